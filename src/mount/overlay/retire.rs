//! Retiring the generations a restore replaced, when the store is quiet.
//!
//! Tearing a generation down is work the user does not wait for, but it is not free:
//! when the last reference to the old overlay goes, the kernel syncs the upper's
//! filesystem (overlayfs's `sync_fs`), the old lower's inodes are evicted (about 200 ms
//! of CPU after a `find` over 100k files) and the old upper is removed. The store lives
//! on that same filesystem, so a checkpoint that runs meanwhile waits in its own
//! `fdatasync` for a journal commit carrying all of that. So a replaced generation is
//! held (an `O_PATH` descriptor keeps its detached overlay alive, and with it its
//! lowers) until no checkpoint or restore of this process has run for [`QUIET`], and
//! torn down then; never later than [`MAX_DEFER`] after it was replaced, nor once more
//! than [`MAX_WAITING`] wait for the same mount (a loop of back-to-back restores pays
//! for the teardown then). Unmounting the mount tears its waiting generations down
//! first.

use crate::sys::Locked;
use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::fs::MountedTree;

/// How long the store must have been idle before a replaced generation is torn down.
pub(super) const QUIET: Duration = Duration::from_millis(250);
/// The longest a replaced generation waits for a quiet store.
pub(super) const MAX_DEFER: Duration = Duration::from_secs(10);
/// The most replaced generations of one mount that wait at a time.
pub(super) const MAX_WAITING: usize = 8;

/// Checkpoints and restores of this process in progress, and when the last one ended
/// (microseconds after [`epoch`]).
static IN_WORK: AtomicUsize = AtomicUsize::new(0);
static LAST_WORK: AtomicU64 = AtomicU64::new(0);

fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

fn now_us() -> u64 {
    epoch().elapsed().as_micros() as u64
}

/// Marks a checkpoint or restore in progress for as long as it lives.
pub(crate) struct Busy(());

impl Busy {
    pub(crate) fn new() -> Busy {
        IN_WORK.fetch_add(1, Ordering::SeqCst);
        LAST_WORK.fetch_max(now_us(), Ordering::SeqCst);
        Busy(())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        LAST_WORK.fetch_max(now_us(), Ordering::SeqCst);
        IN_WORK.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether no checkpoint or restore runs and none ended within [`QUIET`].
fn quiet() -> bool {
    IN_WORK.load(Ordering::SeqCst) == 0
        && now_us().saturating_sub(LAST_WORK.load(Ordering::SeqCst)) >= QUIET.as_micros() as u64
}

/// A replaced generation: its directory, its lower's session and (when it could be
/// opened) a descriptor of its detached overlay's root.
struct Job {
    dir: PathBuf,
    lower: MountedTree,
    held: Option<OwnedFd>,
    since: Instant,
}

impl Job {
    /// Lets the overlay go (the last reference: the kernel shuts it down) and detaches
    /// its lowers; the generation's files are removed once the lower's session has ended,
    /// on a thread of its own: processes still inside the old overlay (a working
    /// directory, an open file) keep it, and its lowers, until they let go.
    fn let_go(self) {
        drop(self.held);
        super::kernel::detach_lowers(&self.dir);
        let (dir, lower) = (self.dir, self.lower);
        let removing = Removing::start();
        let spawned = std::thread::Builder::new()
            .name("casfs-retired".into())
            .spawn(move || {
                let _removing = removing;
                crate::fs::low_priority();
                while !lower.is_finished() {
                    std::thread::sleep(Duration::from_millis(100));
                }
                drop(lower);
                if let Err(e) = crate::sys::dirfd::remove_path(&dir) {
                    tracing::warn!("removing {}: {e}", dir.display());
                }
            });
        if let Err(e) = spawned {
            // Left for the next mount of this mountpoint to remove.
            tracing::warn!("starting a thread to remove a replaced generation: {e}");
        }
    }
}

/// Replaced generations whose files are being removed (their threads running), for an
/// exiting daemon to wait for: a thread cut short by the exit leaves the generation's
/// directory behind until the next mount of the mountpoint.
static REMOVING: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

/// One removal in progress, counted while it lives.
struct Removing(());

impl Removing {
    fn start() -> Removing {
        *REMOVING.0.locked() += 1;
        Removing(())
    }
}

impl Drop for Removing {
    fn drop(&mut self) {
        let mut n = REMOVING.0.locked();
        *n -= 1;
        REMOVING.1.notify_all();
    }
}

/// Waits until no replaced generation of this process is being removed, for at most
/// `limit` (a process still inside an old generation keeps it). Returns whether none is.
pub(super) fn wait_removed(limit: Duration) -> bool {
    let start = Instant::now();
    let mut n = REMOVING.0.locked();
    while *n > 0 {
        let left = limit.saturating_sub(start.elapsed());
        if left.is_zero() {
            return false;
        }
        n = REMOVING
            .1
            .wait_timeout(n, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    true
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Whether a worker thread serves the queue.
    worker: bool,
    /// Tear everything down now (the mount is going).
    hurry: bool,
}

/// One mount's replaced generations waiting to be torn down.
#[derive(Default)]
pub(super) struct Retirements {
    queue: Mutex<Queue>,
    changed: Condvar,
}

impl Retirements {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.locked()
    }

    /// Queues the generation in `dir` (its overlay held by `held`) for teardown.
    pub(super) fn retire(
        self: &Arc<Self>,
        dir: PathBuf,
        lower: MountedTree,
        held: Option<OwnedFd>,
    ) {
        let job = Job {
            dir,
            lower,
            held,
            since: Instant::now(),
        };
        let mut q = self.lock();
        q.jobs.push_back(job);
        self.changed.notify_all();
        if q.worker {
            return;
        }
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("casfs-retire".into())
            .spawn(move || me.serve());
        match spawned {
            Ok(_) => q.worker = true,
            Err(e) => {
                tracing::warn!("starting a retire thread: {e}; retiring at once");
                let jobs: Vec<Job> = q.jobs.drain(..).collect();
                drop(q);
                jobs.into_iter().for_each(Job::let_go);
            }
        }
    }

    /// The worker: takes the oldest generation once it may go, until none waits.
    fn serve(&self) {
        crate::fs::low_priority();
        loop {
            let job = {
                let mut q = self.lock();
                loop {
                    let Some(first) = q.jobs.front() else {
                        q.worker = false;
                        self.changed.notify_all();
                        return;
                    };
                    if q.hurry
                        || q.jobs.len() > MAX_WAITING
                        || first.since.elapsed() >= MAX_DEFER
                        || quiet()
                    {
                        break;
                    }
                    q = self
                        .changed
                        .wait_timeout(q, Duration::from_millis(20))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                q.jobs.pop_front().expect("a job is queued")
            };
            job.let_go();
        }
    }

    /// Lets every waiting generation go now; returns once none waits (their files are
    /// removed in the background as their users let go).
    pub(super) fn flush(&self) {
        let mut q = self.lock();
        q.hurry = true;
        self.changed.notify_all();
        while q.worker || !q.jobs.is_empty() {
            if !q.worker {
                // No worker (it could not start): tear down here.
                let jobs: Vec<Job> = q.jobs.drain(..).collect();
                drop(q);
                jobs.into_iter().for_each(Job::let_go);
                q = self.lock();
                continue;
            }
            q = self.changed.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        q.hurry = false;
    }
}

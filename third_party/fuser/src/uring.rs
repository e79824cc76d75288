//! FUSE over io_uring (casfs patch 0005): requests and replies through per-CPU ring
//! queues instead of `read`/`writev` on `/dev/fuse`.
//!
//! The kernel (Linux >= 6.14, `CONFIG_FUSE_IO_URING`, module parameter `enable_uring`)
//! offers `FUSE_OVER_IO_URING` in INIT when it can; a filesystem that wants the ring
//! adds that capability in `Filesystem::init`, and the session then starts one thread
//! per possible CPU, each with an io_uring of 128-byte SQEs, pinned to its CPU. Each
//! thread registers `DEPTH` entries with its queue (`FUSE_IO_URING_CMD_REGISTER`: an
//! iovec of a 288-byte header and a payload buffer of the connection's largest
//! request); the kernel hands a request to an entry of the queue of the CPU its caller
//! runs on, which completes that entry's command. The thread rebuilds the request as
//! `/dev/fuse` would have delivered it (`fuse_in_header`, the op header the kernel put
//! in the entry's header, then the payload, laid out in front of the payload in place:
//! nothing of the payload is copied), dispatches it to the same handlers as the classic
//! loop, and sends the reply with `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`, which also
//! returns the entry to the queue.
//!
//! A ring thread waits for requests at `SCHED_IDLE` (casfs patch 0006), where the
//! kernel lets it: the commit that answers a caller wakes it, and the scheduler keeps a
//! woken task on the waker's CPU only when that CPU runs nothing but idle-policy tasks.
//! Otherwise it moves the caller to an idle CPU, which on a virtual machine means waking
//! a halted virtual CPU: two to three times the round trip (30 against 10 us measured).
//! An idle-policy thread is preempted by the caller it wakes, so the caller goes on at
//! once on its own CPU and its next request goes to the same queue. Requests whose
//! handlers may work long (opening or reading file data, writes, syncs, a truncate) are
//! served at the normal policy, so that CPU-bound neighbours do not slow them.
//!
//! A reply sent from another thread (a handler that answers later) is queued for the
//! ring's thread, which an eventfd read in the same ring wakes. Forgets, interrupts and
//! notifications stay on `/dev/fuse` (the kernel sends them there), so the classic loop
//! keeps running beside the rings. If registration fails, the kernel turns the ring off
//! for the connection and requests keep coming through `/dev/fuse`.

use std::io;
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::thread::ThreadId;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::debug;
use log::error;
use log::warn;

use crate::Filesystem;
use crate::channel::ChannelSender;
use crate::ll::Operation;
use crate::reply::Reply;
use crate::reply::ReplyEmpty;
use crate::reply::ReplySender;
use crate::request::RequestWithSender;
use crate::session::SessionEventLoop;

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// `sizeof(struct fuse_in_header)`, `sizeof(struct fuse_out_header)`.
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
/// The op header area of an entry's header (`FUSE_URING_OP_IN_OUT_SZ`).
const OP_IN_MAX: usize = 128;
/// Bytes in front of an entry's payload: room to rebuild the request's headers there.
const PREFIX: usize = 4096;
/// Entries registered per queue: requests the kernel can hand one queue at once.
const DEPTH: usize = 4;
/// The user data of the eventfd read that wakes a ring for replies from elsewhere.
const WAKE: u64 = u64::MAX;

/// `struct fuse_uring_req_header`.
#[repr(C)]
struct ReqHeader {
    in_out: [u8; 128],
    op_in: [u8; OP_IN_MAX],
    flags: u64,
    commit_id: u64,
    payload_sz: u32,
    padding: u32,
    reserved: u64,
}

/// `struct fuse_uring_cmd_req`, in the SQE's 80-byte command area.
fn cmd_req(commit_id: u64, qid: u16) -> [u8; 80] {
    let mut c = [0u8; 80];
    c[8..16].copy_from_slice(&commit_id.to_le_bytes());
    c[16..18].copy_from_slice(&qid.to_le_bytes());
    c
}

/// The ring state the session shares with whoever asks which transport serves it.
#[derive(Debug, Default)]
pub(crate) struct UringState {
    /// Queues whose entries the kernel accepted.
    pub(crate) registered: AtomicUsize,
    pub(crate) queues: AtomicUsize,
    /// casfs patch 0008: set (under `wakes`' lock) when the connection is gone and a
    /// ring thread still waits (`stop`).
    stopping: std::sync::atomic::AtomicBool,
    /// casfs patch 0008: each ring thread's wake eventfd, while the thread has it.
    wakes: Mutex<Vec<std::sync::Weak<OwnedFd>>>,
}

impl UringState {
    /// casfs patch 0008: the connection was torn down but a ring thread still waits:
    /// the kernel did not end its entries (an entry registered while the connection
    /// was being torn down is never completed, a race fixed in later kernels). Every
    /// ring thread still running is woken and stops; one not yet started stops at its
    /// start.
    pub(crate) fn stop(&self) {
        let wakes = self.wakes.lock().unwrap_or_else(|p| p.into_inner());
        self.stopping.store(true, Ordering::SeqCst);
        let one = 1u64.to_ne_bytes();
        for w in wakes.iter().filter_map(std::sync::Weak::upgrade) {
            // SAFETY: an 8-byte write to an eventfd held open here.
            unsafe { libc::write(w.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }

    /// Whether every queue is registered (the kernel then sends requests to the rings).
    pub(crate) fn active(&self) -> bool {
        let q = self.queues.load(Ordering::Relaxed);
        q > 0 && self.registered.load(Ordering::Relaxed) == q
    }
}

/// Replies waiting for their ring's thread to commit them: (entry, reply bytes).
struct Replies {
    queue: Mutex<Vec<(u16, Vec<u8>)>>,
    wake: Arc<OwnedFd>,
    owner: ThreadId,
}

/// The sender of one ring entry's reply.
#[derive(Clone)]
pub(crate) struct UringSender {
    replies: Arc<Replies>,
    entry: u16,
    /// `/dev/fuse`, for passthrough backing ids.
    pub(crate) channel: ChannelSender,
}

impl std::fmt::Debug for UringSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UringSender(entry {})", self.entry)
    }
}

impl UringSender {
    pub(crate) fn send(&self, data: &[IoSlice<'_>]) -> io::Result<()> {
        let mut v = Vec::with_capacity(data.iter().map(|d| d.len()).sum());
        for d in data {
            v.extend_from_slice(d);
        }
        if v.len() < OUT_HEADER {
            return Err(io::Error::other("a FUSE reply shorter than its header"));
        }
        self.replies
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((self.entry, v));
        if std::thread::current().id() != self.replies.owner {
            let one = 1u64.to_ne_bytes();
            // SAFETY: an 8-byte write to an eventfd this value keeps open.
            unsafe { libc::write(self.replies.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
        Ok(())
    }
}

/// An anonymous mapping, resident only where touched.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> io::Result<Mapping> {
        // SAFETY: an anonymous private mapping; no file, no fixed address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p.cast()).expect("mmap does not return null on success"),
            len,
        })
    }

    /// casfs patch 0008: its pages given back, its addresses kept reserved (the kernel
    /// may still name them), and never unmapped.
    fn abandon(self) {
        // SAFETY: replaces this mapping's own range with an inaccessible one of the
        // same size; nothing of this process uses it any more.
        unsafe {
            libc::mmap(
                self.ptr.as_ptr().cast(),
                self.len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        std::mem::forget(self);
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// One registered entry: its header, its buffer (prefix, then payload) and the iovec
/// the kernel was given. Boxed or mapped: their addresses never move.
struct Entry {
    header: Box<ReqHeader>,
    buf: Mapping,
    iov: Box<[libc::iovec; 2]>,
}

/// Parameters of the rings, from INIT.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UringParams {
    /// The largest payload the kernel may put in an entry (it refuses smaller buffers).
    pub(crate) max_payload: usize,
}

/// CPUs the kernel may run a caller on: one queue each (`num_possible_cpus`).
pub(crate) fn possible_cpus() -> usize {
    let Ok(s) = std::fs::read_to_string("/sys/devices/system/cpu/possible") else {
        return std::thread::available_parallelism().map_or(1, |n| n.get());
    };
    let mut max = 0;
    for part in s.trim().split(',') {
        let last = part.rsplit('-').next().unwrap_or("0");
        max = max.max(last.parse::<usize>().unwrap_or(0));
    }
    max + 1
}

/// Whether ring threads may wait at `SCHED_IDLE`: only where a thread can also go back
/// to the normal policy (root, or an `RLIMIT_NICE` that allows nice 0), tried once on a
/// thread of its own so that a refusal leaves no serving thread stuck at idle.
fn idle_waits_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| {
        std::thread::Builder::new()
            .name("fuser-policy".into())
            .spawn(|| set_idle(true) && set_idle(false))
            .ok()
            .and_then(|t| t.join().ok())
            .unwrap_or(false)
    })
}

/// Sets the calling thread's policy to `SCHED_IDLE` or back to `SCHED_OTHER`.
fn set_idle(idle: bool) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = if idle {
        libc::SCHED_IDLE
    } else {
        libc::SCHED_OTHER
    };
    // SAFETY: a plain parameter block for the calling thread.
    unsafe { libc::sched_setscheduler(0, policy, &param) == 0 }
}

/// Requests whose handlers may work long enough for their priority to matter: file
/// data opened, read, written or synced, space allocated, a file truncated. The rest
/// (lookups, attributes, creates, links, listings of loaded directories) answer in
/// microseconds and stay at idle.
fn works_long(op: &Operation<'_>) -> bool {
    match op {
        Operation::Open(_)
        | Operation::Read(_)
        | Operation::Write(_)
        | Operation::FSync(_)
        | Operation::FSyncDir(_)
        | Operation::FAllocate(_)
        | Operation::CopyFileRange(_) => true,
        Operation::SetAttr(a) => a.size().is_some(),
        _ => false,
    }
}

fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t with one bit set, for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            debug!(
                "fuse ring {cpu}: not pinned: {}",
                io::Error::last_os_error()
            );
        }
    }
}

/// A REGISTER SQE: the command, and `addr`/`len` naming the entry's two iovecs (the
/// io-uring crate's `UringCmd80` sets no `len`).
fn register_sqe(fd: RawFd, qid: u16, e: &Entry, index: u16) -> squeue::Entry128 {
    let sqe = opcode::UringCmd80::new(types::Fd(fd), CMD_REGISTER)
        .cmd(cmd_req(0, qid))
        .addr(Some(e.iov.as_ptr() as u64))
        .build()
        .user_data(index as u64);
    // SAFETY: `Entry128` is `#[repr(C)]` over the 64-byte `io_uring_sqe` and 64 more
    // bytes: 128 bytes of plain data. `len` is the u32 at offset 24 of the SQE.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
    raw[24..28].copy_from_slice(&2u32.to_ne_bytes());
    // SAFETY: as above, back again.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

fn commit_sqe(fd: RawFd, qid: u16, commit_id: u64, index: u16) -> squeue::Entry128 {
    opcode::UringCmd80::new(types::Fd(fd), CMD_COMMIT_AND_FETCH)
        .cmd(cmd_req(commit_id, qid))
        .build()
        .user_data(index as u64)
}

/// Puts every reply there is (this thread's and others') into its entry and queues its
/// `COMMIT_AND_FETCH` (submitted with the next `submit`).
fn commit_ready(
    ring: &mut IoUring<squeue::Entry128, cqueue::Entry>,
    entries: &mut [Entry],
    replies: &Replies,
    fd: RawFd,
    qid: u16,
    payload_len: usize,
) -> io::Result<()> {
    let ready: Vec<(u16, Vec<u8>)> =
        std::mem::take(&mut *replies.queue.lock().unwrap_or_else(|p| p.into_inner()));
    for (index, reply) in ready {
        let e = &mut entries[index as usize];
        let body = &reply[OUT_HEADER..];
        if body.len() > payload_len {
            error!("fuse ring {qid}: a reply of {} bytes", body.len());
            continue;
        }
        e.header.in_out[..OUT_HEADER].copy_from_slice(&reply[..OUT_HEADER]);
        e.header.payload_sz = body.len() as u32;
        // SAFETY: the entry's payload area; its request was dispatched.
        unsafe {
            std::ptr::copy_nonoverlapping(body.as_ptr(), e.buf.ptr.as_ptr().add(PREFIX), body.len());
        }
        let unique = u64::from_le_bytes(reply[8..16].try_into().expect("8 bytes"));
        // SAFETY: the entry's memory outlives the ring.
        unsafe {
            if ring
                .submission()
                .push(&commit_sqe(fd, qid, unique, index))
                .is_err()
            {
                ring.submit()?;
                let _ = ring.submission().push(&commit_sqe(fd, qid, unique, index));
            }
        }
    }
    Ok(())
}

/// Requests nobody waits for (the kernel sends a release in the background after the
/// last close): served after the others of the same wake, once those are answered.
fn waits_for_nobody(e: &Entry) -> bool {
    const FUSE_RELEASE: u32 = 18;
    const FUSE_RELEASEDIR: u32 = 29;
    let op = u32::from_le_bytes(e.header.in_out[4..8].try_into().expect("4 bytes"));
    op == FUSE_RELEASE || op == FUSE_RELEASEDIR
}

/// Serves queue `qid` until the connection ends.
pub(crate) fn serve_queue<FS: Filesystem>(
    qid: u16,
    params: UringParams,
    se: &SessionEventLoop<FS>,
    channel: ChannelSender,
    state: &UringState,
) -> io::Result<()> {
    pin_to(qid as usize);
    let fd = channel.raw_fd();
    // One thread submits and waits (single issuer), and the kernel's work of handing
    // it a request runs when it waits (deferred task work): with `COOP_TASKRUN`
    // instead, task work added while it slept did not wake it, and a request could
    // wait forever.
    let mut ring: IoUring<squeue::Entry128, cqueue::Entry> = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build((DEPTH as u32 + 1).next_power_of_two())?;
    // SAFETY: a new eventfd, owned from here on.
    let wake = Arc::new(unsafe {
        let f = libc::eventfd(0, libc::EFD_CLOEXEC);
        if f < 0 {
            return Err(io::Error::last_os_error());
        }
        OwnedFd::from_raw_fd(f)
    });
    {
        let mut wakes = state.wakes.lock().unwrap_or_else(|p| p.into_inner());
        if state.stopping.load(Ordering::SeqCst) {
            // casfs patch 0008: the session gave up on the rings before this one began.
            return Ok(());
        }
        wakes.retain(|w| w.strong_count() > 0);
        wakes.push(Arc::downgrade(&wake));
    }
    let replies = Arc::new(Replies {
        queue: Mutex::new(Vec::new()),
        wake,
        owner: std::thread::current().id(),
    });
    let payload_len = params.max_payload.div_ceil(4096) * 4096;
    let mut entries = Vec::with_capacity(DEPTH);
    for _ in 0..DEPTH {
        let header = Box::new(ReqHeader {
            in_out: [0; 128],
            op_in: [0; OP_IN_MAX],
            flags: 0,
            commit_id: 0,
            payload_sz: 0,
            padding: 0,
            reserved: 0,
        });
        let buf = Mapping::new(PREFIX + payload_len)?;
        let iov = Box::new([
            libc::iovec {
                iov_base: (&*header as *const ReqHeader).cast_mut().cast(),
                iov_len: std::mem::size_of::<ReqHeader>(),
            },
            libc::iovec {
                // SAFETY: within the mapping.
                iov_base: unsafe { buf.ptr.as_ptr().add(PREFIX) }.cast(),
                iov_len: payload_len,
            },
        ]);
        entries.push(Entry { header, buf, iov });
    }
    let mut wake_buf = Box::new([0u8; 8]);
    let wake_sqe = |b: &mut [u8; 8]| {
        squeue::Entry128::from(
            opcode::Read::new(types::Fd(replies.wake.as_raw_fd()), b.as_mut_ptr(), 8)
                .build()
                .user_data(WAKE),
        )
    };
    // SAFETY: every SQE names memory that lives as long as `entries` and `wake_buf`,
    // which outlive the ring (dropped after it, below).
    unsafe {
        let mut sq = ring.submission();
        for (i, e) in entries.iter().enumerate() {
            sq.push(&register_sqe(fd, qid, e, i as u16))
                .map_err(|_| io::Error::other("fuse ring: submission queue full"))?;
        }
        sq.push(&wake_sqe(&mut wake_buf))
            .map_err(|_| io::Error::other("fuse ring: submission queue full"))?;
    }
    ring.submit()?;
    // A refused registration completes at once; an accepted one when a request comes.
    let mut refused = None;
    for cqe in ring.completion() {
        if cqe.user_data() != WAKE && cqe.result() < 0 {
            refused = Some(io::Error::from_raw_os_error(-cqe.result()));
        }
    }
    if let Some(e) = refused {
        warn!("fuse ring {qid}: registration refused ({e}); serving through /dev/fuse");
        drop(ring);
        return Ok(());
    }
    state.registered.fetch_add(1, Ordering::Relaxed);
    debug!("fuse ring {qid}: {DEPTH} entries of {payload_len} bytes registered");

    let idle_waits = idle_waits_allowed();
    // casfs patch 0008: stopped by the session (`UringState::stop`), with entries the
    // kernel may still hold.
    let mut abandoned = false;
    let result = (|| -> io::Result<()> {
        let mut done = Vec::new();
        // The thread's policy: idle while it commits and waits, where allowed.
        let mut idle = false;
        loop {
            if idle_waits && !idle {
                idle = set_idle(true);
            }
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
            done.clear();
            // Requests a caller waits for first; then, with their answers on their way
            // (the callers, woken, preempt this idle-policy thread), the releases.
            for c in ring.completion() {
                let (ud, res) = (c.user_data(), c.result());
                let later = ud != WAKE
                    && res >= 0
                    && entries
                        .get(ud as usize)
                        .is_some_and(waits_for_nobody);
                done.push((later, ud, res));
            }
            done.sort_by_key(|d| d.0);
            let mut stop = false;
            let mut answered = false;
            for &(later, ud, res) in &done {
                if later && !answered {
                    answered = true;
                    commit_ready(&mut ring, &mut entries, &replies, fd, qid, payload_len)?;
                    ring.submit()?;
                }
                if ud == WAKE {
                    if state.stopping.load(Ordering::SeqCst) {
                        abandoned = true;
                        stop = true;
                        continue;
                    }
                    // SAFETY: as above; re-armed for the next reply from elsewhere.
                    unsafe {
                        let _ = ring.submission().push(&wake_sqe(&mut wake_buf));
                    }
                    continue;
                }
                if res < 0 {
                    let err = -res;
                    if err == libc::ENOTCONN || err == libc::ECANCELED || err == libc::ENODEV {
                        stop = true;
                        continue;
                    }
                    error!(
                        "fuse ring {qid}: entry {ud}: {}",
                        io::Error::from_raw_os_error(err)
                    );
                    stop = true;
                    continue;
                }
                let index = ud as u16;
                let e = &mut entries[index as usize];
                let in_header = &e.header.in_out[..IN_HEADER];
                let len = u32::from_le_bytes(in_header[..4].try_into().expect("4 bytes")) as usize;
                let payload = e.header.payload_sz as usize;
                let Some(op_len) = len
                    .checked_sub(IN_HEADER + payload)
                    .filter(|n| *n <= OP_IN_MAX && payload <= payload_len)
                else {
                    error!("fuse ring {qid}: a request of {len} bytes with {payload} of payload");
                    stop = true;
                    continue;
                };
                let start = PREFIX - op_len - IN_HEADER;
                // SAFETY: the entry's buffer, PREFIX + payload_len bytes, which the kernel
                // wrote (payload) and no one else touches until this entry is committed.
                let buf = unsafe {
                    std::slice::from_raw_parts_mut(e.buf.ptr.as_ptr(), PREFIX + payload_len)
                };
                buf[start..start + IN_HEADER].copy_from_slice(in_header);
                buf[PREFIX - op_len..PREFIX].copy_from_slice(&e.header.op_in[..op_len]);
                let sender = UringSender {
                    replies: replies.clone(),
                    entry: index,
                    channel: channel.clone(),
                };
                let data = &buf[start..PREFIX + payload];
                match RequestWithSender::new_uring(sender, data) {
                    Some(req) => {
                        let op = req.request.operation();
                        if let Ok(Operation::Destroy(_)) = op {
                            req.reply::<ReplyEmpty>().ok();
                            stop = true;
                        } else {
                            if idle && op.as_ref().is_ok_and(works_long) && set_idle(false) {
                                idle = false;
                            }
                            req.dispatch(se);
                        }
                    }
                    None => {
                        // Unparsable: answer EIO so the caller does not hang.
                        let r: crate::reply::ReplyRaw = Reply::new(
                            crate::ll::RequestId(e.header.commit_id),
                            ReplySender::Uring(UringSender {
                                replies: replies.clone(),
                                entry: index,
                                channel: channel.clone(),
                            }),
                        );
                        r.send_ll(&crate::ll::ResponseErrno(crate::ll::Errno::EIO));
                    }
                }
            }
            commit_ready(&mut ring, &mut entries, &replies, fd, qid, payload_len)?;
            if stop {
                return Ok(());
            }
        }
    })();
    state.registered.fetch_sub(1, Ordering::Relaxed);
    // The ring goes before the memory its commands named.
    drop(ring);
    if abandoned {
        // casfs patch 0008: the kernel may still hold entries naming this memory (it
        // will never write there: the connection is gone); its addresses are never
        // reused.
        warn!("fuse ring {qid}: stopped with entries the kernel did not end");
        for e in entries {
            e.buf.abandon();
            // The header and iovec boxes the kernel was given stay allocated.
            std::mem::forget((e.header, e.iov));
        }
    } else {
        drop(entries);
    }
    drop(wake_buf);
    result
}

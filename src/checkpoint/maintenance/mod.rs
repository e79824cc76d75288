//! Store maintenance: retention (`prune`), garbage collection (`gc`) and the
//! consistency check (`fsck`).
//!
//! What is live: every checkpoint record that retention kept (heads always), every
//! mount's dirty set (its base tree, its node records' trees and files, its upper
//! files) and the directory cache's trees. A collection marks all of it and sweeps the
//! rest while holding the object store's fence, so no capture is between putting its
//! objects and appending the checkpoint that names them (see `cas::gc`). Retention
//! holds the fence too: a restore that has read a checkpoint finishes before the
//! checkpoint can go.

mod fsck;
mod live;

pub use fsck::{fsck, FsckReport};

use live::{fence, mount_checkpoints, stale_dircache, walk, Walk};

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use crate::cas::fence::Collecting;
use crate::cas::remote_store::{RemoteGcOptions, RemoteGcReport, RemoteObjectStore};
use crate::cas::SweepReport;
use crate::checkpoint::ids::{CheckpointError, CheckpointId, CheckpointResult, ThreadId};
use crate::checkpoint::lease::millis;
use crate::checkpoint::store::Store;

/// Which checkpoints retention keeps (besides every thread's head).
#[derive(Debug, Clone, Default)]
pub struct Retention {
    /// The newest N of each thread (following parents from the head).
    pub keep_last: Option<usize>,
    /// Those created within this long of now.
    pub keep_within: Option<Duration>,
    /// Only this thread's checkpoints are considered.
    pub thread: Option<ThreadId>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PruneReport {
    pub dry_run: bool,
    pub threads: usize,
    pub kept: usize,
    pub pruned: usize,
    /// The removed (or, dry, removable) checkpoints.
    pub pruned_ids: Vec<CheckpointId>,
}

/// Removes the checkpoint records `r` does not keep. Heads, and checkpoints a mount is
/// based on (on any host of a fleet: see [`CheckpointStore::pin`]), are always kept.
/// Their objects stay until a `gc`.
///
/// [`CheckpointStore::pin`]: crate::checkpoint::CheckpointStore::pin
pub fn prune(store: &Store, r: &Retention, dry_run: bool) -> CheckpointResult<PruneReport> {
    if r.keep_last.is_none() && r.keep_within.is_none() {
        return Err(CheckpointError::Invalid(
            "prune needs --keep-last and/or --keep-within (heads are always kept)".into(),
        ));
    }
    let _fence = fence(store)?;
    let cps = store.checkpoints();
    let now = millis(SystemTime::now());
    let cutoff = r
        .keep_within
        .map(|d| now.saturating_sub(d.as_millis() as u64));
    let mut by_thread: BTreeMap<ThreadId, Vec<super::record::Checkpoint>> = BTreeMap::new();
    for (_, rec) in cps.all_records()? {
        // A record that does not decode is fsck's business; retention leaves it alone.
        if let Ok(cp) = rec {
            if r.thread.as_ref().is_none_or(|t| *t == cp.body.thread_id) {
                by_thread
                    .entry(cp.body.thread_id.clone())
                    .or_default()
                    .push(cp);
            }
        }
    }
    let pinned = mount_checkpoints(store)?;
    let heads: BTreeMap<ThreadId, CheckpointId> =
        store.checkpoints().threads()?.into_iter().collect();
    let mut doomed = Vec::new();
    let mut kept = 0;
    for (thread, records) in &by_thread {
        // Rank by distance from the head along parents; records off that line (none
        // normally) rank after every one on it.
        let index: BTreeMap<CheckpointId, &super::record::Checkpoint> =
            records.iter().map(|c| (c.id, c)).collect();
        let mut rank: BTreeMap<CheckpointId, usize> = BTreeMap::new();
        let mut next = heads.get(thread).copied();
        while let Some(id) = next {
            let Some(cp) = index.get(&id) else { break };
            if rank.insert(id, rank.len()).is_some() {
                break;
            }
            next = cp.body.parent_id;
        }
        for cp in records {
            let keep = heads.get(thread) == Some(&cp.id)
                || pinned.contains(&cp.id)
                || r.keep_last
                    .is_some_and(|n| rank.get(&cp.id).is_some_and(|&i| i < n))
                || cutoff.is_some_and(|c| cp.body.created_at_ms >= c);
            if keep {
                kept += 1;
            } else {
                doomed.push((cp.id, thread.clone()));
            }
        }
    }
    let pruned = if dry_run {
        doomed.len()
    } else {
        cps.remove_records(&doomed)?
    };
    Ok(PruneReport {
        dry_run,
        threads: by_thread.len(),
        kept: kept + doomed.len() - pruned,
        pruned,
        pruned_ids: doomed.into_iter().map(|(id, _)| id).collect(),
    })
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GcReport {
    pub dry_run: bool,
    /// With fleet objects: what the collection of the remote's packs did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteGcReport>,
    pub checkpoints: usize,
    pub mounts: usize,
    pub dircache_dirs: usize,
    /// Objects reachable from those roots.
    pub reachable: u64,
    pub sweep: SweepReport,
    /// Cached directories dropped because they named objects nothing live keeps.
    pub dircache_dropped: usize,
    /// Bytes of the store's database files before and after.
    pub disk_bytes_before: u64,
    pub disk_bytes_after: u64,
    pub duration_ms: u64,
    /// How long writers (captures, checkpoints, restores) were held off: the mark and
    /// the deletes, not the compaction.
    pub fenced_ms: u64,
}

/// Bytes of the files directly in `dir` (RocksDB keeps its files flat).
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Marks everything live and deletes (or, dry, counts) every other object. Refuses to
/// sweep when a live tree or chunk list cannot be read: what it names is unknown, and
/// `casfs fsck` should look first.
pub fn gc(store: &Store, dry_run: bool) -> CheckpointResult<GcReport> {
    gc_with(
        store,
        &RemoteGcOptions {
            dry_run,
            ..RemoteGcOptions::default()
        },
    )
}

/// The thread whose writer lease a collection of fleet objects holds: one collection
/// at a time across every host.
pub const GC_THREAD: &str = "casfs-gc";

/// A collection's first step: the fence taken (and when), and every live object
/// marked; a live object that cannot be read stops it, the error ending with `then`.
fn fence_and_mark<'a>(
    store: &'a Store,
    then: &str,
) -> CheckpointResult<(Collecting<'a>, Instant, Walk<'a>)> {
    let collecting = fence(store)?;
    let fenced = Instant::now();
    let w = walk(store, false)?;
    crate::crashpoint("gc.marked");
    if let Some(p) = w.problems.first() {
        return Err(CheckpointError::Invalid(format!(
            "gc stopped before sweeping: {} live object(s) cannot be read, first: {p}; {then}",
            w.problems.len()
        )));
    }
    Ok((collecting, fenced, w))
}

/// [`gc`], with how packs of fleet objects are collected (`o.dry_run` is the run's).
/// With fleet objects the remote's packs are collected ([`RemoteObjectStore::collect`])
/// from the live set of every checkpoint record (PostgreSQL's with fleet checkpoints)
/// and every local mount, under the [`GC_THREAD`] lease; the local cache of objects is
/// left as it is.
pub fn gc_with(store: &Store, o: &RemoteGcOptions) -> CheckpointResult<GcReport> {
    let dry_run = o.dry_run;
    if let Some(remote) = store.remote() {
        return gc_remote(store, remote, o);
    }
    let start = Instant::now();
    let db_dir = store.root().join("db");
    let before = dir_bytes(&db_dir);
    let (collecting, fenced, w) = fence_and_mark(store, "run `casfs fsck`")?;
    let reachable = w.marker.marked().len() as u64;
    let marked = w.marker.into_marked();
    let (dircache_dirs, dircache_dropped, _) = stale_dircache(store, &marked, !dry_run)?;
    let sweep = store.local_objects().sweep(&marked, &collecting, dry_run)?;
    // Writers may go on: giving the space back (a compaction) needs no fence.
    drop(collecting);
    let fenced_ms = fenced.elapsed().as_millis() as u64;
    if !dry_run && sweep.objects_freed > 0 {
        store.local_objects().reclaim()?;
    }
    Ok(GcReport {
        dry_run,
        remote: None,
        checkpoints: w.checkpoints,
        mounts: w.mounts,
        dircache_dirs,
        reachable,
        sweep,
        dircache_dropped,
        disk_bytes_before: before,
        disk_bytes_after: dir_bytes(&db_dir),
        duration_ms: start.elapsed().as_millis() as u64,
        fenced_ms,
    })
}

fn gc_remote(
    store: &Store,
    remote: &RemoteObjectStore,
    o: &RemoteGcOptions,
) -> CheckpointResult<GcReport> {
    let start = Instant::now();
    let thread = ThreadId::new(GC_THREAD)?;
    let lease = store.checkpoints().acquire_writer(
        &thread,
        &super::lease::holder_name("gc"),
        Duration::from_secs(600),
    )?;
    let out = (|| {
        let (collecting, fenced, w) = fence_and_mark(store, "nothing was deleted")?;
        let (checkpoints, mounts) = (w.checkpoints, w.mounts);
        let marked = w.marker.into_marked();
        let rep = remote.collect(&marked, o)?;
        drop(collecting);
        Ok(GcReport {
            dry_run: o.dry_run,
            checkpoints,
            mounts,
            dircache_dirs: 0,
            reachable: marked.len() as u64,
            sweep: SweepReport::default(),
            dircache_dropped: 0,
            disk_bytes_before: 0,
            disk_bytes_after: 0,
            duration_ms: start.elapsed().as_millis() as u64,
            fenced_ms: fenced.elapsed().as_millis() as u64,
            remote: Some(rep),
        })
    })();
    if let Err(e) = store.checkpoints().release(&lease) {
        tracing::warn!("releasing the gc lease: {e}");
    }
    out
}

/// A maintenance operation on the whole store.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "what", rename_all = "lowercase")]
pub enum MaintainOp {
    Gc {
        #[serde(default)]
        dry_run: bool,
        /// Fleet objects: the grace period of packs (seconds; default an hour).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        grace_secs: Option<u64>,
        /// Fleet objects: the dead fraction of a pack above which it is rewritten
        /// (default 0.1).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_unused: Option<f64>,
    },
    Prune {
        #[serde(default)]
        keep_last: Option<usize>,
        #[serde(default)]
        keep_within_ms: Option<u64>,
        #[serde(default)]
        thread: Option<String>,
        #[serde(default)]
        dry_run: bool,
        /// Collect garbage afterwards.
        #[serde(default)]
        gc: bool,
    },
    Fsck {
        #[serde(default)]
        repair: bool,
    },
}

/// What a [`MaintainOp`] did: its report (prune with gc: both).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MaintainReport {
    Prune {
        prune: PruneReport,
        gc: Option<GcReport>,
    },
    Gc(GcReport),
    Fsck(FsckReport),
}

impl MaintainOp {
    /// Runs the operation on `store`; `live` names the mounts this process serves.
    pub fn run(
        &self,
        store: &Store,
        live: &std::collections::HashSet<[u8; 8]>,
    ) -> CheckpointResult<MaintainReport> {
        Ok(match self {
            MaintainOp::Gc {
                dry_run,
                grace_secs,
                max_unused,
            } => {
                let d = RemoteGcOptions::default();
                let o = RemoteGcOptions {
                    dry_run: *dry_run,
                    grace: grace_secs.map(Duration::from_secs).unwrap_or(d.grace),
                    max_unused: match max_unused {
                        Some(m) if (0.0..=1.0).contains(m) => *m,
                        Some(m) => {
                            return Err(CheckpointError::Invalid(format!(
                                "gc: max_unused {m} is not a fraction from 0 to 1"
                            )))
                        }
                        None => d.max_unused,
                    },
                };
                MaintainReport::Gc(gc_with(store, &o)?)
            }
            MaintainOp::Prune {
                keep_last,
                keep_within_ms,
                thread,
                dry_run,
                gc: then_gc,
            } => {
                let r = Retention {
                    keep_last: *keep_last,
                    keep_within: keep_within_ms.map(Duration::from_millis),
                    thread: thread.as_deref().map(ThreadId::new).transpose()?,
                };
                let p = prune(store, &r, *dry_run)?;
                let g = if *then_gc {
                    Some(gc(store, *dry_run)?)
                } else {
                    None
                };
                MaintainReport::Prune { prune: p, gc: g }
            }
            MaintainOp::Fsck { repair } => MaintainReport::Fsck(fsck(store, *repair, live)?),
        })
    }
}

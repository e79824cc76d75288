//! A checkpoint of an overlay mount: the merged tree from what the upper's watch saw
//! change, the reads noted since the last one, and what the mount records once a
//! checkpoint names the tree.

use std::collections::{HashMap, HashSet};

use crate::cas::TreeId;
use crate::checkpoint::{CheckpointError, CheckpointResult, MountTag};
use crate::fs::{SnapshotFilter, SnapshotStats};

use super::state::{tree_of, Capture, OverlayMount};
use super::upper::{
    is_dir, mark_in_checkpoint, merge_listings, split_rel, Listings, Reuse, UpperCapture,
};
use super::watch;

impl OverlayMount {
    /// The tree of the merged workspace, its objects stored (named by nothing until a
    /// checkpoint names them), and what to record once a checkpoint names it. Only the
    /// entries the upper's watch saw change, and the directories above them, are
    /// looked at.
    pub(crate) fn snapshot(
        &self,
        filter: Option<&dyn SnapshotFilter>,
    ) -> CheckpointResult<(TreeId, SnapshotStats, Capture)> {
        let (upper, lower_root, generation, base, dev) = {
            let st = self.layers();
            let dev = st.dev();
            (
                self.upper(&st),
                st.lower_root,
                st.generation,
                st.tag.base,
                dev,
            )
        };
        let memo = self.memo();
        let t0 = std::time::Instant::now();
        let changed = memo
            .watch
            .as_ref()
            .map(|w| w.changed(&self.mountpoint, dev, self.writers_scope()));
        let t_changed = t0.elapsed();
        let visit = changed
            .as_ref()
            .and_then(|c| c.dirs.as_ref())
            .map(watch::visits);
        let mut cap = UpperCapture {
            objects: self.store.objects(),
            lower_root,
            filter,
            cache: &self.cache,
            stats: SnapshotStats::default(),
            kept_back: Vec::new(),
            reuse: visit.as_ref().map(|visit| Reuse {
                visit,
                trees: &memo.trees,
            }),
            listings: HashMap::new(),
            partial: HashMap::new(),
            trees: HashMap::new(),
            hashed: Vec::new(),
            prefix: self.prefix(),
        };
        let root = cap.dir(&upper, "", Some(lower_root))?.ok_or_else(|| {
            CheckpointError::Invalid(format!("{}: the upper is gone", upper.display()))
        })?;
        let full = cap.reuse.is_none();
        let t_captured = t0.elapsed();
        let mut stats = std::mem::take(&mut cap.stats);
        // What changed is told against the last checkpoint (what the upper holds is
        // against the lower, which a checkpoint does not move).
        let previous = match base {
            Some(b) => Some(self.store.checkpoints().get(&b)?.body.root),
            None => None,
        };
        stats.changed_paths.clear();
        stats.removed_paths.clear();
        stats.dirs_written = 0;
        crate::cas::paths_between(
            self.store.objects(),
            previous,
            root,
            "",
            &mut stats.changed_paths,
            &mut stats.removed_paths,
            &mut stats.dirs_written,
        )?;
        // Each entry's stamp was taken before it was read: whatever changed during the
        // walk counts as uncaptured afterwards; so do the entries the filter kept back.
        let mut listings = std::mem::take(&mut cap.listings);
        let mut partial = std::mem::take(&mut cap.partial);
        for k in &cap.kept_back {
            let (dir, name) = split_rel(k);
            if let Some(l) = listings.get_mut(dir) {
                l.remove(name);
            }
            for (n, stamp) in partial.get_mut(dir).into_iter().flatten() {
                if n == name {
                    *stamp = None;
                }
            }
        }
        tracing::debug!(
            "snapshot of {}: changes known at {t_changed:?}, captured at {t_captured:?}, \
             compared with its base in {:?}",
            self.mountpoint.display(),
            t0.elapsed()
        );
        let capture = Capture {
            generation,
            upto: changed.map(|c| c.upto),
            full,
            listings,
            partial,
            trees: std::mem::take(&mut cap.trees),
            kept_back: std::mem::take(&mut cap.kept_back),
            hashed: std::mem::take(&mut cap.hashed),
        };
        Ok((root, stats, capture))
    }

    /// The files the lower served since the last call, in first-open order: what the
    /// run read, for another host to fetch first.
    pub(crate) fn take_reads(&self) -> Vec<crate::cas::FileRef> {
        self.view
            .reads
            .as_ref()
            .map(|r| r.take())
            .unwrap_or_default()
    }

    /// The merged workspace's tree, whether it is its base checkpoint's (nothing
    /// uncaptured), and the capture that computed it.
    pub(crate) fn content(&self) -> CheckpointResult<(TreeId, bool, Capture)> {
        let (merged, _, capture) = self.snapshot(None)?;
        let base = tree_of(&self.store, self.tag().base)?;
        Ok((merged, merged == base, capture))
    }

    /// Takes what the upper holds that the base checkpoint holds too (files a killed
    /// daemon's mount wrote before its last checkpoint) as captured, so that `status`
    /// and the next checkpoint count only what differs from the base, as they would have
    /// had the daemon lived. `merged` and `capture` are the upper's, from
    /// [`Self::content`]; nothing is recorded as a checkpoint.
    pub(crate) fn adopt(&self, merged: TreeId, capture: &Capture) -> CheckpointResult<()> {
        let base = tree_of(&self.store, self.tag().base)?;
        let (mut changed, mut removed) = (Vec::new(), Vec::new());
        crate::cas::paths_between(
            self.store.objects(),
            Some(base),
            merged,
            "",
            &mut changed,
            &mut removed,
            &mut 0,
        )?;
        let differ: HashSet<String> = changed.into_iter().chain(removed).collect();
        // The directories above a difference.
        let mut above: HashSet<&str> = HashSet::new();
        for p in &differ {
            let mut cur = p.as_str();
            while let Some(i) = cur.rfind('/') {
                cur = &cur[..i];
                if !above.insert(cur) {
                    break;
                }
            }
        }
        let mut held: Listings = HashMap::new();
        let mut same = Vec::new();
        for (dir, entries) in &capture.listings {
            let d = String::from_utf8_lossy(dir);
            for (name, stamp) in entries {
                let path = crate::cas::join_path(&d, name);
                if differ.contains(&path) || (is_dir(stamp) && above.contains(path.as_str())) {
                    continue;
                }
                held.entry(dir.clone())
                    .or_default()
                    .insert(name.clone(), *stamp);
                same.push(*stamp);
            }
        }
        let mut memo = self.memo();
        if memo.generation == capture.generation {
            mark_in_checkpoint(&self.cache, &same);
            memo.captured = held;
        }
        Ok(())
    }

    /// Records a checkpoint: `tag` is the mount's from now on, `capture` what it holds.
    pub(crate) fn finish(&self, tag: MountTag, capture: Capture) -> CheckpointResult<()> {
        let mut st = self.layers();
        st.tag = tag;
        self.captured(capture);
        self.record(&st)
    }

    /// Takes `capture` as what the mount's base checkpoint holds: the next checkpoint
    /// and `status` start from it.
    pub(crate) fn captured(&self, c: Capture) {
        let mut memo = self.memo();
        if memo.generation != c.generation {
            return;
        }
        mark_in_checkpoint(&self.cache, &c.hashed);
        let m = &mut *memo;
        if c.full {
            m.captured = c.listings;
            m.trees = c.trees;
        } else {
            merge_listings(&mut m.captured, &mut m.trees, c.listings, c.partial);
            m.trees.extend(c.trees);
        }
        if let (Some(w), Some(upto)) = (&m.watch, c.upto) {
            w.settle(upto, &c.kept_back);
        }
    }
}

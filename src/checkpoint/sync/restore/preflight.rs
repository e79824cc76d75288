//! Before a restore changes anything: every tree under its root loaded and every object
//! it needs checked to exist (and, unless staged, fetched), and the bytes below each
//! tree weighed.

use std::collections::HashMap;

use rayon::prelude::*;

use crate::cas::file::load_chunk_list;
use crate::cas::{load_tree, CasError, EntryContent, FileId, ObjectId, Tree, TreeId};
use crate::checkpoint::ids::CheckpointResult;
use crate::checkpoint::store::Store;

pub(super) struct Preflight {
    pub(super) trees: HashMap<TreeId, Tree>,
    pub(super) chunks: HashMap<FileId, Vec<ObjectId>>,
}

/// Loads every tree under `root` and checks that every object the restore needs exists,
/// so that a missing or undecodable object stops the restore before anything changes.
/// Unless `staging` (the contents are then read while files are written), file contents
/// are prefetched; with it, the chunks of every large file are returned.
pub(super) fn preflight(store: &Store, root: TreeId, staging: bool) -> CheckpointResult<Preflight> {
    let mut trees = HashMap::new();
    let mut files = Vec::new();
    let mut level = vec![root];
    while !level.is_empty() {
        // From a remote store, a level's trees come many at a time.
        let ids: Vec<ObjectId> = level.iter().map(|t| ObjectId(t.0)).collect();
        store.objects().prefetch(&ids);
        let loaded: Vec<(TreeId, Tree)> = level
            .par_iter()
            .map(|id| Ok((*id, load_tree(store.objects(), id)?)))
            .collect::<CheckpointResult<_>>()?;
        let mut next = Vec::new();
        for (id, tree) in loaded {
            for e in tree.entries() {
                match &e.content {
                    EntryContent::Dir(t) if !trees.contains_key(t) => next.push(*t),
                    EntryContent::File(_) => files.push(e.file_ref().expect("file")),
                    _ => {}
                }
            }
            trees.insert(id, tree);
        }
        next.sort();
        next.dedup();
        level = next;
    }
    // Every file's objects in one call, after the trees: a pack's objects then come in
    // as few ranged reads as their places in it allow, not one set per tree level. The
    // chunk lists of large files first, so that their chunks come in that same call.
    files.sort_by_key(|f| f.id);
    files.dedup();
    let lists: Vec<ObjectId> = files
        .iter()
        .filter(|f| f.is_chunked())
        .map(|f| ObjectId(f.id.0))
        .collect();
    store.objects().prefetch(&lists);
    // What must be present: single-chunk files, and every chunk of the large ones (each
    // chunk list read once, here).
    let mut needed: Vec<(&'static str, ObjectId)> = Vec::new();
    let mut chunks = HashMap::new();
    for f in &files {
        if !f.is_chunked() {
            needed.push(("file", ObjectId(f.id.0)));
        } else {
            let list = load_chunk_list(store.objects(), f)?;
            needed.extend(list.chunks.iter().map(|(id, _)| ("chunk", ObjectId(id.0))));
            if staging {
                let ids = list.chunks.iter().map(|(id, _)| ObjectId(id.0)).collect();
                chunks.insert(f.id, ids);
            }
        }
    }
    needed.sort_by_key(|n| n.1 .0);
    needed.dedup_by_key(|n| n.1 .0);
    if !staging {
        let ids: Vec<ObjectId> = needed.iter().map(|n| n.1).collect();
        store.objects().prefetch(&ids);
    }
    needed
        .par_iter()
        .try_for_each(|&(what, id)| match store.objects().contains(&id) {
            Ok(true) => Ok(()),
            Ok(false) => Err(CasError::NotFound { what, id: id.0 }),
            Err(e) => Err(e),
        })?;
    Ok(Preflight { trees, chunks })
}

/// The bytes of the files below `id`, remembered for it and every tree below.
pub(super) fn weight_of(
    trees: &HashMap<TreeId, Tree>,
    id: TreeId,
    out: &mut HashMap<TreeId, u64>,
) -> u64 {
    if let Some(w) = out.get(&id) {
        return *w;
    }
    let mut w = 0;
    for e in trees.get(&id).map(Tree::entries).unwrap_or_default() {
        w += match &e.content {
            EntryContent::File(_) => e.size,
            EntryContent::Dir(t) => weight_of(trees, *t, out),
            _ => 0,
        };
    }
    out.insert(id, w);
    w
}

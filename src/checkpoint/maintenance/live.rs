//! The live set, which every maintenance operation starts from: the collection fence
//! (`fence`), the checkpoints mounts are based on (`mount_checkpoints`), the walk that
//! marks every object reachable from a checkpoint record or a mount's dirty set
//! (`walk`, [`Walk`]), and the directory cache's entries that name what nothing live
//! keeps (`stale_dircache`). Retention and gc (the parent) and `fsck` build on it.

use std::collections::HashSet;

use crate::cas::fence::Collecting;
use crate::cas::{Hash, Marker, Problem};
use crate::checkpoint::ids::{CheckpointId, CheckpointResult};
use crate::checkpoint::record::MountTag;
use crate::checkpoint::store::key_hex;
use crate::checkpoint::store::Store;
use crate::checkpoint::sync::dircache;
use crate::fs::dirty::{mount_keys, DirtyStore};

/// Holds the store's collection fence: this host's writers (captures, checkpoints,
/// restores) wait until it is dropped.
pub(super) fn fence(store: &Store) -> CheckpointResult<Collecting<'_>> {
    Ok(store.local_objects().fence_ref().collect()?)
}

/// The checkpoints every mount is based on or will append on: this host's, from their
/// dirty sets, and every host's, from the pins of the checkpoint store (PostgreSQL's in
/// a fleet; the removal of records honours those again, atomically).
pub(super) fn mount_checkpoints(store: &Store) -> CheckpointResult<HashSet<CheckpointId>> {
    let mut out: HashSet<CheckpointId> = store
        .checkpoints()
        .pins()?
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    for key in mount_keys(store.database())? {
        let d = DirtyStore::new(store.database().clone(), key);
        if let Ok(Some(meta)) = d.meta() {
            if let Some(tag) = MountTag::from_tag(&meta.tag) {
                out.extend(tag.base);
                out.extend(tag.expected_head);
            }
        }
    }
    Ok(out)
}

/// What the walk from every live root found.
pub(super) struct Walk<'a> {
    pub(super) marker: Marker<'a>,
    /// Problems under records and mounts: data that is needed and damaged.
    pub(super) problems: Vec<Problem>,
    pub(super) checkpoints: usize,
    pub(super) mounts: usize,
}

/// The directory cache is not a root: it is derivable, and a cached directory may be
/// long gone. Entries that name an object nothing live keeps (or the store lacks) are
/// stale: a capture would reuse what they name. They are dropped before a sweep (under
/// the fence, so no capture or restore is using the cache meanwhile). Returns (cached
/// directories, stale ones, an example).
pub(super) fn stale_dircache(
    store: &Store,
    marked: &HashSet<Hash>,
    drop_them: bool,
) -> CheckpointResult<(usize, usize, Option<String>)> {
    let entries = dircache::all_entries(store)?;
    let mut stale = Vec::new();
    let mut example = None;
    for (key, entry) in &entries {
        let ok = entry.as_ref().is_some_and(|dc| {
            marked.contains(&dc.tree_id.0)
                && dc.tree.entries().iter().all(|e| {
                    e.file_ref().is_none_or(|f| marked.contains(&f.id.0))
                        && e.tree_id().is_none_or(|t| marked.contains(&t.0))
                })
        });
        if !ok {
            if example.is_none() {
                example = Some(format!(
                    "{:?}",
                    String::from_utf8_lossy(key.get(16..).unwrap_or_default())
                ));
            }
            stale.push(key.clone());
        }
    }
    if drop_them && !stale.is_empty() {
        dircache::remove(store, &stale)?;
    }
    Ok((entries.len(), stale.len(), example))
}

pub(super) fn walk(store: &Store, verify: bool) -> CheckpointResult<Walk<'_>> {
    let mut marker = Marker::new(store.objects(), verify);
    if store.remote().is_some() {
        marker = marker.fetching_ahead();
    }
    let mut problems = Vec::new();
    let mut checkpoints = 0;
    let take = |m: &mut Marker, into: &mut Vec<Problem>| into.append(&mut m.problems);
    for (id, rec) in store.checkpoints().all_records()? {
        let Ok(cp) = rec else { continue };
        checkpoints += 1;
        let at = format!("checkpoint {}:/", id.short());
        marker.tree(cp.body.root, &at);
        if let Some(c) = cp.body.conversation {
            marker.file(c.into(), &format!("checkpoint {} conversation", id.short()));
        }
        if let Some(c) = cp.body.read_first {
            marker.file(
                c.into(),
                &format!("checkpoint {} read-first list", id.short()),
            );
        }
        for a in &cp.body.artifacts {
            marker.file(
                a.content.into(),
                &format!("checkpoint {} artifact {:?}", id.short(), a.name),
            );
        }
        take(&mut marker, &mut problems);
    }
    let keys = mount_keys(store.database())?;
    for key in &keys {
        let d = DirtyStore::new(store.database().clone(), *key);
        let hex = key_hex(key);
        match d.meta() {
            Ok(Some(meta)) => marker.tree(meta.base, &format!("mount {hex} base:/")),
            Ok(None) => {}
            Err(e) => problems.push(Problem {
                object: hex.clone(),
                what: "mount record",
                path: format!("mount {hex}"),
                detail: e.to_string(),
            }),
        }
        match d.nodes() {
            Ok(nodes) => {
                for (ino, n) in nodes {
                    let at = format!("mount {hex} inode {ino}");
                    if let Some(t) = n.tree {
                        marker.tree(t, &at);
                    }
                    if let Some(f) = n.clean {
                        marker.file(
                            crate::cas::FileRef {
                                id: f,
                                size: n.size,
                            },
                            &at,
                        );
                    }
                }
            }
            Err(e) => problems.push(Problem {
                object: hex.clone(),
                what: "dirty set",
                path: format!("mount {hex}"),
                detail: e.to_string(),
            }),
        }
        take(&mut marker, &mut problems);
    }
    Ok(Walk {
        marker,
        problems,
        checkpoints,
        mounts: keys.len(),
    })
}

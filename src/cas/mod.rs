//! The content-addressed store: hashes and typed ids, object encoding with zstd and
//! verification, fixed-size chunking of large files, canonical trees, and the
//! [`ObjectStore`] trait with its RocksDB implementation.
//!
//! This layer knows nothing of checkpoints, threads or FUSE.

mod encoding;
mod error;
pub mod file;
pub mod gc;
mod hash;
pub mod kv;
pub mod object;
pub mod pack;
pub mod remote_index;
pub mod remote_store;
mod rocks_store;
mod store;
pub mod tree;

pub use error::{CasError, CasResult};
pub use file::{FileRef, StoreStats, CHUNK_SIZE};
pub use gc::{write_session, Fence, Marker, Problem, WriteSession};
pub use hash::{decode_hex, ChunkId, FileId, Hash, ObjectId, ParseIdError, TreeId, HASH_LEN};
pub use kv::{set_default_block_cache, Batch, Column, Database};
pub use rocks_store::RocksObjectStore;
pub use store::{ObjectStore, PutOutcome, Staged, StagedReader, SweepReport};
pub use tree::{EntryContent, Tree, TreeEntry};

/// Reads and decodes a tree object.
pub fn load_tree(store: &dyn ObjectStore, id: &TreeId) -> CasResult<Tree> {
    let bytes = store.get(&ObjectId(id.0), "tree")?;
    Tree::decode(&bytes).map_err(|detail| CasError::Decode {
        what: "tree",
        id: id.0,
        detail,
    })
}

/// The content of the regular file at `path` ('/'-separated, relative) below tree
/// `root`, if there is one.
pub fn file_at(store: &dyn ObjectStore, root: &TreeId, path: &str) -> CasResult<Option<Vec<u8>>> {
    let mut tree = load_tree(store, root)?;
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    for (i, part) in parts.iter().enumerate() {
        let Some(e) = tree.get(part.as_bytes()) else {
            return Ok(None);
        };
        match (&e.content, i + 1 == parts.len()) {
            (EntryContent::Dir(id), false) => tree = load_tree(store, id)?,
            (EntryContent::File(id), true) => {
                let f = FileRef {
                    id: *id,
                    size: e.size,
                };
                return Ok(Some(file::read_file(store, &f)?));
            }
            _ => return Ok(None),
        }
    }
    Ok(None)
}

/// Encodes and stores a tree object.
pub fn store_tree(store: &dyn ObjectStore, tree: &Tree) -> CasResult<(TreeId, PutOutcome)> {
    let p = store.put_metadata(&tree.encode())?;
    Ok((TreeId(p.id.0), p))
}

/// The paths that differ from tree `a` to tree `b`, as a checkpoint reports them:
/// files (and other non-directories) added or modified into `changed`, entries gone
/// into `removed` (a removed directory once), and in `dirs` the directories whose tree
/// is new (the root included). Identical subtrees are skipped, so the cost follows what
/// changed.
pub fn paths_between(
    objects: &dyn ObjectStore,
    a: Option<TreeId>,
    b: TreeId,
    prefix: &str,
    changed: &mut Vec<String>,
    removed: &mut Vec<String>,
    dirs: &mut u64,
) -> CasResult<()> {
    if a == Some(b) {
        return Ok(());
    }
    *dirs += 1;
    let ta = a.map(|a| load_tree(objects, &a)).transpose()?;
    let tb = load_tree(objects, &b)?;
    let before: std::collections::HashMap<&[u8], &TreeEntry> = ta
        .iter()
        .flat_map(|t| t.entries())
        .map(|e| (e.name.as_slice(), e))
        .collect();
    for e in tb.entries() {
        let path = join_path(prefix, &e.name);
        let old = before.get(e.name.as_slice()).copied();
        match (old.and_then(|o| o.tree_id()), e.tree_id()) {
            (old_tree, Some(t)) => {
                if old.is_some() && old_tree.is_none() {
                    removed.push(path.clone());
                }
                paths_between(objects, old_tree, t, &path, changed, removed, dirs)?;
            }
            (Some(_), None) => {
                removed.push(path.clone());
                changed.push(path);
            }
            (None, None) => {
                if old != Some(e) {
                    changed.push(path);
                }
            }
        }
    }
    let now: std::collections::HashSet<&[u8]> =
        tb.entries().iter().map(|e| e.name.as_slice()).collect();
    for e in ta.iter().flat_map(|t| t.entries()) {
        if !now.contains(e.name.as_slice()) {
            removed.push(join_path(prefix, &e.name));
        }
    }
    Ok(())
}

/// `dir/name` (just `name` at the top), the name read as UTF-8 lossily.
pub fn join_path(dir: &str, name: &[u8]) -> String {
    let n = String::from_utf8_lossy(name);
    if dir.is_empty() {
        n.into_owned()
    } else {
        format!("{dir}/{n}")
    }
}

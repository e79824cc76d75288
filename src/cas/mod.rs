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
pub use tree::{EntryContent, Paired, Tree, TreeEntry};

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
    let ta = a
        .map(|a| load_tree(objects, &a))
        .transpose()?
        .unwrap_or_default();
    let tb = load_tree(objects, &b)?;
    for pair in ta.zip_by_name(&tb) {
        let (o, n) = match pair {
            Paired::Here(o) => {
                removed.push(join_path(prefix, &o.name));
                continue;
            }
            Paired::There(n) => (None, n),
            Paired::Both(o, n) => (Some(o), n),
        };
        let path = || join_path(prefix, &n.name);
        match (o.and_then(|o| o.tree_id()), n.tree_id()) {
            (old_tree, Some(t)) => {
                if old_tree == Some(t) {
                    continue;
                }
                if o.is_some() && old_tree.is_none() {
                    removed.push(path());
                }
                paths_between(objects, old_tree, t, &path(), changed, removed, dirs)?;
            }
            (Some(_), None) => {
                removed.push(path());
                changed.push(path());
            }
            (None, None) => {
                if o != Some(n) {
                    changed.push(path());
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn file(name: &str, content: &str, mtime_ns: i64) -> TreeEntry {
        TreeEntry {
            name: name.as_bytes().to_vec(),
            content: EntryContent::File(FileId(Hash::of(content.as_bytes()))),
            mode: 0o644,
            mtime_ns,
            size: content.len() as u64,
            xattrs: Vec::new(),
        }
    }

    fn dir(store: &dyn ObjectStore, name: &str, mut entries: Vec<TreeEntry>) -> TreeEntry {
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        let tree = Tree::from_sorted_entries(entries).unwrap();
        let (id, _) = store_tree(store, &tree).unwrap();
        TreeEntry {
            name: name.as_bytes().to_vec(),
            content: EntryContent::Dir(id),
            mode: 0o755,
            mtime_ns: 0,
            size: 0,
            xattrs: Vec::new(),
        }
    }

    fn root(store: &dyn ObjectStore, entries: Vec<TreeEntry>) -> TreeId {
        match dir(store, "root", entries).content {
            EntryContent::Dir(id) => id,
            _ => unreachable!(),
        }
    }

    /// Every kind of difference, in both orders of the merge: entries only before,
    /// only after, a file turned directory and back, a changed time, an identical
    /// subtree (skipped, not counted).
    #[test]
    fn paths_between_names_every_difference_once() {
        let t = tempfile::tempdir().unwrap();
        let db = Arc::new(Database::open(&t.path().join("db"), &[]).unwrap());
        let s = RocksObjectStore::new(db);
        let same = |s: &dyn ObjectStore| dir(s, "same", vec![file("k", "k", 1)]);
        let a = root(
            &s,
            vec![
                dir(&s, "d", vec![file("x", "x", 1), file("y", "y", 1)]),
                file("f", "f", 1),
                file("g", "g", 1),
                dir(&s, "h", vec![file("z", "z", 1)]),
                same(&s),
                file("t", "t", 1),
                file("\u{e9}\n odd", "o", 1),
            ],
        );
        let b = root(
            &s,
            vec![
                dir(&s, "d", vec![file("w", "w", 1), file("x", "x2", 1)]),
                dir(&s, "f", vec![file("q", "q", 1)]),
                file("g", "g", 1),
                file("h", "h", 1),
                same(&s),
                file("n", "n", 1),
                file("t", "t", 2),
                file("\u{e9}\n odd", "o", 1),
            ],
        );
        let (mut changed, mut removed, mut dirs) = (Vec::new(), Vec::new(), 0);
        paths_between(&s, Some(a), b, "", &mut changed, &mut removed, &mut dirs).unwrap();
        assert_eq!(changed, ["d/w", "d/x", "f/q", "h", "n", "t"]);
        assert_eq!(removed, ["d/y", "f", "h"]);
        // The root, d and f: the identical subtree is not entered.
        assert_eq!(dirs, 3);

        // Backwards, and from nothing.
        let (mut changed, mut removed, mut dirs) = (Vec::new(), Vec::new(), 0);
        paths_between(&s, Some(b), a, "", &mut changed, &mut removed, &mut dirs).unwrap();
        assert_eq!(changed, ["d/x", "d/y", "f", "h/z", "t"]);
        assert_eq!(removed, ["d/w", "f", "h", "n"]);
        let (mut changed, mut removed, mut dirs) = (Vec::new(), Vec::new(), 0);
        paths_between(&s, None, a, "", &mut changed, &mut removed, &mut dirs).unwrap();
        assert_eq!(
            changed,
            ["d/x", "d/y", "f", "g", "h/z", "same/k", "t", "\u{e9}\n odd"]
        );
        assert!(removed.is_empty());
        let (mut changed, mut removed, mut dirs) = (Vec::new(), Vec::new(), 0);
        paths_between(&s, Some(a), a, "", &mut changed, &mut removed, &mut dirs).unwrap();
        assert_eq!((changed.len(), removed.len(), dirs), (0, 0, 0));
    }
}

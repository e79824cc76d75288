//! Differences between two trees, entry by entry, on the walk of both that the object
//! store layer makes ([`crate::cas::walk_pairs`]): identical subtrees are skipped by
//! hash, so the cost is proportional to what changed, not to the size of the trees.

use serde::Serialize;

use super::ids::{CheckpointError, CheckpointResult};
use crate::cas::{
    join_path, walk_pairs, Below, EntryContent, ObjectStore, PairVisitor, TreeEntry, TreeId,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChangeKind {
    Added,
    Removed,
    Modified,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    pub kind: ChangeKind,
    pub path: String,
    /// For modifications: which of content, kind, mode, mtime, xattrs changed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub what: Vec<&'static str>,
}

/// Every added, removed and modified path from `a` to `b`, in path order. A directory
/// added or removed lists itself and everything in it.
pub fn diff_trees(store: &dyn ObjectStore, a: TreeId, b: TreeId) -> CheckpointResult<Vec<Change>> {
    let mut d = Diff(Vec::new());
    walk_pairs(store, Some(a), Some(b), "", &mut d)?;
    Ok(d.0)
}

/// The changes found so far, on [`walk_pairs`] of the two trees.
struct Diff(Vec<Change>);

impl Diff {
    fn push(&mut self, kind: ChangeKind, path: String, what: Vec<&'static str>) {
        self.0.push(Change { kind, path, what });
    }
}

impl PairVisitor<CheckpointError> for Diff {
    fn pair(
        &mut self,
        dir: &str,
        x: Option<&TreeEntry>,
        y: Option<&TreeEntry>,
    ) -> CheckpointResult<Below> {
        let path = || join_path(dir, &x.or(y).expect("one side at least").name);
        let below = match (x, y) {
            // Removed, added: itself and everything in it.
            (Some(x), None) => {
                self.push(ChangeKind::Removed, path(), Vec::new());
                (x.tree_id(), None)
            }
            (None, Some(y)) => {
                self.push(ChangeKind::Added, path(), Vec::new());
                (None, y.tree_id())
            }
            (Some(x), Some(y)) => match (x.tree_id(), y.tree_id()) {
                (Some(ta), Some(tb)) => {
                    let what = what_changed(x, y);
                    if !what.is_empty() {
                        self.push(ChangeKind::Modified, path(), what);
                    }
                    (Some(ta), Some(tb))
                }
                // A directory turned into something else or back: the one removed
                // whole, then the other added whole (after, see `left`).
                (Some(ta), None) => {
                    self.push(ChangeKind::Removed, path(), Vec::new());
                    (Some(ta), None)
                }
                (None, Some(tb)) => {
                    self.push(ChangeKind::Removed, path(), Vec::new());
                    self.push(ChangeKind::Added, path(), Vec::new());
                    (None, Some(tb))
                }
                (None, None) => {
                    let what = what_changed(x, y);
                    if !what.is_empty() {
                        self.push(ChangeKind::Modified, path(), what);
                    }
                    return Ok(None);
                }
            },
            (None, None) => return Ok(None),
        };
        Ok(Some(below))
    }

    fn left(
        &mut self,
        path: &str,
        x: Option<&TreeEntry>,
        y: Option<&TreeEntry>,
    ) -> CheckpointResult<()> {
        // A directory that became something else: added once its old entries are gone.
        if let (Some(x), Some(y)) = (x, y) {
            if x.tree_id().is_some() && y.tree_id().is_none() {
                self.push(ChangeKind::Added, path.to_string(), Vec::new());
            }
        }
        Ok(())
    }
}

/// What differs between two same-named entries that are both directories or both not.
/// A directory's content and mtime follow from its entries, so they are not listed.
fn what_changed(x: &TreeEntry, y: &TreeEntry) -> Vec<&'static str> {
    let dir = matches!(x.content, EntryContent::Dir(_));
    let mut what = Vec::new();
    if !dir {
        if std::mem::discriminant(&x.content) != std::mem::discriminant(&y.content) {
            what.push("kind");
        } else if x.content != y.content {
            what.push("content");
        }
    }
    if x.mode != y.mode {
        what.push("mode");
    }
    if !dir && x.mtime_ns != y.mtime_ns {
        what.push("mtime");
    }
    if x.xattrs != y.xattrs {
        what.push("xattrs");
    }
    what
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cas::kv::Database;
    use crate::cas::tree_io::tests::{dir, file, root};
    use crate::cas::RocksObjectStore;
    use std::sync::Arc;

    /// Every kind of change, a directory turned into a file and back included: the
    /// one removed whole before the other is added whole.
    #[test]
    fn diffs_list_every_change_in_path_order() {
        let t = tempfile::tempdir().unwrap();
        let s = RocksObjectStore::new(Arc::new(Database::open(&t.path().join("db"), &[]).unwrap()));
        let a = root(
            &s,
            vec![
                dir(&s, "d", vec![file("x", "x", 1), file("y", "y", 1)]),
                file("f", "f", 1),
                dir(&s, "h", vec![file("z", "z", 1)]),
                file("m", "m", 1),
                dir(&s, "same", vec![file("k", "k", 1)]),
            ],
        );
        let b = root(
            &s,
            vec![
                dir(&s, "d", vec![file("w", "w", 1), file("x", "x2", 1)]),
                dir(&s, "f", vec![file("q", "q", 1)]),
                file("h", "h", 1),
                TreeEntry {
                    mode: 0o755,
                    ..file("m", "m", 1)
                },
                dir(&s, "same", vec![file("k", "k", 1)]),
            ],
        );
        let got: Vec<(ChangeKind, String, Vec<&str>)> = diff_trees(&s, a, b)
            .unwrap()
            .into_iter()
            .map(|c| (c.kind, c.path, c.what))
            .collect();
        use ChangeKind::*;
        let want: Vec<(ChangeKind, String, Vec<&str>)> = vec![
            (Added, "d/w".into(), vec![]),
            (Modified, "d/x".into(), vec!["content"]),
            (Removed, "d/y".into(), vec![]),
            (Removed, "f".into(), vec![]),
            (Added, "f".into(), vec![]),
            (Added, "f/q".into(), vec![]),
            (Removed, "h".into(), vec![]),
            (Removed, "h/z".into(), vec![]),
            (Added, "h".into(), vec![]),
            (Modified, "m".into(), vec!["mode"]),
        ];
        assert_eq!(got, want);
        assert!(diff_trees(&s, a, a).unwrap().is_empty());
    }
}

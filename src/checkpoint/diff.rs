//! Differences between two trees, skipping identical subtrees by hash: the cost is
//! proportional to what changed, not to the size of the trees.

use serde::Serialize;

use super::ids::CheckpointResult;
use crate::cas::{load_tree, EntryContent, ObjectStore, Paired, Tree, TreeEntry, TreeId};

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
    let mut out = Vec::new();
    if a != b {
        let ta = load_tree(store, &a)?;
        let tb = load_tree(store, &b)?;
        diff_into(store, &ta, &tb, "", &mut out)?;
    }
    Ok(out)
}

fn join(prefix: &str, e: &TreeEntry) -> String {
    if prefix.is_empty() {
        e.name_lossy()
    } else {
        format!("{prefix}/{}", e.name_lossy())
    }
}

fn diff_into(
    store: &dyn ObjectStore,
    a: &Tree,
    b: &Tree,
    prefix: &str,
    out: &mut Vec<Change>,
) -> CheckpointResult<()> {
    for pair in a.zip_by_name(b) {
        match pair {
            Paired::Here(x) => whole(store, x, prefix, ChangeKind::Removed, out)?,
            Paired::There(y) => whole(store, y, prefix, ChangeKind::Added, out)?,
            Paired::Both(x, y) => entry_pair(store, x, y, prefix, out)?,
        }
    }
    Ok(())
}

fn entry_pair(
    store: &dyn ObjectStore,
    x: &TreeEntry,
    y: &TreeEntry,
    prefix: &str,
    out: &mut Vec<Change>,
) -> CheckpointResult<()> {
    let path = join(prefix, x);
    let (ta, tb) = match (&x.content, &y.content) {
        (EntryContent::Dir(ta), EntryContent::Dir(tb)) => (Some(ta), Some(tb)),
        (EntryContent::Dir(_), _) | (_, EntryContent::Dir(_)) => {
            whole(store, x, prefix, ChangeKind::Removed, out)?;
            return whole(store, y, prefix, ChangeKind::Added, out);
        }
        _ => (None, None),
    };
    let what = what_changed(x, y);
    if !what.is_empty() {
        out.push(Change {
            kind: ChangeKind::Modified,
            path: path.clone(),
            what,
        });
    }
    if let (Some(ta), Some(tb)) = (ta, tb) {
        if ta != tb {
            let (a, b) = (load_tree(store, ta)?, load_tree(store, tb)?);
            diff_into(store, &a, &b, &path, out)?;
        }
    }
    Ok(())
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

fn whole(
    store: &dyn ObjectStore,
    e: &TreeEntry,
    prefix: &str,
    kind: ChangeKind,
    out: &mut Vec<Change>,
) -> CheckpointResult<()> {
    let path = join(prefix, e);
    out.push(Change {
        kind,
        path: path.clone(),
        what: Vec::new(),
    });
    if let EntryContent::Dir(t) = &e.content {
        let tree = load_tree(store, t)?;
        for child in tree.entries() {
            whole(store, child, &path, kind, out)?;
        }
    }
    Ok(())
}

//! Trees in an object store: loaded and decoded, stored with the facts noted of them
//! ([`TreeFacts`]), a file read by its path, and the one walk of two trees side by side
//! ([`walk_pairs`]) that finds what differs from one to the other.

use super::error::{CasError, CasResult};
use super::file::{self, FileRef};
use super::hash::{ObjectId, TreeId};
use super::store::{ObjectStore, PutOutcome};
use super::tree::{EntryContent, Paired, Tree, TreeEntry, TreeFacts};

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

/// Encodes and stores a tree object, and notes its [`TreeFacts`] where those of the
/// trees below it are known.
pub fn store_tree(store: &dyn ObjectStore, tree: &Tree) -> CasResult<(TreeId, PutOutcome)> {
    store_tree_over(store, tree, None)
}

/// [`store_tree`] of a tree made from the stored tree `base` (its id and itself) by
/// changing some entries: where `base`'s facts are known, only the entries that differ
/// from its own are looked at for the new tree's, so that a wide directory with a few
/// changed names costs a few lookups, not one per subdirectory.
pub fn store_tree_over(
    store: &dyn ObjectStore,
    tree: &Tree,
    base: Option<(&TreeId, &Tree)>,
) -> CasResult<(TreeId, PutOutcome)> {
    let p = store.put_metadata(&tree.encode())?;
    let id = TreeId(p.id.0);
    let base = base.and_then(|(id, t)| Some((t, store.tree_facts(id)?)));
    if let Some(facts) = TreeFacts::of_over(tree, base, |sub| store.tree_facts(sub)) {
        if p.new || store.tree_facts(&id) != Some(facts) {
            store.note_tree_facts(&id, facts);
        }
    }
    Ok((id, p))
}

/// Where a [`walk_pairs`] goes below a pair: the trees to walk, old and new (`None` for
/// either: nothing on that side), or `None` to walk no deeper.
pub type Below = Option<(Option<TreeId>, Option<TreeId>)>;

/// What a [`walk_pairs`] does at each name of the two trees it walks.
pub trait PairVisitor<E> {
    /// The entries named alike in the directory at `dir` (`None`: the tree has no such
    /// name), and where to go below them.
    fn pair(
        &mut self,
        dir: &str,
        old: Option<&TreeEntry>,
        new: Option<&TreeEntry>,
    ) -> Result<Below, E>;

    /// After the walk below a pair `pair` asked to walk into (`path`: the pair's).
    fn left(
        &mut self,
        _path: &str,
        _old: Option<&TreeEntry>,
        _new: Option<&TreeEntry>,
    ) -> Result<(), E> {
        Ok(())
    }
}

/// Walks tree `a` and tree `b` (`None`: an empty tree) side by side below `dir`, in
/// name order, handing every pair of same-named entries to `v`. Identical trees are
/// not entered, so the cost follows what changed.
pub fn walk_pairs<E: From<CasError>>(
    store: &dyn ObjectStore,
    a: Option<TreeId>,
    b: Option<TreeId>,
    dir: &str,
    v: &mut dyn PairVisitor<E>,
) -> Result<(), E> {
    if a == b {
        return Ok(());
    }
    let load = |t: Option<TreeId>| -> CasResult<Tree> {
        t.map(|t| load_tree(store, &t))
            .transpose()
            .map(Option::unwrap_or_default)
    };
    let (ta, tb) = (load(a)?, load(b)?);
    for pair in ta.zip_by_name(&tb) {
        let (o, n) = match pair {
            Paired::Here(o) => (Some(o), None),
            Paired::There(n) => (None, Some(n)),
            Paired::Both(o, n) => (Some(o), Some(n)),
        };
        if let Some((below_a, below_b)) = v.pair(dir, o, n)? {
            let name = &o.or(n).expect("one side at least").name;
            let path = join_path(dir, name);
            walk_pairs(store, below_a, below_b, &path, v)?;
            v.left(&path, o, n)?;
        }
    }
    Ok(())
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
    struct Paths<'a> {
        changed: &'a mut Vec<String>,
        removed: &'a mut Vec<String>,
        dirs: &'a mut u64,
    }
    impl PairVisitor<CasError> for Paths<'_> {
        fn pair(
            &mut self,
            dir: &str,
            o: Option<&TreeEntry>,
            n: Option<&TreeEntry>,
        ) -> CasResult<Below> {
            let Some(n) = n else {
                let o = o.expect("one side at least");
                self.removed.push(join_path(dir, &o.name));
                return Ok(None);
            };
            let path = || join_path(dir, &n.name);
            match (o.and_then(|o| o.tree_id()), n.tree_id()) {
                (old_tree, Some(t)) => {
                    if old_tree == Some(t) {
                        return Ok(None);
                    }
                    if o.is_some() && old_tree.is_none() {
                        self.removed.push(path());
                    }
                    *self.dirs += 1;
                    return Ok(Some((old_tree, Some(t))));
                }
                (Some(_), None) => {
                    self.removed.push(path());
                    self.changed.push(path());
                }
                (None, None) => {
                    if o != Some(n) {
                        self.changed.push(path());
                    }
                }
            }
            Ok(None)
        }
    }
    if a == Some(b) {
        return Ok(());
    }
    *dirs += 1;
    let mut v = Paths {
        changed,
        removed,
        dirs,
    };
    walk_pairs(objects, a, Some(b), prefix, &mut v)
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

/// Trees made for tests (here and in `checkpoint::diff`).
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cas::hash::{FileId, Hash};
    use crate::cas::kv::Database;
    use crate::cas::rocks_store::RocksObjectStore;
    use std::sync::Arc;

    pub(crate) fn file(name: &str, content: &str, mtime_ns: i64) -> TreeEntry {
        TreeEntry {
            name: name.as_bytes().to_vec(),
            content: EntryContent::File(FileId(Hash::of(content.as_bytes()))),
            mode: 0o644,
            mtime_ns,
            size: content.len() as u64,
            xattrs: Vec::new(),
        }
    }

    pub(crate) fn dir(
        store: &dyn ObjectStore,
        name: &str,
        mut entries: Vec<TreeEntry>,
    ) -> TreeEntry {
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        let tree = Tree::from_sorted_entries(entries).unwrap();
        dir_entry(name, store_tree(store, &tree).unwrap().0)
    }

    fn dir_entry(name: &str, id: TreeId) -> TreeEntry {
        TreeEntry {
            name: name.as_bytes().to_vec(),
            content: EntryContent::Dir(id),
            mode: 0o755,
            mtime_ns: 0,
            size: 0,
            xattrs: Vec::new(),
        }
    }

    pub(crate) fn root(store: &dyn ObjectStore, entries: Vec<TreeEntry>) -> TreeId {
        match dir(store, "root", entries).content {
            EntryContent::Dir(id) => id,
            _ => unreachable!(),
        }
    }

    /// A tree stored over the one it was made from gets the facts a full look would
    /// give, looking only at the entries that changed: an unchanged subtree is not
    /// asked about; a changed one is, and a base with attributes somewhere is no help.
    #[test]
    fn facts_over_a_base_look_only_at_changed_entries() {
        use std::cell::Cell;
        let t = tempfile::tempdir().unwrap();
        let s = RocksObjectStore::new(Arc::new(Database::open(&t.path().join("db"), &[]).unwrap()));
        let subs: Vec<TreeEntry> = (0..50)
            .map(|i| dir(&s, &format!("d{i:02}"), vec![file("x", &i.to_string(), 1)]))
            .collect();
        let base = Tree::from_sorted_entries(subs.clone()).unwrap();
        let (base_id, _) = store_tree(&s, &base).unwrap();
        assert_eq!(s.tree_facts(&base_id), Some(TreeFacts { xattrs: false }));
        let asked = Cell::new(0);
        let sub = |id: &TreeId| {
            asked.set(asked.get() + 1);
            s.tree_facts(id)
        };
        // One new file, one subtree changed to one with attributes below it.
        let mut tagged = file("x", "x", 1);
        tagged.xattrs = vec![(b"user.k".to_vec(), b"v".to_vec())];
        let mut entries = subs.clone();
        entries[7] = dir(&s, "d07", vec![tagged]);
        entries.push(file("new", "n", 1));
        let tree = Tree::from_entries(entries).unwrap();
        let over = TreeFacts::of_over(&tree, Some((&base, TreeFacts { xattrs: false })), sub);
        assert_eq!(over, Some(TreeFacts { xattrs: true }));
        assert_eq!(over, TreeFacts::of(&tree, |id| s.tree_facts(id)));
        assert_eq!(asked.get(), 1, "only the changed subtree is asked about");
        // Only a file added: nothing to ask, the base's facts hold.
        asked.set(0);
        let mut entries = subs.clone();
        entries.push(file("new", "n", 1));
        let plain = Tree::from_entries(entries).unwrap();
        let over = TreeFacts::of_over(&plain, Some((&base, TreeFacts { xattrs: false })), sub);
        assert_eq!(over, Some(TreeFacts { xattrs: false }));
        assert_eq!(asked.get(), 0);
        // A base with attributes (maybe in an entry now gone) is looked past.
        asked.set(0);
        let over = TreeFacts::of_over(&plain, Some((&tree, TreeFacts { xattrs: true })), sub);
        assert_eq!(over, Some(TreeFacts { xattrs: false }));
        assert_eq!(asked.get(), 50);
        // And stored over its base, the new tree's facts are noted as they are.
        let (id, _) = store_tree_over(&s, &plain, Some((&base_id, &base))).unwrap();
        assert_eq!(s.tree_facts(&id), Some(TreeFacts { xattrs: false }));
    }

    /// Facts follow from content: a tree is without extended attributes when none of
    /// its entries nor of any tree below has any; unknown when a subtree's facts are;
    /// kept across a reopen; forgotten with their tree by a collection.
    #[test]
    fn stored_trees_note_their_facts() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("db");
        let s = RocksObjectStore::new(Arc::new(Database::open(&path, &[]).unwrap()));
        let no = Some(TreeFacts { xattrs: false });
        let yes = Some(TreeFacts { xattrs: true });
        let plain = root(
            &s,
            vec![dir(&s, "d", vec![file("x", "x", 1)]), file("f", "f", 1)],
        );
        assert_eq!(s.tree_facts(&plain), no);
        let mut tagged = file("x", "x", 1);
        tagged.xattrs = vec![(b"user.k".to_vec(), b"v".to_vec())];
        let deep = dir(&s, "c", vec![tagged]);
        let deep = dir(&s, "b", vec![deep]);
        let top = root(&s, vec![dir(&s, "a", vec![deep]), file("f", "f", 1)]);
        assert_eq!(s.tree_facts(&top), yes);
        // A directory's own attributes count (they are its entry's, in its parent).
        let mut d = dir(&s, "d", vec![]);
        d.xattrs = vec![(b"user.d".to_vec(), b"1".to_vec())];
        assert_eq!(s.tree_facts(&root(&s, vec![d])), yes);
        // A subtree stored without facts (by an older version, say) leaves its parents
        // unknown, unless another subtree settles it.
        let bare = Tree::from_sorted_entries(vec![file("y", "y", 1)]).unwrap();
        let bare_id = TreeId(s.put_metadata(&bare.encode()).unwrap().id.0);
        assert_eq!(s.tree_facts(&bare_id), None);
        assert_eq!(s.tree_facts(&root(&s, vec![dir_entry("u", bare_id)])), None);
        let settled = root(&s, vec![dir_entry("u", bare_id), dir_entry("v", top)]);
        assert_eq!(s.tree_facts(&settled), yes);

        drop(s);
        let s = RocksObjectStore::new(Arc::new(Database::open(&path, &[]).unwrap()));
        assert_eq!(s.tree_facts(&plain), no);
        let r = Database::open_read_only(&path).unwrap();
        assert_eq!(RocksObjectStore::new(Arc::new(r)).tree_facts(&top), yes);
        // A collection keeping only `plain`'s objects forgets the other trees' facts.
        let keep: std::collections::HashSet<Hash> = [plain.0]
            .into_iter()
            .chain(
                load_tree(&s, &plain)
                    .unwrap()
                    .entries()
                    .iter()
                    .filter_map(|e| e.tree_id().map(|t| t.0)),
            )
            .collect();
        let c = s.fence_ref().collect().unwrap();
        s.sweep(&keep, &c, false).unwrap();
        drop(c);
        assert_eq!(s.tree_facts(&plain), no);
        let d = load_tree(&s, &plain).unwrap().entries()[0]
            .tree_id()
            .unwrap();
        assert_eq!(s.tree_facts(&d), no);
        assert_eq!(s.tree_facts(&top), None);
        assert_eq!(s.tree_facts(&settled), None);
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

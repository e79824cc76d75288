//! Trees: one directory each, in a canonical, versioned binary encoding.
//!
//! Entries are sorted by name (bytewise) and unique; the encoding has exactly one form
//! for a given tree, so the same tree always has the same [`TreeId`]. The decoder checks
//! everything the encoder guarantees (names, kinds, order, lengths, no trailing bytes),
//! so a tree read from the store can be trusted by restore and by the mount.
//!
//! Encoding, version 1 (varints are LEB128, mtime is zigzag):
//! `01 | count | entry*`, where an entry is
//! `name_len name | kind | mode | mtime_ns | size | content | xattr_count (name_len name value_len value)*`
//! and content is a 32-byte hash for files and directories, `len target` for symlinks,
//! `rdev` for devices, and nothing for fifos.

use super::encoding::{put_bytes, put_varint, put_zigzag, Reader};
use super::hash::{FileId, Hash, TreeId};

pub const TREE_VERSION: u8 = 1;
pub const MAX_NAME_LEN: usize = 255;
pub const MAX_SYMLINK_LEN: usize = 4095;
pub const MAX_XATTR_NAME_LEN: usize = 255;
pub const MAX_XATTR_VALUE_LEN: usize = 65536;
/// The deepest a stored tree goes, in directories below its root: every capture
/// refuses a deeper one (naming the path), so every walk of stored trees is bounded,
/// and so is every walk casfs makes of a directory a less trusted party can deepen
/// (a removal, a capture). Real trees are a few dozen deep; only a program making one
/// on purpose goes further.
pub const MAX_TREE_DEPTH: usize = 1024;

/// What an entry is, with what its kind needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryContent {
    File(FileId),
    Dir(TreeId),
    Symlink(Vec<u8>),
    Fifo,
    CharDevice { rdev: u64 },
    BlockDevice { rdev: u64 },
}

impl EntryContent {
    fn kind_code(&self) -> u8 {
        match self {
            EntryContent::File(_) => 1,
            EntryContent::Dir(_) => 2,
            EntryContent::Symlink(_) => 3,
            EntryContent::Fifo => 4,
            EntryContent::CharDevice { .. } => 5,
            EntryContent::BlockDevice { .. } => 6,
        }
    }

    pub fn kind_name(&self) -> &'static str {
        match self {
            EntryContent::File(_) => "file",
            EntryContent::Dir(_) => "dir",
            EntryContent::Symlink(_) => "symlink",
            EntryContent::Fifo => "fifo",
            EntryContent::CharDevice { .. } => "chardev",
            EntryContent::BlockDevice { .. } => "blockdev",
        }
    }
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeEntry {
    pub name: Vec<u8>,
    pub content: EntryContent,
    /// Permission bits, including setuid, setgid and sticky (at most 0o7777).
    pub mode: u32,
    pub mtime_ns: i64,
    /// Content length for files, target length for symlinks, 0 otherwise.
    pub size: u64,
    /// Extended attributes sorted by name.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl TreeEntry {
    pub fn tree_id(&self) -> Option<TreeId> {
        match self.content {
            EntryContent::Dir(id) => Some(id),
            _ => None,
        }
    }

    pub fn name_lossy(&self) -> String {
        String::from_utf8_lossy(&self.name).into_owned()
    }

    /// Checks everything about one entry that does not depend on its neighbours.
    pub fn validate(&self) -> Result<(), String> {
        validate_name(&self.name)?;
        self.check_fields()
            .map_err(|what| format!("entry {:?}: {what}", self.name_lossy()))
    }

    fn check_fields(&self) -> Result<(), String> {
        if self.mode > 0o7777 {
            return Err(format!("mode {:o} has bits beyond 0o7777", self.mode));
        }
        match &self.content {
            EntryContent::Symlink(target) => {
                if target.is_empty() || target.len() > MAX_SYMLINK_LEN || target.contains(&0) {
                    return Err("invalid symlink target".into());
                }
                if self.size != target.len() as u64 {
                    return Err("symlink size does not match its target".into());
                }
            }
            EntryContent::File(_) => {}
            _ if self.size != 0 => {
                return Err(format!("a {} has no size", self.content.kind_name()));
            }
            _ => {}
        }
        let mut prev: Option<&[u8]> = None;
        for (k, v) in &self.xattrs {
            if k.is_empty() || k.len() > MAX_XATTR_NAME_LEN || k.contains(&0) {
                return Err("invalid xattr name".into());
            }
            if v.len() > MAX_XATTR_VALUE_LEN {
                return Err("xattr value too long".into());
            }
            if prev.is_some_and(|p| p >= k.as_slice()) {
                return Err("xattrs not sorted and unique".into());
            }
            prev = Some(k);
        }
        Ok(())
    }
}

/// A name that may stand in a directory: not empty, not `.` or `..`, no `/`, no NUL.
pub fn validate_name(name: &[u8]) -> Result<(), String> {
    let problem = if name.is_empty() {
        return Err("empty entry name".into());
    } else if name == b"." || name == b".." {
        "is not allowed"
    } else if name.contains(&b'/') {
        "contains '/'"
    } else if name.contains(&0) {
        "contains NUL"
    } else if name.len() > MAX_NAME_LEN {
        "is longer than 255 bytes"
    } else {
        return Ok(());
    };
    Err(format!(
        "entry name {:?} {problem}",
        String::from_utf8_lossy(name)
    ))
}

/// A directory: entries sorted by name, names unique.
/// One name of [`Tree::zip_by_name`]: an entry only in the tree zipped (`Here`), only
/// in the other (`There`), or in both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Paired<'t> {
    Here(&'t TreeEntry),
    There(&'t TreeEntry),
    Both(&'t TreeEntry, &'t TreeEntry),
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tree {
    entries: Vec<TreeEntry>,
}

impl Tree {
    /// Builds a tree from entries already sorted by name; refuses unsorted, duplicate
    /// or invalid entries.
    pub fn from_sorted_entries(entries: Vec<TreeEntry>) -> Result<Tree, String> {
        for (i, e) in entries.iter().enumerate() {
            e.validate()?;
            if i > 0 && entries[i - 1].name >= e.name {
                return Err(format!(
                    "entries not sorted and unique at {:?}",
                    e.name_lossy()
                ));
            }
        }
        Ok(Tree { entries })
    }

    /// Builds a tree from entries in any order.
    pub fn from_entries(mut entries: Vec<TreeEntry>) -> Result<Tree, String> {
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Tree::from_sorted_entries(entries)
    }

    pub fn entries(&self) -> &[TreeEntry] {
        &self.entries
    }

    pub fn into_entries(self) -> Vec<TreeEntry> {
        self.entries
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Looks an entry up by name (binary search).
    pub fn get(&self, name: &[u8]) -> Option<&TreeEntry> {
        self.position(name).map(|i| &self.entries[i])
    }

    /// The index of the entry named `name` (binary search).
    pub fn position(&self, name: &[u8]) -> Option<usize> {
        self.entries
            .binary_search_by(|e| e.name.as_slice().cmp(name))
            .ok()
    }

    /// This tree's entries beside `other`'s, in name order, in one pass over both.
    pub fn zip_by_name<'t>(&'t self, other: &'t Tree) -> impl Iterator<Item = Paired<'t>> + 't {
        let (a, b) = (&self.entries, &other.entries);
        let (mut i, mut j) = (0, 0);
        std::iter::from_fn(move || {
            let pair = match (a.get(i), b.get(j)) {
                (None, None) => return None,
                (Some(x), None) => Paired::Here(x),
                (None, Some(y)) => Paired::There(y),
                (Some(x), Some(y)) => match x.name.cmp(&y.name) {
                    std::cmp::Ordering::Less => Paired::Here(x),
                    std::cmp::Ordering::Greater => Paired::There(y),
                    std::cmp::Ordering::Equal => Paired::Both(x, y),
                },
            };
            match pair {
                Paired::Here(_) => i += 1,
                Paired::There(_) => j += 1,
                Paired::Both(..) => (i, j) = (i + 1, j + 1),
            }
            Some(pair)
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.entries.len() * 64);
        out.push(TREE_VERSION);
        put_varint(&mut out, self.entries.len() as u64);
        for e in &self.entries {
            put_bytes(&mut out, &e.name);
            out.push(e.content.kind_code());
            put_varint(&mut out, e.mode as u64);
            put_zigzag(&mut out, e.mtime_ns);
            put_varint(&mut out, e.size);
            match &e.content {
                EntryContent::File(id) => out.extend_from_slice(id.0.as_bytes()),
                EntryContent::Dir(id) => out.extend_from_slice(id.0.as_bytes()),
                EntryContent::Symlink(t) => put_bytes(&mut out, t),
                EntryContent::Fifo => {}
                EntryContent::CharDevice { rdev } | EntryContent::BlockDevice { rdev } => {
                    put_varint(&mut out, *rdev)
                }
            }
            put_varint(&mut out, e.xattrs.len() as u64);
            for (k, v) in &e.xattrs {
                put_bytes(&mut out, k);
                put_bytes(&mut out, v);
            }
        }
        out
    }

    pub fn id(&self) -> TreeId {
        TreeId(Hash::of(&self.encode()))
    }

    /// Decodes and validates a tree. Never panics on any input.
    pub fn decode(bytes: &[u8]) -> Result<Tree, String> {
        let mut r = Reader::new(bytes);
        let version = r.u8()?;
        if version != TREE_VERSION {
            return Err(format!("unknown tree version {version}"));
        }
        // Every entry takes at least 8 bytes, which bounds the count by the input.
        let n = r.len(bytes.len() / 8, "entry count")?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.bytes(MAX_NAME_LEN, "name length")?.to_vec();
            let kind = r.u8()?;
            let mode = r.varint()?;
            if mode > 0o7777 {
                return Err(format!("mode {mode:o} out of range"));
            }
            let mtime_ns = r.zigzag()?;
            let size = r.varint()?;
            let content = match kind {
                1 => EntryContent::File(FileId(r.hash()?)),
                2 => EntryContent::Dir(TreeId(r.hash()?)),
                3 => EntryContent::Symlink(r.bytes(MAX_SYMLINK_LEN, "symlink length")?.to_vec()),
                4 => EntryContent::Fifo,
                5 => EntryContent::CharDevice { rdev: r.varint()? },
                6 => EntryContent::BlockDevice { rdev: r.varint()? },
                k => return Err(format!("unknown entry kind {k}")),
            };
            let nx = r.len(bytes.len(), "xattr count")?;
            let mut xattrs = Vec::with_capacity(nx.min(64));
            for _ in 0..nx {
                let k = r.bytes(MAX_XATTR_NAME_LEN, "xattr name length")?.to_vec();
                let v = r.bytes(MAX_XATTR_VALUE_LEN, "xattr value length")?.to_vec();
                xattrs.push((k, v));
            }
            entries.push(TreeEntry {
                name,
                content,
                mode: mode as u32,
                mtime_ns,
                size,
                xattrs,
            });
        }
        r.finish()?;
        Tree::from_sorted_entries(entries)
    }
}

/// What holds of a tree and every tree below it, noted when it is stored (see
/// [`ObjectStore::tree_facts`](crate::cas::ObjectStore::tree_facts)), for readers that would otherwise walk the tree to know
/// (a read-only view of a tree without extended attributes says it supports none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeFacts {
    /// Some entry of the tree or of a tree below has extended attributes.
    pub xattrs: bool,
}

impl TreeFacts {
    /// The facts of `tree`, given those of the trees below it (`sub`); unknown when
    /// they depend on a subtree's that are.
    pub fn of(tree: &Tree, sub: impl Fn(&TreeId) -> Option<TreeFacts>) -> Option<TreeFacts> {
        Self::of_over(tree, None, sub)
    }

    /// [`of`](Self::of) `tree`, made from `base` (a tree and its facts) by changing
    /// some entries: an entry equal to `base`'s of its name (its subtree too) adds
    /// nothing to facts that hold of `base` as a whole, so only the others are looked
    /// at. `base`'s extended attributes may be in an entry `tree` no longer has: then
    /// every entry is.
    pub fn of_over(
        tree: &Tree,
        base: Option<(&Tree, TreeFacts)>,
        sub: impl Fn(&TreeId) -> Option<TreeFacts>,
    ) -> Option<TreeFacts> {
        let same = |e: &TreeEntry| match base {
            Some((b, TreeFacts { xattrs: false })) => b.get(&e.name) == Some(e),
            _ => false,
        };
        // The changed entries' own attributes first (they settle it with no lookup),
        // their subtrees then.
        let mut subtrees = Vec::new();
        for e in tree.entries().iter().filter(|e| !same(e)) {
            if !e.xattrs.is_empty() {
                return Some(TreeFacts { xattrs: true });
            }
            subtrees.extend(e.tree_id());
        }
        let mut unknown = false;
        for id in subtrees {
            match sub(&id) {
                Some(f) if f.xattrs => return Some(f),
                Some(_) => {}
                None => unknown = true,
            }
        }
        (!unknown).then_some(TreeFacts { xattrs: false })
    }

    /// The stored form: one byte of flags.
    pub fn encode(self) -> [u8; 1] {
        [self.xattrs as u8]
    }

    /// The facts a stored value says; None for a value this version does not know.
    pub fn decode(v: &[u8]) -> Option<TreeFacts> {
        match v {
            [f] if *f <= 1 => Some(TreeFacts { xattrs: *f == 1 }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, data: &[u8]) -> TreeEntry {
        TreeEntry {
            name: name.as_bytes().to_vec(),
            content: EntryContent::File(FileId(Hash::of(data))),
            mode: 0o644,
            mtime_ns: -5,
            size: data.len() as u64,
            xattrs: vec![(b"user.a".to_vec(), b"1".to_vec())],
        }
    }

    fn sample() -> Tree {
        Tree::from_entries(vec![
            file("b.txt", b"bee"),
            file("a.txt", b"ay"),
            TreeEntry {
                name: b"link".to_vec(),
                content: EntryContent::Symlink(b"../x".to_vec()),
                mode: 0o777,
                mtime_ns: 1_700_000_000_123_456_789,
                size: 4,
                xattrs: vec![],
            },
            TreeEntry {
                name: b"sub".to_vec(),
                content: EntryContent::Dir(TreeId(Hash::of(b"t"))),
                mode: 0o755,
                mtime_ns: 0,
                size: 0,
                xattrs: vec![],
            },
            TreeEntry {
                name: b"pipe".to_vec(),
                content: EntryContent::Fifo,
                mode: 0o600,
                mtime_ns: 0,
                size: 0,
                xattrs: vec![],
            },
        ])
        .unwrap()
    }

    #[test]
    fn round_trip_is_canonical() {
        let t = sample();
        let enc = t.encode();
        let back = Tree::decode(&enc).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.encode(), enc);
        assert_eq!(t.entries()[0].name, b"a.txt");
        assert!(t.get(b"link").is_some());
        assert!(t.get(b"nope").is_none());
        // Same entries in another order: same id.
        let mut rev = t.entries().to_vec();
        rev.reverse();
        assert_eq!(Tree::from_entries(rev).unwrap().id(), t.id());
    }

    #[test]
    fn decoder_refuses_every_truncation_and_bad_names() {
        let enc = sample().encode();
        for cut in 0..enc.len() {
            assert!(Tree::decode(&enc[..cut]).is_err(), "cut {cut}");
        }
        for bad in ["", ".", "..", "a/b", "a\0b"] {
            let e = TreeEntry {
                name: bad.as_bytes().to_vec(),
                ..file("x", b"")
            };
            assert!(Tree::from_entries(vec![e.clone()]).is_err(), "{bad:?}");
            // Hand-encode a tree with the bad name: decode refuses it too.
            let mut t = Tree::default();
            t.entries.push(e);
            assert!(Tree::decode(&t.encode()).is_err(), "{bad:?}");
        }
        let dup = vec![file("a", b"1"), file("a", b"2")];
        assert!(Tree::from_entries(dup).is_err());
    }

    #[test]
    fn decoder_survives_random_mutation() {
        let enc = sample().encode();
        let mut x: u64 = 0x1234_5678;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut m = enc.clone();
            let i = (x as usize) % m.len();
            m[i] = (x >> 32) as u8;
            let _ = Tree::decode(&m);
        }
    }
}

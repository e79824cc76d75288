//! The directory cache: what casfs last saw of each directory of a captured or restored
//! plain directory, kept in the store like git's index with its cache-tree.
//!
//! For each directory it keeps the tree last stored for it and, per entry, the
//! [`Fingerprint`] the entry had then. A capture that finds an entry's fingerprint
//! unchanged reuses the stored entry without reading the file or listing its xattrs;
//! a directory whose entries all come out the same reuses its tree id without encoding
//! or storing anything. A restore that finds a file's fingerprint unchanged and its
//! stored entry equal to the wanted one does not touch it.
//!
//! A fingerprint is recorded only when it is trustworthy: for a capture, when the
//! entry's ctime is older than the capture's start by more than the timestamp
//! granularity (otherwise a write within the same clock tick could go unseen, git's
//! "racily clean" problem); for a restore, when the restored mtime is old. Otherwise the
//! entry is kept without a fingerprint and is read again next time.
//!
//! Column family `dircache`: key `scope(16) ++ relative directory path` (the root is the
//! empty path, children `a`, `a/b`, ...), value `version | tree id | count |
//! (flag fingerprint?)* | encoded tree`.

use crate::sys::Locked;
use std::path::Path;
use std::sync::Mutex;

use super::watch::Token;
use crate::cas::{Batch, Hash, Tree, TreeEntry, TreeId};
use crate::checkpoint::ids::CheckpointResult;
use crate::checkpoint::store::Store;
use crate::sys::dirfd::Fingerprint;

pub use crate::checkpoint::store::DIRCACHE_CF;

const VERSION: u8 = 1;

/// What the cache holds for one directory.
#[derive(Debug, Clone)]
pub struct DirCache {
    pub tree_id: TreeId,
    pub tree: Tree,
    /// One per tree entry, in order; `None` where the entry must be looked at again.
    pub fingerprints: Vec<Option<Fingerprint>>,
}

impl DirCache {
    /// The cached entry named `name`: its index, the entry and its fingerprint.
    pub fn find(&self, name: &[u8]) -> Option<(usize, &TreeEntry, Option<Fingerprint>)> {
        let i = self
            .tree
            .entries()
            .binary_search_by(|e| e.name.as_slice().cmp(name))
            .ok()?;
        Some((i, &self.tree.entries()[i], self.fingerprints[i]))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(40 + self.fingerprints.len() * 45);
        v.push(VERSION);
        v.extend_from_slice(self.tree_id.0.as_bytes());
        v.extend_from_slice(&(self.fingerprints.len() as u32).to_le_bytes());
        for f in &self.fingerprints {
            match f {
                Some(f) => {
                    v.push(1);
                    f.encode_into(&mut v);
                }
                None => v.push(0),
            }
        }
        v.extend_from_slice(&self.tree.encode());
        v
    }

    /// Decodes a stored entry; `None` for anything not written by `encode` (the cache
    /// then treats the directory as not cached).
    pub fn decode(b: &[u8]) -> Option<DirCache> {
        if b.first() != Some(&VERSION) || b.len() < 37 {
            return None;
        }
        let tree_id = TreeId(Hash::from_slice(&b[1..33])?);
        let n = u32::from_le_bytes(b[33..37].try_into().ok()?) as usize;
        let mut pos = 37;
        let mut fingerprints = Vec::with_capacity(n.min(b.len()));
        for _ in 0..n {
            match *b.get(pos)? {
                0 => {
                    fingerprints.push(None);
                    pos += 1;
                }
                1 => {
                    let f = Fingerprint::decode(b.get(pos + 1..pos + 1 + Fingerprint::LEN)?)?;
                    fingerprints.push(Some(f));
                    pos += 1 + Fingerprint::LEN;
                }
                _ => return None,
            }
        }
        let tree_bytes = &b[pos..];
        if Hash::of(tree_bytes) != tree_id.0 {
            return None;
        }
        let tree = Tree::decode(tree_bytes).ok()?;
        if tree.len() != n {
            return None;
        }
        Some(DirCache {
            tree_id,
            tree,
            fingerprints,
        })
    }
}

/// Every cached directory of every scope: the key and what it holds (`None`: a value
/// that does not decode, which the cache itself treats as absent).
pub fn all_entries(store: &Store) -> CheckpointResult<Vec<(Vec<u8>, Option<DirCache>)>> {
    let db = store.database();
    let mut out = Vec::new();
    for item in db.column(DIRCACHE_CF).entries() {
        let (k, v) = item?;
        if is_token_key(&k) {
            continue;
        }
        out.push((k.to_vec(), DirCache::decode(&v)));
    }
    Ok(out)
}

/// Forgets the cached directories under these keys (from [`all_entries`]).
pub fn remove(store: &Store, keys: &[Vec<u8>]) -> CheckpointResult<()> {
    let db = store.database();
    let mut b = Batch::default();
    for k in keys {
        b.delete(&db.column(DIRCACHE_CF), k);
    }
    Ok(db.write(b, false)?)
}

/// A pending write: key and new value, or `None` to delete.
type Update = (Vec<u8>, Option<Vec<u8>>);

/// The cache of one captured or restored directory, read lazily and written at the end.
pub struct DirCacheSet<'a> {
    store: &'a Store,
    scope: [u8; 16],
    /// Whether to use what the cache holds (it is always updated).
    read: bool,
    updates: Mutex<Vec<Update>>,
    /// The watcher's token to record with the updates; without one, a recorded token
    /// is removed (the cache no longer matches what a watcher vouched for).
    token: Mutex<Option<Token>>,
}

/// Where the watcher's token is kept: after the root's key, with a NUL no path has.
const TOKEN_SUFFIX: &[u8] = b"\0watch";

/// Whether a `dircache` key is a watcher token's rather than a directory's.
fn is_token_key(k: &[u8]) -> bool {
    k.get(16) == Some(&0)
}

impl<'a> DirCacheSet<'a> {
    /// The cache of the directory at `root` (absolute and canonical). With `read` false
    /// the cache is ignored but still rewritten with what is seen.
    pub fn new(store: &'a Store, root: &Path, read: bool) -> Self {
        use std::os::unix::ffi::OsStrExt;
        let mut scope = [0u8; 16];
        scope.copy_from_slice(&Hash::of(root.as_os_str().as_bytes()).0[..16]);
        DirCacheSet {
            store,
            scope,
            read,
            updates: Mutex::new(Vec::new()),
            token: Mutex::new(None),
        }
    }

    /// Whether what the cache holds is used.
    pub fn reads(&self) -> bool {
        self.read
    }

    /// The watcher token the last capture recorded (only when the cache is read).
    pub fn token(&self) -> CheckpointResult<Option<Token>> {
        self.read_key(TOKEN_SUFFIX, Token::decode)
    }

    /// Records `t` when the updates are saved.
    pub fn set_token(&self, t: Token) {
        *self.token.locked() = Some(t);
    }

    fn key(&self, rel: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(16 + rel.len());
        k.extend_from_slice(&self.scope);
        k.extend_from_slice(rel);
        k
    }

    /// What the cache holds for the directory `rel`; an unreadable entry is ignored.
    pub fn get(&self, rel: &[u8]) -> CheckpointResult<Option<DirCache>> {
        self.read_key(rel, DirCache::decode)
    }

    /// The value under this cache's key for `suffix`, decoded (`None` when the cache is
    /// not read, the key is absent or the value does not decode).
    fn read_key<T>(
        &self,
        suffix: &[u8],
        decode: impl FnOnce(&[u8]) -> Option<T>,
    ) -> CheckpointResult<Option<T>> {
        if !self.read {
            return Ok(None);
        }
        let db = self.store.database();
        let v = db.column(DIRCACHE_CF).read(&self.key(suffix), decode)?;
        Ok(v.flatten())
    }

    pub fn put(&self, rel: &[u8], c: &DirCache) {
        self.updates
            .locked()
            .push((self.key(rel), Some(c.encode())));
    }

    /// Forgets the directory `rel` and everything below it.
    pub fn forget_subtree(&self, rel: &[u8]) {
        let mut u = self.updates.locked();
        u.push((self.key(rel), None));
        let mut below = rel.to_vec();
        below.push(b'/');
        u.push((self.key(&below), None));
    }

    /// Writes what changed. The cache is only an accelerator: it is written without
    /// syncing, and a lost update just means reading some files again.
    pub fn save(self) -> CheckpointResult<()> {
        let token_key = self.key(TOKEN_SUFFIX);
        let updates = self.updates.into_inner().unwrap_or_else(|p| p.into_inner());
        let token = self.token.into_inner().unwrap_or_else(|p| p.into_inner());
        let db = self.store.database();
        let col = db.column(DIRCACHE_CF);
        let mut batch = Batch::default();
        match token {
            Some(t) => batch.put(&col, token_key, t.encode()),
            None => batch.delete(&col, token_key),
        }
        for (k, v) in updates {
            match v {
                Some(v) => batch.put(&col, k, v),
                None if k.last() == Some(&b'/') => {
                    // Everything under "dir/": the range ["dir/", "dir0").
                    let mut end = k.clone();
                    *end.last_mut().expect("non-empty") = b'/' + 1;
                    batch.delete_range(&col, &k, &end);
                }
                None => batch.delete(&col, k),
            }
        }
        Ok(db.write(batch, false)?)
    }
}

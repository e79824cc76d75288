//! The persistent dirty set of a writable mount, in the `mounts` column family.
//!
//! Keys start with the mount's 8-byte key, then:
//! - `M`: the mount's base tree and an opaque tag the layer above keeps with it;
//! - `N` + inode (big-endian u64): the record of a node that differs from the base (or
//!   is referenced from a directory that does);
//! - `E` + directory inode + name: an override of one entry of a dirty directory, either
//!   a whiteout (the base entry is gone) or the inode of a node record.
//!
//! A directory's listing is its base tree's entries with its overrides applied, so making
//! a directory dirty writes one record, not its listing. Every mutation is one atomic
//! write batch through the write-ahead log (not synced: a killed daemon loses nothing
//! the kernel had accepted; `fsync` syncs the log).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::cas::{Batch, CasError, CasResult, Column, Database, FileId, TreeId};

/// The column family holding every mount's dirty set.
pub const MOUNTS_CF: &str = "mounts";

/// What kind of node a record describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Fifo,
    CharDev,
    BlockDev,
    Socket,
}

/// A dirty node as persisted.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeRecord {
    pub kind: Kind,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    /// Size of a file without an upper file, or of a symlink's target.
    pub size: u64,
    pub nlink: u32,
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// A directory's base tree (`None`: created in this mount).
    pub tree: Option<TreeId>,
    /// A file's stored content, when it has no upper file.
    pub clean: Option<FileId>,
    /// Whether the file's content is its upper file.
    pub upper: bool,
    pub target: Option<Vec<u8>>,
}

/// An override of one directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Override {
    Whiteout,
    Node(u64),
}

/// The base of a mount and the tag the layer above keeps with it (for checkpoints, the
/// thread and base checkpoint).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MountMeta {
    pub base: TreeId,
    #[serde(default = "null_tag")]
    pub tag: Tag,
}

/// What the layer above keeps with a workspace's base, as JSON text that `fs` stores and
/// hands back without reading it.
pub type Tag = Box<serde_json::value::RawValue>;

/// The tag of a workspace nobody tagged: JSON `null`.
pub fn null_tag() -> Tag {
    serde_json::value::RawValue::from_string("null".into()).expect("null is JSON")
}

/// One mount's slice of the `mounts` column family.
pub struct DirtyStore {
    db: Arc<Database>,
    key: [u8; 8],
}

fn decode_err(what: &str, detail: impl std::fmt::Display) -> CasError {
    CasError::Invalid(format!("dirty set: bad {what}: {detail}"))
}

/// The keys of every mount that has anything in the `mounts` column family.
pub fn mount_keys(db: &Database) -> CasResult<Vec<[u8; 8]>> {
    let mut out: Vec<[u8; 8]> = Vec::new();
    let col = db.column(MOUNTS_CF);
    let mut at = Vec::new();
    while let Some(k) = col.key_at_or_after(&at)? {
        if k.len() < 8 {
            at = k;
            at.push(0);
            continue;
        }
        let key: [u8; 8] = k[..8].try_into().expect("8 bytes");
        out.push(key);
        // Skip to the next mount's keys.
        at = key.to_vec();
        at.push(0xff);
        at.push(0xff);
    }
    Ok(out)
}

impl DirtyStore {
    pub fn new(db: Arc<Database>, key: [u8; 8]) -> DirtyStore {
        DirtyStore { db, key }
    }

    fn k(&self, tag: u8, rest: &[&[u8]]) -> Vec<u8> {
        let mut k = Vec::with_capacity(32);
        k.extend_from_slice(&self.key);
        k.push(tag);
        for r in rest {
            k.extend_from_slice(r);
        }
        k
    }

    pub fn database(&self) -> &Database {
        &self.db
    }

    fn col(&self) -> Column<'_> {
        self.db.column(MOUNTS_CF)
    }

    pub fn batch(&self) -> Batch {
        Batch::default()
    }

    /// Applies `batch` through the write-ahead log, without syncing it.
    pub fn commit(&self, batch: Batch) -> CasResult<()> {
        crate::crashpoint("dirty.commit");
        self.db.write(batch, false)
    }

    /// Makes every committed batch durable.
    pub fn sync(&self) -> CasResult<()> {
        self.db.sync()
    }

    pub fn put_meta(&self, b: &mut Batch, meta: &MountMeta) {
        let v = serde_json::to_vec(meta).expect("meta serializes");
        b.put(&self.col(), self.k(b'M', &[]), v);
    }

    pub fn meta(&self) -> CasResult<Option<MountMeta>> {
        let v = self.col().get(&self.k(b'M', &[]))?;
        v.map(|v| serde_json::from_slice(&v).map_err(|e| decode_err("mount record", e)))
            .transpose()
    }

    pub fn put_node(&self, b: &mut Batch, ino: u64, rec: &NodeRecord) {
        let v = serde_json::to_vec(rec).expect("record serializes");
        b.put(&self.col(), self.k(b'N', &[&ino.to_be_bytes()]), v);
    }

    pub fn delete_node(&self, b: &mut Batch, ino: u64) {
        b.delete(&self.col(), self.k(b'N', &[&ino.to_be_bytes()]));
    }

    pub fn put_entry(&self, b: &mut Batch, dir: u64, name: &[u8], o: Override) {
        let v = match o {
            Override::Whiteout => vec![0u8],
            Override::Node(ino) => {
                let mut v = vec![1u8];
                v.extend_from_slice(&ino.to_be_bytes());
                v
            }
        };
        b.put(&self.col(), self.k(b'E', &[&dir.to_be_bytes(), name]), v);
    }

    /// Forgets every node record and override (the base keeps its record).
    pub fn clear(&self, b: &mut Batch) {
        let col = self.col();
        b.delete_range(&col, &self.k(b'E', &[]), &self.k(b'E' + 1, &[]));
        b.delete_range(&col, &self.k(b'N', &[]), &self.k(b'N' + 1, &[]));
    }

    /// Forgets this mount entirely.
    pub fn clear_all(&self, b: &mut Batch) {
        let mut end = self.key.to_vec();
        end.push(0xff);
        b.delete_range(&self.col(), &self.key, &end);
    }

    fn scan(&self, prefix: Vec<u8>) -> CasResult<Vec<(Vec<u8>, Vec<u8>)>> {
        Ok(self
            .col()
            .prefixed(&prefix)?
            .into_iter()
            .map(|(k, v)| (k[prefix.len()..].to_vec(), v))
            .collect())
    }

    /// Every node record.
    pub fn nodes(&self) -> CasResult<Vec<(u64, NodeRecord)>> {
        let mut out = Vec::new();
        for (k, v) in self.scan(self.k(b'N', &[]))? {
            let ino = u64::from_be_bytes(
                k.as_slice()
                    .try_into()
                    .map_err(|_| decode_err("node key", k.len()))?,
            );
            let rec = serde_json::from_slice(&v).map_err(|e| decode_err("node record", e))?;
            out.push((ino, rec));
        }
        Ok(out)
    }

    /// Every entry override of every directory: (directory, name, override).
    pub fn all_entries(&self) -> CasResult<Vec<(u64, Vec<u8>, Override)>> {
        let mut out = Vec::new();
        for (k, v) in self.scan(self.k(b'E', &[]))? {
            if k.len() < 8 {
                return Err(decode_err("entry key", k.len()));
            }
            let dir = u64::from_be_bytes(k[..8].try_into().expect("8 bytes"));
            out.push((dir, k[8..].to_vec(), decode_override(&v)?));
        }
        Ok(out)
    }

    /// The overrides of directory `dir`.
    pub fn entries(&self, dir: u64) -> CasResult<Vec<(Vec<u8>, Override)>> {
        let mut out = Vec::new();
        for (name, v) in self.scan(self.k(b'E', &[&dir.to_be_bytes()]))? {
            out.push((name, decode_override(&v)?));
        }
        Ok(out)
    }
}

/// Decodes a stored entry override.
pub fn decode_override(v: &[u8]) -> CasResult<Override> {
    match v {
        [0] => Ok(Override::Whiteout),
        [1, rest @ ..] if rest.len() == 8 => Ok(Override::Node(u64::from_be_bytes(
            rest.try_into().expect("8 bytes"),
        ))),
        _ => Err(decode_err("entry override", format!("{v:?}"))),
    }
}

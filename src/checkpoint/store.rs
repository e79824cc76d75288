//! A store directory: `<store>/casfs.json` (format marker), `<store>/lock` (held by the
//! process that has the store open), `<store>/id` (the store's random name: a fleet
//! tells its mounts apart by it), `<store>/db` (RocksDB with every column family) and
//! `<store>/mounts/<key>/` (the files of each writable mount: upper files, its control
//! socket and pid file).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::checkpoint_store::CheckpointStore;
use super::ids::{CheckpointError, CheckpointId, CheckpointResult};
use super::portable_kv::{PortableKv, RocksPortable};
use super::record::MountTag;
use super::rocks_store::RocksCheckpointStore;
use super::rocks_store::COLUMN_FAMILIES;
use crate::cas::{Database, Hash, ObjectStore, RocksObjectStore, TreeId};
use crate::fs::{mount_key, Owner};

const MARKER: &str = "casfs.json";
const ID_FILE: &str = "id";

/// The column family of the directory cache (`sync::dircache`).
pub const DIRCACHE_CF: &str = "dircache";
const FORMAT: u32 = 1;

/// Whether opening may create the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    Create,
    MustExist,
}

/// Where a store's checkpoints and objects live beyond its own RocksDB (fleet
/// backends): URLs without credentials, from the store's `casfs.json` or the command
/// line.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Backends {
    /// `postgres://user@host:port/db?schema=NAME` (password from PGPASSWORD).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<String>,
    /// `s3://bucket/prefix` and the like (credentials from the environment); the local
    /// RocksDB becomes a read-through cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objects: Option<String>,
}

impl Backends {
    pub fn is_fleet(&self) -> bool {
        self.checkpoints.is_some() || self.objects.is_some()
    }

    /// `self`, with what `over` names replacing it.
    pub fn overridden_by(&self, over: &Backends) -> Backends {
        Backends {
            checkpoints: over
                .checkpoints
                .clone()
                .or_else(|| self.checkpoints.clone()),
            objects: over.objects.clone().or_else(|| self.objects.clone()),
        }
    }
}

/// An open store: objects and checkpoints in one RocksDB, exclusively this process's;
/// with fleet backends, checkpoints in PostgreSQL and objects in object storage (the
/// RocksDB then caches objects and keeps the mounts' dirty sets). Which backend answers
/// is chosen once, when the store opens: every layer above sees the traits.
pub struct Store {
    root: PathBuf,
    db: Arc<Database>,
    /// The objects in this host's RocksDB: the store's own, or the cache of fleet
    /// objects.
    local: Arc<RocksObjectStore>,
    /// The object store in use: `local`, or the remote reading through it.
    objects: Arc<dyn ObjectStore>,
    /// With fleet objects: the remote (its packs are collected, synced and verified).
    remote: Option<Arc<crate::cas::remote_store::RemoteObjectStore>>,
    /// The checkpoint store in use: the embedded RocksDB's, or PostgreSQL's.
    checkpoints: Arc<dyn CheckpointStore>,
    /// The one portable backend of this open store: its transactions are serialized
    /// by it, so every request shares it.
    portable_kv: Arc<dyn PortableKv>,
    backends: Backends,
    /// The store's name in a fleet (`<store>/id`), made when it is first opened for
    /// writing; `None` for a read-only open of a store that has none yet.
    id: Option<String>,
    /// `None` for a read-only open, which takes no lock.
    _lock: Option<File>,
}

impl Store {
    /// Opens the store at `root`, waiting up to `lock_timeout` for another process that
    /// has it open.
    pub fn open(root: &Path, mode: OpenMode, lock_timeout: Duration) -> CheckpointResult<Store> {
        Self::open_with(root, mode, lock_timeout, &Backends::default())
    }

    /// Opens the store with the backends its `casfs.json` names, overridden by `over`.
    pub fn open_with(
        root: &Path,
        mode: OpenMode,
        lock_timeout: Duration,
        over: &Backends,
    ) -> CheckpointResult<Store> {
        Self::open_with_families(root, mode, lock_timeout, over, &[])
    }

    /// [`Store::open_with`], also creating the column families a layer above keeps in
    /// the store's database (the middleware's `host`). Column families the database
    /// has are always opened.
    pub fn open_with_families(
        root: &Path,
        mode: OpenMode,
        lock_timeout: Duration,
        over: &Backends,
        families: &[&str],
    ) -> CheckpointResult<Store> {
        let marker = root.join(MARKER);
        if !marker.exists() {
            if mode == OpenMode::MustExist {
                return Err(CheckpointError::path(
                    root,
                    "no casfs store here (run `casfs init`, or pass --store / set CASFS_STORE)",
                ));
            }
            if root.exists() {
                let non_empty = std::fs::read_dir(root)
                    .map_err(|e| CheckpointError::io(root, e))?
                    .next()
                    .is_some();
                if non_empty {
                    return Err(CheckpointError::path(
                        root,
                        "exists, is not empty and is not a casfs store; refusing to use it",
                    ));
                }
            }
            std::fs::create_dir_all(root).map_err(|e| CheckpointError::io(root, e))?;
            let tmp = root.join(format!("{MARKER}.tmp"));
            std::fs::write(&tmp, format!("{{\"format\": {FORMAT}}}\n"))
                .map_err(|e| CheckpointError::io(&tmp, e))?;
            std::fs::rename(&tmp, &marker).map_err(|e| CheckpointError::io(&marker, e))?;
        }
        let text = std::fs::read_to_string(&marker).map_err(|e| CheckpointError::io(&marker, e))?;
        let format = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("format").and_then(|f| f.as_u64()));
        if format != Some(FORMAT as u64) {
            return Err(CheckpointError::path(
                &marker,
                format!("unsupported store format (this casfs reads format {FORMAT})"),
            ));
        }
        let backends = read_backends(&marker)?.overridden_by(over);
        let lock = lock_store(root, lock_timeout)?;
        keep_private(root)?;
        store_id(root, true)?;
        let mut cfs: Vec<&str> = COLUMN_FAMILIES.to_vec();
        cfs.push(DIRCACHE_CF);
        cfs.push(crate::fs::MOUNTS_CF);
        cfs.push(crate::cas::remote_store::REMOTE_CF);
        cfs.push(super::portable_kv::PORTABLE_CF);
        cfs.extend_from_slice(families);
        let db = Arc::new(Database::open(&root.join("db"), &cfs)?);
        Store::assemble(root, db, Some(lock), backends)
    }

    fn assemble(
        root: &Path,
        db: Arc<Database>,
        lock: Option<File>,
        backends: Backends,
    ) -> CheckpointResult<Store> {
        let local = Arc::new(RocksObjectStore::new(db.clone()));
        let remote = match &backends.objects {
            Some(url) => Some(Arc::new(crate::cas::remote_store::RemoteObjectStore::open(
                local.clone(),
                url,
                Some(root.join("remote-index")),
            )?)),
            None => None,
        };
        let objects: Arc<dyn ObjectStore> = match &remote {
            Some(r) => r.clone(),
            None => local.clone(),
        };
        let (checkpoints, kv): (Arc<dyn CheckpointStore>, Arc<dyn PortableKv>) =
            match &backends.checkpoints {
                Some(url) => {
                    let pg = Arc::new(super::pg_store::PgCheckpointStore::open(url)?);
                    (pg.clone(), pg)
                }
                None => (
                    Arc::new(RocksCheckpointStore::new(db.clone())),
                    Arc::new(RocksPortable::new(db.clone())),
                ),
            };
        Ok(Store {
            id: store_id(root, false)?,
            portable_kv: kv,
            root: root.to_path_buf(),
            local,
            objects,
            remote,
            checkpoints,
            backends,
            db,
            _lock: lock,
        })
    }

    /// Writes `backends` into the store's `casfs.json` (URLs only; credentials never
    /// belong there and are refused).
    pub fn save_backends(root: &Path, backends: &Backends) -> CheckpointResult<()> {
        let marker = root.join(MARKER);
        for url in backends.checkpoints.iter().chain(&backends.objects) {
            let u = url::Url::parse(url)
                .map_err(|e| CheckpointError::Invalid(format!("backend URL: {e}")))?;
            if u.password().is_some() {
                return Err(CheckpointError::Invalid(
                    "a backend URL with a password is never written to disk; give the password in the environment".into(),
                ));
            }
        }
        let mut v = serde_json::json!({"format": FORMAT});
        if let Some(c) = &backends.checkpoints {
            v["checkpoints"] = c.clone().into();
        }
        if let Some(o) = &backends.objects {
            v["objects"] = o.clone().into();
        }
        let tmp = root.join(format!("{MARKER}.tmp"));
        std::fs::write(&tmp, format!("{v:#}\n")).map_err(|e| CheckpointError::io(&tmp, e))?;
        std::fs::rename(&tmp, &marker).map_err(|e| CheckpointError::io(&marker, e))
    }

    /// The name under which the mount with dirty-set key `key` pins checkpoints in the
    /// checkpoint store: this host's name, the store's and the mount's.
    pub fn pin_holder(&self, key: &[u8; 8]) -> String {
        format!(
            "{}/{}/{}",
            super::lease::this_host(),
            self.id.as_deref().unwrap_or("-"),
            key_hex(key)
        )
    }

    /// Pins what a mount reads from ([`CheckpointStore::pin`]): the base and expected
    /// head of `tag`, added to its pins or replacing them. A mount pins a checkpoint
    /// before it reads the record, so retention on another host keeps it.
    pub fn pin_mount(&self, key: &[u8; 8], tag: &MountTag, replace: bool) -> CheckpointResult<()> {
        if self.backends.checkpoints.is_none() {
            // The embedded store's mounts are this host's: their dirty sets say it.
            return Ok(());
        }
        let ids: Vec<CheckpointId> = tag.base.into_iter().chain(tag.expected_head).collect();
        self.checkpoints.pin(&self.pin_holder(key), &ids, replace)
    }

    /// Drops a discarded mount's pins.
    pub fn unpin_mount(&self, key: &[u8; 8]) -> CheckpointResult<()> {
        if self.backends.checkpoints.is_none() {
            return Ok(());
        }
        self.checkpoints.unpin(&self.pin_holder(key))
    }

    /// The backends in use.
    pub fn backends(&self) -> &Backends {
        &self.backends
    }

    /// The remote object store, with fleet objects.
    pub fn remote(&self) -> Option<&Arc<crate::cas::remote_store::RemoteObjectStore>> {
        self.remote.as_ref()
    }

    /// Opens an existing store read-only, without waiting for or taking its lock: a
    /// writer may have it open. Sees what was durable when it was opened, which includes
    /// every appended checkpoint and its objects.
    pub fn open_read_only(root: &Path) -> CheckpointResult<Store> {
        Self::open_read_only_with(root, &Backends::default())
    }

    /// [`Store::open_read_only`] with backends as in [`Store::open_with`].
    pub fn open_read_only_with(root: &Path, over: &Backends) -> CheckpointResult<Store> {
        if !root.join(MARKER).exists() {
            return Err(CheckpointError::path(
                root,
                "no casfs store here (run `casfs init`, or pass --store / set CASFS_STORE)",
            ));
        }
        let backends = read_backends(&root.join(MARKER))?.overridden_by(over);
        let db = Arc::new(Database::open_read_only(&root.join("db"))?);
        Store::assemble(root, db, None, backends)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn database(&self) -> &Arc<Database> {
        &self.db
    }

    pub fn objects(&self) -> &dyn ObjectStore {
        self.objects.as_ref()
    }

    /// The object store, shareable with threads that outlive a borrow (the mount).
    pub fn objects_shared(&self) -> Arc<dyn ObjectStore> {
        self.objects.clone()
    }

    pub fn checkpoints(&self) -> &dyn CheckpointStore {
        self.checkpoints.as_ref()
    }

    /// The checkpoint store, shareable with threads that outlive a borrow (a lease's
    /// renewer).
    pub fn checkpoints_shared(&self) -> Arc<dyn CheckpointStore> {
        self.checkpoints.clone()
    }

    /// The backend of the portable checkpoint stores (an agent framework's own records,
    /// `middleware::portable`), where the checkpoints are: the store's RocksDB, or
    /// PostgreSQL with fleet checkpoints. Every call answers the same backend (a
    /// clone), so each operation is one atomic step whichever request makes it.
    pub fn portable_kv(&self) -> Arc<dyn PortableKv> {
        self.portable_kv.clone()
    }

    /// The objects in this host's RocksDB: the whole object store when it is embedded,
    /// the cache of fleet objects otherwise. Garbage collection sweeps it, holding its
    /// fence.
    pub fn local_objects(&self) -> &RocksObjectStore {
        &self.local
    }
}

/// The backends a store's `casfs.json` names.
fn read_backends(marker: &Path) -> CheckpointResult<Backends> {
    let text = std::fs::read_to_string(marker).map_err(|e| CheckpointError::io(marker, e))?;
    serde_json::from_str(&text).map_err(|e| CheckpointError::path(marker, format!("backends: {e}")))
}

fn lock_store(root: &Path, timeout: Duration) -> CheckpointResult<File> {
    let path = root.join("lock");
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| CheckpointError::io(&path, e))?;
    let start = Instant::now();
    let mut delay = Duration::from_millis(5);
    loop {
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => break,
            Err(rustix::io::Errno::WOULDBLOCK) => {}
            Err(e) => return Err(CheckpointError::io(&path, e.into())),
        }
        if start.elapsed() >= timeout {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            return Err(CheckpointError::path(
                root,
                format!(
                    "store is in use by another casfs process ({}) and stayed busy for {:?}",
                    holder.trim(),
                    timeout
                ),
            ));
        }
        std::thread::sleep(delay);
        delay = (delay * 2).min(Duration::from_millis(100));
    }
    let _ = file.set_len(0);
    let _ = file.rewind();
    let _ = write!(file, "pid {}", std::process::id());
    Ok(file)
}

/// Where the overlay backend keeps the EROFS images of trees (a cache, rebuilt when
/// missing), named by [`image_name`].
pub fn images_dir(store_root: &Path) -> PathBuf {
    store_root.join("images")
}

/// The file name of the image of `tree` with its files `owner`'s: `<tree id>.erofs`
/// for root's, `<tree id>.<uid>-<gid>.erofs` for a workspace of another user.
pub fn image_name(tree: &TreeId, owner: Owner) -> String {
    match owner {
        Owner { uid: 0, gid: 0 } => format!("{}.erofs", tree.0.to_hex()),
        Owner { uid, gid } => format!("{}.{uid}-{gid}.erofs", tree.0.to_hex()),
    }
}

/// The file name that marks a tree the image format cannot hold (it holds the reason).
pub fn unsupported_image_name(tree: &TreeId) -> String {
    format!("{}.unsupported", tree.0.to_hex())
}

/// The tree a file in the images directory is of (an image, a marker, a build's
/// temporary file), from its name; `None` for a name casfs did not make.
pub fn image_tree(name: &str) -> Option<TreeId> {
    name.split('.').next().and_then(Hash::from_hex).map(TreeId)
}

/// The store's random name (`<store>/id`, 16 hex digits), written once when `create`
/// (the store's lock is held then, so no two processes write it).
fn store_id(root: &Path, create: bool) -> CheckpointResult<Option<String>> {
    let path = root.join(ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let id = s.trim();
            if id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
                Ok(Some(id.to_string()))
            } else {
                Err(CheckpointError::path(
                    &path,
                    "is not a store id (16 hex digits)",
                ))
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
            let mut b = [0u8; 8];
            getrandom::fill(&mut b).expect("the system's random source");
            let id = key_hex(&b);
            let tmp = root.join(format!("{ID_FILE}.tmp"));
            std::fs::write(&tmp, format!("{id}\n")).map_err(|e| CheckpointError::io(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| CheckpointError::io(&path, e))?;
            Ok(Some(id))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CheckpointError::io(&path, e)),
    }
}

/// Where a mount's files live in the store.
pub fn mount_dir(store_root: &Path, mountpoint: &Path) -> PathBuf {
    mount_dir_of_key(store_root, &mount_key(mountpoint))
}

/// A mount key as it names the mount's directory: 16 hex digits.
pub fn key_hex(key: &[u8; 8]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where the files of the mount with dirty-set key `key` live in the store.
pub fn mount_dir_of_key(store_root: &Path, key: &[u8; 8]) -> PathBuf {
    store_root.join("mounts").join(key_hex(key))
}

/// The store's own directories, 0700 whatever the umask was: they hold every
/// workspace's uncaptured work (a mount's upper files, an overlay's upper directory),
/// the images its lowers are made of and the database, none of it for other users to
/// reach (an upper holds set-id files and is not mounted `nosuid`). The store's root
/// keeps its mode: a server's sandboxes directory may be in it, for members to reach.
const PRIVATE_DIRS: &[&str] = &["db", "mounts", "images", "remote-index"];

fn keep_private(root: &Path) -> CheckpointResult<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    for name in PRIVATE_DIRS {
        let dir = root.join(name);
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(CheckpointError::io(&dir, e)),
        }
        let m = std::fs::symlink_metadata(&dir).map_err(|e| CheckpointError::io(&dir, e))?;
        if !m.is_dir() {
            return Err(CheckpointError::path(&dir, "is not a directory"));
        }
        if m.permissions().mode() & 0o077 != 0 {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| CheckpointError::io(&dir, e))?;
        }
    }
    Ok(())
}

//! A store directory: `<store>/casfs.json` (format marker), `<store>/lock` (held by the
//! process that has the store open) and `<store>/db` (RocksDB with every column family).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::dircache::DIRCACHE_CF;
use super::rocks_store::COLUMN_FAMILIES;
use super::{CheckpointError, CheckpointResult, CheckpointStore, RocksCheckpointStore};
use crate::cas::{Database, ObjectStore, RocksObjectStore};

const MARKER: &str = "casfs.json";
const FORMAT: u32 = 1;

/// Whether opening may create the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    Create,
    MustExist,
}

/// A column family for what an agent host keeps beside its checkpoints (the
/// middleware's conversation, artifact and blob stores): plain keys, not objects.
pub const HOST_CF: &str = "host";

/// An open store: objects and checkpoints in one RocksDB, exclusively this process's.
pub struct Store {
    root: PathBuf,
    db: Arc<Database>,
    objects: Arc<RocksObjectStore>,
    checkpoints: RocksCheckpointStore,
    /// `None` for a read-only open, which takes no lock.
    _lock: Option<File>,
}

impl Store {
    /// Opens the store at `root`, waiting up to `lock_timeout` for another process that
    /// has it open.
    pub fn open(root: &Path, mode: OpenMode, lock_timeout: Duration) -> CheckpointResult<Store> {
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
        let lock = lock_store(root, lock_timeout)?;
        let mut cfs: Vec<&str> = COLUMN_FAMILIES.to_vec();
        cfs.push(DIRCACHE_CF);
        cfs.push(crate::fs::MOUNTS_CF);
        cfs.push(HOST_CF);
        let db = Arc::new(Database::open(&root.join("db"), &cfs)?);
        Ok(Store {
            root: root.to_path_buf(),
            objects: Arc::new(RocksObjectStore::new(db.clone())),
            checkpoints: RocksCheckpointStore::new(db.clone()),
            db,
            _lock: Some(lock),
        })
    }

    /// Opens an existing store read-only, without waiting for or taking its lock: a
    /// writer may have it open. Sees what was durable when it was opened, which includes
    /// every appended checkpoint and its objects.
    pub fn open_read_only(root: &Path) -> CheckpointResult<Store> {
        if !root.join(MARKER).exists() {
            return Err(CheckpointError::path(
                root,
                "no casfs store here (run `casfs init`, or pass --store / set CASFS_STORE)",
            ));
        }
        let db = Arc::new(Database::open_read_only(&root.join("db"))?);
        Ok(Store {
            root: root.to_path_buf(),
            objects: Arc::new(RocksObjectStore::new(db.clone())),
            checkpoints: RocksCheckpointStore::new(db.clone()),
            db,
            _lock: None,
        })
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
        &self.checkpoints
    }

    /// The embedded checkpoint store itself (retention and fsck need more than the
    /// trait gives).
    pub fn rocks_checkpoints(&self) -> &RocksCheckpointStore {
        &self.checkpoints
    }

    /// The embedded object store itself (garbage collection sweeps it).
    pub fn rocks_objects(&self) -> &RocksObjectStore {
        &self.objects
    }
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
        // SAFETY: flock on a file descriptor we own.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            break;
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(CheckpointError::io(&path, err));
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

//! Checkpoints: immutable records naming a root tree, on threads whose heads move by
//! compare-and-swap under a writer lease with a fencing token. Also the capture and
//! restore of plain directories, and tree diffs.
//!
//! Depends on `cas` and `fs` (a mounted workspace checkpoints through this layer);
//! knows nothing of runs or the command line.

pub mod capture;
pub mod diff;
pub mod dircache;
mod error;
pub mod fsutil;
mod lease;
pub mod maintenance;
pub mod mountd;
pub mod pg_store;
mod record;
pub mod restore;
mod rocks_store;
mod store;
mod store_dir;
pub mod watch;
pub mod xattr;

pub use capture::{
    capture_dir, capture_to_thread, AppendOptions, CaptureOptions, CaptureProgress, Captured,
    ExpectedHead,
};
pub use error::{CheckpointError, CheckpointResult};
pub use lease::{holder_name, WriterLease};
pub use mountd::{discard_mount_state, MountCheckpoint, MountTag, MountedThread};
pub use pg_store::PgCheckpointStore;
pub use record::{
    Artifact, CaptureStats, Checkpoint, CheckpointBody, CheckpointId, ContentRef, NewCheckpoint,
    SecretFile, ThreadId,
};
pub use restore::{
    restore_tree, uncaptured_changes, RestoreOptions, RestoreProgress, RestoreStats,
};
pub use rocks_store::RocksCheckpointStore;
pub use store::CheckpointStore;
pub use store_dir::{Backends, OpenMode, Store, HOST_CF};

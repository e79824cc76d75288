//! Checkpoints: immutable records naming a root tree, on threads whose heads move by
//! compare-and-swap under a writer lease with a fencing token. Also the capture and
//! restore of plain directories, and tree diffs.
//!
//! Depends on `cas` and `fs` (capture filters, the dirty sets fsck and gc read); knows
//! nothing of mounts being served, runs or the command line.

pub mod capture;
mod checkpoint_store;
pub mod diff;
pub mod dircache;
pub mod dirfd;
mod error;
mod lease;
pub mod maintenance;
pub mod pg_store;
pub mod portable;
mod record;
pub mod refs;
pub mod restore;
mod rocks_store;
mod store;
pub mod watch;
pub mod xattr;

pub use capture::{
    capture_dir, capture_to_thread, AppendOptions, CaptureOptions, CaptureProgress, Captured,
    ExpectedHead,
};
pub use checkpoint_store::{Bookkeeping, CheckpointStore};
pub use error::{CheckpointError, CheckpointResult};
pub use lease::{
    holder_name, same_secret, secret_hex, LeaseKeeper, LeaseRecord, LeaseStatus, OwnerToken,
    WriterLease,
};
pub use pg_store::PgCheckpointStore;
pub use record::{check_tenant_name, MAX_TENANT_LEN};
pub use record::{
    Artifact, CaptureStats, Checkpoint, CheckpointBody, CheckpointId, ContentRef, MountTag,
    NewCheckpoint, RootMeta, SecretFile, ThreadId,
};
pub use restore::{
    restore_tree, uncaptured_changes, RestoreOptions, RestoreProgress, RestoreStats,
};
pub use rocks_store::RocksCheckpointStore;
pub use store::{images_dir, key_hex, mount_dir, mount_dir_of_key, Backends, OpenMode, Store};

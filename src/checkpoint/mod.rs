//! Checkpoints: immutable records naming a root tree, on threads whose heads move by
//! compare-and-swap under a writer lease with a fencing token. Also the capture and
//! restore of plain directories, and tree diffs.
//!
//! Depends on `cas` and `fs` (capture filters, the dirty sets fsck and gc read); knows
//! nothing of mounts being served, runs or the command line.

mod checkpoint_store;
pub mod diff;
mod ids;
mod keeper;
mod lease;
pub mod maintenance;
pub mod pg_store;
pub mod portable_kv;
mod record;
pub mod refs;
mod rocks_store;
mod store;
pub mod sync;

pub use checkpoint_store::{Bookkeeping, CheckpointStore};
pub use ids::{check_tenant_name, CheckpointId, ThreadId, MAX_TENANT_LEN};
pub use ids::{CheckpointError, CheckpointResult};
pub use keeper::{LeaseKeeper, LeaseStatus};
pub use lease::{
    holder_name, millis, same_secret, secret_hex, LeaseRecord, OwnerToken, WriterLease,
};
pub use pg_store::PgCheckpointStore;
pub use record::{
    Artifact, CaptureStats, Checkpoint, CheckpointBody, ContentRef, MountTag, NewCheckpoint,
    RootMeta, SecretFile,
};
pub use rocks_store::RocksCheckpointStore;
pub use store::{
    image_name, image_tree, images_dir, key_hex, mount_dir, mount_dir_of_key,
    unsupported_image_name, Backends, OpenMode, Store,
};
pub use sync::capture::{
    capture_dir, capture_to_thread, AppendOptions, CaptureOptions, CaptureProgress, Captured,
    ExpectedHead,
};
pub use sync::restore::{
    restore_tree, uncaptured_changes, RestoreOptions, RestoreProgress, RestoreStats,
};

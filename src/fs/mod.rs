//! The FUSE filesystem.
//!
//! This first part serves any stored tree read-only ([`TreeView`]): directories and
//! file contents are loaded lazily from the object store when the kernel asks, every
//! object is verified (damage is EIO, never wrong bytes), and large files are read chunk
//! by chunk through a bounded chunk cache. The writable overlay (copy-up, dirty set,
//! O(changed) checkpoint, root swap) builds on the same inode table.
//!
//! Depends on `cas` only: it knows trees and objects, not checkpoints or threads.

mod chunk_cache;
pub mod dirty;
pub mod erofs;
mod listing;
mod mounted;
mod owner;
mod reads;
mod reply;
mod transport;
mod view;
mod workspace;

pub use chunk_cache::{ChunkCache, ChunkReader};
pub use dirty::{null_tag, Tag, MOUNTS_CF};
pub use listing::{list_dir_noatime, read_dir_fd, Listed};
pub use mounted::{
    detach, fd_identity, is_dead_mount, is_fuse_mount, is_overlay_mount, low_priority,
    mount_identity, passthrough_permitted, process_ending, unmount_retrying, Mounted,
    FUSE_SUPER_MAGIC,
};
pub use owner::{gate_directory, Owner};
pub use reads::ReadLog;
pub use transport::{kernel_enabled as fuse_uring_enabled, FuseTransport};
pub use view::{mount_objects, mount_tree, MountedTree, TreeView, ViewOptions};
pub use workspace::{
    mount_key, mount_workspace, upper_rel, EntryKind, FilterError, FsEvent, FsEventKind,
    MountedWorkspace, ReadMode, Snapshot, SnapshotFilter, SnapshotStats, Workspace, WorkspaceError,
    WorkspaceFs, WorkspaceOptions, WorkspaceStatus,
};

//! The bottom floor: what every layer uses of the operating system and the standard
//! library beyond their plain calls. Nothing here imports another casfs module.

pub mod allocators;
pub mod dirfd;
pub mod inotify;
pub mod interfaces;
pub mod line_socket;
pub mod loop_dev;
pub mod mount_attr;
pub mod ns;
pub mod peer_cred;
pub mod priority;
pub mod proc_maps;
pub mod process;
pub mod signal;
pub mod sync;
pub mod users;
pub mod xattr;

pub use sync::{Locked, ReadWriteLocked};

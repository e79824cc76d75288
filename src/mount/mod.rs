//! A thread's mounted workspace, whatever the backend: checkpoint under the writer
//! lease, restore, adoption of what a killed daemon left ([`MountedThread`]); the typed
//! control protocol its socket speaks ([`control`]); and the daemon that serves it
//! ([`daemon`]: pid file, signals, detaching, the serve loop). Two backends serve a
//! workspace ([`MountMode`]): casfs's own FUSE filesystem (`crate::fs::Workspace`) and
//! the kernel's overlayfs over a read-only casfs lower ([`overlay`]), which a user who
//! is not root mounts in a user namespace of their own ([`namespace`]).
//!
//! Depends on `checkpoint`, `fs` and `cas`; knows nothing of agent runs.

pub mod control;
pub mod daemon;
pub mod disk;
pub mod namespace;
pub mod overlay;
mod thread_mount;

pub use thread_mount::{discard_mount_state, MountCheckpoint, MountMode, MountedThread};

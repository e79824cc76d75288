//! A thread's mounted workspace, whatever the backend: checkpoint under the writer
//! lease, restore, adoption of what a killed daemon left ([`MountedThread`]); the typed
//! control protocol its socket speaks ([`control`]); and the daemon that serves it
//! ([`daemon`]: pid file, signals, detaching, the serve loop). This is where a second
//! mount backend (kernel overlayfs over a casfs lower) plugs in.
//!
//! Depends on `checkpoint`, `fs` and `cas`; knows nothing of agent runs.

pub mod control;
pub mod daemon;
mod thread_mount;

pub use thread_mount::{discard_mount_state, MountCheckpoint, MountedThread};

//! The lifecycle middleware for agent runs on a conversation thread.
//!
//! A host calls [`Middleware::setup`] when a run starts and one of the terminal hooks
//! of the returned [`Run`] when it ends. Setup takes the thread's writer lease (renewed
//! in the background), ensures the run's sandbox through a [`SandboxProvider`] (the
//! casfs one mounts one workspace per sandbox key) and, unless the sandbox was resumed
//! alive, shows the thread's head checkpoint in it: files, conversation and artifacts.
//! [`Run::on_finish`] captures a checkpoint of the changed files (under the
//! [`SnapshotPolicy`], with secrets replaced by placeholders), the conversation and the
//! artifacts, and appends it with the head read just before as the expected head,
//! checking between every step that the lease is still this run's. A run that is
//! paused, aborted, fails or is detached by a disconnect closes its lease and never
//! publishes afterwards.
//!
//! Depends on `mount`, `checkpoint`, `fs` and `cas`; nothing below knows of runs.

mod context;
mod dir_watch;
mod error;
mod events;
pub mod isolate;
mod lifecycle;
mod persistence;
mod policy;
pub mod portable;
mod provider;
mod publish;
mod secrets;
pub mod serve;

pub use context::{Cancellation, RunContext};
pub use dir_watch::start_inotify;
pub use error::{MiddlewareError, MiddlewareResult};
pub use events::{FileEvent, FileEvents};
pub use lifecycle::{AbortInfo, Chunk, Lifecycle, Middleware, MiddlewareConfig, Run};
pub use persistence::{
    ArtifactMeta, ArtifactStore, BlobStore, MessageStore, Persistence, RunCompletion,
    StorePersistence, COLUMN_FAMILIES, HOST_CF,
};
pub use policy::{workspace_hash, Oversize, SnapshotPolicy};
pub use provider::{
    check_tenant, sandbox_key, CasfsProvider, DirProvider, DirWorkspace, EnsureOutcome, Extras,
    SandboxHandle, SandboxProvider, SandboxWorkspace, WeakSandboxHandle,
};
pub use publish::{RunOutcome, SnapshotConfig};
pub use secrets::{Secrets, PLACEHOLDER_PREFIX};

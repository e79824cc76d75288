//! Errors of the content-addressed store.

use std::io;
use std::path::PathBuf;

use super::hash::Hash;

/// What can go wrong in the object store. Every variant names the object or path.
#[derive(Debug, thiserror::Error)]
pub enum CasError {
    #[error("{what} {id} not found in the store")]
    NotFound { what: &'static str, id: Hash },

    /// Stored bytes that do not hash to their key, or cannot be decompressed.
    #[error("integrity error: object {id} is corrupt: {detail}")]
    Corrupt { id: Hash, detail: String },

    /// An object that is intact but is not a valid object of the expected type.
    #[error("cannot decode {what} {id}: {detail}")]
    Decode {
        what: &'static str,
        id: Hash,
        detail: String,
    },

    #[error("store database at {path}: {source}")]
    Db {
        path: PathBuf,
        #[source]
        source: rocksdb::Error,
    },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("invalid input: {0}")]
    Invalid(String),

    /// Writing would leave the store's filesystem with less than the reserve the
    /// database needs to keep working (No space left on device).
    #[error(
        "no space left for the store on {}: {need} bytes to write, {free} free, {reserve} kept in reserve for its database",
        path.display()
    )]
    NoSpace {
        path: PathBuf,
        need: u64,
        free: u64,
        reserve: u64,
    },
}

impl CasError {
    pub fn io(path: impl Into<PathBuf>, source: io::Error) -> CasError {
        CasError::Io {
            path: path.into(),
            source,
        }
    }

    pub fn is_no_space(&self) -> bool {
        matches!(self, CasError::NoSpace { .. })
    }

    /// A database read found a file the database named gone (deleted by a writer's
    /// compaction after a read-only open).
    pub fn is_vanished_file(&self) -> bool {
        matches!(self, CasError::Db { source, .. }
            if source.kind() == rocksdb::ErrorKind::IOError
                && source.as_ref().contains("No such file"))
    }

    /// True when the error means stored data is damaged (as opposed to missing or I/O).
    pub fn is_integrity(&self) -> bool {
        matches!(self, CasError::Corrupt { .. } | CasError::Decode { .. })
    }
}

pub type CasResult<T> = Result<T, CasError>;

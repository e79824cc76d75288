//! The files a run read, in the order it first opened them: recorded by a mount (the
//! FUSE workspace for clean files, the overlay's lower view for every file it serves)
//! and stored with the next checkpoint, so that a host mounting it later fetches them
//! first.

use crate::sys::Locked;
use std::collections::HashSet;
use std::sync::Mutex;

use crate::cas::{FileId, FileRef};

/// How many first-read files are remembered between checkpoints.
const MAX_READS_KEPT: usize = 8192;

/// Files opened since the last [`ReadLog::take`], each once, in first-open order (at
/// most the first 8192).
#[derive(Debug, Default)]
pub struct ReadLog {
    inner: Mutex<(HashSet<FileId>, Vec<FileRef>)>,
}

impl ReadLog {
    pub fn note(&self, f: FileRef) {
        let mut r = self.inner.locked();
        if r.1.len() < MAX_READS_KEPT && r.0.insert(f.id) {
            r.1.push(f);
        }
    }

    /// The files noted since the last call, and a fresh start.
    pub fn take(&self) -> Vec<FileRef> {
        let mut r = self.inner.locked();
        r.0.clear();
        std::mem::take(&mut r.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cas::Hash;

    #[test]
    fn notes_each_file_once_in_first_open_order_up_to_the_limit() {
        let f = |i: u32| FileRef {
            id: FileId(Hash::of(&i.to_le_bytes())),
            size: i as u64,
        };
        let log = ReadLog::default();
        for i in [3, 1, 3, 2, 1] {
            log.note(f(i));
        }
        let got: Vec<u64> = log.take().iter().map(|r| r.size).collect();
        assert_eq!(got, [3, 1, 2]);
        assert!(log.take().is_empty());
        for i in 0..10_000 {
            log.note(f(i));
        }
        let kept = log.take();
        assert_eq!(kept.len(), MAX_READS_KEPT);
        assert_eq!(kept[0].size, 0);
        // After a take, a file read before counts again.
        log.note(f(3));
        assert_eq!(log.take().len(), 1);
    }
}

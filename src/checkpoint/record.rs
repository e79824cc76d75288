//! The checkpoint record: its body (root tree, parent, thread, conversation,
//! artifacts, capture statistics) and its canonical encoding, which its id hashes.

use crate::fs::Tag;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::ids::{CheckpointError, CheckpointId, CheckpointResult, ThreadId};
use crate::cas::{FileId, FileRef, Hash, TreeId};

/// Stored content named by the record: the conversation, or an artifact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentRef {
    pub id: FileId,
    pub size: u64,
}

impl From<FileRef> for ContentRef {
    fn from(f: FileRef) -> Self {
        ContentRef {
            id: f.id,
            size: f.size,
        }
    }
}

impl From<ContentRef> for FileRef {
    fn from(c: ContentRef) -> Self {
        FileRef {
            id: c.id,
            size: c.size,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub name: String,
    pub content: ContentRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// The host's id of the artifact, and the key its bytes had in the host's blob store
    /// (a restore puts them back under it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blob_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at_ms: Option<u64>,
}

/// A file stored with secret values replaced by placeholders (`{{casfs-secret:NAME}}`),
/// and which secrets: a restore writes the current values back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretFile {
    pub path: String,
    pub secrets: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What a capture did, kept with the checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureStats {
    /// Regular files in the captured tree.
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// Fifos and device nodes.
    pub special: u64,
    /// Total bytes of regular files.
    pub bytes: u64,
    /// Files whose content was read and hashed.
    pub files_hashed: u64,
    pub bytes_hashed: u64,
    /// Files taken from the directory cache without reading them.
    pub files_skipped: u64,
    /// Sockets and other entries that cannot be stored (left out, with a warning).
    pub unsupported: u64,
    /// Directories taken whole from the directory cache because the watcher saw
    /// nothing change in them (their files are not counted above).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dirs_reused: u64,
    /// What the watcher answered ("changes", or "full: why"); absent without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watcher: Option<String>,
    /// Entries added or modified since the parent (files and other non-directories; a
    /// moved directory's files at their new paths), as a mount's checkpoint tells them
    /// (it does not walk the tree, so `files` and the totals above stay 0). Absent from
    /// captures that do not count them, and from older records (whose ids stay).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed: Option<u64>,
    /// Entries of the parent's tree that are gone (a removed directory counts once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub removed: Option<u64>,
    pub new_objects: u64,
    /// Bytes added to the store (compressed).
    pub new_bytes: u64,
    pub reused_objects: u64,
    pub duration_ms: u64,
}

/// A checkpoint's content before it is appended: the store assigns the parent (the
/// expected head), the creation time and the id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCheckpoint {
    pub thread_id: ThreadId,
    pub reason: String,
    pub source_run_id: Option<String>,
    pub root: TreeId,
    pub conversation: Option<ContentRef>,
    pub artifacts: Vec<Artifact>,
    pub workspace_hash: Option<String>,
    pub stats: CaptureStats,
    pub secret_files: Vec<SecretFile>,
    /// The clean files the run read, in the order first read (a list stored as
    /// content): another host restoring this checkpoint fetches them first.
    pub read_first: Option<ContentRef>,
    /// The captured directory's own mode and mtime (a tree holds its entries', not its
    /// own); set by captures of plain directories.
    pub root_meta: Option<RootMeta>,
}

/// A directory's own permission bits and modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootMeta {
    pub mode: u32,
    pub mtime_ns: i64,
}

impl NewCheckpoint {
    /// The first checkpoint of `new_thread`, forked from `src`: its content, conversation
    /// and artifacts.
    pub fn fork_of(new_thread: &ThreadId, src: &Checkpoint) -> NewCheckpoint {
        NewCheckpoint {
            thread_id: new_thread.clone(),
            reason: format!("fork of {} ({})", src.id.short(), src.body.thread_id),
            source_run_id: None,
            root: src.body.root,
            conversation: src.body.conversation,
            artifacts: src.body.artifacts.clone(),
            workspace_hash: src.body.workspace_hash.clone(),
            // The content's totals are the source's; nothing was read or changed.
            stats: CaptureStats {
                changed: Some(0),
                removed: Some(0),
                files_hashed: 0,
                bytes_hashed: 0,
                files_skipped: 0,
                dirs_reused: 0,
                watcher: None,
                new_objects: 0,
                new_bytes: 0,
                reused_objects: 0,
                duration_ms: 0,
                ..src.body.stats.clone()
            },
            secret_files: src.body.secret_files.clone(),
            read_first: src.body.read_first,
            root_meta: src.body.root_meta,
        }
    }

    pub fn new(thread_id: ThreadId, root: TreeId, reason: impl Into<String>) -> NewCheckpoint {
        NewCheckpoint {
            thread_id,
            reason: reason.into(),
            source_run_id: None,
            root,
            conversation: None,
            artifacts: Vec::new(),
            workspace_hash: None,
            stats: CaptureStats::default(),
            secret_files: Vec::new(),
            read_first: None,
            root_meta: None,
        }
    }
}

/// The hashed body of a checkpoint record. Field order is the canonical JSON order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointBody {
    pub version: u32,
    pub thread_id: ThreadId,
    pub parent_id: Option<CheckpointId>,
    /// Unix time in milliseconds.
    pub created_at_ms: u64,
    pub reason: String,
    pub source_run_id: Option<String>,
    pub root: TreeId,
    pub conversation: Option<ContentRef>,
    pub artifacts: Vec<Artifact>,
    pub workspace_hash: Option<String>,
    pub stats: CaptureStats,
    /// Absent from records without any (so their encoding, and id, is as before).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_files: Vec<SecretFile>,
    /// See [`NewCheckpoint::read_first`]; absent when none (older ids unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_first: Option<ContentRef>,
    /// See [`NewCheckpoint::root_meta`]; absent when none (older ids unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_meta: Option<RootMeta>,
}

/// A checkpoint: an immutable record naming a root tree, its parent and its thread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub id: CheckpointId,
    #[serde(flatten)]
    pub body: CheckpointBody,
}

pub const RECORD_VERSION: u32 = 1;

impl Checkpoint {
    pub fn from_new(
        new: NewCheckpoint,
        parent_id: Option<CheckpointId>,
        now: SystemTime,
    ) -> Checkpoint {
        let body = CheckpointBody {
            version: RECORD_VERSION,
            thread_id: new.thread_id,
            parent_id,
            created_at_ms: now
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis() as u64,
            reason: new.reason,
            source_run_id: new.source_run_id,
            root: new.root,
            conversation: new.conversation,
            artifacts: new.artifacts,
            workspace_hash: new.workspace_hash,
            stats: new.stats,
            secret_files: new.secret_files,
            read_first: new.read_first,
            root_meta: new.root_meta,
        };
        let id = CheckpointId(Hash::of(&body_bytes(&body)));
        Checkpoint { id, body }
    }

    pub fn created_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.body.created_at_ms)
    }

    /// The stored form: the body's canonical JSON (the id is its hash).
    pub fn encode(&self) -> Vec<u8> {
        body_bytes(&self.body)
    }

    /// Decodes a stored record and checks that it hashes to `id`.
    pub fn decode(id: &CheckpointId, bytes: &[u8]) -> CheckpointResult<Checkpoint> {
        let corrupt = |detail: String| CheckpointError::Corrupt {
            id: id.to_hex(),
            detail,
        };
        let actual = Hash::of(bytes);
        if actual != id.0 {
            return Err(corrupt(format!("record hashes to {actual}")));
        }
        let body: CheckpointBody =
            serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        if body.version != RECORD_VERSION {
            return Err(corrupt(format!("unknown record version {}", body.version)));
        }
        Ok(Checkpoint { id: *id, body })
    }
}

fn body_bytes(body: &CheckpointBody) -> Vec<u8> {
    serde_json::to_vec(body).expect("a checkpoint body always serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_names() {
        assert!(ThreadId::new("main").is_ok());
        assert!(ThreadId::new("conv-123_x.y:z").is_ok());
        for bad in [
            "",
            "a b",
            "a/b/c",
            "/b",
            "a/",
            ".a/b",
            "a/@b",
            "@x",
            "a~1",
            "tab\t",
            &"x".repeat(201),
        ] {
            assert!(ThreadId::new(bad).is_err(), "{bad:?}");
        }
        // A tenant's thread: the tenant, one '/', a name.
        let t = ThreadId::new("alice/main").unwrap();
        assert_eq!((t.tenant(), t.name()), (Some("alice"), "main"));
        assert_eq!(ThreadId::in_tenant("alice", "main").unwrap(), t);
        assert!(ThreadId::in_tenant("alice", "a/b").is_err());
        assert!(ThreadId::in_tenant("a b", "main").is_err());
        let main = ThreadId::new("main").unwrap();
        assert_eq!((main.tenant(), main.name()), (None, "main"));
        let back: ThreadId = serde_json::from_str("\"alice/main\"").unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn record_id_is_the_hash_of_its_body() {
        let t = ThreadId::new("t").unwrap();
        let cp = Checkpoint::from_new(
            NewCheckpoint::new(t, TreeId(Hash::of(b"root")), "test"),
            None,
            SystemTime::now(),
        );
        let bytes = cp.encode();
        assert_eq!(Checkpoint::decode(&cp.id, &bytes).unwrap(), cp);
        let mut bad = bytes.clone();
        let n = bad.len() / 2;
        bad[n] ^= 1;
        assert!(matches!(
            Checkpoint::decode(&cp.id, &bad),
            Err(CheckpointError::Corrupt { .. })
        ));
    }
}

/// What the workspace's base is, kept with it in the dirty set's mount record.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MountTag {
    pub thread: ThreadId,
    /// The checkpoint the content started from (`None`: an empty workspace).
    pub base: Option<CheckpointId>,
    /// The head the next checkpoint is appended on (the thread's head when the base
    /// was set; after a checkpoint, that checkpoint).
    pub expected_head: Option<CheckpointId>,
}

impl MountTag {
    /// The tag as the workspace keeps it.
    pub fn to_tag(&self) -> Tag {
        serde_json::value::to_raw_value(self).expect("a mount tag serializes")
    }

    /// The tag a workspace keeps, if it is a mount tag.
    pub fn from_tag(t: &Tag) -> Option<MountTag> {
        serde_json::from_str(t.get()).ok()
    }
}

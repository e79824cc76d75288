//! The lifecycle middleware driving scripted agent runs on real mounts: finish, pause,
//! abort (cancel and detach), error, disconnect, a lease lost mid-run, two runs on one
//! thread, a sandbox recreated elsewhere (a new host), secrets, policy, and setup
//! failures.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use casfs::cas::{load_tree, EntryContent, Hash};
use casfs::checkpoint::{CheckpointError, OpenMode, Store, ThreadId};
use casfs::fs::WorkspaceOptions;
use casfs::middleware::{
    AbortInfo, ArtifactMeta, ArtifactStore, BlobStore, CasfsProvider, Chunk, MessageStore,
    Middleware, MiddlewareConfig, MiddlewareError, MiddlewareResult, Persistence, RunCompletion,
    RunContext, SandboxProvider, Secrets, SnapshotConfig, SnapshotPolicy, StorePersistence,
};
use serde_json::json;

use crate::MountGuard;

/// One host: a store, its persistence, a casfs sandbox provider and the middleware.
pub(crate) struct Host {
    _t: tempfile::TempDir,
    pub store: Arc<Store>,
    pub persistence: Persistence,
    pub provider: Arc<CasfsProvider>,
    pub mw: Arc<Middleware>,
    guards: Mutex<Vec<MountGuard>>,
}

pub(crate) fn open_store(dir: &Path) -> Arc<Store> {
    Arc::new(
        Store::open_with_families(
            dir,
            OpenMode::Create,
            Duration::from_secs(5),
            &Default::default(),
            casfs::middleware::COLUMN_FAMILIES,
        )
        .unwrap(),
    )
}

pub(crate) fn host_with(
    store: Arc<Store>,
    persistence: Persistence,
    cfg: impl FnOnce(&mut MiddlewareConfig),
) -> Host {
    let t = tempfile::tempdir().unwrap();
    let provider = Arc::new(CasfsProvider::new(
        store.clone(),
        &t.path().join("sandboxes"),
        WorkspaceOptions::default(),
    ));
    let mut snap = SnapshotConfig::new(persistence.clone());
    snap.workspace = json!({"image": "debian:12", "setup": ["true"]});
    let mut config = MiddlewareConfig {
        snapshots: Some(snap),
        ..Default::default()
    };
    cfg(&mut config);
    let mw = Arc::new(Middleware::new(store.clone(), provider.clone(), config).unwrap());
    Host {
        _t: t,
        store,
        persistence,
        provider,
        mw,
        guards: Mutex::new(Vec::new()),
    }
}

pub(crate) fn host(cfg: impl FnOnce(&mut MiddlewareConfig)) -> (tempfile::TempDir, Host) {
    let t = tempfile::tempdir().unwrap();
    let store = open_store(&t.path().join("store"));
    let p = Persistence::on_store(Arc::new(
        StorePersistence::new(store.database().clone()).unwrap(),
    ));
    (t, host_with(store, p, cfg))
}

pub(crate) fn thread(name: &str) -> ThreadId {
    ThreadId::new(name).unwrap()
}

impl Host {
    pub fn ctx(&self, t: &str, run: &str) -> RunContext {
        let ctx = RunContext::new(thread(t), run);
        self.guards.lock().unwrap().push(MountGuard::new(
            &self.provider.mountpoint(&self.provider.key(&ctx)),
        ));
        ctx
    }

    pub fn setup(&self, t: &str, run: &str) -> MiddlewareResult<casfs::middleware::Run> {
        self.mw.setup(self.ctx(t, run), Some(&self.persistence))
    }

    pub fn head(&self, t: &str) -> Option<casfs::checkpoint::CheckpointId> {
        self.store.checkpoints().head(&thread(t)).unwrap()
    }

    /// A message and an artifact written through the host's persistence, as a run does.
    pub fn persist(&self, t: &str, run: &str, message: &str, artifact: &[u8]) {
        let m = self.persistence.messages.as_ref().unwrap();
        let mut msgs = m.load_thread(&thread(t)).unwrap();
        msgs.push(json!({"role": "assistant", "run": run, "content": message}));
        m.save_thread(&thread(t), &msgs).unwrap();
        let key = format!("blob-{run}");
        self.persistence
            .blobs
            .as_ref()
            .unwrap()
            .put(&key, artifact)
            .unwrap();
        self.persistence
            .artifacts
            .as_ref()
            .unwrap()
            .put(&ArtifactMeta {
                artifact_id: format!("art-{run}"),
                run_id: run.into(),
                thread: thread(t),
                blob_key: Some(key),
                name: format!("{run}.txt"),
                mime_type: "text/plain".into(),
                size: artifact.len() as u64,
                created_at_ms: 1,
            })
            .unwrap();
    }
}

/// Whether the lease of thread `t` is free (another writer can take it).
pub(crate) fn lease_is_free(store: &Store, t: &str) -> bool {
    match store
        .checkpoints()
        .acquire_writer(&thread(t), "probe", Duration::from_secs(5))
    {
        Ok(l) => {
            store.checkpoints().release(&l).unwrap();
            true
        }
        Err(CheckpointError::LeaseHeld { .. }) => false,
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn a_finished_run_publishes_files_conversation_and_artifacts() {
    let (_t, h) = host(|_| {});
    let run = h.setup("conv", "r1").unwrap();
    let root = run.sandbox().unwrap().root;
    fs::create_dir(root.join("src")).unwrap();
    fs::write(root.join("src/main.rs"), "fn main() {}\n").unwrap();
    h.persist("conv", "r1", "wrote main.rs", b"report one");
    assert!(!lease_is_free(&h.store, "conv"), "the run holds the thread");
    let out = run.on_finish().unwrap();
    let id = out.checkpoint.expect("published");
    assert_eq!(h.head("conv"), Some(id));
    assert!(lease_is_free(&h.store, "conv"), "released at the end");
    let cp = h.store.checkpoints().get(&id).unwrap();
    assert_eq!(cp.body.source_run_id.as_deref(), Some("r1"));
    assert!(cp.body.conversation.is_some());
    assert_eq!(cp.body.artifacts.len(), 1);
    assert_eq!(cp.body.artifacts[0].name, "r1.txt");
    assert!(cp.body.workspace_hash.is_some());
    assert_eq!(out.changed_files, 1);

    // The next run resumes the live sandbox and builds on the head.
    let run2 = h.setup("conv", "r2").unwrap();
    let root2 = run2.sandbox().unwrap().root;
    assert_eq!(root2, root);
    assert_eq!(
        fs::read_to_string(root2.join("src/main.rs")).unwrap(),
        "fn main() {}\n"
    );
    fs::write(root2.join("README"), "hi\n").unwrap();
    let out2 = run2.on_finish().unwrap();
    let cp2 = h
        .store
        .checkpoints()
        .get(&out2.checkpoint.unwrap())
        .unwrap();
    assert_eq!(cp2.body.parent_id, Some(id));
    assert_eq!(out2.changed_files, 1, "only README changed");
    drop(run);
    drop(run2);
}

#[test]
fn pause_disconnect_abort_and_error_never_publish() {
    let (_t, h) = host(|c| c.lifecycle.destroy_on_error = true);
    // Pause: the run finishes with an interrupt; a later on_finish publishes nothing.
    let run = h.setup("t", "pause").unwrap();
    fs::write(run.sandbox().unwrap().root.join("a"), "1").unwrap();
    run.on_chunk(&Chunk::Other).unwrap();
    run.on_chunk(&Chunk::RunFinished { interrupt: true })
        .unwrap();
    assert!(
        lease_is_free(&h.store, "t"),
        "a paused run let the thread go"
    );
    assert_eq!(run.on_finish().unwrap().checkpoint, None);
    assert_eq!(h.head("t"), None);
    drop(run);

    // Disconnect: the run keeps executing (its sandbox stays), but cannot publish.
    let run = h.setup("t", "disc").unwrap();
    let root = run.sandbox().unwrap().root;
    run.on_disconnect().unwrap();
    assert!(lease_is_free(&h.store, "t"));
    fs::write(root.join("b"), "2").unwrap();
    assert_eq!(run.on_finish().unwrap().checkpoint, None);
    assert_eq!(h.head("t"), None);
    drop(run);

    // Abort with detach: no publish, the sandbox stays mounted for a later attach.
    let run = h.setup("t", "detach").unwrap();
    let root = run.sandbox().unwrap().root;
    run.on_abort(AbortInfo { cancelled: false }).unwrap();
    assert!(casfs::fs::is_fuse_mount(&root));
    assert!(lease_is_free(&h.store, "t"));
    drop(run);

    // Abort with cancel: the sandbox is destroyed.
    let run = h.setup("t", "cancel").unwrap();
    run.context().cancel.cancel();
    run.on_abort(AbortInfo { cancelled: true }).unwrap();
    assert!(!casfs::fs::is_fuse_mount(&root), "unmounted");
    assert!(lease_is_free(&h.store, "t"));
    assert_eq!(h.head("t"), None);
    drop(run);

    // Error: released, nothing published, destroyed (destroy_on_error).
    let run = h.setup("t", "err").unwrap();
    let root = run.sandbox().unwrap().root;
    fs::write(root.join("c"), "3").unwrap();
    run.on_error("the model failed").unwrap();
    assert!(lease_is_free(&h.store, "t"));
    assert!(!casfs::fs::is_fuse_mount(&root));
    assert_eq!(h.head("t"), None);
    // One terminal hook per run.
    assert!(matches!(run.on_finish(), Err(MiddlewareError::Config(_))));
}

#[test]
fn a_lost_lease_is_an_error_and_publishes_nothing() {
    let (_t, h) = host(|c| c.snapshots.as_mut().unwrap().lease_ttl = Duration::from_millis(600));
    let run = h.setup("t", "r1").unwrap();
    fs::write(run.sandbox().unwrap().root.join("f"), "x").unwrap();
    // Another host breaks the lease and takes the thread.
    let lease = run.lease().unwrap();
    h.store.checkpoints().release(&lease).unwrap();
    let theirs = h
        .store
        .checkpoints()
        .acquire_writer(&thread("t"), "other-host", Duration::from_secs(30))
        .unwrap();
    // The renewer notices at its next renewal (a third of the TTL).
    assert!(crate::wait_for(Duration::from_secs(10), || run
        .lease()
        .is_none()));
    let e = run.on_finish().unwrap_err();
    assert!(
        matches!(
            e,
            MiddlewareError::Checkpoint(CheckpointError::LeaseLost { .. })
        ),
        "{e}"
    );
    assert_eq!(h.head("t"), None);
    h.store.checkpoints().release(&theirs).unwrap();
}

#[test]
fn two_runs_on_one_thread_never_both_publish() {
    let (_t, h) = host(|_| {});
    let first = h.setup("t", "r1").unwrap();
    let e = h.setup("t", "r2").err().unwrap();
    assert!(
        matches!(
            e,
            MiddlewareError::Checkpoint(CheckpointError::LeaseHeld { .. })
        ),
        "{e}"
    );
    fs::write(first.sandbox().unwrap().root.join("f"), "1").unwrap();
    let id = first.on_finish().unwrap().checkpoint.unwrap();
    assert_eq!(h.head("t"), Some(id));
    // Once the first is done, the next run may go.
    let next = h.setup("t", "r3").unwrap();
    assert!(next.on_finish().unwrap().checkpoint.is_some());
}

/// A host-side persistence that starts empty, as on a new machine.
#[derive(Default)]
pub(crate) struct MemPersistence {
    messages: Mutex<HashMap<String, Vec<serde_json::Value>>>,
    artifacts: Mutex<Vec<ArtifactMeta>>,
    blobs: Mutex<HashMap<String, Vec<u8>>>,
}

impl MessageStore for MemPersistence {
    fn load_thread(&self, t: &ThreadId) -> MiddlewareResult<Vec<serde_json::Value>> {
        Ok(self
            .messages
            .lock()
            .unwrap()
            .get(t.as_str())
            .cloned()
            .unwrap_or_default())
    }
    fn save_thread(&self, t: &ThreadId, m: &[serde_json::Value]) -> MiddlewareResult<()> {
        self.messages
            .lock()
            .unwrap()
            .insert(t.to_string(), m.to_vec());
        Ok(())
    }
}

impl ArtifactStore for MemPersistence {
    fn list_for_thread(&self, t: &ThreadId) -> MiddlewareResult<Vec<ArtifactMeta>> {
        Ok(self
            .artifacts
            .lock()
            .unwrap()
            .iter()
            .filter(|a| &a.thread == t)
            .cloned()
            .collect())
    }
    fn put(&self, meta: &ArtifactMeta) -> MiddlewareResult<()> {
        self.artifacts.lock().unwrap().push(meta.clone());
        Ok(())
    }
}

impl BlobStore for MemPersistence {
    fn get(&self, key: &str) -> MiddlewareResult<Option<Vec<u8>>> {
        Ok(self.blobs.lock().unwrap().get(key).cloned())
    }
    fn head(&self, key: &str) -> MiddlewareResult<Option<u64>> {
        Ok(self.blobs.lock().unwrap().get(key).map(|b| b.len() as u64))
    }
    fn put(&self, key: &str, body: &[u8]) -> MiddlewareResult<()> {
        self.blobs.lock().unwrap().insert(key.into(), body.to_vec());
        Ok(())
    }
}

impl RunCompletion for MemPersistence {
    fn wait_for_run_completion(&self, _: &str, _: Duration) -> MiddlewareResult<()> {
        Ok(())
    }
}

pub(crate) fn mem_persistence() -> (Arc<MemPersistence>, Persistence) {
    let m = Arc::new(MemPersistence::default());
    let p = Persistence {
        messages: Some(m.clone()),
        artifacts: Some(m.clone()),
        blobs: Some(m.clone()),
        completion: Some(m.clone()),
    };
    (m, p)
}

/// Every object in the store, decoded, and every checkpoint record.
fn everything_stored(store: &Store) -> Vec<Vec<u8>> {
    let db = store.database();
    let mut out = Vec::new();
    for cf in [casfs::cas::kv::OBJECTS_CF, "checkpoints"] {
        for item in db.column(cf).entries() {
            let (k, v) = item.unwrap();
            if cf == "checkpoints" {
                out.push(v.to_vec());
            } else {
                let id = Hash::from_slice(&k).unwrap();
                out.push(casfs::cas::object::decode_stored(&id, &v).unwrap());
            }
        }
    }
    out
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[test]
fn secrets_never_stored_and_a_new_host_gets_everything_back() {
    let token = "ghp_s3cr3tT0k3nValue9911";
    let password = "correct-horse-battery";
    let secrets: BTreeMap<String, String> = [
        ("GITHUB_TOKEN".to_string(), token.to_string()),
        ("DB_PASSWORD".to_string(), password.to_string()),
    ]
    .into();
    let t = tempfile::tempdir().unwrap();
    let store = open_store(&t.path().join("store"));
    let (_mem_a, pa) = mem_persistence();
    let with_secrets = |c: &mut MiddlewareConfig| {
        let s = c.snapshots.as_mut().unwrap();
        s.secrets = secrets.clone();
        s.policy = SnapshotPolicy {
            exclude: vec!["node_modules".into(), "*.log".into()],
            max_file_size: Some(1 << 20),
            ..Default::default()
        };
    };
    let a = host_with(store.clone(), pa, with_secrets);
    let run = a.setup("conv", "r1").unwrap();
    let root = run.sandbox().unwrap().root;
    fs::write(
        root.join(".env"),
        format!("GITHUB_TOKEN={token}\nDB={password}\n"),
    )
    .unwrap();
    fs::write(root.join("plain.txt"), "nothing secret\n").unwrap();
    fs::create_dir(root.join("node_modules")).unwrap();
    fs::write(root.join("node_modules/dep.js"), "x").unwrap();
    fs::write(root.join("debug.log"), format!("token {token}")).unwrap();
    fs::write(root.join("big.bin"), vec![7u8; (1 << 20) + 1]).unwrap();
    a.persist(
        "conv",
        "r1",
        &format!("I used {token} to push"),
        password.as_bytes(),
    );
    let out = run.on_finish().unwrap();
    let id = out.checkpoint.unwrap();
    assert_eq!(out.secret_files, 1);
    assert_eq!(out.skipped, vec!["big.bin".to_string()]);
    // The workspace still shows the real values to the agent.
    assert!(fs::read_to_string(root.join(".env"))
        .unwrap()
        .contains(token));

    for blob in everything_stored(&store) {
        assert!(!contains(&blob, token), "a stored object holds the token");
        assert!(
            !contains(&blob, password),
            "a stored object holds the password"
        );
    }
    // What went in: .env with placeholders, plain.txt; not node_modules, *.log, big.bin.
    let cp = store.checkpoints().get(&id).unwrap();
    let tree = load_tree(store.objects(), &cp.body.root).unwrap();
    let names: Vec<String> = tree
        .entries()
        .iter()
        .map(|e| String::from_utf8_lossy(&e.name).into_owned())
        .collect();
    assert_eq!(names, vec![".env".to_string(), "plain.txt".to_string()]);
    let env = tree.get(b".env").unwrap();
    let EntryContent::File(fid) = env.content else {
        panic!()
    };
    let stored = casfs::cas::file::read_file(
        store.objects(),
        &casfs::cas::FileRef {
            id: fid,
            size: env.size,
        },
    )
    .unwrap();
    assert!(contains(&stored, "{{casfs-secret:GITHUB_TOKEN}}"));
    drop(run);
    a.provider.destroy("conv", &Secrets::default()).unwrap();

    // Host B: another sandbox directory, a persistence layer that starts empty, the
    // same store (standing in for a shared one).
    let (mem_b, pb) = mem_persistence();
    let b = host_with(store.clone(), pb, with_secrets);
    let run = b.setup("conv", "r2").unwrap();
    let root_b = run.sandbox().unwrap().root;
    assert_ne!(root_b, root);
    assert_eq!(
        fs::read_to_string(root_b.join(".env")).unwrap(),
        format!("GITHUB_TOKEN={token}\nDB={password}\n"),
        "the real values are back"
    );
    assert_eq!(
        fs::read_to_string(root_b.join("plain.txt")).unwrap(),
        "nothing secret\n"
    );
    assert!(!root_b.join("debug.log").exists());
    let msgs = mem_b.load_thread(&thread("conv")).unwrap();
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0]["content"], format!("I used {token} to push"));
    let arts = mem_b.list_for_thread(&thread("conv")).unwrap();
    assert_eq!(arts.len(), 1);
    assert_eq!(arts[0].name, "r1.txt");
    // The size recorded is that of the blob written back (the real value), not of the
    // stored form with its placeholder.
    assert_eq!(arts[0].size, password.len() as u64);
    assert_eq!(
        mem_b
            .get(arts[0].blob_key.as_deref().unwrap())
            .unwrap()
            .unwrap(),
        password.as_bytes()
    );
    // A run on the new host publishes on top, and still stores no secret.
    fs::write(root_b.join("more.txt"), format!("again {password}")).unwrap();
    let out = run.on_finish().unwrap();
    // .env, stored again with its placeholders, holds what the parent holds.
    assert_eq!(out.changed_files, 1, "only more.txt changed");
    let cp2 = store.checkpoints().get(&out.checkpoint.unwrap()).unwrap();
    assert_eq!(cp2.body.parent_id, Some(id));
    for blob in everything_stored(&store) {
        assert!(!contains(&blob, password));
        assert!(!contains(&blob, token));
    }
}

#[test]
fn setup_refuses_misconfiguration_and_a_missing_head() {
    // Persistence wired to other stores than the configuration's.
    let (_t, h) = host(|_| {});
    let (_m, other) = mem_persistence();
    let e = h.mw.setup(h.ctx("t", "r0"), Some(&other)).err().unwrap();
    assert!(matches!(e, MiddlewareError::Config(_)), "{e}");
    let e = h.mw.setup(h.ctx("t", "r0"), None).err().unwrap();
    assert!(matches!(e, MiddlewareError::Config(_)), "{e}");
    assert!(lease_is_free(&h.store, "t"));

    // A configuration without a blob store.
    let mut p = h.persistence.clone();
    p.blobs = None;
    let e = Middleware::new(
        h.store.clone(),
        h.provider.clone(),
        MiddlewareConfig {
            snapshots: Some(SnapshotConfig::new(p)),
            ..Default::default()
        },
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("blobs is missing"), "{e}");

    // A head that names a checkpoint the store lacks.
    let run = h.setup("t", "r1").unwrap();
    fs::write(run.sandbox().unwrap().root.join("f"), "1").unwrap();
    let id = run.on_finish().unwrap().checkpoint.unwrap();
    drop(run);
    h.provider.destroy("t", &Secrets::default()).unwrap();
    let db = h.store.database();
    db.column("checkpoints")
        .delete(id.hash().as_bytes(), true)
        .unwrap();
    let mp: PathBuf = h.provider.mountpoint("t");
    let e = h.setup("t", "r2").err().unwrap();
    assert!(matches!(e, MiddlewareError::HeadMissing { .. }), "{e}");
    assert!(e.to_string().contains(&id.to_hex()), "{e}");
    assert!(lease_is_free(&h.store, "t"), "released after the failure");
    assert!(!casfs::fs::is_fuse_mount(&mp), "no sandbox was made for it");
}

/// Persistence whose message store fails on write: a restore on a new host fails.
struct FailingMessages(Arc<MemPersistence>);

impl MessageStore for FailingMessages {
    fn load_thread(&self, t: &ThreadId) -> MiddlewareResult<Vec<serde_json::Value>> {
        self.0.load_thread(t)
    }
    fn save_thread(&self, _: &ThreadId, _: &[serde_json::Value]) -> MiddlewareResult<()> {
        Err(MiddlewareError::Persistence("disk full".into()))
    }
}

#[test]
fn a_setup_failing_after_its_sandbox_was_made_destroys_it() {
    let t = tempfile::tempdir().unwrap();
    let store = open_store(&t.path().join("store"));
    let (_m, pa) = mem_persistence();
    let a = host_with(store.clone(), pa, |_| {});
    let run = a.setup("t", "r1").unwrap();
    a.persist("t", "r1", "hello", b"art");
    run.on_finish().unwrap();
    drop(run);
    a.provider.destroy("t", &Secrets::default()).unwrap();
    let (m, mut pb) = mem_persistence();
    pb.messages = Some(Arc::new(FailingMessages(m)));
    let b = host_with(store.clone(), pb, |_| {});
    let e = b.setup("t", "r2").err().unwrap();
    assert!(e.to_string().contains("disk full"), "{e}");
    assert!(lease_is_free(&store, "t"));
    assert!(
        !casfs::fs::is_fuse_mount(&b.provider.mountpoint("t")),
        "destroyed"
    );
}

#[test]
fn a_checkpoint_of_another_workspace_definition_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let store = open_store(&t.path().join("store"));
    let p = Persistence::on_store(Arc::new(
        StorePersistence::new(store.database().clone()).unwrap(),
    ));
    let a = host_with(store.clone(), p.clone(), |_| {});
    let run = a.setup("t", "r1").unwrap();
    fs::write(run.sandbox().unwrap().root.join("f"), "1").unwrap();
    run.on_finish().unwrap();
    drop(run);
    a.provider.destroy("t", &Secrets::default()).unwrap();
    let other_def = |c: &mut MiddlewareConfig| {
        c.snapshots.as_mut().unwrap().workspace = json!({"image": "alpine"});
    };
    let b = host_with(store.clone(), p.clone(), other_def);
    let e = b.setup("t", "r2").err().unwrap();
    assert!(
        matches!(e, MiddlewareError::WorkspaceMismatch { .. }),
        "{e}"
    );
    assert!(lease_is_free(&store, "t"));
    let c = host_with(store.clone(), p, |c| {
        other_def(c);
        c.snapshots
            .as_mut()
            .unwrap()
            .policy
            .allow_workspace_mismatch = true;
    });
    let run = c.setup("t", "r3").unwrap();
    assert_eq!(
        fs::read_to_string(run.sandbox().unwrap().root.join("f")).unwrap(),
        "1"
    );
}

#[test]
fn file_events_arrive_in_order_with_diffs_and_are_drained() {
    let seen: Arc<Mutex<Vec<casfs::middleware::FileEvent>>> = Arc::default();
    let sink = seen.clone();
    let (_t, h) = host(move |c| {
        c.file_events = Some(casfs::middleware::FileEvents {
            on_event: Arc::new(move |e| {
                // A slow host: draining must still wait for every event.
                std::thread::sleep(Duration::from_millis(5));
                sink.lock().unwrap().push(e.clone());
            }),
            diff: true,
        })
    });
    // A base with one file.
    let run = h.setup("t", "r1").unwrap();
    fs::write(run.sandbox().unwrap().root.join("notes.txt"), "one\ntwo\n").unwrap();
    run.on_finish().unwrap();
    seen.lock().unwrap().clear();

    let run = h.setup("t", "r2").unwrap();
    let root = run.sandbox().unwrap().root;
    fs::create_dir(root.join("src")).unwrap();
    fs::write(root.join("src/a.rs"), "fn a() {}\n").unwrap();
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(root.join("notes.txt"))
        .unwrap();
    std::io::Write::write_all(&mut f, b"three\n").unwrap();
    drop(f);
    fs::rename(root.join("src/a.rs"), root.join("src/b.rs")).unwrap();
    fs::remove_file(root.join("src/b.rs")).unwrap();
    run.on_chunk(&Chunk::RunFinished { interrupt: true })
        .unwrap();
    let events = seen.lock().unwrap().clone();
    let brief: Vec<(String, String, Option<String>)> = events
        .iter()
        .map(|e| {
            (
                serde_json::to_value(e.event.kind)
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_string(),
                e.event.path.clone(),
                e.event.to.clone(),
            )
        })
        .collect();
    let s = |x: &str| x.to_string();
    assert_eq!(
        brief,
        vec![
            (s("create"), s("src"), None),
            (s("create"), s("src/a.rs"), None),
            (s("modify"), s("src/a.rs"), None),
            (s("modify"), s("notes.txt"), None),
            (s("rename"), s("src/a.rs"), Some(s("src/b.rs"))),
            (s("delete"), s("src/b.rs"), None),
        ],
        "{events:#?}"
    );
    let seqs: Vec<u64> = events.iter().map(|e| e.event.seq).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    let notes = events.iter().find(|e| e.event.path == "notes.txt").unwrap();
    let diff = notes.diff.as_deref().unwrap();
    assert!(
        diff.contains("--- a/notes.txt") && diff.contains("+three"),
        "{diff}"
    );
    assert!(!diff.contains("+one"), "{diff}");
    // Paused: drained and stopped; later changes are not reported.
    fs::write(root.join("late.txt"), "x").unwrap();
    run.on_finish().unwrap();
    assert_eq!(seen.lock().unwrap().len(), 6);
}

#[test]
fn a_live_sandbox_behind_the_head_is_brought_up_to_it() {
    let t = tempfile::tempdir().unwrap();
    let store = open_store(&t.path().join("store"));
    let p = Persistence::on_store(Arc::new(
        StorePersistence::new(store.database().clone()).unwrap(),
    ));
    let a = host_with(store.clone(), p.clone(), |_| {});
    let b = host_with(store.clone(), p, |_| {});
    let run = a.setup("t", "r1").unwrap();
    fs::write(run.sandbox().unwrap().root.join("from-a"), "a").unwrap();
    run.on_finish().unwrap();
    drop(run);
    // Another sandbox (host B) publishes on the thread; A's sandbox stays live.
    let run = b.setup("t", "r2").unwrap();
    fs::write(run.sandbox().unwrap().root.join("from-b"), "b").unwrap();
    let head = run.on_finish().unwrap().checkpoint.unwrap();
    drop(run);
    let run = a.setup("t", "r3").unwrap();
    let root = run.sandbox().unwrap().root;
    assert_eq!(fs::read_to_string(root.join("from-b")).unwrap(), "b");
    fs::write(root.join("more"), "m").unwrap();
    let out = run.on_finish().unwrap();
    let cp = a.store.checkpoints().get(&out.checkpoint.unwrap()).unwrap();
    assert_eq!(
        cp.body.parent_id,
        Some(head),
        "published on top of B's checkpoint"
    );
}

/// A host with plain-directory sandboxes (no FUSE): the same lifecycle, checkpoints by
/// walking the directory, file events from inotify.
fn dir_host(
    store: Arc<Store>,
    persistence: Persistence,
    dir: &Path,
    cfg: impl FnOnce(&mut MiddlewareConfig),
) -> (Arc<casfs::middleware::DirProvider>, Arc<Middleware>) {
    let provider = Arc::new(casfs::middleware::DirProvider::new(store.clone(), dir));
    let mut snap = SnapshotConfig::new(persistence);
    snap.workspace = json!({"image": "debian:12"});
    let mut config = MiddlewareConfig {
        snapshots: Some(snap),
        ..Default::default()
    };
    cfg(&mut config);
    let mw = Arc::new(Middleware::new(store, provider.clone(), config).unwrap());
    (provider, mw)
}

#[test]
fn plain_directory_sandboxes_with_inotify_events() {
    let token = "tok_plain_dir_0123456789";
    let t = tempfile::tempdir().unwrap();
    let store = open_store(&t.path().join("store"));
    let seen: Arc<Mutex<Vec<casfs::middleware::FileEvent>>> = Arc::default();
    let sink = seen.clone();
    let setup_cfg = move |c: &mut MiddlewareConfig| {
        let s = c.snapshots.as_mut().unwrap();
        s.secrets = [("TOKEN".to_string(), token.to_string())].into();
        s.policy.exclude = vec!["target/".into()];
        c.file_events = Some(casfs::middleware::FileEvents {
            on_event: Arc::new(move |e| sink.lock().unwrap().push(e.clone())),
            diff: true,
        });
    };
    let (m, pa) = mem_persistence();
    let (pv, mw) = dir_host(
        store.clone(),
        pa.clone(),
        &t.path().join("a"),
        setup_cfg.clone(),
    );
    let run = mw
        .setup(RunContext::new(thread("t"), "r1"), Some(&pa))
        .unwrap();
    let root = run.sandbox().unwrap().root;
    assert!(run.sandbox().unwrap().mount().is_none());
    fs::write(root.join("config.toml"), format!("token = \"{token}\"\n")).unwrap();
    fs::write(root.join("draft.md"), "draft\n").unwrap();
    fs::rename(root.join("draft.md"), root.join("final.md")).unwrap();
    fs::write(root.join("tmp.txt"), "x").unwrap();
    fs::remove_file(root.join("tmp.txt")).unwrap();
    fs::create_dir(root.join("target")).unwrap();
    m.save_thread(
        &thread("t"),
        &[json!({"role": "user", "content": format!("use {token}")})],
    )
    .unwrap();
    let out = run.on_finish().unwrap();
    let id = out.checkpoint.unwrap();
    assert_eq!(out.secret_files, 1);
    let brief: Vec<(String, String)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|e| {
            let k = serde_json::to_value(e.event.kind).unwrap();
            (k.as_str().unwrap().to_string(), e.event.path.clone())
        })
        .collect();
    let s = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        brief,
        vec![
            s("create", "config.toml"),
            s("modify", "config.toml"),
            s("create", "draft.md"),
            s("modify", "draft.md"),
            s("rename", "draft.md"),
            s("create", "tmp.txt"),
            s("modify", "tmp.txt"),
            s("delete", "tmp.txt"),
            s("create", "target"),
        ]
    );
    assert!(!root.read_dir().unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .starts_with(".casfs-drain")));
    for blob in everything_stored(&store) {
        assert!(!contains(&blob, token));
    }
    let cp = store.checkpoints().get(&id).unwrap();
    let names: Vec<String> = load_tree(store.objects(), &cp.body.root)
        .unwrap()
        .entries()
        .iter()
        .map(|e| String::from_utf8_lossy(&e.name).into_owned())
        .collect();
    assert_eq!(
        names,
        vec!["config.toml".to_string(), "final.md".to_string()]
    );
    drop(run);
    pv.destroy("t", &Secrets::default()).unwrap();
    assert!(!root.exists());

    // Another host's plain directory gets the files (real values) and conversation.
    let (mb, pb) = mem_persistence();
    let (_pv, mw) = dir_host(store.clone(), pb.clone(), &t.path().join("b"), setup_cfg);
    let run = mw
        .setup(RunContext::new(thread("t"), "r2"), Some(&pb))
        .unwrap();
    let root = run.sandbox().unwrap().root;
    assert_eq!(
        fs::read_to_string(root.join("config.toml")).unwrap(),
        format!("token = \"{token}\"\n")
    );
    assert_eq!(
        fs::read_to_string(root.join("final.md")).unwrap(),
        "draft\n"
    );
    assert_eq!(
        mb.load_thread(&thread("t")).unwrap()[0]["content"],
        format!("use {token}")
    );
    fs::write(root.join("final.md"), "final\n").unwrap();
    let out = run.on_finish().unwrap();
    assert_eq!(out.changed_files, 1, "only final.md changed");
    let cp2 = store.checkpoints().get(&out.checkpoint.unwrap()).unwrap();
    assert_eq!(cp2.body.parent_id, Some(id));
}

#[test]
fn a_lease_that_expired_while_the_run_stalled_publishes_nothing() {
    let (_t, h) = host(|c| c.snapshots.as_mut().unwrap().lease_ttl = Duration::from_millis(400));
    let run = h.setup("t", "r1").unwrap();
    fs::write(run.sandbox().unwrap().root.join("f"), "x").unwrap();
    run.stall_lease_renewal();
    std::thread::sleep(Duration::from_millis(600));
    let e = run.on_finish().unwrap_err();
    assert!(
        matches!(
            e,
            MiddlewareError::Checkpoint(CheckpointError::LeaseExpired { .. })
        ),
        "{e}"
    );
    assert_eq!(h.head("t"), None);
    assert!(
        lease_is_free(&h.store, "t"),
        "an expired lease does not hold the thread"
    );
}

//! The promises users rely on most, tried as a client would: the real `casfs serve` over
//! HTTP on its Unix socket. A cancelled run is never published (not by the next run
//! either); a secret never reaches any byte under the store; every error is the
//! documented JSON, and every answer matches `openapi.json`; run ids are taken once and
//! sandbox keys never collide; arbitrary names never give a 500 or a path outside the
//! sandboxes directory.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use proptest::prelude::*;
use serde_json::{json, Value};

use crate::serve::{call, start, Served};
use crate::{wait_for, MountGuard};

/// One HTTP/1.1 request with raw headers and body; returns the status and the body as
/// JSON (a body that is not JSON comes back as a string, which no schema accepts).
fn raw(s: &Served, method: &str, path: &str, headers: &[&str], body: &[u8]) -> (u16, Value) {
    let mut stream = UnixStream::connect(&s.socket).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    // A server may answer (413) before it has read the whole body.
    let _ = stream.write_all(body);
    let mut resp = Vec::new();
    let _ = stream.read_to_end(&mut resp);
    let text = String::from_utf8_lossy(&resp).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let v = serde_json::from_str(rest).unwrap_or_else(|_| Value::String(rest.to_string()));
    (status, v)
}

/// The sandbox path a started run reports.
fn sandbox_of(v: &Value) -> PathBuf {
    PathBuf::from(v["sandbox"]["path"].as_str().expect("a sandbox path"))
}

pub(crate) fn start_run(s: &Served, thread: &str, run: &str) -> PathBuf {
    let (st, v) = call(
        s,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": thread, "run_id": run})),
    );
    assert_eq!(st, 200, "start {run}: {v}");
    sandbox_of(&v)
}

fn ok_call(s: &Served, method: &str, path: &str, body: Option<&Value>) -> Value {
    let (st, v) = call(s, method, path, body);
    assert_eq!(st, 200, "{method} {path}: {v}");
    v
}

/// Every regular file under `dir`, recursively (not following symlinks).
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let ft = e.file_type().unwrap();
        if ft.is_dir() {
            out.extend(files_under(&e.path()));
        } else if ft.is_file() {
            out.push(e.path());
        }
    }
    out
}

/// The names of the root tree of checkpoint `id`, read from the stopped server's store.
fn root_names(store: &Path, id: &str) -> Vec<String> {
    let st = casfs::checkpoint::Store::open_read_only(store).unwrap();
    let id = casfs::checkpoint::CheckpointId(casfs::cas::Hash::from_hex(id).unwrap());
    let cp = st.checkpoints().get(&id).unwrap();
    casfs::cas::load_tree(st.objects(), &cp.body.root)
        .unwrap()
        .entries()
        .iter()
        .map(|e| String::from_utf8_lossy(&e.name).into_owned())
        .collect()
}

fn stop(s: Served) {
    drop(s);
}

#[test]
fn a_cancelled_run_is_discarded_and_never_published_by_the_next() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let _g = MountGuard::new(&sb.join("t").join("workspace"));
    let s = start(&store, &sb, &[], &[]);

    let root = start_run(&s, "t", "c1");
    std::fs::write(root.join("cancelled.txt"), "never publish me").unwrap();
    ok_call(
        &s,
        "POST",
        "/v1/runs/c1/abort",
        Some(&json!({"cancelled": true})),
    );
    // The destroy discarded the upper files with the dirty set (and the sandbox's
    // disk; the server's spare disks, formatted empty ahead of need, hold nothing of
    // any run).
    let spares = store.join("mounts").join(".spare");
    let left: Vec<_> = files_under(&store.join("mounts"))
        .into_iter()
        .filter(|f| !f.starts_with(&spares))
        .collect();
    assert!(left.is_empty(), "left under mounts/: {left:?}");

    // The next run gets a sandbox made anew: empty, as the thread has no head.
    let root = start_run(&s, "t", "r2");
    assert!(
        !root.join("cancelled.txt").exists(),
        "the cancelled file came back"
    );
    std::fs::write(root.join("r2.txt"), "published").unwrap();
    let v = ok_call(&s, "POST", "/v1/runs/r2/finish", None);
    let first = v["checkpoint"].as_str().unwrap().to_string();
    assert_eq!(v["changed_files"], 1, "{v}");

    // A detached run's sandbox is resumed with its files: they are the next run's.
    let root = start_run(&s, "t", "d3");
    std::fs::write(root.join("kept.txt"), "resumed").unwrap();
    ok_call(
        &s,
        "POST",
        "/v1/runs/d3/abort",
        Some(&json!({"cancelled": false})),
    );
    let root = start_run(&s, "t", "r4");
    assert_eq!(
        std::fs::read_to_string(root.join("kept.txt")).unwrap(),
        "resumed"
    );
    let v = ok_call(&s, "POST", "/v1/runs/r4/finish", None);
    let second = v["checkpoint"].as_str().unwrap().to_string();

    // A cancelled run on top of a head: the next sandbox is exactly the head.
    let root = start_run(&s, "t", "c5");
    std::fs::write(root.join("cancelled.txt"), "no").unwrap();
    std::fs::write(root.join("r2.txt"), "overwritten by a cancelled run").unwrap();
    std::fs::remove_file(root.join("kept.txt")).unwrap();
    ok_call(
        &s,
        "POST",
        "/v1/runs/c5/abort",
        Some(&json!({"cancelled": true})),
    );
    let root = start_run(&s, "t", "r6");
    assert!(!root.join("cancelled.txt").exists());
    assert_eq!(
        std::fs::read_to_string(root.join("r2.txt")).unwrap(),
        "published"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("kept.txt")).unwrap(),
        "resumed"
    );
    let v = ok_call(&s, "POST", "/v1/runs/r6/finish", None);
    assert_eq!(v["changed_files"], 0, "nothing of c5 is published: {v}");
    let third = v["checkpoint"].as_str().unwrap().to_string();
    stop(s);

    assert_eq!(root_names(&store, &first), vec!["r2.txt"]);
    assert_eq!(root_names(&store, &second), vec!["kept.txt", "r2.txt"]);
    assert_eq!(root_names(&store, &third), vec!["kept.txt", "r2.txt"]);
    // The stopped server destroyed its sandboxes: nothing uncaptured is left.
    let left = files_under(&store.join("mounts"));
    assert!(left.is_empty(), "left under mounts/: {left:?}");
}

/// Every byte string the store holds in a form that could hide a secret from a raw
/// scan: every key and value of every column family, every object decoded.
fn decoded_store(store: &Path) -> Vec<Vec<u8>> {
    let st = casfs::checkpoint::Store::open_read_only(store).unwrap();
    let db = st.database();
    let mut out = Vec::new();
    for cf in db.cf_names() {
        for item in db.column(cf).entries() {
            let (k, v) = item.unwrap();
            out.push(k.to_vec());
            if cf == casfs::cas::kv::OBJECTS_CF {
                let id = casfs::cas::Hash::from_slice(&k).unwrap();
                out.push(casfs::cas::object::decode_stored(&id, &v).unwrap());
            } else {
                out.push(v.to_vec());
            }
        }
    }
    out
}

fn holds(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Fails if any file under `store` (raw bytes) or anything the store holds (decoded)
/// contains one of `needles`.
pub(crate) fn assert_nowhere(store: &Path, needles: &[&[u8]]) {
    for f in files_under(store) {
        let bytes = std::fs::read(&f).unwrap();
        for n in needles {
            assert!(
                !holds(&bytes, n),
                "{} holds {:?}",
                f.display(),
                String::from_utf8_lossy(n)
            );
        }
    }
    for b in decoded_store(store) {
        for n in needles {
            assert!(
                !holds(&b, n),
                "the store holds {:?}",
                String::from_utf8_lossy(n)
            );
        }
    }
}

#[test]
fn a_secret_reaches_no_byte_under_the_store() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let _g = MountGuard::new(&sb.join("conv").join("workspace"));
    // A value JSON escapes: scrubbing after encoding would miss it.
    let secret = "sk-\"live\"\\path-9f8e7d6c";
    let escaped = serde_json::to_string(secret).unwrap();
    let escaped = escaped.trim_matches('"').to_string();
    let needles: Vec<&[u8]> = vec![secret.as_bytes(), escaped.as_bytes()];
    let s = start(
        &store,
        &sb,
        &["--secret", "API_KEY"],
        &[("API_KEY", secret)],
    );

    let root = start_run(&s, "conv", "r1");
    std::fs::write(root.join(".env"), format!("API_KEY={secret}\n")).unwrap();
    std::fs::write(root.join("app.py"), "print('hi')\n").unwrap();
    let messages = json!([
        {"role": "user", "content": format!("my key is {secret}, quoted: \"{secret}\"")},
        {(secret.to_string()): ["as an object key", secret]},
    ]);
    ok_call(&s, "PUT", "/v1/threads/conv/messages", Some(&messages));
    // The host reads back what it wrote.
    assert_eq!(
        ok_call(&s, "GET", "/v1/threads/conv/messages", None),
        messages
    );
    use base64::Engine;
    let blob = format!("report: {secret}\n");
    let content = base64::engine::general_purpose::STANDARD.encode(&blob);
    let v = ok_call(
        &s,
        "POST",
        "/v1/threads/conv/artifacts",
        Some(
            &json!({"artifact_id": format!("a-{secret}"), "run_id": "r1",
            "name": format!("{secret}.txt"), "mime_type": "text/plain", "content_base64": content}),
        ),
    );
    assert_eq!(v["size"], blob.len(), "{v}");
    let v = ok_call(&s, "POST", "/v1/runs/r1/finish", None);
    assert_eq!(v["secret_files"], 1, "{v}");
    let arts = ok_call(&s, "GET", "/v1/threads/conv/artifacts", None);
    assert_eq!(arts[0]["name"], format!("{secret}.txt"), "{arts}");

    // A name, a symlink target, an extended attribute holding it: each refuses the
    // capture (422), naming the entry with a placeholder and never the value.
    let name_safe = secret.replace('/', "_");
    type Plant = Box<dyn Fn(&Path)>;
    type Clear = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Plant, Clear)> = vec![
        (
            "name",
            Box::new(move |r: &Path| std::fs::write(r.join(&name_safe), "x").unwrap()),
            Box::new(move |r: &Path| {
                std::fs::remove_file(r.join(secret.replace('/', "_"))).unwrap()
            }),
        ),
        (
            "symlink target",
            Box::new(move |r: &Path| {
                std::os::unix::fs::symlink(format!("/run/{secret}"), r.join("link")).unwrap()
            }),
            Box::new(|r: &Path| std::fs::remove_file(r.join("link")).unwrap()),
        ),
        (
            "extended attribute",
            Box::new(move |r: &Path| set_xattr(&r.join("app.py"), "user.token", secret)),
            Box::new(|r: &Path| remove_xattr(&r.join("app.py"), "user.token")),
        ),
    ];
    for (i, (what, plant, clear)) in cases.iter().enumerate() {
        let run = format!("bad{i}");
        let root = start_run(&s, "conv", &run);
        plant(&root);
        let (st, v) = call(&s, "POST", &format!("/v1/runs/{run}/finish"), None);
        assert_eq!(
            (st, v["error"]["kind"].as_str()),
            (422, Some("policy")),
            "{what}: {v}"
        );
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(what) && m.contains("API_KEY"), "{m}");
        assert!(!m.contains("live"), "the message shows the value: {m}");
        let run = format!("fix{i}");
        let root = start_run(&s, "conv", &run);
        clear(&root);
        ok_call(&s, "POST", &format!("/v1/runs/{run}/finish"), None);
    }
    // Names of runs and threads go into records: refused when they hold it.
    let (st, v) = call(
        &s,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "conv2", "run_id": format!("r-{secret}")})),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        !v["error"]["message"].as_str().unwrap().contains("live"),
        "{v}"
    );
    stop(s);
    assert_nowhere(&store, &needles);

    // Restored on a new sandbox (the server restarted): the real value is back in
    // the file, through the API in the conversation, and the artifact keeps its size.
    let s = start(
        &store,
        &sb,
        &["--secret", "API_KEY"],
        &[("API_KEY", secret)],
    );
    let root = start_run(&s, "conv", "r9");
    assert_eq!(
        std::fs::read_to_string(root.join(".env")).unwrap(),
        format!("API_KEY={secret}\n")
    );
    assert_eq!(
        ok_call(&s, "GET", "/v1/threads/conv/messages", None),
        messages
    );
    let arts = ok_call(&s, "GET", "/v1/threads/conv/artifacts", None);
    assert_eq!(arts[0]["size"], blob.len(), "{arts}");
    ok_call(
        &s,
        "POST",
        "/v1/runs/r9/abort",
        Some(&json!({"cancelled": true})),
    );
    stop(s);
    assert_nowhere(&store, &needles);
}

fn set_xattr(path: &Path, name: &str, value: &str) {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: NUL-terminated path and name, a valid buffer and its length.
    let rc = unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(rc, 0, "setxattr: {}", std::io::Error::last_os_error());
}

fn remove_xattr(path: &Path, name: &str) {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: NUL-terminated path and name.
    let rc = unsafe { libc::removexattr(p.as_ptr(), n.as_ptr()) };
    assert_eq!(rc, 0, "removexattr: {}", std::io::Error::last_os_error());
}

#[test]
fn a_server_killed_mid_run_leaves_no_work_and_no_secret_behind() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let _g = MountGuard::new(&sb.join("t").join("workspace"));
    let secret = "tok-0123456789-killed";
    let env = [("API_KEY", secret)];
    let args = ["--secret", "API_KEY"];
    let mut s = start(&store, &sb, &args, &env);
    let root = start_run(&s, "t", "r1");
    std::fs::write(root.join("done.txt"), "published").unwrap();
    ok_call(&s, "POST", "/v1/runs/r1/finish", None);
    let root = start_run(&s, "t", "k2");
    std::fs::write(root.join(".env"), format!("API_KEY={secret}\n")).unwrap();
    std::os::unix::fs::symlink(secret, root.join("link")).unwrap();
    std::fs::write(root.join("uncaptured.txt"), "mid-run").unwrap();
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    if crate::overlay() {
        // The kernel's overlay outlives its server (its lower is dead).
        assert!(casfs::fs::is_overlay_mount(&root), "the overlay stays");
    } else {
        // Over io_uring the kernel lets go of the connection once the dead process's
        // rings are torn down, which it does in the background: a moment later.
        assert!(
            wait_for(Duration::from_secs(5), || casfs::fs::is_dead_mount(&root)),
            "a killed server leaves a dead mount"
        );
    }

    // Restarted: the dead run's lease is taken over (its holder is gone), the dead
    // mount is cleaned, the next run starts at the head.
    let s = start(&store, &sb, &args, &env);
    let root = start_run(&s, "t", "r3");
    assert_eq!(
        std::fs::read_to_string(root.join("done.txt")).unwrap(),
        "published"
    );
    assert!(!root.join("uncaptured.txt").exists());
    assert!(!root.join(".env").exists());
    let v = ok_call(&s, "POST", "/v1/runs/r3/finish", None);
    assert_eq!(v["changed_files"], 0, "nothing of the killed run: {v}");
    stop(s);
    assert_nowhere(&store, &[secret.as_bytes()]);
    let fsck = crate::common::json(&store, &["fsck"]);
    assert_eq!(fsck["errors"], json!([]), "{fsck}");
}

#[test]
fn file_events_report_every_change_with_its_diff() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let _g = MountGuard::new(&sb.join("t").join("workspace"));
    let s = start(&store, &sb, &["--diffs"], &[]);
    let root = start_run(&s, "t", "e1");
    let f = root.join("notes.txt");
    // Every close of a writer's file description is announced, and a child that
    // another test (tests run in threads of one process) forks while a file here is
    // open holds a copy until its exec closes it: that close repeats the event before
    // it, diff and all. Repeats are left out.
    let events = |n: usize| {
        let mut v = Value::Null;
        wait_for(Duration::from_secs(10), || {
            let all = ok_call(&s, "GET", "/v1/runs/e1/events", None);
            let mut kept: Vec<Value> = Vec::new();
            for e in all.as_array().unwrap() {
                let same = |k: &Value| k["kind"] == e["kind"] && k["path"] == e["path"];
                let repeat = kept
                    .last()
                    .is_some_and(|k| same(k) && k["diff"] == e["diff"] && e["kind"] == "modify");
                if !repeat {
                    kept.push(e.clone());
                }
            }
            v = Value::Array(kept);
            v.as_array().unwrap().len() >= n
        });
        v
    };
    std::fs::write(&f, "v1\n").unwrap();
    let v = events(2);
    std::thread::sleep(Duration::from_millis(1500));
    // An append long after: its own event (it was dropped as a repeat of the last).
    std::fs::OpenOptions::new()
        .append(true)
        .open(&f)
        .unwrap()
        .write_all(b"v2\n")
        .unwrap();
    let v2 = events(3);
    // A rewrite through O_TRUNC: one event, with the content written after the
    // truncate (its diff was "" when the truncate had an event of its own).
    std::fs::write(&f, "v3\n").unwrap();
    let v3 = events(4);
    let ev = v3.as_array().unwrap();
    let kinds: Vec<&str> = ev.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["create", "modify", "modify", "modify"], "{v3}");
    let diff = |i: usize| ev[i]["diff"].as_str().unwrap_or_default().to_string();
    assert!(diff(1).contains("+v1"), "{v}");
    assert!(diff(2).contains("+v1") && diff(2).contains("+v2"), "{v2}");
    assert!(diff(3).contains("+v3") && !diff(3).contains("v1"), "{v3}");
    let seqs: Vec<u64> = ev.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
}

/// The schema of the answer `openapi.json` documents for `method path` with `status`
/// (`None`: not documented). Unknown routes answer with the Error schema.
fn documented(doc: &Value, method: &str, path: &str, status: u16) -> Option<Value> {
    let path = path.split('?').next().unwrap();
    let error = json!({"$ref": "#/components/schemas/Error"});
    let matches = |template: &str| {
        let (a, b): (Vec<&str>, Vec<&str>) =
            (template.split('/').collect(), path.split('/').collect());
        a.len() == b.len() && a.iter().zip(&b).all(|(t, p)| t.starts_with('{') || t == p)
    };
    let Some((_, item)) = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(t, _)| matches(t))
    else {
        return (status == 404).then_some(error);
    };
    let Some(op) = item.get(method.to_lowercase()) else {
        return (status == 405).then_some(error);
    };
    let r = op["responses"].get(status.to_string())?;
    if r.get("$ref").is_some() {
        return Some(error);
    }
    Some(r["content"]["application/json"]["schema"].clone())
}

/// Checks that `body` is what `openapi.json` documents for the answer.
pub(crate) fn conforms(doc: &Value, method: &str, path: &str, status: u16, body: &Value) {
    let schema = documented(doc, method, path, status)
        .unwrap_or_else(|| panic!("{method} {path}: {status} is not documented ({body})"));
    // The schema, resolved against the whole document (its $refs point into it).
    let mut root = doc.clone();
    root.as_object_mut()
        .unwrap()
        .insert("$ref".into(), json!("#/$defs/answer"));
    root.as_object_mut()
        .unwrap()
        .insert("$defs".into(), json!({"answer": schema}));
    let v = jsonschema::draft202012::new(&root).expect("openapi.json schemas compile");
    if let Err(e) = v.validate(body) {
        panic!("{method} {path} {status}: {body} does not match openapi.json: {e}");
    }
}

#[test]
fn every_answer_is_documented_and_every_error_is_json() {
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json"))
            .unwrap(),
    )
    .unwrap();
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let policy = t.path().join("policy.json");
    std::fs::write(&policy, r#"{"max_file_size": 10, "oversize": "fail"}"#).unwrap();
    let s = start(
        &store,
        &sb,
        &["--max-body", "4096", "--policy", policy.to_str().unwrap()],
        &[],
    );
    let j = ["Content-Type: application/json"];
    let check =
        |method: &str, path: &str, headers: &[&str], body: &[u8], want: (u16, &str)| -> Value {
            let (st, v) = raw(&s, method, path, headers, body);
            assert_eq!(
                (st, v["error"]["kind"].as_str().unwrap_or("")),
                want,
                "{method} {path}: {v}"
            );
            conforms(&doc, method, path, st, &v);
            v
        };
    // Bodies the server cannot take: JSON errors, 400/413/415 (never 422, never text).
    check("POST", "/v1/runs", &j, b"{not json", (400, "invalid"));
    check(
        "POST",
        "/v1/runs",
        &j,
        br#"{"thread": 5, "run_id": "x"}"#,
        (400, "invalid"),
    );
    check("POST", "/v1/runs", &j, b"{}", (400, "invalid"));
    check(
        "POST",
        "/v1/runs",
        &[],
        br#"{"thread": "t", "run_id": "x"}"#,
        (415, "unsupported_media_type"),
    );
    let big = format!(r#"{{"thread": "t", "run_id": "{}"}}"#, "x".repeat(5000));
    check("POST", "/v1/runs", &j, big.as_bytes(), (413, "too_large"));
    check(
        "PUT",
        "/v1/threads/t/messages",
        &j,
        br#"{"a": 1}"#,
        (400, "invalid"),
    );
    check(
        "POST",
        "/v1/maintenance",
        &j,
        br#"{"what": "bogus"}"#,
        (400, "invalid"),
    );
    check(
        "POST",
        "/v1/runs/x/abort",
        &j,
        br#"{"cancelled": "yes"}"#,
        (400, "invalid"),
    );
    // Routes, methods, paths and queries.
    check("GET", "/v1/nope", &[], b"", (404, "not_found"));
    check("DELETE", "/v1/runs", &[], b"", (405, "method_not_allowed"));
    check(
        "GET",
        "/v1/threads/t/checkpoints?limit=abc",
        &[],
        b"",
        (400, "invalid"),
    );
    check(
        "GET",
        "/v1/threads/a%20b/checkpoints",
        &[],
        b"",
        (400, "invalid"),
    );
    check(
        "GET",
        "/v1/threads/%FF/messages",
        &[],
        b"",
        (400, "invalid"),
    );
    check(
        "GET",
        "/v1/runs/nope/events?after=-1",
        &[],
        b"",
        (400, "invalid"),
    );
    check("POST", "/v1/runs/nope/finish", &[], b"", (404, "not_found"));
    check("GET", "/v1/checkpoints/0123", &[], b"", (404, "not_found"));
    // Names: client mistakes are 400; anything valid gets a sandbox (not a 500).
    check(
        "POST",
        "/v1/runs",
        &j,
        br#"{"thread": "t", "run_id": ""}"#,
        (400, "invalid"),
    );
    check(
        "POST",
        "/v1/runs",
        &j,
        br#"{"thread": "t", "run_id": "x", "tenant": ""}"#,
        (400, "invalid"),
    );
    let odd = [
        json!({"thread": "a:b@c%d+e", "run_id": "o1", "tenant": "../../etc"}),
        json!({"thread": "ü".repeat(100), "run_id": "o2", "tenant": "/"}),
        json!({"thread": "..", "run_id": "o3"}),
        json!({"thread": "x".repeat(200), "run_id": "o4", "tenant": "t".repeat(200)}),
    ];
    for (i, b) in odd.iter().enumerate() {
        let body = serde_json::to_vec(b).unwrap();
        let v = check("POST", "/v1/runs", &j, &body, (200, ""));
        let p = sandbox_of(&v);
        let _g = MountGuard::new(&p);
        // `<sandboxes>/<key>/workspace`: one gate right under the sandboxes directory.
        assert_eq!(p.file_name().unwrap(), "workspace", "{p:?}");
        assert_eq!(
            p.parent().unwrap().parent().unwrap(),
            std::fs::canonicalize(&sb).unwrap(),
            "{p:?}"
        );
        check(
            "POST",
            &format!("/v1/runs/o{}/abort", i + 1),
            &j,
            br#"{"cancelled": true}"#,
            (200, ""),
        );
    }
    // Conflicts and the policy.
    let _g = MountGuard::new(&sb.join("t").join("workspace"));
    let v = check(
        "POST",
        "/v1/runs",
        &j,
        br#"{"thread": "t", "run_id": "r1"}"#,
        (200, ""),
    );
    check(
        "POST",
        "/v1/runs",
        &j,
        br#"{"thread": "t", "run_id": "r2"}"#,
        (409, "lease_held"),
    );
    check(
        "POST",
        "/v1/runs",
        &j,
        br#"{"thread": "u", "run_id": "r1"}"#,
        (409, "run_exists"),
    );
    check("GET", "/v1/runs/r1/events", &[], b"", (200, ""));
    check("GET", "/v1/sandboxes", &[], b"", (200, ""));
    check("GET", "/v1/threads", &[], b"", (200, ""));
    check("GET", "/v1/health", &[], b"", (200, ""));
    std::fs::write(sandbox_of(&v).join("big.bin"), [0u8; 100]).unwrap();
    check("POST", "/v1/runs/r1/finish", &[], b"", (422, "policy"));
    check("POST", "/v1/runs/r1/finish", &[], b"", (404, "not_found"));
    let v = check(
        "POST",
        "/v1/runs",
        &j,
        br#"{"thread": "t", "run_id": "r3"}"#,
        (200, ""),
    );
    std::fs::remove_file(sandbox_of(&v).join("big.bin")).unwrap();
    let v = check("POST", "/v1/runs/r3/finish", &[], b"", (200, ""));
    let id = v["checkpoint"].as_str().unwrap().to_string();
    check("GET", &format!("/v1/checkpoints/{id}"), &[], b"", (200, ""));
    // The references the command line takes: `@thread`, `~N`, prefixes.
    let v = check("GET", "/v1/checkpoints/@t", &[], b"", (200, ""));
    assert_eq!(v["id"], json!(id));
    check(
        "GET",
        &format!("/v1/checkpoints/{}", &id[..8]),
        &[],
        b"",
        (200, ""),
    );
    check("GET", "/v1/checkpoints/@t~1", &[], b"", (404, "not_found"));
    check("GET", "/v1/checkpoints/@t~x", &[], b"", (400, "invalid"));
    check(
        "GET",
        "/v1/checkpoints/@nobody",
        &[],
        b"",
        (404, "not_found"),
    );
    check("GET", "/v1/threads/t/checkpoints", &[], b"", (200, ""));
    check("GET", "/v1/threads/t/messages", &[], b"", (200, ""));
    check("GET", "/v1/threads/t/artifacts", &[], b"", (200, ""));
    check(
        "POST",
        "/v1/maintenance",
        &j,
        br#"{"what": "fsck", "repair": false}"#,
        (200, ""),
    );
}

#[test]
fn run_ids_are_taken_once_and_sandbox_keys_never_collide() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sb = t.path().join("sb");
    let s = Arc::new(start(&store, &sb, &[], &[]));
    for i in 0..6 {
        let gate = Arc::new(Barrier::new(2));
        let id = format!("dup{i}");
        let racers: Vec<_> = ["x1", "x2"]
            .into_iter()
            .map(|thread| {
                let (s, gate, id) = (s.clone(), gate.clone(), id.clone());
                let _g = MountGuard::new(&sb.join(thread));
                std::thread::spawn(move || {
                    let _g = _g;
                    gate.wait();
                    call(
                        &s,
                        "POST",
                        "/v1/runs",
                        Some(&json!({"thread": thread, "run_id": id})),
                    )
                })
            })
            .collect();
        let mut answers: Vec<(u16, Value)> =
            racers.into_iter().map(|r| r.join().unwrap()).collect();
        answers.sort_by_key(|a| a.0);
        assert_eq!(answers[0].0, 200, "{answers:?}");
        assert_eq!(
            (answers[1].0, answers[1].1["error"]["kind"].as_str()),
            (409, Some("run_exists")),
            "{answers:?}"
        );
        ok_call(
            &s,
            "POST",
            &format!("/v1/runs/{id}/abort"),
            Some(&json!({"cancelled": true})),
        );
    }
    // (a, b.c) and (a.b, c) are two sandboxes.
    let (st, v1) = call(
        &s,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "b.c", "run_id": "k1", "tenant": "a"})),
    );
    assert_eq!(st, 200, "{v1}");
    let (st, v2) = call(
        &s,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "c", "run_id": "k2", "tenant": "a.b"})),
    );
    assert_eq!(st, 200, "{v2}");
    let (p1, p2) = (sandbox_of(&v1), sandbox_of(&v2));
    let _g = (MountGuard::new(&p1), MountGuard::new(&p2));
    assert_ne!(p1, p2);
    std::fs::write(p1.join("mine.txt"), "k1").unwrap();
    assert!(!p2.join("mine.txt").exists());
    for r in ["k1", "k2"] {
        ok_call(
            &s,
            "POST",
            &format!("/v1/runs/{r}/abort"),
            Some(&json!({"cancelled": true})),
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// Arbitrary thread, tenant and run names through the API: 200, 400 or 409, never a
    /// 500; a sandbox is always one directory right under the sandboxes directory.
    #[test]
    fn arbitrary_names_never_fail_the_server_or_escape_the_sandboxes(
        names in proptest::collection::vec(
            ("\\PC{0,40}|[./%+~@:a-z]{1,12}|\\.\\.", proptest::option::of("\\PC{0,40}|\\.\\.|/|\\.\\./x"), "\\PC{0,24}"),
            4,
        )
    ) {
        let t = tempfile::tempdir().unwrap();
        let sb = t.path().join("sb");
        let s = start(&t.path().join("store"), &sb, &[], &[]);
        let sb = std::fs::canonicalize(&sb).unwrap();
        for (thread, tenant, run) in names {
            let (st, v) = call(&s, "POST", "/v1/runs", Some(&json!({"thread": thread, "run_id": run, "tenant": tenant})));
            prop_assert!(matches!(st, 200 | 400 | 409), "{st}: {v}");
            prop_assert!(v.get("error").is_none() || v["error"]["kind"].is_string(), "{v}");
            if st == 200 {
                let p = sandbox_of(&v);
                let _g = MountGuard::new(&p);
                prop_assert_eq!(p.parent().and_then(|g| g.parent()), Some(sb.as_path()), "{:?}", p);
                prop_assert!(p.is_dir());
                let path = format!("/v1/runs/{}/abort", utf8_percent(&run));
                let (st, v) = call(&s, "POST", &path, Some(&json!({"cancelled": true})));
                prop_assert_eq!(st, 200, "{}", v);
            }
        }
        drop(s);
        // Nothing was made beside the sandboxes directory but the store and its socket.
        for e in std::fs::read_dir(t.path()).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            prop_assert!(["sb", "store", "serve.sock"].contains(&name.as_str()), "{}", name);
        }
    }
}

/// `s` percent-encoded for a URL path segment.
fn utf8_percent(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

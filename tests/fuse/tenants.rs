//! Members of the socket's group are tenants of their own: tried as a hostile member
//! would, with two real users (useradd) in the group of a root `casfs serve` (the
//! Debian unit's setting), on the mount backend of the pass. Member B tries every way
//! member A's sandboxes, runs, threads, checkpoints, messages, artifacts and portable
//! stores were reached before (listing, events, resuming, capturing, destroying,
//! reading, overwriting, forking, pruning, evicting at the cap) and gets nothing; a
//! placeholder a client writes comes back as written.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::serve::{call, start, Served};
use crate::users::{place, TestGroup, TestUser};
use crate::MountsUnder;

const SECRET: &str = "sk-tenant-secret-0123456789";

/// A root server whose socket's group is `group`, with secret API_KEY, and more flags.
fn server(store: &Path, sandboxes: &Path, group: &TestGroup, extra: &[&str]) -> Served {
    let mut args = vec![
        "--socket-group",
        group.name.as_str(),
        "--mode",
        crate::mount_mode().as_str(),
        "--secret",
        "API_KEY",
    ];
    args.extend_from_slice(extra);
    start(store, sandboxes, &args, &[("API_KEY", SECRET)])
}

/// A request as `user` that must answer 200; its body.
fn ok_as(user: &TestUser, s: &Served, method: &str, path: &str, body: Option<&Value>) -> Value {
    let (st, v) = user.http(&s.socket, method, path, body);
    assert_eq!(st, 200, "as {}: {method} {path}: {v}", user.name);
    v
}

/// A request as `user` that must not answer 200: its status.
fn refused_as(user: &TestUser, s: &Served, method: &str, path: &str, body: Option<&Value>) -> u16 {
    let (st, v) = user.http(&s.socket, method, path, body);
    assert_ne!(st, 200, "as {}: {method} {path} was served: {v}", user.name);
    assert!(v["error"]["kind"].is_string(), "{v}");
    st
}

/// Boundary 3 (tenants): member B reaches nothing of member A's: not A's sandboxes
/// (listed, their events read, resumed, captured, destroyed, entered through the file
/// system), runs, threads, checkpoints (by id, prefix or `@thread`), messages,
/// artifacts, portable stores, instance records or transcripts; maintenance is refused
/// to both. Root, an administrator, sees A's thread under A's name.
#[test]
fn a_member_reaches_nothing_of_another_member() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (_t, store, sandboxes) = place();
    let group = TestGroup::new();
    let (a, b) = (TestUser::new(Some(&group)), TestUser::new(Some(&group)));
    let _g = MountsUnder(sandboxes.clone());
    let s = server(&store, &sandboxes, &group, &[]);

    // A's published checkpoint, with a private file; a run still going with uncaptured
    // work; a sandbox A made as a client; messages, an artifact, a portable store.
    let v = ok_as(
        &a,
        &s,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "work", "run_id": "r1"})),
    );
    let root_a = PathBuf::from(v["sandbox"]["path"].as_str().unwrap());
    a.sh(
        &root_a,
        "printf 'mine\\n' > private.txt && chmod 0600 private.txt && printf 'n\\n' > notes.md",
    );
    let cp_a = ok_as(&a, &s, "POST", "/v1/runs/r1/finish", None)["checkpoint"]
        .as_str()
        .unwrap()
        .to_string();
    let v = ok_as(
        &a,
        &s,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "work", "run_id": "live"})),
    );
    let live_a = PathBuf::from(v["sandbox"]["path"].as_str().unwrap());
    a.sh(
        &live_a,
        "printf 'wip\\n' > uncaptured.txt && chmod 0600 uncaptured.txt",
    );
    let v = ok_as(
        &a,
        &s,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "client"})),
    );
    let (key_a, path_a) = (
        v["key"].as_str().unwrap().to_string(),
        PathBuf::from(v["path"].as_str().unwrap()),
    );
    a.sh(&path_a, "printf 'client\\n' > c.txt && chmod 0600 c.txt");
    ok_as(
        &a,
        &s,
        "PUT",
        "/v1/threads/work/messages",
        Some(&json!([{"role": "user", "content": "a's"}])),
    );
    let art = json!({"artifact_id": "x", "run_id": "r1", "name": "a.txt", "mime_type": "text/plain",
                     "content_base64": "YSdz"});
    ok_as(&a, &s, "POST", "/v1/threads/work/artifacts", Some(&art));
    ok_as(&a, &s, "PUT", "/v1/stores/st", Some(&json!({})));
    ok_as(
        &a,
        &s,
        "PUT",
        "/v1/stores/st/instances/k",
        Some(&json!({"who": "a"})),
    );
    ok_as(
        &a,
        &s,
        "PUT",
        "/v1/stores/st/threads/t/messages",
        Some(&json!([{"content": "a's"}])),
    );

    // B lists nothing of A's.
    assert_eq!(ok_as(&b, &s, "GET", "/v1/sandboxes", None), json!([]));
    assert_eq!(ok_as(&b, &s, "GET", "/v1/threads", None), json!([]));
    // B cannot read A's events, capture A's sandbox, end or read A's runs.
    assert_eq!(
        refused_as(
            &b,
            &s,
            "GET",
            &format!("/v1/sandboxes/{key_a}/events"),
            None
        ),
        404
    );
    for (m, p) in [
        ("GET", "/v1/runs/live/events"),
        ("POST", "/v1/runs/live/finish"),
        ("POST", "/v1/runs/live/disconnect"),
    ] {
        assert_eq!(refused_as(&b, &s, m, p, None), 404, "{m} {p}");
    }
    let w = ok_as(
        &b,
        &s,
        "POST",
        "/v1/threads/client/writer",
        Some(&json!({})),
    );
    let proof = json!({"token": w["token"], "owner_token": w["owner_token"]});
    let grab = json!({"sandbox": key_a, "expected_head": null, "writer": proof});
    assert_eq!(
        refused_as(
            &b,
            &s,
            "POST",
            "/v1/threads/client/checkpoints",
            Some(&grab)
        ),
        404
    );
    // B's checkpoint references never name A's checkpoints.
    // The same answer as for a checkpoint that does not exist: nothing tells B what
    // A's ids are or how long A's history is.
    let none = "0".repeat(64);
    let (st, missing) = b.http(&s.socket, "GET", &format!("/v1/checkpoints/{none}"), None);
    assert_eq!(st, 404);
    for r in [
        cp_a.clone(),
        cp_a[..12].to_string(),
        format!("{cp_a}~1"),
        format!("{}~5", &cp_a[..12]),
        "@work".to_string(),
    ] {
        let (st, v) = b.http(&s.socket, "GET", &format!("/v1/checkpoints/{r}"), None);
        assert_eq!(st, 404, "{r}: {v}");
        let shown = v["error"]["message"].as_str().unwrap().replace(&r, &none);
        assert_eq!(shown, missing["error"]["message"].as_str().unwrap(), "{r}");
    }
    assert_eq!(
        refused_as(
            &b,
            &s,
            "POST",
            "/v1/threads/stolen/fork",
            Some(&json!({"from": cp_a}))
        ),
        404
    );
    // B's "work" is B's own: empty, with no messages or artifacts of A's.
    assert_eq!(
        ok_as(&b, &s, "GET", "/v1/threads/work/checkpoints", None),
        json!([])
    );
    assert_eq!(
        ok_as(&b, &s, "GET", "/v1/threads/work/messages", None),
        json!([])
    );
    assert_eq!(
        ok_as(&b, &s, "GET", "/v1/threads/work/artifacts", None),
        json!([])
    );
    // Resuming "A's" thread gives B a sandbox of B's own, holding nothing of A's.
    let v = ok_as(
        &b,
        &s,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "work"})),
    );
    let root_b = PathBuf::from(v["path"].as_str().unwrap());
    assert_ne!(v["key"], json!(key_a));
    assert!(!root_b.join("private.txt").exists() && !root_b.join("uncaptured.txt").exists());
    assert_eq!(v["outcome"], "created", "{v}");
    // B's run ids are B's own: "live" is free for B, and B's end of it is not A's.
    ok_as(
        &b,
        &s,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "other", "run_id": "live"})),
    );
    ok_as(
        &b,
        &s,
        "POST",
        "/v1/runs/live/abort",
        Some(&json!({"cancelled": true})),
    );
    // A DELETE of A's sandbox destroys nothing.
    let v = ok_as(&b, &s, "DELETE", &format!("/v1/sandboxes/{key_a}"), None);
    assert_eq!(v["destroyed"], false, "{v}");
    // Through the file system neither: not even a name of A's workspaces is reachable.
    for p in [&root_a, &live_a, &path_a] {
        let out = b.run("ls", &[&p.display().to_string()]);
        assert!(!out.status.success(), "B listed {}", p.display());
        let out = b.run("cat", &[&p.join("notes.md").display().to_string()]);
        assert!(!out.status.success(), "B read {}", p.display());
    }
    let out = b.run("ls", &[&sandboxes.display().to_string()]);
    assert!(!out.status.success(), "B listed whose sandboxes there are");
    // Nor through the store's own directories, where uncaptured work and images live
    // (the test's umask lets others read what it makes: the store does not rely on it).
    for d in ["mounts", "images", "db"] {
        let out = b.run("ls", &[&store.join(d).display().to_string()]);
        assert!(!out.status.success(), "B listed the store's {d}");
    }
    let uppers = b.run(
        "sh",
        &[
            "-c",
            &format!("find {} 2>/dev/null | grep -c upper", store.display()),
        ],
    );
    assert_eq!(
        String::from_utf8_lossy(&uppers.stdout).trim(),
        "0",
        "B found uppers"
    );
    // Portable stores: B's "st" is B's own.
    assert_eq!(
        refused_as(&b, &s, "GET", "/v1/stores/st/instances/k", None),
        404,
        "B reached A's store"
    );
    ok_as(&b, &s, "PUT", "/v1/stores/st", Some(&json!({})));
    assert_eq!(
        ok_as(&b, &s, "GET", "/v1/stores/st/instances/k", None)["record"],
        Value::Null
    );
    ok_as(&b, &s, "DELETE", "/v1/stores/st/instances/k", None);
    ok_as(
        &b,
        &s,
        "PUT",
        "/v1/stores/st/threads/t/messages",
        Some(&json!([{"content": "b's"}])),
    );
    // Maintenance is the administrators'.
    let prune = json!({"what": "prune", "keep_last": 1});
    assert_eq!(
        refused_as(&b, &s, "POST", "/v1/maintenance", Some(&prune)),
        403
    );
    assert_eq!(
        refused_as(&a, &s, "POST", "/v1/maintenance", Some(&prune)),
        403
    );

    // A still has everything, as it was.
    let listed = ok_as(&a, &s, "GET", "/v1/sandboxes", None);
    let keys: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["key"].as_str().unwrap())
        .collect();
    assert!(keys.contains(&key_a.as_str()), "{listed}");
    assert_eq!(
        std::fs::read_to_string(path_a.join("c.txt")).unwrap(),
        "client\n"
    );
    assert_eq!(
        std::fs::read_to_string(live_a.join("uncaptured.txt")).unwrap(),
        "wip\n"
    );
    assert_eq!(
        ok_as(&a, &s, "GET", "/v1/stores/st/instances/k", None)["record"],
        json!({"who": "a"})
    );
    assert_eq!(
        ok_as(&a, &s, "GET", "/v1/stores/st/threads/t/messages", None)["messages"],
        json!([{"content": "a's"}])
    );
    assert_eq!(
        ok_as(&a, &s, "GET", &format!("/v1/checkpoints/{cp_a}"), None)["thread_id"],
        "work"
    );
    let threads = ok_as(&a, &s, "GET", "/v1/threads", None);
    assert_eq!(threads.as_array().unwrap().len(), 1, "{threads}");
    assert_eq!(threads[0]["thread"], "work");
    // Root sees A's thread under A's name, and may name it.
    let (st, v) = call(&s, "GET", "/v1/threads", None);
    assert_eq!(st, 200);
    let qualified = format!("{}/work", a.name);
    assert!(
        v.as_array()
            .unwrap()
            .iter()
            .any(|t| t["thread"] == json!(qualified)),
        "{v}"
    );
    let path = format!("/v1/checkpoints/@{}", qualified.replace('/', "%2F"));
    let (st, v) = call(&s, "GET", &path, None);
    assert_eq!((st, v["id"].as_str()), (200, Some(cp_a.as_str())), "{v}");
    ok_as(
        &a,
        &s,
        "POST",
        "/v1/runs/live/abort",
        Some(&json!({"cancelled": true})),
    );
}

/// Boundary 3 (tenants): making room at the caps destroys only the asking tenant's
/// idle sandboxes. A's idle sandbox, with uncaptured work, survives B making
/// sandboxes at the cap of all and at B's own; with nothing of its own idle, B is
/// refused (429), not served with A's work.
#[test]
fn one_tenants_load_never_destroys_anothers_work() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (_t, store, sandboxes) = place();
    let group = TestGroup::new();
    let (a, b) = (TestUser::new(Some(&group)), TestUser::new(Some(&group)));
    let _g = MountsUnder(sandboxes.clone());
    let s = server(&store, &sandboxes, &group, &["--max-sandboxes", "2"]);
    let v = ok_as(
        &a,
        &s,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "a1"})),
    );
    let path_a = PathBuf::from(v["path"].as_str().unwrap());
    a.sh(&path_a, "printf 'uncaptured\\n' > work.txt");
    // B's first fills the cap of all; B's next ones make room among B's own.
    let mut last = String::new();
    for i in 0..4 {
        let v = ok_as(
            &b,
            &s,
            "POST",
            "/v1/sandboxes",
            Some(&json!({"thread": format!("b{i}")})),
        );
        last = v["key"].as_str().unwrap().to_string();
    }
    assert_eq!(
        std::fs::read_to_string(path_a.join("work.txt")).unwrap(),
        "uncaptured\n"
    );
    assert_eq!(
        ok_as(&a, &s, "GET", "/v1/sandboxes", None)
            .as_array()
            .unwrap()
            .len(),
        1
    );
    // B's one sandbox held by a run: nothing of B's is idle, and A's is not B's to take.
    let (st, v) = b.http(
        &s.socket,
        "POST",
        "/v1/runs",
        Some(&json!({"thread": "b3", "run_id": "r"})),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["sandbox"]["key"], json!(last), "{v}");
    let (st, v) = b.http(
        &s.socket,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "b9"})),
    );
    assert_eq!(
        (st, v["error"]["kind"].as_str()),
        (429, Some("too_many_sandboxes")),
        "{v}"
    );
    assert_eq!(
        std::fs::read_to_string(path_a.join("work.txt")).unwrap(),
        "uncaptured\n"
    );
    ok_as(
        &b,
        &s,
        "POST",
        "/v1/runs/r/abort",
        Some(&json!({"cancelled": true})),
    );
}

/// Boundary 4 (secrets): text a client writes that looks like a placeholder is data:
/// in messages, an artifact's name, a portable store's instance record, transcript and
/// checkpoint record it comes back as written, never as the secret's value; the value
/// a client writes comes back to it (and is stored as a placeholder).
#[test]
fn a_placeholder_a_client_writes_comes_back_as_written() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (_t, store, sandboxes) = place();
    let group = TestGroup::new();
    let a = TestUser::new(Some(&group));
    let _g = MountsUnder(sandboxes.clone());
    let s = server(&store, &sandboxes, &group, &[]);
    let fake = "{{casfs-secret:API_KEY}}";
    let text = format!("look: {fake} and {SECRET}");
    let expect = |v: &Value, what: &str| {
        assert_eq!(v, &json!(text), "{what}");
    };
    // As a member and as root (the server's user): neither learns the value this way.
    let as_root = |m: &str, p: &str, b: Option<&Value>| {
        let (st, v) = call(&s, m, p, b);
        assert_eq!(st, 200, "{m} {p}: {v}");
        v
    };
    let as_a = |m: &str, p: &str, b: Option<&Value>| ok_as(&a, &s, m, p, b);
    for (who, req) in [
        (
            "member",
            &as_a as &dyn Fn(&str, &str, Option<&Value>) -> Value,
        ),
        ("root", &as_root),
    ] {
        req(
            "PUT",
            "/v1/threads/t/messages",
            Some(&json!([{"content": text}])),
        );
        expect(
            &req("GET", "/v1/threads/t/messages", None)[0]["content"],
            who,
        );
        let art = json!({"artifact_id": "x", "run_id": "r", "name": text, "mime_type": "text/plain",
                         "content_base64": "eA=="});
        req("POST", "/v1/threads/t/artifacts", Some(&art));
        expect(&req("GET", "/v1/threads/t/artifacts", None)[0]["name"], who);
        req("PUT", "/v1/stores/s", Some(&json!({})));
        req(
            "PUT",
            "/v1/stores/s/instances/k",
            Some(&json!({"note": text})),
        );
        expect(
            &req("GET", "/v1/stores/s/instances/k", None)["record"]["note"],
            who,
        );
        req(
            "PUT",
            "/v1/stores/s/threads/t/messages",
            Some(&json!([{"content": text}])),
        );
        expect(
            &req("GET", "/v1/stores/s/threads/t/messages", None)["messages"][0]["content"],
            who,
        );
        let g = req(
            "POST",
            "/v1/stores/s/writers",
            Some(&json!({"thread_id": "t"})),
        );
        let w = json!({"thread_id": "t", "owner_token": g["owner_token"], "fence": g["fence"]});
        let cp = json!({"id": format!("cp-{who}"), "threadId": "t", "parentCheckpointId": null,
                        "createdAt": 1, "reason": "automatic", "files": [],
                        "conversation": [{"role": "user", "content": text}], "artifacts": []});
        let head = req("GET", "/v1/stores/s/threads/t/head", None)["head"].clone();
        req(
            "POST",
            "/v1/stores/s/checkpoints",
            Some(&json!({"checkpoint": cp, "expected_head_id": head, "writer": w})),
        );
        let got = req("GET", &format!("/v1/stores/s/checkpoints/cp-{who}"), None);
        expect(&got["checkpoint"]["conversation"][0]["content"], who);
        // A fork names its new record itself: a placeholder in its ids is refused (an
        // id is stored as it is, and an answer filling it would give the value away).
        let g2 = req(
            "POST",
            "/v1/stores/s/writers",
            Some(&json!({"thread_id": "f"})),
        );
        let w2 = json!({"thread_id": "f", "owner_token": g2["owner_token"], "fence": g2["fence"]});
        let fork = |dest_id: &str| {
            json!({"source_thread_id": "t", "source_checkpoint_id": format!("cp-{who}"),
                   "destination_thread_id": "f", "destination_checkpoint_id": dest_id,
                   "created_at": 2, "writer": w2})
        };
        let (st, v) = if who == "root" {
            call(&s, "POST", "/v1/stores/s/forks", Some(&fork(fake)))
        } else {
            a.http(&s.socket, "POST", "/v1/stores/s/forks", Some(&fork(fake)))
        };
        assert_eq!(
            (st, v["error"]["kind"].as_str()),
            (400, Some("invalid_id")),
            "{v}"
        );
        let forked = req(
            "POST",
            "/v1/stores/s/forks",
            Some(&fork(&format!("fork-{who}"))),
        );
        expect(&forked["checkpoint"]["conversation"][0]["content"], who);
    }
    // No byte under the store holds the value.
    drop(s);
    for f in walk(&store) {
        let bytes = std::fs::read(&f).unwrap_or_default();
        assert!(
            !bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
            "{} holds the secret",
            f.display()
        );
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => out.extend(walk(&p)),
            Ok(t) if t.is_file() => out.push(p),
            _ => {}
        }
    }
    out
}

/// Boundary 3 (tenants): a tenant is held to its own cap (`--max-sandboxes-per-tenant`):
/// one more of its sandboxes takes the place of its own least recently used idle one,
/// while another tenant's stay.
#[test]
fn a_tenant_is_held_to_its_own_cap() {
    if crate::needs_root("it makes users with useradd") {
        return;
    }
    let (_t, store, sandboxes) = place();
    let group = TestGroup::new();
    let (a, b) = (TestUser::new(Some(&group)), TestUser::new(Some(&group)));
    let _g = MountsUnder(sandboxes.clone());
    let s = server(
        &store,
        &sandboxes,
        &group,
        &["--max-sandboxes-per-tenant", "2"],
    );
    for i in 0..2 {
        ok_as(
            &a,
            &s,
            "POST",
            "/v1/sandboxes",
            Some(&json!({"thread": format!("a{i}")})),
        );
    }
    for i in 0..5 {
        ok_as(
            &b,
            &s,
            "POST",
            "/v1/sandboxes",
            Some(&json!({"thread": format!("b{i}")})),
        );
        let mine = ok_as(&b, &s, "GET", "/v1/sandboxes", None);
        assert!(mine.as_array().unwrap().len() <= 2, "{mine}");
    }
    let threads = |u: &TestUser| -> Vec<String> {
        let v = ok_as(u, &s, "GET", "/v1/sandboxes", None);
        let mut t: Vec<String> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["thread"].as_str().unwrap().to_string())
            .collect();
        t.sort();
        t
    };
    assert_eq!(threads(&a), ["a0", "a1"]);
    assert_eq!(threads(&b), ["b3", "b4"]);
}

/// Boundary 3 (tenants): on TCP the token names the tenant: tenant y reaches nothing
/// of tenant x's, an unknown token nothing at all, and the administrators' token sees
/// x's thread under x's name.
#[test]
fn a_tcp_token_names_its_tenant() {
    let t = tempfile::tempdir().unwrap();
    let (store, sandboxes) = (t.path().join("store"), t.path().join("sb"));
    let _g = MountsUnder(sandboxes.clone());
    let (x, y, admin) = (
        "token-of-x-0123456789",
        "token-of-y-0123456789",
        "token-of-admins-0123456789",
    );
    let tokens = t.path().join("tenants");
    std::fs::write(&tokens, format!("# tenants\nx {x}\ny {y}\n")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let _s = start(
        &store,
        &sandboxes,
        &[
            "--listen",
            &addr,
            "--tenant-tokens",
            &tokens.display().to_string(),
            "--mode",
            crate::mount_mode().as_str(),
        ],
        &[("CASFS_TOKEN", admin)],
    );
    assert!(
        crate::wait_for(std::time::Duration::from_secs(20), || {
            std::net::TcpStream::connect(&addr).is_ok()
        }),
        "the server did not listen on {addr}"
    );
    let req = |token: &str, m: &str, p: &str, b: Option<&Value>| -> (u16, Value) {
        let stream = std::net::TcpStream::connect(&addr).unwrap();
        crate::serve::http(stream, m, p, b, Some(token))
    };
    let (st, _) = req(
        x,
        "PUT",
        "/v1/threads/t/messages",
        Some(&json!([{"content": "x's"}])),
    );
    assert_eq!(st, 200);
    let (st, v) = req(x, "GET", "/v1/threads/t/messages", None);
    assert_eq!((st, &v), (200, &json!([{"content": "x's"}])));
    let (st, v) = req(y, "GET", "/v1/threads/t/messages", None);
    assert_eq!((st, &v), (200, &json!([])), "y read x's messages");
    let (st, v) = req(y, "GET", "/v1/threads", None);
    assert_eq!((st, &v), (200, &json!([])));
    let (st, v) = req("token-of-nobody-012345", "GET", "/v1/threads", None);
    assert_eq!(
        (st, v["error"]["kind"].as_str()),
        (401, Some("unauthorized"))
    );
    let (st, v) = req(admin, "GET", "/v1/threads/x%2Ft/messages", None);
    assert_eq!((st, &v), (200, &json!([{"content": "x's"}])));
    let prune = json!({"what": "prune", "keep_last": 1});
    let (st, _) = req(y, "POST", "/v1/maintenance", Some(&prune));
    assert_eq!(st, 403);
}

//! Portable checkpoint stores under real concurrency: many clients race one store
//! through the real `casfs serve` over its Unix socket (threads released together by a
//! barrier, many rounds, no sleeps), and every operation must be one atomic step. On
//! RocksDB one server answers them all; on PostgreSQL two servers (two processes, two
//! stores) share one database and the clients alternate between them.

use std::os::unix::net::UnixStream;
use std::sync::Barrier;

use serde_json::{json, Value};

use crate::serve::{call, http, start, Served};

/// Clients in each race.
const CLIENTS: usize = 24;
/// Rounds of each race.
const ROUNDS: usize = 20;

/// Where the stores' records are.
#[derive(Clone, Copy, Debug)]
enum Db {
    Rocks,
    Postgres,
}

/// The servers of one test, stopped when dropped.
struct Hosts {
    servers: Vec<Served>,
    _dir: tempfile::TempDir,
}

fn hosts(db: Db) -> Hosts {
    let dir = tempfile::tempdir().unwrap();
    let url = match db {
        Db::Rocks => None,
        Db::Postgres => {
            let base = std::env::var("CASFS_TEST_PG").unwrap_or_else(|_| {
                panic!("CASFS_TEST_PG is not set: run the tests through scripts/test.sh, or source scripts/services.sh first")
            });
            let tag =
                casfs::cas::Hash::of(format!("{:?}", std::time::SystemTime::now()).as_bytes())
                    .to_hex();
            Some(format!("{base}?schema=portable_{}", &tag[..12]))
        }
    };
    let count = match db {
        Db::Rocks => 1,
        Db::Postgres => 2,
    };
    let servers = (0..count)
        .map(|i| {
            let home = dir.path().join(format!("host{i}"));
            std::fs::create_dir(&home).unwrap();
            let mut args = vec!["--allow-client-clocks"];
            if let Some(u) = &url {
                args.extend(["--checkpoints", u.as_str()]);
            }
            start(&home.join("store"), &home.join("sb"), &args, &[])
        })
        .collect();
    Hosts { servers, _dir: dir }
}

impl Hosts {
    /// One request through the first server.
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        call(&self.servers[0], method, path, body)
    }

    /// A request that must succeed; its answer.
    fn ok(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let (st, v) = self.call(method, path, body);
        assert_eq!(st, 200, "{method} {path}: {v}");
        v
    }

    /// Sends every request at once (each client connected first, then released by a
    /// barrier), client `i` through server `i % servers`; the answers in order.
    fn race(&self, reqs: Vec<(&'static str, String, Option<Value>)>) -> Vec<(u16, Value)> {
        let barrier = Barrier::new(reqs.len());
        std::thread::scope(|sc| {
            let handles: Vec<_> = reqs
                .iter()
                .enumerate()
                .map(|(i, (method, path, body))| {
                    let socket = &self.servers[i % self.servers.len()].socket;
                    let barrier = &barrier;
                    sc.spawn(move || {
                        let stream = UnixStream::connect(socket).unwrap();
                        barrier.wait();
                        http(stream, method, path, body.as_ref(), None)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }
}

/// The winners of a race: the answers that are 200. Every other answer must be a 409
/// of one of `kinds`.
fn winners(answers: &[(u16, Value)], kinds: &[&str]) -> Vec<usize> {
    let mut out = Vec::new();
    for (i, (st, v)) in answers.iter().enumerate() {
        if *st == 200 {
            out.push(i);
        } else {
            let kind = v["error"]["kind"].as_str().unwrap_or("");
            assert!(
                *st == 409 && kinds.contains(&kind),
                "client {i}: {st} {v} (expected 200 or 409 {kinds:?})"
            );
        }
    }
    out
}

fn blob(n: usize) -> String {
    format!(
        "sandbox-files/sha256/{}",
        casfs::cas::Hash::of(format!("blob {n}").as_bytes()).to_hex()
    )
}

/// A checkpoint record of thread `thread` naming blob keys `keys`.
fn cp(id: &str, thread: &str, parent: Option<&str>, keys: &[&str]) -> Value {
    let files: Vec<Value> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| json!({"path": format!("f{i}"), "kind": "file", "blobKey": k, "size": 1}))
        .collect();
    json!({
        "id": id, "threadId": thread, "parentCheckpointId": parent, "createdAt": 1,
        "reason": "automatic", "files": files,
        "conversation": [{"role": "user", "content": id}], "artifacts": [],
    })
}

/// Store `name` with the server's clock.
fn open(h: &Hosts, name: &str) {
    h.ok("PUT", &format!("/v1/stores/{name}"), Some(&json!({})));
}

/// `thread`'s writer lease, taken with the server's clock: the writer as presented.
fn writer(h: &Hosts, store: &str, thread: &str) -> Value {
    let g = h.ok(
        "POST",
        &format!("/v1/stores/{store}/writers"),
        Some(&json!({"thread_id": thread})),
    );
    json!({"thread_id": thread, "owner_token": g["owner_token"], "fence": g["fence"]})
}

fn append_req(cp: &Value, expected: Option<&str>, w: &Value) -> Value {
    json!({"checkpoint": cp, "expected_head_id": expected, "writer": w})
}

fn head(h: &Hosts, store: &str, thread: &str) -> Option<String> {
    h.ok(
        "GET",
        &format!("/v1/stores/{store}/threads/{thread}/head"),
        None,
    )["head"]
        .as_str()
        .map(str::to_string)
}

/// The store's blob reference counts, by key.
fn refs(h: &Hosts, store: &str) -> std::collections::BTreeMap<String, u64> {
    h.ok("GET", &format!("/v1/stores/{store}/blob-references"), None)
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["key"].as_str().unwrap().to_string(),
                r["references"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Boundary 5 (portable atomicity): of many clients taking one writer lease at once,
/// exactly one wins each round, and the fences handed out are unique and grow by one.
fn one_writer_wins_each_acquire(db: Db) {
    let h = hosts(db);
    open(&h, "s");
    for round in 0..ROUNDS {
        let reqs = (0..CLIENTS)
            .map(|_| {
                let body = json!({"thread_id": "t"});
                ("POST", "/v1/stores/s/writers".to_string(), Some(body))
            })
            .collect();
        let answers = h.race(reqs);
        let won = winners(&answers, &["writer_conflict"]);
        assert_eq!(won.len(), 1, "round {round}: {answers:?}");
        let g = &answers[won[0]].1;
        assert_eq!(g["fence"], json!(round + 1), "round {round}: {g}");
        let w = json!({"thread_id": "t", "owner_token": g["owner_token"], "fence": g["fence"]});
        h.ok(
            "POST",
            "/v1/stores/s/writers/release",
            Some(&json!({"writer": w})),
        );
    }
}

/// Boundary 5 (portable atomicity): the first operation on a store makes it once. Of
/// many clients making one new store with options of their own, exactly one makes it
/// (the others are told it exists with other options), and instance records and
/// transcripts written in the same race come back whole, as one of their writers wrote
/// them.
fn a_store_is_made_once_and_records_stay_whole(db: Db) {
    let h = hosts(db);
    for round in 0..ROUNDS {
        let name = format!("r{round}");
        let payload = |i: usize| json!({"writer": i, "items": vec![i; 64]});
        let mut reqs = Vec::new();
        for i in 0..CLIENTS {
            let (method, path, body) = match i % 4 {
                0 | 1 => (
                    "PUT",
                    format!("/v1/stores/{name}"),
                    json!({"lease_duration_ms": 10_000 + i, "renew_after_ms": 5_000}),
                ),
                2 => ("PUT", format!("/v1/stores/{name}/instances/k"), payload(i)),
                _ => (
                    "PUT",
                    format!("/v1/stores/{name}/threads/t/messages"),
                    json!([{"role": "user", "content": format!("{i}")}, payload(i)]),
                ),
            };
            reqs.push((method, path, Some(body)));
        }
        let answers = h.race(reqs);
        let made: Vec<usize> = (0..CLIENTS)
            .filter(|i| i % 4 < 2 && answers[*i].0 == 200)
            .collect();
        assert_eq!(made.len(), 1, "round {round}: {answers:?}");
        for (i, (st, v)) in answers.iter().enumerate() {
            let kind = v["error"]["kind"].as_str().unwrap_or("");
            match i % 4 {
                0 | 1 => assert!(*st == 200 || kind == "store_exists", "{i}: {st} {v}"),
                _ => assert!(*st == 200 || kind == "no_store", "{i}: {st} {v}"),
            }
        }
        let o = &answers[made[0]].1["options"];
        assert_eq!(
            o["lease_duration_ms"].as_f64(),
            Some(10_000.0 + made[0] as f64),
            "{o}"
        );
        // The store keeps the winner's options: giving them again opens it.
        let again = json!({"lease_duration_ms": 10_000 + made[0], "renew_after_ms": 5_000});
        h.ok("PUT", &format!("/v1/stores/{name}"), Some(&again));
        // Each record is one client's, whole, and one whose write succeeded.
        let rec = h.ok("GET", &format!("/v1/stores/{name}/instances/k"), None)["record"].clone();
        if !rec.is_null() {
            let i = rec["writer"].as_u64().unwrap() as usize;
            assert_eq!((rec.clone(), answers[i].0), (payload(i), 200));
        }
        let m = h.ok(
            "GET",
            &format!("/v1/stores/{name}/threads/t/messages"),
            None,
        )["messages"]
            .clone();
        if !m.is_null() {
            let i = m[1]["writer"].as_u64().unwrap() as usize;
            let want = json!([{"role": "user", "content": format!("{i}")}, payload(i)]);
            assert_eq!((m.clone(), answers[i].0), (want, 200));
        }
        // Puts and deletes of one instance record: it ends absent or one put's, whole.
        let reqs = (0..CLIENTS)
            .map(|i| {
                let path = format!("/v1/stores/{name}/instances/j");
                if i % 2 == 0 {
                    ("PUT", path, Some(payload(i)))
                } else {
                    ("DELETE", path, None)
                }
            })
            .collect();
        let answers = h.race(reqs);
        assert!(answers.iter().all(|(st, _)| *st == 200), "{answers:?}");
        let rec = h.ok("GET", &format!("/v1/stores/{name}/instances/j"), None)["record"].clone();
        if !rec.is_null() {
            let i = rec["writer"].as_u64().unwrap() as usize;
            assert_eq!(rec, payload(i));
        }
    }
}

/// Boundary 5 (portable atomicity): a writer's renewal, its release and other clients'
/// takeover after its lease would have expired, all at once (the clients' clock). At
/// most one takeover wins, with the next fence, and keeps its lease: nothing the old
/// writer does afterwards renews or releases it.
fn renew_release_and_takeover_race(db: Db) {
    let h = hosts(db);
    let opts = json!({"lease_duration_ms": 10_000, "renew_after_ms": 5_000, "clock": "client"});
    h.ok("PUT", "/v1/stores/c", Some(&opts));
    let mut fence = 0u64;
    for round in 0..ROUNDS {
        let t0 = 1_000_000.0 * (round as f64 + 1.0);
        let g = h.ok(
            "POST",
            "/v1/stores/c/writers",
            Some(&json!({"thread_id": "t", "now": t0})),
        );
        fence += 1;
        assert_eq!(g["fence"], json!(fence), "{g}");
        let old = json!({"thread_id": "t", "owner_token": g["owner_token"], "fence": fence});
        let reqs = (0..CLIENTS)
            .map(|i| match i % 3 {
                0 => (
                    "POST",
                    "/v1/stores/c/writers/renew".to_string(),
                    Some(json!({"writer": old, "now": t0 + 9_999.0})),
                ),
                1 => (
                    "POST",
                    "/v1/stores/c/writers/release".to_string(),
                    Some(json!({"writer": old})),
                ),
                _ => (
                    "POST",
                    "/v1/stores/c/writers".to_string(),
                    Some(json!({"thread_id": "t", "now": t0 + 10_001.0})),
                ),
            })
            .collect();
        let answers = h.race(reqs);
        let mut taken = Vec::new();
        for (i, (st, v)) in answers.iter().enumerate() {
            let kind = v["error"]["kind"].as_str().unwrap_or("");
            match i % 3 {
                0 => assert!(*st == 200 || kind == "writer_lost", "renew {i}: {st} {v}"),
                1 => assert_eq!(*st, 200, "release {i}: {v}"),
                _ if *st == 200 => taken.push(v.clone()),
                _ => assert_eq!(kind, "writer_conflict", "acquire {i}: {st} {v}"),
            }
        }
        assert!(taken.len() <= 1, "round {round}: {answers:?}");
        if let Some(g) = taken.first() {
            fence += 1;
            assert_eq!(g["fence"], json!(fence), "round {round}: {g}");
            let new = json!({"thread_id": "t", "owner_token": g["owner_token"], "fence": fence});
            // The new writer's lease is whole: it renews, the old writer's does not.
            let (st, v) = h.call(
                "POST",
                "/v1/stores/c/writers/renew",
                Some(&json!({"writer": new, "now": t0 + 10_002.0})),
            );
            assert_eq!(st, 200, "round {round}: the winner's lease is gone: {v}");
            let (st, v) = h.call(
                "POST",
                "/v1/stores/c/writers/renew",
                Some(&json!({"writer": old, "now": t0 + 10_002.0})),
            );
            assert_eq!(
                (st, v["error"]["kind"].as_str()),
                (409, Some("writer_lost")),
                "{v}"
            );
        }
        // Past every lease: the next acquire takes the next fence.
        let g = h.ok(
            "POST",
            "/v1/stores/c/writers",
            Some(&json!({"thread_id": "t", "now": t0 + 100_000.0})),
        );
        fence += 1;
        assert_eq!(g["fence"], json!(fence), "round {round}: {g}");
    }
}

/// Boundary 5 (portable atomicity): of many appends on one head, exactly one succeeds
/// each round (the others are told the head moved), the history stays one line, and
/// the blob key every append names is counted once per checkpoint kept.
fn one_append_wins_each_head(db: Db) {
    let h = hosts(db);
    open(&h, "s");
    let w = writer(&h, "s", "t");
    let shared = blob(0);
    let mut line: Vec<String> = Vec::new();
    for round in 0..ROUNDS {
        let parent = line.last().cloned();
        let reqs = (0..CLIENTS)
            .map(|i| {
                let id = format!("r{round}-c{i}");
                let c = cp(&id, "t", parent.as_deref(), &[&shared, &blob(1000 + i)]);
                let body = append_req(&c, parent.as_deref(), &w);
                ("POST", "/v1/stores/s/checkpoints".to_string(), Some(body))
            })
            .collect();
        let answers = h.race(reqs);
        let won = winners(&answers, &["stale_head"]);
        assert_eq!(won.len(), 1, "round {round}: {answers:?}");
        let id = format!("r{round}-c{}", won[0]);
        assert_eq!(answers[won[0]].1["head_id"], json!(id));
        assert_eq!(head(&h, "s", "t").as_deref(), Some(id.as_str()));
        line.push(id);
        assert_eq!(refs(&h, "s")[&shared], line.len() as u64, "round {round}");
    }
    // One line: every checkpoint's parent is the one before it, and nothing else.
    let list = h.ok("GET", "/v1/stores/s/threads/t/checkpoints", None);
    let ids: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    let mut sorted = ids.clone();
    sorted.sort();
    let mut want: Vec<&str> = line.iter().map(String::as_str).collect();
    want.sort();
    assert_eq!(sorted, want);
    for (i, id) in line.iter().enumerate() {
        let c = h.ok("GET", &format!("/v1/stores/s/checkpoints/{id}"), None)["checkpoint"].clone();
        let parent = if i == 0 {
            Value::Null
        } else {
            json!(line[i - 1])
        };
        assert_eq!(c["parentCheckpointId"], parent, "{id}");
    }
    // The blob counts are exactly the kept checkpoints'.
    let r = refs(&h, "s");
    let others: u64 = r
        .iter()
        .filter(|(k, _)| **k != shared)
        .map(|(_, n)| n)
        .sum();
    assert_eq!(
        (r[&shared], others),
        (ROUNDS as u64, ROUNDS as u64),
        "{r:?}"
    );
}

/// Boundary 5 (portable atomicity): of many deletes of one head, exactly one succeeds
/// each round; the head moves back by one checkpoint and the blob counts by one.
fn one_delete_wins_each_head(db: Db) {
    let h = hosts(db);
    open(&h, "s");
    let w = writer(&h, "s", "t");
    let shared = blob(0);
    let mut line: Vec<String> = Vec::new();
    for n in 0..ROUNDS {
        let id = format!("c{n}");
        let parent = line.last().cloned();
        let c = cp(&id, "t", parent.as_deref(), &[&shared]);
        h.ok(
            "POST",
            "/v1/stores/s/checkpoints",
            Some(&append_req(&c, parent.as_deref(), &w)),
        );
        line.push(id);
    }
    while let Some(top) = line.pop() {
        let reqs = (0..CLIENTS)
            .map(|_| {
                let body = json!({"thread_id": "t", "checkpoint_id": top, "writer": w});
                ("POST", "/v1/stores/s/heads/delete".to_string(), Some(body))
            })
            .collect();
        let answers = h.race(reqs);
        let won = winners(&answers, &["not_head"]);
        assert_eq!(won.len(), 1, "deleting {top}: {answers:?}");
        assert_eq!(head(&h, "s", "t"), line.last().cloned(), "after {top}");
        let counted = refs(&h, "s").get(&shared).copied().unwrap_or(0);
        assert_eq!(counted, line.len() as u64, "after deleting {top}");
    }
    assert!(refs(&h, "s").is_empty());
}

/// Boundary 5 (portable atomicity): of many forks of one checkpoint to one destination
/// thread, exactly one succeeds each round; the destination holds its one root and the
/// source's blobs are counted once more.
fn one_fork_wins_each_destination(db: Db) {
    let h = hosts(db);
    open(&h, "s");
    let src = writer(&h, "s", "src");
    let shared = blob(0);
    let c = cp("origin", "src", None, &[&shared]);
    h.ok(
        "POST",
        "/v1/stores/s/checkpoints",
        Some(&append_req(&c, None, &src)),
    );
    for round in 0..ROUNDS {
        let dest = format!("d{round}");
        let w = writer(&h, "s", &dest);
        let reqs = (0..CLIENTS)
            .map(|i| {
                let body = json!({
                    "source_thread_id": "src", "source_checkpoint_id": "origin",
                    "destination_thread_id": dest,
                    "destination_checkpoint_id": format!("{dest}-c{i}"),
                    "created_at": 2, "writer": w,
                });
                ("POST", "/v1/stores/s/forks".to_string(), Some(body))
            })
            .collect();
        let answers = h.race(reqs);
        let won = winners(&answers, &["fork_destination_not_empty"]);
        assert_eq!(won.len(), 1, "round {round}: {answers:?}");
        let root = format!("{dest}-c{}", won[0]);
        assert_eq!(head(&h, "s", &dest), Some(root.clone()));
        let list = h.ok(
            "GET",
            &format!("/v1/stores/s/threads/{dest}/checkpoints"),
            None,
        );
        assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
        assert_eq!(list[0]["id"], json!(root));
        let m = h.ok(
            "GET",
            &format!("/v1/stores/s/threads/{dest}/messages"),
            None,
        );
        assert_eq!(
            m["messages"],
            json!([{"role": "user", "content": "origin"}])
        );
        assert_eq!(refs(&h, "s")[&shared], round as u64 + 2, "round {round}");
    }
}

/// Boundary 5 (portable atomicity): many appends on threads of their own naming one
/// blob key all succeed, and its reference count is exactly theirs; after as many
/// concurrent deletes it is gone (a blob collection would keep a blob in use, and only
/// that).
fn blob_references_count_every_racing_append(db: Db) {
    let h = hosts(db);
    open(&h, "s");
    let shared = blob(0);
    for round in 0..ROUNDS {
        let writers: Vec<Value> = (0..CLIENTS)
            .map(|i| writer(&h, "s", &format!("b{round}-{i}")))
            .collect();
        let reqs = (0..CLIENTS)
            .map(|i| {
                let thread = format!("b{round}-{i}");
                let c = cp(&format!("{thread}-c"), &thread, None, &[&shared]);
                let body = append_req(&c, None, &writers[i]);
                ("POST", "/v1/stores/s/checkpoints".to_string(), Some(body))
            })
            .collect();
        let answers = h.race(reqs);
        assert_eq!(winners(&answers, &[]).len(), CLIENTS, "{answers:?}");
        assert_eq!(refs(&h, "s")[&shared], CLIENTS as u64, "round {round}");
        let reqs = (0..CLIENTS)
            .map(|i| {
                let thread = format!("b{round}-{i}");
                let body = json!({
                    "thread_id": thread, "checkpoint_id": format!("{thread}-c"),
                    "writer": writers[i],
                });
                ("POST", "/v1/stores/s/heads/delete".to_string(), Some(body))
            })
            .collect();
        let answers = h.race(reqs);
        assert_eq!(winners(&answers, &[]).len(), CLIENTS, "{answers:?}");
        assert!(
            refs(&h, "s").is_empty(),
            "round {round}: {:?}",
            refs(&h, "s")
        );
    }
}

macro_rules! on_both_databases {
    ($($name:ident),* $(,)?) => {
        mod rocksdb {
            $(
                #[test]
                fn $name() {
                    super::$name(super::Db::Rocks)
                }
            )*
        }
        mod postgresql {
            $(
                #[test]
                fn $name() {
                    super::$name(super::Db::Postgres)
                }
            )*
        }
    };
}

on_both_databases!(
    one_writer_wins_each_acquire,
    a_store_is_made_once_and_records_stay_whole,
    renew_release_and_takeover_race,
    one_append_wins_each_head,
    one_delete_wins_each_head,
    one_fork_wins_each_destination,
    blob_references_count_every_racing_append,
);

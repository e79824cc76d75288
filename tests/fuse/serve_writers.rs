//! The writer routes of `casfs serve` (the TypeScript adapter's checkpoint store),
//! raced and abused over the Unix socket: one writer per thread among many at once,
//! one append among two racing on one head, stale fencing tokens, forged leases, and a
//! server killed while a client holds a lease.

use std::path::PathBuf;

use serde_json::{json, Value};

use crate::serve::{call, refused, start, Served};
use crate::MountGuard;

/// What a writer presents: the token and owner secret of a lease answer.
pub(crate) fn proof(lease: &Value) -> Value {
    json!({"token": lease["token"], "owner_token": lease["owner_token"]})
}

/// POSTs each of `bodies` to `path`, all at once from threads of their own.
fn at_once(s: &Served, path: &str, bodies: &[Value]) -> Vec<(u16, Value)> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = bodies
            .iter()
            .map(|b| {
                sc.spawn(move || {
                    let c = std::os::unix::net::UnixStream::connect(&s.socket).unwrap();
                    crate::serve::http(c, "POST", path, Some(b), None)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn client_writers_race_and_compare_and_swap_the_head() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sandboxes = t.path().join("sb");
    let _ga = MountGuard::new(&sandboxes.join("a+w").join("workspace"));
    let _gb = MountGuard::new(&sandboxes.join("b+w").join("workspace"));
    let s = start(&store, &sandboxes, &["--lease-ttl", "30"], &[]);

    // Eight writers at once: exactly one gets the thread, the others are told who has it.
    let bodies: Vec<Value> = (0..8)
        .map(|i| json!({"holder": format!("writer {i}")}))
        .collect();
    let tries = at_once(&s, "/v1/threads/w/writer", &bodies);
    let won: Vec<&Value> = tries
        .iter()
        .filter(|(st, _)| *st == 200)
        .map(|x| &x.1)
        .collect();
    assert_eq!(won.len(), 1, "{tries:?}");
    for (st, v) in tries.iter().filter(|(st, _)| *st != 200) {
        assert_eq!(
            (*st, v["error"]["kind"].as_str()),
            (409, Some("lease_held")),
            "{v}"
        );
        assert!(v["error"]["message"].as_str().unwrap().contains("writer "));
    }
    let lease = won[0].clone();
    assert_eq!(lease["renew_after_ms"], json!(10_000));
    assert_eq!(lease["owner_token"].as_str().unwrap().len(), 64, "{lease}");
    // What the writer sends back: its fencing token and owner secret.
    let lease = proof(&lease);

    // Two sandboxes of the thread (two hosts' tenants), both at the empty head.
    let mk = |tenant: &str| {
        let (st, v) = call(
            &s,
            "POST",
            "/v1/sandboxes",
            Some(&json!({"thread": "w", "tenant": tenant})),
        );
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["outcome"], "created");
        PathBuf::from(v["path"].as_str().unwrap())
    };
    let (pa, pb) = (mk("a"), mk("b"));
    std::fs::write(pa.join("a.txt"), "from a").unwrap();
    std::fs::write(pb.join("b.txt"), "from b").unwrap();
    // Both append on the empty head at once under the one lease: one wins, the other's
    // head moved.
    let bodies: Vec<Value> = ["a+w", "b+w"]
        .iter()
        .map(|key| json!({"sandbox": key, "expected_head": null, "writer": lease}))
        .collect();
    let results = at_once(&s, "/v1/threads/w/checkpoints", &bodies);
    assert_eq!(
        results.iter().filter(|(st, _)| *st == 200).count(),
        1,
        "{results:?}"
    );
    let w = results.iter().position(|(st, _)| *st == 200).unwrap();
    let (winner, loser) = (["a+w", "b+w"][w], ["a+w", "b+w"][1 - w]);
    let won_file = ["a.txt", "b.txt"][w];
    let lost = &results[1 - w];
    assert_eq!(lost.0, 409, "{lost:?}");
    assert_eq!(lost.1["error"]["kind"], "head_mismatch");
    let ok = &results[w].1;
    let head = ok["checkpoint"]["id"].as_str().unwrap().to_string();
    let (_, h) = call(&s, "GET", "/v1/threads/w/head", None);
    assert_eq!(h["head"], json!(head));
    assert_eq!(ok["checkpoint"]["parent_id"], Value::Null);
    // The loser's sandbox still shows the empty thread: publishing it on the new head
    // is refused too, naming the sandbox.
    let behind = json!({"sandbox": loser, "expected_head": head, "writer": lease});
    let m = refused(
        &s,
        "POST",
        "/v1/threads/w/checkpoints",
        Some(&behind),
        409,
        "head_mismatch",
    );
    assert!(m.contains(loser) && m.contains("none"), "{m}");

    // Forged leases: holder and TTL are not the writer's to send again, another
    // thread's token, a bumped token, a wrong owner secret.
    for field in ["ttl_ms", "holder", "thread", "expires_at_ms"] {
        let mut forged = lease.clone();
        forged[field] = json!(1);
        let m = refused(
            &s,
            "POST",
            "/v1/threads/w/writer/renew",
            Some(&forged),
            400,
            "invalid",
        );
        assert!(m.contains(field), "{m}");
    }
    refused(
        &s,
        "POST",
        "/v1/threads/x/writer/renew",
        Some(&lease),
        409,
        "lease_lost",
    );
    let mut bumped = lease.clone();
    bumped["token"] = json!(lease["token"].as_u64().unwrap() + 1);
    refused(
        &s,
        "POST",
        "/v1/threads/w/writer/renew",
        Some(&bumped),
        409,
        "lease_lost",
    );
    let odd = json!({"holder": "h", "ttl_ms": 1000, "extra": 1});
    refused(
        &s,
        "POST",
        "/v1/threads/w/writer",
        Some(&odd),
        400,
        "invalid",
    );
    let prefix = json!({"sandbox": winner, "expected_head": &head[..12], "writer": lease});
    refused(
        &s,
        "POST",
        "/v1/threads/w/checkpoints",
        Some(&prefix),
        400,
        "invalid",
    );
    let no_head = json!({"sandbox": winner, "writer": lease});
    let (st, _) = call(&s, "POST", "/v1/threads/w/checkpoints", Some(&no_head));
    assert_eq!(
        st, 400,
        "expected_head is required (null for an empty thread)"
    );

    // Released, the old token is dead: renew and append refused, the head unchanged.
    let (st, _) = call(&s, "POST", "/v1/threads/w/writer/release", Some(&lease));
    assert_eq!(st, 200);
    let (st, _) = call(&s, "POST", "/v1/threads/w/writer/release", Some(&lease));
    assert_eq!(st, 200, "a repeated release is harmless");
    refused(
        &s,
        "POST",
        "/v1/threads/w/writer/renew",
        Some(&lease),
        409,
        "lease_lost",
    );
    let again = json!({"sandbox": winner, "expected_head": head, "writer": lease});
    refused(
        &s,
        "POST",
        "/v1/threads/w/checkpoints",
        Some(&again),
        409,
        "lease_lost",
    );
    let (_, h) = call(&s, "GET", "/v1/threads/w/head", None);
    assert_eq!(h["head"], json!(head));

    // A client's lease outlives a server killed under it: the restarted server refuses
    // another writer until the TTL, and the client renews and publishes through it.
    let (st, l2) = call(&s, "POST", "/v1/threads/w/writer", Some(&json!({})));
    assert_eq!(st, 200, "{l2}");
    assert!(l2["holder"].as_str().unwrap().starts_with("casfs-client:"));
    let l2 = proof(&l2);
    let mut s = s;
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    drop(s);
    let s = start(&store, &sandboxes, &["--lease-ttl", "30"], &[]);
    refused(
        &s,
        "POST",
        "/v1/threads/w/writer",
        Some(&json!({})),
        409,
        "lease_held",
    );
    let (st, l3) = call(&s, "POST", "/v1/threads/w/writer/renew", Some(&l2));
    assert_eq!(st, 200, "{l3}");
    assert_eq!(l3["token"], l2["token"]);
    assert!(l3["holder"].as_str().unwrap().starts_with("casfs-client:"));
    let l3 = proof(&l3);
    // The sandboxes of the killed server are gone with their uncaptured work; a new one
    // shows the head and publishes on it.
    let (st, v) = call(
        &s,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"thread": "w", "tenant": "b"})),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["base"], json!(head));
    let pb = PathBuf::from(v["path"].as_str().unwrap());
    let names: Vec<String> = std::fs::read_dir(&pb)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        vec![won_file.to_string()],
        "exactly the published file"
    );
    std::fs::write(pb.join("c.txt"), "after the crash").unwrap();
    let body = json!({"sandbox": "b+w", "expected_head": head, "writer": l3});
    let (st, v) = call(&s, "POST", "/v1/threads/w/checkpoints", Some(&body));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["checkpoint"]["parent_id"], json!(head));
    // Its file events: the write above, waited for if it has not been seen yet.
    let (st, ev) = call(
        &s,
        "GET",
        "/v1/sandboxes/b+w/events?after=0&wait_ms=5000",
        None,
    );
    assert_eq!(st, 200, "{ev}");
    assert!(
        ev.as_array().unwrap().iter().any(|e| e["path"] == "c.txt"),
        "{ev}"
    );
    refused(
        &s,
        "GET",
        "/v1/sandboxes/b+w/events?wait_ms=x",
        None,
        400,
        "invalid",
    );
    refused(
        &s,
        "GET",
        "/v1/sandboxes/a+w/events",
        None,
        404,
        "not_found",
    );
    let (st, v) = call(&s, "DELETE", "/v1/sandboxes/b+w", None);
    assert_eq!((st, v["destroyed"].clone()), (200, json!(true)));
    let (st, v) = call(&s, "DELETE", "/v1/sandboxes/b+w", None);
    assert_eq!((st, v["destroyed"].clone()), (200, json!(false)));
}

/// A sandbox is busy only while a run or a capture holds it: a client listing the
/// sandboxes, the server's own upkeep and an event's diff only look, so a destroy at
/// the same moment is never refused because of them (CI once saw a 409 here).
#[test]
fn a_destroy_is_never_refused_because_someone_looked() {
    let t = tempfile::tempdir().unwrap();
    let store = t.path().join("store");
    let sandboxes = t.path().join("sb");
    let _g = MountGuard::new(&sandboxes.join("looked").join("workspace"));
    let s = start(&store, &sandboxes, &[], &[]);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let (st, v) = call(&s, "GET", "/v1/sandboxes", None);
                assert_eq!(st, 200, "{v}");
            }
        });
        // Stops the lister also when a round below fails, so the scope can end.
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let _stop = Stop(&stop);
        for i in 0..25 {
            let (key, root) = crate::sandbox_events::sandbox(&s, "looked");
            // Events with diffs, read while the destroy comes.
            std::fs::write(root.join(format!("f{i}")), "x").unwrap();
            let (st, v) = call(&s, "GET", &format!("/v1/sandboxes/{key}/events"), None);
            assert_eq!(st, 200, "{v}");
            let (st, v) = call(&s, "DELETE", &format!("/v1/sandboxes/{key}"), None);
            assert_eq!((st, &v["destroyed"]), (200, &json!(true)), "round {i}: {v}");
        }
    });
}

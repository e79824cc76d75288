//! `casfs gc`, `casfs prune` and `casfs fsck`: run here when the store is free, or by
//! the mount daemon that has it open (through its control socket), so they are safe
//! while that mount captures and restores.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use casfs::cas::remote_store::RemoteGcReport;
use casfs::checkpoint::maintenance::{GcReport, MaintainOp, MaintainReport};
use casfs::checkpoint::{OpenMode, Store};
use casfs::mount::control::{request, MountStatus, Request};
use serde_json::Value;

use super::args::Cli;
use super::output::{bytes, json, millis, with_spinner};

/// The control socket of a mount daemon serving this store, if one answers.
fn daemon_socket(cli: &Cli) -> Option<PathBuf> {
    let rd = std::fs::read_dir(cli.store_root().join("mounts")).ok()?;
    rd.flatten()
        .map(|e| e.path().join("control.sock"))
        .filter(|s| s.exists())
        .find(|s| request::<MountStatus>(s, &Request::Status).is_ok())
}

/// Runs `op` on the store: here when its lock is free within a moment, else by the
/// mount daemon that holds it; else waits for the lock as other commands do.
fn run_op(cli: &Cli, op: MaintainOp, label: &str) -> anyhow::Result<MaintainReport> {
    let root = cli.store_root();
    let local = |store: Store| -> anyhow::Result<MaintainReport> {
        let r = with_spinner(label, String::new, || op.run(&store, &HashSet::new()));
        Ok(r?)
    };
    match Store::open_with(
        &root,
        OpenMode::MustExist,
        Duration::from_millis(300),
        &cli.backends(),
    ) {
        Ok(store) => local(store),
        Err(first) => {
            if let Some(sock) = daemon_socket(cli) {
                tracing::info!("the store is held by the mount at {}", sock.display());
                let req = Request::Maintain(op.clone());
                return Ok(with_spinner(label, String::new, || request(&sock, &req))?);
            }
            let serve_sock = root.join("serve.sock");
            if serve_sock.exists() {
                if let Ok(v) = with_spinner(label, String::new, || via_serve(&serve_sock, &op)) {
                    return v;
                }
            }
            if !first.to_string().contains("in use") {
                return Err(first.into());
            }
            local(cli.open_store(OpenMode::MustExist)?)
        }
    }
}

/// Runs `op` in a `casfs serve` listening on its default socket (POST /v1/maintenance).
/// `Err` when nothing answers there; `Ok(Err)` when the server ran it and failed.
fn via_serve(
    sock: &std::path::Path,
    op: &MaintainOp,
) -> Result<anyhow::Result<MaintainReport>, ()> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(sock).map_err(|_| ())?;
    let body = serde_json::to_vec(op).expect("json");
    let head = format!(
        "POST /v1/maintenance HTTP/1.1\r\nHost: casfs\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).map_err(|_| ())?;
    s.write_all(&body).map_err(|_| ())?;
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).map_err(|_| ())?;
    let text = String::from_utf8_lossy(&reply);
    let (head, body) = text.split_once("\r\n\r\n").ok_or(())?;
    let ok = head.starts_with("HTTP/1.1 200");
    let v: Value = serde_json::from_str(body.trim()).map_err(|_| ())?;
    if ok {
        Ok(serde_json::from_value(v).map_err(|e| anyhow::anyhow!("casfs serve: report: {e}")))
    } else {
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or("failed")
            .to_string();
        Ok(Err(anyhow::anyhow!("casfs serve: {msg}")))
    }
}

/// What a collection of fleet packs did (or, dry, would do).
fn print_remote_packs(what: &str, r: &RemoteGcReport) {
    let verb = if r.dry_run { "would delete" } else { "deleted" };
    println!(
        "{what}: remote packs: {} kept, {} marked for deletion, {} waiting out their grace period, \
         {verb} {} and {} orphan(s) ({}); {} live object(s) copied into {} new pack(s); \
         {} unused in kept packs",
        r.packs_kept,
        r.packs_marked,
        r.packs_waiting,
        r.packs_deleted,
        r.orphan_packs_deleted,
        bytes(r.bytes_deleted),
        r.objects_copied,
        r.packs_written,
        bytes(r.bytes_unused)
    );
}

fn print_gc(g: &GcReport) {
    let verb = if g.dry_run { "would free" } else { "freed" };
    if let Some(r) = &g.remote {
        print_remote_packs("gc", r);
        println!(
            "    live: {} objects from {} checkpoint(s), {} mount(s); {} requests; {}",
            g.reachable,
            g.checkpoints,
            g.mounts,
            r.requests.total(),
            millis(g.duration_ms)
        );
        return;
    }
    println!(
        "gc: {} of {} objects unreachable, {verb} {} (stored){}",
        g.sweep.objects_freed,
        g.sweep.objects_total,
        bytes(g.sweep.bytes_freed),
        if g.sweep.kept_new > 0 {
            format!(", {} written meanwhile kept", g.sweep.kept_new)
        } else {
            String::new()
        }
    );
    println!(
        "    live: {} objects from {} checkpoint(s), {} mount(s), {} cached dir(s)",
        g.reachable, g.checkpoints, g.mounts, g.dircache_dirs
    );
    if !g.dry_run {
        println!(
            "    database {} -> {}",
            bytes(g.disk_bytes_before),
            bytes(g.disk_bytes_after)
        );
    }
    if g.dircache_dropped > 0 {
        println!(
            "    {} stale cached director(y/ies) forgotten (the next capture there reads them)",
            g.dircache_dropped
        );
    }
    println!(
        "    {} (writers held off for {})",
        millis(g.duration_ms),
        millis(g.fenced_ms)
    );
}

pub fn gc(
    cli: &Cli,
    dry_run: bool,
    grace: Option<Duration>,
    max_unused: f64,
) -> anyhow::Result<()> {
    let op = MaintainOp::Gc {
        dry_run,
        grace_secs: grace.map(|g| g.as_secs()),
        max_unused: Some(max_unused),
    };
    let r = run_op(cli, op, "collecting")?;
    if cli.json {
        return json(&r);
    }
    let MaintainReport::Gc(g) = r else {
        bail!("gc: the store answered with another report");
    };
    print_gc(&g);
    Ok(())
}

pub fn prune(
    cli: &Cli,
    keep_last: Option<usize>,
    keep_within: Option<&str>,
    thread: Option<&str>,
    dry_run: bool,
    then_gc: bool,
) -> anyhow::Result<()> {
    if keep_last.is_none() && keep_within.is_none() {
        bail!("give --keep-last N and/or --keep-within DURATION (heads are always kept)");
    }
    let keep_within_ms = keep_within
        .map(|s| {
            humantime::parse_duration(s)
                .map(|d| d.as_millis() as u64)
                .map_err(|e| anyhow::anyhow!("--keep-within {s:?}: {e} (try 7d, 12h, 30m)"))
        })
        .transpose()?;
    let op = MaintainOp::Prune {
        keep_last,
        keep_within_ms,
        thread: thread.map(str::to_string),
        dry_run,
        gc: then_gc,
    };
    let r = run_op(cli, op, "pruning")?;
    if cli.json {
        return json(&r);
    }
    let MaintainReport::Prune { prune: p, gc: g } = r else {
        bail!("prune: the store answered with another report");
    };
    println!(
        "prune: {} {} checkpoint(s), kept {} on {} thread(s){}",
        if dry_run { "would remove" } else { "removed" },
        p.pruned,
        p.kept,
        p.threads,
        if then_gc || p.pruned == 0 {
            ""
        } else {
            " (run `casfs gc` to free their objects)"
        }
    );
    if let Some(g) = &g {
        print_gc(g);
    }
    Ok(())
}

pub fn fsck(cli: &Cli, repair: bool) -> anyhow::Result<()> {
    let r = match run_op(cli, MaintainOp::Fsck { repair }, "checking")? {
        MaintainReport::Fsck(r) => r,
        _ => bail!("fsck: the store answered with another report"),
    };
    if cli.json {
        json(&r)?;
    } else {
        for e in &r.errors {
            println!("error: {e}");
        }
        for l in &r.leftovers {
            println!("leftover: {l}");
        }
        for f in &r.repaired {
            println!("repaired: {f}");
        }
        if let Some(remote) = &r.remote {
            print_remote_packs("fsck (a gc now)", remote);
        }
        println!(
            "fsck: {} checkpoint(s) on {} thread(s), {} mount(s), {} objects verified, {} unreachable ({}); {} error(s), {} leftover(s); {}",
            r.checkpoints,
            r.threads,
            r.mounts,
            r.objects_verified,
            r.unreachable_objects,
            bytes(r.unreachable_bytes),
            r.errors.len(),
            r.leftovers.len(),
            millis(r.duration_ms)
        );
    }
    if !r.errors.is_empty() {
        bail!("the store has {} error(s)", r.errors.len());
    }
    Ok(())
}

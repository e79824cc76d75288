//! One function per command.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use serde_json::json;

use casfs::cas::file::write_file_to;
use casfs::cas::{load_tree, EntryContent, Tree, TreeEntry, TreeId};
use casfs::checkpoint::diff::{diff_trees, ChangeKind};
use casfs::checkpoint::{
    capture_to_thread, holder_name, restore_tree, uncaptured_changes, AppendOptions,
    CaptureOptions, CaptureProgress, Checkpoint, CheckpointError, ExpectedHead, OpenMode,
    RestoreOptions, RestoreProgress, Store, ThreadId,
};

use super::args::{resolve, thread_or_at, Cli, Command};
use super::output::{bytes, json, millis, time_ms, with_spinner};

pub fn run(cli: &Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Gc {
            dry_run,
            grace,
            max_unused,
        } => super::maintain::gc(cli, *dry_run, *grace, *max_unused),
        Command::Prune {
            keep_last,
            keep_within,
            thread,
            dry_run,
            gc,
        } => super::maintain::prune(
            cli,
            *keep_last,
            keep_within.as_deref(),
            thread.as_deref(),
            *dry_run,
            *gc,
        ),
        Command::Fsck { repair } => super::maintain::fsck(cli, *repair),
        Command::Init => {
            let store = cli.open_store(OpenMode::Create)?;
            if store.backends().is_fleet() {
                // Remembered by the store, so later commands need no flags.
                Store::save_backends(store.root(), store.backends())?;
            }
            if cli.json {
                json(&json!({ "store": store.root() }))
            } else {
                println!("casfs store at {}", store.root().display());
                Ok(())
            }
        }
        Command::Capture {
            dir,
            thread,
            reason,
            expected_head,
            no_stat_cache,
            lease_ttl,
        } => capture(
            cli,
            dir,
            thread,
            reason,
            expected_head.as_deref(),
            *no_stat_cache,
            *lease_ttl,
        ),
        Command::Restore {
            dir,
            checkpoint,
            thread,
            at,
            no_stat_cache,
            force,
        } => {
            if checkpoint.is_some() && at.is_some() {
                bail!("give the checkpoint either as an argument or with --at, not both");
            }
            let at = checkpoint.as_deref().or(at.as_deref());
            match super::mount::socket_of(cli, dir) {
                Some(socket) => {
                    super::mount::restore_mount(cli, &socket, dir, at, thread.as_deref(), *force)
                }
                None => restore(cli, dir, thread.as_deref(), at, *no_stat_cache, *force),
            }
        }
        Command::Status { mountpoint } => super::mount::status(cli, mountpoint),
        Command::Checkpoint { mountpoint, reason } => {
            super::mount::checkpoint(cli, mountpoint, reason)
        }
        Command::Log { thread, limit } => log(cli, thread, *limit),
        Command::Threads => threads(cli),
        Command::Show { checkpoint } => show(cli, checkpoint),
        Command::Ls {
            checkpoint,
            path,
            recursive,
        } => ls(cli, checkpoint, path, *recursive),
        Command::Cat { checkpoint, path } => cat(cli, checkpoint, path),
        Command::Diff { a, b } => diff(cli, a, b),
        Command::Fork { new_thread, from } => fork(cli, new_thread, from),
        Command::Mount {
            mountpoint,
            thread,
            at,
            read_only,
            no_passthrough,
            mode,
            fuse_transport,
            foreground,
            allow_other,
            max_local_copies,
            chunk_cache,
        } => super::mount::mount(
            cli,
            mountpoint,
            thread.as_deref(),
            at.as_deref(),
            *read_only,
            *foreground,
            *mode,
            casfs::fs::WorkspaceOptions {
                allow_other: *allow_other,
                passthrough: !*no_passthrough,
                local_copies_bytes: max_local_copies.saturating_mul(1 << 20),
                chunk_cache_bytes: (chunk_cache.saturating_mul(1 << 20)) as usize,
                fuse_uring: fuse_transport
                    .wants_uring()
                    .map_err(|e| anyhow::anyhow!("--fuse-transport: {e}"))?,
                ..casfs::fs::WorkspaceOptions::default()
            },
        ),
        Command::Watch {
            dir,
            foreground,
            stop,
        } => super::watch::watch(cli, dir, *foreground, *stop),
        Command::Unmount { mountpoint, lazy } => super::mount::unmount(cli, mountpoint, *lazy),
        Command::Exec {
            mountpoint,
            cwd,
            namespace,
            holder,
            keep_mount_rights,
            command,
        } => super::mount::exec(
            cli,
            mountpoint,
            cwd.as_deref(),
            super::mount::ExecVia {
                namespace: *namespace,
                holder: *holder,
                keep_mount_rights: *keep_mount_rights,
            },
            command,
        ),
        Command::Shell { mountpoint, cwd } => {
            let shell = std::env::var_os("SHELL")
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "/bin/sh".into());
            let via = super::mount::ExecVia {
                namespace: false,
                holder: None,
                keep_mount_rights: false,
            };
            super::mount::exec(cli, mountpoint, cwd.as_deref(), via, &[shell])
        }
        Command::NamespaceHolder => Ok(casfs::mount::namespace::run_holder()?),
        Command::SandboxInit => Ok(casfs::middleware::isolate::init::run()?),
        Command::SandboxSpawn => Ok(casfs::middleware::isolate::spare_main()?),
        Command::Serve { .. } => super::serve::run(cli),
        Command::Completions { shell } => super::generate::completions(*shell),
        Command::ManPages { dir } => super::generate::man_pages(dir),
        Command::Bench { .. } => super::bench::main(cli),
    }
}

fn capture(
    cli: &Cli,
    dir: &Path,
    thread: &str,
    reason: &str,
    expected_head: Option<&str>,
    no_stat_cache: bool,
    lease_ttl: f64,
) -> anyhow::Result<()> {
    let thread = ThreadId::new(thread)?;
    if !dir.is_dir() {
        bail!("{}: not a directory", dir.display());
    }
    if !(0.1..=86400.0).contains(&lease_ttl) {
        bail!("--lease-ttl {lease_ttl}: use 0.1 to 86400 seconds");
    }
    let store = cli.open_store(OpenMode::Create)?;
    let expected = match expected_head {
        None => ExpectedHead::Current,
        Some("none") => ExpectedHead::Exactly(None),
        Some(r) => ExpectedHead::Exactly(Some(resolve(&store, r)?)),
    };
    let remote_before = store.remote().map(|r| r.stats());
    let progress = CaptureProgress::default();
    let opts = CaptureOptions {
        no_stat_cache,
        progress: Some(&progress),
        filter: None,
    };
    let append = AppendOptions {
        thread: thread.clone(),
        reason: reason.to_string(),
        expected,
        holder: holder_name("casfs-capture"),
        lease_ttl: Duration::from_secs_f64(lease_ttl),
    };
    let (cp, warnings) = with_spinner(
        "capturing",
        || {
            format!(
                "{} files, {} hashed",
                progress.files.load(Ordering::Relaxed),
                bytes(progress.bytes_hashed.load(Ordering::Relaxed))
            )
        },
        || capture_to_thread(&store, dir, &opts, &append),
    )
    .with_context(|| format!("capture of {} on thread {thread:?}", dir.display()))?;
    // What crossed the network (fleet objects): objects, packs, requests by kind.
    let remote = remote_delta(&store, remote_before);
    if cli.json {
        return json(&json!({ "checkpoint": cp, "warnings": warnings, "remote": remote }));
    }
    print_remote(&remote);
    let s = &cp.body.stats;
    println!("checkpoint {}", cp.id);
    println!(
        "  thread {}, parent {}",
        cp.body.thread_id,
        cp.body
            .parent_id
            .map(|p| p.short())
            .unwrap_or_else(|| "none".into())
    );
    println!(
        "  {} files ({}), {} dirs, {} symlinks",
        s.files,
        bytes(s.bytes),
        s.dirs,
        s.symlinks
    );
    println!(
        "  hashed {} files ({}), {} unchanged (directory cache); {} new objects ({})",
        s.files_hashed,
        bytes(s.bytes_hashed),
        s.files_skipped,
        s.new_objects,
        bytes(s.new_bytes)
    );
    match &s.watcher {
        Some(w) if w == "changes" => println!(
            "  watcher: {} directories unchanged, not looked at",
            s.dirs_reused
        ),
        Some(w) => println!(
            "  watcher: looked at everything ({})",
            w.trim_start_matches("full: ")
        ),
        None => {}
    }
    println!("  took {}", millis(s.duration_ms));
    for w in warnings {
        eprintln!("casfs: warning: {w}");
    }
    Ok(())
}

fn restore(
    cli: &Cli,
    dir: &Path,
    thread: Option<&str>,
    at: Option<&str>,
    no_stat_cache: bool,
    force: bool,
) -> anyhow::Result<()> {
    let store = cli.open_store(OpenMode::MustExist)?;
    let id = resolve(&store, &thread_or_at("restore", thread, at)?)?;
    let cp = store.checkpoints().get(&id)?;
    if let Some(t) = thread {
        if cp.body.thread_id.as_str() != t {
            let on_thread = store
                .checkpoints()
                .log(&ThreadId::new(t)?, usize::MAX)?
                .iter()
                .any(|c| c.id == id);
            if !on_thread {
                bail!(
                    "checkpoint {} is not in the history of thread {t:?}",
                    id.short()
                );
            }
        }
    }
    if !force {
        const SHOWN: usize = 5;
        let changes = uncaptured_changes(&store, dir, SHOWN + 1)?;
        if !changes.is_empty() {
            let more = if changes.len() > SHOWN { ", ..." } else { "" };
            bail!(
                "{} has changes no capture recorded ({}{more}); capture them first, or pass --force to overwrite them",
                dir.display(),
                changes[..changes.len().min(SHOWN)].join(", ")
            );
        }
    }
    let remote_before = store.remote().map(|r| r.stats());
    let progress = RestoreProgress::default();
    let opts = RestoreOptions {
        no_stat_cache,
        progress: Some(&progress),
        root_meta: cp.body.root_meta,
        ..Default::default()
    };
    let stats = with_spinner(
        "restoring",
        || {
            format!(
                "{} files, {} written",
                progress.files.load(Ordering::Relaxed),
                bytes(progress.bytes_written.load(Ordering::Relaxed))
            )
        },
        || restore_tree(&store, cp.body.root, dir, &opts),
    )
    .with_context(|| format!("restore of {} into {}", id.short(), dir.display()))?;
    let remote = remote_delta(&store, remote_before);
    if cli.json {
        return json(&json!({ "checkpoint": id, "dir": dir, "stats": stats, "remote": remote }));
    }
    print_remote(&remote);
    println!("restored {} into {}", id, dir.display());
    println!(
        "  {} files written ({}), {} unchanged, {} dirs, {} symlinks, {} removed",
        stats.files_written,
        bytes(stats.bytes_written),
        stats.files_unchanged,
        stats.dirs,
        stats.symlinks,
        stats.removed
    );
    println!("  took {}", millis(stats.duration_ms));
    Ok(())
}

fn summary_line(cp: &Checkpoint) -> String {
    let st = &cp.body.stats;
    // A mount's checkpoint never walks the tree, so it counts what changed, not totals
    // (a record from before it counted them says what it hashed).
    let count = match (st.changed, st.removed) {
        (Some(c), Some(r)) => format!("{c} changed, {r} removed"),
        _ if st.files == 0 && st.dirs == 0 => format!("{} hashed", st.files_hashed),
        _ => format!("{} files", st.files),
    };
    format!(
        "{}  {}  {:<10} {count}  {}",
        cp.id.short(),
        time_ms(cp.body.created_at_ms),
        cp.body.thread_id,
        cp.body.reason
    )
}

fn log(cli: &Cli, thread: &str, limit: usize) -> anyhow::Result<()> {
    let store = cli.open_store_read()?;
    let thread = ThreadId::new(thread)?;
    let log = store.checkpoints().log(&thread, limit)?;
    if log.is_empty() {
        return Err(CheckpointError::EmptyThread(thread).into());
    }
    if cli.json {
        return json(&log);
    }
    for cp in &log {
        println!("{}", summary_line(cp));
    }
    Ok(())
}

fn threads(cli: &Cli) -> anyhow::Result<()> {
    let store = cli.open_store_read()?;
    let threads = store.checkpoints().threads()?;
    if cli.json {
        let v: Vec<_> = threads
            .iter()
            .map(|(t, h)| json!({ "thread": t, "head": h }))
            .collect();
        return json(&v);
    }
    for (t, h) in threads {
        println!("{}  {}", h.short(), t);
    }
    Ok(())
}

fn show(cli: &Cli, r: &str) -> anyhow::Result<()> {
    let store = cli.open_store_read()?;
    let cp = store.checkpoints().get(&resolve(&store, r)?)?;
    if cli.json {
        return json(&cp);
    }
    let b = &cp.body;
    println!("checkpoint {}", cp.id);
    println!("thread     {}", b.thread_id);
    println!(
        "parent     {}",
        b.parent_id
            .map(|p| p.to_string())
            .unwrap_or_else(|| "none".into())
    );
    println!("created    {}", time_ms(b.created_at_ms));
    println!("reason     {}", b.reason);
    if let Some(run) = &b.source_run_id {
        println!("run        {run}");
    }
    println!("root       {}", b.root);
    // A mount's checkpoint reads only what changed: it has no totals to tell.
    if b.stats.files + b.stats.dirs + b.stats.symlinks + b.stats.special > 0
        || b.stats.changed.is_none()
    {
        println!(
            "content    {} files ({}), {} dirs, {} symlinks, {} special",
            b.stats.files,
            bytes(b.stats.bytes),
            b.stats.dirs,
            b.stats.symlinks,
            b.stats.special
        );
    }
    if let (Some(c), Some(r)) = (b.stats.changed, b.stats.removed) {
        println!("changes    {c} changed, {r} removed");
    }
    println!(
        "capture    {} hashed ({}), {} unchanged, {} new objects ({}), {}",
        b.stats.files_hashed,
        bytes(b.stats.bytes_hashed),
        b.stats.files_skipped,
        b.stats.new_objects,
        bytes(b.stats.new_bytes),
        millis(b.stats.duration_ms)
    );
    if let Some(c) = &b.conversation {
        println!("conversation {} ({})", c.id.short(), bytes(c.size));
    }
    for a in &b.artifacts {
        println!(
            "artifact   {} {} ({})",
            a.name,
            a.content.id.short(),
            bytes(a.content.size)
        );
    }
    if let Some(w) = &b.workspace_hash {
        println!("workspace  {w}");
    }
    Ok(())
}

/// Finds `path` (slash-separated) under the root tree.
fn lookup(store: &Store, root: TreeId, path: &str) -> anyhow::Result<Option<TreeEntry>> {
    let mut tree = load_tree(store.objects(), &root)?;
    let parts: Vec<&str> = path
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    let mut found = None;
    for (i, part) in parts.iter().enumerate() {
        let e = tree
            .get(part.as_bytes())
            .cloned()
            .ok_or_else(|| anyhow!("{path}: no such file or directory in the checkpoint"))?;
        if i + 1 < parts.len() {
            match e.content {
                EntryContent::Dir(t) => tree = load_tree(store.objects(), &t)?,
                _ => bail!("{path}: {part} is not a directory in the checkpoint"),
            }
        }
        found = Some(e);
    }
    Ok(found)
}

fn mode_string(e: &TreeEntry) -> String {
    let kind = match e.content {
        EntryContent::File(_) => '-',
        EntryContent::Dir(_) => 'd',
        EntryContent::Symlink(_) => 'l',
        EntryContent::Fifo => 'p',
        EntryContent::CharDevice { .. } => 'c',
        EntryContent::BlockDevice { .. } => 'b',
    };
    let mut s = String::from(kind);
    for shift in [6, 3, 0] {
        let bits = (e.mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn entry_json(e: &TreeEntry, path: &str) -> serde_json::Value {
    let (kind, target, id) = match &e.content {
        EntryContent::File(id) => ("file", None, Some(id.to_hex())),
        EntryContent::Dir(id) => ("dir", None, Some(id.to_hex())),
        EntryContent::Symlink(t) => (
            "symlink",
            Some(String::from_utf8_lossy(t).into_owned()),
            None,
        ),
        other => (other.kind_name(), None, None),
    };
    json!({
        "path": path, "kind": kind, "mode": format!("{:04o}", e.mode), "size": e.size,
        "mtime_ns": e.mtime_ns, "id": id, "target": target,
        "xattrs": e.xattrs.iter().map(|(k, _)| String::from_utf8_lossy(k).into_owned()).collect::<Vec<_>>(),
    })
}

fn ls(cli: &Cli, r: &str, path: &str, recursive: bool) -> anyhow::Result<()> {
    let store = cli.open_store_read()?;
    let cp = store.checkpoints().get(&resolve(&store, r)?)?;
    let tree_id = match lookup(&store, cp.body.root, path)? {
        None => cp.body.root,
        Some(e) => match e.content {
            EntryContent::Dir(t) => t,
            _ => {
                let p = path.trim_matches('/');
                return print_entries(cli, &[(p.to_string(), e)]);
            }
        },
    };
    let mut rows = Vec::new();
    collect(
        &store,
        &load_tree(store.objects(), &tree_id)?,
        path.trim_matches('/'),
        recursive,
        &mut rows,
    )?;
    print_entries(cli, &rows)
}

fn collect(
    store: &Store,
    tree: &Tree,
    prefix: &str,
    recursive: bool,
    out: &mut Vec<(String, TreeEntry)>,
) -> anyhow::Result<()> {
    for e in tree.entries() {
        let p = if prefix.is_empty() {
            e.name_lossy()
        } else {
            format!("{prefix}/{}", e.name_lossy())
        };
        out.push((p.clone(), e.clone()));
        if recursive {
            if let EntryContent::Dir(t) = e.content {
                collect(store, &load_tree(store.objects(), &t)?, &p, true, out)?;
            }
        }
    }
    Ok(())
}

fn print_entries(cli: &Cli, rows: &[(String, TreeEntry)]) -> anyhow::Result<()> {
    if cli.json {
        let v: Vec<_> = rows.iter().map(|(p, e)| entry_json(e, p)).collect();
        return json(&v);
    }
    let mut out = std::io::stdout().lock();
    for (p, e) in rows {
        let mtime = time_ms((e.mtime_ns.max(0) / 1_000_000) as u64);
        let suffix = match &e.content {
            EntryContent::Symlink(t) => format!(" -> {}", String::from_utf8_lossy(t)),
            EntryContent::Dir(_) => "/".into(),
            _ => String::new(),
        };
        writeln!(
            out,
            "{} {:>12} {} {p}{suffix}",
            mode_string(e),
            e.size,
            mtime
        )?;
    }
    Ok(())
}

fn cat(cli: &Cli, r: &str, path: &str) -> anyhow::Result<()> {
    let store = cli.open_store_read()?;
    let cp = store.checkpoints().get(&resolve(&store, r)?)?;
    let e = lookup(&store, cp.body.root, path)?
        .ok_or_else(|| anyhow!("{path}: name a file inside the checkpoint"))?;
    let f = e
        .file_ref()
        .ok_or_else(|| anyhow!("{path}: is a {}, not a file", e.content.kind_name()))?;
    // Verify everything before writing a byte: a corrupt file prints nothing.
    let mut buf = Vec::with_capacity(f.size as usize);
    write_file_to(store.objects(), &f, &mut buf, Path::new(path))?;
    let mut out = std::io::stdout().lock();
    out.write_all(&buf)?;
    out.flush()?;
    Ok(())
}

fn diff(cli: &Cli, a: &str, b: &str) -> anyhow::Result<()> {
    let store = cli.open_store_read()?;
    let ca = store.checkpoints().get(&resolve(&store, a)?)?;
    let cb = store.checkpoints().get(&resolve(&store, b)?)?;
    let changes = diff_trees(store.objects(), ca.body.root, cb.body.root)?;
    if cli.json {
        return json(&changes);
    }
    for c in changes {
        let k = match c.kind {
            ChangeKind::Added => 'A',
            ChangeKind::Removed => 'D',
            ChangeKind::Modified => 'M',
        };
        if c.what.is_empty() {
            println!("{k} {}", c.path);
        } else {
            println!("{k} {} ({})", c.path, c.what.join(", "));
        }
    }
    Ok(())
}

fn fork(cli: &Cli, new_thread: &str, from: &str) -> anyhow::Result<()> {
    let store = cli.open_store(OpenMode::MustExist)?;
    let thread = ThreadId::new(new_thread)?;
    let from = resolve(&store, from)?;
    let cp = store.checkpoints().fork(&thread, &from)?;
    if cli.json {
        return json(&cp);
    }
    println!(
        "thread {} starts at {} (fork of {})",
        thread,
        cp.id,
        from.short()
    );
    Ok(())
}

/// What the remote object store did since `before` (`None` without fleet objects).
fn remote_delta(
    store: &Store,
    before: Option<casfs::cas::remote_store::RemoteStats>,
) -> Option<casfs::cas::remote_store::RemoteStats> {
    Some(store.remote()?.stats().since(&before?))
}

fn print_remote(r: &Option<casfs::cas::remote_store::RemoteStats>) {
    let Some(r) = r else { return };
    let q = &r.requests;
    eprintln!(
        "remote: {} object(s) in {} pack(s) up ({}), {} down ({}); requests: {} PUT, {} GET, \
         {} ranged GET, {} LIST, {} HEAD",
        r.uploaded_objects,
        r.uploaded_packs,
        bytes(r.uploaded_bytes),
        r.fetched_objects,
        bytes(r.fetched_bytes),
        q.put,
        q.get,
        q.ranged_get,
        q.list,
        q.head
    );
}

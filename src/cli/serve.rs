//! `casfs serve`: reads its configuration, opens the store (and holds it), serves.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};

use super::args::{Cli, Command};
use casfs::checkpoint::OpenMode;
use casfs::fs::WorkspaceOptions;
use casfs::middleware::serve::{
    serve, Identities, Listen, ServeLimits, Server, SocketAccess, MIN_TOKEN_LEN,
};
use casfs::middleware::{
    CasfsProvider, DirProvider, FileEvents, Lifecycle, MiddlewareConfig, Persistence,
    SandboxProvider, Secrets, SnapshotConfig, SnapshotPolicy, StorePersistence,
};

pub fn run(cli: &Cli) -> anyhow::Result<()> {
    let Command::Serve {
        socket,
        socket_mode,
        socket_group,
        admin_group,
        listen,
        token_file,
        tenant_tokens,
        sandboxes,
        plain,
        mode,
        policy,
        workspace,
        secrets,
        diffs,
        lease_ttl,
        destroy_on_complete,
        destroy_on_error,
        max_body,
        max_data_body,
        max_json_depth,
        max_json_elements,
        max_request_memory,
        max_request_memory_per_peer,
        request_memory_wait,
        max_runs,
        max_runs_per_tenant,
        max_sandboxes,
        max_sandboxes_per_tenant,
        run_idle_timeout,
        sandbox_idle_timeout,
        max_events,
        max_connections,
        max_connections_per_peer,
        client_timeout,
        idle_connection_timeout,
        allow_client_clocks,
        sandbox_network,
        sandbox_memory,
        sandbox_pids,
        sandbox_cpus,
        sandbox_tmp,
        sandbox_disk,
        sandbox_user,
        sandbox_allow,
        sandboxes_ahead,
    } = &cli.command
    else {
        unreachable!("dispatched on Serve")
    };
    // Sandboxes on overlay, served by a user who is not root, live in the user's
    // namespace: joined now, before anything starts a thread.
    if *mode == casfs::mount::MountMode::Overlay && casfs::mount::namespace::rootless() {
        if let Some(why) = casfs::mount::namespace::rootless_overlay_blocked() {
            bail!(
                "--mode overlay as uid {}: {why}; serve with --mode fuse (or auto, which \
                 falls back to it)",
                casfs::mount::namespace::euid()
            );
        }
        // Inside the namespace only the user's own ids are mapped: other users' peer
        // credentials read as 65534, and a group cannot be given the socket.
        if socket_group.is_some() || socket_mode.is_some_and(|m| m != 0o600) {
            bail!(
                "--socket-group and --socket-mode let other users in, which a server of uid {} \
                 with rootless overlay sandboxes cannot tell apart; serve them as root, or \
                 with --mode fuse",
                casfs::mount::namespace::euid()
            );
        }
        casfs::mount::namespace::join_for_mounting()?;
    }
    // A client that goes away mid-reply must not take the server (and every
    // sandbox's mount) with it.
    casfs::ignore_broken_pipes();
    // What the no-follow handles keep for the process's life, opened now.
    casfs::sys::dirfd::prepare().context("opening /proc")?;
    let read_json = |p: &std::path::Path| -> anyhow::Result<serde_json::Value> {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))
    };
    let policy: SnapshotPolicy = match policy {
        Some(p) => serde_json::from_value(read_json(p)?)
            .with_context(|| format!("{}: not a capture policy", p.display()))?,
        None => SnapshotPolicy::default(),
    };
    let workspace = match workspace {
        Some(p) => read_json(p)?,
        None => serde_json::Value::Null,
    };
    let mut secret_values = BTreeMap::new();
    for name in secrets {
        let v = std::env::var(name).map_err(|_| {
            anyhow!("--secret {name}: no environment variable {name} holds its value")
        })?;
        secret_values.insert(name.clone(), v);
    }
    let token = match (token_file, std::env::var("CASFS_TOKEN").ok()) {
        (Some(f), _) => Some(
            std::fs::read_to_string(f)
                .with_context(|| format!("reading {}", f.display()))?
                .trim()
                .to_string(),
        ),
        (None, t) => t,
    };
    if token.as_deref().is_some_and(|t| t.len() < MIN_TOKEN_LEN) {
        bail!("the administrators' token (CASFS_TOKEN or --token-file) is shorter than {MIN_TOKEN_LEN} characters");
    }
    let tenant_tokens = match tenant_tokens {
        Some(f) => {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            Identities::parse_tenant_tokens(&text)
                .map_err(|e| anyhow!("--tenant-tokens {}: {e}", f.display()))?
        }
        None => Vec::new(),
    };
    let identities = Identities {
        admin_group: admin_group
            .as_deref()
            .map(casfs::middleware::serve::group_id)
            .transpose()
            .map_err(|e| anyhow!("--admin-group {e}"))?,
        admin_token: token,
        tenant_tokens,
    };
    if listen.is_some() && !identities.tokens() {
        bail!(
            "--listen needs bearer tokens: the administrators' (CASFS_TOKEN or --token-file) \
             and/or the tenants' (--tenant-tokens)"
        );
    }
    if !(0.1..=3600.0).contains(lease_ttl) {
        bail!("--lease-ttl {lease_ttl}: give 0.1 to 3600 seconds");
    }

    let socket_bits = socket_mode.unwrap_or(if socket_group.is_some() { 0o660 } else { 0o600 });
    let access = SocketAccess::new(socket_bits, socket_group.as_deref())
        .map_err(|e| anyhow!("--socket-group {e}"))?;
    if listen.is_some() && (socket_mode.is_some() || socket_group.is_some()) {
        bail!("--socket-mode and --socket-group are for the Unix socket, not --listen");
    }

    let store = Arc::new(cli.open_store(OpenMode::Create)?);
    let root = store.root().to_path_buf();
    let sandboxes = sandboxes.clone().unwrap_or_else(|| root.join("sandboxes"));
    std::fs::create_dir_all(&sandboxes)
        .with_context(|| format!("creating {}", sandboxes.display()))?;
    // Members of the socket's group reach the workspaces they make.
    access
        .open_to_group(&sandboxes)
        .context("opening the sandboxes directory to --socket-group")?;
    // The host column family keeps conversations and artifacts: scrubbed too.
    let sp = Arc::new(
        StorePersistence::new(store.database().clone())?
            .with_secrets(Secrets::new(secret_values.clone())?),
    );
    let mut snap = SnapshotConfig::new(Persistence::on_store(sp.clone()));
    snap.policy = policy;
    snap.workspace = workspace;
    snap.secrets = secret_values;
    snap.lease_ttl = Duration::from_secs_f64(*lease_ttl);
    let config = MiddlewareConfig {
        snapshots: Some(snap),
        lifecycle: Lifecycle {
            destroy_on_complete: *destroy_on_complete,
            destroy_on_error: *destroy_on_error,
        },
        file_events: Some(FileEvents {
            on_event: Arc::new(|_| {}),
            diff: *diffs,
        }),
    };
    // Plain and overlay sandboxes report file events through one inotify instance.
    if *plain || *mode != casfs::mount::MountMode::Fuse {
        casfs::middleware::start_inotify().map_err(|e| anyhow!(e))?;
    }
    let sandbox_disk = match *sandbox_disk {
        Some(0) => None,
        Some(bytes) => {
            if *plain {
                bail!("--sandbox-disk: a plain-directory sandbox (--plain) is not a mount of its own to bound");
            }
            if !rustix::process::geteuid().is_root() {
                bail!(
                    "--sandbox-disk: a sandbox's disk is a file system of its own on a loop \
                     device, which only root mounts (a server that is not root has no bound \
                     but its store's file system)"
                );
            }
            if bytes < casfs::mount::disk::MIN_BYTES {
                bail!(
                    "--sandbox-disk {bytes}: give at least {} (16 MiB)",
                    casfs::mount::disk::MIN_BYTES
                );
            }
            casfs::mount::disk::usable(&root)
                .with_context(|| format!("--sandbox-disk {bytes}: making a disk"))?;
            Some(bytes)
        }
        None if *plain || !rustix::process::geteuid().is_root() => None,
        None => match casfs::mount::disk::usable(&root) {
            Ok(()) => Some(casfs::mount::disk::DEFAULT_BYTES),
            Err(e) => {
                tracing::warn!(
                    "sandboxes' disks are not bounded ({e}): their writes take the store's \
                     file system's room"
                );
                None
            }
        },
    };
    // Formatted and mounted ahead, so that the first sandboxes do not wait for them;
    // removed when this function returns, however it does (an option refused below
    // included).
    let _spares = sandbox_disk.map(|bytes| casfs::mount::disk::Spares::warm(&root, bytes));
    let provider: Arc<dyn SandboxProvider> = if *plain {
        Arc::new(
            DirProvider::new(store.clone(), &sandboxes)
                .with_max_sandboxes(*max_sandboxes)
                .with_max_sandboxes_per_tenant(*max_sandboxes_per_tenant),
        )
    } else {
        Arc::new(
            CasfsProvider::new(
                store.clone(),
                &sandboxes,
                WorkspaceOptions {
                    // CASFS_FUSE_TRANSPORT, as `casfs mount --fuse-transport`.
                    fuse_uring: casfs::fs::FuseTransport::from_env()
                        .and_then(|t| t.wants_uring())
                        .map_err(|e| anyhow!(e))?,
                    // A sandbox is made at the thread's head, which each run moves: a
                    // mount of it is O(1) on the tree's view rather than O(entries)
                    // building an image that the next run's tree will not use.
                    build_lower_image: false,
                    // A sandbox's isolated processes run as its owner or, in one of
                    // the server's own user, as --sandbox-user: let them in. The gate
                    // in front of each sandbox keeps everyone else out.
                    allow_other: true,
                    disk_bytes: sandbox_disk,
                    ..WorkspaceOptions::default()
                },
            )
            .with_mode(*mode)
            .with_max_sandboxes(*max_sandboxes)
            .with_max_sandboxes_per_tenant(*max_sandboxes_per_tenant),
        )
    };
    if *max_body < 1024 {
        bail!("--max-body {max_body}: give at least 1024 bytes");
    }
    if *max_data_body < 1024 {
        bail!("--max-data-body {max_data_body}: give at least 1024 bytes");
    }
    if !(1..=casfs::middleware::serve::MAX_JSON_DEPTH).contains(max_json_depth) {
        bail!(
            "--max-json-depth {max_json_depth}: give 1 to {}",
            casfs::middleware::serve::MAX_JSON_DEPTH
        );
    }
    if *max_json_elements < 1 {
        bail!("--max-json-elements 0: give at least 1");
    }
    let largest = (*max_body).max(*max_data_body);
    if *max_request_memory < largest {
        bail!(
            "--max-request-memory {max_request_memory}: give at least the largest body a \
             route takes ({largest} bytes, --max-body and --max-data-body)"
        );
    }
    let secs = |flag: &str, v: f64| -> anyhow::Result<Duration> {
        if !(0.05..=1e7).contains(&v) {
            bail!("--{flag} {v}: give 0.05 to 10000000 seconds");
        }
        Ok(Duration::from_secs_f64(v))
    };
    let limits = ServeLimits {
        max_body: *max_body,
        max_data_body: *max_data_body,
        json: casfs::middleware::serve::JsonLimits {
            max_depth: *max_json_depth,
            max_elements: *max_json_elements,
        },
        max_request_memory: *max_request_memory,
        max_request_memory_per_peer: max_request_memory_per_peer
            .unwrap_or(*max_request_memory / 4)
            .max(1),
        request_memory_wait: secs("request-memory-wait", *request_memory_wait)?,
        max_runs: (*max_runs).max(1),
        max_runs_per_tenant: (*max_runs_per_tenant).max(1),
        run_idle: secs("run-idle-timeout", *run_idle_timeout)?,
        sandbox_idle: secs("sandbox-idle-timeout", *sandbox_idle_timeout)?,
        max_events: (*max_events).max(1),
        max_connections: (*max_connections).max(1),
        max_connections_per_peer: max_connections_per_peer
            .unwrap_or(*max_connections / 4)
            .max(1),
        timeouts: casfs::middleware::serve::Timeouts {
            idle: secs("idle-connection-timeout", *idle_connection_timeout)?,
            head: secs("client-timeout", *client_timeout)?,
            stall: secs("client-timeout", *client_timeout)?,
        },
    };
    let server = Server::new(store, sp, provider, config, identities)?;
    server.set_limits(limits);
    server.set_allow_client_clocks(*allow_client_clocks);
    let name = sandbox_user.as_deref().unwrap_or("nobody");
    let stand_in =
        casfs::fs::Owner::of_user(name).with_context(|| format!("--sandbox-user {name:?}"))?;
    if stand_in.uid == 0 || stand_in.gid == 0 {
        bail!("--sandbox-user {name:?}: a sandbox's processes are never root's, nor of group 0");
    }
    if name == "nobody" && rustix::process::geteuid().is_root() {
        tracing::warn!(
            "--sandbox-user nobody: the sandboxes no member owns are nobody's, a user other \
             services may run as too; give them a user of their own (the Debian package's \
             casfs-sandbox)"
        );
    }
    if !sandbox_allow.is_empty() && *sandbox_network == casfs::middleware::isolate::Network::Host {
        bail!("--sandbox-allow: sandboxes on the host's network (--sandbox-network host) reach everything already");
    }
    if *sandbox_tmp < 1 << 20 {
        bail!("--sandbox-tmp {sandbox_tmp}: give at least 1 MiB (1048576)");
    }
    if !sandbox_cpus.is_finite() || *sandbox_cpus <= 0.0 {
        bail!("--sandbox-cpus {sandbox_cpus}: give a positive number of CPUs");
    }
    casfs::middleware::isolate::keep_ahead(*sandboxes_ahead);
    server.set_isolation(casfs::middleware::isolate::Options {
        limits: casfs::middleware::isolate::Limits {
            memory: *sandbox_memory,
            pids: (*sandbox_pids).max(1),
            cpu_millis: (*sandbox_cpus * 1000.0) as u64,
        },
        network: *sandbox_network,
        allow: sandbox_allow.clone(),
        tmp_bytes: *sandbox_tmp,
        stand_in,
    });
    let where_ = match listen {
        Some(a) => Listen::Tcp(*a),
        None => Listen::Unix(
            socket.clone().unwrap_or_else(|| root.join("serve.sock")),
            access,
        ),
    };
    let shown = match &where_ {
        Listen::Tcp(a) => format!("http://{a}"),
        Listen::Unix(p, _) => format!("unix:{}", p.display()),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // Blocking work (captures, restores, removals) walks trees as deep as casfs
        // stores (`cas::MAX_TREE_DEPTH`): room for them, resident only when used.
        .thread_stack_size(casfs::DEEP_STACK)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    // Not eprintln!, which panics when stderr is a pipe nobody reads any more.
    let _ = writeln!(
        std::io::stderr(),
        "casfs: serving {shown} (sandboxes in {})",
        sandboxes.display()
    );
    let serving = server.clone();
    let served = rt.block_on(async move {
        let stop = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
        };
        serve(serving, where_, stop).await
    });
    // Whether it stopped or failed: nothing a run left uncaptured outlives the server
    // (its sandboxes go), nor a spare disk, nor what was started ahead for the next
    // sandbox (with its control group).
    casfs::fs::process_ending();
    let closed = server.close();
    drop(_spares);
    casfs::middleware::isolate::end_spare();
    served.with_context(|| format!("serving {shown}"))?;
    closed.context("destroying the sandboxes")?;
    Ok(())
}

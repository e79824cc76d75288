//! The command line's definition (clap): the options every command takes ([`Cli`]),
//! the commands and their arguments, the parsers of their values, and where the store
//! is and how it opens.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

use anyhow::anyhow;
use casfs::checkpoint::{Backends, CheckpointId, OpenMode, Store};

use super::units::parse_size;

#[derive(Parser)]
#[command(
    name = "casfs",
    // The commit too (build.rs): `casfs 0.1.0 (commit 0546df917bbc)`.
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("CASFS_COMMIT"), ")"),
    about = "A content-addressed workspace filesystem: capture, checkpoint and restore workspaces",
    propagate_version = true
)]
pub struct Cli {
    /// Store directory [default: $XDG_DATA_HOME/casfs, else ~/.local/share/casfs]
    #[arg(long, global = true, env = "CASFS_STORE", value_name = "DIR")]
    pub(super) store: Option<PathBuf>,

    /// Checkpoints, heads and leases in PostgreSQL
    /// (postgres://user@host:port/db?schema=NAME; password from PGPASSWORD) instead of
    /// the store's own database [default: what the store's casfs.json names]
    #[arg(long, global = true, env = "CASFS_CHECKPOINTS", value_name = "URL")]
    pub(super) checkpoints: Option<String>,

    /// Objects in S3-compatible storage (s3://bucket/prefix; also gs://, az://,
    /// file://), credentials from the environment (AWS_ACCESS_KEY_ID, ...); the store's
    /// own database caches them [default: what the store's casfs.json names]
    #[arg(long, global = true, env = "CASFS_OBJECTS", value_name = "URL")]
    pub(super) objects: Option<String>,

    /// Print machine-readable JSON instead of text
    #[arg(long, global = true)]
    pub(super) json: bool,

    /// Seconds to wait for another casfs process that has the store open
    #[arg(long, global = true, default_value_t = 60.0, value_name = "SECS")]
    pub(super) lock_timeout: f64,

    #[command(subcommand)]
    pub(super) command: Command,
}

/// A checkpoint reference: a hex id or unique prefix (at least 4 digits), or `@THREAD`
/// for a thread's head; either may end in `~N` for the Nth parent.
pub type Ref = String;

// Parsed once per process: `serve`'s many flags make its variant the largest, which
// costs nothing worth boxing for.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Command {
    /// Create a store (other commands that write create it too)
    Init,

    /// Capture a directory as a new checkpoint on a thread
    Capture {
        dir: PathBuf,
        #[arg(long, short)]
        thread: String,
        #[arg(long, short, default_value = "capture")]
        reason: String,
        /// Append only if the thread's head is this checkpoint (`none`: only if the
        /// thread is empty); default: the head when the capture starts
        #[arg(long, value_name = "REF|none")]
        expected_head: Option<String>,
        /// Read every file, ignoring the directory cache (which is still updated)
        #[arg(long)]
        no_stat_cache: bool,
        /// Writer lease time-to-live in seconds (renewed while the capture runs)
        #[arg(long, default_value_t = 30.0, value_name = "SECS")]
        lease_ttl: f64,
    },

    /// Make a directory match a checkpoint exactly (extra files are removed); refuses
    /// to overwrite uncaptured changes unless --force
    ///
    /// On a writable casfs mount, swaps the mount's root to the checkpoint (default:
    /// the mount's base) instantly, copying nothing; --thread then also moves the
    /// mount to that thread.
    Restore {
        dir: PathBuf,
        /// The checkpoint to restore (same as --at)
        checkpoint: Option<Ref>,
        /// Restore this thread's head (or, with --at, a checkpoint of the thread)
        #[arg(long, short)]
        thread: Option<String>,
        /// The checkpoint to restore
        #[arg(long, value_name = "REF")]
        at: Option<Ref>,
        /// Rewrite every file, ignoring the directory cache
        #[arg(long)]
        no_stat_cache: bool,
        /// Overwrite changes in DIR that no capture recorded (otherwise refused)
        #[arg(long)]
        force: bool,
    },

    /// List a thread's checkpoints, newest first
    Log {
        #[arg(long, short)]
        thread: String,
        /// At most this many
        #[arg(long, short = 'n', default_value_t = 50)]
        limit: usize,
    },

    /// List threads and their heads
    Threads,

    /// Show one checkpoint record
    Show { checkpoint: Ref },

    /// List a directory of a checkpoint
    Ls {
        checkpoint: Ref,
        /// Path inside the checkpoint
        #[arg(default_value = "")]
        path: String,
        /// List subdirectories too
        #[arg(long, short = 'r')]
        recursive: bool,
    },

    /// Write a file of a checkpoint to standard output
    Cat { checkpoint: Ref, path: String },

    /// Paths added, removed and modified from checkpoint A to checkpoint B
    Diff { a: Ref, b: Ref },

    /// Mount a thread's workspace: contents load lazily from the store, writes go to
    /// local upper files, `casfs checkpoint` captures only what changed
    Mount {
        mountpoint: PathBuf,
        /// The thread whose head is mounted and on which checkpoints are appended
        #[arg(long, short)]
        thread: Option<String>,
        /// Start from this checkpoint instead of the thread's head
        #[arg(long, value_name = "REF")]
        at: Option<Ref>,
        /// Serve the checkpoint read-only, without taking the store's lock
        #[arg(long)]
        read_only: bool,
        /// Serve every read through the daemon, even where FUSE passthrough works
        #[arg(long)]
        no_passthrough: bool,
        /// Backend: `overlay` (the kernel's overlayfs over a read-only casfs lower:
        /// native-speed metadata; as a user other than root, inside that user's own
        /// namespace, entered with `casfs exec`), `fuse` (every request through casfs:
        /// per-write events, chunk-exact large-file checkpoints) or `auto` (overlay where
        /// the host allows it)
        #[arg(long, env = "CASFS_MOUNT_MODE", default_value = "auto", value_parser = parse_mode)]
        mode: casfs::mount::MountMode,
        /// How the kernel talks to the daemon: `io_uring` (per-CPU ring queues; needs
        /// /sys/module/fuse/parameters/enable_uring = Y, which casfs never sets itself),
        /// `classic` (read/write on /dev/fuse) or `auto` (io_uring where enabled)
        #[arg(long, env = "CASFS_FUSE_TRANSPORT", default_value = "auto", value_parser = casfs::fs::FuseTransport::parse)]
        fuse_transport: casfs::fs::FuseTransport,
        /// Stay in the foreground (otherwise return once the mount answers)
        #[arg(long)]
        foreground: bool,
        /// Let other users in (permissions still apply)
        #[arg(long)]
        allow_other: bool,
        /// Keep at most this many MiB of local copies of clean files (made for
        /// passthrough reads and left by checkpoints); the oldest unused go first
        #[arg(long, default_value_t = 2048, value_name = "MIB")]
        max_local_copies: u64,
        /// Chunk cache for reads served by the daemon, in MiB
        #[arg(long, default_value_t = 64, value_name = "MIB")]
        chunk_cache: u64,
    },

    /// Show a writable mount's thread, base checkpoint and uncaptured changes
    Status { mountpoint: PathBuf },

    /// Checkpoint a writable mount: only the files changed since its base are read
    Checkpoint {
        mountpoint: PathBuf,
        #[arg(long, short, default_value = "checkpoint")]
        reason: String,
    },

    /// Follow a plain directory with inotify so that its re-captures look only at the
    /// directories that changed (like git's fsmonitor); runs until stopped
    Watch {
        dir: PathBuf,
        /// Stay in the foreground (otherwise return once the watcher answers)
        #[arg(long)]
        foreground: bool,
        /// Stop the directory's watcher
        #[arg(long, conflicts_with = "foreground")]
        stop: bool,
    },

    /// Run a command where the casfs mount at MOUNTPOINT is seen: in the caller's user
    /// and mount namespace, or (for a rootless overlay mount, which lives in the user's
    /// own namespace) inside that namespace, with the caller's uid, groups and working
    /// directory and no extra capabilities. `casfs exec ws -- make -j4`
    Exec {
        mountpoint: PathBuf,
        /// Working directory of the command [default: the caller's]
        #[arg(long, short = 'C', value_name = "DIR")]
        cwd: Option<PathBuf>,
        /// Enter the user's namespace (started if none runs) whatever MOUNTPOINT is
        #[arg(long, hide = true)]
        namespace: bool,
        /// Enter the namespaces of process PID (the mount's daemon, or the `casfs serve`
        /// of a sandbox: `casfs status` and the API name it as the namespace's holder)
        #[arg(long, value_name = "PID", conflicts_with = "namespace")]
        holder: Option<i32>,
        /// With --namespace: let the command and what it runs mount there (for a test
        /// harness that starts casfs mounts from inside; never for an agent)
        #[arg(long, hide = true)]
        keep_mount_rights: bool,
        /// The command and its arguments (after `--`)
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<std::ffi::OsString>,
    },

    /// An interactive shell ($SHELL, else /bin/sh) where the casfs mount at MOUNTPOINT is
    /// seen (see `casfs exec`)
    Shell {
        mountpoint: PathBuf,
        /// Working directory of the shell [default: the caller's]
        #[arg(long, short = 'C', value_name = "DIR")]
        cwd: Option<PathBuf>,
    },

    /// The process that holds the user's namespace of rootless mounts (started by
    /// casfs when needed; runs until SIGTERM)
    #[command(hide = true)]
    NamespaceHolder,

    /// The init of an isolated sandbox (started by `casfs serve` inside bubblewrap; talks
    /// to the server on descriptor 3)
    #[command(hide = true)]
    SandboxInit,

    /// A spare process `casfs serve` starts ahead of a sandbox, which becomes its
    /// bubblewrap (talks to the server on descriptor 3)
    #[command(hide = true)]
    SandboxSpawn,

    /// Unmount a casfs mount
    Unmount {
        mountpoint: PathBuf,
        /// Detach now even if files are open (lazy unmount)
        #[arg(long)]
        lazy: bool,
    },

    /// Serve the store, sandboxes and run lifecycle over HTTP + JSON (see docs/openapi.json)
    /// on a Unix socket, or on loopback TCP with a bearer token
    Serve {
        /// Unix socket to listen on [default: <store>/serve.sock]
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Permissions of the Unix socket, in octal: 0600, the server's user only; 0660,
        /// the members of --socket-group too, each one's sandboxes theirs
        /// [default: 0600, or 0660 with --socket-group]
        #[arg(long, value_name = "MODE", value_parser = parse_socket_mode)]
        socket_mode: Option<u32>,
        /// Group of the Unix socket (a name or a number). Each member is a tenant of
        /// their own (named after their user): they see and change only their own
        /// sandboxes, threads, runs and stores, and reach only their own workspaces (the
        /// sandboxes directory gets the group too, mode 0710: passage, no listing)
        #[arg(long, value_name = "GROUP")]
        socket_group: Option<String>,
        /// Members of this group (a name or a number) are administrators on the Unix
        /// socket, as root and the server's own user are: they see and change every
        /// tenant's objects (naming a tenant's thread `TENANT/THREAD`) and may run
        /// maintenance
        #[arg(long, value_name = "GROUP")]
        admin_group: Option<String>,
        /// Listen on this loopback TCP address instead (needs CASFS_TOKEN in the
        /// environment or --token-file, and/or --tenant-tokens)
        #[arg(long, value_name = "ADDR")]
        listen: Option<std::net::SocketAddr>,
        /// File holding the administrators' bearer token (at least 16 characters)
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// File of tenants' bearer tokens, one `TENANT TOKEN` a line (`#` comments): on
        /// TCP a request's token names its tenant, who sees and changes only their own
        /// objects. Tenant names are shared with the Unix users of the socket
        #[arg(long, value_name = "FILE")]
        tenant_tokens: Option<PathBuf>,
        /// Where sandboxes are mounted, one directory per key [default: <store>/sandboxes]
        #[arg(long)]
        sandboxes: Option<PathBuf>,
        /// Sandboxes are plain directories (no FUSE): checkpoints walk them, file events
        /// come from inotify
        #[arg(long)]
        plain: bool,
        /// Sandboxes' mount backend: `fuse` (per-write file events from the mount),
        /// `overlay` (the kernel's overlayfs over a casfs lower: native-speed
        /// metadata; events from inotify) or `auto` (overlay where the host allows it)
        #[arg(long, env = "CASFS_MOUNT_MODE", default_value = "auto", value_parser = parse_mode)]
        mode: casfs::mount::MountMode,
        /// Capture policy (JSON: include, exclude, max_file_size, max_total_bytes,
        /// oversize, allow_workspace_mismatch)
        #[arg(long)]
        policy: Option<PathBuf>,
        /// Workspace definition (any JSON) whose hash each checkpoint records
        #[arg(long)]
        workspace: Option<PathBuf>,
        /// A secret never to store: its value is read from the environment variable of
        /// this name (repeatable)
        #[arg(long = "secret", value_name = "NAME")]
        secrets: Vec<String>,
        /// Attach unified diffs against the base checkpoint to file events
        #[arg(long)]
        diffs: bool,
        /// Writer lease TTL in seconds
        #[arg(long, default_value_t = 30.0)]
        lease_ttl: f64,
        /// Destroy a run's sandbox when it finishes (its uncaptured work is discarded)
        #[arg(long)]
        destroy_on_complete: bool,
        /// Destroy a run's sandbox when it fails
        #[arg(long)]
        destroy_on_error: bool,
        /// The largest request body in bytes of a route that carries no data (larger
        /// ones get 413 too_large): runs, sandboxes, writer leases, forks, portable
        /// stores' leases and instance records, maintenance
        #[arg(long, value_name = "BYTES", default_value_t = casfs::middleware::serve::DEFAULT_MAX_BODY)]
        max_body: usize,
        /// The largest request body in bytes of a route that carries data (larger ones
        /// get 413 too_large): an artifact (base64-encoded, so about three quarters of
        /// it), a thread's messages, a client append (its conversation), a portable
        /// checkpoint record or transcript
        #[arg(long, value_name = "BYTES", default_value_t = casfs::middleware::serve::DEFAULT_MAX_DATA_BODY)]
        max_data_body: usize,
        /// Arrays and objects nested in one another in a request body's JSON, at most
        /// (1 to 128); deeper is refused with 400 before any value is made of it
        #[arg(long, value_name = "N", default_value_t = 64)]
        max_json_depth: usize,
        /// Elements (array items and object members together) in a request body's
        /// JSON, at most; more are refused with 400 before any value is made of them
        #[arg(long, value_name = "N", default_value_t = 1_000_000)]
        max_json_elements: u64,
        /// Memory in bytes for request bodies and the JSON values made of them, held at
        /// once by all requests; a request beyond waits up to --request-memory-wait,
        /// then gets 503 busy (one that needs more than all of it: 413)
        #[arg(long, value_name = "BYTES", default_value_t = casfs::middleware::serve::DEFAULT_MAX_REQUEST_MEMORY)]
        max_request_memory: usize,
        /// The same, held by one peer (a Unix user other than the server's) beside its
        /// first request in progress [default: a quarter of --max-request-memory]
        #[arg(long, value_name = "BYTES")]
        max_request_memory_per_peer: Option<usize>,
        /// Seconds a request waits for memory (--max-request-memory) before 503 busy
        #[arg(long, value_name = "SECS", default_value_t = 5.0)]
        request_memory_wait: f64,
        /// Runs going at once (set up, not ended); more are refused with 429
        #[arg(long, default_value_t = 64)]
        max_runs: usize,
        /// Runs of one tenant going at once (administrators: only --max-runs)
        #[arg(long, default_value_t = 16)]
        max_runs_per_tenant: usize,
        /// Live sandboxes at once; making one more destroys the tenant's own least
        /// recently used idle one, and with none of its own idle is refused with 429
        /// (another tenant's work is never destroyed to make room) (0: no limit)
        #[arg(long, default_value_t = 128)]
        max_sandboxes: usize,
        /// Live sandboxes of one tenant (administrators: only --max-sandboxes); at
        /// it, as at --max-sandboxes (0: no limit)
        #[arg(long, default_value_t = 32)]
        max_sandboxes_per_tenant: usize,
        /// Seconds without a request for a run (a chunk, an event read, a hook) after
        /// which it is ended as a disconnect: nothing published, the lease released
        #[arg(long, default_value_t = 600.0)]
        run_idle_timeout: f64,
        /// Seconds a sandbox a run made may stay live with no run holding it before it
        /// is destroyed (its uncaptured work discarded). Sandboxes clients made with
        /// POST /v1/sandboxes are theirs to destroy: they go only when the cap needs
        /// room (idle ones, least recently used first) or the server stops
        #[arg(long, default_value_t = 3600.0)]
        sandbox_idle_timeout: f64,
        /// File events kept per run for the events route; a client that falls further
        /// behind gets a `lost` marker saying which
        #[arg(long, default_value_t = 10_000)]
        max_events: usize,
        /// Client connections open at once; more are answered 503 and closed
        #[arg(long, default_value_t = 256)]
        max_connections: usize,
        /// Client connections open at once from one peer: a Unix user other than the
        /// server's (by the uid the kernel gives), a TCP client by its address; more
        /// are answered 503 and closed, so that one member's connections never turn
        /// the others away [default: a quarter of --max-connections]
        #[arg(long, value_name = "N")]
        max_connections_per_peer: Option<usize>,
        /// Seconds a client may take to send a request head (from a new connection's
        /// first byte, or from the end of the last reply on a kept-alive one), or leave
        /// its request body or our reply without progress, before its connection is
        /// closed
        #[arg(long, default_value_t = 30.0)]
        client_timeout: f64,
        /// Seconds a new connection may send nothing; a kept-alive connection with no
        /// request going is closed after this or --client-timeout, the shorter
        #[arg(long, default_value_t = 60.0)]
        idle_connection_timeout: f64,
        /// Let clients make portable stores (PUT /v1/stores/{store} with clock
        /// "client") whose writer leases expire by the time each request states: for
        /// test suites that inject a clock. Such a store shares nothing with any other,
        /// but any of its clients can move its leases: never on a production server
        #[arg(long)]
        allow_client_clocks: bool,
        /// A sandbox's processes' network (bubblewrap): none (a namespace with only
        /// loopback) or host (the host's network: no network isolation)
        #[arg(long, value_name = "NETWORK", default_value = "none", value_parser = parse_network)]
        sandbox_network: casfs::middleware::isolate::Network,
        /// Memory of one sandbox's processes, in bytes (its own OOM killer beyond)
        #[arg(long, value_name = "BYTES", default_value_t = 1 << 30)]
        sandbox_memory: u64,
        /// Processes and threads of one sandbox (a fork bomb stops there)
        #[arg(long, value_name = "N", default_value_t = 512)]
        sandbox_pids: u64,
        /// CPU time of one sandbox, in CPUs (1.5: one and a half CPUs' worth)
        #[arg(long, value_name = "CPUS", default_value_t = 2.0)]
        sandbox_cpus: f64,
        /// Size of each sandbox's private /tmp, in bytes
        #[arg(long, value_name = "BYTES", default_value_t = 256 << 20)]
        sandbox_tmp: u64,
        /// Bytes one sandbox's writes to its workspace may take (what it changed since
        /// it was made, copies of changed files included): its uncaptured work lives in
        /// a file system of that size of its own (a sparse ext4 image on a loop
        /// device), and a write past it fails with ENOSPC inside the sandbox; 0: no
        /// bound but the store's file system. Root servers only [default: 8 GiB for a
        /// root server where loop devices work, else none]
        #[arg(long, value_name = "BYTES")]
        sandbox_disk: Option<u64>,
        /// The user the processes of sandboxes the server's own user owns run as (never
        /// root) [default: nobody]
        #[arg(long, value_name = "USER")]
        sandbox_user: Option<String>,
        /// A destination a sandbox without the host's network may reach through the
        /// proxy casfs runs in it (HTTP_PROXY, HTTPS_PROXY): HOST, *.DOMAIN or ADDRESS,
        /// with :PORT (else 80 and 443); repeat it for more. A name that resolves to an
        /// address off the public internet (loopback, private, link-local) or to one of
        /// the host's own is refused unless that address is listed
        #[arg(long, value_name = "DEST")]
        sandbox_allow: Vec<casfs::middleware::isolate::proxy::Allowed>,
        /// Sandboxes a root server keeps booted (namespaces, mounts, filter and init
        /// running, no workspace yet) for the next starts of the last shape started,
        /// booted one at a time while no request is being answered; 0: each start
        /// boots its own
        #[arg(long, value_name = "N", default_value_t = casfs::middleware::isolate::DEFAULT_AHEAD)]
        sandboxes_ahead: usize,
    },

    /// Benchmark capture, re-capture, restore, a run-like loop and mounted I/O against
    /// git, restic, tar + zstd, rsync, ext4 and fuse-overlayfs, side by side (mounted
    /// I/O on the largest workload)
    Bench {
        /// Generated workload sizes in files (1k, 10k, 100k, 1m)
        #[arg(long, value_delimiter = ',', default_value = "1k,5k", value_parser = parse_count)]
        sizes: Vec<usize>,
        /// Levels of directories in generated trees
        #[arg(long, default_value_t = 3)]
        depth: usize,
        /// Files in each directory of generated trees
        #[arg(long, default_value_t = 20)]
        files_per_dir: usize,
        /// Median file size of generated trees in bytes (sizes are log-normal around it,
        /// sigma 1.3, as in source trees)
        #[arg(long, default_value_t = 2981)]
        median_size: usize,
        /// Benchmark a copy of this directory instead of generated trees
        #[arg(long, value_name = "DIR")]
        from: Option<PathBuf>,
        /// Files changed before each re-capture and each loop run
        #[arg(long, default_value_t = 10)]
        changes: usize,
        /// Repetitions of each measurement (medians are reported)
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Runs of the run-like loop
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Scenarios to run
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "capture,recapture,restore,loop,io"
        )]
        scenarios: Vec<String>,
        /// Peers to measure beside casfs
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "git,restic,tar+zstd,rsync,ext4,fuse-overlayfs"
        )]
        peers: Vec<String>,
        /// Size of the large file written and read in the I/O scenario, in MiB
        #[arg(long, default_value_t = 256)]
        io_mb: usize,
        /// Also write the report as JSON to this file (a directory: a file in it named
        /// for the run's date and commit); docs/results/README.md describes it
        #[arg(long)]
        out: Option<PathBuf>,
        /// Draw capture and restore time against workload size (SVG)
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Work in this directory and keep it (default: a temporary one, removed)
        #[arg(long)]
        keep: Option<PathBuf>,
        /// Compare two JSON reports (A then B) instead of running
        #[arg(long, num_args = 2, value_names = ["A", "B"])]
        compare: Option<Vec<PathBuf>>,
        /// Instead of running: write the result file (`--out`) of bench NAME, run by a
        /// script, from the rows it gives on standard input (one JSON object a line:
        /// labels, "unit" and "runs"; or {"param": {...}}, or {"note": "..."})
        #[arg(long, value_name = "NAME", requires = "out")]
        record: Option<String>,
        /// With --record: the command line the script was run with
        #[arg(long, value_name = "TEXT", requires = "record")]
        command: Option<String>,
        /// With --record: where the script made its trees (its filesystem is recorded)
        #[arg(long, value_name = "DIR", requires = "record")]
        bench_dir: Option<PathBuf>,
    },

    /// Delete objects nothing live needs: live is every checkpoint record (see
    /// `prune`), every mount's uncaptured changes and the directory cache. Safe while
    /// a mount captures and restores (it runs in the mount's daemon then). With fleet
    /// objects it collects the remote's packs (one gc at a time across hosts)
    Gc {
        /// Report what would be freed, delete nothing
        #[arg(long)]
        dry_run: bool,
        /// Fleet objects: packs younger than this are left alone, and a pack marked
        /// for deletion goes this long after (default 1h; longer than any upload)
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        grace: Option<std::time::Duration>,
        /// Fleet objects: rewrite a pack when more than this fraction of it is dead
        #[arg(long, value_name = "FRACTION", default_value_t = 0.1)]
        max_unused: f64,
    },

    /// Remove old checkpoint records; heads, and checkpoints a mount is based on, are
    /// always kept. Their objects are freed by `casfs gc` (or --gc)
    Prune {
        /// Keep the newest N checkpoints of each thread
        #[arg(long, value_name = "N")]
        keep_last: Option<usize>,
        /// Keep checkpoints created within this long (for example 7d, 12h)
        #[arg(long, value_name = "DURATION")]
        keep_within: Option<String>,
        /// Only this thread's checkpoints
        #[arg(long, short)]
        thread: Option<String>,
        /// Report what would be removed, remove nothing
        #[arg(long)]
        dry_run: bool,
        /// Collect garbage afterwards
        #[arg(long)]
        gc: bool,
    },

    /// Verify the store: every reachable object read and checked, every checkpoint
    /// record, head, lease and fencing token, every mount's dirty set and upper files;
    /// exits non-zero when something is wrong
    Fsck {
        /// Remove what is provably unneeded (unreachable objects, stray upper files)
        /// and rebuild what is derivable (the directory cache, fencing tokens); never
        /// deletes what a checkpoint or an uncaptured change needs
        #[arg(long)]
        repair: bool,
    },

    /// Start a new thread from any checkpoint
    Fork {
        new_thread: String,
        #[arg(long, value_name = "REF")]
        from: Ref,
    },

    /// Print the shell completion script for SHELL (bash, zsh, fish, elvish,
    /// powershell) on standard output
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },

    /// Write the man pages (casfs.1 and one casfs-COMMAND.1 per command) into DIR
    #[command(hide = true)]
    ManPages { dir: PathBuf },
}

fn default_store() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(x).join("casfs");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".local/share/casfs")
}

impl Cli {
    pub(super) fn store_root(&self) -> PathBuf {
        self.store.clone().unwrap_or_else(default_store)
    }

    /// Opens the store for reading only: no lock, so this works while a mount or a
    /// capture has it open.
    pub(crate) fn backends(&self) -> Backends {
        Backends {
            checkpoints: self.checkpoints.clone(),
            objects: self.objects.clone(),
        }
    }

    pub(crate) fn open_store_read(&self) -> anyhow::Result<Store> {
        Ok(Store::open_read_only_with(
            &self.store_root(),
            &self.backends(),
        )?)
    }

    pub(super) fn open_store(&self, mode: OpenMode) -> anyhow::Result<Store> {
        let root = self.store_root();
        let timeout = Duration::from_secs_f64(self.lock_timeout.max(0.0));
        // The middleware keeps its conversation and artifact stores in the store too.
        Ok(Store::open_with_families(
            &root,
            mode,
            timeout,
            &self.backends(),
            casfs::middleware::COLUMN_FAMILIES,
        )?)
    }
}

fn parse_network(s: &str) -> Result<casfs::middleware::isolate::Network, String> {
    match s {
        "none" => Ok(casfs::middleware::isolate::Network::None),
        "host" => Ok(casfs::middleware::isolate::Network::Host),
        _ => Err(format!("{s:?}: give none or host")),
    }
}

/// A count like `10k` or `1m`.
fn parse_count(s: &str) -> Result<usize, String> {
    parse_size(s).ok_or_else(|| format!("{s:?}: give a number of files like 1000, 10k or 1m"))
}

/// The checkpoint reference a command given `--thread T` and/or `--at REF` means:
/// REF if given, else the head of T.
pub(crate) fn thread_or_at(
    command: &str,
    thread: Option<&str>,
    at: Option<&str>,
) -> anyhow::Result<String> {
    casfs::checkpoint::refs::thread_or_at(thread, at)
        .ok_or_else(|| anyhow!("{command} needs --thread T (its head) or --at CHECKPOINT"))
}

/// Resolves `@thread`, a hex id or prefix, each optionally followed by `~N`.
pub(crate) fn resolve(store: &Store, r: &str) -> anyhow::Result<CheckpointId> {
    Ok(casfs::checkpoint::refs::resolve(store.checkpoints(), r)?)
}

fn parse_mode(s: &str) -> Result<casfs::mount::MountMode, String> {
    s.parse()
}

/// A socket's permission bits in octal (`0660`, `660`): read and write bits only.
fn parse_socket_mode(s: &str) -> Result<u32, String> {
    let bad = || format!("{s:?}: give the permission bits in octal, like 0600 or 0660");
    let m = u32::from_str_radix(s.strip_prefix("0o").unwrap_or(s), 8).map_err(|_| bad())?;
    if m > 0o777 || m & 0o111 != 0 || m & 0o600 != 0o600 {
        return Err(format!(
            "{s:?}: a socket's mode gives read and write (6) to its owner at least, and no \
             execute bits (0600, 0660, 0666)"
        ));
    }
    Ok(m)
}

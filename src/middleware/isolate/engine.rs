//! The engine that isolates: bubblewrap (`bwrap`, Debian's `bubblewrap`), as Flatpak
//! and several coding-agent CLIs use it. casfs writes no namespace code of its own for
//! a sandbox: it hands bubblewrap the sandbox's workspace, its filter and its init, and
//! bubblewrap makes the namespaces and the root.
//!
//! What a sandbox sees (docs/middleware.md, "Sandboxes that isolate"):
//! - its own user, mount, pid, ipc, uts and cgroup namespaces, and its own network
//!   namespace with only loopback unless the host's network was asked for;
//! - a root of its own on a tmpfs: the host's `/usr` (with the merged-usr links `/bin`,
//!   `/lib`, `/lib64`, `/sbin`) and a few files of `/etc` (dynamic linker cache,
//!   certificates, time zone, name service switch) read-only, a `/etc/passwd` and
//!   `/etc/group` naming only its own user, a fresh `/proc`, a minimal `/dev`, a private
//!   `/tmp` of bounded size, and the workspace at `/workspace`, the only other place it
//!   may write. Nothing of `/root`, `/home`, `/run`, `/var`, the store, the server's
//!   socket or another sandbox is there to be reached;
//! - an unprivileged uid (its owner's; never 0), no capability, `no_new_privs`, the
//!   filter of [`super::seccomp`], its own session (no terminal of the host's), no
//!   further user namespace, and only the environment the server gave it.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};

use super::init::CONTROL_FD;
use super::limits::Group;
use super::seccomp;

/// A sandbox's network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Network {
    /// A network namespace of its own with only loopback: nothing outside is reached.
    None,
    /// The host's network (and its `/etc/resolv.conf`): no network isolation.
    Host,
}

/// What one sandbox is started with.
pub struct Spec<'a> {
    /// The workspace on the host (mounted at `/workspace` inside).
    pub workspace: &'a Path,
    /// Who its processes are: never root.
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (none but what it needs to reach the workspace).
    pub groups: Vec<u32>,
    pub network: Network,
    /// Bytes of its private `/tmp`.
    pub tmp_bytes: u64,
}

/// A started sandbox: bubblewrap (the sandbox's outside pid) and the server's end of
/// the init's control socket.
pub struct Started {
    pub child: Child,
    pub control: OwnedFd,
}

/// Where bubblewrap is: `$CASFS_BWRAP`, else `bwrap` in the usual places.
pub fn bwrap() -> io::Result<PathBuf> {
    if let Some(p) = std::env::var_os("CASFS_BWRAP") {
        return Ok(PathBuf::from(p));
    }
    ["/usr/bin/bwrap", "/usr/local/bin/bwrap", "/bin/bwrap"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "sandboxes that isolate need bubblewrap (bwrap), which is not installed \
                 (Debian: apt-get install bubblewrap)",
            )
        })
}

/// Read-only files of the host's `/etc` a program commonly needs; none names a user
/// or holds a secret.
const ETC: &[&str] = &[
    "/etc/alternatives",
    "/etc/ca-certificates",
    "/etc/ca-certificates.conf",
    "/etc/debian_version",
    "/etc/host.conf",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/mime.types",
    "/etc/nsswitch.conf",
    "/etc/os-release",
    "/etc/ssl",
];

/// The lowest number a descriptor to be given is kept at until the child moves it to
/// its own number (3 on): clear of every number the child is given.
const HIGH_FD: i32 = 64;

/// A descriptor at a number of at least [`HIGH_FD`].
fn high(fd: impl AsFd) -> io::Result<OwnedFd> {
    Ok(rustix::io::fcntl_dupfd_cloexec(fd, HIGH_FD)?)
}

/// Starts bubblewrap for `spec`, in `group` when given; its init runs `casfs
/// sandbox-init` from this very executable.
pub fn start(spec: &Spec<'_>, group: Option<&Group>) -> io::Result<Started> {
    if spec.uid == 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "a sandbox's processes are never root",
        ));
    }
    let bwrap = bwrap()?;
    let (ours, theirs) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let programs = seccomp::programs()?;
    let exe = std::fs::File::open("/proc/self/exe")?;
    // The workspace's own mountpoint, under the sandboxes' directory and the gate the
    // provider made (the server's directories): bubblewrap binds it by this path.
    let ws = crate::checkpoint::dirfd::open_dir_path(spec.workspace)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", spec.workspace.display())))?;
    let passwd = format!(
        "root:x:0:0:root:/root:/usr/sbin/nologin\n\
         sandbox:x:{}:{}:sandbox:/workspace:/bin/sh\n\
         nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        spec.uid, spec.gid
    );
    let group_file = format!("root:x:0:\nsandbox:x:{}:\nnogroup:x:65534:\n", spec.gid);
    // Each descriptor the child gets, at the number it gets it as.
    let mut given: Vec<(OwnedFd, RawFd)> = vec![(high(&theirs)?, CONTROL_FD)];
    drop(theirs);
    let mut next = CONTROL_FD + 1;
    let mut give = |fd: OwnedFd, given: &mut Vec<(OwnedFd, RawFd)>| -> io::Result<RawFd> {
        let n = next;
        next += 1;
        given.push((high(&fd)?, n));
        Ok(n)
    };
    let mut args: Vec<String> = Vec::new();
    let mut arg = |a: &[&str]| args.extend(a.iter().map(|s| s.to_string()));
    arg(&["--unshare-all", "--unshare-user", "--disable-userns"]);
    if spec.network == Network::Host {
        arg(&[
            "--share-net",
            "--ro-bind-try",
            "/etc/resolv.conf",
            "/etc/resolv.conf",
        ]);
        arg(&["--ro-bind-try", "/etc/hosts", "/etc/hosts"]);
    }
    // No --die-with-parent: its parent-death signal follows the thread that started
    // bubblewrap, not the server. The sandbox ends when its init's socket closes (the
    // server ended it, or the server is gone), and its control group is killed.
    arg(&["--new-session", "--hostname", "sandbox"]);
    arg(&["--cap-drop", "ALL"]);
    arg(&["--ro-bind", "/usr", "/usr"]);
    for l in ["bin", "lib", "lib64", "sbin", "lib32", "libx32"] {
        let host = Path::new("/").join(l);
        match std::fs::read_link(&host) {
            Ok(to) => arg(&["--symlink", &to.to_string_lossy(), &format!("/{l}")]),
            Err(_) if host.is_dir() => arg(&["--ro-bind", &format!("/{l}"), &format!("/{l}")]),
            Err(_) => {}
        }
    }
    for e in ETC {
        arg(&["--ro-bind-try", e, e]);
    }
    let pw = give(super::data_fd("passwd", passwd.as_bytes())?, &mut given)?;
    let gr = give(super::data_fd("group", group_file.as_bytes())?, &mut given)?;
    arg(&["--ro-bind-data", &pw.to_string(), "/etc/passwd"]);
    arg(&["--ro-bind-data", &gr.to_string(), "/etc/group"]);
    arg(&["--proc", "/proc", "--dev", "/dev"]);
    arg(&[
        "--size",
        &spec.tmp_bytes.to_string(),
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
    ]);
    let w = give(ws, &mut given)?;
    arg(&["--bind-fd", &w.to_string(), "/workspace"]);
    let x = give(OwnedFd::from(exe), &mut given)?;
    arg(&["--ro-bind-fd", &x.to_string(), "/.casfs-init"]);
    for p in &programs {
        let s = give(seccomp::to_fd(p)?, &mut given)?;
        arg(&["--add-seccomp-fd", &s.to_string()]);
    }
    // Everything but /workspace, /tmp and /dev's own mounts is read-only, the new
    // root included.
    arg(&["--remount-ro", "/"]);
    arg(&["--chdir", "/workspace", "--clearenv"]);
    arg(&["--", "/.casfs-init", "sandbox-init"]);

    let mut cmd = Command::new(&bwrap);
    cmd.args(&args)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let plan: Vec<(RawFd, RawFd)> = given.iter().map(|(f, n)| (f.as_raw_fd(), *n)).collect();
    assert!(
        CONTROL_FD + (plan.len() as i32) < HIGH_FD,
        "a descriptor to give would be moved onto another"
    );
    let first_free = (CONTROL_FD + plan.len() as i32) as u32;
    let procs: Vec<RawFd> = group
        .map(|g| g.procs().iter().map(|f| f.as_raw_fd()).collect())
        .unwrap_or_default();
    let switch = rustix::process::getuid().is_root();
    let (uid, gid) = (spec.uid, spec.gid);
    let groups: Vec<libc::gid_t> = spec.groups.clone();
    let zero = CString::new("0").expect("no NUL");
    // SAFETY: between fork and exec only async-signal-safe calls are made (write,
    // dup2, close_range, setgroups, setgid, setuid), on memory prepared before the
    // fork.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &procs {
                if libc::write(fd, zero.as_ptr().cast(), 1) != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            for &(from, to) in &plan {
                if libc::dup2(from, to) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            // Nothing else of the server's reaches bubblewrap.
            libc::syscall(libc::SYS_close_range, first_free, u32::MAX, 0);
            if switch
                && (libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0)
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("starting {}: {e}", bwrap.display())))?;
    drop(given);
    Ok(Started {
        child,
        control: ours,
    })
}

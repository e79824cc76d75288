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

use crate::sys::Locked;
use std::io;
use std::os::fd::{AsFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Child;

use super::init::{init_exe, CONTROL_FD};
use super::limits::Group;
use super::memfile::data_fd;
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
    /// The workspace on the host (mounted at `/workspace` inside); none for a sandbox
    /// booted ahead of its workspace (a root server's: [`Stage::attach`] brings it).
    pub workspace: Option<&'a Path>,
    /// Who its processes are: never root.
    pub uid: u32,
    pub gid: u32,
    pub network: Network,
    /// Bytes of its private `/tmp`.
    pub tmp_bytes: u64,
}

/// A started sandbox: bubblewrap (the sandbox's outside pid) and the server's end of
/// the init's control socket.
pub struct Started {
    pub child: Child,
    /// What bubblewrap binds from, until the sandbox's init runs (then dropped).
    pub stage: Option<Stage>,
    /// Its control group (none where the server may make none).
    pub group: Option<Group>,
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

/// Where a root server stages what bubblewrap binds: a directory of root's that every
/// user may pass but not list (0711), and none but root writes.
const STAGE_ROOT: &str = "/run/casfs-stage";

/// Copies of a sandbox's workspace mount and of the casfs executable, attached under
/// [`STAGE_ROOT`] for bubblewrap to bind by path (as the sandbox's user), in a
/// directory that is a gate only that user passes (0700, root's, an ACL entry for the
/// user; [`crate::fs::gate_directory`]): the copy of the workspace is not behind the
/// sandbox's own gate, so no one else may reach it, even for the moment it is there.
/// Dropped once the sandbox's init runs (bubblewrap has its own copies by then):
/// detached and removed. What a server that died left there is swept by the next
/// one's stage.
///
/// A sandbox booted ahead of its workspace ([`super::warm`]) is staged with an empty
/// *slot* where the workspace goes: a tmpfs of its own, in a peer group of its own
/// (shared propagation), that bubblewrap binds at `/workspace` as a slave of it (the
/// technique of `systemd-nspawn`'s propagation directory). [`Stage::attach`] later
/// mounts the workspace on the slot, the kernel propagates that mount into the
/// sandbox's namespace (locked there: its processes cannot unmount it to see what is
/// beneath), and the slot is made private before the stage is cleared, so that its
/// removal on the host does not propagate. Propagation goes one way only: nothing
/// mounted inside a sandbox reaches the host. [`STAGE_ROOT`] is a private mount, so
/// that no stage propagates to the host's other namespaces.
pub struct Stage {
    root: OwnedFd,
    name: String,
    /// The root of the slot's mount (a stage without its workspace), until attached.
    slot: Option<OwnedFd>,
}

impl Stage {
    fn make(ws: Option<&OwnedFd>, exe: &OwnedFd, uid: u32) -> io::Result<Stage> {
        use rustix::fs::{mkdirat, openat, Mode, OFlags, CWD};
        use rustix::mount::{move_mount, open_tree, MoveMountFlags, OpenTreeFlags};
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let named = |what: &str, e: rustix::io::Errno| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!("staging a sandbox's {what} under {STAGE_ROOT}: {e}"),
            )
        };
        match mkdirat(CWD, STAGE_ROOT, Mode::from_raw_mode(0o711)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(named("directory", e)),
        }
        let root = private_root().map_err(|e| {
            io::Error::new(e.kind(), format!("{STAGE_ROOT} as a private mount: {e}"))
        })?;
        let st = rustix::fs::fstat(&root).map_err(|e| named("directory", e))?;
        if st.st_uid != 0 || st.st_mode & 0o022 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{STAGE_ROOT} is not root's alone: refused as a stage"),
            ));
        }
        // Passed, never listed.
        if st.st_mode & 0o777 != 0o711 {
            rustix::fs::fchmod(&root, Mode::from_raw_mode(0o711))
                .map_err(|e| named("directory", e))?;
        }
        Self::sweep(&root);
        // Named by the server (its pid and start time: a later process with its pid is
        // another server) and a count.
        let me = std::process::id();
        let name = format!(
            "{me}.{}-{}",
            start_time(me).unwrap_or(0),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        // A stage of this name left by a server that died with this pid and start time
        // cannot be (the start time differs), but clear one anyway.
        Self::clear(&root, &name);
        mkdirat(&root, name.as_str(), Mode::from_raw_mode(0o700))
            .map_err(|e| named("directory", e))?;
        let mut stage = Stage {
            root,
            name,
            slot: None,
        };
        let dir = openat(
            &stage.root,
            stage.name.as_str(),
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| named("directory", e))?;
        crate::fs::gate_directory(dir.as_fd(), Some(uid)).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("the gate of a sandbox's stage under {STAGE_ROOT}: {e}"),
            )
        })?;
        mkdirat(&dir, "workspace", Mode::from_raw_mode(0o755))
            .map_err(|e| named("workspace", e))?;
        drop(
            openat(
                &dir,
                "init",
                OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            )
            .map_err(|e| named("init", e))?,
        );
        let clone = OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_EMPTY_PATH;
        let tree = match ws {
            Some(ws) => open_tree(ws, "", clone | OpenTreeFlags::AT_RECURSIVE),
            None => slot_mount(),
        }
        .map_err(|e| named("workspace", e))?;
        move_mount(
            &tree,
            "",
            &dir,
            "workspace",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(|e| named("workspace", e))?;
        if ws.is_none() {
            // Its root (the mount just made, on top there), and a peer group of its own.
            let slot = openat(
                &dir,
                "workspace",
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| named("slot", e))?;
            propagation(&slot, rustix::mount::MountPropagationFlags::SHARED)
                .map_err(|e| named("slot", e))?;
            stage.slot = Some(slot);
        }
        let tree = open_tree(exe, "", clone).map_err(|e| named("init", e))?;
        move_mount(
            &tree,
            "",
            &dir,
            "init",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(|e| named("init", e))?;
        Ok(stage)
    }

    /// Mounts workspace `ws` on the slot of a stage made without one: the kernel
    /// propagates it to the sandbox's `/workspace`. Then the slot is private (its
    /// removal with the stage does not reach the sandbox).
    pub fn attach(&mut self, ws: &OwnedFd) -> io::Result<()> {
        use rustix::mount::{move_mount, open_tree, MoveMountFlags, OpenTreeFlags};
        let slot = self.slot.take().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "a stage made with its workspace has no slot for one",
            )
        })?;
        let named = |what: &str, e: rustix::io::Errno| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!("{what} a sandbox's workspace under {STAGE_ROOT}: {e}"),
            )
        };
        let tree = open_tree(
            ws,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH
                | OpenTreeFlags::AT_RECURSIVE,
        )
        .map_err(|e| named("copying", e))?;
        // No set-id file nor device node of it counts inside, whatever the host's
        // mount says (bubblewrap's own binds are remounted so; this one arrives after).
        nosuid_nodev(&tree).map_err(|e| named("securing", e))?;
        // Onto the slot's own root, exactly (no path walked).
        move_mount(
            &tree,
            "",
            &slot,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(|e| named("mounting", e))?;
        propagation(&slot, rustix::mount::MountPropagationFlags::PRIVATE)
            .map_err(|e| named("making private the slot of", e))?;
        Ok(())
    }

    /// The path of `entry` of this stage.
    fn path(&self, entry: &str) -> String {
        format!("{STAGE_ROOT}/{}/{entry}", self.name)
    }

    /// Detaches and removes stage `name` (in `root`, [`STAGE_ROOT`]).
    fn clear(root: &OwnedFd, name: &str) {
        use rustix::fs::{openat, unlinkat, AtFlags, Mode, OFlags};
        // The workspace, on the slot it may have: each mount there, top first.
        for entry in ["workspace", "workspace", "init"] {
            let _ = rustix::mount::unmount(
                format!("{STAGE_ROOT}/{name}/{entry}"),
                rustix::mount::UnmountFlags::DETACH | rustix::mount::UnmountFlags::NOFOLLOW,
            );
        }
        let flags = OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC;
        if let Ok(dir) = openat(root, name, flags, Mode::empty()) {
            let _ = unlinkat(&dir, "init", AtFlags::empty());
            let _ = unlinkat(&dir, "workspace", AtFlags::REMOVEDIR);
        }
        let _ = unlinkat(root, name, AtFlags::REMOVEDIR);
    }

    /// Clears the stages of servers that are gone.
    fn sweep(root: &OwnedFd) {
        let Ok(dir) = rustix::fs::Dir::read_from(root) else {
            return;
        };
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some((pid, started)) = name
                .split_once('-')
                .and_then(|(p, _)| p.split_once('.'))
                .and_then(|(p, t)| Some((p.parse::<u32>().ok()?, t.parse::<u64>().ok()?)))
            else {
                // Not a stage's name (or an earlier version's): its server is gone.
                Self::clear(root, &name);
                continue;
            };
            // Its server is gone, or the pid is another process's now.
            if start_time(pid) != Some(started) {
                Self::clear(root, &name);
            }
        }
    }
}

/// A slot for a workspace: an empty file system of its own (a tmpfs of one page,
/// root's, 0755), detached. Not a directory of the stage bound on itself: the
/// workspace is mounted on the slot's root, in the sandbox too, and the kernel
/// detaches every mount on a directory that is removed (the stage's, once cleared);
/// no one can remove a file system's root.
fn slot_mount() -> rustix::io::Result<OwnedFd> {
    use rustix::mount::{
        fsconfig_create, fsconfig_set_string, fsmount, fsopen, FsMountFlags, FsOpenFlags,
        MountAttrFlags,
    };
    let fs = fsopen("tmpfs", FsOpenFlags::FSOPEN_CLOEXEC)?;
    fsconfig_set_string(&fs, "size", "4k")?;
    fsconfig_set_string(&fs, "nr_inodes", "4")?;
    fsconfig_set_string(&fs, "mode", "0755")?;
    fsconfig_create(&fs)?;
    fsmount(
        &fs,
        FsMountFlags::FSMOUNT_CLOEXEC,
        MountAttrFlags::MOUNT_ATTR_NOSUID
            | MountAttrFlags::MOUNT_ATTR_NODEV
            | MountAttrFlags::MOUNT_ATTR_NOEXEC,
    )
}

/// [`STAGE_ROOT`], made once a private mount of its own (bound on itself) if it is not
/// one: what is mounted under it propagates to no other namespace of the host.
fn private_root() -> io::Result<OwnedFd> {
    use rustix::fs::{openat, statx, AtFlags, Mode, OFlags, StatxAttributes, StatxFlags, CWD};
    use rustix::mount::{move_mount, open_tree, MoveMountFlags, OpenTreeFlags};
    static PRIVATE: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    let open = || {
        openat(
            CWD,
            STAGE_ROOT,
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
    };
    let mut done = PRIVATE.locked();
    let root = open()?;
    if *done {
        return Ok(root);
    }
    let st = statx(&root, "", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)?;
    let mounted = if st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT) {
        st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT)
    } else {
        // A kernel before 5.8: this namespace's mount table says.
        std::fs::read("/proc/self/mountinfo").is_ok_and(|t| {
            t.split(|b| *b == b'\n')
                .any(|l| l.split(|b| *b == b' ').nth(4) == Some(STAGE_ROOT.as_bytes()))
        })
    };
    let root = if mounted {
        root
    } else {
        // What dead servers staged there goes first; what live ones (of an earlier
        // version) staged comes along into the new mount.
        Stage::sweep(&root);
        let tree = open_tree(
            &root,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH
                | OpenTreeFlags::AT_RECURSIVE,
        )?;
        move_mount(
            &tree,
            "",
            &root,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )?;
        drop(root);
        // The mount just made, on top.
        open()?
    };
    propagation(&root, rustix::mount::MountPropagationFlags::PRIVATE)?;
    *done = true;
    Ok(root)
}

/// Makes the detached mount `tree` and every mount under it `nosuid,nodev`.
fn nosuid_nodev(tree: &OwnedFd) -> rustix::io::Result<()> {
    use crate::sys::mount_attr::{set_recursive, NODEV, NOSUID};
    set_recursive(tree.as_fd(), NOSUID | NODEV)
}

/// Sets the propagation of exactly the mount whose root `dir` is (through its
/// descriptor's magic link, which names that mount even where another is on top).
fn propagation(
    dir: &OwnedFd,
    flags: rustix::mount::MountPropagationFlags,
) -> rustix::io::Result<()> {
    use std::os::fd::AsRawFd;
    rustix::mount::mount_change(format!("/proc/self/fd/{}", dir.as_raw_fd()), flags)
}

/// When process `pid` started (clock ticks after boot, `/proc/<pid>/stat`'s 22nd field).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command in parentheses (which may hold spaces and parentheses).
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Drop for Stage {
    fn drop(&mut self) {
        Self::clear(&self.root, &self.name);
    }
}

/// The lowest number a descriptor to be given is kept at until the child moves it to
/// its own number (3 on): clear of every number the child is given.
const HIGH_FD: i32 = 64;

/// A descriptor at a number of at least [`HIGH_FD`].
fn high(fd: impl AsFd) -> io::Result<OwnedFd> {
    Ok(rustix::io::fcntl_dupfd_cloexec(fd, HIGH_FD)?)
}

/// Starts bubblewrap for `spec`, in `group` when given; its init is [`init_exe`]'s.
pub(super) fn start(spec: &Spec<'_>, spare: super::spare::Spare) -> io::Result<Started> {
    if spec.uid == 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "a sandbox's processes are never root",
        ));
    }
    let bwrap = bwrap()?;
    let (ours, theirs) = super::wire::pair()?;
    let programs = seccomp::programs()?;
    let exe = init_exe()?;
    // The workspace's own mountpoint, under the sandboxes' directory and the gate the
    // provider made (the server's directories): bubblewrap binds it by this path.
    let ws = spec
        .workspace
        .map(|w| {
            crate::sys::dirfd::open_dir_path(w)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", w.display())))
        })
        .transpose()?;
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
    let pw = give(data_fd("passwd", passwd.as_bytes())?, &mut given)?;
    let gr = give(data_fd("group", group_file.as_bytes())?, &mut given)?;
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
    // A server run by root starts bubblewrap as the sandbox's user, who need not be able
    // to pass the directories above the workspace (bubblewrap resolves what it binds by
    // path, as that user): copies of the workspace's mount and of the init are staged
    // where that user passes ([`Stage`]) until the sandbox's init runs; or, for a sandbox
    // booted ahead of its workspace, the slot its workspace is mounted on later.
    let stage = if rustix::process::getuid().is_root() {
        let st = Stage::make(ws.as_ref(), &OwnedFd::from(exe), spec.uid)?;
        arg(&["--bind", &st.path("workspace"), "/workspace"]);
        arg(&["--ro-bind", &st.path("init"), "/.casfs-init"]);
        drop(ws);
        Some(st)
    } else {
        let ws = ws.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "a server that is not root starts a sandbox with its workspace",
            )
        })?;
        let w = give(ws, &mut given)?;
        arg(&["--bind-fd", &w.to_string(), "/workspace"]);
        let x = give(OwnedFd::from(exe), &mut given)?;
        arg(&["--ro-bind-fd", &x.to_string(), "/.casfs-init"]);
        None
    };
    for p in &programs {
        let s = give(seccomp::to_fd(p)?, &mut given)?;
        arg(&["--add-seccomp-fd", &s.to_string()]);
    }
    // Everything but /workspace, /tmp and /dev's own mounts is read-only, the new
    // root included.
    arg(&["--remount-ro", "/"]);
    arg(&["--chdir", "/workspace", "--clearenv"]);
    arg(&["--", "/.casfs-init", "sandbox-init"]);

    assert!(
        CONTROL_FD + (given.len() as i32) < HIGH_FD,
        "a descriptor to give would be moved onto another"
    );
    // The spare becomes bubblewrap: the descriptors at their numbers, nothing else of
    // the server's, and (a root server's) only the sandbox's user, with no group of
    // root's nor of anyone's.
    let launch = super::spare::Launch {
        bwrap: bwrap.to_string_lossy().into_owned(),
        args,
        user: stage.is_some().then_some((spec.uid, spec.gid)),
        targets: given.iter().map(|(_, n)| *n).collect(),
    };
    let fds: Vec<_> = given.iter().map(|(f, _)| f.as_fd()).collect();
    let (child, group) = spare.launch(&launch, &fds)?;
    drop(fds);
    drop(given);
    Ok(Started {
        child,
        control: ours,
        stage,
        group,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// The copy of a workspace staged for bubblewrap is behind a gate of its own that
    /// only the sandbox's user passes; the stages' directory is passed, never listed;
    /// a dropped stage leaves nothing.
    #[test]
    fn a_stage_is_a_gate_only_its_user_passes() {
        if !rustix::process::getuid().is_root() {
            eprintln!("skipped: a stage is a root server's");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("secret.txt"), "theirs").unwrap();
        let ws = crate::sys::dirfd::open_dir_path(t.path()).unwrap();
        let exe = OwnedFd::from(std::fs::File::open("/proc/self/exe").unwrap());
        let stage = Stage::make(Some(&ws), &exe, 4242).unwrap();
        let root = std::fs::metadata(STAGE_ROOT).unwrap();
        assert_eq!((root.uid(), root.mode() & 0o777), (0, 0o711));
        let dir = Path::new(STAGE_ROOT).join(&stage.name);
        let gate = std::fs::metadata(&dir).unwrap();
        // 0700 and the ACL, whose mask (`--x`) shows as the group's bits.
        assert_eq!((gate.uid(), gate.mode() & 0o777), (0, 0o710));
        let acl = std::process::Command::new("getfacl")
            .args(["-n", "-p"])
            .arg(&dir)
            .output()
            .unwrap();
        let acl = String::from_utf8_lossy(&acl.stdout);
        assert!(acl.contains("user:4242:--x"), "{acl}");
        assert!(
            !acl.lines()
                .any(|l| l.starts_with("other::") && l != "other::---"),
            "{acl}"
        );
        assert_eq!(
            std::fs::read_to_string(Path::new(&stage.path("workspace")).join("secret.txt"))
                .unwrap(),
            "theirs"
        );
        drop(stage);
        assert!(!dir.exists(), "a dropped stage is removed");
    }
}

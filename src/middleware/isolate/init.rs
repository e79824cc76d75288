//! The init of a sandbox (`casfs sandbox-init`): the first program bubblewrap starts in
//! it, already inside every namespace, limit and filter of the sandbox, with its
//! unprivileged uid and no capability. It starts the processes the server asks for
//! (each leading a process group of its own, its standard streams the descriptors the
//! server passed) and reports each one's start and end. When the server's end of its
//! socket closes (the sandbox ends, or the server went away) it returns, and with it
//! bubblewrap's pid 1: the kernel then kills every process left in the sandbox's pid
//! namespace.
//!
//! Single-threaded and blocking: one `poll` over the socket and a pidfd per child.
//!
//! Which executable is that init, for bubblewrap and the spare process: [`init_exe`].

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use rustix::event::{poll, PollFd, PollFlags};
use rustix::process::{pidfd_open, Pid, PidfdFlags};

use super::wire::{self, Event, Request};

/// The descriptor the control socket has in the init.
pub const CONTROL_FD: i32 = 3;

struct Running {
    child: Child,
    pidfd: OwnedFd,
}

/// Runs the init on the control socket at [`CONTROL_FD`] until the server closes it.
pub fn run() -> io::Result<()> {
    // The socket bubblewrap passed on at CONTROL_FD is this process's from here on;
    // whatever else was inherited is not the sandbox's processes' to have (closed).
    let sock = crate::sys::process::take_inherited(CONTROL_FD)?;
    rustix::io::fcntl_setfd(&sock, rustix::io::FdFlags::CLOEXEC)?;
    // Not dumpable: the sandbox's processes (its uid) cannot open its /proc files (its
    // memory, its descriptors: the control socket).
    let _ = rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable);
    // The server makes the sandbox's proxy in its network namespace (`proxy`), and
    // looks among the processes of its pid namespace for files they keep open for
    // writing (`crate::mount::MountedThread::writers_in`).
    let ns = |name: &str| {
        use rustix::fs::{Mode, OFlags};
        let own_ns = format!("/proc/self/ns/{name}");
        rustix::fs::open(own_ns, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
    };
    let (netns, pidns) = (ns("net")?, ns("pid")?);
    wire::send(sock.as_fd(), &Event::Ready, &[netns.as_fd(), pidns.as_fd()])?;
    drop((netns, pidns));
    let mut running: HashMap<u64, Running> = HashMap::new();
    // Every group ever started: a kill reaches what a process left behind after it ended.
    let mut groups: HashMap<u64, i32> = HashMap::new();
    let mut buf = Vec::new();
    loop {
        let ids: Vec<u64> = running.keys().copied().collect();
        let mut fds = Vec::with_capacity(ids.len() + 1);
        fds.push(PollFd::new(&sock, PollFlags::IN));
        for id in &ids {
            fds.push(PollFd::new(&running[id].pidfd, PollFlags::IN));
        }
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
        drop(fds);
        for (i, id) in ids.iter().enumerate() {
            if ready[i + 1] {
                let mut r = running.remove(id).expect("a running child");
                let code = match r.child.wait() {
                    Ok(st) => st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(1)),
                    Err(_) => 128 + libc::SIGKILL,
                };
                wire::send(sock.as_fd(), &Event::Exited { id: *id, code }, &[])?;
            }
        }
        if ready[0] {
            match wire::recv::<Request>(sock.as_fd(), &mut buf)? {
                None => return Ok(()),
                Some((req, fds)) => handle(sock.as_fd(), req, fds, &mut running, &mut groups)?,
            }
        }
    }
}

fn handle(
    sock: BorrowedFd<'_>,
    req: Request,
    fds: Vec<OwnedFd>,
    running: &mut HashMap<u64, Running>,
    groups: &mut HashMap<u64, i32>,
) -> io::Result<()> {
    match req {
        Request::Spawn { id, argv, cwd, env } => {
            let ev = match spawn(argv, cwd, env, fds) {
                Ok(r) => {
                    let pid = r.child.id() as i32;
                    running.insert(id, r);
                    groups.insert(id, pid);
                    Event::Started { id, pid }
                }
                Err(e) => Event::Failed {
                    id,
                    error: e.to_string(),
                },
            };
            wire::send(sock, &ev, &[])
        }
        Request::Kill { id, signal } => {
            if let Some(&pgid) = groups.get(&id) {
                let _ = crate::sys::signal::send_to_group(pgid, signal);
            }
            Ok(())
        }
    }
}

fn spawn(
    argv: Vec<String>,
    cwd: String,
    env: Vec<(String, String)>,
    fds: Vec<OwnedFd>,
) -> io::Result<Running> {
    let [stdin, stdout, stderr]: [OwnedFd; 3] = fds.try_into().map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a spawn without its three streams",
        )
    })?;
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "an empty command"))?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .envs(env)
        .current_dir(&cwd)
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr))
        .process_group(0);
    let child = cmd
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("{program:?} in {cwd:?}: {e}")))?;
    let pidfd = pidfd_open(
        Pid::from_raw(child.id() as i32).expect("a child's pid"),
        PidfdFlags::empty(),
    )?;
    Ok(Running { child, pidfd })
}

/// Where the Debian package installs `casfs-sandbox-init` for its `/usr/bin/casfs`.
const INIT_INSTALLED: &str = "/usr/libexec/casfs/casfs-sandbox-init";

/// The sandbox's init: `casfs-sandbox-init`, a small executable that starts in a
/// fraction of `casfs`'s time (it links neither RocksDB nor libstdc++), of the same
/// build as the server: beside its executable (or, for the package's `/usr/bin/casfs`,
/// in `/usr/libexec/casfs`). Taken only when it is a regular file (no link followed)
/// of root's or the server's user that no one else may write, so that a server run
/// from a directory others write into (`/tmp`) never runs their file; else this very
/// executable (`casfs sandbox-init`). Its directory too must be root's or the
/// server's user's and written by no one else (the spare process runs it as the
/// server's user, on the host).
pub(super) fn init_exe() -> io::Result<std::fs::File> {
    use std::os::unix::prelude::OpenOptionsExt;
    let exe = std::fs::read_link("/proc/self/exe").ok();
    let dir = exe.as_deref().and_then(Path::parent);
    let init = match dir {
        Some(d) if d == Path::new("/usr/bin") => Some(PathBuf::from(INIT_INSTALLED)),
        Some(d) => Some(d.join("casfs-sandbox-init")),
        None => None,
    };
    if let Some(p) = init {
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&p);
        if let Ok(f) = opened {
            let euid = rustix::process::geteuid().as_raw();
            // The file, and the directory it is in (the spare runs it as the server's
            // user: no one else may put another file under its name).
            let dir_ok = p.parent().is_some_and(|d| {
                rustix::fs::lstat(d).is_ok_and(|st| {
                    (st.st_uid == 0 || st.st_uid == euid) && st.st_mode & 0o022 == 0
                })
            });
            let ok = dir_ok
                && rustix::fs::fstat(&f).is_ok_and(|st| {
                    rustix::fs::FileType::from_raw_mode(st.st_mode)
                        == rustix::fs::FileType::RegularFile
                        && (st.st_uid == 0 || st.st_uid == euid)
                        && st.st_mode & 0o022 == 0
                });
            if ok {
                return Ok(f);
            }
            tracing::warn!(
                "{}: not a regular file of root's or ours that only its owner writes; \
                 sandboxes start this executable as their init instead",
                p.display()
            );
        }
    }
    std::fs::File::open("/proc/self/exe")
}

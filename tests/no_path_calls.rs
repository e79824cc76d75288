//! Boundary 1 (paths): the modules that touch a tree a less trusted party changes (a
//! sandbox's workspace, an overlay's upper, a plain directory captured or restored
//! into) make no file system call by path there: everything goes through
//! `sys::dirfd`'s directory handles. This test reads their source and fails on
//! any call by path (`std::fs`, `File::open`, `OpenOptions`, the path-taking `libc`
//! calls, ...) that is not in the allowlist below, each entry saying why that one call
//! is safe; and on an allowlist entry that no longer matches anything.

use std::path::Path;

/// The modules of docs/architecture.md's list of every place the server touches a path
/// inside a workspace.
const MODULES: &[&str] = &[
    "src/checkpoint/sync/capture.rs",
    "src/checkpoint/sync/restore/mod.rs",
    "src/checkpoint/sync/restore/preflight.rs",
    "src/checkpoint/sync/restore/uncaptured.rs",
    "src/checkpoint/sync/dircache.rs",
    "src/sys/xattr.rs",
    "src/checkpoint/sync/watch.rs",
    "src/checkpoint/maintenance/mod.rs",
    "src/checkpoint/maintenance/fsck.rs",
    "src/sys/dirfd/mod.rs",
    "src/sys/dirfd/root.rs",
    "src/mount/overlay/upper/mod.rs",
    "src/mount/overlay/upper/status.rs",
    "src/mount/overlay/watch.rs",
    "src/mount/overlay/writers.rs",
    "src/middleware/events.rs",
    "src/middleware/dir_watch.rs",
    "src/middleware/secrets.rs",
    "src/middleware/publish.rs",
    "src/middleware/policy.rs",
    "src/middleware/provider/mod.rs",
    "src/middleware/provider/gate.rs",
    "src/middleware/provider/handle.rs",
    "src/middleware/provider/casfs.rs",
    "src/middleware/provider/dir.rs",
    "src/middleware/serve/files.rs",
    "src/middleware/serve/processes.rs",
    "src/middleware/isolate/mod.rs",
    "src/middleware/isolate/memfile.rs",
    "src/middleware/isolate/process.rs",
    "src/middleware/isolate/engine.rs",
    "src/middleware/isolate/limits.rs",
    "src/middleware/isolate/init.rs",
];

/// What a call by path looks like in the source.
const BY_PATH: &[&str] = &[
    "std::fs::",
    " fs::",
    "(fs::",
    "!fs::",
    "File::open",
    "File::create",
    "OpenOptions",
    "symlink_metadata",
    "read_link(",
    "read_dir(",
    "canonicalize(",
    "set_permissions",
    "lchown",
    ".chown(",
    ".exists()",
    ".metadata()",
    "list_dir_noatime(",
    "rustix::fs::open(",
    ".watch(",
    "libc::open(",
    "libc::openat(",
    "libc::stat(",
    "libc::lstat(",
    "libc::fstatat(",
    "libc::statfs(",
    "rustix::fs::statfs(",
    "rustix::fs::statvfs(",
    "libc::chmod(",
    "libc::fchmodat(",
    "libc::chown(",
    "libc::lchown(",
    "libc::fchownat(",
    "libc::unlink(",
    "libc::unlinkat(",
    "libc::rename(",
    "libc::renameat(",
    "libc::mkdir(",
    "libc::mkdirat(",
    "libc::mknod(",
    "libc::mknodat(",
    "libc::symlink(",
    "libc::symlinkat(",
    "libc::link(",
    "libc::readlink(",
    "libc::readlinkat(",
    "libc::utimensat(",
    "libc::utime",
    "libc::truncate(",
    "libc::access(",
    "libc::inotify_add_watch(",
    "libc::getxattr(",
    "libc::lgetxattr(",
    "libc::setxattr(",
    "libc::lsetxattr(",
    "libc::listxattr(",
    "libc::llistxattr(",
    "libc::removexattr(",
    "libc::lremovexattr(",
];

/// Every remaining call by path in those modules: (module, text of the line, why it is
/// safe).
const ALLOWED: &[(&str, &str, &str)] = &[
    (
        "src/middleware/isolate/memfile.rs",
        "let mut f = std::fs::File::from(fd);",
        "data_fd: a memory file's own descriptor (memfd_create), no path",
    ),
    (
        "src/middleware/isolate/engine.rs",
        ".find(|p| p.exists())",
        "where bubblewrap is installed: the host's /usr/bin and /usr/local/bin",
    ),
    (
        "src/middleware/isolate/init.rs",
        "fn init_exe() -> io::Result<std::fs::File> {",
        "the signature of the function that finds the sandbox's init (below)",
    ),
    (
        "src/middleware/isolate/init.rs",
        "let exe = std::fs::read_link(\"/proc/self/exe\").ok();",
        "the server's own executable's place, through its magic link: where its init is",
    ),
    (
        "src/middleware/isolate/init.rs",
        "use std::os::unix::prelude::OpenOptionsExt;",
        "the trait for the no-follow open of the sandbox's init (below)",
    ),
    (
        "src/middleware/isolate/init.rs",
        "let opened = std::fs::OpenOptions::new()",
        "the sandbox's init beside the server's executable (no link followed, owner and mode checked)",
    ),
    (
        "src/middleware/isolate/init.rs",
        "std::fs::File::open(\"/proc/self/exe\")",
        "the server's own executable (the sandbox's init where no casfs-sandbox-init is installed)",
    ),
    (
        "src/middleware/isolate/engine.rs",
        "std::fs::read(\"/proc/self/mountinfo\").is_ok_and(|t| {",
        "this process's own mount table (procfs), on kernels without STATX_ATTR_MOUNT_ROOT",
    ),
    (
        "src/middleware/isolate/engine.rs",
        "match std::fs::read_link(&host) {",
        "the host's /bin, /lib, ... (merged-usr links or not), never a workspace's",
    ),
    (
        "src/middleware/isolate/engine.rs",
        "let stat = std::fs::read_to_string(format!(\"/proc/{pid}/stat\")).ok()?;",
        "a process's start time, from procfs (which server a stage under /run is)",
    ),
    (
        "src/middleware/isolate/init.rs",
        "rustix::fs::open(own_ns,",
        "the init's own network and pid namespaces (/proc/self/ns/net and ns/pid, inside \
         the sandbox), for its proxy and the look for files its processes keep open",
    ),
    (
        "src/middleware/isolate/limits.rs",
        "if !v2 && PathBuf::from(\"/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes\").exists() {",
        "whether the host's cgroup v1 accounts swap: a file of the cgroup file system",
    ),
    (
        "src/middleware/isolate/limits.rs",
        "let f = std::fs::OpenOptions::new()",
        "the sandbox's own control group's cgroup.procs, which the server just made",
    ),
    (
        "src/checkpoint/sync/capture.rs",
        "let dir = fs::canonicalize(dir)",
        "the directory the caller names (the command line's, or a sandbox root the \
         provider made in its own directory): resolved once; everything below it through \
         handles",
    ),
    (
        "src/checkpoint/sync/restore/mod.rs",
        "use std::fs::{self, File};",
        "imports: `fs` for the destination's own path (below), `File` the type descriptors \
         are read and written as",
    ),
    (
        "src/checkpoint/sync/restore/mod.rs",
        "fs::create_dir_all(dest)",
        "the destination the caller names, made if missing: everything below it through \
         handles of directories the restore opened or made",
    ),
    (
        "src/checkpoint/sync/restore/mod.rs",
        "let dest = fs::canonicalize(dest)",
        "the same destination, resolved once to key its directory cache",
    ),
    (
        "src/checkpoint/sync/restore/uncaptured.rs",
        "let dir = match fs::canonicalize(dir)",
        "uncaptured_changes: the directory the caller names; below it through handles",
    ),
    (
        "src/sys/xattr.rs",
        "libc::llistxattr(c.as_ptr()",
        "/proc/self/fd/<dir>/<name> on a kernel without listxattrat: the descriptor pins \
         the directory, only the last name is looked up and not followed, and the entry is \
         checked to be the one opened",
    ),
    (
        "src/sys/xattr.rs",
        "libc::lgetxattr(",
        "the same /proc/self/fd/<dir>/<name> path",
    ),
    (
        "src/checkpoint/sync/watch.rs",
        "if !socket.exists() {",
        "the watcher's socket, in the store's own directory",
    ),
    (
        "src/checkpoint/sync/watch.rs",
        "let root = std::fs::canonicalize(root)?;",
        "the directory named on `casfs watch`'s command line (its user's own); below it \
         through handles",
    ),
    (
        "src/checkpoint/sync/watch.rs",
        "let sfs = rustix::fs::statfs(&root)?;",
        "the same root, for its filesystem type",
    ),
    (
        "src/checkpoint/sync/watch.rs",
        "std::fs::create_dir_all(dir)?;",
        "the store's own directory of watcher sockets",
    ),
    (
        "src/checkpoint/sync/watch.rs",
        "let _ = std::fs::remove_file(&self.0);",
        "the watcher's own socket, in the store's directory",
    ),
    (
        "src/checkpoint/maintenance/mod.rs",
        "std::fs::read_dir(dir)",
        "dir_bytes: the store's database directory, which only casfs writes",
    ),
    (
        "src/checkpoint/maintenance/mod.rs",
        ".filter_map(|e| e.metadata().ok())",
        "the same database directory's files",
    ),
    (
        "src/checkpoint/maintenance/fsck.rs",
        "if let Ok(rd) = std::fs::read_dir(&mounts_dir) {",
        "the store's mounts directory: names are keys casfs made; the uppers below are \
         walked through handles",
    ),
    (
        "src/checkpoint/maintenance/fsck.rs",
        "let Ok(rd) = std::fs::read_dir(crate::checkpoint::store::images_dir(store.root())) else {",
        "the store's EROFS images, which only casfs writes",
    ),
    (
        "src/checkpoint/maintenance/fsck.rs",
        "if repair && std::fs::remove_file(&path).is_ok() {",
        "an EROFS image in the store's images directory",
    ),
    (
        "src/sys/dirfd/mod.rs",
        "match rustix::fs::open(path, flags | OFlags::NOATIME, Mode::empty()) {",
        "open_dir_path_noatime: the same caller's own path",
    ),
    (
        "src/sys/dirfd/mod.rs",
        "Err(rustix::io::Errno::PERM) => rustix::fs::open(path, flags, Mode::empty()),",
        "the same, without O_NOATIME",
    ),
    (
        "src/sys/dirfd/mod.rs",
        "rustix::fs::open(",
        "open_dir_path: the one path the handles start from, the caller's own (a store \
         directory, a sandbox's root, a command line's directory); and /proc, checked to \
         be procfs",
    ),
    (
        "src/mount/overlay/writers.rs",
        "std::io::Read::read_to_end(&mut std::fs::File::from(f), &mut buf).ok()?;",
        "open_writers: a file of /proc/<pid> opened relative to its directory's descriptor",
    ),
    (
        "src/mount/overlay/writers.rs",
        "let mut maps_file = std::fs::File::from(maps_fd);",
        "/proc/<pid>/maps, opened relative to its directory's descriptor",
    ),
    (
        "src/middleware/provider/casfs.rs",
        "let _ = std::fs::create_dir_all(dir);",
        "the provider's own sandboxes directory",
    ),
    (
        "src/middleware/provider/casfs.rs",
        "let dir = std::fs::canonicalize(dir)",
        "the same directory, resolved once",
    ),
    (
        "src/middleware/provider/casfs.rs",
        "let _ = std::fs::remove_dir(self.mountpoint(key));",
        "an empty mountpoint in the provider's directory, once unmounted (rmdir follows \
         nothing and removes only an empty directory)",
    ),
    (
        "src/middleware/provider/casfs.rs",
        "let entries = match std::fs::read_dir(&self.dir) {",
        "the provider's own directory: the names of its sandboxes",
    ),
    (
        "src/middleware/provider/casfs.rs",
        "let _ = std::fs::remove_dir(&mp);",
        "an empty leftover mountpoint in the provider's directory",
    ),
    (
        "src/middleware/provider/dir.rs",
        "let root = std::fs::canonicalize(&root).map_err(err)?;",
        "the same root, just made",
    ),
    (
        "src/middleware/provider/dir.rs",
        "owner.chown(&root).map_err(err)?;",
        "that root, just made and still empty, given to its owner (lchown: not followed)",
    ),
    (
        "src/middleware/provider/dir.rs",
        "let Ok(entries) = std::fs::read_dir(&self.dir) else {",
        "the provider's own directory: the names of its sandboxes",
    ),
    (
        "src/middleware/provider/gate.rs",
        "use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};",
        "imports of the extension traits the gate is made with",
    ),
    (
        "src/middleware/provider/gate.rs",
        "match std::fs::DirBuilder::new().mode(0o700).create(gate) {",
        "a sandbox's gate, made in the provider's own directory (the server's: nobody \
         else can put anything there)",
    ),
    (
        "src/middleware/provider/gate.rs",
        "let dir = std::fs::OpenOptions::new()",
        "that gate, opened O_NOFOLLOW, its owner and ACL set through the descriptor",
    ),
    (
        "src/middleware/provider/gate.rs",
        "let m = dir.metadata().map_err(named)?;",
        "fstat of that descriptor",
    ),
    (
        "src/middleware/provider/gate.rs",
        "match std::fs::DirBuilder::new().mode(0o755).create(&ws) {",
        "the workspace directory inside the gate, which only the server may write",
    ),
    (
        "src/middleware/provider/casfs.rs",
        "let _ = std::fs::remove_dir(self.dir.join(key));",
        "an emptied gate in the provider's directory (rmdir follows nothing and removes \
         only an empty directory)",
    ),
    (
        "src/middleware/provider/dir.rs",
        "std::fs::create_dir_all(&self.dir).map_err(err)?;",
        "the provider's own sandboxes directory",
    ),
    (
        "src/checkpoint/sync/restore/mod.rs",
        "entry.chown(uid, gid).map_err(io)?;",
        "the entry just opened and checked to be the one restored, changed through its \
         descriptor",
    ),
];

/// Lines that name the `File` type only.
const TYPE_ONLY: &[&str] = &["use std::fs::File;"];

#[test]
fn no_module_that_touches_a_workspace_calls_the_file_system_by_path() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    let mut used = vec![false; ALLOWED.len()];
    for m in MODULES {
        let src = std::fs::read_to_string(root.join(m)).unwrap_or_else(|e| panic!("{m}: {e}"));
        for (n, line) in src.lines().enumerate() {
            // Unit tests work on their own temporary directories.
            if line.starts_with("#[cfg(test)]") {
                break;
            }
            let code = line.trim();
            if code.starts_with("//") || TYPE_ONLY.contains(&code) {
                continue;
            }
            // A call at the start of a line (`fs::create_dir_all(..)`) has a space before it
            // too.
            let padded = format!(" {code}");
            if !BY_PATH.iter().any(|p| padded.contains(p)) {
                continue;
            }
            match ALLOWED
                .iter()
                .position(|(f, text, _)| f == m && code.contains(text))
            {
                Some(i) => used[i] = true,
                None => found.push(format!("{m}:{}: {code}", n + 1)),
            }
        }
    }
    assert!(
        found.is_empty(),
        "calls by path in modules that touch workspaces (go through \
         sys::dirfd, or add the call to ALLOWED with why it is safe):\n{}",
        found.join("\n")
    );
    let stale: Vec<String> = ALLOWED
        .iter()
        .zip(&used)
        .filter(|(_, u)| !**u)
        .map(|((f, t, _), _)| format!("{f}: {t}"))
        .collect();
    assert!(
        stale.is_empty(),
        "allowlist entries that match nothing any more:\n{}",
        stale.join("\n")
    );
}

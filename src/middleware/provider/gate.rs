//! The gate of a sandbox: a directory of the server's own that only the sandbox's
//! owner may pass through, with the workspace's directory in it.

use std::path::{Path, PathBuf};

use crate::fs::Owner;

/// The workspace's name inside its sandbox's gate: a sandbox of key `k` is the
/// directory (or mount) `<sandboxes>/<k>/workspace`.
pub const WORKSPACE_DIR: &str = "workspace";

/// Makes (or takes back) the gate of a sandbox, `gate`: a directory of the server's
/// own, mode 0700, that only `owner` (when it is another user) may pass through, with
/// an empty directory `workspace` in it for the sandbox. Every sandbox sits behind one,
/// so a member of the socket's group reaches their own workspaces and no one else's,
/// whatever its mode (`/proc/self/mountinfo` names every mountpoint).
pub(super) fn make_gate(gate: &Path, owner: Owner) -> std::io::Result<PathBuf> {
    use std::os::fd::AsFd;
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    let named =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", gate.display()));
    match std::fs::DirBuilder::new().mode(0o700).create(gate) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(named(e)),
    }
    // The sandboxes directory is the server's: nobody else can have put a link here,
    // and O_NOFOLLOW makes sure.
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(gate)
        .map_err(named)?;
    let me = Owner::current();
    let m = dir.metadata().map_err(named)?;
    if m.uid() != me.uid {
        std::os::unix::fs::fchown(&dir, Some(me.uid), Some(me.gid)).map_err(named)?;
    }
    crate::fs::gate_directory(dir.as_fd(), owner.is_other().then_some(owner.uid)).map_err(named)?;
    let ws = gate.join(WORKSPACE_DIR);
    match std::fs::DirBuilder::new().mode(0o755).create(&ws) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(named(e)),
    }
    Ok(ws)
}

//! Who may use the Unix socket of `casfs serve`, and who is at the other end of each
//! connection. [`SocketAccess`]: the socket's permissions and group (0600 by default,
//! its owner only; 0660 with a group, such as the Debian package's `casfs`, lets that
//! group's members in without root). [`Peer`]: the credentials the kernel gives for
//! a connection (`SO_PEERCRED`), taken as it is accepted; a sandbox made on it (a run's
//! or one a client makes) is the caller's: the workspace's root and every file it did
//! not see made are theirs, and its mount lets them in ([`crate::fs::Owner`]), so a
//! member of the group who is not root can work in it.
//!
//! A connection over TCP has no credentials: its sandboxes are the server's user's.

use std::path::Path;
use std::sync::Arc;

use axum::extract::connect_info::ConnectInfo;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;

use crate::fs::Owner;

/// The Unix socket's permissions and group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketAccess {
    /// Permission bits (0600: the server's user only).
    pub mode: u32,
    /// The socket's group (None: the server's).
    pub group: Option<u32>,
}

impl Default for SocketAccess {
    fn default() -> SocketAccess {
        SocketAccess {
            mode: 0o600,
            group: None,
        }
    }
}

impl SocketAccess {
    /// Mode `mode`, group `group` (a name or a number; None: the server's).
    pub fn new(mode: u32, group: Option<&str>) -> Result<SocketAccess, String> {
        Ok(SocketAccess {
            mode,
            group: group.map(group_id).transpose()?,
        })
    }

    /// Binds the socket at `path` with these permissions (see [`crate::bind_socket`]).
    pub(super) fn bind(&self, path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
        crate::bind_socket(path, self.mode, self.group)
    }

    /// Opens `dir` (where sandboxes are mounted) to the socket's group: theirs, 0710,
    /// so that members pass through to the sandboxes made for them (each behind a gate
    /// only its owner passes) but cannot list whose there are. Without a group it is
    /// left as it is.
    pub fn open_to_group(&self, dir: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let Some(g) = self.group else {
            return Ok(());
        };
        let named =
            |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", dir.display()));
        std::os::unix::fs::chown(dir, None, Some(g)).map_err(named)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o710)).map_err(named)
    }
}

/// The id of group `name` (or `name` itself, a number).
pub fn group_id(name: &str) -> Result<u32, String> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(n);
    }
    let c = std::ffi::CString::new(name).map_err(|_| format!("group {name:?}: a NUL in it"))?;
    match crate::sys::users::group_id(&c) {
        Ok(Some(gid)) => Ok(gid),
        Ok(None) => Err(format!(
            "group {name:?}: no such group (create it: groupadd --system {name})"
        )),
        Err(e) => Err(format!("group {name:?}: {e}")),
    }
}

/// The process at the other end of a connection, as the kernel saw it connect (none
/// over TCP). A handler takes it as an argument; one served without connection info
/// (a router called directly) gets none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Peer {
    /// Set on the Unix socket, whether or not the kernel named the peer.
    unix: bool,
    owner: Option<Owner>,
    /// The peer's supplementary groups (`SO_PEERGROUPS`), sorted.
    groups: Arc<[u32]>,
}

impl Peer {
    /// The peer of a Unix connection (none if the kernel does not say).
    pub(super) fn of_unix(s: &tokio::net::UnixStream) -> Peer {
        let owner = match s.peer_cred() {
            Ok(c) => Some(Owner {
                uid: c.uid(),
                gid: c.gid(),
            }),
            Err(e) => {
                tracing::warn!("the peer of a connection: {e}");
                None
            }
        };
        let mut groups = peer_groups(s).unwrap_or_else(|e| {
            tracing::warn!("the groups of a connection's peer: {e}");
            Vec::new()
        });
        groups.sort_unstable();
        Peer {
            unix: true,
            owner,
            groups: groups.into(),
        }
    }

    /// A TCP connection's (no credentials).
    pub(super) fn tcp() -> Peer {
        Peer::default()
    }

    pub(super) fn is_unix(&self) -> bool {
        self.unix
    }

    /// The peer's user, as the kernel saw it connect.
    pub fn uid(&self) -> Option<u32> {
        self.owner.map(|o| o.uid)
    }

    /// The peer's primary group.
    pub fn gid(&self) -> Option<u32> {
        self.owner.map(|o| o.gid)
    }

    /// Whether the peer had group `g` among its supplementary groups.
    pub fn in_group(&self, g: u32) -> bool {
        self.groups.binary_search(&g).is_ok()
    }

    /// Whose a sandbox this peer makes is: the peer's, unless it is the server's own
    /// user (or unknown), whose sandboxes are the server's as always.
    pub fn owner(&self) -> Option<Owner> {
        let me = rustix::process::geteuid().as_raw();
        self.owner.filter(|o| o.uid != me)
    }
}

/// The supplementary groups of the process at the other end of `s` when it connected
/// (`SO_PEERGROUPS`, Linux 4.13 and later).
fn peer_groups(s: &tokio::net::UnixStream) -> std::io::Result<Vec<u32>> {
    use std::os::fd::AsFd;
    crate::sys::peer_cred::groups(s.as_fd())
}

impl<S: Send + Sync> FromRequestParts<S> for Peer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Peer, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<ConnectInfo<Peer>>()
            .map(|c| c.0.clone())
            .unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn groups_are_named_or_numbered_and_an_unknown_one_is_named() {
        assert_eq!(
            SocketAccess::new(0o660, Some("root")).unwrap().group,
            Some(0)
        );
        assert_eq!(
            SocketAccess::new(0o660, Some("4242")).unwrap().group,
            Some(4242)
        );
        assert_eq!(
            SocketAccess::new(0o600, None).unwrap(),
            SocketAccess::default()
        );
        let e = SocketAccess::new(0o660, Some("no-such-group-casfs")).unwrap_err();
        assert!(
            e.contains("\"no-such-group-casfs\"") && e.contains("no such group"),
            "{e}"
        );
    }

    #[test]
    fn the_socket_has_its_mode_and_group_when_it_appears() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("s.sock");
        // The process's own group: any user may give a file to it.
        let gid = crate::fs::Owner::current().gid;
        let a = SocketAccess::new(0o660, Some(&gid.to_string())).unwrap();
        let _l = a.bind(&path).unwrap();
        let m = std::fs::metadata(&path).unwrap();
        assert_eq!((m.permissions().mode() & 0o777, m.gid()), (0o660, gid));
        std::os::unix::net::UnixStream::connect(&path).unwrap();
        a.open_to_group(t.path()).unwrap();
        let m = std::fs::metadata(t.path()).unwrap();
        assert_eq!((m.permissions().mode() & 0o777, m.gid()), (0o710, gid));
    }
}

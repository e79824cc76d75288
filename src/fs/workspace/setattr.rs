//! The steps behind a `setattr`: mode, owner, size and times changed in one step of the
//! inode table, with the set-id bits and capabilities a change of owner or content
//! clears.

use fuser::{Errno, FileAttr, Request, TimeOrNow};

use super::events::FsEventKind;
use super::node::{fstat, io_errno, now_ns, set_file_times, time_ns, Body};
use super::ops::WorkspaceFs;
use super::table::sgid_goes;
use crate::fs::dirty::Kind;
use crate::sys::ReadWriteLocked;

/// What a `setattr` asks to change.
pub(super) struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeOrNow>,
    pub mtime: Option<TimeOrNow>,
}

impl WorkspaceFs {
    pub(super) fn set_attributes(
        &self,
        req: &Request,
        ino: u64,
        SetAttr {
            mode,
            uid,
            gid,
            size,
            atime,
            mtime,
        }: SetAttr,
    ) -> Result<FileAttr, Errno> {
        let ws = self.ws();
        let _b = ws.barrier.read_locked();
        let mut tx = ws.tx();
        let t = now_ns();
        let resolve = |x: TimeOrNow| match x {
            TimeOrNow::Now => t,
            TimeOrNow::SpecificTime(s) => time_ns(s),
        };
        if let Some(sz) = size {
            let kind = tx.node(ino)?.kind;
            if kind == Kind::Dir {
                return Err(Errno::EISDIR);
            }
            if kind != Kind::File {
                return Err(Errno::EINVAL);
            }
            let u = tx.copy_up(ino, sz == 0)?;
            let before = fstat(&u).map_err(io_errno)?.st_size as u64;
            u.set_len(sz).map_err(io_errno)?;
            tx.node_mut(ino)?
                .note_changed(before.min(sz), before.max(sz));
            // A truncate clears set-id bits unless the caller has CAP_FSETID (fuser
            // does not pass on the kernel's FATTR_KILL_SUIDGID: root is taken for
            // the capability).
            tx.kill_privs(ino, (req.uid() != 0).then_some(req))?;
            tx.node_mut(ino)?.meta.ctime = t;
            // A truncate while the file is open for writing (a shell's `>`: the
            // kernel opens, then truncates without naming the handle) is announced
            // by the writer's close, with what was written after it: one change,
            // one event.
            if tx.watched() && tx.node(ino)?.extra().writers == 0 {
                let path = tx.path_of(ino);
                tx.events.push((FsEventKind::Modify, path, None, false));
            }
        }
        let has_upper = matches!(tx.node(ino)?.body, Body::File { upper: Some(_), .. });
        if (atime.is_some() || mtime.is_some()) && has_upper {
            let u = match &tx.node(ino)?.body {
                Body::File { upper: Some(u), .. } => u.clone(),
                _ => unreachable!(),
            };
            let f = ws.upper_file(ino, &u).map_err(io_errno)?;
            set_file_times(&f, atime.map(resolve), mtime.map(resolve)).map_err(io_errno)?;
        }
        // chown of a non-directory, the VFS's rule (left to the daemon by
        // FUSE_HANDLE_KILLPRIV_V2; fuser does not pass FATTR_KILL_SUIDGID on, so root
        // is taken for CAP_FSETID): setuid goes; setgid goes when the group may
        // execute, or when the caller lacks CAP_FSETID and is not in the file's
        // group (before the change).
        let (kind, old_mode, old_gid) = {
            let n = tx.node(ino)?;
            (n.kind, n.meta.mode, n.meta.gid)
        };
        // chown(f, -1, -1) changes nothing but still drops the bits: the kernel
        // sends it as a setattr that sets nothing (its FATTR_KILL_SUIDGID is the
        // only flag, which fuser does not pass on).
        let nothing = uid.is_none()
            && gid.is_none()
            && size.is_none()
            && atime.is_none()
            && mtime.is_none()
            && mode.is_none();
        let chown =
            (uid.is_some() || gid.is_some() || nothing) && mode.is_none() && kind != Kind::Dir;
        let drop_sgid = chown && sgid_goes(old_mode, old_gid, (req.uid() != 0).then_some(req));
        let n = tx.node_mut(ino)?;
        if let Some(m) = mode {
            n.meta.mode = m & 0o7777;
        }
        if let Some(u) = uid {
            n.meta.uid = u;
        }
        if let Some(g) = gid {
            n.meta.gid = g;
        }
        if chown {
            n.meta.mode &= !libc::S_ISUID;
        }
        if drop_sgid {
            n.meta.mode &= !libc::S_ISGID;
        }
        if let Some(a) = atime {
            n.meta.atime = resolve(a);
        }
        if let Some(m) = mtime {
            n.meta.mtime = resolve(m);
        }
        tx.changed(ino, t)?;
        tx.close_if_idle(ino);
        let a = tx.attr(ino)?;
        tx.commit()?;
        Ok(a)
    }
}

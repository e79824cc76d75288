//! The steps behind FUSE requests that take more than one: making nodes, renaming
//! entries, opening files (copy-up, passthrough backings, handles), listing directories.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use fuser::{
    BackingId, Errno, FileAttr, FileType, FopenFlags, Generation, RenameFlags, ReplyEntry, Request,
};

use super::events::FsEventKind;
use super::node::{
    check_name, file_type, io_errno, now_ns, Body, Children, Handle, Name, Src, Upper,
};
use super::shared::{Workspace, MATERIALIZE_MIN, PASSTHROUGH_WRITE_ROOM, TRACK_WRITES_MIN, TTL};
use crate::cas::ObjectId;
use crate::fs::dirty::Kind;
use crate::sys::{Locked, ReadWriteLocked};

/// The FUSE face of a [`Workspace`].
pub struct WorkspaceFs(pub Arc<Workspace>);

impl WorkspaceFs {
    pub(super) fn ws(&self) -> &Workspace {
        &self.0
    }

    pub(super) fn entry_reply(&self, r: Result<FileAttr, Errno>, reply: ReplyEntry) {
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    /// Creates node `name` in `parent`: a regular file gets an empty upper file, a
    /// directory an empty listing, a symlink `target`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn create_node(
        &self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        kind: Kind,
        mode: u32,
        rdev: u64,
        target: Option<Vec<u8>>,
        keep_open: bool,
    ) -> Result<(u64, FileAttr), Errno> {
        let name = name.as_bytes();
        check_name(name)?;
        let mut tx = self.ws().tx();
        if tx.node(parent)?.kind != Kind::Dir {
            return Err(Errno::ENOTDIR);
        }
        if tx.lookup(parent, name)?.is_some() {
            return Err(Errno::EEXIST);
        }
        if tx.st.dirty.len() >= self.ws().max_dirty {
            return Err(Errno::ENOSPC);
        }
        let node = tx.make_node(kind, mode, req, parent, Body::Other { rdev });
        let ino = tx.alloc(node);
        let body = match kind {
            Kind::Dir => Body::Dir {
                tree: None,
                children: Some(Children::default()),
            },
            Kind::File => match self.ws().create_upper(ino) {
                Ok(f) => Body::File {
                    clean: None,
                    upper: Some(Upper::Open(Arc::new(f))),
                },
                Err(e) => {
                    tx.st.nodes.remove(&ino);
                    return Err(io_errno(e));
                }
            },
            Kind::Symlink => {
                let t = target.unwrap_or_default();
                tx.node_mut(ino)?.meta.size = t.len() as u64;
                Body::Symlink(t)
            }
            _ => Body::Other { rdev },
        };
        tx.node_mut(ino)?.body = body;
        tx.attach(parent, name, ino)?;
        tx.event(FsEventKind::Create, parent, name, kind == Kind::Dir);
        // create() opens it right after (and keeps it open); mknod does not.
        if kind != Kind::File || !keep_open {
            tx.close_if_idle(ino);
        }
        tx.node_mut(ino)?.looked_up();
        let attr = tx.attr(ino)?;
        tx.commit()?;
        Ok((ino, attr))
    }

    /// Opens `ino` (copying up for writing) and returns the handle, with passthrough
    /// the backing to reply with, and the open flags to reply with.
    pub(super) fn open_node(
        &self,
        ino: u64,
        flags: i32,
        make_backing: impl FnOnce(&File) -> std::io::Result<BackingId>,
    ) -> Result<(u64, Option<Arc<BackingId>>, FopenFlags), Errno> {
        let write = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let trunc = flags & libc::O_TRUNC != 0 && write;
        let ws = self.ws();
        let _b = if write {
            Some(ws.barrier.read_locked())
        } else {
            None
        };
        // A clean file about to be written, or read through passthrough, first gets a
        // local copy; the copy is made without holding the table.
        let wanted = {
            let st = ws.lock();
            let n = st.nodes.get(&ino).ok_or(Errno::ESTALE)?;
            match &n.body {
                Body::File {
                    clean: Some(c),
                    upper: None,
                    ..
                } if !(write && trunc)
                    && (write
                        || (ws.read_copies
                            && ws.passthrough.load(Ordering::Relaxed)
                            && n.extra().open_plain == 0
                            && c.size >= MATERIALIZE_MIN
                            // A local copy is an optimisation: not when space is short.
                            && ws.dirty.database().has_room(c.size + PASSTHROUGH_WRITE_ROOM))) =>
                {
                    Some((*c, n.meta.atime, n.meta.mtime))
                }
                _ => None,
            }
        };
        let prepared = match wanted {
            Some((c, atime, mtime)) => match ws.prepare_upper(&c, atime, mtime) {
                Ok(p) => Some((c, p)),
                // A copy to read through is an optimisation: without room (a bounded
                // mount's disk full) the chunks serve the reads.
                Err(Errno::ENOSPC) if !write => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        let mut tx = ws.tx();
        // In use: not an idle copy while open (noted again, newest, at release).
        tx.forget_copy(ino);
        let n = tx.node(ino)?;
        match n.kind {
            Kind::File => {}
            Kind::Dir => return Err(Errno::EISDIR),
            _ => return Err(Errno::EINVAL),
        }
        if let Some((c, (tmp, f))) = prepared {
            let still =
                matches!(&n.body, Body::File { clean: Some(c2), upper: None, .. } if c2.id == c.id);
            if still {
                ws.install_upper(&tmp, ino).map_err(io_errno)?;
                let n = tx.node_mut(ino)?;
                n.set_changed_chunks(Some(BTreeSet::new()));
                if let Body::File { upper, .. } = &mut n.body {
                    *upper = Some(Upper::Open(Arc::new(f)));
                }
            } else {
                ws.discard_tmp(&tmp);
            }
        }
        if write {
            tx.copy_up(ino, trunc)?;
            if trunc {
                let n = tx.node_mut(ino)?;
                n.meta.ctime = now_ns();
            }
        }
        let n = tx.node(ino)?;
        let (upper, clean) = match &n.body {
            Body::File { upper, clean, .. } => (upper.clone(), *clean),
            _ => unreachable!(),
        };
        if let (false, Some(c)) = (n.dirty, clean) {
            ws.note_read(c);
        }
        // While a handle is open the upper file stays open.
        let upper = match upper {
            Some(u) => {
                let f = ws.upper_file(ino, &u).map_err(io_errno)?;
                if let Body::File { upper, .. } = &mut tx.node_mut(ino)?.body {
                    *upper = Some(Upper::Open(f.clone()));
                }
                Some(f)
            }
            None => None,
        };
        let n = tx.node(ino)?;
        let mut backing = n.extra().backing.clone();
        // Writes through passthrough never reach the daemon, so nothing keeps them
        // from using the space the store's database needs: a handle that may write
        // gets passthrough only while the filesystem has ample room. Nor does the
        // daemon see which chunks they change: a large file's writers go through the
        // daemon, so that its checkpoint reads only what they wrote.
        let may_pass = !write
            || (ws.dirty.database().has_room(PASSTHROUGH_WRITE_ROOM)
                && !n.has_privs()
                && (trunc || ws.attr_of(ino, n).size < TRACK_WRITES_MIN));
        if let (None, true, 0, Some(u), true) = (
            &backing,
            ws.passthrough.load(Ordering::Relaxed),
            n.extra().open_plain,
            &upper,
            may_pass,
        ) {
            match make_backing(u) {
                Ok(b) => backing = Some(Arc::new(b)),
                Err(e) => tracing::debug!("passthrough unavailable for inode {ino}: {e}"),
            }
        }
        let u = tx.node_mut(ino)?.extra_mut();
        if write {
            u.writers += 1;
            if backing.is_some() {
                u.pass_writers += 1;
                u.changed_chunks = None;
            }
        }
        if backing.is_some() {
            u.open_passthrough += 1;
            u.backing = backing.clone();
        } else {
            u.open_plain += 1;
        }
        tx.st.open.insert(ino);
        // The kernel sends a flush at every close(2), and close waits for it. Only a
        // writer's close is announced (as a change), so the others never need it, and a
        // writer's close is announced at its release when nobody listened at its open.
        let noflush = !write || !tx.watched();
        let src = match (upper, clean) {
            (Some(u), _) => Src::Upper(u),
            (None, Some(c)) => Src::Clean(c),
            (None, None) => Src::None,
        };
        tx.commit()?;
        let fh = ws.new_fh();
        ws.handles.locked().insert(
            fh,
            Handle {
                ino,
                write,
                announce_at_release: write && noflush,
                src,
                backing: backing.clone(),
            },
        );
        let flags = if noflush {
            FopenFlags::FOPEN_NOFLUSH
        } else {
            FopenFlags::empty()
        };
        Ok((fh, backing, flags))
    }

    /// Directory `ino`'s entries from position `offset` (`.` and `..` first, then the
    /// children in name order).
    pub(super) fn listing(
        &self,
        ino: u64,
        offset: u64,
    ) -> Result<Vec<(u64, FileType, Vec<u8>)>, Errno> {
        let mut tx = self.ws().tx();
        let parent = tx.node(ino)?.parent();
        let children: Vec<(Name, u64)> = tx
            .children(ino)?
            .iter()
            .skip((offset as usize).saturating_sub(2))
            .take(1024)
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        let mut out = Vec::with_capacity(children.len() + 2);
        if offset == 0 {
            out.push((ino, FileType::Directory, b".".to_vec()));
        }
        if offset <= 1 {
            out.push((parent, FileType::Directory, b"..".to_vec()));
        }
        for (name, c) in children {
            let k = tx.node(c).map(|n| file_type(n.kind))?;
            out.push((c, k, name.to_vec()));
        }
        Ok(out)
    }

    /// Reads the trees of the subdirectories among `entries` that are not loaded yet
    /// all at once (readdirplus loads them one by one after).
    pub(super) fn prefetch_subtrees(&self, entries: &[(u64, FileType, Vec<u8>)]) {
        let ids: Vec<ObjectId> = {
            let st = self.ws().lock();
            entries
                .iter()
                .filter(|(_, kind, name)| {
                    *kind == FileType::Directory && name != b"." && name != b".."
                })
                .filter_map(|(c, _, _)| match st.nodes.get(c).map(|n| &n.body) {
                    Some(Body::Dir {
                        children: None,
                        tree: Some(t),
                        ..
                    }) => Some(ObjectId(t.0)),
                    _ => None,
                })
                .collect()
        };
        if ids.len() > 1 {
            self.ws().objects.prefetch(&ids);
        }
    }

    pub(super) fn current_src(&self, ino: u64, fh: u64) -> Src {
        if let Some(n) = self.ws().lock().nodes.get_mut(&ino) {
            if let Body::File { upper, clean, .. } = &mut n.body {
                return match (upper, clean) {
                    (Some(u), _) => match self.ws().upper_file(ino, u) {
                        Ok(f) => {
                            *u = Upper::Open(f.clone());
                            Src::Upper(f)
                        }
                        Err(e) => {
                            tracing::error!("upper file of inode {ino}: {e}");
                            Src::None
                        }
                    },
                    (None, Some(c)) => Src::Clean(*c),
                    (None, None) => Src::None,
                };
            }
        }
        self.ws()
            .handles
            .locked()
            .get(&fh)
            .map(|h| h.src.clone())
            .unwrap_or(Src::None)
    }

    pub(super) fn writable_upper(&self, ino: u64, fh: u64) -> Result<Arc<File>, Errno> {
        match self.current_src(ino, fh) {
            Src::Upper(u) => Ok(u),
            _ => {
                let mut tx = self.ws().tx();
                let u = tx.copy_up(ino, false)?;
                tx.commit()?;
                Ok(u)
            }
        }
    }

    /// Renames entry `n1` of `p` to `n2` of `np` (`flags`: exchange, no-replace).
    pub(super) fn rename_entry(
        &self,
        p: u64,
        n1: &[u8],
        np: u64,
        n2: &[u8],
        flags: RenameFlags,
    ) -> Result<(), Errno> {
        check_name(n2)?;
        if flags.contains(RenameFlags::RENAME_WHITEOUT) {
            return Err(Errno::EINVAL);
        }
        let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        if exchange && noreplace {
            return Err(Errno::EINVAL);
        }
        let mut tx = self.ws().tx();
        if tx.node(np)?.kind != Kind::Dir {
            return Err(Errno::ENOTDIR);
        }
        let src = tx.lookup(p, n1)?.ok_or(Errno::ENOENT)?;
        let dst = tx.lookup(np, n2)?;
        let src_dir = tx.node(src)?.kind == Kind::Dir;
        // A directory cannot move below itself.
        if tx.is_within(np, src)? {
            return Err(Errno::EINVAL);
        }
        if exchange {
            let dst = dst.ok_or(Errno::ENOENT)?;
            if dst == src {
                return Ok(());
            }
            if tx.node(dst)?.kind == Kind::Dir && tx.is_within(p, dst)? {
                return Err(Errno::EINVAL);
            }
            let dst_dir = tx.node(dst)?.kind == Kind::Dir;
            tx.rename_event(p, n1, np, n2, src_dir);
            tx.rename_event(np, n2, p, n1, dst_dir);
            tx.detach(p, n1)?;
            tx.detach(np, n2)?;
            tx.attach(np, n2, src)?;
            tx.attach(p, n1, dst)?;
            let t = now_ns();
            tx.changed(src, t)?;
            tx.changed(dst, t)?;
            return tx.commit();
        }
        if let Some(d) = dst {
            if noreplace {
                return Err(Errno::EEXIST);
            }
            if d == src {
                return Ok(());
            }
            let dst_dir = tx.node(d)?.kind == Kind::Dir;
            if src_dir && !dst_dir {
                return Err(Errno::ENOTDIR);
            }
            if !src_dir && dst_dir {
                return Err(Errno::EISDIR);
            }
            if dst_dir && !tx.children(d)?.is_empty() {
                return Err(Errno::ENOTEMPTY);
            }
            tx.detach(np, n2)?;
            tx.drop_link(d)?;
        }
        tx.rename_event(p, n1, np, n2, src_dir);
        tx.detach(p, n1)?;
        tx.attach(np, n2, src)?;
        tx.changed(src, now_ns())?;
        tx.commit()
    }
}

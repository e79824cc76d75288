//! The `fuser::Filesystem` of a workspace: each request goes to the inode table and
//! back as a reply.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use fuser::{
    AccessFlags, Errno, FileHandle, FileType, Filesystem, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use rustix::fs::SeekFrom;

use super::events::FsEventKind;
use super::node::{check_name, eio, fstat, io_errno, kind_of_mode, now_ns, Body, Src};
use super::ops::WorkspaceFs;
use super::setattr::SetAttr;
use super::shared::{LINK_MAX, TTL};
use crate::cas::tree::{MAX_NAME_LEN, MAX_SYMLINK_LEN, MAX_XATTR_NAME_LEN, MAX_XATTR_VALUE_LEN};
use crate::cas::TreeId;
use crate::fs::dirty::Kind;
use crate::fs::reply::{reply_getxattr, reply_listxattr};
use crate::sys::{Locked, ReadWriteLocked};

pub(super) fn reply_empty(r: Result<(), Errno>, reply: ReplyEmpty) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

impl Filesystem for WorkspaceFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if self.ws().want_passthrough
            && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            && config.set_max_stack_depth(1).is_ok()
        {
            self.ws().passthrough.store(true, Ordering::Relaxed);
        }
        let _ = config
            .add_capabilities(InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO);
        // The daemon clears set-id bits and file capabilities itself (see `kill_privs`).
        // Without it the kernel asks for `security.capability` before every write(2),
        // passthrough ones included, and for the attributes before every chown: a
        // round trip each.
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        crate::fs::transport::ask_for_uring(config, self.ws().want_uring);
        Ok(())
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.ws().forget([(ino.0, nlookup)]);
    }

    fn batch_forget(&self, _req: &Request, nodes: &[fuser::ForgetOne]) {
        self.ws()
            .forget(nodes.iter().map(|n| (n.nodeid().0, n.nlookup())));
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if name.len() > MAX_NAME_LEN {
            // The kernel leaves the check to us: every path call with such a component.
            return reply.error(Errno::ENAMETOOLONG);
        }
        let r = (|| {
            let mut tx = self.ws().tx();
            let Some(ino) = tx.lookup(parent.0, name.as_bytes())? else {
                return Ok(None);
            };
            if tx.node(ino)?.kind == Kind::Dir {
                tx.load_dir(ino)?;
            }
            tx.node_mut(ino)?.looked_up();
            tx.attr(ino).map(Some)
        })();
        match r {
            Ok(Some(a)) => reply.entry(&TTL, &a, Generation(0)),
            // A negative entry the kernel may cache: a create passes through the kernel,
            // which replaces it, and a root swap invalidates it.
            Ok(None) => {
                let mut a = self
                    .ws()
                    .attr_of(0, &self.ws().root_node(TreeId(crate::cas::Hash::of(b""))));
                a.ino = INodeNo(0);
                reply.entry(&TTL, &a, Generation(0))
            }
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let r = (|| {
            let mut tx = self.ws().tx();
            if tx.node(ino.0)?.kind == Kind::Dir {
                tx.load_dir(ino.0)?;
            }
            tx.attr(ino.0)
        })();
        match r {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _ = fh;
        let r = self.set_attributes(
            req,
            ino.0,
            SetAttr {
                mode,
                uid,
                gid,
                size,
                atime,
                mtime,
            },
        );
        match r {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let tx = self.ws().tx();
        match tx.node(ino.0).map(|n| &n.body) {
            Ok(Body::Symlink(t)) => reply.data(t),
            Ok(_) => reply.error(Errno::EINVAL),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let r = (|| {
            let kind = kind_of_mode(mode).ok_or(Errno::EINVAL)?;
            let perm = mode & !umask;
            if matches!(kind, Kind::Dir | Kind::Symlink) {
                return Err(Errno::EINVAL);
            }
            let rdev = if kind == Kind::File { 0 } else { rdev as u64 };
            let (_, a) = self.create_node(req, parent.0, name, kind, perm, rdev, None, false)?;
            Ok(a)
        })();
        self.entry_reply(r, reply);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let r = self
            .create_node(
                req,
                parent.0,
                name,
                Kind::Dir,
                mode & !umask,
                0,
                None,
                false,
            )
            .map(|x| x.1);
        self.entry_reply(r, reply);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            let mut tx = self.ws().tx();
            let child = tx.lookup(parent.0, name.as_bytes())?.ok_or(Errno::ENOENT)?;
            if tx.node(child)?.kind == Kind::Dir {
                return Err(Errno::EISDIR);
            }
            tx.event(FsEventKind::Delete, parent.0, name.as_bytes(), false);
            tx.detach(parent.0, name.as_bytes())?;
            tx.drop_link(child)?;
            tx.commit()
        })();
        reply_empty(r, reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            let mut tx = self.ws().tx();
            if name.as_bytes() == b"." {
                return Err(Errno::EINVAL);
            }
            let child = tx.lookup(parent.0, name.as_bytes())?.ok_or(Errno::ENOENT)?;
            if tx.node(child)?.kind != Kind::Dir {
                return Err(Errno::ENOTDIR);
            }
            if !tx.children(child)?.is_empty() {
                return Err(Errno::ENOTEMPTY);
            }
            tx.event(FsEventKind::Delete, parent.0, name.as_bytes(), true);
            tx.detach(parent.0, name.as_bytes())?;
            tx.drop_link(child)?;
            tx.commit()
        })();
        reply_empty(r, reply);
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let t = target.as_os_str().as_bytes().to_vec();
        if t.len() > MAX_SYMLINK_LEN {
            return reply.error(Errno::ENAMETOOLONG);
        }
        let r = self
            .create_node(
                req,
                parent.0,
                link_name,
                Kind::Symlink,
                0o777,
                0,
                Some(t),
                false,
            )
            .map(|x| x.1);
        self.entry_reply(r, reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = self.rename_entry(
            parent.0,
            name.as_bytes(),
            newparent.0,
            newname.as_bytes(),
            flags,
        );
        reply_empty(r, reply);
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let r = (|| {
            let name = newname.as_bytes();
            check_name(name)?;
            let mut tx = self.ws().tx();
            if tx.node(ino.0)?.kind == Kind::Dir {
                return Err(Errno::EPERM);
            }
            if tx.node(newparent.0)?.kind != Kind::Dir {
                return Err(Errno::ENOTDIR);
            }
            if tx.lookup(newparent.0, name)?.is_some() {
                return Err(Errno::EEXIST);
            }
            if tx.node(ino.0)?.meta.nlink >= LINK_MAX {
                return Err(Errno::EMLINK);
            }
            // Every link of a linked node is an override, so that all of them follow
            // its content: make it dirty where it is first.
            tx.persist(ino.0)?;
            tx.node_mut(ino.0)?.meta.nlink += 1;
            tx.attach(newparent.0, name, ino.0)?;
            tx.event(FsEventKind::Create, newparent.0, name, false);
            tx.changed(ino.0, now_ns())?;
            tx.node_mut(ino.0)?.looked_up();
            let a = tx.attr(ino.0)?;
            tx.commit()?;
            Ok(a)
        })();
        self.entry_reply(r, reply);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let r = self.open_node(ino.0, flags.0, |f| reply.open_backing(f));
        match r {
            Ok((fh, Some(b), f)) => reply.opened_passthrough(FileHandle(fh), f, &b),
            Ok((fh, None, f)) => reply.opened(FileHandle(fh), f),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let r = match self.current_src(ino.0, fh.0) {
            Src::Upper(u) => {
                let mut buf = vec![0u8; size as usize];
                let mut n = 0;
                loop {
                    match u.read_at(&mut buf[n..], offset + n as u64) {
                        Ok(0) => break,
                        Ok(k) => {
                            n += k;
                            if n == buf.len() {
                                break;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return reply.error(io_errno(e)),
                    }
                }
                buf.truncate(n);
                Ok(buf)
            }
            Src::Clean(c) => self.ws().read_clean(ino.0, &c, offset, size),
            Src::None => Err(Errno::EIO),
        };
        match r {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let ws = self.ws();
        let _b = ws.barrier.read_locked();
        // Upper files share the store's filesystem: leave its database the reserve it
        // needs (a write that fails there for lack of space, it does not survive).
        let r = ws
            .dirty
            .database()
            .ensure_space(data.len() as u64)
            .map_err(eio)
            .and_then(|()| self.writable_upper(ino.0, fh.0))
            .and_then(|u| {
                u.write_all_at(data, offset).map_err(io_errno)?;
                let kill = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
                ws.written(
                    ino.0,
                    offset,
                    offset + data.len() as u64,
                    kill.then_some(req),
                )
            });
        match r {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close() waits for the flush (not for the release): a change is announced
        // before the writer goes on. Only handles opened while someone listened get
        // flushes (`open_node`); the others' closes are announced at their release.
        let ws = self.ws();
        let writes = ws.handles.locked().get(&fh.0).is_some_and(|h| h.write);
        if writes {
            let mut tx = ws.tx();
            if tx.watched() {
                let path = tx.path_of(ino.0);
                tx.events.push((FsEventKind::Modify, path, None, false));
            }
            let _ = tx.commit();
        }
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.ws().release_handle(fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            if let Src::Upper(u) = self.current_src(ino.0, fh.0) {
                if datasync {
                    u.sync_data().map_err(io_errno)?;
                } else {
                    u.sync_all().map_err(io_errno)?;
                }
            }
            self.ws().dirty.sync().map_err(eio)
        })();
        reply_empty(r, reply);
    }

    /// No opendir: the kernel then sends neither opendir nor releasedir, and caches
    /// every listing (FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE by default). That is right here
    /// because every change to a directory goes through the kernel, which drops its
    /// cache, and a root swap invalidates the root.
    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.ws().tx().node(ino.0) {
            Ok(n) if n.kind == Kind::Dir => reply.error(Errno::ENOSYS),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let entries = match self.listing(ino.0, offset) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        for (i, (child, kind, name)) in entries.into_iter().enumerate() {
            let next = offset + i as u64 + 1;
            if reply.add(INodeNo(child), next, kind, OsStr::from_bytes(&name)) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let entries = match self.listing(ino.0, offset) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        self.prefetch_subtrees(&entries);
        let mut ahead = Vec::new();
        let mut tx = self.ws().tx();
        for (k, (child, kind, name)) in entries.into_iter().enumerate() {
            if kind == FileType::Directory && name != b"." && name != b".." {
                let _ = tx.load_dir_reading_ahead(child, &mut ahead);
            }
            let Ok(attr) = tx.attr(child) else { continue };
            let next = offset + k as u64 + 1;
            if reply.add(
                INodeNo(child),
                next,
                OsStr::from_bytes(&name),
                &TTL,
                &attr,
                Generation(0),
            ) {
                break;
            }
            if name != b"." && name != b".." {
                if let Ok(n) = tx.node_mut(child) {
                    n.looked_up();
                }
            }
        }
        drop(tx);
        reply.ok();
        // A walk goes on into these subdirectories: their own subdirectories' trees are
        // read while it does.
        self.ws().objects.read_ahead(ahead);
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.ws().dirty.sync() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(eio(e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = match rustix::fs::fstatvfs(&self.ws().upper_fd) {
            Ok(s) => s,
            Err(e) => return reply.error(io_errno(e.into())),
        };
        reply.statfs(
            s.f_blocks,
            s.f_bfree,
            s.f_bavail,
            s.f_files,
            s.f_ffree,
            s.f_bsize as u32,
            MAX_NAME_LEN as u32,
            s.f_frsize as u32,
        );
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            let name = name.as_bytes();
            if name.len() > MAX_XATTR_NAME_LEN || name.is_empty() {
                return Err(Errno::ERANGE);
            }
            if value.len() > MAX_XATTR_VALUE_LEN {
                return Err(Errno::E2BIG);
            }
            // No POSIX ACLs or other system attributes: tools (cp -a, tar) then fall
            // back to plain modes, as on any filesystem without ACL support.
            if name.starts_with(b"system.") {
                return Err(Errno::EOPNOTSUPP);
            }
            let mut tx = self.ws().tx();
            let n = tx.node_mut(ino.0)?;
            let pos = n.xattrs().binary_search_by(|(k, _)| k.as_slice().cmp(name));
            match (pos, flags) {
                (Ok(_), f) if f & libc::XATTR_CREATE != 0 => return Err(Errno::EEXIST),
                (Err(_), f) if f & libc::XATTR_REPLACE != 0 => return Err(Errno::NO_XATTR),
                (Ok(i), _) => n.xattrs_mut()[i].1 = value.to_vec(),
                (Err(i), _) => n.xattrs_mut().insert(i, (name.to_vec(), value.to_vec())),
            }
            tx.changed(ino.0, now_ns())?;
            tx.commit()
        })();
        reply_empty(r, reply);
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let tx = self.ws().tx();
        match tx.node(ino.0) {
            Ok(n) => reply_getxattr(n.xattrs(), name, size, reply),
            Err(e) => reply.error(e),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let tx = self.ws().tx();
        match tx.node(ino.0) {
            Ok(n) => reply_listxattr(n.xattrs(), size, reply),
            Err(e) => reply.error(e),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            let mut tx = self.ws().tx();
            let n = tx.node_mut(ino.0)?;
            let pos = n
                .xattrs()
                .binary_search_by(|(k, _)| k.as_slice().cmp(name.as_bytes()))
                .map_err(|_| Errno::NO_XATTR)?;
            n.xattrs_mut().remove(pos);
            n.settle_extra();
            tx.changed(ino.0, now_ns())?;
            tx.commit()
        })();
        reply_empty(r, reply);
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // Permissions are checked by the kernel (default_permissions); this only says
        // whether the node exists.
        match self.ws().tx().node(ino.0) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let r = self.create_node(
            req,
            parent.0,
            name,
            Kind::File,
            mode & !umask,
            0,
            None,
            true,
        );
        let (ino, attr) = match r {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        match self.open_node(ino, flags & !libc::O_TRUNC, |f| reply.open_backing(f)) {
            Ok((fh, Some(b), f)) => {
                reply.created_passthrough(&TTL, &attr, Generation(0), FileHandle(fh), f, &b)
            }
            Ok((fh, None, f)) => reply.created(&TTL, &attr, Generation(0), FileHandle(fh), f),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let ws = self.ws();
        let _b = ws.barrier.read_locked();
        let grows = mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_COLLAPSE_RANGE) == 0;
        let space = if grows {
            ws.dirty.database().ensure_space(length).map_err(eio)
        } else {
            Ok(())
        };
        let r = space
            .and_then(|()| self.writable_upper(ino.0, fh.0))
            .and_then(|u| {
                let end = fstat(&u).map_err(io_errno)?.st_size as u64;
                // The kernel checks the range and the mode.
                let flags = rustix::fs::FallocateFlags::from_bits_retain(mode as u32);
                rustix::fs::fallocate(&u, flags, offset, length).map_err(|e| io_errno(e.into()))?;
                let moves = libc::FALLOC_FL_COLLAPSE_RANGE | libc::FALLOC_FL_INSERT_RANGE;
                // Collapse and insert move everything after `offset` (up to the old end,
                // so a collapse notes what it cut); the others change only their range.
                let to = if mode & moves != 0 {
                    end.max(offset.saturating_add(length))
                } else {
                    offset.saturating_add(length)
                };
                // As a write: set-id bits go unless the caller has CAP_FSETID (root is
                // taken for it, as for truncates), file capabilities go.
                ws.written(ino.0, offset, to, (req.uid() != 0).then_some(req))
            });
        reply_empty(r, reply);
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let r = match self.current_src(ino.0, fh.0) {
            Src::Upper(u) => {
                // Our own descriptor of the upper file; the kernel checks the offset.
                let pos = match whence {
                    libc::SEEK_SET => Some(SeekFrom::Start(offset as u64)),
                    libc::SEEK_CUR => Some(SeekFrom::Current(offset)),
                    libc::SEEK_END => Some(SeekFrom::End(offset)),
                    libc::SEEK_DATA => Some(SeekFrom::Data(offset as u64)),
                    libc::SEEK_HOLE => Some(SeekFrom::Hole(offset as u64)),
                    _ => None,
                };
                match pos {
                    Some(pos) => rustix::fs::seek(&u, pos)
                        .map(|o| o as i64)
                        .map_err(|e| io_errno(e.into())),
                    None => Err(Errno::EINVAL),
                }
            }
            Src::Clean(c) => {
                let size = c.size as i64;
                match whence {
                    libc::SEEK_DATA if offset < size => Ok(offset),
                    libc::SEEK_HOLE if offset < size => Ok(size),
                    libc::SEEK_DATA | libc::SEEK_HOLE => Err(Errno::ENXIO),
                    _ => Err(Errno::EINVAL),
                }
            }
            Src::None => Err(Errno::EIO),
        };
        match r {
            Ok(o) => reply.offset(o),
            Err(e) => reply.error(e),
        }
    }
}

//! Upper files (local copies of dirty files) and local copies of clean ones: where
//! they live under the mount's directory, how a clean file is copied up, how clean
//! content is read from the object store.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use fuser::Errno;
use rustix::fs::{AtFlags, Mode, OFlags};

use super::node::{eio, fstat, io_errno, now_ns, set_file_times, Body, Stat, Upper};
use super::shared::Workspace;
use super::table::Tx;
use crate::cas::file::{load_chunk_list, read_chunk};
use crate::cas::{ChunkId, FileRef};

impl<'a> Tx<'a> {
    /// Drops a node that no directory links any more, unless it is open.
    /// Counts `ino`'s local copy among the unused ones, if it has one and is clean and
    /// closed; evicts the oldest beyond the limit.
    pub(super) fn note_copy(&mut self, ino: u64) {
        let Some(n) = self.st.nodes.get(&ino) else {
            return;
        };
        let size = match &n.body {
            Body::File {
                clean: Some(c),
                upper: Some(_),
                ..
            } if !n.dirty && !n.is_open() => c.size,
            _ => return,
        };
        let copies = &mut self.st.copies;
        if !copies.sizes.contains_key(&ino) {
            copies.generation += 1;
            copies.sizes.insert(ino, (size, copies.generation));
            copies.bytes += size;
            copies.order.push_back((ino, copies.generation));
        }
        while self.st.copies.bytes > self.ws.copies_limit {
            let Some((old, generation)) = self.st.copies.order.pop_front() else {
                break;
            };
            match self.st.copies.sizes.get(&old) {
                Some(&(sz, g)) if g == generation => {
                    self.st.copies.sizes.remove(&old);
                    self.st.copies.bytes -= sz;
                }
                _ => continue,
            }
            let Some(n) = self.st.nodes.get_mut(&old) else {
                continue;
            };
            let idle = !n.dirty && !n.is_open();
            if let Body::File {
                clean: Some(_),
                upper,
                ..
            } = &mut n.body
            {
                if idle && upper.is_some() {
                    *upper = None;
                    // Now, not through the reaper: the node lives on, and a copy-up of it
                    // before the reaper came by would lose its new upper file.
                    self.ws.remove_upper_now(old);
                    // No copy, so nothing of one to note.
                    n.set_changed_chunks(None);
                    n.settle_extra();
                }
            }
        }
    }

    /// `ino`'s copy is in use, changed or gone: no longer an unused copy.
    pub(super) fn forget_copy(&mut self, ino: u64) {
        if let Some((sz, _)) = self.st.copies.sizes.remove(&ino) {
            self.st.copies.bytes -= sz;
        }
        // Its place in `order` goes stale (a later note gets a new generation).
        let c = &mut self.st.copies;
        if c.order.len() > 64 && c.order.len() > 4 * c.sizes.len() {
            let sizes = &c.sizes;
            c.order
                .retain(|(i, g)| sizes.get(i).is_some_and(|&(_, g2)| g2 == *g));
        }
    }

    pub(super) fn maybe_free(&mut self, ino: u64) {
        let Some(n) = self.st.nodes.get(&ino) else {
            return;
        };
        if !n.links.is_empty() || n.is_open() {
            return;
        }
        self.forget_copy(ino);
        let n = self.st.nodes.remove(&ino).expect("present");
        self.st.unloaded.remove(&ino);
        if n.dirty {
            self.ws.dirty.delete_node(&mut self.batch, ino);
        }
        self.st.dirty.remove(&ino);
        if let Body::File { upper: Some(_), .. } = n.body {
            self.ws.remove_upper(ino);
        }
        if let Body::Dir {
            children: Some(ch), ..
        } = n.body
        {
            // An empty directory has no children; a replaced tree's clean nodes go too.
            for c in ch.values() {
                self.st.nodes.remove(c);
            }
        }
    }

    /// Gives file `ino` an upper file holding its current content.
    pub(super) fn copy_up(&mut self, ino: u64, truncate: bool) -> Result<Arc<File>, Errno> {
        self.forget_copy(ino);
        let n = self.node(ino)?;
        let dirty = n.dirty;
        let existing = match &n.body {
            Body::File { upper: Some(u), .. } => Some(u.clone()),
            _ => None,
        };
        if let Some(u) = existing {
            let u = self.ws.upper_file(ino, &u).map_err(io_errno)?;
            // Open now: whoever changes it closes it (handle release, or close_if_idle),
            // which takes its new size and times.
            if let Body::File { upper, .. } = &mut self.node_mut(ino)?.body {
                *upper = Some(Upper::Open(u.clone()));
            }
            if truncate {
                let old = fstat(&u).map_err(io_errno)?.st_size as u64;
                u.set_len(0).map_err(io_errno)?;
                self.node_mut(ino)?.note_changed(0, old);
            }
            if !dirty {
                self.persist(ino)?;
            }
            return Ok(u);
        }
        let n = self.node(ino)?;
        let (clean, mtime, atime) = match &n.body {
            Body::File { clean, .. } => (*clean, n.meta.mtime, n.meta.atime),
            Body::Dir { .. } => return Err(Errno::EISDIR),
            _ => return Err(Errno::EINVAL),
        };
        let f = self.ws.create_upper(ino).map_err(io_errno)?;
        if let (Some(c), false) = (clean, truncate) {
            self.ws.fill_upper(&f, &c)?;
        }
        if !truncate {
            set_file_times(&f, Some(atime), Some(mtime)).map_err(io_errno)?;
        }
        let f = Arc::new(f);
        // `clean` stays: the content the copy started from, whose chunks the next
        // snapshot need not store again.
        if let Body::File { upper, .. } = &mut self.node_mut(ino)?.body {
            *upper = Some(Upper::Open(f.clone()));
        }
        let n = self.node_mut(ino)?;
        // Equal to `clean` until something writes it; emptied, it differs everywhere.
        n.set_changed_chunks(Some(BTreeSet::new()));
        if let (Some(c), true) = (clean, truncate) {
            n.note_changed(0, c.size);
        }
        if truncate {
            n.meta.ctime = now_ns();
        }
        // The record changes even when already dirty: it now has an upper file.
        self.persist(ino)?;
        Ok(f)
    }
}

impl Workspace {
    pub(super) fn upper_path(&self, ino: u64) -> PathBuf {
        self.upper_dir.join(upper_rel(ino))
    }

    pub(super) fn upper_cname(ino: u64) -> CString {
        CString::new(upper_rel(ino)).expect("no NUL")
    }

    /// Opens `name` (relative to the upper directory) read-write; `create` makes it new
    /// and empty (mode 0600).
    pub(super) fn open_in_upper(&self, name: &CString, create: bool) -> std::io::Result<File> {
        let flags = if create {
            OFlags::RDWR | OFlags::CREATE | OFlags::TRUNC | OFlags::CLOEXEC
        } else {
            OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOFOLLOW
        };
        let fd = rustix::fs::openat(&self.upper_fd, name, flags, Mode::from_raw_mode(0o600))?;
        Ok(File::from(fd))
    }

    pub(super) fn open_upper(&self, ino: u64) -> std::io::Result<File> {
        self.open_in_upper(&Self::upper_cname(ino), false)
    }

    /// Inode numbers are never reused within a mount, and upper files no record names
    /// are removed at mount: there is nothing to clobber.
    pub(super) fn create_upper(&self, ino: u64) -> std::io::Result<File> {
        self.open_in_upper(&Self::upper_cname(ino), true)
    }

    /// Removes an upper file in the background: freeing a large file's blocks takes
    /// time a request should not wait for, and a crash before leaves only an orphan
    /// that the next mount removes.
    /// Removes the upper file of a node that is gone (by the reaper, in batches).
    pub(super) fn remove_upper(&self, ino: u64) {
        let _ = self.reaper.send(ino);
    }

    /// Removes the upper file of `ino` at once (the node stays and may get another).
    pub(super) fn remove_upper_now(&self, ino: u64) {
        let name = Self::upper_cname(ino);
        let _ = rustix::fs::unlinkat(&self.upper_fd, &name, AtFlags::empty());
    }

    /// Writes stored content `c` to a new temporary file in the upper directory (not
    /// holding the table), with the node's times. [`Workspace::install_upper`] gives it
    /// its inode's name.
    pub(super) fn prepare_upper(
        &self,
        c: &FileRef,
        atime: i64,
        mtime: i64,
    ) -> Result<(CString, File), Errno> {
        self.dirty.database().ensure_space(c.size).map_err(eio)?;
        let n = self.next_tmp.fetch_add(1, Ordering::Relaxed);
        let name = CString::new(format!("tmp-{n}")).expect("no NUL");
        let f = self.open_in_upper(&name, true).map_err(io_errno)?;
        let filled = self
            .fill_upper(&f, c)
            .and_then(|()| set_file_times(&f, Some(atime), Some(mtime)).map_err(io_errno));
        if let Err(e) = filled {
            self.discard_tmp(&name);
            return Err(e);
        }
        Ok((name, f))
    }

    pub(super) fn install_upper(&self, tmp: &CString, ino: u64) -> std::io::Result<()> {
        let name = Self::upper_cname(ino);
        let dir = &self.upper_fd;
        rustix::fs::renameat(dir, tmp, dir, &name).map_err(std::io::Error::from)
    }

    pub(super) fn discard_tmp(&self, tmp: &CString) {
        let _ = rustix::fs::unlinkat(&self.upper_fd, tmp, AtFlags::empty());
    }

    /// The open upper file of `ino` (opened now if it is closed).
    pub(super) fn upper_file(&self, ino: u64, u: &Upper) -> std::io::Result<Arc<File>> {
        match u {
            Upper::Open(f) => Ok(f.clone()),
            Upper::Closed => Ok(Arc::new(self.open_upper(ino)?)),
        }
    }

    pub(super) fn upper_stat(&self, ino: u64, u: &Upper) -> std::io::Result<Stat> {
        match u {
            Upper::Open(f) => fstat(f),
            Upper::Closed => {
                let name = Self::upper_cname(ino);
                rustix::fs::statat(&self.upper_fd, &name, AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(std::io::Error::from)
            }
        }
    }

    /// Writes stored content `c` into fresh upper file `f`.
    pub(super) fn fill_upper(&self, f: &File, c: &FileRef) -> Result<(), Errno> {
        if !c.is_chunked() {
            let data = self.reader.chunk(ChunkId(c.id.0), c.size).map_err(eio)?;
            f.write_all_at(&data, 0).map_err(io_errno)?;
            return Ok(());
        }
        let list = load_chunk_list(self.objects.as_ref(), c).map_err(eio)?;
        let mut off = 0u64;
        for (id, len) in &list.chunks {
            let data = read_chunk(self.objects.as_ref(), id, *len as u64).map_err(eio)?;
            f.write_all_at(&data, off).map_err(io_errno)?;
            off += *len as u64;
        }
        Ok(())
    }

    pub(super) fn read_clean(
        &self,
        ino: u64,
        fref: &FileRef,
        offset: u64,
        size: u32,
    ) -> Result<Vec<u8>, Errno> {
        // A large file's chunk list is loaded once and kept with its node.
        let list = || {
            let cached = match self.lock().nodes.get(&ino) {
                Some(n) => match (&n.body, &n.extra().chunks) {
                    (
                        Body::File {
                            clean: Some(cl), ..
                        },
                        Some(c),
                    ) if cl.id == fref.id => Some(c.clone()),
                    _ => None,
                },
                None => None,
            };
            if let Some(l) = cached {
                return Ok(l);
            }
            let l = Arc::new(load_chunk_list(self.objects.as_ref(), fref)?);
            if let Some(n) = self.lock().nodes.get_mut(&ino) {
                let same =
                    matches!(&n.body, Body::File { clean: Some(cl), .. } if cl.id == fref.id);
                // Kept while a handle is open (its uses are boxed then).
                if let (true, Some(u)) = (same, n.extra.as_deref_mut()) {
                    u.chunks = Some(l.clone());
                }
            }
            Ok(l)
        };
        self.reader.read(fref, list, offset, size).map_err(eio)
    }
}

/// Where the upper file of inode `ino` lives, relative to the mount's upper directory:
/// upper files are spread over 256 subdirectories (one directory of 100k files makes
/// every create slower).
pub fn upper_rel(ino: u64) -> String {
    format!("{:02x}/{ino}", ino % 256)
}

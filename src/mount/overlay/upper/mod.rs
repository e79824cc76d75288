//! Reading an overlayfs upper directory as changes to its lower tree.
//!
//! The upper holds exactly what differs from the lower, in the kernel's own format
//! (Documentation/filesystems/overlayfs.rst): a regular file, symlink, device or
//! directory is a new or changed entry; a 0/0 character device (or an empty file
//! with `trusted.overlay.whiteout`) is a removed one; a directory with
//! `trusted.overlay.opaque=y` replaces the lower's directory of that name instead of
//! merging with it; `trusted.overlay.redirect` names the lower directory a renamed
//! directory (or a metacopy file) came from, absolute from the lower's root or
//! relative to the parent's lower directory; `trusted.overlay.metacopy` marks a file
//! whose metadata changed but whose data is still the lower's. The tree of the merged
//! view is the lower's trees with these applied, bottom-up: the walk visits the upper
//! only, never the lower's other directories.

mod stamp;
mod status;

pub(super) use stamp::{
    rel_join, split_rel, DirTrees, HashCache, Hashed, Listings, Partial, Rel, Stamp, Visit,
};

pub(super) use status::{changes_since, is_dir, merge_listings};

use crate::sys::Locked;
use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::io::{Read, Seek};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::cas::file::{store_bytes, store_reader, StoreStats};
use crate::cas::{
    load_tree, store_tree_over, EntryContent, FileId, ObjectStore, Tree, TreeEntry, TreeId,
};
use crate::fs::erofs::parse_data_name;
use crate::fs::{EntryKind, FilterError, SnapshotFilter, SnapshotStats};
use crate::sys::dirfd::{self, Entry, Meta};
use crate::sys::xattr;

/// The prefix of the xattrs overlayfs keeps on upper entries, mounted by root.
pub(super) const TRUSTED_PREFIX: &[u8] = b"trusted.overlay.";
/// The same for an overlay mounted with `userxattr` (in a user namespace).
pub(super) const USER_PREFIX: &[u8] = b"user.overlay.";

/// What a capture may take from the last checkpoint: the tree of every directory not in
/// `visit`, and the entries of a directory in it that are not named, as that checkpoint
/// built them.
pub(super) struct Reuse<'a> {
    /// The changed directories (and what of them changed) and their ancestors (the
    /// name of the child on the way).
    pub visit: &'a HashMap<Rel, Visit>,
    pub trees: &'a DirTrees,
}

/// What an upper entry makes of its name in the merged directory.
enum Step {
    /// The lower's entry (if any) shows: nothing in the upper, or nothing storable.
    Lower,
    /// A whiteout: the name is gone.
    Removed,
    Entry(TreeEntry),
}

/// The error of a capture of the upper.
#[derive(Debug, thiserror::Error)]
pub(super) enum UpperError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Cas(#[from] crate::cas::CasError),
    #[error("{0}")]
    Invalid(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> UpperError + '_ {
    move |source| UpperError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// One capture of an upper over a lower tree.
pub(super) struct UpperCapture<'a> {
    pub objects: &'a dyn ObjectStore,
    pub lower_root: TreeId,
    pub filter: Option<&'a dyn SnapshotFilter>,
    pub cache: &'a HashCache,
    pub stats: SnapshotStats,
    /// Entries the filter left out or stored in another form (a secret replaced):
    /// they stay uncaptured, as with the FUSE backend, so the next checkpoint looks at
    /// them again.
    pub kept_back: Vec<Rel>,
    /// Directories taken from the last checkpoint without a visit (none: every one
    /// is visited).
    pub reuse: Option<Reuse<'a>>,
    /// The stamp of every upper entry the walk saw, by directory, taken before the entry
    /// was read: what the checkpoint holds (an entry changed later has another stamp).
    pub listings: Listings,
    /// The same for directories of which only some entries were looked at (none: the
    /// entry is not in the upper).
    pub partial: Partial,
    /// The tree of every directory the walk visited.
    pub trees: DirTrees,
    /// The stamps of the files it counted as hashed (read now, or ahead of it): a
    /// checkpoint holds them once it is appended ([`mark_in_checkpoint`]).
    pub hashed: Vec<Stamp>,
    /// The xattr prefix of overlayfs's own attributes: [`TRUSTED_PREFIX`], or
    /// [`USER_PREFIX`] for a rootless overlay.
    pub prefix: &'static [u8],
}

/// Marks the files a capture hashed as held by a checkpoint: the next one that finds
/// them unchanged reads and counts nothing.
pub(super) fn mark_in_checkpoint(cache: &HashCache, hashed: &[Stamp]) {
    let mut c = cache.locked();
    for s in hashed {
        if let Some(h) = c.get_mut(s) {
            h.in_checkpoint = true;
        }
    }
}

/// Whether `m` (with xattrs `x`) is a whiteout: a removed lower entry.
fn is_whiteout(m: &Meta, x: &[(Vec<u8>, Vec<u8>)], prefix: &[u8]) -> bool {
    (m.kind() == libc::S_IFCHR && m.rdev == 0)
        || (m.is_file() && m.size == 0 && ovl_attr(x, prefix, "whiteout").is_some())
}

fn ovl_attr<'x>(x: &'x [(Vec<u8>, Vec<u8>)], prefix: &[u8], name: &str) -> Option<&'x [u8]> {
    x.iter()
        .find(|(k, _)| k.strip_prefix(prefix) == Some(name.as_bytes()))
        .map(|(_, v)| v.as_slice())
}

/// overlayfs's attribute `name` of an upper entry, as the kernel reads it: a rootless
/// overlay (`user.overlay.*`) follows no redirect and has no metacopy, so those two are
/// not read there (any process of the user could set them on the upper directly).
fn followed<'x>(x: &'x [(Vec<u8>, Vec<u8>)], prefix: &[u8], name: &str) -> Option<&'x [u8]> {
    if prefix == USER_PREFIX && matches!(name, "redirect" | "metacopy") {
        return None;
    }
    ovl_attr(x, prefix, name)
}

/// The user's xattrs: overlayfs's own (under `prefix`) left out.
fn user_xattrs(x: Vec<(Vec<u8>, Vec<u8>)>, prefix: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    x.into_iter()
        .filter(|(k, _)| !k.starts_with(prefix))
        .collect()
}

/// An entry renamed, removed or replaced while the walk ran.
fn vanished(e: &std::io::Error) -> bool {
    dirfd::vanished(e)
}

impl UpperCapture<'_> {
    fn tree(&self, id: &TreeId) -> Result<Tree, UpperError> {
        Ok(load_tree(self.objects, id)?)
    }

    /// The entry at `path` ('/'-separated, from the lower's root), if any.
    fn lower_entry(&self, path: &[u8]) -> Result<Option<TreeEntry>, UpperError> {
        let mut tree = self.tree(&self.lower_root)?;
        let parts: Vec<&[u8]> = path
            .split(|b| *b == b'/')
            .filter(|p| !p.is_empty())
            .collect();
        for (i, part) in parts.iter().enumerate() {
            let Some(e) = tree.get(part).cloned() else {
                return Ok(None);
            };
            if i + 1 == parts.len() {
                return Ok(Some(e));
            }
            match e.tree_id() {
                Some(t) => tree = self.tree(&t)?,
                None => return Ok(None),
            }
        }
        Ok(None)
    }

    /// Where a redirect points: an absolute path from the lower's root, or a name in
    /// the parent's lower directory.
    fn redirected(
        &self,
        target: &[u8],
        parent_lower: Option<&Tree>,
    ) -> Result<Option<TreeEntry>, UpperError> {
        if target.starts_with(b"/") {
            self.lower_entry(target)
        } else {
            Ok(parent_lower.and_then(|t| t.get(target).cloned()))
        }
    }

    /// The tree of the merged directory whose upper is `upper` and whose lower is
    /// `lower` (none: a new or opaque directory); `rel` is its path in the workspace.
    /// `upper` (the store's own directory) is the one path opened: everything in it is
    /// read through directory handles ([`crate::sys::dirfd`]), no link followed.
    pub(super) fn dir(
        &mut self,
        upper: &Path,
        rel: &str,
        lower: Option<TreeId>,
    ) -> Result<Option<TreeId>, UpperError> {
        let fd = dirfd::open_dir_path_noatime(upper).map_err(io(upper))?;
        self.dir_at(fd.as_fd(), upper, rel, &[], lower)
    }

    /// [`dir`](Self::dir) of the directory at `key` in the upper, open as `fd` (`upper`
    /// is its path, for messages).
    fn dir_at(
        &mut self,
        fd: BorrowedFd<'_>,
        upper: &Path,
        rel: &str,
        key: &[u8],
        lower: Option<TreeId>,
    ) -> Result<Option<TreeId>, UpperError> {
        if !rel.is_empty() && rel.matches('/').count() >= crate::cas::MAX_TREE_DEPTH {
            return Err(UpperError::Refused(format!(
                "{rel}: more than {} directories deep; casfs stores no deeper tree",
                crate::cas::MAX_TREE_DEPTH
            )));
        }
        let lower_id = lower;
        // From the last checkpoint: the tree as it was, and (for a directory on the way
        // to changes) the names to look at again.
        let mut names_only = None;
        let mut before = None;
        if let Some(r) = &self.reuse {
            if let Some((_, t)) = r.trees.get(key).filter(|(l, _)| *l == lower_id) {
                match r.visit.get(key) {
                    None => return Ok(Some(*t)),
                    Some(Visit::Names(n)) => {
                        names_only = Some(n.clone());
                        before = Some(*t);
                    }
                    Some(Visit::All) => {}
                }
            }
        }
        let whole = names_only.is_none();
        let lower = lower.map(|t| self.tree(&t)).transpose()?;
        // What the listing starts from: the tree as it was (with its id), or the lower's.
        let mut prev = None;
        let (mut listing, names): (BTreeMap<Vec<u8>, TreeEntry>, Vec<Vec<u8>>) =
            match (names_only, before) {
                (Some(n), Some(b)) => {
                    let (_, prev) = prev.insert((b, self.tree(&b)?));
                    let mut names: Vec<Vec<u8>> = n.into_iter().collect();
                    names.sort();
                    let listing = prev
                        .entries()
                        .iter()
                        .map(|e| (e.name.clone(), e.clone()))
                        .collect();
                    (listing, names)
                }
                _ => {
                    let listing = lower
                        .iter()
                        .flat_map(|t| t.entries().iter().cloned())
                        .map(|e| (e.name.clone(), e))
                        .collect();
                    // Listed without touching the directory's access time (the user's):
                    // the handle was opened with O_NOATIME where that is allowed.
                    let mut names: Vec<Vec<u8>> = match dirfd::list_dir_typed(fd) {
                        Ok(rd) => rd.into_iter().map(|e| e.0).collect(),
                        // Renamed or removed while the walk ran: per-entry consistency.
                        Err(e) if vanished(&e) && !rel.is_empty() => return Ok(None),
                        Err(e) => return Err(io(upper)(e)),
                    };
                    names.sort();
                    (listing, names)
                }
            };
        let mut stamps: Vec<(Vec<u8>, Option<Stamp>)> = Vec::with_capacity(names.len());
        for name in names {
            let (stamp, step) = self.entry(fd, upper, rel, key, &name, lower.as_ref())?;
            stamps.push((name.clone(), stamp));
            match step {
                // What the lower shows, where the upper has nothing (or nothing storable).
                Step::Lower => match lower.as_ref().and_then(|t| t.get(&name).cloned()) {
                    Some(e) => {
                        listing.insert(name, e);
                    }
                    None => {
                        listing.remove(&name);
                    }
                },
                Step::Removed => {
                    listing.remove(&name);
                }
                Step::Entry(e) => {
                    listing.insert(name, e);
                }
            }
        }
        let tree = Tree::from_sorted_entries(listing.into_values().collect())
            .map_err(|e| UpperError::Invalid(format!("{}: {e}", upper.display())))?;
        let base = match (&prev, &lower_id, &lower) {
            (Some((id, t)), _, _) => Some((id, t)),
            (None, Some(id), Some(t)) => Some((id, t)),
            _ => None,
        };
        let (id, put) = store_tree_over(self.objects, &tree, base)?;
        let mut s = StoreStats::default();
        s.record(&put);
        self.add(&s);
        self.trees.insert(key.to_vec(), (lower_id, id));
        if whole {
            let l = stamps
                .into_iter()
                .filter_map(|(n, s)| s.map(|s| (n, s)))
                .collect();
            self.listings.insert(key.to_vec(), l);
        } else {
            self.partial.insert(key.to_vec(), stamps);
        }
        Ok(Some(id))
    }

    /// What the upper's entry `name` of directory `upper` (open as `dir`) makes of the
    /// merged directory (whose lower tree is `lower`), and its stamp (none: not in the
    /// upper). The entry is opened first (never followed): its stamp is the `fstat` of
    /// what was opened, and its content is read only from that.
    fn entry(
        &mut self,
        dir: BorrowedFd<'_>,
        upper: &Path,
        rel: &str,
        key: &[u8],
        name: &[u8],
        lower: Option<&Tree>,
    ) -> Result<(Option<Stamp>, Step), UpperError> {
        let name = name.to_vec();
        let path = upper.join(std::ffi::OsStr::from_bytes(&name));
        let child_rel = crate::cas::join_path(rel, &name);
        let cname = CString::new(name.clone())
            .map_err(|_| UpperError::Invalid(format!("{}: a NUL in a name", path.display())))?;
        let opened = match Entry::open(dir, &cname) {
            Ok(e) => e,
            // Removed while the walk ran: per-entry consistency (docs/mount.md).
            Err(e) if vanished(&e) => return Ok((None, Step::Lower)),
            Err(e) => return Err(io(&path)(e)),
        };
        let m = opened.meta;
        let x = match xattr::list_at(dir, &cname, &m) {
            Ok(x) => x,
            Err(e) if vanished(&e) => return Ok((None, Step::Lower)),
            Err(e) => return Err(io(&path)(e)),
        };
        let stamp = Some(Stamp::of(&m));
        let before = lower.and_then(|t| t.get(&name).cloned());
        if is_whiteout(&m, &x, self.prefix) {
            return Ok((stamp, Step::Removed));
        }
        let (kind, size) = if m.is_file() {
            (EntryKind::File, m.size)
        } else if m.is_dir() {
            (EntryKind::Dir, 0)
        } else if m.is_symlink() {
            (EntryKind::Symlink, 0)
        } else {
            (EntryKind::Special, 0)
        };
        if let Some(f) = self.filter {
            if !f.keep(&child_rel, kind, size) {
                // Left out: the lower's entry (if any) stays what the tree holds.
                self.kept_back.push(rel_join(key, &name));
                return Ok((stamp, Step::Lower));
            }
        }
        let entry = |content, size, xattrs| TreeEntry {
            name: name.clone(),
            content,
            mode: m.perm(),
            mtime_ns: m.mtime_ns,
            size,
            xattrs,
        };
        let new = if m.is_dir() {
            let sub_lower = if ovl_attr(&x, self.prefix, "opaque") == Some(b"y") {
                None
            } else if let Some(r) = followed(&x, self.prefix, "redirect") {
                self.redirected(r, lower)?.and_then(|e| e.tree_id())
            } else {
                before.as_ref().and_then(|e| e.tree_id())
            };
            let child_key = rel_join(key, &name);
            let sub = match opened.open_dir_noatime() {
                Ok(s) => s,
                Err(e) if vanished(&e) => return Ok((None, Step::Lower)),
                Err(e) => return Err(io(&path)(e)),
            };
            let Some(id) = self.dir_at(sub.as_fd(), &path, &child_rel, &child_key, sub_lower)?
            else {
                return Ok((stamp, Step::Lower));
            };
            self.stats.dirs_written += 1;
            entry(EntryContent::Dir(id), 0, user_xattrs(x, self.prefix))
        } else if m.is_file() {
            if followed(&x, self.prefix, "metacopy").is_some() {
                // Metadata changed, data still the lower's (where it came from).
                let redirect = followed(&x, self.prefix, "redirect");
                // Straight to a content in an image's data layer, or a path of the lower.
                let data = redirect
                    .and_then(|r| r.strip_prefix(b"/"))
                    .and_then(parse_data_name);
                let from = match (data, redirect) {
                    (Some(f), _) => Some(TreeEntry {
                        name: name.clone(),
                        content: EntryContent::File(f.id),
                        mode: 0,
                        mtime_ns: 0,
                        size: f.size,
                        xattrs: Vec::new(),
                    }),
                    (None, Some(r)) => self.redirected(r, lower)?,
                    (None, None) => before.clone(),
                };
                let Some(EntryContent::File(id)) = from.as_ref().map(|e| e.content.clone()) else {
                    return Err(UpperError::Invalid(format!(
                        "{}: a metacopy file whose lower file is not in the base",
                        path.display()
                    )));
                };
                let size = from.map(|e| e.size).unwrap_or(0);
                entry(EntryContent::File(id), size, user_xattrs(x, self.prefix))
            } else {
                let child_key = rel_join(key, &name);
                let Some((id, size)) = self.file(&opened, &path, &child_rel, &child_key)? else {
                    return Ok((stamp, Step::Lower));
                };
                entry(EntryContent::File(id), size, user_xattrs(x, self.prefix))
            }
        } else if m.is_symlink() {
            let t = match opened.readlink() {
                Ok(t) => t,
                Err(e) if vanished(&e) => return Ok((None, Step::Lower)),
                Err(e) => return Err(io(&path)(e)),
            };
            let len = t.len() as u64;
            entry(EntryContent::Symlink(t), len, user_xattrs(x, self.prefix))
        } else {
            let content = match m.kind() {
                libc::S_IFIFO => EntryContent::Fifo,
                libc::S_IFCHR => EntryContent::CharDevice { rdev: m.rdev },
                libc::S_IFBLK => EntryContent::BlockDevice { rdev: m.rdev },
                _ => {
                    // A socket cannot be stored.
                    self.stats.skipped += 1;
                    return Ok((stamp, Step::Lower));
                }
            };
            entry(content, 0, user_xattrs(x, self.prefix))
        };
        if let Some(f) = self.filter {
            f.vet(rel, &new).map_err(|e| match e {
                FilterError::Refused(why) => UpperError::Refused(format!("{child_rel}: {why}")),
                FilterError::Io(e) => io(&path)(e),
            })?;
        }
        Ok((stamp, Step::Entry(new)))
    }

    fn add(&mut self, s: &StoreStats) {
        self.stats.new_objects += s.new_objects;
        self.stats.new_bytes += s.new_bytes;
        self.stats.reused_objects += s.reused_objects;
    }

    /// Stores an upper file (unless stored unchanged before), returning its id and
    /// size: the file opened (`entry`), reopened for reading. A file that changes while
    /// it is read is read again (three tries), then stored as read: consistency is per
    /// file.
    fn file(
        &mut self,
        entry: &Entry,
        path: &Path,
        rel: &str,
        key: &[u8],
    ) -> Result<Option<(FileId, u64)>, UpperError> {
        let stamp = Stamp::of(&entry.meta);
        if self.filter.is_none() {
            let hit = self.cache.locked().get(&stamp).copied();
            if let Some(hit) = hit {
                if !hit.in_checkpoint {
                    // Read for this checkpoint, ahead of it.
                    self.stats.files_hashed += 1;
                    self.stats.bytes_hashed += hit.size;
                    self.stats.hashed_ahead += 1;
                    self.hashed.push(stamp);
                }
                return Ok(Some((hit.id, hit.size)));
            }
        }
        let mut tries = 0;
        loop {
            tries += 1;
            let mut file = match entry.open_read() {
                Ok(f) => f,
                Err(e) if vanished(&e) => return Ok(None),
                Err(e) => return Err(io(path)(e)),
            };
            let before = Stamp::of(&dirfd::fstat(file.as_fd()).map_err(io(path))?);
            let mut s = StoreStats::default();
            let other = match self.filter {
                Some(f) => f
                    .transform(rel, &mut file, before.size)
                    .map_err(|e| match e {
                        FilterError::Refused(why) => UpperError::Refused(format!("{rel}: {why}")),
                        FilterError::Io(e) => io(path)(e),
                    })?,
                None => None,
            };
            let fref = match other {
                Some(data) => {
                    self.kept_back.push(key.to_vec());
                    store_bytes(self.objects, &data, &mut s)?
                }
                None => {
                    file.rewind().map_err(io(path))?;
                    if before.size <= (1 << 20) {
                        let mut buf = Vec::with_capacity(before.size as usize + 1);
                        file.read_to_end(&mut buf).map_err(io(path))?;
                        store_bytes(self.objects, &buf, &mut s)?
                    } else {
                        store_reader(self.objects, &mut file, path, &mut s)?
                    }
                }
            };
            let after = Stamp::of(&dirfd::fstat(file.as_fd()).map_err(io(path))?);
            self.add(&s);
            self.stats.files_hashed += 1;
            self.stats.bytes_hashed += fref.size;
            if after == before || tries == 3 {
                if after == before && self.filter.is_none() {
                    let hashed = Hashed {
                        id: fref.id,
                        size: fref.size,
                        in_checkpoint: false,
                    };
                    self.cache.locked().insert(before, hashed);
                    self.hashed.push(before);
                } else if after != before {
                    tracing::warn!("{rel}: changed while it was being captured; stored as read");
                }
                return Ok(Some((fref.id, fref.size)));
            }
        }
    }
}

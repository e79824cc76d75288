//! The locked inode table ([`Tx`]: the table's lock plus the dirty-set writes and
//! events of one change, applied together by `commit`): lookups, directory loading,
//! links, the dirty set, set-id rules, the paths of changes announced to subscribers.

use std::collections::BTreeSet;
use std::sync::MutexGuard;

use fuser::{Errno, FileAttr, Request};

use super::events::{FsEvent, FsEventKind};
use super::node::{
    eio, node_from_entry, now_ns, record_of, Body, Children, Links, Meta, Name, Node, FILE_CAPS,
    ROOT,
};
use super::shared::Workspace;
use super::state::{Numbers, State};
use crate::cas::{load_tree, ObjectId, TreeId};
use crate::fs::dirty::{Kind, Override};

/// A locked state with what it needs to persist changes.
pub(super) struct Tx<'a> {
    pub(super) ws: &'a Workspace,
    pub(super) st: MutexGuard<'a, State>,
    pub(super) batch: crate::cas::Batch,
    /// Changes to announce once the batch is written.
    pub(super) events: Vec<(FsEventKind, String, Option<String>, bool)>,
}

impl<'a> Tx<'a> {
    pub(super) fn node(&self, ino: u64) -> Result<&Node, Errno> {
        self.st.nodes.get(&ino).ok_or(Errno::ESTALE)
    }

    pub(super) fn node_mut(&mut self, ino: u64) -> Result<&mut Node, Errno> {
        self.st.nodes.get_mut(&ino).ok_or(Errno::ESTALE)
    }

    pub(super) fn alloc(&mut self, node: Node) -> u64 {
        let ino = self.st.next_ino;
        self.st.next_ino += 1;
        self.st.nodes.insert(ino, Box::new(node));
        ino
    }

    /// The children of directory `ino`, loaded from its tree and overrides on first use.
    pub(super) fn children(&mut self, ino: u64) -> Result<&Children, Errno> {
        self.load_dir(ino)?;
        match &self.node(ino)?.body {
            Body::Dir {
                children: Some(c), ..
            } => Ok(c),
            _ => Err(Errno::ENOTDIR),
        }
    }

    /// [`Tx::load_dir`], and when it loads `ino` now, the trees of its subdirectories
    /// (none of them loaded yet) are added to `ahead`.
    pub(super) fn load_dir_reading_ahead(
        &mut self,
        ino: u64,
        ahead: &mut Vec<ObjectId>,
    ) -> Result<(), Errno> {
        if matches!(
            self.node(ino)?.body,
            Body::Dir {
                children: Some(_),
                ..
            }
        ) {
            return Ok(());
        }
        self.load_dir(ino)?;
        let kids: Vec<u64> = self.children(ino)?.iter().map(|(_, c)| *c).collect();
        for c in kids {
            if let Body::Dir {
                children: None,
                tree: Some(t),
            } = &self.node(c)?.body
            {
                ahead.push(ObjectId(t.0));
            }
        }
        Ok(())
    }

    pub(super) fn load_dir(&mut self, ino: u64) -> Result<(), Errno> {
        let n = self.node(ino)?;
        let (tree, dirty) = match &n.body {
            Body::Dir {
                children: Some(_), ..
            } => return Ok(()),
            Body::Dir { tree, .. } => (*tree, n.dirty),
            _ => return Err(Errno::ENOTDIR),
        };
        let mut children = Children::default();
        let remembered = self.st.unloaded.remove(&ino);
        if let Some(t) = tree {
            let tree = load_tree(self.ws.objects.as_ref(), &t).map_err(eio)?;
            // In name order (a tree's entries are sorted), as the numbers its children
            // had before they were unloaded.
            let entries = tree.into_entries();
            let reuse =
                remembered.and_then(|(rt, v)| (rt == t && v.len() == entries.len()).then_some(v));
            let mut sorted = Vec::with_capacity(entries.len());
            for (k, e) in entries.into_iter().enumerate() {
                let node = node_from_entry(&e, ino, self.ws.owner);
                let child = match reuse.as_ref().map(|v| v.get(k)) {
                    Some(old) if !self.st.nodes.contains_key(&old) => {
                        self.st.nodes.insert(old, Box::new(node));
                        old
                    }
                    _ => self.alloc(node),
                };
                sorted.push((Name::from_slice(&e.name), child));
            }
            children = Children::from_sorted(sorted);
        }
        if dirty {
            for (name, o) in self.ws.dirty.entries(ino).map_err(eio)? {
                if let Some(old) = children.remove(name.as_slice()) {
                    self.st.nodes.remove(&old);
                }
                if let Override::Node(c) = o {
                    match self.st.nodes.get_mut(&c) {
                        Some(child) => {
                            if !child
                                .links
                                .iter()
                                .any(|l| l.0 == ino && l.1[..] == name[..])
                            {
                                child.links.push((ino, Name::from_slice(&name)));
                            }
                            children.insert(Name::from_slice(&name), c);
                        }
                        None => tracing::error!(
                            "dirty set: entry {:?} of directory {ino} names missing node {c}",
                            String::from_utf8_lossy(&name)
                        ),
                    }
                }
            }
        }
        let subdirs = children
            .values()
            .filter(|c| self.st.nodes.get(c).is_some_and(|n| n.kind == Kind::Dir))
            .count() as u32;
        let n = self.node_mut(ino)?;
        n.meta.nlink = 2 + subdirs;
        if let Body::Dir { children: c, .. } = &mut n.body {
            *c = Some(children);
        }
        Ok(())
    }

    /// The kernel forgot `count` lookups of `ino`; a clean node it no longer knows puts
    /// its directory on `queue`, to be unloaded by [`Tx::unload`].
    pub(super) fn forget(&mut self, ino: u64, count: u64, queue: &mut Vec<u64>) {
        let Some(n) = self.st.nodes.get_mut(&ino) else {
            // A node of a tree a root swap replaced, or already unloaded.
            return;
        };
        n.forgot(count);
        if n.lookups == 0 && ino != ROOT && !n.dirty && n.links.len() == 1 {
            queue.push(n.links[0].0);
        }
    }

    /// Unloads the children of each directory in `queue` (and then of its ancestors,
    /// bottom up) when every one of them is unused: clean, unknown to the kernel, not
    /// open, without a local copy, and if a directory, unloaded itself. The directory
    /// keeps its node (with its tree) and lists its children from the tree again when
    /// next used, under the same inode numbers. Returns how many nodes went.
    pub(super) fn unload(&mut self, queue: Vec<u64>) -> usize {
        let mut pending: BTreeSet<u64> = queue.into_iter().collect();
        let mut dropped = 0;
        while let Some(dir) = pending.pop_last() {
            let Some((tree, children)) = self.unused_children(dir) else {
                continue;
            };
            for c in &children {
                self.st.nodes.remove(c);
            }
            dropped += children.len();
            self.st.unloaded.insert(dir, (tree, Numbers::of(children)));
            let Some(n) = self.st.nodes.get_mut(&dir) else {
                continue;
            };
            if let Body::Dir { children: c, .. } = &mut n.body {
                *c = None;
            }
            if dir != ROOT && n.lookups == 0 && n.links.len() == 1 {
                pending.insert(n.links[0].0);
            }
        }
        let nodes = &mut self.st.nodes;
        if dropped > 0 && nodes.capacity() > 4 * nodes.len() + 4096 {
            nodes.shrink_to_fit();
            self.st.unloaded.shrink_to_fit();
        }
        dropped
    }

    /// Directory `dir`'s tree and its children in name order, if it is clean and every
    /// child is unused (see [`Tx::unload`]).
    fn unused_children(&self, dir: u64) -> Option<(TreeId, Vec<u64>)> {
        let n = self.st.nodes.get(&dir)?;
        let Body::Dir {
            tree: Some(tree),
            children: Some(children),
        } = &n.body
        else {
            return None;
        };
        if n.dirty {
            return None;
        }
        let mut inos = Vec::with_capacity(children.len());
        for &c in children.values() {
            let c_node = self.st.nodes.get(&c)?;
            let unused = c_node.lookups == 0
                && !c_node.dirty
                && !c_node.is_open()
                && c_node.extra().writers == 0
                && c_node.links.len() == 1
                && match &c_node.body {
                    Body::Dir { children, .. } => children.is_none(),
                    Body::File { upper, .. } => upper.is_none(),
                    _ => true,
                };
            if !unused {
                return None;
            }
            inos.push(c);
        }
        Some((*tree, inos))
    }

    /// Whether directory `dir` is `ancestor` or below it.
    pub(super) fn is_within(&self, dir: u64, ancestor: u64) -> Result<bool, Errno> {
        let mut cur = dir;
        loop {
            if cur == ancestor {
                return Ok(true);
            }
            if cur == ROOT {
                return Ok(false);
            }
            cur = self.node(cur)?.parent();
        }
    }

    pub(super) fn lookup(&mut self, parent: u64, name: &[u8]) -> Result<Option<u64>, Errno> {
        Ok(self.children(parent)?.get(name).copied())
    }

    /// Writes node `ino`'s record and makes sure every directory that links it is dirty
    /// and points at it.
    pub(super) fn persist(&mut self, ino: u64) -> Result<(), Errno> {
        let n = self.node(ino)?;
        let rec = record_of(n);
        let was_dirty = n.dirty;
        let links = n.links.clone();
        self.ws.dirty.put_node(&mut self.batch, ino, &rec);
        if was_dirty {
            return Ok(());
        }
        self.node_mut(ino)?.dirty = true;
        self.st.dirty.insert(ino);
        for (dir, name) in links {
            self.ws
                .dirty
                .put_entry(&mut self.batch, dir, &name, Override::Node(ino));
            if !self.node(dir)?.dirty {
                self.persist(dir)?;
            }
        }
        Ok(())
    }

    /// Marks directory `dir`'s content changed now and persists it.
    pub(super) fn touch_dir(&mut self, dir: u64) -> Result<(), Errno> {
        let t = now_ns();
        let n = self.node_mut(dir)?;
        n.meta.mtime = t;
        n.meta.ctime = t;
        self.persist(dir)
    }

    pub(super) fn attach(&mut self, dir: u64, name: &[u8], child: u64) -> Result<(), Errno> {
        let is_dir = self.node(child)?.kind == Kind::Dir;
        {
            let c = self.node_mut(child)?;
            c.links.push((dir, Name::from_slice(name)));
        }
        let d = self.node_mut(dir)?;
        if let Body::Dir {
            children: Some(ch), ..
        } = &mut d.body
        {
            ch.insert(Name::from_slice(name), child);
            if is_dir {
                d.meta.nlink += 1;
            }
        }
        if self.node(child)?.dirty {
            self.ws
                .dirty
                .put_entry(&mut self.batch, dir, name, Override::Node(child));
        }
        self.touch_dir(dir)?;
        self.persist(child)
    }

    /// Removes entry `name` from `dir` (the node stays in the table).
    pub(super) fn detach(&mut self, dir: u64, name: &[u8]) -> Result<u64, Errno> {
        let child = self.lookup(dir, name)?.ok_or(Errno::ENOENT)?;
        let is_dir = self.node(child)?.kind == Kind::Dir;
        let d = self.node_mut(dir)?;
        if let Body::Dir {
            children: Some(ch), ..
        } = &mut d.body
        {
            ch.remove(name);
            if is_dir {
                d.meta.nlink -= 1;
            }
        }
        let c = self.node_mut(child)?;
        c.links.retain(|l| !(l.0 == dir && l.1[..] == *name));
        self.ws
            .dirty
            .put_entry(&mut self.batch, dir, name, Override::Whiteout);
        self.touch_dir(dir)?;
        Ok(child)
    }

    /// Node `ino`'s metadata changed at `t`: it no longer equals its base entry, and its
    /// record (with its links) is written.
    pub(super) fn changed(&mut self, ino: u64, t: i64) -> Result<(), Errno> {
        let n = self.node_mut(ino)?;
        n.meta.ctime = t;
        self.persist(ino)
    }

    /// What a write or truncate does to a file, as the kernel's VFS does it (the daemon
    /// does it here: FUSE_HANDLE_KILLPRIV_V2). By a caller without `CAP_FSETID`
    /// (`by: Some(request)`): setuid goes, and setgid if the group may execute or the
    /// caller is not in the file's group. File capabilities go in any case. Persists
    /// only a change.
    pub(super) fn kill_privs(&mut self, ino: u64, by: Option<&Request>) -> Result<(), Errno> {
        let n = self.node_mut(ino)?;
        if n.kind != Kind::File {
            return Ok(());
        }
        let before = (n.meta.mode, n.xattrs().len());
        if by.is_some() {
            n.meta.mode &= !libc::S_ISUID;
            if sgid_goes(n.meta.mode, n.meta.gid, by) {
                n.meta.mode &= !libc::S_ISGID;
            }
        }
        if n.xattrs().iter().any(|(k, _)| k == FILE_CAPS) {
            n.xattrs_mut().retain(|(k, _)| k != FILE_CAPS);
            n.settle_extra();
        }
        if (n.meta.mode, n.xattrs().len()) != before {
            self.changed(ino, now_ns())?;
        }
        Ok(())
    }

    /// One name of `ino` was detached: a directory is gone, a file loses a link and goes
    /// with its last one (once closed).
    pub(super) fn drop_link(&mut self, ino: u64) -> Result<(), Errno> {
        let n = self.node_mut(ino)?;
        n.meta.nlink = if n.kind == Kind::Dir {
            0
        } else {
            n.meta.nlink.saturating_sub(1)
        };
        let t = now_ns();
        n.meta.ctime = t;
        if n.meta.nlink > 0 {
            self.changed(ino, t)?;
        }
        self.maybe_free(ino);
        Ok(())
    }

    /// Closes the upper file of `ino` if no handle needs it open.
    pub(super) fn close_if_idle(&mut self, ino: u64) {
        if let Some(n) = self.st.nodes.get_mut(&ino) {
            if !n.is_open() {
                n.close_upper();
            }
        }
    }

    pub(super) fn commit(mut self) -> Result<(), Errno> {
        if !self.batch.is_empty() {
            let batch = std::mem::take(&mut self.batch);
            self.ws.dirty.commit(batch).map_err(eio)?;
        }
        // Sent while the table is held: subscribers see changes in the order made.
        let events = std::mem::take(&mut self.events);
        let ev = &mut self.st.events;
        for (kind, path, to, is_dir) in events {
            ev.seq += 1;
            let e = FsEvent {
                seq: ev.seq,
                kind,
                path,
                to,
                is_dir,
            };
            ev.subscribers.retain(|s| s.send(e.clone()).is_ok());
        }
        Ok(())
    }

    pub(super) fn attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        Ok(self.ws.attr_of(ino, self.node(ino)?))
    }

    pub(super) fn make_node(
        &self,
        kind: Kind,
        mode: u32,
        req: &Request,
        parent: u64,
        body: Body,
    ) -> Node {
        let t = now_ns();
        let pm = self
            .st
            .nodes
            .get(&parent)
            .map(|p| p.meta)
            .unwrap_or_default();
        let mut mode = mode & 0o7777;
        let gid = if pm.mode & libc::S_ISGID != 0 {
            if kind == Kind::Dir {
                mode |= libc::S_ISGID;
            }
            pm.gid
        } else {
            req.gid()
        };
        Node {
            ino: 0,
            kind,
            meta: Meta {
                mode,
                uid: req.uid(),
                gid,
                nlink: if kind == Kind::Dir { 2 } else { 1 },
                atime: t,
                mtime: t,
                ctime: t,
                size: 0,
                blocks: 0,
            },
            links: Links::new(),
            body,
            dirty: false,
            extra: None,
            lookups: 0,
        }
    }

    pub(super) fn path_of(&self, ino: u64) -> String {
        let mut parts = Vec::new();
        let mut cur = ino;
        let mut guard = 0;
        while cur != ROOT && guard < 4096 {
            let Some(n) = self.st.nodes.get(&cur) else {
                break;
            };
            let Some((p, name)) = n.links.first() else {
                return format!("(unlinked inode {ino})");
            };
            parts.push(String::from_utf8_lossy(name).into_owned());
            cur = *p;
            guard += 1;
        }
        parts.reverse();
        parts.join("/")
    }
}

/// Whether the caller of `req` is in group `gid` (its group, or one of its supplementary
/// groups as /proc tells).
/// The VFS's setgid rule (`setattr_should_drop_sgid`): the bit goes when the group may
/// execute, or when the caller (`by`: one without `CAP_FSETID`; None for root) is not in
/// the file's group `gid`.
pub(super) fn sgid_goes(mode: u32, gid: u32, by: Option<&Request>) -> bool {
    mode & libc::S_ISGID != 0
        && (mode & libc::S_IXGRP != 0 || by.is_some_and(|r| !in_group(r, gid)))
}

pub(super) fn in_group(req: &Request, gid: u32) -> bool {
    if req.gid() == gid {
        return true;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{}/status", req.pid())) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(gid)))
}

impl<'a> Tx<'a> {
    /// Whether anyone listens for changes (paths are worked out only then).
    pub(super) fn watched(&self) -> bool {
        !self.st.events.subscribers.is_empty()
    }

    /// The path of entry `name` of directory `dir`.
    pub(super) fn entry_path(&self, dir: u64, name: &[u8]) -> String {
        let d = self.path_of(dir);
        let n = String::from_utf8_lossy(name);
        if d.is_empty() {
            n.into_owned()
        } else {
            format!("{d}/{n}")
        }
    }

    /// Announces that entry `n1` of `p` becomes entry `n2` of `np`.
    pub(super) fn rename_event(&mut self, p: u64, n1: &[u8], np: u64, n2: &[u8], is_dir: bool) {
        if self.watched() {
            let (from, to) = (self.entry_path(p, n1), self.entry_path(np, n2));
            self.events
                .push((FsEventKind::Rename, from, Some(to), is_dir));
        }
    }

    /// Announces a change to entry `name` of `dir` when the transaction commits.
    pub(super) fn event(&mut self, kind: FsEventKind, dir: u64, name: &[u8], is_dir: bool) {
        if self.watched() {
            let path = self.entry_path(dir, name);
            self.events.push((kind, path, None, is_dir));
        }
    }
}

impl Workspace {
    /// The table locked for one change.
    pub(super) fn tx(&self) -> Tx<'_> {
        Tx {
            ws: self,
            st: self.lock(),
            batch: crate::cas::Batch::default(),
            events: Vec::new(),
        }
    }
}

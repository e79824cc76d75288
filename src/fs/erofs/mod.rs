//! A stored tree as an EROFS metadata image, composefs-style: the kernel serves every
//! lookup, listing and stat of the tree from the image with no daemon in the way, and
//! overlayfs fetches file contents from a data-only layer (casfs's object view,
//! [`crate::fs::view::mount_objects`]) by the redirect each file carries.
//!
//! Layout (Documentation/filesystems/erofs.rst, include/erofs_fs.h), 4 KiB blocks:
//! block 0 holds the superblock at byte 1024; the metadata area starts at block 1 with
//! the root's inode first (its nid must fit 16 bits), then every inode in breadth-first
//! order, each 32-byte aligned: a 64-byte extended inode, its xattrs inline, then its
//! inline tail (a directory's last block of entries, a symlink's target, a file's one
//! chunk index). Directory blocks that do not fit inline follow the metadata area.
//!
//! A regular file with content is chunk-based with a single null chunk (no data in the
//! image: it reads as zeros if opened directly) and carries
//! `trusted.overlay.metacopy` (empty: no digest) and `trusted.overlay.redirect` =
//! `/<file id>-<size>`, the path of its content in the data-only layer. Empty files are
//! plain empty files.
//!
//! What the image cannot say the way the tree does is refused ([`ImageError::Unsupported`])
//! and the caller serves that tree through FUSE instead: an xattr value over 65,535
//! bytes, an xattr in overlayfs's own `trusted.overlay.` namespace, a 0/0 character
//! device (overlayfs would read it as a whiteout), a device number beyond the kernel's
//! 12/20-bit encoding.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;

use crate::cas::{load_tree, CasError, EntryContent, FileRef, ObjectStore, TreeEntry, TreeId};

const BLOCK: usize = 4096;
const SLOT: usize = 32;
const INODE_SIZE: usize = 64;
const DIRENT_SIZE: usize = 12;
const XATTR_HEADER: usize = 12;
/// Largest directory tail kept inline with its inode (as composefs).
const MAX_INLINE_DIR_TAIL: usize = 2048;

const MAGIC: u32 = 0xE0F5_E1E2;
const FEATURE_INCOMPAT_CHUNKED_FILE: u32 = 0x4;

const LAYOUT_EXTENDED: u16 = 1;
const FLAT_PLAIN: u16 = 0;
const FLAT_INLINE: u16 = 2 << 1;
const CHUNK_BASED: u16 = 4 << 1;
/// Chunk format: chunk size `4 KiB << 31`, so any file is one chunk.
const ONE_CHUNK: u32 = 31;
const NULL_ADDR: u32 = 0xFFFF_FFFF;

/// Prefixes EROFS stores xattr names under (index into this table).
const XATTR_PREFIXES: [&[u8]; 7] = [
    b"",
    b"user.",
    b"system.posix_acl_access",
    b"system.posix_acl_default",
    b"trusted.",
    b"lustre.",
    b"security.",
];

/// Why no image was built.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("the tree cannot be an EROFS image: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Cas(#[from] CasError),
    #[error("writing {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

/// What a built image holds.
#[derive(Debug, Clone, Copy, Default)]
pub struct ImageStats {
    pub inodes: u64,
    pub bytes: u64,
}

/// The path of a file's content in the data-only layer: `/<id>-<size>`.
pub fn data_path(f: &FileRef) -> String {
    format!("/{}-{}", f.id.0.to_hex(), f.size)
}

/// The file named by a data-layer name (`<id>-<size>`, no slash), if it is one.
pub fn parse_data_name(name: &[u8]) -> Option<FileRef> {
    let s = std::str::from_utf8(name).ok()?;
    let (hex, size) = s.split_once('-')?;
    if size.is_empty() || !size.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let id = crate::cas::Hash::from_hex(hex)?;
    Some(FileRef {
        id: crate::cas::FileId(id),
        size: size.parse().ok()?,
    })
}

enum Body {
    Dir {
        /// Entries sorted by name, `.` and `..` included: (name, node, file type).
        entries: Vec<(Vec<u8>, usize, u8)>,
        /// Entry counts of each block; the last is the tail.
        blocks: Vec<usize>,
        /// Bytes used in the last block.
        tail: usize,
    },
    File(Option<FileRef>),
    Symlink(Vec<u8>),
    /// The kernel's encoding of the device number, and whether a block device.
    Device {
        rdev: u32,
        block: bool,
    },
    Fifo,
}

struct Node {
    parent: usize,
    mode: u16,
    mtime_ns: i64,
    xattrs: Vec<(u8, Vec<u8>, Vec<u8>)>,
    body: Body,
    /// Placed by the layout.
    nid: u64,
    inline: bool,
    blkaddr: u32,
}

impl Node {
    fn xattr_size(&self) -> usize {
        if self.xattrs.is_empty() {
            return 0;
        }
        XATTR_HEADER
            + self
                .xattrs
                .iter()
                .map(|(_, n, v)| (4 + n.len() + v.len()).next_multiple_of(4))
                .sum::<usize>()
    }

    fn size(&self) -> u64 {
        match &self.body {
            Body::Dir { blocks, tail, .. } => ((blocks.len() - 1) * BLOCK + tail) as u64,
            Body::File(f) => f.map_or(0, |f| f.size),
            Body::Symlink(t) => t.len() as u64,
            Body::Device { .. } | Body::Fifo => 0,
        }
    }

    /// Bytes that may follow the inode and its xattrs in the metadata area.
    fn tail_len(&self) -> usize {
        match &self.body {
            Body::Dir { tail, .. } => *tail,
            Body::File(Some(_)) => 4,
            Body::Symlink(t) => t.len(),
            _ => 0,
        }
    }

    /// Blocks of data outside the metadata area.
    fn data_blocks(&self) -> usize {
        match &self.body {
            Body::Dir { blocks, .. } if self.inline => blocks.len() - 1,
            Body::Dir { blocks, .. } => blocks.len(),
            Body::Symlink(_) if !self.inline => 1,
            _ => 0,
        }
    }

    fn file_type(&self) -> (u8, u16) {
        match &self.body {
            Body::Dir { .. } => (2, libc::S_IFDIR as u16),
            Body::File(_) => (1, libc::S_IFREG as u16),
            Body::Symlink(_) => (7, libc::S_IFLNK as u16),
            Body::Fifo => (5, libc::S_IFIFO as u16),
            Body::Device { block: true, .. } => (4, libc::S_IFBLK as u16),
            Body::Device { block: false, .. } => (3, libc::S_IFCHR as u16),
        }
    }
}

fn unsupported(path: &str, why: &str) -> ImageError {
    ImageError::Unsupported(format!("{path:?}: {why}"))
}

/// The kernel's `new_encode_dev` of a `dev_t`, if it fits 12-bit major, 20-bit minor.
fn encode_dev(rdev: u64) -> Option<u32> {
    let (major, minor) = (
        u64::from(rustix::fs::major(rdev)),
        u64::from(rustix::fs::minor(rdev)),
    );
    if major >= 1 << 12 || minor >= 1 << 20 {
        return None;
    }
    Some(((minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)) as u32)
}

fn node_of(e: &TreeEntry, parent: usize, path: &str) -> Result<Node, ImageError> {
    let mut xattrs = Vec::with_capacity(e.xattrs.len() + 2);
    for (k, v) in &e.xattrs {
        if k.starts_with(b"trusted.overlay.") {
            return Err(unsupported(path, "an xattr in overlayfs's namespace"));
        }
        if v.len() > u16::MAX as usize {
            return Err(unsupported(path, "an xattr value over 65535 bytes"));
        }
        let (i, p) = XATTR_PREFIXES
            .iter()
            .enumerate()
            .rev()
            .find(|(_, p)| k.starts_with(p))
            .expect("the empty prefix matches");
        let suffix = k[p.len()..].to_vec();
        if suffix.len() > u8::MAX as usize {
            return Err(unsupported(path, "an xattr name over 255 bytes"));
        }
        xattrs.push((i as u8, suffix, v.clone()));
    }
    let mode = (e.mode & 0o7777) as u16;
    let body = match &e.content {
        EntryContent::Dir(_) => Body::Dir {
            entries: Vec::new(),
            blocks: Vec::new(),
            tail: 0,
        },
        EntryContent::File(id) => {
            let f = (e.size > 0).then_some(FileRef {
                id: *id,
                size: e.size,
            });
            if let Some(f) = &f {
                xattrs.push((4, b"overlay.metacopy".to_vec(), Vec::new()));
                xattrs.push((4, b"overlay.redirect".to_vec(), data_path(f).into_bytes()));
            }
            Body::File(f)
        }
        EntryContent::Symlink(t) => Body::Symlink(t.clone()),
        EntryContent::Fifo => Body::Fifo,
        EntryContent::CharDevice { rdev } | EntryContent::BlockDevice { rdev } => {
            let block = matches!(e.content, EntryContent::BlockDevice { .. });
            if !block && *rdev == 0 {
                return Err(unsupported(path, "a 0/0 character device (a whiteout)"));
            }
            let rdev = encode_dev(*rdev)
                .ok_or_else(|| unsupported(path, "a device number beyond 12/20 bits"))?;
            Body::Device { rdev, block }
        }
    };
    Ok(Node {
        parent,
        mode,
        mtime_ns: e.mtime_ns,
        xattrs,
        body,
        nid: 0,
        inline: false,
        blkaddr: 0,
    })
}

/// Splits sorted entries into blocks: the entry count of each (at least one block).
fn split_blocks(entries: &[(Vec<u8>, usize, u8)]) -> (Vec<usize>, usize) {
    let mut blocks = Vec::new();
    let (mut n, mut used) = (0usize, 0usize);
    for (name, _, _) in entries {
        let size = DIRENT_SIZE + name.len();
        if used + size > BLOCK {
            blocks.push(n);
            (n, used) = (0, 0);
        }
        n += 1;
        used += size;
    }
    blocks.push(n);
    (blocks, used)
}

/// Reads every directory of `root` into nodes, breadth-first (root first).
fn collect(objects: &dyn ObjectStore, root: &TreeId) -> Result<Vec<Node>, ImageError> {
    let root_entry = TreeEntry {
        name: Vec::new(),
        content: EntryContent::Dir(*root),
        mode: 0o755,
        mtime_ns: 0,
        size: 0,
        xattrs: Vec::new(),
    };
    let mut nodes = vec![node_of(&root_entry, 0, "/")?];
    let mut queue = VecDeque::from([(0usize, *root, String::new())]);
    while let Some((dir, id, path)) = queue.pop_front() {
        let tree = load_tree(objects, &id)?;
        let mut entries = Vec::with_capacity(tree.len() + 2);
        entries.push((b".".to_vec(), dir, 2));
        entries.push((b"..".to_vec(), nodes[dir].parent, 2));
        for e in tree.entries() {
            let child_path = format!("{path}/{}", e.name_lossy());
            let node = node_of(e, dir, &child_path)?;
            let idx = nodes.len();
            if let EntryContent::Dir(sub) = e.content {
                queue.push_back((idx, sub, child_path));
            }
            entries.push((e.name.clone(), idx, node.file_type().0));
            nodes.push(node);
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let (blocks, tail) = split_blocks(&entries);
        nodes[dir].body = Body::Dir {
            entries,
            blocks,
            tail,
        };
    }
    Ok(nodes)
}

/// Places every inode (nid, inline or not) and every data block; returns the number
/// of blocks of the image.
fn layout(nodes: &mut [Node]) -> Result<u32, ImageError> {
    let mut pos = 0usize;
    for n in nodes.iter_mut() {
        pos = pos.next_multiple_of(SLOT);
        let head = INODE_SIZE + n.xattr_size();
        let tail = n.tail_len();
        n.inline = match n.body {
            Body::Dir { .. } => tail <= MAX_INLINE_DIR_TAIL && head + tail <= BLOCK,
            Body::Symlink(_) => head + tail <= BLOCK,
            Body::File(Some(_)) => true,
            _ => false,
        };
        if n.inline && tail > 0 {
            // Inline data never crosses a block boundary: start the inode on a fresh
            // block if it would.
            let start = pos + head;
            if start / BLOCK != (start + tail - 1) / BLOCK {
                pos = pos.next_multiple_of(BLOCK);
            }
        }
        n.nid = (pos / SLOT) as u64;
        pos += head + if n.inline { tail } else { 0 };
    }
    if nodes[0].nid != 0 {
        return Err(ImageError::Unsupported("root not at nid 0".into()));
    }
    let mut block = 1 + pos.div_ceil(BLOCK);
    for n in nodes.iter_mut() {
        let b = n.data_blocks();
        if b > 0 {
            n.blkaddr = u32::try_from(block)
                .map_err(|_| ImageError::Unsupported("over 2^32 blocks".into()))?;
            block += b;
        }
    }
    u32::try_from(block).map_err(|_| ImageError::Unsupported("over 2^32 blocks".into()))
}

/// A sequential writer that knows its offset.
struct Out<W: Write> {
    w: W,
    pos: usize,
}

impl<W: Write> Out<W> {
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.pos += b.len();
        self.w.write_all(b)
    }

    fn zeros(&mut self, n: usize) -> std::io::Result<()> {
        const Z: [u8; BLOCK] = [0; BLOCK];
        let mut left = n;
        while left > 0 {
            let k = left.min(BLOCK);
            self.put(&Z[..k])?;
            left -= k;
        }
        Ok(())
    }

    fn pad_to(&mut self, offset: usize) -> std::io::Result<()> {
        self.zeros(offset - self.pos)
    }
}

/// Appends one block of directory entries (dirents, then their names) to `out`.
fn dir_block(nodes: &[Node], entries: &[(Vec<u8>, usize, u8)], out: &mut Vec<u8>) {
    let mut nameoff = DIRENT_SIZE * entries.len();
    for (name, node, ft) in entries {
        out.extend_from_slice(&nodes[*node].nid.to_le_bytes());
        out.extend_from_slice(&(nameoff as u16).to_le_bytes());
        out.push(*ft);
        out.push(0);
        nameoff += name.len();
    }
    for (name, _, _) in entries {
        out.extend_from_slice(name);
    }
}

/// An inode as it is written: header, xattrs and inline tail.
fn inode_bytes(nodes: &[Node], n: &Node, uid: u32, gid: u32) -> Result<Vec<u8>, ImageError> {
    let layout = match &n.body {
        Body::File(Some(_)) => CHUNK_BASED,
        Body::Dir { .. } | Body::Symlink(_) if n.inline => FLAT_INLINE,
        _ => FLAT_PLAIN,
    };
    let i_u = match &n.body {
        Body::File(Some(_)) => ONE_CHUNK,
        Body::Device { rdev, .. } => *rdev,
        _ => n.blkaddr,
    };
    let nlink: u32 = match &n.body {
        Body::Dir { entries, .. } => entries.iter().filter(|e| e.2 == 2).count() as u32,
        _ => 1,
    };
    let xsize = n.xattr_size();
    let icount: u16 = if xsize == 0 {
        0
    } else {
        u16::try_from((xsize - XATTR_HEADER) / 4 + 1)
            .map_err(|_| ImageError::Unsupported("xattrs over 256 KiB on one entry".into()))?
    };
    let mut b = Vec::with_capacity(INODE_SIZE + xsize + n.tail_len());
    b.extend_from_slice(&(LAYOUT_EXTENDED | layout).to_le_bytes());
    b.extend_from_slice(&icount.to_le_bytes());
    b.extend_from_slice(&(n.file_type().1 | (n.mode & 0o7777)).to_le_bytes());
    b.extend_from_slice(&0u16.to_le_bytes());
    b.extend_from_slice(&n.size().to_le_bytes());
    b.extend_from_slice(&i_u.to_le_bytes());
    b.extend_from_slice(&(n.nid as u32).to_le_bytes());
    b.extend_from_slice(&uid.to_le_bytes());
    b.extend_from_slice(&gid.to_le_bytes());
    let (secs, nsec) = (
        n.mtime_ns.div_euclid(1_000_000_000),
        n.mtime_ns.rem_euclid(1_000_000_000) as u32,
    );
    b.extend_from_slice(&(secs as u64).to_le_bytes());
    b.extend_from_slice(&nsec.to_le_bytes());
    b.extend_from_slice(&nlink.to_le_bytes());
    b.extend_from_slice(&[0; 16]);
    if xsize > 0 {
        b.extend_from_slice(&[0; XATTR_HEADER]);
        for (index, name, value) in &n.xattrs {
            b.push(name.len() as u8);
            b.push(*index);
            b.extend_from_slice(&(value.len() as u16).to_le_bytes());
            b.extend_from_slice(name);
            b.extend_from_slice(value);
            b.resize(b.len().next_multiple_of(4), 0);
        }
    }
    if n.inline {
        match &n.body {
            Body::Dir {
                entries, blocks, ..
            } => {
                let first = blocks[..blocks.len() - 1].iter().sum::<usize>();
                dir_block(nodes, &entries[first..], &mut b);
            }
            Body::File(Some(_)) => b.extend_from_slice(&NULL_ADDR.to_le_bytes()),
            Body::Symlink(t) => b.extend_from_slice(t),
            _ => {}
        }
    }
    Ok(b)
}

/// Writes the EROFS image of tree `root` to `path` (through a temporary file renamed
/// into place, so a reader never sees half an image). Files are owned by `uid`/`gid`.
pub fn write_image(
    objects: &dyn ObjectStore,
    root: &TreeId,
    path: &Path,
    uid: u32,
    gid: u32,
) -> Result<ImageStats, ImageError> {
    let mut nodes = collect(objects, root)?;
    let blocks = layout(&mut nodes)?;
    let io = |source| ImageError::Io {
        path: path.display().to_string(),
        source,
    };
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(".{}-{n}.tmp", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp_name);
    let result = write_to(&nodes, blocks, root, &tmp, uid, gid)
        .and_then(|bytes| std::fs::rename(&tmp, path).map(|_| bytes).map_err(io));
    match result {
        Ok(bytes) => Ok(ImageStats {
            inodes: nodes.len() as u64,
            bytes,
        }),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

fn write_to(
    nodes: &[Node],
    blocks: u32,
    root: &TreeId,
    path: &Path,
    uid: u32,
    gid: u32,
) -> Result<u64, ImageError> {
    let io = |source| ImageError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, &file);
    let pos = encode(nodes, blocks, root, &mut w, uid, gid, &io)?;
    w.flush().map_err(io)?;
    drop(w);
    file.sync_all().map_err(io)?;
    Ok(pos)
}

/// Writes the image of laid-out `nodes` to `w`; returns its length.
fn encode<W: Write>(
    nodes: &[Node],
    blocks: u32,
    root: &TreeId,
    w: W,
    uid: u32,
    gid: u32,
    io: &dyn Fn(std::io::Error) -> ImageError,
) -> Result<u64, ImageError> {
    let mut out = Out { w, pos: 0 };
    let mut sb = Vec::with_capacity(128);
    sb.extend_from_slice(&MAGIC.to_le_bytes());
    sb.extend_from_slice(&0u32.to_le_bytes()); // checksum (feature off)
    sb.extend_from_slice(&0u32.to_le_bytes()); // feature_compat
    sb.push(12); // blkszbits
    sb.push(0); // extslots
    sb.extend_from_slice(&0u16.to_le_bytes()); // root_nid
    sb.extend_from_slice(&(nodes.len() as u64).to_le_bytes());
    sb.extend_from_slice(&0u64.to_le_bytes()); // build_time
    sb.extend_from_slice(&0u32.to_le_bytes()); // build_time_nsec
    sb.extend_from_slice(&blocks.to_le_bytes());
    sb.extend_from_slice(&1u32.to_le_bytes()); // meta_blkaddr
    sb.extend_from_slice(&0u32.to_le_bytes()); // xattr_blkaddr
    sb.extend_from_slice(&root.0 .0[..16]); // uuid
    sb.extend_from_slice(b"casfs\0\0\0\0\0\0\0\0\0\0\0"); // volume name
    sb.extend_from_slice(&FEATURE_INCOMPAT_CHUNKED_FILE.to_le_bytes());
    sb.resize(128, 0);
    out.pad_to(1024).map_err(io)?;
    out.put(&sb).map_err(io)?;
    out.pad_to(BLOCK).map_err(io)?;
    for n in nodes {
        out.pad_to(BLOCK + n.nid as usize * SLOT).map_err(io)?;
        let b = inode_bytes(nodes, n, uid, gid)?;
        out.put(&b).map_err(io)?;
    }
    out.pad_to(out.pos.next_multiple_of(BLOCK)).map_err(io)?;
    let mut block = Vec::with_capacity(BLOCK);
    for n in nodes {
        if n.data_blocks() == 0 {
            continue;
        }
        out.pad_to(n.blkaddr as usize * BLOCK).map_err(io)?;
        match &n.body {
            Body::Dir {
                entries, blocks, ..
            } => {
                let mut at = 0;
                for &count in &blocks[..n.data_blocks()] {
                    block.clear();
                    dir_block(nodes, &entries[at..at + count], &mut block);
                    at += count;
                    block.resize(BLOCK, 0);
                    out.put(&block).map_err(io)?;
                }
            }
            Body::Symlink(t) => {
                out.put(t).map_err(io)?;
                out.pad_to(out.pos.next_multiple_of(BLOCK)).map_err(io)?;
            }
            _ => {}
        }
    }
    out.pad_to(blocks as usize * BLOCK).map_err(io)?;
    Ok(out.pos as u64)
}

/// Whether the image at `path` is, byte for byte, what [`write_image`] writes for tree
/// `root` (owned by whom its root inode names): an image damaged on disk is not.
pub fn image_matches(
    objects: &dyn ObjectStore,
    root: &TreeId,
    path: &Path,
) -> Result<bool, ImageError> {
    use std::io::Read;
    let io = |source| ImageError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut have = blake3::Hasher::new();
    let mut head = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        if head.len() < BLOCK + INODE_SIZE {
            let k = (BLOCK + INODE_SIZE - head.len()).min(n);
            head.extend_from_slice(&buf[..k]);
        }
        have.update(&buf[..n]);
    }
    if head.len() < BLOCK + INODE_SIZE {
        return Ok(false);
    }
    // The root inode (nid 0, at the start of block 1): uid at 24, gid at 28.
    let word = |at: usize| u32::from_le_bytes(head[BLOCK + at..BLOCK + at + 4].try_into().unwrap());
    let (uid, gid) = (word(24), word(28));
    let mut nodes = collect(objects, root)?;
    let blocks = layout(&mut nodes)?;
    let mut want = blake3::Hasher::new();
    encode(&nodes, blocks, root, &mut want, uid, gid, &io)?;
    Ok(have.finalize() == want.finalize())
}

/// Mounts the image at `image` read-only, nosuid and nodev at `target` (file-backed
/// EROFS: no loop device). The image is workspace content: its set-id bits and device
/// numbers are data, never in effect.
pub fn mount_image(image: &Path, target: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in a path"))
    };
    let (src, target) = (c(image)?, c(target)?);
    use rustix::mount::MountFlags;
    let flags = MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV;
    rustix::mount::mount(
        src.as_c_str(),
        target.as_c_str(),
        c"erofs",
        flags,
        None::<&std::ffi::CStr>,
    )
    .map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests;

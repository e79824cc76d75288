//! Files still open for writing in an upper, found in `/proc`: a file written and not
//! closed yet, or mapped shared and writable, made no event the watch hears, and its
//! writes may have returned already.

use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::upper::Rel;

/// A mount point (with a `/` after it) and the directory of the file system mounted
/// there (relative to its root: empty, or with a `/` after it).
type MountedAt = (Vec<u8>, Vec<u8>);

/// Where a process of another mount namespace has the file system of device `dev`
/// mounted, as its `/proc/PID/mountinfo` (`text`) says.
fn mounts_of(dev: u64, text: Vec<u8>) -> Vec<MountedAt> {
    let want = format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev));
    // `\ooo` escapes of spaces, tabs, newlines and backslashes; other bytes as they
    // are (not necessarily UTF-8).
    let unescape = |b: &[u8]| -> Vec<u8> {
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            let oct = b
                .get(i + 1..i + 4)
                .filter(|o| o.iter().all(|c| (b'0'..=b'7').contains(c)));
            match oct {
                Some(o) if b[i] == b'\\' => {
                    out.push(o.iter().fold(0u8, |n, c| n.wrapping_mul(8) + (c - b'0')));
                    i += 4;
                }
                _ => {
                    out.push(b[i]);
                    i += 1;
                }
            }
        }
        out
    };
    text.split(|b| *b == b'\n')
        .filter_map(|l| {
            let f: Vec<&[u8]> = l.split(|b| *b == b' ').collect();
            if f.get(2) != Some(&want.as_bytes()) {
                return None;
            }
            let mut point = unescape(f.get(4)?);
            if point.last() != Some(&b'/') {
                point.push(b'/');
            }
            let root = unescape(f.get(3)?);
            let root = match root.strip_prefix(b"/") {
                Some(r) if !r.is_empty() => {
                    let mut r = r.to_vec();
                    r.push(b'/');
                    r
                }
                _ => Vec::new(),
            };
            Some((point, root))
        })
        .collect()
}

/// The files under any of `dirs` (relative to it) that some process holds open for
/// writing, or has mapped shared and writable, as `/proc` tells: writes that may have
/// returned with no close to announce them. Processes this one may not inspect are
/// passed over (they cannot reach the mount either, unless they are root's, and this
/// is root's reading then).
///
/// A process of another mount namespace (a sandbox's, whose workspace is this overlay
/// at `/workspace`) names the files it has open from its own root: where `dev` (the
/// overlay's device) is mounted there, found in its `mountinfo`, counts as well.
///
/// `pid_ns`: only the processes of this pid namespace (its inode) are looked at, one
/// `stat` of each process's `ns/pid` to find them.
pub(super) fn open_writers(dirs: &[&Path], dev: Option<u64>, pid_ns: Option<u64>) -> Vec<Rel> {
    let prefixes: Vec<Vec<u8>> = dirs
        .iter()
        .map(|d| {
            let mut p = d.as_os_str().as_bytes().to_vec();
            p.push(b'/');
            p
        })
        .collect();
    let real = |rest: &[u8]| !rest.is_empty() && !rest.ends_with(b" (deleted)");
    let under = |p: &[u8], theirs: &[MountedAt]| -> Option<Rel> {
        if let Some(rest) = prefixes.iter().find_map(|x| p.strip_prefix(x.as_slice())) {
            return real(rest).then(|| rest.to_vec());
        }
        theirs.iter().find_map(|(point, root)| {
            let rest = p.strip_prefix(point.as_slice())?;
            real(rest).then(|| [root.as_slice(), rest].concat())
        })
    };
    // Every call below is relative to a descriptor of /proc or of the process's own
    // directory: a path from /proc down, walked again for each descriptor, cost most
    // of the scan.
    use rustix::fs::{openat, readlinkat, statat, AtFlags, Dir, Mode, OFlags};
    use std::os::fd::OwnedFd;
    let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let Ok(proc_fd) = openat(rustix::fs::CWD, "/proc", dir_flags, Mode::empty()) else {
        return Vec::new();
    };
    let read = |dir: &OwnedFd, name: &str| -> Option<Vec<u8>> {
        let f = openat(dir, name, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).ok()?;
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::fs::File::from(f), &mut buf).ok()?;
        Some(buf)
    };
    // Mount namespaces by inode: ours, and where each other one has the overlay.
    let ns_of = |dir: &OwnedFd| {
        statat(dir, "ns/mnt", AtFlags::empty())
            .ok()
            .map(|st| st.st_ino)
    };
    let ours = openat(&proc_fd, "self", dir_flags, Mode::empty())
        .ok()
        .and_then(|d| ns_of(&d));
    let mut namespaces: std::collections::HashMap<u64, Vec<MountedAt>> = Default::default();
    let mut out = std::collections::BTreeSet::new();
    let Ok(procs) = Dir::read_from(&proc_fd) else {
        return Vec::new();
    };
    let mut link = Vec::new();
    for p in procs.flatten() {
        let name = p.file_name().to_bytes();
        if name.is_empty() || !name.iter().all(u8::is_ascii_digit) {
            continue;
        }
        if let Some(ns) = pid_ns {
            let mut at = name.to_vec();
            at.extend_from_slice(b"/ns/pid");
            let inside =
                statat(&proc_fd, at.as_slice(), AtFlags::empty()).is_ok_and(|st| st.st_ino == ns);
            if !inside {
                continue;
            }
        }
        let Ok(dir) = openat(&proc_fd, p.file_name(), dir_flags, Mode::empty()) else {
            continue;
        };
        // A kernel thread (most of a host's processes) or a zombie has no executable,
        // and neither descriptors nor mappings: one call, not ten.
        match readlinkat(&dir, "exe", std::mem::take(&mut link)) {
            Ok(exe) => link = exe.into_bytes(),
            Err(_) => continue,
        }
        let theirs: &[MountedAt] = match (dev, ns_of(&dir)) {
            (Some(dev), Some(ns)) if Some(ns) != ours => namespaces
                .entry(ns)
                .or_insert_with(|| mounts_of(dev, read(&dir, "mountinfo").unwrap_or_default())),
            _ => &[],
        };
        if let Ok(fd_dir) = openat(&dir, "fd", dir_flags, Mode::empty()) {
            if let Ok(fds) = Dir::read_from(&fd_dir) {
                for fd in fds.flatten() {
                    let n = fd.file_name();
                    if n.to_bytes().first().is_none_or(|c| !c.is_ascii_digit()) {
                        continue;
                    }
                    let Ok(target) = readlinkat(&fd_dir, n, std::mem::take(&mut link)) else {
                        continue;
                    };
                    let found = under(target.as_bytes(), theirs);
                    link = target.into_bytes();
                    let Some(rel) = found else {
                        continue;
                    };
                    let info = format!("fdinfo/{}", n.to_string_lossy());
                    let writable = read(&dir, &info).is_some_and(|t| {
                        t.split(|b| *b == b'\n')
                            .find_map(|l| l.strip_prefix(b"flags:"))
                            .and_then(|f| std::str::from_utf8(f).ok())
                            .and_then(|f| i64::from_str_radix(f.trim(), 8).ok())
                            .is_some_and(|f| f & libc::O_ACCMODE as i64 != libc::O_RDONLY as i64)
                    });
                    if writable {
                        out.insert(rel);
                    }
                }
            }
        }
        // Its shared writable file mappings: asked of the kernel one by one where it
        // can say (most processes have none, and then the whole `maps` text is not
        // made), else read from the text.
        let Ok(maps_fd) = openat(
            &dir,
            "maps",
            OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        ) else {
            continue;
        };
        let mut maps_file = std::fs::File::from(maps_fd);
        if let Some(paths) = crate::sys::proc_maps::shared_writable(maps_file.as_fd()) {
            out.extend(paths.iter().filter_map(|p| under(p, theirs)));
            continue;
        }
        // `address perms offset dev inode path`: a shared writable mapping ("rw?s").
        let mut maps = Vec::new();
        if std::io::Read::read_to_end(&mut maps_file, &mut maps).is_ok() {
            for line in maps.split(|b| *b == b'\n') {
                let mut rest = line;
                let mut fields = Vec::with_capacity(5);
                for _ in 0..5 {
                    let t = rest.iter().position(|b| *b != b' ').unwrap_or(rest.len());
                    rest = &rest[t..];
                    let e = rest.iter().position(|b| *b == b' ').unwrap_or(rest.len());
                    fields.push(&rest[..e]);
                    rest = &rest[e..];
                }
                let perms = fields[1];
                if perms.len() == 4 && perms[1] == b'w' && perms[3] == b's' {
                    let t = rest.iter().position(|b| *b != b' ').unwrap_or(rest.len());
                    if let Some(rel) = under(&rest[t..], theirs) {
                        out.insert(rel);
                    }
                }
            }
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    /// Where another namespace has a file system mounted, from its `mountinfo`: each
    /// mount of that device (escaped names undone, a bind of a subdirectory with its
    /// directory), no other device's.
    #[test]
    fn another_namespace_s_mounts_of_a_device_are_read_from_its_mountinfo() {
        let t = tempfile::tempdir().unwrap();
        let info = t.path().join("mountinfo");
        std::fs::write(
            &info,
            b"113 86 0:44 / /workspace rw,nosuid - tmpfs none rw\n\
             61 86 0:44 /caf\xe9 /not-utf-8-\xff rw - tmpfs none rw\n\
             58 113 0:41 / /workspace rw,nosuid,nodev - overlay casfs rw,lowerdir=x\n\
             59 86 0:41 /sub\\040dir /other\\040place rw - overlay casfs rw\n\
             60 86 0:410 / /not-it rw - overlay casfs rw\n",
        )
        .unwrap();
        let got = super::mounts_of(rustix::fs::makedev(0, 41), std::fs::read(&info).unwrap());
        assert_eq!(
            got,
            vec![
                (b"/workspace/".to_vec(), Vec::new()),
                (b"/other place/".to_vec(), b"sub dir/".to_vec()),
            ]
        );
    }
}

//! The mappings of a process, asked of the kernel (`PROCMAP_QUERY` on its
//! `/proc/<pid>/maps`, Linux 6.11) rather than read from the text.

use std::os::fd::{AsRawFd, BorrowedFd};

/// `PROCMAP_QUERY` of `<linux/fs.h>` (Linux 6.11): one mapping of a `/proc/PID/maps`
/// that matches the query's flags, at or after an address.
const PROCMAP_QUERY: libc::c_ulong = 0xC068_6611;
const QUERY_WRITABLE: u64 = 0x02;
const QUERY_SHARED: u64 = 0x08;
const QUERY_COVERING_OR_NEXT: u64 = 0x10;
const QUERY_FILE_BACKED: u64 = 0x20;

/// `struct procmap_query`.
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// The paths of the shared writable file mappings of the process whose `maps` is
/// open, asked with `PROCMAP_QUERY`; `None` where the kernel cannot say (older than
/// 6.11) or a query failed otherwise than by finding no more: the text is read then.
pub fn shared_writable(maps: BorrowedFd<'_>) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    let mut name = vec![0u8; libc::PATH_MAX as usize + 64];
    let mut addr = 0u64;
    loop {
        let mut q = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_flags: QUERY_WRITABLE | QUERY_SHARED | QUERY_COVERING_OR_NEXT | QUERY_FILE_BACKED,
            query_addr: addr,
            vma_name_size: name.len() as u32,
            vma_name_addr: name.as_mut_ptr() as u64,
            ..ProcmapQuery::default()
        };
        // SAFETY: the ioctl reads and writes `q` (its size given) and writes at most
        // `vma_name_size` bytes to `name`; both outlive the call.
        let r = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY as _, &mut q) };
        if r != 0 {
            return match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::ENOENT) => Some(out),
                _ => None,
            };
        }
        // The name's length with its NUL.
        let len = (q.vma_name_size as usize).saturating_sub(1).min(name.len());
        out.push(name[..len].to_vec());
        if q.vma_end <= addr {
            return None;
        }
        addr = q.vma_end;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_kernel_names_shared_writable_mappings_only() {
        use std::os::fd::AsRawFd;
        let t = tempfile::tempdir().unwrap();
        let (shared, private) = (t.path().join("shared"), t.path().join("private"));
        let mut maps = Vec::new();
        for (p, flags) in [(&shared, libc::MAP_SHARED), (&private, libc::MAP_PRIVATE)] {
            std::fs::write(p, [0u8; 4096]).unwrap();
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .unwrap();
            // SAFETY: a fresh mapping of 4096 bytes of an open file, unmapped below.
            let m = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags,
                    f.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(m, libc::MAP_FAILED);
            maps.push(m);
        }
        let own = std::fs::File::open("/proc/self/maps").unwrap();
        let found = super::shared_writable(std::os::fd::AsFd::as_fd(&own));
        for m in maps {
            // SAFETY: the mappings made above, not used after.
            unsafe { libc::munmap(m, 4096) };
        }
        // Kernels before 6.11 cannot say (the text is read then).
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut v = release
            .split(|c: char| !c.is_ascii_digit())
            .map(|x| x.parse::<u32>());
        let (major, minor) = (v.next().unwrap().unwrap(), v.next().unwrap().unwrap());
        if (major, minor) < (6, 11) {
            return;
        }
        let found = found.expect("PROCMAP_QUERY answers on Linux 6.11 and later");
        let name = |p: &std::path::Path| p.as_os_str().as_encoded_bytes().to_vec();
        assert!(found.contains(&name(&shared)), "{found:?}");
        assert!(!found.contains(&name(&private)), "{found:?}");
    }
}

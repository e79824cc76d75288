//! inotify, the one way casfs hears of changes in a directory tree, over the `inotify`
//! crate: an instance, watches added through a directory's descriptor and removed, and
//! its queue read and decoded, an overflow reported as such. Every watcher of casfs (the
//! `casfs watch` process, the overlay uppers' watch, sandboxes' file events) is on it.
//!
//! The kernel queues an event before the system call that caused it returns, so a read
//! of the queue until it is empty ([`Instance::drain`]) sees every change made before.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::path::PathBuf;

pub use inotify::{EventMask, WatchDescriptor, WatchMask};

/// Enough for a good many events a read (one takes 16 bytes and its name).
pub const READ_BUFFER: usize = 64 << 10;

/// One decoded event.
#[derive(Debug, Clone)]
pub enum Event<'a> {
    /// The queue overflowed (`IN_Q_OVERFLOW`): events were lost.
    Overflow,
    /// An event of watch `wd`: `name` is the entry's in the watched directory (`None`:
    /// the directory itself); `cookie` pairs the two sides of a rename.
    Watched {
        wd: WatchDescriptor,
        mask: EventMask,
        cookie: u32,
        name: Option<&'a [u8]>,
    },
}

/// An inotify instance (close-on-exec, non-blocking).
pub struct Instance {
    inner: inotify::Inotify,
}

impl Instance {
    pub fn new() -> std::io::Result<Instance> {
        Ok(Instance {
            inner: inotify::Inotify::init()?,
        })
    }

    /// Watches the directory open at `dir`, found through its descriptor's magic link
    /// (followed: that is the point), so that no path is resolved again.
    pub fn watch_dir(
        &self,
        dir: BorrowedFd<'_>,
        mask: WatchMask,
    ) -> std::io::Result<WatchDescriptor> {
        let by_fd = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
        self.inner
            .watches()
            .add(&by_fd, mask.difference(WatchMask::DONT_FOLLOW))
    }

    /// Stops watch `wd` (one the kernel dropped already is no error).
    pub fn unwatch(&self, wd: WatchDescriptor) {
        let _ = self.inner.watches().remove(wd);
    }

    /// Bytes queued to be read (`None`: unknown).
    pub fn queued(&self) -> Option<usize> {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes the bytes ready to be read into `n`.
        let r = unsafe { libc::ioctl(self.inner.as_raw_fd(), libc::FIONREAD, &mut n) };
        (r == 0).then(|| usize::try_from(n).unwrap_or(0))
    }

    /// Reads once into `buf` (whole events, as many as fit); `None` when the queue is
    /// empty. The events borrow `buf` only: they may be handled with `self` changed.
    /// (The descriptor does not block, so a read is never interrupted by a signal.)
    pub fn read<'a>(&mut self, buf: &'a mut [u8]) -> std::io::Result<Option<Events<'a>>> {
        match self.inner.read_events(buf) {
            Ok(evs) => Ok(Some(Events(evs))),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads the queue until it is empty, handing every event to `f`.
    pub fn drain(&mut self, buf: &mut [u8], mut f: impl FnMut(Event<'_>)) -> std::io::Result<()> {
        while let Some(evs) = self.read(buf)? {
            evs.for_each(&mut f);
        }
        Ok(())
    }
}

/// Waits until the instance whose descriptor is `fd` has events queued (`timeout_ms`
/// < 0: without end), without holding the instance (a reader thread waits so while
/// others add watches); false when it timed out or was interrupted.
pub fn wait(fd: RawFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd; a descriptor closed meanwhile is an error, not a fault.
    unsafe { libc::poll(&mut p, 1, timeout_ms) > 0 }
}

/// The events of one [`Instance::read`], decoded.
pub struct Events<'a>(inotify::Events<'a>);

impl<'a> Iterator for Events<'a> {
    type Item = Event<'a>;

    fn next(&mut self) -> Option<Event<'a>> {
        self.0.next().map(decode)
    }
}

impl AsRawFd for Instance {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.as_raw_fd()
    }
}

impl AsFd for Instance {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

fn decode(e: inotify::Event<&std::ffi::OsStr>) -> Event<'_> {
    use std::os::unix::ffi::OsStrExt;
    if e.mask.contains(EventMask::Q_OVERFLOW) {
        return Event::Overflow;
    }
    Event::Watched {
        wd: e.wd,
        mask: e.mask,
        cookie: e.cookie,
        name: e.name.map(|n| n.as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_change_is_queued_before_its_call_returns() {
        let d = tempfile::tempdir().unwrap();
        let mut i = Instance::new().unwrap();
        let dir = std::fs::File::open(d.path()).unwrap();
        let wd = i
            .watch_dir(
                dir.as_fd(),
                WatchMask::CREATE | WatchMask::MOVED_FROM | WatchMask::MOVED_TO,
            )
            .unwrap();
        std::fs::write(d.path().join("a"), b"").unwrap();
        std::fs::rename(d.path().join("a"), d.path().join("b")).unwrap();
        let mut buf = vec![0u8; READ_BUFFER];
        let mut seen = Vec::new();
        i.drain(&mut buf, |e| match e {
            Event::Watched {
                wd: w,
                mask,
                cookie,
                name,
            } => {
                assert_eq!(w, wd);
                seen.push((mask, cookie, name.unwrap().to_vec()))
            }
            Event::Overflow => panic!("overflow"),
        })
        .unwrap();
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert_eq!(seen[0].0, EventMask::CREATE);
        assert_eq!(seen[0].2, b"a");
        assert_eq!(seen[1].1, seen[2].1);
        assert_eq!(seen[2].2, b"b");
        assert!(i.read(&mut buf).unwrap().is_none());
        i.unwatch(wd);
    }
}

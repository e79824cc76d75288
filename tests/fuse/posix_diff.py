#!/usr/bin/env python3
"""POSIX behaviour probe, run once on ext4 and once on a casfs mount: the outputs must
be identical. Each line names a check and what happened (an errno name, a mode, a link
count, whether a timestamp moved), never an absolute time, inode number or device.

The checks follow the areas a filesystem conformance suite covers (open, create,
mkdir, rmdir, unlink, link, symlink, rename, chmod, chown, truncate, utimensat,
mknod/mkfifo, xattrs, sparse files, permission denials, sticky directories, time
updates of files and their parents). Run as root: some checks switch to uid 65534.

usage: posix_diff.py DIR   (DIR must be empty and usable by uid 65534)
"""

import errno
import os
import stat
import sys
import time

D = sys.argv[1]
NOBODY = 65534
out = []


def p(*parts):
    return os.path.join(D, *parts)


def rec(name, value):
    out.append(f"{name}: {value}")


def err(fn, *a, **k):
    try:
        r = fn(*a, **k)
        if isinstance(r, int) and fn is os.open:
            os.close(r)
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


def check(name, fn, *a, **k):
    rec(name, err(fn, *a, **k))


def st(path):
    return os.lstat(path)


def mode(path):
    return oct(stat.S_IMODE(st(path).st_mode))


def tick():
    time.sleep(0.05)


def times(path):
    s = st(path)
    return (s.st_mtime_ns, s.st_ctime_ns)


def moved(before, after):
    return "mtime %s ctime %s" % (
        "moved" if after[0] != before[0] else "same",
        "moved" if after[1] != before[1] else "same",
    )


def as_nobody(fn):
    """Runs fn() as uid/gid 65534 in a child; returns its result string."""
    return as_user(NOBODY, NOBODY, [], fn)


def as_user(uid, gid, groups, fn):
    """Runs fn() as uid, gid and supplementary groups in a child; returns its result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            res = fn()
        except OSError as e:
            res = errno.errorcode.get(e.errno, str(e.errno))
        except Exception as e:  # noqa: BLE001
            res = "exception %r" % e
        os.write(w, str(res).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return data.decode()


os.umask(0o022)

# --- open / create -----------------------------------------------------------------
fd = os.open(p("f"), os.O_CREAT | os.O_WRONLY, 0o666)
os.close(fd)
rec("create mode", mode(p("f")))
check("create O_EXCL existing", os.open, p("f"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
check("open missing", os.open, p("missing"), os.O_RDONLY)
os.mkdir(p("dir"))
check("open dir for writing", os.open, p("dir"), os.O_WRONLY)
check("open through a file", os.open, p("f", "x"), os.O_RDONLY)
check("create name 255", os.open, p("n" * 255), os.O_CREAT | os.O_WRONLY, 0o644)
check("create name 256", os.open, p("n" * 256), os.O_CREAT | os.O_WRONLY, 0o644)
check("open O_DIRECTORY on file", os.open, p("f"), os.O_RDONLY | os.O_DIRECTORY)
fd = os.open(p("f"), os.O_WRONLY | os.O_TRUNC)
os.write(fd, b"hello")
os.close(fd)
fd = os.open(p("f"), os.O_WRONLY | os.O_APPEND)
os.write(fd, b" world")
os.close(fd)
rec("append", open(p("f"), "rb").read())
fd = os.open(p("f"), os.O_RDWR)
os.pwrite(fd, b"!", 20)
os.close(fd)
rec("write past end", open(p("f"), "rb").read())
rec("size", st(p("f")).st_size)

# --- mkdir / rmdir -----------------------------------------------------------------
n0 = st(D).st_nlink
os.mkdir(p("d2"), 0o751)
rec("mkdir mode", mode(p("d2")))
rec("parent nlink after mkdir", st(D).st_nlink - n0)
rec("new dir nlink", st(p("d2")).st_nlink)
check("mkdir existing", os.mkdir, p("d2"))
check("mkdir over file", os.mkdir, p("f"))
os.mkdir(p("d2", "sub"))
rec("dir nlink with subdir", st(p("d2")).st_nlink)
check("rmdir non-empty", os.rmdir, p("d2"))
check("rmdir file", os.rmdir, p("f"))
check("rmdir dot", os.rmdir, p("d2", "."))
check("unlink dir", os.unlink, p("d2"))
check("rmdir sub", os.rmdir, p("d2", "sub"))
rec("dir nlink after rmdir", st(p("d2")).st_nlink)
os.mkdir(p("sgid"))
os.chmod(p("sgid"), 0o2775)
os.chown(p("sgid"), 0, 4242)
os.mkdir(p("sgid", "child"))
fd = os.open(p("sgid", "file"), os.O_CREAT | os.O_WRONLY, 0o644)
os.close(fd)
rec("setgid dir: child dir mode", mode(p("sgid", "child")))
rec("setgid dir: child dir gid", st(p("sgid", "child")).st_gid)
rec("setgid dir: file gid", st(p("sgid", "file")).st_gid)

# --- time updates ------------------------------------------------------------------
b = times(D)
tick()
fd = os.open(p("t"), os.O_CREAT | os.O_WRONLY, 0o644)
os.close(fd)
rec("create: parent", moved(b, times(D)))
b = times(p("t"))
tick()
with open(p("t"), "ab") as f:
    f.write(b"x")
rec("write: file", moved(b, times(p("t"))))
b = times(p("t"))
tick()
os.chmod(p("t"), 0o600)
rec("chmod: file", moved(b, times(p("t"))))
b = times(p("t"))
tick()
os.chown(p("t"), 0, 0)
rec("chown: file", moved(b, times(p("t"))))
b, bd = times(p("t")), times(D)
tick()
os.link(p("t"), p("t2"))
rec("link: file", moved(b, times(p("t"))))
rec("link: parent", moved(bd, times(D)))
b, bd = times(p("t")), times(D)
tick()
os.unlink(p("t2"))
rec("unlink: other link", moved(b, times(p("t"))))
rec("unlink: parent", moved(bd, times(D)))
os.mkdir(p("dst"))
b, bd, bdst = times(p("t")), times(D), times(p("dst"))
tick()
os.rename(p("t"), p("dst", "t"))
rec("rename: file", moved(b, times(p("dst", "t"))))
rec("rename: source dir", moved(bd, times(D)))
rec("rename: target dir", moved(bdst, times(p("dst"))))
b = times(p("dst", "t"))
tick()
os.truncate(p("dst", "t"), st(p("dst", "t")).st_size)
rec("truncate same size: file", moved(b, times(p("dst", "t"))))
b = times(p("dst", "t"))
tick()
os.truncate(p("dst", "t"), 100)
rec("truncate grow: file", moved(b, times(p("dst", "t"))))
rec("truncate grow: zeros", open(p("dst", "t"), "rb").read()[1:].count(0))
b = times(p("dst", "t"))
tick()
os.setxattr(p("dst", "t"), "user.a", b"1")
rec("setxattr: file", moved(b, times(p("dst", "t"))))
os.utime(p("dst", "t"), ns=(1_000_000_123, 2_000_000_456))
s = st(p("dst", "t"))
rec("utimens exact", (s.st_atime_ns, s.st_mtime_ns))
b = times(p("dst", "t"))
tick()
os.utime(p("dst", "t"))
rec("utimens now", moved(b, times(p("dst", "t"))))
b = times(p("dst"))
tick()
os.mkdir(p("dst", "x"))
os.rmdir(p("dst", "x"))
rec("mkdir+rmdir: parent", moved(b, times(p("dst"))))

# --- symlinks ----------------------------------------------------------------------
os.symlink("target/x", p("sl"))
s = st(p("sl"))
rec("symlink", (oct(stat.S_IMODE(s.st_mode)), stat.S_ISLNK(s.st_mode), s.st_size))
rec("readlink", os.readlink(p("sl")))
check("symlink existing", os.symlink, "y", p("sl"))
check("symlink long 1023", os.symlink, "a" * 1023, p("sl2"))
check("symlink long 4096", os.symlink, "a" * 4096, p("sl3"))
check("open dangling", os.open, p("sl"), os.O_RDONLY)
os.symlink("loop", p("loop"))
check("open loop", os.open, p("loop"), os.O_RDONLY)
check("open O_NOFOLLOW symlink", os.open, p("sl2"), os.O_RDONLY | os.O_NOFOLLOW)

# --- hard links --------------------------------------------------------------------
with open(p("h"), "wb") as f:
    f.write(b"h")
os.link(p("h"), p("h2"))
rec("link nlink", (st(p("h")).st_nlink, st(p("h2")).st_nlink))
rec("link same inode", st(p("h")).st_ino == st(p("h2")).st_ino)
check("link dir", os.link, p("dir"), p("dirlink"))
check("link existing", os.link, p("h"), p("f"))
check("link missing", os.link, p("missing"), p("x"))
os.rename(p("h"), p("h2"))
rec("rename onto own hard link", (os.path.exists(p("h")), os.path.exists(p("h2"))))

# --- rename ------------------------------------------------------------------------
os.mkdir(p("r1"))
os.mkdir(p("r2"))
os.mkdir(p("r3"))
with open(p("r3", "x"), "wb") as f:
    f.write(b"x")
with open(p("rf"), "wb") as f:
    f.write(b"rf")
check("rename dir onto empty dir", os.rename, p("r1"), p("r2"))
rec("rename dir onto empty dir: result", (os.path.exists(p("r1")), os.path.isdir(p("r2"))))
check("rename dir onto non-empty", os.rename, p("r2"), p("r3"))
check("rename dir onto file", os.rename, p("r2"), p("rf"))
check("rename file onto dir", os.rename, p("rf"), p("r2"))
check("rename dir into itself", os.rename, p("r3"), p("r3", "in"))
check("rename missing", os.rename, p("missing"), p("x"))
check("rename to self", os.rename, p("rf"), p("rf"))
n0 = (st(p("r2")).st_nlink, st(p("r3")).st_nlink)
os.mkdir(p("r2", "mv"))
os.rename(p("r2", "mv"), p("r3", "mv"))
rec("rename dir: parents' nlink", (st(p("r2")).st_nlink - n0[0], st(p("r3")).st_nlink - n0[1]))
check("rename name 256", os.rename, p("rf"), p("r" * 256))

# --- chmod / chown / permissions ---------------------------------------------------
with open(p("suid"), "wb") as f:
    f.write(b"s")
os.chmod(p("suid"), 0o4755)
rec("chmod setuid", mode(p("suid")))
os.chown(p("suid"), NOBODY, NOBODY)
rec("chown clears setuid", mode(p("suid")))
os.chown(p("suid"), 0, 0)
os.chmod(p("suid"), 0o6777)
rec("nobody writes setuid file", as_nobody(lambda: os.write(os.open(p("suid"), os.O_WRONLY), b"w")))
rec("after write by nobody", mode(p("suid")))
# Set-id bits and file capabilities under writes and truncates by root and by others.
os.chmod(p("suid"), 0o6777)
with open(p("suid"), "r+b") as f:
    f.write(b"root")
rec("after write by root", mode(p("suid")))
rec("nobody truncates setuid file", as_nobody(lambda: os.truncate(p("suid"), 1) or "ok"))
rec("after truncate by nobody", mode(p("suid")))
os.chmod(p("suid"), 0o2666)
rec("nobody writes setgid file without group exec", as_nobody(lambda: os.write(os.open(p("suid"), os.O_WRONLY), b"g")))
rec("after that write", mode(p("suid")))
os.chmod(p("suid"), 0o4766)
for i in range(2):
    rec(f"nobody appends to setuid file {i}", as_nobody(lambda: os.write(os.open(p("suid"), os.O_WRONLY | os.O_APPEND), b"a")))
    rec(f"after append {i}", mode(p("suid")))
    os.chmod(p("suid"), 0o4766)
rec("nobody opens setuid file with O_TRUNC", as_nobody(lambda: os.open(p("suid"), os.O_WRONLY | os.O_TRUNC) and "ok"))
rec("after O_TRUNC by nobody", mode(p("suid")))
os.chmod(p("suid"), 0o4766)
rec("nobody fallocates setuid file", as_nobody(lambda: os.posix_fallocate(os.open(p("suid"), os.O_WRONLY), 0, 8192) or "ok"))
rec("after fallocate by nobody", mode(p("suid")))
CAPS = b"\x00\x00\x00\x02" + (1 << 10).to_bytes(4, "little") + bytes(12)
os.setxattr(p("suid"), "security.capability", CAPS)
rec("file capabilities set", os.getxattr(p("suid"), "security.capability") == CAPS)
with open(p("suid"), "r+b") as f:
    f.write(b"c")
rec("file capabilities after write by root", err(os.getxattr, p("suid"), "security.capability"))
# chown of a non-directory drops setuid, and setgid when the group may execute or the
# caller (without CAP_FSETID) is not in the file's group: every kind, set-id mode and
# change, by root and by the owner (uid 65534 in groups 65533 and 65532), also through a
# symlink. The file starts as 65534:65533.
import socket  # noqa: E402

os.mkdir(p("own"))
os.chmod(p("own"), 0o777)
KINDS = ["file", "fifo", "chardev", "blockdev", "socket"]
MODES = [0o6555, 0o6545, 0o4755, 0o2755, 0o2745]
CHANGES = [
    ("root -1:65532", None, -1, 65532, False),
    ("root 0:-1", None, 0, -1, False),
    ("root -1:-1", None, -1, -1, False),
    ("owner -1:65532", (NOBODY, 65533, [65533, 65532]), -1, 65532, False),
    ("owner 65534:-1", (NOBODY, 65533, [65533, 65532]), NOBODY, -1, False),
    ("owner -1:65532 via symlink", (NOBODY, 65533, [65533, 65532]), -1, 65532, True),
    ("outsider owner -1:65533", (NOBODY, 65532, [65532]), -1, 65533, False),
]


def make(kind, path):
    if kind == "file":
        with open(path, "wb") as f:
            f.write(b"f")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "chardev":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    elif kind == "blockdev":
        os.mknod(path, stat.S_IFBLK | 0o600, os.makedev(7, 200))
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()


n = 0
for kind in KINDS:
    for m in MODES:
        for label, who, uid, gid, via_link in CHANGES:
            n += 1
            f = p("own", f"o{n}")
            make(kind, f)
            os.chown(f, NOBODY, 65533)
            os.chmod(f, m)
            target = f
            if via_link:
                target = p("own", f"l{n}")
                os.symlink(f, target)
            if who is None:
                res = err(os.chown, target, uid, gid)
            else:
                res = as_user(*who, lambda: os.chown(target, uid, gid) or "ok")
            rec(f"chown {kind} {oct(m)} {label}", f"{res} {mode(f)} gid {st(f).st_gid}")

with open(p("private"), "wb") as f:
    f.write(b"p")
os.chmod(p("private"), 0o600)
rec("nobody reads 0600", as_nobody(lambda: os.open(p("private"), os.O_RDONLY) and "ok"))
rec("nobody chmods root file", as_nobody(lambda: os.chmod(p("private"), 0o777) or "ok"))
rec("nobody chowns root file", as_nobody(lambda: os.chown(p("private"), NOBODY, NOBODY) or "ok"))
os.mkdir(p("closed"), 0o700)
rec("nobody lists 0700 dir", as_nobody(lambda: os.listdir(p("closed")) and "ok"))
rec("nobody creates in 0755 dir", as_nobody(lambda: os.open(p("dir", "n"), os.O_CREAT | os.O_WRONLY, 0o644) and "ok"))
os.mkdir(p("sticky"))
os.chmod(p("sticky"), 0o1777)
with open(p("sticky", "roots"), "wb") as f:
    f.write(b"r")
rec("nobody deletes in sticky dir", as_nobody(lambda: os.unlink(p("sticky", "roots")) or "ok"))
rec("nobody creates in sticky dir", as_nobody(lambda: os.close(os.open(p("sticky", "mine"), os.O_CREAT | os.O_WRONLY, 0o640)) or "ok"))
rec("nobody's file owner", (st(p("sticky", "mine")).st_uid, st(p("sticky", "mine")).st_gid, mode(p("sticky", "mine"))))
rec("nobody renames own file in sticky dir", as_nobody(lambda: os.rename(p("sticky", "mine"), p("sticky", "mine2")) or "ok"))
rec("nobody utimes root file to now", as_nobody(lambda: os.utime(p("private")) or "ok"))
os.chmod(p("private"), 0o666)
rec("nobody utimes writable root file to now", as_nobody(lambda: os.utime(p("private")) or "ok"))
rec("nobody utimes writable root file explicitly", as_nobody(lambda: os.utime(p("private"), (1, 1)) or "ok"))
rec("nobody truncates 0644 root file", as_nobody(lambda: os.truncate(p("f"), 0) or "ok"))

# --- special files -----------------------------------------------------------------
os.mkfifo(p("fifo"), 0o640)
s = st(p("fifo"))
rec("fifo", (stat.S_ISFIFO(s.st_mode), mode(p("fifo"))))
os.mknod(p("chr"), 0o600 | stat.S_IFCHR, os.makedev(1, 3))
s = st(p("chr"))
rec("char device", (stat.S_ISCHR(s.st_mode), os.major(s.st_rdev), os.minor(s.st_rdev)))
os.mknod(p("blk"), 0o600 | stat.S_IFBLK, os.makedev(7, 0))
s = st(p("blk"))
rec("block device", (stat.S_ISBLK(s.st_mode), os.major(s.st_rdev), os.minor(s.st_rdev)))
os.mknod(p("regular"), 0o640 | stat.S_IFREG)
rec("mknod regular", (stat.S_ISREG(st(p("regular")).st_mode), mode(p("regular"))))
check("mknod existing", os.mknod, p("fifo"), 0o600 | stat.S_IFIFO)

# --- sparse files, fallocate, seek -------------------------------------------------
fd = os.open(p("sparse"), os.O_CREAT | os.O_RDWR, 0o644)
os.pwrite(fd, b"end", 8 << 20)
rec("sparse size", os.fstat(fd).st_size)
rec("sparse hole reads zeros", os.pread(fd, 64, 1 << 20) == bytes(64))
rec("SEEK_DATA from 0", os.lseek(fd, 0, os.SEEK_DATA) >= 0)
rec("SEEK_HOLE past end", err(os.lseek, fd, (8 << 20) + 10, os.SEEK_HOLE))
os.posix_fallocate(fd, 0, 16 << 20)
rec("fallocate size", os.fstat(fd).st_size)
os.ftruncate(fd, 3)
rec("ftruncate", (os.fstat(fd).st_size, os.pread(fd, 10, 0)))
os.close(fd)
fd = os.open(p("sparse"), os.O_RDONLY)
rec("ftruncate read-only fd", err(os.ftruncate, fd, 0))
os.close(fd)

# --- open-unlinked -----------------------------------------------------------------
fd = os.open(p("ghost"), os.O_CREAT | os.O_RDWR, 0o644)
os.write(fd, b"ghost")
os.unlink(p("ghost"))
rec("unlinked: exists", os.path.exists(p("ghost")))
rec("unlinked: fstat nlink", os.fstat(fd).st_nlink)
os.write(fd, b"!")
rec("unlinked: read", os.pread(fd, 100, 0))
os.close(fd)

# --- xattrs ------------------------------------------------------------------------
with open(p("x"), "wb") as f:
    f.write(b"x")
os.setxattr(p("x"), "user.one", b"1")
os.setxattr(p("x"), "user.two", b"")
rec("listxattr", sorted(os.listxattr(p("x"))))
rec("getxattr empty", os.getxattr(p("x"), "user.two"))
rec("getxattr missing", err(os.getxattr, p("x"), "user.none"))
rec("setxattr XATTR_CREATE existing", err(os.setxattr, p("x"), "user.one", b"2", os.XATTR_CREATE))
rec("setxattr XATTR_REPLACE missing", err(os.setxattr, p("x"), "user.none", b"2", os.XATTR_REPLACE))
os.removexattr(p("x"), "user.one")
rec("removexattr missing", err(os.removexattr, p("x"), "user.one"))
rec("listxattr after remove", os.listxattr(p("x")))
rec("xattr on dir", err(os.setxattr, p("dir"), "user.d", b"d"))
rec("nobody setxattr on root file", as_nobody(lambda: os.setxattr(p("x"), "user.n", b"n") or "ok"))

# --- readdir -----------------------------------------------------------------------
rec("listing", sorted(os.listdir(D)))
rec("listing dst", sorted(os.listdir(p("dst"))))

print("\n".join(out))

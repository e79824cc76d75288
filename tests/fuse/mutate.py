#!/usr/bin/env python3
"""Applies the same mutations to a copy of the sample tree (tests/common build_sample_tree)
wherever it lives: on ext4 and on a casfs mount whose nodes all start clean (loaded from
the store). Afterwards the two trees must be the same, entry by entry.

usage: mutate.py DIR
"""

import errno
import os
import subprocess
import sys

D = sys.argv[1]


def p(*parts):
    return os.path.join(D, *parts)


def move_dir(a, b):
    """rename(2), or what mv(1) does where the filesystem refuses it with EXDEV (a
    rootless overlay, which cannot rename a directory of its lower): copy, then remove."""
    try:
        os.rename(a, b)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        subprocess.run(["mv", "-T", a, b], check=True)


# Metadata of clean files and directories.
os.chmod(p("README.md"), 0o600)
os.utime(p("script.sh"), ns=(1_111_111_111_000_000_001, 1_222_222_222_000_000_002))
os.setxattr(p("src", "main.rs"), "user.added", b"on a clean file")
os.removexattr(p("README.md"), "user.casfs.test")
os.chmod(p("src", "deep"), 0o700)

# Content: append to a small clean file, write inside a multi-chunk one, truncate one.
with open(p("src", "main.rs"), "ab") as f:
    f.write(b"\n// appended\n")
with open(p("src", "deep", "er", "still", "data.bin"), "r+b") as f:
    f.seek((1 << 20) + 12345)
    f.write(b"written inside chunk 1")
os.truncate(p("src", "1MiB-plus-1"), 1000)
os.truncate(p("empty-file"), 5000)

# Names: rename a clean file across directories, a clean directory with its content,
# replace a clean file by rename, remove a clean file and a clean empty directory.
os.rename(p("secret"), p("src", "secret-moved"))
move_dir(p("src", "deep"), p("deep-moved"))
os.rename(p("script.sh"), p("README.md"))
os.unlink(p("name with spaces & ünïcödé"))
os.rmdir(p("empty", "nested-empty"))
os.unlink(p("link-dangling"))
os.symlink("deep-moved/er/still/data.bin", p("link-new"))

# Hard link a clean file, then write through the new name.
os.link(p("src", "exactly-1MiB"), p("hard"))
with open(p("hard"), "r+b") as f:
    f.write(b"via the hard link")

# New content in a clean directory; a clean fifo renamed.
os.makedirs(p("empty", "fresh", "deeper"))
with open(p("empty", "fresh", "deeper", "new.txt"), "wb") as f:
    f.write(b"new")
os.rename(p("pipe"), p("empty", "pipe"))

# Times last: what was written gets a fixed mtime (so the two runs agree), and every
# directory too, deepest first.
T = (1_300_000_000_000_000_000, 1_300_000_000_000_000_007)
for f in [
    p("src", "main.rs"),
    p("deep-moved", "er", "still", "data.bin"),
    p("src", "1MiB-plus-1"),
    p("empty-file"),
    p("hard"),
    p("empty", "fresh", "deeper", "new.txt"),
]:
    os.utime(f, ns=T)
os.utime(p("link-new"), ns=T, follow_symlinks=False)
for root, dirs, _ in os.walk(D, topdown=False):
    for d in dirs:
        os.utime(os.path.join(root, d), ns=T, follow_symlinks=False)
print("ok")

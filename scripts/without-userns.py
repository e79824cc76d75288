#!/usr/bin/env python3
"""Runs a command as USER where user namespaces are forbidden: in a user namespace
(uids and gids 0-65535 mapped to themselves, so USER and root keep who they are) and a
mount namespace of its own, whose `user.max_user_namespaces` is 0, so that no process in
it can make another user namespace. That is the setting a host (or a container runtime's
namespace) uses to forbid them; the machines casfs is tested on do not let even root set
it host-wide (no CAP_SYS_RESOURCE), but the namespace's own copy is its root's to set.

usage (as root): without-userns.py USER COMMAND [ARG...]
"""

import ctypes
import os
import pwd
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000


def main():
    if len(sys.argv) < 3 or os.geteuid() != 0:
        sys.exit(__doc__)
    pw = pwd.getpwnam(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    ready_r, ready_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(mapped_w)
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
            e = ctypes.get_errno()
            sys.exit(f"unshare: {os.strerror(e)}")
        os.write(ready_w, b"x")
        os.read(mapped_r, 1)
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
        os.environ["HOME"] = pw.pw_dir
        os.environ["USER"] = pw.pw_name
        os.execvp(sys.argv[2], sys.argv[2:])
    os.close(ready_w)
    os.close(mapped_r)
    os.read(ready_r, 1)
    for m in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{m}", "w") as f:
            f.write("0 0 65536\n")
    os.write(mapped_w, b"x")
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()

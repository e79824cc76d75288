#!/usr/bin/env python3
"""Runs a systemd service unit as systemd would, on a machine where systemd is not
PID 1 (a CI container): the directives casfs.service uses, each applied or checked,
and any other directive refused, so the run cannot silently differ from the unit.

    run-unit.py start UNIT --state DIR [--trace]   start; returns once the main process runs
    run-unit.py stop --state DIR                   stop as systemd does; prints the time taken
    run-unit.py check UNIT --state DIR             (after --trace and stop) the trace against
                                                   the unit's sandboxing directives
    run-unit.py crash --state DIR                  SIGKILL the main process (Restart= is tested)
    run-unit.py status --state DIR                 the supervisor's state, as JSON

Applied as systemd applies them: Type=exec, User=root, Environment=,
EnvironmentFile= (`-` optional), ExecStart= ($VAR split into words, ${VAR} one word),
StateDirectory= and RuntimeDirectory= with their modes (and $STATE_DIRECTORY,
$RUNTIME_DIRECTORY), UMask=, KillMode= (mixed, control-group), KillSignal=,
TimeoutStopSec=, Restart=on-failure with RestartSec=, NoNewPrivileges= and
CapabilityBoundingSet= (through setpriv(1)). Not applied but checked against what the
service did (with --trace: strace -f of the main process and its threads, children
and forks): SystemCallFilter= (every system call made is in the set, expanded by
`systemd-analyze syscall-filter`), SystemCallArchitectures=native,
RestrictAddressFamilies= (every socket's family), RestrictNamespaces= (no unshare,
setns or clone of a namespace), RestrictRealtime= (no realtime scheduling),
LockPersonality= (no personality change), MemoryDenyWriteExecute= (no writable and
executable mapping, no mprotect to executable), DevicePolicy=closed with DeviceAllow=
(every device node opened is allowed). Ordering ([Unit] After= and the like) and
[Install] do not apply to one unit started by hand. The supervisor (this script,
detached) logs the service's output to DIR/output.log, as the journal would.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

APPLIED = {
    "Type", "User", "Environment", "EnvironmentFile", "ExecStart", "StateDirectory",
    "StateDirectoryMode", "RuntimeDirectory", "RuntimeDirectoryMode", "UMask",
    "KillMode", "KillSignal", "TimeoutStopSec", "Restart", "RestartSec",
    "NoNewPrivileges", "CapabilityBoundingSet",
}
CHECKED = {
    "SystemCallFilter", "SystemCallErrorNumber", "SystemCallArchitectures",
    "RestrictAddressFamilies", "RestrictNamespaces", "RestrictRealtime",
    "LockPersonality", "MemoryDenyWriteExecute", "DevicePolicy", "DeviceAllow",
}
UNIT_KEYS = {"Description", "Documentation", "After", "Wants", "Before", "Requires"}
INSTALL_KEYS = {"WantedBy"}
# Device nodes DevicePolicy=closed allows besides DeviceAllow= (systemd.resource-control(5)).
CLOSED_DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom",
                  "/dev/tty", "/dev/ptmx", "/dev/pts/"]


def die(msg):
    print(f"run-unit: {msg}", file=sys.stderr)
    sys.exit(1)


def parse_unit(path):
    """{section: [(key, value)]}, with line continuations joined."""
    sections, cur = {}, None
    lines = open(path).read().split("\n")
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            cur = line.strip("[]")
            sections.setdefault(cur, [])
            continue
        if cur is None or "=" not in line:
            die(f"{path}: cannot read {line!r}")
        k, v = line.split("=", 1)
        sections[cur].append((k.strip(), v.strip()))
    for sec, items in sections.items():
        known = {"Unit": UNIT_KEYS, "Service": APPLIED | CHECKED, "Install": INSTALL_KEYS}.get(sec)
        if known is None:
            die(f"{path}: section [{sec}] is not emulated")
        for k, _ in items:
            if k not in known:
                die(f"{path}: [{sec}] {k}= is neither applied nor checked by run-unit.py")
    return sections


def values(items, key):
    return [v for k, v in items if k == key]


def last(items, key, default=None):
    v = values(items, key)
    return v[-1] if v else default


def words(items, key):
    """A list setting (CapabilityBoundingSet=, SystemCallFilter=, ...): words of every
    assignment, an empty assignment resetting the list."""
    out = []
    for v in values(items, key):
        out = [] if v == "" else out + v.split()
    return out


def parse_env_assignments(v):
    env = {}
    for w in shlex.split(v):
        if "=" in w:
            k, val = w.split("=", 1)
            env[k] = val
    return env


def parse_env_file(path):
    env = {}
    for line in open(path):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("export "):
            line = line[len("export "):]
        k, _, v = line.partition("=")
        v = v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
            v = v[1:-1]
        env[k.strip()] = v
    return env


def seconds(v):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|min)?", v)
    if not m:
        die(f"cannot read the time span {v!r}")
    n = float(m.group(1))
    return {"ms": n / 1000, "min": n * 60}.get(m.group(2), n)


def expand_exec(line, env):
    """ExecStart=: prefixes refused, ${VAR} one word, $VAR split into words."""
    if line[:1] in "-@:+!":
        die(f"ExecStart= prefix {line[0]!r} is not emulated")
    if "%" in line.replace("%%", ""):
        die("ExecStart= specifiers (%) are not emulated")
    argv = []
    for w in shlex.split(line.replace("%%", "%")):
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", w)
        if m:
            argv += env.get(m.group(1), "").split()
            continue
        argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), w))
    return argv


def prepare(unit, state):
    s = parse_unit(unit)
    svc = s.get("Service", [])
    if last(svc, "Type", "simple") not in ("exec", "simple"):
        die("only Type=exec or Type=simple is emulated")
    if last(svc, "User", "root") != "root" or os.geteuid() != 0:
        die("only User=root, run by root, is emulated")
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "USER": "root", "LOGNAME": "root", "SHELL": "/bin/sh",
           "INVOCATION_ID": os.urandom(16).hex()}
    for v in values(svc, "Environment"):
        env.update(parse_env_assignments(v))
    for v in values(svc, "EnvironmentFile"):
        optional = v.startswith("-")
        p = v.lstrip("-")
        if os.path.exists(p):
            env.update(parse_env_file(p))
        elif not optional:
            die(f"EnvironmentFile={p} does not exist")
    dirs = []
    for key, base, var in [("StateDirectory", "/var/lib", "STATE_DIRECTORY"),
                           ("RuntimeDirectory", "/run", "RUNTIME_DIRECTORY")]:
        mode = int(last(svc, key + "Mode", "0755"), 8)
        made = [os.path.join(base, d) for d in words(svc, key)]
        for d in made:
            os.makedirs(d, exist_ok=True)
            os.chmod(d, mode)
            dirs.append((key, d))
        if made:
            env[var] = ":".join(made)
    execs = values(svc, "ExecStart")
    if len(execs) != 1:
        die("exactly one ExecStart= is emulated")
    argv = expand_exec(execs[0], env)
    caps = words(svc, "CapabilityBoundingSet")
    wrap = ["setpriv"]
    if last(svc, "NoNewPrivileges", "no") in ("yes", "true", "1"):
        wrap.append("--no-new-privs")
    if caps:
        if any(c.startswith("~") for c in caps):
            die("CapabilityBoundingSet=~ is not emulated")
        names = ",".join("+" + c.lower().removeprefix("cap_") for c in caps)
        wrap.append(f"--bounding-set=-all,{names}")
    return s, svc, env, argv, wrap + ["--"], dirs


def supervise(unit, state, trace):
    """The detached supervisor: starts the service, restarts it on failure, stops it
    when told (SIGTERM to the supervisor)."""
    s, svc, env, argv, wrap, dirs = prepare(unit, state)
    umask = int(last(svc, "UMask", "0022"), 8)
    restart = last(svc, "Restart", "no")
    restart_sec = seconds(last(svc, "RestartSec", "0.1"))
    kill_mode = last(svc, "KillMode", "control-group")
    kill_signal = getattr(signal, last(svc, "KillSignal", "SIGTERM"))
    timeout = seconds(last(svc, "TimeoutStopSec", "90s"))
    if kill_mode not in ("mixed", "control-group"):
        die(f"KillMode={kill_mode} is not emulated")
    log = open(os.path.join(state, "output.log"), "ab", buffering=0)
    stopping = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.update(now=True))
    status = {"pid": os.getpid(), "starts": 0, "exits": [], "argv": argv, "wrap": wrap}

    def save(**kw):
        status.update(kw)
        tmp = os.path.join(state, "status.json.tmp")
        with open(tmp, "w") as f:
            json.dump(status, f)
        os.replace(tmp, os.path.join(state, "status.json"))

    while True:
        cmd = list(wrap)
        if trace:
            n = status["starts"]
            cmd += ["strace", "-f", "-qq", "-s", "64", "-o", os.path.join(state, f"trace.{n}")]
        cmd += argv
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=log, cwd="/", start_new_session=True,
                                preexec_fn=lambda: os.umask(umask))
        main = proc.pid
        if trace:
            # The main process is the child of strace that runs the service (strace
            # forks probes of its own first), not strace.
            want = os.path.realpath(argv[0])
            deadline = time.time() + 10
            while time.time() < deadline and main == proc.pid:
                try:
                    kids = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
                except OSError:
                    kids = []
                for k in kids:
                    try:
                        if os.readlink(f"/proc/{k}/exe") == want:
                            main = int(k)
                    except OSError:
                        pass
                time.sleep(0.01)
            if main == proc.pid:
                die("the service's process under strace was not found")
        save(starts=status["starts"] + 1, main_pid=main, group=proc.pid, running=True)
        while proc.poll() is None and not stopping["now"]:
            time.sleep(0.05)
        if stopping["now"] and proc.poll() is None:
            t0 = time.time()
            try:
                os.kill(main, kill_signal)
                if kill_mode == "control-group":
                    os.killpg(proc.pid, kill_signal)
            except ProcessLookupError:
                pass
            while proc.poll() is None and time.time() - t0 < timeout:
                time.sleep(0.02)
            killed = proc.poll() is None
            # Whatever is left of the service (systemd: its control group) is killed.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            status["exits"].append({"code": proc.returncode, "stop_seconds": round(time.time() - t0, 3),
                                    "killed_after_timeout": killed})
            break
        status["exits"].append({"code": proc.returncode})
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # Clean, as systemd counts it: exit 0, or SIGHUP, SIGINT, SIGTERM, SIGPIPE.
        failed = proc.returncode != 0 and -proc.returncode not in (1, 2, 13, 15)
        if stopping["now"] or not (restart in ("on-failure", "always") and (failed or restart == "always")):
            break
        save(running=False)
        # A restart is a stop and a start: the runtime directory goes and comes back.
        for key, d in dirs:
            if key == "RuntimeDirectory":
                subprocess.run(["rm", "-rf", "--one-file-system", d])
        time.sleep(restart_sec)
        for key, d in dirs:
            if key == "RuntimeDirectory":
                os.makedirs(d, exist_ok=True)
                os.chmod(d, int(last(svc, "RuntimeDirectoryMode", "0755"), 8))
    # RuntimeDirectory= goes when the service stops; StateDirectory= stays.
    for key, d in dirs:
        if key == "RuntimeDirectory":
            subprocess.run(["rm", "-rf", "--one-file-system", d])
    save(running=False, stopped=True)


def read_status(state):
    with open(os.path.join(state, "status.json")) as f:
        return json.load(f)


def start(unit, state, trace):
    os.makedirs(state, exist_ok=True)
    for f in os.listdir(state):
        os.unlink(os.path.join(state, f))
    prepare(unit, state)  # refuses what is not emulated, before detaching
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork():
            os._exit(0)
        fd = os.open(os.devnull, os.O_RDWR)
        for k in (0, 1, 2):
            os.dup2(fd, k)
        try:
            supervise(unit, state, trace)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            st = read_status(state)
            if st.get("running"):
                print(json.dumps({"main_pid": st["main_pid"], "argv": st["argv"], "wrap": st["wrap"]}))
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    die("the service did not start (see output.log)")


def stop(state):
    st = read_status(state)
    t0 = time.time()
    os.kill(st["pid"], signal.SIGTERM)
    while True:
        st = read_status(state)
        if st.get("stopped"):
            break
        if time.time() - t0 > 600:
            die("the supervisor did not stop")
        time.sleep(0.05)
    print(json.dumps({"stopped_in_s": round(time.time() - t0, 3), "exits": st["exits"]}))
    last_exit = st["exits"][-1]
    if last_exit.get("killed_after_timeout"):
        die("the service did not stop within TimeoutStopSec= and was killed")


def crash(state):
    st = read_status(state)
    if not st.get("running"):
        die(f"the service is not running: {st}")
    os.kill(st["main_pid"], signal.SIGKILL)
    t0 = time.time()
    while time.time() - t0 < 30:
        new = read_status(state)
        if new["starts"] > st["starts"] and new.get("running"):
            print(json.dumps({"restarted_in_s": round(time.time() - t0, 3), "main_pid": new["main_pid"]}))
            return
        time.sleep(0.05)
    die("the service was not restarted (Restart=)")


def expand_filter(names):
    """The system calls a SystemCallFilter= allows (systemd-analyze syscall-filter)."""
    allowed, todo, seen = set(), list(names), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if not n.startswith("@"):
            allowed.add(n)
            continue
        out = subprocess.run(["systemd-analyze", "syscall-filter", n], capture_output=True,
                             text=True, check=True).stdout
        for line in out.splitlines()[1:]:
            line = line.strip()
            if line and not line.startswith("#"):
                todo.append(line)
    return allowed


TRACE_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. )?([a-z_0-9]+)(?: resumed>)?(.*)$")


# System calls casfs tries and, refused with EPERM (a SystemCallFilter= of a systemd
# that predates them, with SystemCallErrorNumber=EPERM), stops trying for another way:
# getxattrat/listxattrat (Linux 6.13) fall back to /proc/self/fd
# (src/sys/xattr.rs; its test `refused_xattrat_calls_fall_back_to_proc`). By
# name, and by number where strace does not know the name.
PROBES = {"getxattrat", "listxattrat", "syscall_0x1d0", "syscall_0x1d1"}


def check(unit, state):
    s = parse_unit(unit)
    svc = s.get("Service", [])
    traces = sorted(f for f in os.listdir(state) if f.startswith("trace."))
    if not traces:
        die("no trace: start with --trace")
    calls, families, devices, problems = {}, set(), set(), []
    restrict_ns = last(svc, "RestrictNamespaces") == "yes"
    mdwe = last(svc, "MemoryDenyWriteExecute") == "yes"
    for t in traces:
        for line in open(os.path.join(state, t), errors="replace"):
            m = TRACE_LINE.match(line)
            if not m or m.group(2) in ("exited", "killed"):
                continue
            name, rest = m.group(2), m.group(3)
            if "resumed>" in line:
                continue
            calls[name] = calls.get(name, 0) + 1
            if name == "socket":
                families.add(rest.split(",")[0].lstrip("("))
            if name in ("open", "openat", "openat2"):
                pm = re.search(r'"(/dev/[^"]*)"', rest)
                if pm and "= -1" not in rest:
                    devices.add(pm.group(1))
            if restrict_ns and name in ("unshare", "setns") and "= -1" not in rest:
                problems.append(f"RestrictNamespaces=: {line.strip()}")
            if restrict_ns and name in ("clone", "clone3") and "CLONE_NEW" in rest:
                problems.append(f"RestrictNamespaces=: {line.strip()}")
            if name in ("sched_setscheduler", "sched_setattr") and re.search(r"SCHED_(FIFO|RR|DEADLINE)", rest):
                problems.append(f"RestrictRealtime=: {line.strip()}")
            if name == "personality" and not re.match(r"\(0xffffffff\)", rest):
                problems.append(f"LockPersonality=: {line.strip()}")
            if mdwe and name in ("mmap", "mprotect", "pkey_mprotect"):
                w, x = "PROT_WRITE" in rest, "PROT_EXEC" in rest
                if (name == "mmap" and w and x) or (name != "mmap" and x):
                    problems.append(f"MemoryDenyWriteExecute=: {line.strip()}")
    filt = words(svc, "SystemCallFilter")
    if filt:
        if any(f.startswith("~") for f in filt):
            die("SystemCallFilter=~ is not checked")
        allowed = expand_filter(filt)
        if last(svc, "SystemCallErrorNumber") == "EPERM":
            allowed |= PROBES
        for c in sorted(set(calls) - allowed):
            problems.append(f"SystemCallFilter=: {c} ({calls[c]} calls) is not allowed")
    fams = words(svc, "RestrictAddressFamilies")
    for f in sorted(families - set(fams)) if fams else []:
        problems.append(f"RestrictAddressFamilies=: a socket of family {f}")
    if last(svc, "DevicePolicy") == "closed":
        allow = [v.split()[0] for v in values(svc, "DeviceAllow")] + CLOSED_DEVICES
        for d in sorted(devices):
            if not any(d == a or (a.endswith("/") and d.startswith(a))
                       or (a == "block-loop" and re.fullmatch(r"/dev/loop\d+", d))
                       for a in allow):
                problems.append(f"DevicePolicy=closed: opened {d}")
    report = {"system_calls": len(calls), "calls": sum(calls.values()),
              "names": " ".join(sorted(calls)),
              "socket_families": sorted(families), "devices_opened": sorted(devices),
              "problems": problems}
    print(json.dumps(report, indent=1))
    if problems:
        die(f"{len(problems)} thing(s) the unit's sandboxing would refuse")


def main():
    args = sys.argv[1:]
    if not args:
        die(__doc__)
    verb, rest = args[0], args[1:]
    state = rest[rest.index("--state") + 1] if "--state" in rest else die("--state DIR is needed")
    state = os.path.abspath(state)
    if verb == "start":
        start(os.path.abspath(rest[0]), state, "--trace" in rest)
    elif verb == "stop":
        stop(state)
    elif verb == "crash":
        crash(state)
    elif verb == "check":
        check(os.path.abspath(rest[0]), state)
    elif verb == "status":
        print(json.dumps(read_status(state)))
    else:
        die(f"unknown verb {verb}")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# CI: casfs installed the way a Linux host installs a service (issue 42). Builds the
# Debian packages (scripts/package-deb.sh), checks them with lintian, installs them,
# checks the unit with systemd-analyze verify, starts casfs.service (with systemd where
# it is PID 1; otherwise the unit's own ExecStart under the unit's environment,
# directories, umask, capabilities and stop rules, by scripts/run-unit.py, which also
# traces the service and holds what it did against the unit's sandboxing), and then,
# as a member of group casfs who is not root: makes sandboxes through the service's
# socket, writes and edits files in them (the workspace theirs: SO_PEERCRED), and
# finishes runs into checkpoints; a user outside the group is refused. It upgrades the
# package over itself with the store live (a run going, a sandbox mounted) and finds
# every checkpoint after the restart, kills the server to see Restart=on-failure, packs
# the npm package and runs a five-line script from an empty project against the
# service, removes the package (the store stays, and a reinstall finds every checkpoint)
# and purges it (the store goes). Needs root; installs what it needs; refuses to run
# where casfs is installed or /var/lib/casfs exists (it would replace and then delete
# them). Prints the time each step took.
set -euo pipefail
cd "$(dirname "$0")/.."
src="$PWD"
t0=$(date +%s)
step() { echo "test-package: [$(($(date +%s) - t0)) s] $*" >&2; }
fail() {
  echo "test-package: FAILED: $*" >&2
  # What the service said last (under systemd: journalctl -u casfs).
  [ -s "${state:-}/output.log" ] && tail -n 30 "$state/output.log" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || fail "run as root (it installs a package)"
if dpkg-query -W -f='${Status}' casfs 2>/dev/null | grep -q installed || [ -e /var/lib/casfs ] ||
  [ -e /etc/casfs ]; then
  fail "casfs is installed here, or /var/lib/casfs or /etc/casfs exists: this test would replace and purge them"
fi

need=(lintian systemd strace curl python3 util-linux passwd fuse3 file man-db)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  step "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The group and the user the package makes are left by a purge, by design; this test
# removes them again if they were not there before.
had_group=no
getent group casfs >/dev/null && had_group=yes
had_sandbox_user=no
getent passwd casfs-sandbox >/dev/null && had_sandbox_user=yes
command -v npm >/dev/null 2>&1 || fail "npm (Node.js 20.18 or later) is needed: scripts/setup.sh installs it"

work="$(mktemp -d)"
chmod 0755 "$work"
user="casfsci$$"
outsider="casfsno$$"
unit=/lib/systemd/system/casfs.service
sock=/run/casfs/serve.sock
state="$work/unit"
# systemd runs the service where it is PID 1; run-unit.py does elsewhere.
if [ -d /run/systemd/system ] && [ "$(ps -p 1 -o comm=)" = systemd ]; then
  manager=systemd
else
  manager=run-unit
fi

svc_start() {
  if [ $manager = systemd ]; then
    systemctl start casfs.service
  else
    python3 scripts/run-unit.py start "$unit" --state "$state" --trace >&2
  fi
  wait_ready
}
# Until the service answers on its socket.
wait_ready() {
  for _ in $(seq 400); do
    curl -sf --unix-socket "$sock" http://localhost/v1/health >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  fail "the service does not answer on $sock (see $state/output.log or journalctl -u casfs)"
}
svc_stop() {
  if [ $manager = systemd ]; then
    systemctl stop casfs.service
  else
    # The trace of each run is checked against the unit's sandboxing once it stopped.
    python3 scripts/run-unit.py stop --state "$state" >&2 || fail "stopping the service"
    python3 scripts/run-unit.py check "$unit" --state "$state" >&2 || fail "the unit's sandboxing"
  fi
}
cleanup() {
  local rc=$?
  set +e
  if [ "$rc" != 0 ] && [ -n "${CASFS_TEST_KEEP:-}" ]; then
    cp -a "$state" "$CASFS_TEST_KEEP" && echo "test-package: kept $state in $CASFS_TEST_KEEP" >&2
  fi
  if [ $manager = run-unit ] && [ -e "$state/status.json" ]; then
    python3 scripts/run-unit.py stop --state "$state" >/dev/null 2>&1
  fi
  [ $manager = systemd ] && systemctl stop casfs.service 2>/dev/null
  dpkg -P casfs-dbgsym casfs >/dev/null 2>&1
  grep -q '^# written by scripts/test-package.sh' /etc/casfs/serve.env 2>/dev/null && rm -rf /etc/casfs
  userdel "$user" 2>/dev/null
  userdel "$outsider" 2>/dev/null
  groupdel "$user" 2>/dev/null
  groupdel "$outsider" 2>/dev/null
  [ $had_group = no ] && groupdel casfs 2>/dev/null
  [ $had_sandbox_user = no ] && userdel casfs-sandbox 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

# As $1, with its groups: the server sees that user at the other end of the socket.
as() {
  local who="$1"
  shift
  setpriv --reuid="$who" --regid="$(id -g "$who")" --init-groups -- env -i PATH=/usr/bin:/bin "$@"
}
# api USER METHOD PATH [JSON]: the answer's body on stdout; fails unless 200.
api() {
  local who="$1" method="$2" path="$3" body="${4:-}" out
  local args=(-sS --unix-socket "$sock" -X "$method" -w '\n%{http_code}')
  [ -n "$body" ] && args+=(-H 'Content-Type: application/json' --data "$body")
  out="$(as "$who" curl "${args[@]}" "http://localhost$path")"
  [ "${out##*$'\n'}" = 200 ] || fail "$method $path as $who: ${out}"
  printf '%s\n' "${out%$'\n'*}"
}
json() { python3 -c "import json,sys; v=json.load(sys.stdin); print($1)"; }

step "building the packages"
build_start=$(date +%s)
mapfile -t debs < <(scripts/package-deb.sh "$work/debs")
deb="${debs[0]}"
dbgdeb="${debs[1]}"
step "built $(basename "$deb") ($(stat -c %s "$deb") bytes) and $(basename "$dbgdeb") in $(($(date +%s) - build_start)) s"
dpkg-deb --info "$deb" | sed -n '/Package:/,$p' >&2

step "lintian"
# Tags kept on purpose are overridden in the package (usr/share/lintian/overrides/casfs,
# from packaging/deb/lintian-overrides), each with its reason; any other warning or
# error fails.
# (Shown with the informational tags first: lintian 2.116 counts an overridden warning
# as a failure once it is shown.)
lintian --display-info --show-overrides "$deb" "$dbgdeb" >&2 || true
lintian --fail-on error,warning "$deb" "$dbgdeb" >&2 || fail "lintian found errors or warnings"

step "installing"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$deb" "$dbgdeb" >/dev/null
getent group casfs >/dev/null || fail "the package made no group casfs"
casfs --version | grep -Eq '^casfs [0-9.]+ \(commit ([0-9a-f]{12}(-modified)?|unknown)\)$' ||
  fail "casfs --version: $(casfs --version)"
step "$(casfs --version)"
man -w casfs-serve >/dev/null || fail "no man page casfs-serve(1)"
for f in /usr/share/bash-completion/completions/casfs /usr/share/zsh/vendor-completions/_casfs \
  /usr/share/fish/vendor_completions.d/casfs.fish /usr/share/doc/casfs/copyright; do
  [ -s "$f" ] || fail "$f is missing"
done
[ -e /etc/casfs/serve.env ] && fail "the package ships /etc/casfs/serve.env"
id=$(readelf -n /usr/bin/casfs | sed -n 's/.*Build ID: \([0-9a-f]*\).*/\1/p')
[ -s "/usr/lib/debug/.build-id/${id:0:2}/${id:2}.debug" ] || fail "casfs-dbgsym holds no debug file for build id $id"
file /usr/bin/casfs | grep -q ', stripped' || fail "/usr/bin/casfs is not stripped"

step "systemd-analyze verify"
systemd-analyze verify "$unit" || fail "systemd-analyze verify $unit"

useradd -M -U -s /usr/sbin/nologin -G casfs "$user"
useradd -M -U -s /usr/sbin/nologin "$outsider"
step "starting casfs.service ($manager: PID 1 is $(ps -p 1 -o comm=)); caller $user (uid $(id -u "$user"), in group casfs)"
svc_start
[ "$(stat -c '%a %U:%G' "$sock")" = "660 root:casfs" ] || fail "$sock is $(stat -c '%a %U:%G' "$sock")"
if as "$outsider" curl -sS --unix-socket "$sock" http://localhost/v1/health >/dev/null 2>&1; then
  fail "$outsider, not in group casfs, was answered"
fi
api "$user" GET /v1/health | json 'v["ok"]' | grep -qx True || fail "health"

step "sandboxes and checkpoints as $user"
# run THREAD RUN SCRIPT: a run whose sandbox the caller works in (SCRIPT in its root),
# then finishes; prints the checkpoint.
run() {
  local thread="$1" id="$2" script="$3" root
  root="$(api "$user" POST /v1/runs "{\"thread\": \"$thread\", \"run_id\": \"$id\"}" | json 'v["sandbox"]["path"]')"
  [ "$(stat -c %u "$root")" = "$(id -u "$user")" ] || fail "sandbox $root is not $user's"
  as "$user" sh -c "cd '$root' && $script" || fail "writing in $root as $user"
  # Every file of the workspace is the caller's: those restored and those written.
  local others
  others="$(find "$root" ! -user "$user")"
  [ -z "$others" ] || fail "not $user's in $root: $others"
  api "$user" POST "/v1/runs/$id/finish" | json 'v["checkpoint"]'
}
c1="$(run pkg-a r1 "printf 'one\n' > a.txt && mkdir -p src && printf 'fn main() {}\n' > src/main.rs")"
# The live sandbox of pkg-a is resumed.
c2="$(run pkg-a r2 "printf 'two\n' >> a.txt && mv src/main.rs src/lib.rs && rm -f nothing")"
c3="$(run pkg-b r1 "printf 'b\n' > b.txt")"
for c in "$c1" "$c2" "$c3"; do [ ${#c} = 64 ] || fail "a run published no checkpoint ($c)"; done
[ "$(casfs --store /var/lib/casfs cat "$c2" a.txt)" = "$(printf 'one\ntwo')" ] || fail "checkpoint $c2's a.txt"
# Left live across the upgrade: a client's sandbox with uncaptured work, and a run.
sb="$(api "$user" POST /v1/sandboxes '{"thread": "pkg-b"}' | json 'v["path"]')"
as "$user" sh -c "printf 'uncaptured\n' > '$sb/u.txt'"
api "$user" POST /v1/runs '{"thread": "pkg-c", "run_id": "going"}' >/dev/null
checkpoints() {
  for t in pkg-a pkg-b; do api "$user" GET "/v1/threads/$t/checkpoints" | json '"\n".join(c["id"] for c in v)'; done | sort
}
before="$(checkpoints)"
[ "$(echo "$before" | wc -l)" = 3 ] || fail "expected 3 checkpoints, found: $before"

step "a sandbox's processes under the unit: isolated, as $user and as casfs-sandbox (root's)"
# exec_in USER KEY COMMAND: the exec's answer; fails unless it exited 0.
exec_in() {
  local body
  body="$(python3 -c 'import json,sys; print(json.dumps({"command": sys.argv[1]}))' "$3")"
  local out
  out="$(api "$1" POST "/v1/sandboxes/$2/exec" "$body")"
  [ "$(echo "$out" | json 'v["exit_code"]')" = 0 ] || fail "exec in $2 as $1: $out"
  echo "$out" | json 'v["stdout"]'
}
# Its own user, a workspace it writes, no root-only file, no network but loopback.
probe='id -u && echo made > made.txt && test ! -r /etc/shadow && ! ls /var/lib/casfs 2>/dev/null && grep -c : /proc/net/dev'
x="$(api "$user" POST /v1/sandboxes '{"thread": "pkg-x"}')"
key="$(echo "$x" | json 'v["key"]')"
got="$(exec_in "$user" "$key" "$probe")"
[ "$got" = "$(printf '%s\n1' "$(id -u "$user")")" ] || fail "a process in $user's sandbox said: $got"
[ "$(stat -c %U "$(echo "$x" | json 'v["path"]')/made.txt")" = "$user" ] || fail "made.txt is not $user's"
rkey="$(api root POST /v1/sandboxes '{"thread": "pkg-root"}' | json 'v["key"]')"
got="$(exec_in root "$rkey" "$probe")"
[ "$got" = "$(printf '%s\n1' "$(id -u casfs-sandbox)")" ] || fail "a process in root's sandbox said: $got"
[ -x /usr/libexec/casfs/casfs-sandbox-init ] || fail "the package has no sandbox init"
# Each bounded by a disk of its own (the unit lets casfs make loop devices).
disks="$(find /var/lib/casfs/mounts -maxdepth 1 -name '*.disk' | wc -l)"
[ "$disks" -ge 2 ] || fail "the sandboxes have $disks bounded disk(s), not 2"
size="$(exec_in "$user" "$key" "df -P /workspace | awk 'NR == 2 { print \$2 }'")"
[ "$size" -le $((9 << 20)) ] || fail "$user's sandbox's workspace has $size KiB of room, not its 8 GiB"
api "$user" DELETE "/v1/sandboxes/$key" >/dev/null
api root DELETE "/v1/sandboxes/$rkey" >/dev/null

step "the npm package, from an empty project, against the service"
answer="$(scripts/test-npm-package.sh "$sock" "$user")"
echo "$answer" | json 'v["ok"] is True and "pkg-a" in v["threads"] and "pkg-b" in v["threads"]' | grep -qx True ||
  fail "the npm check script answered $answer"
step "npm script answered $answer"

step "upgrading the package over itself, the store live; serve.env turns FUSE sandboxes on"
# The administrator's settings, read by the unit's EnvironmentFile= at the restart:
# from now on the sandboxes are casfs's own FUSE mounts (overlay until now).
install -d -m0755 /etc/casfs
printf '# written by scripts/test-package.sh\nCASFS_SERVE_ARGS="--mode fuse"\n' > /etc/casfs/serve.env
chmod 0600 /etc/casfs/serve.env
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --reinstall "$deb" >/dev/null
[ -s /etc/casfs/serve.env ] || fail "the upgrade touched /etc/casfs/serve.env"
if [ $manager = run-unit ]; then
  # What postinst's try-restart does under systemd.
  svc_stop
  svc_start
fi
mounted="$(awk '$5 ~ "^/var/lib/casfs/sandboxes/" { print $5 }' /proc/self/mountinfo)"
[ -z "$mounted" ] || fail "sandboxes still mounted after the restart: $mounted"
[ "$(checkpoints)" = "$before" ] || fail "checkpoints after the upgrade: $(checkpoints), before: $before"
for c in $before; do api "$user" GET "/v1/checkpoints/$c" >/dev/null; done
# The run going at the stop let its thread go: a new run takes it at once.
api "$user" POST /v1/runs '{"thread": "pkg-c", "run_id": "after"}' >/dev/null
api "$user" POST /v1/runs/after/abort '{"cancelled": true}' >/dev/null
# A new sandbox (FUSE now), restored at the head: the restored file is the caller's.
c4="$(run pkg-a r3 "test \"\$(cat a.txt)\" = \"\$(printf 'one\ntwo')\" && printf 'three\n' >> a.txt")"
# A member's sandbox keys name the member (`user@thread`): found by its thread.
api "$user" GET /v1/sandboxes | json '[s["mode"] for s in v if s["thread"] == "pkg-a"]' | grep -qx "\['fuse'\]" ||
  fail "serve.env's CASFS_SERVE_ARGS did not reach the service"
[ "$(casfs --store /var/lib/casfs cat "$c4" a.txt)" = "$(printf 'one\ntwo\nthree')" ] || fail "checkpoint $c4's a.txt"

step "Restart=on-failure: the server killed"
if [ $manager = run-unit ]; then
  python3 scripts/run-unit.py crash --state "$state" >&2
else
  systemctl kill --signal=SIGKILL casfs.service
fi
wait_ready
[ "$(checkpoints)" = "$(printf '%s\n' $before "$c4" | sort)" ] || fail "checkpoints after the crash"

step "removing the package: the store stays"
svc_stop
apt-get remove -y -qq casfs-dbgsym casfs >/dev/null
[ ! -e /usr/bin/casfs ] && [ ! -e "$unit" ] || fail "files left after remove"
[ -d /var/lib/casfs/db ] || fail "remove deleted the store"
getent group casfs >/dev/null || fail "remove deleted the group"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$deb" >/dev/null
svc_start
[ "$(checkpoints)" = "$(printf '%s\n' $before "$c4" | sort)" ] || fail "checkpoints after remove and install"
svc_stop

step "purging the package: the store goes"
dpkg -P casfs >/dev/null
[ ! -e /var/lib/casfs ] || fail "purge left /var/lib/casfs"
[ -s /etc/casfs/serve.env ] || fail "purge deleted the administrator's /etc/casfs/serve.env"
rm -rf /etc/casfs
step "passed ($(($(date +%s) - t0)) s in all)"

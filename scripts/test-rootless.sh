#!/usr/bin/env bash
# Rootless casfs, tested as an ordinary user (docs/mount.md, "Rootless"):
#  1. the mount suite (cargo test --test fuse) on the overlay backend, run inside casfs's
#     namespace of that user, where each test's `casfs mount` makes a rootless overlay;
#  2. the TypeScript client's tests against a `casfs serve` that user runs;
#  3. the commands as a user runs them from outside the namespace: mount, exec, status,
#     checkpoint, restore, a killed daemon's work adopted, unmount; and what a program
#     inside can get at (the holder's environment, capabilities, a forged pid file);
#  4. a sandbox's processes under a `casfs serve` of that user: isolated by bubblewrap
#     (no control group is delegated to it: no limits);
#  5. a host that forbids user namespaces (scripts/without-userns.py): `auto` falls back
#     to FUSE and says why, `--mode overlay` refuses and names the setting.
# Run as root (it makes the user and gives it /dev/fuse) after scripts/setup.sh and with
# scripts/services.sh sourced, as scripts/test.sh does.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "test-rootless.sh: run as root (it makes a user)" >&2; exit 1; }
user=${CASFS_ROOTLESS_USER:-casfs-rootless}
id "$user" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$user"
home=$(getent passwd "$user" | cut -d: -f6)
uid=$(id -u "$user")
# /dev/fuse as Debian's udev rule leaves it (0666); a machine without udev has 0600.
chmod 0666 /dev/fuse
repo=$PWD
casfs=$repo/target/debug/casfs
cargo build --locked
suite=$(cargo test --locked --no-run --test fuse --message-format=json |
  python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "fuse" and m.get("executable"):
        print(m["executable"])')
# The user's environment: nothing of root's but where the fleet services are.
as_user() {
  runuser -u "$user" -- env -i HOME="$home" USER="$user" LANG=C.UTF-8 \
    PATH="/usr/local/bin:/usr/bin:/bin" RUST_BACKTRACE=1 \
    CASFS_TEST_PG="${CASFS_TEST_PG:-}" PGPASSWORD="${PGPASSWORD:-}" \
    CASFS_TEST_S3="${CASFS_TEST_S3:-}" AWS_ENDPOINT_URL="${AWS_ENDPOINT_URL:-}" \
    AWS_ALLOW_HTTP="${AWS_ALLOW_HTTP:-}" AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-}" \
    AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-}" AWS_REGION="${AWS_REGION:-}" \
    "$@"
}
stop_holder() { pkill -u "$user" -f 'casfs namespace-holder' 2>/dev/null || true; }
work=$(mktemp -d /tmp/casfs-rootless.XXXXXX)
chown "$user:" "$work"
cleanup() {
  # Mounts of the user live in its namespace: they go with their daemons and holder.
  pkill -u "$user" -f "$work" 2>/dev/null || true
  stop_holder
  rm -rf "$work"
}
trap cleanup EXIT
stop_holder

echo "== the mount suite as $user (uid $uid), rootless overlay"
[ -n "${CASFS_ROOTLESS_SKIP_SUITE:-}" ] || as_user CASFS_MOUNT_MODE=overlay "$casfs" exec --namespace --keep-mount-rights \
  --cwd "$repo" / -- "$suite"

echo "== the TypeScript client's tests against a casfs serve of $user"
# A copy the user may write (its build writes src/generated and dist), laid out as
# in the repository (it reads ../../docs/openapi.json).
mkdir -p "$work/repo/clients" "$work/repo/docs"
cp -a clients/typescript "$work/repo/clients/"
cp docs/openapi.json "$work/repo/docs/"
chown -R "$user:" "$work/repo"
as_user sh -c "cd '$work/repo/clients/typescript' && CASFS_MOUNT_MODE=overlay \
  CASFS_BIN='$casfs' npm test"

echo "== the commands from outside the namespace"
fail() { echo "test-rootless.sh: $*" >&2; exit 1; }
c() { as_user "$casfs" --store "$work/store" "$@"; }
mp=$work/ws
as_user mkdir "$mp"
c mount --mode overlay -t rl "$mp" | grep -q "casfs exec" || fail "mount does not say how to enter"
[ -z "$(ls -A "$mp")" ] || fail "outside the namespace, $mp should be the plain directory"
c exec --cwd "$mp" "$mp" -- sh -c 'echo one > a && mkdir d && echo two > d/f'
[ "$(c exec "$mp" -- id -u)" = "$uid" ] || fail "exec runs as another uid"
st=$(c --json status "$mp")
echo "$st" | python3 -c 'import json, sys
s = json.load(sys.stdin)
assert s["mode"] == "overlay" and s["namespace"]["uid"] == '"$uid"', s
assert s["dirty_files"] == 2, s' || fail "status: $st"
outside=$(echo "$st" | python3 -c 'import json, sys; print(json.load(sys.stdin)["namespace"]["outside"])')
[ "$(as_user cat "$outside/a")" = one ] || fail "not readable from outside at $outside"
first=$(c --json checkpoint "$mp" | python3 -c 'import json, sys; print(json.load(sys.stdin)["checkpoint"])')
c exec --cwd "$mp" "$mp" -- sh -c 'rm a && echo three >> d/f'
c checkpoint "$mp" >/dev/null
c restore "$mp" "$first" >/dev/null
[ "$(c exec "$mp" -- cat "$mp/a")" = one ] || fail "restore did not bring a back"
c exec --cwd "$mp" "$mp" -- sh -c 'echo uncaptured > u'
pid=$(c --json status "$mp" | python3 -c 'import json, sys; print(json.load(sys.stdin)["pid"])')
kill -9 "$pid"
c mount --mode overlay -t rl "$mp" >/dev/null
[ "$(c exec "$mp" -- cat "$mp/u")" = uncaptured ] || fail "a killed daemon's write was lost"
c unmount "$mp" >/dev/null
if c exec "$mp" -- true 2>/dev/null; then fail "exec after unmount should fail"; fi

echo "== what a program inside the namespace can get at"
stop_holder
sleep 0.2
mp3=$work/ws3
as_user mkdir "$mp3"
as_user env CASFS_TEST_SECRET=do-not-leak "$casfs" --store "$work/store3" mount --mode overlay \
  -t rl3 "$mp3" >/dev/null
pidfile=
for f in "/run/user/$uid/casfs/namespace.pid" "/tmp/casfs-$uid/namespace.pid"; do
  if [ -f "$f" ]; then pidfile=$f; break; fi
done
[ -n "$pidfile" ] || fail "no pid file of the user's namespace"
holder=$(cut -d' ' -f1 "$pidfile")
if tr '\0' '\n' < "/proc/$holder/environ" | grep -q do-not-leak; then
  fail "the holder kept its starter's environment"
fi
# A program run by casfs exec: no capabilities, none in its bounding set, none to gain.
caps=$(as_user "$casfs" exec "$mp3" -- grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' \
  /proc/self/status | tr -s '\t ' ' ')
echo "$caps" | grep -q "CapEff: 0000000000000000" || fail "exec: capabilities: $caps"
echo "$caps" | grep -q "CapBnd: 0000000000000000" || fail "exec: bounding set: $caps"
echo "$caps" | grep -q "NoNewPrivs: 1" || fail "exec: no_new_privs: $caps"
# A program inside names a namespace of its own in the pid file: a mount made from outside
# must not join it.
as_user "$casfs" exec "$mp3" -- sh -c 'unshare -Um sleep 60 & sleep 0.5
  p=$(pgrep -n -u "$(id -u)" -x sleep)
  printf "%s %s %s\n" "$p" "$(stat -L -c %i /proc/$p/ns/user)" "$(stat -L -c %i /proc/$p/ns/mnt)" \
    > '"$pidfile"
forged=$(cut -d' ' -f2 "$pidfile")
mp4=$work/ws4
as_user mkdir "$mp4"
c mount --mode overlay -t rl4 "$mp4" >/dev/null
joined=$(as_user "$casfs" exec "$mp4" -- stat -L -c %i /proc/self/ns/user)
[ "$joined" != "$forged" ] || fail "a mount joined the namespace a program inside made"
c unmount "$mp4" >/dev/null
as_user "$casfs" --store "$work/store3" unmount "$mp3" >/dev/null
pkill -u "$user" -x sleep 2>/dev/null || true

echo "== a sandbox's processes under a casfs serve of $user: isolated, without limits"
stop_holder
sleep 0.2
srv=$work/serve
as_user mkdir "$srv"
as_user "$casfs" --store "$srv/store" serve --socket "$srv/s.sock" --sandboxes "$srv/sb" \
  >"$srv.log" 2>&1 &
for _ in $(seq 200); do [ -S "$srv/s.sock" ] && break; sleep 0.1; done
api() { as_user curl -sS --unix-socket "$srv/s.sock" -H 'Content-Type: application/json' "$@"; }
api -X POST http://x/v1/sandboxes -d '{"thread":"iso"}' >/dev/null
probe='id -u; echo w > /workspace/w && cat /workspace/w; grep -E "^(CapEff|Seccomp):" /proc/self/status; ls /home 2>&1'
out=$(api -X POST http://x/v1/sandboxes/iso/exec \
  -d "$(python3 -c 'import json, sys; print(json.dumps({"command": sys.argv[1]}))' "$probe")")
echo "$out" | python3 -c 'import json, sys
r = json.load(sys.stdin)
o = r["stdout"]
assert o.startswith(sys.argv[1] + "\nw\n"), r
assert "CapEff:\t0000000000000000" in o and "Seccomp:\t2" in o, r
assert "No such file" in o, r' "$uid" || fail "isolated exec under $user's server: $out $(cat "$srv.log")"
pkill -u "$user" -f "$srv/store" 2>/dev/null || true

echo "== a host without user namespaces"
# In a namespace of its own whose user.max_user_namespaces is 0 (scripts/without-userns.py).
mp2=$work/ws2
as_user mkdir "$mp2"
scripts/without-userns.py "$user" env -i PATH=/usr/local/bin:/usr/bin:/bin \
  CASFS="$casfs --store $work/store2" MP="$mp2" sh -ec '
  fail() { echo "test-rootless.sh: $*" >&2; exit 1; }
  err=$($CASFS mount --mode overlay -t rl2 "$MP" 2>&1) && fail "--mode overlay should refuse"
  echo "$err" | grep -q "user.max_user_namespaces" || fail "the refusal does not name the setting: $err"
  $CASFS mount --mode auto -t rl2 "$MP" >/dev/null
  st=$($CASFS --json status "$MP")
  echo "$st" | python3 -c "import json, sys
s = json.load(sys.stdin)
assert s[\"mode\"] == \"fuse\" and \"user.max_user_namespaces\" in s[\"mode_fallback\"], s" ||
    fail "auto: $st"
  $CASFS status "$MP" | grep -q "auto chose fuse" || fail "status does not say why"
  $CASFS unmount "$MP" >/dev/null'
echo "rootless: all passed"

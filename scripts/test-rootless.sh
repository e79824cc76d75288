#!/usr/bin/env bash
# Rootless casfs, tested as an ordinary user (docs/mount.md, "Rootless"):
#  1. the mount suite (cargo test --test fuse) on the overlay backend, run inside casfs's
#     namespace of that user, where each test's `casfs mount` makes a rootless overlay;
#  2. the TypeScript client's tests against a `casfs serve` that user runs;
#  3. the commands as a user runs them from outside the namespace: mount, exec, status,
#     checkpoint, restore, a killed daemon's work adopted, unmount;
#  4. a host that forbids user namespaces (scripts/without-userns.py): `auto` falls back
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
as_user CASFS_MOUNT_MODE=overlay "$casfs" exec --namespace --keep-mount-rights \
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

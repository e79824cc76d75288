#!/usr/bin/env bash
# The end-to-end demo on the embedded default store: builds casfs, makes a workspace,
# captures it, changes it, captures again, restores the first checkpoint, re-captures
# with `casfs watch` running, mounts it read-only through FUSE; then mounts the thread writable, writes into it, checkpoints
# (only what changed is read), changes more, restores instantly; then runs agent runs
# through `casfs serve` (lease, sandbox, conversation, secrets, pause); and prints what it
# did with timings. Everything lives in a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

cargo build --release --locked --quiet
CASFS="$PWD/target/release/casfs"
DEMO="$(mktemp -d -t casfs-demo.XXXXXX)"
trap '"$CASFS" watch "$DEMO/workspace" --stop >/dev/null 2>&1; rm -rf "$DEMO"' EXIT
export CASFS_STORE="$DEMO/store"
W="$DEMO/workspace"

now() { date +%s%N; }
step() { printf '\n== %s\n' "$*"; }
timed() {
  local t0 t1; t0=$(now); "$@"; t1=$(now)
  printf '   (%d ms wall)\n' $(( (t1 - t0) / 1000000 ))
}

step "Generate a workspace: 5,000 source-like files and one 64 MiB file"
mkdir -p "$W"
python3 - "$W" <<'PY'
import os, random, sys
root = sys.argv[1]; rng = random.Random(42)
words = "fn let mut struct impl pub use mod match if else return self Some None Ok Err".split()
for i in range(5000):
    d = os.path.join(root, f"pkg{i % 50}", f"mod{i % 7}")
    os.makedirs(d, exist_ok=True)
    n = int(rng.lognormvariate(7.5, 1.2))
    with open(os.path.join(d, f"file{i}.rs"), "w") as f:
        f.write(" ".join(rng.choice(words) for _ in range(max(1, n // 5))))
with open(os.path.join(root, "model.bin"), "wb") as f:
    f.write(os.urandom(64 << 20))
PY
du -sh "$W" | sed 's/^/   /'

step "casfs init"
"$CASFS" init

step "Capture the workspace (checkpoint 1)"
timed "$CASFS" capture "$W" --thread demo --reason "initial"

step "Change 10 files and write 4 KiB into the middle of the 64 MiB file"
for i in $(seq 0 9); do echo "// edited $i" >> "$W/pkg$i/mod$((i % 7))/file$i.rs"; done
printf 'PATCHED!%.0s' $(seq 512) | dd of="$W/model.bin" bs=4096 seek=5000 conv=notrunc status=none
rm -rf "$W/pkg49"
echo "new file" > "$W/NOTES.md"

step "Capture again (checkpoint 2): only changed files are read, only touched chunks stored"
timed "$CASFS" capture "$W" --thread demo --reason "after edits"

step "What changed between the checkpoints"
"$CASFS" diff @demo~1 @demo > "$DEMO/diff.txt"
grep -v '^D pkg49/' "$DEMO/diff.txt" | sed 's/^/   /'
echo "   ... and $(grep -c '^D pkg49/' "$DEMO/diff.txt") paths removed under pkg49/"

step "Restore checkpoint 1 into the workspace (only differing files are rewritten)"
timed "$CASFS" restore "$W" --thread demo --at @demo~1

step "Check: the workspace equals checkpoint 1 again"
"$CASFS" capture "$W" --thread check --reason verify >/dev/null
if [ -z "$("$CASFS" diff @demo~1 @check)" ]; then
  echo "   identical to checkpoint 1"
else
  echo "   MISMATCH"; exit 1
fi

step "Watch the workspace: a re-capture then looks only where inotify saw changes"
"$CASFS" watch "$W"
"$CASFS" capture "$W" --thread watched --reason "arms the watcher" >/dev/null
for i in $(seq 0 9); do echo "// watched edit $i" >> "$W/pkg$i/mod$((i % 7))/file$i.rs"; done
timed "$CASFS" capture "$W" --thread watched --reason "10 files changed"
"$CASFS" watch "$W" --stop

step "Restore checkpoint 2 into an empty directory"
timed "$CASFS" restore "$DEMO/copy" --at @demo

step "Mount checkpoint 1 read-only (nothing is copied; contents load on first read)"
mkdir -p "$DEMO/mnt"
trap '"$CASFS" unmount --lazy "$DEMO/mnt" >/dev/null 2>&1 || true; rm -rf "$DEMO"' EXIT
timed "$CASFS" mount "$DEMO/mnt" --at @demo~1 --read-only
printf '   first file through the mount: %s bytes\n' "$(wc -c < "$DEMO/mnt/pkg0/mod0/file0.rs")"
printf '   model.bin through the mount equals the restored one: '
cmp -s "$DEMO/mnt/model.bin" "$W/model.bin" && echo yes || { echo NO; exit 1; }
"$CASFS" unmount "$DEMO/mnt"

step "Mount the thread writable: its head appears at once, contents load lazily"
M="$DEMO/live"
mkdir -p "$M"
trap '"$CASFS" unmount --lazy "$M" >/dev/null 2>&1 || true; rm -rf "$DEMO"' EXIT
timed "$CASFS" mount "$M" --thread demo   # --mode auto: overlay as root, else fuse
"$CASFS" status "$M" | grep -E 'mode|reads' | sed 's/^/ /'
printf '   %s files visible\n' "$(find "$M" -type f | wc -l)"

step "Metadata work in the mount: untar 5,000 small files, then rm -rf them"
mkdir -p "$DEMO/untar-src" && for d in $(seq 0 49); do mkdir -p "$DEMO/untar-src/d$d"; for f in $(seq 0 99); do echo "$d $f" > "$DEMO/untar-src/d$d/f$f"; done; done
tar -C "$DEMO/untar-src" -cf "$DEMO/small.tar" . && mkdir -p "$M/untarred"
timed tar -xf "$DEMO/small.tar" -C "$M/untarred"
timed rm -rf "$M/untarred"

step "Work inside the mount: edit 10 files, add a directory, delete one"
for i in $(seq 0 9); do echo "// agent edit $i" >> "$M/pkg$i/mod$((i % 7))/file$i.rs"; done
mkdir -p "$M/generated" && seq 1000 > "$M/generated/numbers.txt"
rm "$M/NOTES.md"
"$CASFS" status "$M" | sed 's/^/   /'

step "Checkpoint the mount: only the dirty files are read, no walk of the tree"
timed "$CASFS" checkpoint "$M" --reason "agent run 1"

step "A large file: 4 KiB written into the 64 MiB model.bin; one new 1 MiB chunk is stored (FUSE mode reads only that chunk; overlay copies the file up and reads it once)"
head -c 4096 /dev/urandom | dd of="$M/model.bin" bs=4096 seek=4000 conv=notrunc status=none
timed "$CASFS" checkpoint "$M" --reason "model.bin edited"

step "Change more, then restore checkpoint 2, before both (a fresh upper mounted in place, or a root swap: nothing copied)"
echo "scratch" > "$M/scratch.txt"
rm -rf "$M/pkg1"
timed "$CASFS" restore "$M" @demo~2 --force
printf '   pkg1 is back: %s files; generated/ is gone: ' "$(find "$M/pkg1" -type f | wc -l)"
[ ! -e "$M/generated" ] && echo yes || { echo NO; exit 1; }
printf '   restored content equals the captured one: '
cmp -s "$M/model.bin" "$DEMO/copy/model.bin" && echo "yes (model.bin is checkpoint 2's)" || { echo NO; exit 1; }
"$CASFS" unmount "$M"
sleep 0.5

step "History"
"$CASFS" log --thread demo

step "Agent runs through the lifecycle middleware: casfs serve on a Unix socket"
S="$DEMO/serve.sock"
export API_KEY="sk-demo-4f1e2d3c4b5a6978"   # a secret the workspace resolves
"$CASFS" serve --socket "$S" --sandboxes "$DEMO/sandboxes" --secret API_KEY --diffs \
  2> "$DEMO/serve.log" &
SERVE=$!
trap 'kill $SERVE 2>/dev/null || true; wait $SERVE 2>/dev/null || true; umount -l "$DEMO"/sandboxes/* 2>/dev/null || true; rm -rf "$DEMO"' EXIT
for _ in $(seq 200); do [ -S "$S" ] && break; sleep 0.05; done
api() { curl -sS --unix-socket "$S" -X "$1" "http://casfs$2" -H 'Content-Type: application/json' ${3:+-d "$3"}; }
# Like `timed`, for a call whose JSON answer goes to a file.
timed_api() {
  local out=$1 t0 t1; shift; t0=$(now); api "$@" > "$out"; t1=$(now)
  printf '   (%s %s: %d ms wall)\n' "$1" "$2" $(( (t1 - t0) / 1000000 ))
}
field() { python3 -c "import json,sys; v=json.load(sys.stdin); print(eval(sys.argv[1], {}, {'v': v}))" "$1"; }
echo "   run 1 starts: writer lease taken, sandbox mounted (the thread is new: empty)"
timed_api "$DEMO/r1.json" POST /v1/runs '{"thread": "agent", "run_id": "run-1"}'
SB=$(field 'v["sandbox"]["path"]' < "$DEMO/r1.json")
mkdir -p "$SB/src"
printf 'import os\nKEY = "%s"\nprint("hello")\n' "$API_KEY" > "$SB/src/app.py"
echo "# notes" > "$SB/NOTES.md"
api PUT /v1/threads/agent/messages '[{"role": "user", "content": "write app.py"}, {"role": "assistant", "content": "done"}]' > /dev/null
echo "   file events so far (from the mount, with diffs against the base):"
api GET /v1/runs/run-1/events | field '"\n".join("     %d %s %s" % (e["seq"], e["kind"], e["path"]) for e in v)'
echo "   run 1 finishes: conversation, files (secret replaced by a placeholder), append on the head"
timed_api "$DEMO/f1.json" POST /v1/runs/run-1/finish
field '"   checkpoint %s, %d changed, %d file(s) with secrets" % (v["checkpoint"][:12], v["changed_files"], v["secret_files"])' < "$DEMO/f1.json"
printf '   stored app.py: '
"$CASFS" cat @agent src/app.py | sed -n 2p
printf '   the sandbox still has the real value: '
grep -q "$API_KEY" "$SB/src/app.py" && echo yes || { echo NO; exit 1; }
echo "   run 2 resumes the live sandbox, pauses (interrupt): its lease closes, nothing is published"
api POST /v1/runs '{"thread": "agent", "run_id": "run-2"}' > /dev/null
echo "more" >> "$SB/NOTES.md"
api POST /v1/runs/run-2/chunk '{"type": "run_finished", "interrupt": true}' > /dev/null
api POST /v1/runs/run-2/finish | field '"   finish after pause: checkpoint %s" % (v["checkpoint"] or "none (not published)")'
echo "   a second run on the thread while run 3 holds it is refused:"
api POST /v1/runs '{"thread": "agent", "run_id": "run-3"}' > /dev/null
api POST /v1/runs '{"thread": "agent", "run_id": "run-4"}' | field '"     %s" % v["error"]["message"]'
api POST /v1/runs/run-3/abort '{"cancelled": true}' > /dev/null
kill $SERVE; wait $SERVE 2>/dev/null || true
"$CASFS" log --thread agent

#!/usr/bin/env bash
# The end-to-end demo on the embedded default store: builds casfs, makes a workspace,
# captures it, changes it, captures again, restores the first checkpoint, mounts it
# read-only through FUSE; then mounts the thread writable, writes into it, checkpoints
# (only what changed is read), changes more, restores instantly; and prints what it did
# with timings. Everything lives in a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

cargo build --release --locked --quiet
CASFS="$PWD/target/release/casfs"
DEMO="$(mktemp -d -t casfs-demo.XXXXXX)"
trap 'rm -rf "$DEMO"' EXIT
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
timed "$CASFS" mount "$M" --thread demo
printf '   %s files visible\n' "$(find "$M" -type f | wc -l)"

step "Work inside the mount: edit 10 files, add a directory, delete one"
for i in $(seq 0 9); do echo "// agent edit $i" >> "$M/pkg$i/mod$((i % 7))/file$i.rs"; done
mkdir -p "$M/generated" && seq 1000 > "$M/generated/numbers.txt"
rm "$M/NOTES.md"
"$CASFS" status "$M" | sed 's/^/   /'

step "Checkpoint the mount: only the dirty files are read, no walk of the tree"
timed "$CASFS" checkpoint "$M" --reason "agent run 1"

step "Change more, then restore the checkpoint before it (a root swap: nothing copied)"
echo "scratch" > "$M/scratch.txt"
rm -rf "$M/pkg1"
timed "$CASFS" restore "$M" @demo~1 --force
printf '   pkg1 is back: %s files; generated/ is gone: ' "$(find "$M/pkg1" -type f | wc -l)"
[ ! -e "$M/generated" ] && echo yes || { echo NO; exit 1; }
printf '   restored content equals the captured one: '
cmp -s "$M/model.bin" "$DEMO/copy/model.bin" && echo "yes (model.bin is checkpoint 2's)" || { echo NO; exit 1; }
"$CASFS" unmount "$M"
sleep 0.5

step "History"
"$CASFS" log --thread demo

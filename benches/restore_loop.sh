#!/bin/bash
# The overlay's checkpoint and restore in a loop, by hand (root), as the overlay bench's
# checkpoint section does, with a pause between rounds to tell a checkpoint's own cost
# from the teardown of the generation a restore replaced:
#   benches/restore_loop.sh [--files N] [--rounds R] [--pause SECONDS] [--lower image|view]
#                           [--dir DIR]   (where the store, tree and mount go; /tmp)
# Prints each round's checkpoint and restore time as the daemon reports them;
# CASFS_BENCH_OUT=FILE (or a directory) also writes them as a result file
# (docs/results/README.md).
set -euo pipefail
files=100000 rounds=6 pause=0 lower=image dir=/tmp
command="benches/restore_loop.sh $*"
while [ $# -gt 0 ]; do
  case $1 in
    --files) files=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --pause) pause=$2; shift 2 ;;
    --lower) lower=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
here=$(cd "$(dirname "$0")/.." && pwd)
# CASFS_BIN: a casfs binary to run (another build, to compare); else this tree's, built.
B=${CASFS_BIN:-$here/target/release/casfs}
[ -n "${CASFS_BIN:-}" ] || cargo build --release --quiet --manifest-path "$here/Cargo.toml"
work=$(mktemp -d "$dir/casfs-restore-loop.XXXXXX")
S=$work/store M=$work/mnt
mkdir -p "$M"
trap '$B --store "$S" unmount "$M" >/dev/null 2>&1 || umount -l "$M" 2>/dev/null; rm -rf "$work"' EXIT
python3 - "$work/tree" "$files" <<'PY'
import os, sys
root, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    d = f"{root}/d{i // 100:03d}"
    if i % 100 == 0:
        os.makedirs(d, exist_ok=True)
    with open(f"{d}/f{i}.txt", "w") as f:
        f.write(f"file {i}\n" * 10)
PY
export CASFS_OVERLAY_LOWER=$lower
field() { python3 -c "import json,sys; v=json.load(sys.stdin); print($1)"; }
$B --store "$S" capture "$work/tree" -t t >/dev/null
$B --store "$S" mount "$M" -t t --mode overlay >/dev/null
prev=$($B --store "$S" --json status "$M" | field 'v["base"]')
cks="" rss=""
for r in $(seq 1 "$rounds"); do
  for k in $(seq 0 9); do
    i=$((k * (files / 10)))
    echo "change $r" >> "$M/d$(printf %03d $((i / 100)))/f$i.txt"
  done
  cp=$($B --store "$S" --json checkpoint "$M")
  id=$(echo "$cp" | field 'v["checkpoint"]')
  ck=$(echo "$cp" | field 'v["duration_us"] / 1000')
  find "$M" > /dev/null
  rs=$($B --store "$S" --json restore "$M" "$prev" --force | field 'v["duration_us"] / 1000')
  $B --store "$S" --json restore "$M" "$id" --force >/dev/null
  prev=$id
  echo "round $r: checkpoint $ck ms, restore $rs ms"
  cks="${cks:+$cks,}$ck" rss="${rss:+$rss,}$rs"
  sleep "$pause"
done
if [ -n "${CASFS_BENCH_OUT:-}" ]; then
  {
    printf '{"param": {"files": %s, "rounds": %s, "pause_s": %s, "lower": "%s"}}\n' \
      "$files" "$rounds" "$pause" "$lower"
    printf '{"op": "checkpoint after 10 changes (daemon)", "files": %s, "unit": "ms", "runs": [%s]}\n' \
      "$files" "$cks"
    printf '{"op": "restore of the previous checkpoint (daemon)", "files": %s, "unit": "ms", "runs": [%s]}\n' \
      "$files" "$rss"
  } | "$B" bench --record restore_loop --command "$command" --bench-dir "$work" \
        --out "$CASFS_BENCH_OUT"
fi

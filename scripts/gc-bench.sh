#!/usr/bin/env bash
# Times retention, garbage collection and fsck on a real tree: copies SRC (default
# /usr/share), captures it, re-captures it five times (10 edited .txt files and a
# replaced 5 MB file each time), then gc --dry-run, prune --keep-last 1, gc, fsck.
# Usage: scripts/gc-bench.sh [SRC]; CASFS_BENCH_OUT=FILE (or a directory) also writes
# the times as a result file (docs/results/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo build --release --locked --quiet
B="$PWD/target/release/casfs"
SRC="${1:-/usr/share}"
W="$(mktemp -d /tmp/casfs-gc-bench.XXXXXX)"
trap 'rm -rf "$W"' EXIT
export CASFS_STORE="$W/store"
cp -a "$SRC" "$W/tree"
files_n=$(find "$W/tree" -type f | wc -l)
echo "tree: $files_n files, $(du -sh "$W/tree" | cut -f1)"
rows=()
t() {
  local s e
  s=$(date +%s%N)
  "$@" >"$W/out"
  e=$(date +%s%N)
  printf '%6.2f s  casfs %s\n' "$(echo "($e - $s) / 1000000000" | bc -l)" "${*:2}"
  rows+=("{\"step\": ${#rows[@]}, \"op\": \"casfs ${*:2}\", \"unit\": \"ms\", \"runs\": [$(((e - s) / 1000000))]}")
}
t "$B" capture "$W/tree" -t gc-bench
for i in 1 2 3 4 5; do
  { find "$W/tree" -type f -name '*.txt' || true; } | head -10 | while read -r f; do echo "round $i" >>"$f"; done
  head -c 5000000 /dev/urandom >"$W/tree/blob"
  t "$B" capture "$W/tree" -t gc-bench
done
for cmd in "gc --dry-run" "prune --keep-last 1" "gc" "fsck"; do
  # shellcheck disable=SC2086
  t "$B" $cmd
  sed 's/^/          /' "$W/out"
done
if [ -n "${CASFS_BENCH_OUT:-}" ]; then
  {
    printf '{"param": {"source": "%s", "files": %s}}\n' "$SRC" "$files_n"
    printf '%s\n' "${rows[@]}"
  } | "$B" bench --record gc-bench --command "scripts/gc-bench.sh $*" --bench-dir "$W" \
        --out "$CASFS_BENCH_OUT"
fi

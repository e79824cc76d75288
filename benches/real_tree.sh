#!/bin/bash
# Side-by-side on a copy of a real tree (default /usr/share; pass another as $1): initial capture (casfs vs tar+zstd vs git),
# then re-capture after 10 changed files (casfs vs git), 3 runs each, interleaved.
# CASFS_BENCH_OUT=FILE (or a directory) also writes every run as a result file
# (docs/results/README.md).
set -e
cd "$(dirname "$0")/.." && cargo build --release --quiet
B="$PWD/target/release/casfs"
SRC="${1:-/usr/share}"
T="$(mktemp -d -t casfs-usb.XXXXXX)"; trap 'rm -rf "$T"' EXIT
cp -a "$SRC" $T/share; sleep 1
export GIT_AUTHOR_NAME=b GIT_AUTHOR_EMAIL=b@x GIT_COMMITTER_NAME=b GIT_COMMITTER_EMAIL=b@x
t() { local s=$(date +%s%N); "$@" >/dev/null 2>&1; echo "$(( ($(date +%s%N) - s) / 1000000 ))"; }
files_n=$(find $T/share -type f | wc -l) bytes=$(du -sb $T/share | cut -f1)
echo "files: $files_n, bytes: $bytes"
declare -A runs
add() { runs[$1]="${runs[$1]:+${runs[$1]},}$2"; }
for i in 1 2 3; do
  rm -rf $T/st $T/o; mkdir -p $T/o
  c=$(t $B --store $T/st capture $T/share -t b)
  z=$(t sh -c "tar -cf - -C $T share | zstd -T0 -3 -q -o $T/o/s.tzst")
  rm -rf $T/g; g=$(t sh -c "GIT_DIR=$T/g GIT_WORK_TREE=$T/share git init -q && GIT_DIR=$T/g git config gc.auto 0 && GIT_DIR=$T/g GIT_WORK_TREE=$T/share git add -A && GIT_DIR=$T/g GIT_WORK_TREE=$T/share git commit -qm i")
  echo "initial run $i: casfs ${c} ms, tar+zstd ${z} ms, git ${g} ms"
  add "initial capture|casfs" "$c"; add "initial capture|tar+zstd" "$z"; add "initial capture|git" "$g"
done
files=($(find $T/share -type f -size +1k | head -1000 | shuf -n 30 --random-source=/dev/zero))
for i in 1 2 3; do
  for k in $(seq 0 9); do echo "change $i $k" >> "${files[$((i*10+k-10))]}"; done
  c=$(t $B --store $T/st capture $T/share -t b)
  g=$(t sh -c "GIT_DIR=$T/g GIT_WORK_TREE=$T/share git add -A && GIT_DIR=$T/g GIT_WORK_TREE=$T/share git commit -qm c")
  echo "re-capture run $i: casfs ${c} ms, git ${g} ms"
  add "re-capture after 10 changes|casfs" "$c"; add "re-capture after 10 changes|git" "$g"
done
if [ -n "${CASFS_BENCH_OUT:-}" ]; then
  {
    printf '{"param": {"source": "%s", "files": %s, "bytes": %s}}\n' "$SRC" "$files_n" "$bytes"
    for k in "initial capture|casfs" "initial capture|tar+zstd" "initial capture|git" \
             "re-capture after 10 changes|casfs" "re-capture after 10 changes|git"; do
      printf '{"scenario": "%s", "tool": "%s", "files": %s, "unit": "ms", "runs": [%s]}\n' \
        "${k%|*}" "${k#*|}" "$files_n" "${runs[$k]}"
    done
  } | "$B" bench --record real_tree --command "benches/real_tree.sh $*" --bench-dir "$T" \
        --out "$CASFS_BENCH_OUT"
fi

#!/usr/bin/env bash
# Runs every benchmark the docs cite, one after another, each writing its result file
# under docs/results/<bench>/ (docs/results/README.md); then renders the docs' tables
# from them (scripts/render-results.py). As root, on a machine with nothing else
# running (the benchmarks mount loop filesystems, FUSE and overlays). Took about an
# hour on 2 cores (2026-12-04); the benchmarks the docs lean on most run first.
# `scripts/bench-all.sh NAME...` runs only those (names as below).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
# The fleet benchmark needs PostgreSQL and an S3 server on loopback.
source scripts/services.sh
set +u
out() { mkdir -p "docs/results/$1" && echo "docs/results/$1/"; }
run() {
  local name="$1"; shift
  if [ "${#only[@]}" -gt 0 ] && [[ ! " ${only[*]} " =~ " $name " ]]; then return; fi
  echo "bench-all: $name: $*" >&2
  local start=$SECONDS
  "$@"
  echo "bench-all: $name took $((SECONDS - start)) s" >&2
}
only=("$@")
cargo build --release --locked
casfs=target/release/casfs
run capture cargo bench --bench capture -- --sizes 1000,10000,100000 --reps 3 --out "$(out capture)"
run mount-fuse cargo bench --bench mount -- --sizes 1k,10k,100k --reps 3 --mode fuse --out "$(out mount)"
run mount-overlay cargo bench --bench mount -- --sizes 1k,10k,100k --reps 3 --mode overlay --out "$(out mount)"
run overlay cargo bench --bench overlay -- --reps 3 --sizes 1k,10k,100k --out "$(out overlay)"
# As an ordinary user (made here if missing, as scripts/test-rootless.sh makes it).
id casfs-rootless >/dev/null 2>&1 || useradd --create-home --shell /bin/bash casfs-rootless
run rootless cargo bench --bench rootless -- --user casfs-rootless --reps 3 --sizes 1k,10k,100k --out "$(out rootless)"
run soak cargo bench --bench soak -- --runs 10000 --clients 8 --threads 100 --out "$(out soak)"
run fleet cargo bench --bench fleet -- --sizes 1k,10k,100k --reps 3 --out "$(out fleet)"
run casfs-bench "$casfs" bench --sizes 1k,10k,100k --reps 3 --runs 3 --plot docs/bench.svg --out "$(out casfs-bench)"
run middleware cargo bench --bench middleware -- --sizes 10k --reps 15 --out "$(out middleware)"
run agent-loop bash -c "cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error >/dev/null && \
  npm run bench -- --sizes 1k,10k,100k --runs 3 --out ../../$(out agent-loop)"
run restore_loop env CASFS_BENCH_OUT="$(out restore_loop)" benches/restore_loop.sh --files 100000
run real_tree env CASFS_BENCH_OUT="$(out real_tree)" benches/real_tree.sh
run gc-bench env CASFS_BENCH_OUT="$(out gc-bench)" scripts/gc-bench.sh
run chunking cargo bench --bench chunking -- --out "$(out chunking)"
run casfs-bench-real "$casfs" bench --from /usr/share --reps 3 --runs 3 --out "$(out casfs-bench)"
python3 scripts/render-results.py

#!/usr/bin/env bash
# Fuzzes every decoder of stored or received bytes (fuzz/fuzz_targets, checks in
# src/fuzzing.rs) for FUZZ_SECS seconds each (default 15; CI runs the default). A crash
# leaves its input in fuzz/artifacts/<target>/: copy it to fuzz/regressions/<target>/
# and the test suite runs it for good (tests/fuzz_regressions.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cd fuzz
# cargo-fuzz passes nightly-only flags (-Zsanitizer=address); the stable toolchain,
# which ships the sanitizer runtimes, takes them with RUSTC_BOOTSTRAP.
export RUSTC_BOOTSTRAP=1
secs="${FUZZ_SECS:-15}"
cargo fuzz build -O >/dev/null 2>&1 || cargo fuzz build -O
total=0
for t in $(cargo fuzz list); do
  mkdir -p "corpus/$t"
  if ! out="$(cargo fuzz run -O "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$secs" -print_final_stats=1 2>&1)"; then
    echo "$out" | tail -40
    echo "fuzz: $t crashed; its input is in fuzz/artifacts/$t/" >&2
    exit 1
  fi
  runs="$(echo "$out" | sed -n 's/.*stat::number_of_executed_units: *\([0-9]*\).*/\1/p' | tail -1)"
  total=$((total + ${runs:-0}))
  echo "fuzz: $t: ${runs:-?} executions in ${secs} s, no crash"
done
echo "fuzz: $total executions in all, no crash"

#!/usr/bin/env bash
# The whole test suite: installs what it needs, checks formatting and lints, then runs
# every unit and integration test (integration tests mount real FUSE filesystems), then
# fuzzes every decoder for a short while.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
# PostgreSQL and an S3-compatible server on loopback, for the fleet tests.
source scripts/services.sh

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --locked
# A short run of every fuzz target (FUZZ_SECS each).
scripts/fuzz.sh

#!/usr/bin/env bash
# The whole test suite: installs what it needs, checks formatting and lints, then runs
# every unit and integration test (integration tests mount real FUSE filesystems).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --locked

#!/usr/bin/env bash
# The whole test suite: installs what it needs, checks formatting and lints, then runs
# every unit and integration test (integration tests mount real filesystems), the mount
# tests once per backend (FUSE, then overlayfs over a casfs lower), then fuzzes every
# decoder for a short while.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
# PostgreSQL and an S3-compatible server on loopback, for the fleet tests.
source scripts/services.sh

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
# Everything, with `casfs mount` on the FUSE backend...
CASFS_MOUNT_MODE=fuse cargo test --locked
# ...and the mount suite again on the overlay backend.
CASFS_MOUNT_MODE=overlay cargo test --locked --test fuse
# A short run of every fuzz target (FUZZ_SECS each).
scripts/fuzz.sh

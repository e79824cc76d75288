#!/usr/bin/env bash
# The whole test suite: installs what it needs, checks formatting and lints, then runs
# every unit and integration test (integration tests mount real filesystems), the mount
# tests and the TypeScript client's once per backend (FUSE, then overlayfs over a casfs
# lower), the FUSE backend once more on the classic /dev/fuse transport and both again as
# an ordinary user (rootless overlay, scripts/test-rootless.sh), then fuzzes
# every decoder for a short while. It turns on FUSE over io_uring host-wide
# (scripts/setup.sh --enable-fuse-uring) so that the FUSE passes run on both transports.
# Then it builds, installs and exercises the Debian package and the npm tarball
# (scripts/test-package.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh --enable-fuse-uring
# PostgreSQL and an S3-compatible server on loopback, for the fleet tests.
source scripts/services.sh

# A clean clone builds once: incremental state would only take disk (about 2 GB).
if [ -n "${CI:-}" ]; then
  export CARGO_INCREMENTAL=0
fi

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
# The TypeScript client's tests (clients/typescript: npm test) against a real
# `casfs serve` built from this tree, its sandboxes on backend $1.
ts_tests() {
  (cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error &&
    CASFS_MOUNT_MODE="$1" CASFS_BIN="$PWD/../../target/debug/casfs" npm test)
}
# Everything, with `casfs mount` on the FUSE backend (over io_uring where the kernel
# has it)...
CASFS_MOUNT_MODE=fuse cargo test --locked
ts_tests fuse
# ...the mount suite again on the overlay backend...
CASFS_MOUNT_MODE=overlay cargo test --locked --test fuse
ts_tests overlay
# ...and on the FUSE backend over the classic transport, if the first pass used io_uring.
if [ "$(cat /sys/module/fuse/parameters/enable_uring 2>/dev/null)" = Y ]; then
  CASFS_MOUNT_MODE=fuse CASFS_FUSE_TRANSPORT=classic cargo test --locked --test fuse
fi
# ...and as an ordinary user: the mount suite on rootless overlay (in that user's own
# namespace), the TypeScript client's against that user's `casfs serve`, the commands
# from outside the namespace, and a host that forbids user namespaces.
scripts/test-rootless.sh
# The Debian package and the npm tarball, installed and used the way a host does
# (docs/install.md): build, lintian, install, the unit, a caller in group casfs,
# upgrade, remove, purge. Most of its time is the release build the package needs.
scripts/test-package.sh
# The fuzzers build in fuzz/target: on a clean clone the builds above are not needed any
# more, and a CI machine's disk is not large.
if [ -n "${CI:-}" ]; then
  rm -rf target/debug target/dist
fi
# A short run of every fuzz target (FUZZ_SECS each).
scripts/fuzz.sh

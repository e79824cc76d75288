#!/usr/bin/env bash
# Installs what building and testing casfs needs on Debian 12 (run as root, or with
# sudo available). Idempotent: packages already present are not reinstalled.
set -euo pipefail

# Build: Debian's RocksDB (linked instead of compiling RocksDB's C++), libclang for
# bindgen, pkg-config and a C toolchain. Mount: fuse3 (fusermount3). Benchmarks and
# tests compare with git, zstd, tar, rsync, restic and fuse-overlayfs; attr gives
# getfattr/setfattr; libacl1-dev is for building pjdfstest (below); curl talks to
# `casfs serve` in the demo and fetches rustup (with ca-certificates) where Rust is
# missing; fonts-dejavu-core labels `casfs bench --plot`; acl's getfacl shows the tests
# the gates `casfs serve` puts in front of members' sandboxes; bubblewrap isolates
# sandboxes' processes (`casfs serve`'s /exec and /processes); e2fsprogs' mkfs.ext4
# makes each sandbox's bounded disk.
PACKAGES=(librocksdb-dev libclang-dev clang pkg-config build-essential fuse3
          git zstd tar rsync restic attr fuse-overlayfs libacl1-dev curl ca-certificates
          fonts-dejavu-core acl bubblewrap e2fsprogs)

# The FUSE tests' POSIX probe is a Python script; any python3 on PATH will do.
command -v python3 >/dev/null 2>&1 || PACKAGES+=(python3)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "casfs setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  for d in "$HOME/.cargo/bin" /usr/local/cargo/bin; do
    [ -x "$d/cargo" ] && export PATH="$d:$PATH"
  done
fi
# No Rust (Debian 12's own is too old for casfs): rustup's stable toolchain, from
# static.rust-lang.org, checked against its published SHA-256, into ~/.cargo.
if ! command -v cargo >/dev/null 2>&1; then
  arch="$(uname -m)-unknown-linux-gnu"
  url="https://static.rust-lang.org/rustup/dist/$arch/rustup-init"
  tmp="$(mktemp -d)"
  echo "casfs setup: no cargo on PATH; installing Rust (stable) with rustup from $url" >&2
  curl --proto '=https' --tlsv1.2 -sSf -o "$tmp/rustup-init" "$url"
  want="$(curl --proto '=https' --tlsv1.2 -sSf "$url.sha256" | cut -d' ' -f1)"
  got="$(sha256sum "$tmp/rustup-init" | cut -d' ' -f1)"
  if [ "$want" != "$got" ]; then
    echo "casfs setup: rustup-init from $url has SHA-256 $got, not the published $want" >&2
    exit 1
  fi
  chmod +x "$tmp/rustup-init"
  "$tmp/rustup-init" -y --no-modify-path --profile minimal --default-toolchain stable \
    --component clippy,rustfmt >/dev/null
  rm -rf "$tmp"
  export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
fi
rust_ok() {
  local v
  v="$(rustc --version 2>/dev/null | cut -d' ' -f2)"
  [ -n "$v" ] && [ "$(printf '%s\n1.85.0\n' "$v" | sort -V | head -1)" = 1.85.0 ]
}
rust_ok || {
  echo "casfs setup: casfs needs Rust >= 1.85; found $(rustc --version 2>/dev/null || echo none)" \
    "(rustup update stable)" >&2
  exit 1
}

# Where Debian puts librocksdb for this architecture (see .cargo/config.toml).
if [ -z "${ROCKSDB_LIB_DIR:-}" ]; then
  multiarch="$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)"
  export ROCKSDB_LIB_DIR="/usr/lib/$multiarch"
fi

# The independent POSIX conformance suite the FUSE tests run against the mount: the
# Rust rewrite of pjdfstest, from crates.io (about a minute to build, once).
if ! command -v pjdfstest >/dev/null 2>&1 && [ ! -x "${CARGO_HOME:-$HOME/.cargo}/bin/pjdfstest" ]; then
  echo "casfs setup: installing pjdfstest 0.2.2 (cargo install)" >&2
  cargo install --quiet --locked pjdfstest --version 0.2.2
fi

# The fuzzer driver for scripts/fuzz.sh (libFuzzer through cargo-fuzz), from crates.io.
if ! command -v cargo-fuzz >/dev/null 2>&1 && [ ! -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo-fuzz" ]; then
  echo "casfs setup: installing cargo-fuzz 0.13.2 (cargo install)" >&2
  cargo install --quiet --locked cargo-fuzz --version 0.13.2
fi

# The TypeScript client (clients/typescript) and its tests: Node.js 20.18 or later with
# npm. This machine kind ships Node 20; elsewhere Debian's nodejs is tried, and a Node
# that is too old is named (Debian 12's own is 18).
node_ok() {
  command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 &&
    node -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>20||(a===20&&b>=18)?0:1)'
}
if ! node_ok; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  echo "casfs setup: installing Debian's nodejs and npm" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null || true
  node_ok || echo "casfs setup: the TypeScript client needs Node.js >= 20.18.1 with npm; found $(node --version 2>/dev/null || echo none)" >&2
fi

# FUSE over io_uring (casfs's `io_uring` transport) is built into this kernel but off
# until root writes Y to a host-wide module parameter. casfs never sets it; this flag
# does, on purpose and saying so (the test command passes it, to test both transports).
# New FUSE mounts on the host then use the per-CPU rings; writing N turns them off again.
if [ "${1:-}" = "--enable-fuse-uring" ]; then
  param=/sys/module/fuse/parameters/enable_uring
  if [ ! -e "$param" ]; then
    modprobe fuse 2>/dev/null || true
  fi
  if [ -w "$param" ]; then
    if [ "$(cat "$param")" != Y ]; then
      echo "casfs setup: enabling FUSE over io_uring host-wide (echo Y > $param)" >&2
      echo Y > "$param"
    fi
  else
    echo "casfs setup: $param is absent or not writable: FUSE over io_uring stays off" >&2
  fi
fi

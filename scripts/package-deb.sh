#!/usr/bin/env bash
# Builds the Debian packages of casfs, in one command:
#
#   scripts/package-deb.sh [OUTDIR]        (default: <target dir>/deb)
#
# casfs_<version>_<arch>.deb: the release binary (cargo profile `dist`, stripped;
# `casfs --version` names the commit), `Depends` computed from the binary by
# dpkg-shlibdeps plus fuse3, man pages and bash/zsh/fish completions generated from the
# command line's definition, the docs, the systemd unit casfs.service and the
# maintainer scripts (packaging/deb/). casfs-dbgsym_<version>_<arch>.deb: the line
# tables taken out of the binary, where debuggers look for them
# (/usr/lib/debug/.build-id/). Installs what it needs from Debian (dpkg-dev, binutils
# and the build dependencies) when missing. Honours CARGO_TARGET_DIR;
# CASFS_DEB_REVISION (default 1) is the Debian revision, CASFS_DEB_MAINTAINER the
# Maintainer field. Prints the paths of the two packages last, one a line.
set -euo pipefail
cd "$(dirname "$0")/.."
src="$PWD"

say() { echo "package-deb: $*" >&2; }

need=(dpkg-dev binutils librocksdb-dev libclang-dev clang pkg-config build-essential)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ -z "${ROCKSDB_LIB_DIR:-}" ]; then
  export ROCKSDB_LIB_DIR="/usr/lib/$(dpkg-architecture -qDEB_HOST_MULTIARCH)"
fi

target="${CARGO_TARGET_DIR:-$src/target}"
out="$(mkdir -p "${1:-$target/deb}" && cd "${1:-$target/deb}" && pwd)"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)"
debv="$version-${CASFS_DEB_REVISION:-1}"
arch="$(dpkg --print-architecture)"
maint="${CASFS_DEB_MAINTAINER:-casfs maintainers <casfs-maintainers@users.noreply.github.com>}"
# Reproducible timestamps: the commit's time (now, without git).
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}"

say "building casfs $version (cargo build --profile dist --locked)"
start=$(date +%s)
nice cargo build --profile dist --locked --bin casfs --bin casfs-sandbox-init
say "built in $(($(date +%s) - start)) s"
built="$target/dist/casfs"
say "$("$built" --version)"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
root="$work/casfs"
dbg="$work/casfs-dbgsym"
mkdir -p "$root/DEBIAN" "$dbg/DEBIAN"

# The binary: its debug info into the dbgsym package (by build id), the rest stripped
# (as dh_strip does), with a link to the debug file.
build_id="$(readelf -n "$built" | sed -n 's/.*Build ID: \([0-9a-f]*\).*/\1/p')"
[ -n "$build_id" ] || { say "$built has no build id"; exit 1; }
debug_file="$dbg/usr/lib/debug/.build-id/${build_id:0:2}/${build_id:2}.debug"
install -d "$(dirname "$debug_file")" "$root/usr/bin"
objcopy --only-keep-debug --compress-debug-sections "$built" "$debug_file"
chmod 0644 "$debug_file"
strip --remove-section=.comment --remove-section=.note --strip-all -o "$root/usr/bin/casfs" "$built"
objcopy --add-gnu-debuglink="$debug_file" "$root/usr/bin/casfs"
chmod 0755 "$root/usr/bin/casfs"
bin="$root/usr/bin/casfs"
# A sandbox's init, small so that it starts fast (casfs finds it here).
install -d "$root/usr/libexec/casfs"
strip --remove-section=.comment --remove-section=.note --strip-all \
  -o "$root/usr/libexec/casfs/casfs-sandbox-init" "$target/dist/casfs-sandbox-init"
chmod 0755 "$root/usr/libexec/casfs/casfs-sandbox-init"

# Man pages and completions, from the binary itself.
install -d "$root/usr/share/man/man1"
"$bin" man-pages "$root/usr/share/man/man1"
gzip -9n "$root"/usr/share/man/man1/*.1
install -d "$root/usr/share/bash-completion/completions" "$root/usr/share/zsh/vendor-completions" \
  "$root/usr/share/fish/vendor_completions.d"
"$bin" completions bash > "$root/usr/share/bash-completion/completions/casfs"
"$bin" completions zsh > "$root/usr/share/zsh/vendor-completions/_casfs"
"$bin" completions fish > "$root/usr/share/fish/vendor_completions.d/casfs.fish"

# The service (Debian 12 keeps units under /lib), docs, an example environment file
# (the real one, /etc/casfs/serve.env, is the administrator's: never shipped).
install -D -m0644 packaging/deb/casfs.service "$root/lib/systemd/system/casfs.service"
doc="$root/usr/share/doc/casfs"
install -D -m0644 packaging/deb/copyright "$doc/copyright"
install -D -m0644 packaging/deb/serve.env.example "$doc/examples/serve.env"
install -m0644 README.md "$doc/README.md"
install -m0644 docs/install.md "$doc/install.md"
gzip -9n "$doc/README.md" "$doc/install.md"
commit="$("$bin" --version | sed -n 's/.*(commit \(.*\))$/\1/p')"
{
  echo "casfs ($debv) unstable; urgency=medium"
  echo
  echo "  * Built from commit ${commit:-unknown} of the casfs sources."
  echo
  echo " -- $maint  $(date -u -R -d "@$SOURCE_DATE_EPOCH")"
} | gzip -9n > "$doc/changelog.Debian.gz"
install -m0755 packaging/deb/postinst packaging/deb/prerm packaging/deb/postrm "$root/DEBIAN/"
install -D -m0644 packaging/deb/lintian-overrides "$root/usr/share/lintian/overrides/casfs"

# Depends: the shared libraries the binary links (librocksdb, libstdc++, libc, ...) as
# dpkg-shlibdeps finds their packages, fuse3 for fusermount3, and bubblewrap, which
# isolates a sandbox's processes.
mkdir -p "$work/src/debian"
printf 'Source: casfs\nMaintainer: %s\n\nPackage: casfs\nArchitecture: any\n' "$maint" \
  > "$work/src/debian/control"
shlibs="$(cd "$work/src" && dpkg-shlibdeps -O -e"$bin" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')"
[ -n "$shlibs" ] || { say "dpkg-shlibdeps found no dependencies of $bin"; exit 1; }

installed_size() { du -sk --exclude=DEBIAN "$1" | cut -f1; }
cat > "$root/DEBIAN/control" <<EOF
Package: casfs
Version: $debv
Architecture: $arch
Maintainer: $maint
Installed-Size: $(installed_size "$root")
Depends: $shlibs, fuse3, bubblewrap, e2fsprogs
Section: admin
Priority: optional
Description: content-addressed workspace filesystem for agent sandboxes
 casfs mounts an agent's workspace (the kernel's overlayfs over a lazy casfs
 lower, or casfs's own FUSE filesystem) and keeps every file's content in a
 content-addressed store, so a checkpoint costs O(changed files) and a restore
 of any checkpoint is an instant remount. Checkpoints live on threads whose
 heads move by compare-and-swap under writer leases.
 .
 The package ships the casfs command (with man pages and shell completions)
 and casfs.service, which serves the store, sandboxes and the agent run
 lifecycle over HTTP + JSON on /run/casfs/serve.sock to root and the members
 of the group casfs, each caller's sandboxes their own.
EOF

# The debug symbols, linked to the package they belong to.
install -d "$dbg/usr/share/doc"
ln -s casfs "$dbg/usr/share/doc/casfs-dbgsym"
cat > "$dbg/DEBIAN/control" <<EOF
Package: casfs-dbgsym
Source: casfs
Version: $debv
Auto-Built-Package: debug-symbols
Architecture: $arch
Maintainer: $maint
Installed-Size: $(installed_size "$dbg")
Depends: casfs (= $debv)
Section: debug
Priority: optional
Description: debug symbols for casfs
Build-Ids: $build_id
EOF

for r in "$root" "$dbg"; do
  (cd "$r" && find . -type f ! -path './DEBIAN/*' -printf '%P\0' | LC_ALL=C sort -z |
    xargs -0 md5sum > DEBIAN/md5sums)
  chmod 0644 "$r/DEBIAN/control" "$r/DEBIAN/md5sums"
  find "$r" -type d -exec chmod 0755 {} +
  find "$r" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
done
deb="$out/casfs_${debv}_${arch}.deb"
dbgdeb="$out/casfs-dbgsym_${debv}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
dpkg-deb --root-owner-group -Zxz --build "$dbg" "$dbgdeb" >/dev/null
say "binary: $(stat -c %s "$built") bytes as built (profile dist), $(stat -c %s "$bin") shipped," \
  "$(stat -c %s "$debug_file") of debug info in casfs-dbgsym"
say "Depends: $shlibs, fuse3, bubblewrap, e2fsprogs"
echo "$deb"
echo "$dbgdeb"

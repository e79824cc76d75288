#!/usr/bin/env bash
# The npm package `casfs` as a user gets it: `npm pack` of clients/typescript (its
# prepack builds dist/ and the types from docs/openapi.json), installed into an empty
# project with `npm install ./casfs-<version>.tgz`, then imported with no build step of
# the user's: from plain ESM, a five-line script run against a live `casfs serve`, and
# from TypeScript, a file the TypeScript compiler checks (strict, NodeNext) against the
# package's own types.
#
#   scripts/test-npm-package.sh SOCKET [USER]
#
# SOCKET: the server's Unix socket; USER: run the script as this user (a member of the
# socket's group). Prints the script's answer (JSON: ok, threads) on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
sock="$1"
user="${2:-}"
say() { echo "test-npm-package: $*" >&2; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"
(cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error &&
  npm pack --pack-destination "$work" --loglevel=error) >&2
tgz="$(ls "$work"/casfs-*.tgz)"
tar -tzf "$tgz" > "$work/contents"
for f in package/dist/index.js package/dist/index.d.ts package/dist/generated/api.d.ts package/package.json; do
  grep -qx "$f" "$work/contents" || { say "$tgz lacks $f"; exit 1; }
done
say "packed $(basename "$tgz"): $(stat -c %s "$tgz") bytes, $(wc -l < "$work/contents") files"

app="$work/app"
mkdir "$app"
cd "$app"
npm init -y >/dev/null
npm pkg set type=module private=true
npm install --no-audit --no-fund --loglevel=error "$tgz" >&2
# The TypeScript user's own tools (not the package's).
npm install --no-audit --no-fund --loglevel=error --save-dev typescript@5 @types/node@20 >&2

cat > check.mjs <<'EOF'
import { connect } from 'casfs'
const client = connect({ socketPath: process.argv[2] })
const { data: health } = await client.api.GET('/v1/health')
const { data: threads } = await client.api.GET('/v1/threads')
console.log(JSON.stringify({ ok: health?.ok, threads: threads?.map((t) => t.thread) })); await client.close()
EOF
cat > check.ts <<'EOF'
import { connect, type CasfsClient } from 'casfs'
const client: CasfsClient = connect({ socketPath: process.argv[2] ?? '/run/casfs/serve.sock' })
const { data: health } = await client.api.GET('/v1/health')
const { data: threads } = await client.api.GET('/v1/threads')
const answer: { ok: boolean | undefined; threads: string[] | undefined } = { ok: health?.ok, threads: threads?.map((t) => t.thread) }
console.log(JSON.stringify(answer)); await client.close()
EOF
cat > tsconfig.json <<'EOF'
{
  "compilerOptions": {
    "target": "ES2022",
    "module": "NodeNext",
    "moduleResolution": "NodeNext",
    "strict": true,
    "noEmit": true,
    "skipLibCheck": false,
    "types": ["node"]
  },
  "files": ["check.ts"]
}
EOF
npx --no-install tsc -p . >&2
say "check.ts type-checks against the installed package's types"

if [ -n "$user" ]; then
  chmod -R a+rX "$work"
  setpriv --reuid="$user" --regid="$(id -g "$user")" --init-groups -- \
    env -i PATH="$PATH" node check.mjs "$sock"
else
  node check.mjs "$sock"
fi

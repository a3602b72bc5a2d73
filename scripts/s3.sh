#!/usr/bin/env bash
# Starts a throwaway S3-protocol server (moto, from PyPI) for the object-store tests and prints
# the shell lines that point the tests at it:
#
#   eval "$(scripts/s3.sh start)"   # exports IOTA_TEST_S3_ENDPOINT, IOTA_TEST_S3_BUCKET,
#                                   # AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, IOTA_S3_DIR
#   scripts/s3.sh stop "$IOTA_S3_DIR"
#   scripts/s3.sh install           # only installs moto (ahead of time)
#
# moto is installed into a virtual environment (target/s3-venv, or $IOTA_S3_VENV) on first use.
# The server listens on 127.0.0.1 on a free port and keeps everything in memory; the credentials
# are test values that moto accepts and that are good for nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."

MOTO_VERSION=5.2.5
VENV=${IOTA_S3_VENV:-target/s3-venv}
BUCKET=${IOTA_TEST_S3_BUCKET:-iota-test}

ensure_venv() {
    if [ -x "$VENV/bin/moto_server" ] \
        && "$VENV/bin/python" -c "import moto, boto3, sys; sys.exit(moto.__version__ != '$MOTO_VERSION')" 2>/dev/null; then
        return
    fi
    echo "installing moto[server]==$MOTO_VERSION into $VENV (PyPI)" >&2
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV" >&2
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "moto[server]==$MOTO_VERSION" boto3 >&2
}

start() {
    ensure_venv
    local dir port
    dir=$(mktemp -d /tmp/iota-s3.XXXXXX)
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # Detached from this script's stdout, so `eval "$(s3.sh start)"` returns at once.
    setsid "$VENV/bin/moto_server" -H 127.0.0.1 -p "$port" </dev/null >"$dir/log" 2>&1 &
    echo $! >"$dir/pid"
    local endpoint="http://127.0.0.1:$port"
    local tries=0
    until python3 -c "import urllib.request; urllib.request.urlopen('$endpoint/moto-api/', timeout=1)" 2>/dev/null; do
        tries=$((tries + 1))
        if [ "$tries" -gt 100 ] || ! kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
            echo "moto_server did not start; its log:" >&2
            cat "$dir/log" >&2
            stop "$dir"
            exit 1
        fi
        sleep 0.2
    done
    AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1 \
        "$VENV/bin/python" - "$endpoint" "$BUCKET" <<'EOF' >&2
import sys
import boto3
endpoint, bucket = sys.argv[1], sys.argv[2]
boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
EOF
    echo "export IOTA_TEST_S3_ENDPOINT=$endpoint"
    echo "export IOTA_TEST_S3_BUCKET=$BUCKET"
    echo "export AWS_ACCESS_KEY_ID=testing"
    echo "export AWS_SECRET_ACCESS_KEY=testing"
    echo "export AWS_REGION=us-east-1"
    echo "export IOTA_S3_DIR=$dir"
}

stop() {
    local dir=${1:?usage: s3.sh stop DIR}
    if [ -f "$dir/pid" ]; then
        kill "$(cat "$dir/pid")" 2>/dev/null || true
    fi
    rm -rf "$dir"
}

case "${1:-}" in
    install) ensure_venv ;;
    start) start ;;
    stop) stop "${2:-}" ;;
    *) echo "usage: $0 install | start | stop DIR" >&2; exit 2 ;;
esac

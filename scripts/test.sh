#!/usr/bin/env bash
# The project's whole check, as a new user and CI run it: formatting, lints, every test.
#
# Installs and starts what the tests need, and stops it afterwards: a throwaway PostgreSQL from
# the system's binaries (scripts/pg.sh; set DATABASE_URL to use your own server instead), an
# S3-compatible server for the object-store tests (scripts/s3.sh: moto from PyPI in a venv; set
# IOTA_TEST_S3_ENDPOINT to use your own) and Debian's Chromium for the dashboard test (set
# IOTA_CHROMIUM to use another browser binary).
set -euo pipefail
cd "$(dirname "$0")/.."

cleanup=()
on_exit() {
    for c in "${cleanup[@]}"; do eval "$c" || true; done
}
trap on_exit EXIT

if [ -z "${DATABASE_URL:-}" ]; then
    echo "== starting PostgreSQL"
    eval "$(scripts/pg.sh start)"
    cleanup+=("scripts/pg.sh stop '$IOTA_PG_DIR'")
fi
export DATABASE_URL

if [ -z "${IOTA_TEST_S3_ENDPOINT:-}" ]; then
    echo "== starting an S3-compatible server (moto, from PyPI)"
    eval "$(scripts/s3.sh start)"
    cleanup+=("scripts/s3.sh stop '$IOTA_S3_DIR'")
fi
export IOTA_TEST_S3_ENDPOINT

if [ -z "${IOTA_CHROMIUM:-}" ] && [ ! -x /usr/bin/chromium ]; then
    echo "== installing chromium (Debian package, for the dashboard test)"
    as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

if ! dpkg -s libopenblas-dev >/dev/null 2>&1; then
    echo "== installing libopenblas-dev (Debian package, for iota-model's openblas feature)"
    as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas-dev >/dev/null
fi

if [ -z "${IOTA_TEST_TEXT_CORPUS:-}" ] && [ ! -d /usr/share/doc/python3-doc/html/_sources ]; then
    echo "== installing python3-doc (Debian package: the English corpus of cli/tests/localnet_up_text.rs)"
    as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-doc >/dev/null
fi

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== Python SDK venvs (bittensor 11.x and 10.x from PyPI, for localnet/tests/python_sdk.rs)"
venvs=$(bash scripts/python-sdk-venvs.sh)
eval "$venvs"
echo "== cargo test"
cargo test --workspace --locked
echo "== iota-model with the openblas feature"
cargo clippy -p iota-model --features openblas --all-targets --locked -- -D warnings
cargo test -p iota-model --features openblas --locked

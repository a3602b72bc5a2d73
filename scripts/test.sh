#!/usr/bin/env bash
# The project's whole check, as a new user and CI run it: formatting, lints, every test.
#
# Installs and starts what the tests need, and stops it afterwards: a throwaway PostgreSQL from
# the system's binaries (scripts/pg.sh; set DATABASE_URL to use your own server instead), an
# S3-compatible server for the object-store tests (scripts/s3.sh: moto from PyPI in a venv; set
# IOTA_TEST_S3_ENDPOINT to use your own), Debian's Chromium for the dashboard test (set
# IOTA_CHROMIUM to use another browser binary), schemathesis (PyPI, in a venv) for the API's, and
# bittensor-drand (PyPI, in a venv) for the chain client's timelock encryption cross-check.
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

# Installing (Debian packages, moto, the Python SDKs: mostly waiting on the network) runs while
# the lints compile; its output is shown once it is done.
install_debian_packages() {
    local missing=()
    if [ -z "${IOTA_CHROMIUM:-}" ] && [ ! -x /usr/bin/chromium ]; then
        missing+=(chromium) # the dashboard test's browser
    fi
    if ! dpkg -s libopenblas-dev >/dev/null 2>&1; then
        missing+=(libopenblas-dev) # iota-model's openblas feature
    fi
    if [ -z "${IOTA_TEST_TEXT_CORPUS:-}" ] && [ ! -d /usr/share/doc/python3-doc/html/_sources ]; then
        missing+=(python3-doc) # the English corpus of cli/tests/localnet_up_text.rs
    fi
    if [ "${#missing[@]}" -eq 0 ]; then return; fi
    echo "== installing Debian packages: ${missing[*]}"
    as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}
install_all() {
    install_debian_packages
    if [ -z "${IOTA_TEST_S3_ENDPOINT:-}" ]; then
        echo "== installing an S3-compatible server (moto, from PyPI)"
        scripts/s3.sh install
    fi
    echo "== Python SDK venvs (bittensor 11.x and 10.x from PyPI, for localnet/tests/python_sdk.rs)"
    bash scripts/python-sdk-venvs.sh >target/python-sdk.env
    echo "== bittensor-drand venv (from PyPI, for chain/tests/drand_python.rs)"
    bash scripts/drand-venv.sh >target/drand.env
    echo "== schemathesis (from PyPI, for orchestrator/tests/schemathesis.rs)"
    scripts/schemathesis-venv.sh
    echo "== CUDA 13.0 compiler (from PyPI, for the model's CUDA kernels)"
    scripts/cuda-toolchain.sh --compiler-only >/dev/null
}
mkdir -p target
install_all >target/test-install.log 2>&1 &
install_pid=$!
cleanup+=("kill $install_pid 2>/dev/null")

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== module cycles"
python3 scripts/module-cycles.py --self-test
python3 scripts/module-cycles.py

if ! wait "$install_pid"; then
    cat target/test-install.log
    echo "installing what the tests need failed" >&2
    exit 1
fi
cat target/test-install.log
eval "$(cat target/python-sdk.env)"
eval "$(cat target/drand.env)"

# iota-model with the `cuda` feature: clippy, with candle's and the crate's own CUDA kernels
# compiled to PTX by their build scripts (about two and a half minutes; no GPU needed).
echo "== iota-model with the cuda feature (scripts/check-cuda.sh)"
scripts/check-cuda.sh

if [ -z "${IOTA_TEST_S3_ENDPOINT:-}" ]; then
    echo "== starting the S3-compatible server"
    eval "$(scripts/s3.sh start)"
    cleanup+=("scripts/s3.sh stop '$IOTA_S3_DIR'")
fi
export IOTA_TEST_S3_ENDPOINT

# cargo-nextest, where installed, runs tests of different binaries side by side, each in its own
# process; it skips doctests. Most tests wait on a chain, a phase deadline or the store, so it
# runs two a core, which keeps the cores busy while they wait; the few that train for minutes
# take two slots each (.config/nextest.toml).
run_tests() {
    if cargo nextest --version >/dev/null 2>&1; then
        cargo nextest run --locked --no-fail-fast \
            --test-threads "${IOTA_TEST_THREADS:-$((2 * $(nproc)))}" "$@"
    else
        cargo test --locked "$@"
    fi
}
echo "== tests"
run_tests --workspace
if cargo nextest --version >/dev/null 2>&1; then
    cargo test --workspace --doc --locked
fi
# Selected with the whole workspace, so that every dependency keeps the features it was just
# built with: `-p iota-model` alone resolves them differently and rebuilds nearly everything.
echo "== iota-model with the openblas feature: lints, and every crate's unit tests"
cargo clippy --workspace --all-targets --locked --features iota-model/openblas -- -D warnings
run_tests --workspace --lib --features iota-model/openblas

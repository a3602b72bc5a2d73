#!/usr/bin/env bash
# Creates the venv the chain client's timelock encryption is cross-checked against
# (chain/tests/drand_python.rs): the `bittensor-drand` package from PyPI (Rust, through PyO3; the
# encryption the Python SDK uses for drand-timelocked weight commits), under target/python/drand.
# Prints the `export` line for its interpreter. An existing venv with the right version is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=2.0.0
DIR=target/python/drand
PYTHON=${PYTHON:-python3}
if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c "import ensurepip, venv" 2>/dev/null; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq >&2 && apt-get install -y -qq python3 python3-venv python3-pip >&2
    fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c "import ensurepip, venv" 2>/dev/null; then
    echo "drand-venv: $PYTHON with venv is required (Debian: apt-get install python3-venv)" >&2
    exit 1
fi

installed=""
if [ -x "$DIR/bin/python" ]; then
    installed=$("$DIR/bin/python" -m pip show bittensor-drand 2>/dev/null || true)
fi
if ! grep -qx "Version: $VERSION" <<<"$installed"; then
    rm -rf "$DIR"
    "$PYTHON" -m venv "$DIR" >&2
    "$DIR/bin/python" -m pip install --quiet --disable-pip-version-check "bittensor-drand==$VERSION" >&2
fi
echo "export IOTA_PY_DRAND=$PWD/$DIR/bin/python"

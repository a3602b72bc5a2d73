#!/usr/bin/env bash
# Creates the venv the chain client's timelock encryption is cross-checked against
# (chain/tests/drand_python.rs): the `bittensor-drand` package from PyPI (Rust, through PyO3; the
# encryption the Python SDK uses for drand-timelocked weight commits), under target/python/drand.
# Prints the `export` line for its interpreter. An existing venv with the right version is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=2.0.0
DIR=target/python/drand
. scripts/lib/python.sh
require_python_venv drand-venv

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

#!/usr/bin/env bash
# Creates the Python clients the localnet is tested against (localnet/tests/python_sdk.rs):
# the current `bittensor` SDK and the previous generation (10.x on async-substrate-interface),
# each in its own venv under target/python. Prints the `export` lines for their interpreters.
# Packages come from PyPI; an existing venv with the right version is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# A fresh Debian/Ubuntu machine may lack Python or its venv module: install them when we can.
if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c "import ensurepip, venv" 2>/dev/null; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq >&2 && apt-get install -y -qq python3 python3-venv python3-pip >&2
    fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c "import ensurepip, venv" 2>/dev/null; then
    echo "python-sdk-venvs: $PYTHON with venv is required (Debian: apt-get install python3-venv)" >&2
    exit 1
fi

make_venv() { # dir, pip requirement
    local dir=$1 requirement=$2
    local installed=""
    if [ -x "$dir/bin/python" ]; then
        installed=$("$dir/bin/python" -m pip show bittensor 2>/dev/null || true)
    fi
    if grep -qx "Version: ${requirement#*==}" <<<"$installed"; then
        return
    fi
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir" >&2
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "$requirement" >&2
}

make_venv target/python/sdk11 "bittensor==11.3.0"
make_venv target/python/sdk10 "bittensor==10.5.0"
echo "export IOTA_PY_SDK11=$PWD/target/python/sdk11/bin/python"
echo "export IOTA_PY_SDK10=$PWD/target/python/sdk10/bin/python"

#!/usr/bin/env bash
# Creates the Python clients the localnet is tested against (localnet/tests/python_sdk.rs):
# the current `bittensor` SDK and the previous generation (10.x on async-substrate-interface),
# each in its own venv under target/python. Prints the `export` lines for their interpreters.
# Packages come from PyPI; an existing venv with the right version is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/lib/python.sh
require_python_venv python-sdk-venvs

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

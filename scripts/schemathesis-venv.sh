#!/usr/bin/env bash
# Installs schemathesis (the API fuzzer the orchestrator's `schemathesis` test runs) and the sr25519
# bindings its signing hook uses, from PyPI, into a venv under target/python/schemathesis.
# Prints nothing but errors; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=target/python/schemathesis
if [ -x "$VENV/bin/schemathesis" ] && "$VENV/bin/python" -c 'import sr25519' 2>/dev/null; then
    exit 0
fi
if ! python3 -c 'import ensurepip' 2>/dev/null; then
    echo "python3's venv module is missing: install python3-venv (scripts/python-sdk-venvs.sh does)" >&2
    exit 1
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check 'schemathesis==4.32.5' 'py-sr25519-bindings>=0.2,<0.3' >&2

#!/usr/bin/env bash
# The project's whole check, as a new user and CI run it: formatting, lints, every test.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== Python SDK venvs (bittensor 11.x and 10.x from PyPI, for localnet/tests/python_sdk.rs)"
venvs=$(bash scripts/python-sdk-venvs.sh)
eval "$venvs"
echo "== cargo test"
cargo test --workspace --locked

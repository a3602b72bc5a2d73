#!/usr/bin/env bash
# The project's whole check, as a new user and CI run it: formatting, lints, every test.
#
# Starts what the tests need and stops it afterwards: a throwaway PostgreSQL from the system's
# binaries (scripts/pg.sh; set DATABASE_URL to use your own server instead).
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

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --workspace --locked

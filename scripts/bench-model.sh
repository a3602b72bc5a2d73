#!/usr/bin/env bash
# Training-core benchmarks (model/benches/model.rs) in release mode: per-stage forward+backward
# tokens/s of `small` next to the monolithic model, and the bottleneck compression table.
#
#   scripts/bench-model.sh                # both tables
#   scripts/bench-model.sh throughput     # one of them
#   BENCH_STEPS=300 scripts/bench-model.sh compression
#
# candle's CPU elementwise thread pool costs more in wake-ups than it saves on small machines
# (measured 2x slower on 2 vCPUs); set CANDLE_NUM_THREADS yourself to override the default of 1.
# Matrix products still use every core.
set -euo pipefail
cd "$(dirname "$0")/.."
export CANDLE_NUM_THREADS="${CANDLE_NUM_THREADS:-1}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/model}"
exec cargo bench -p iota-model --bench model -- "$@"

#!/usr/bin/env bash
# Training-core benchmarks (model/benches/model.rs) in release mode: per-stage forward+backward
# tokens/s of `small` next to the monolithic model, and the bottleneck compression table.
#
#   scripts/bench-model.sh                # both tables
#   scripts/bench-model.sh throughput     # one of them
#   BENCH_STEPS=300 scripts/bench-model.sh compression
#
# On a GPU (not run by this script): `cargo bench -p iota-model --features cuda --bench model --
# device` times each stage of `iota-1.5b` alone in bf16 and f32 (model/README.md).
#
# Threads: candle's default (all cores) unless CANDLE_NUM_THREADS is set. On an idle 2-vCPU
# machine 2 threads measured 7-23% faster than 1; on an oversubscribed one, 1 thread was 2x
# faster (model/README.md, "CPU speed and thread count").
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/model}"
exec cargo bench -p iota-model --bench model -- "$@"

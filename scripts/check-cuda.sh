#!/usr/bin/env bash
# Checks that iota-model compiles and passes clippy with candle's CUDA backend and the crate's
# own kernels (`--features cuda`), on a machine without a GPU:
#
#   scripts/check-cuda.sh
#
# candle and this crate compile their CUDA kernels with nvcc in build scripts, so even `cargo
# check` needs the CUDA compiler: scripts/cuda-toolchain.sh installs CUDA 13.0's from PyPI. The
# target compute capability defaults to 8.0 (CUDA_COMPUTE_CAP). A cold run takes about 12 minutes
# on two cores, most of it in candle's kernels, which is why CI runs only `nvcc --ptx` on this
# crate's kernels (scripts/test.sh) and this script is run by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
eval "$(scripts/cuda-toolchain.sh)"
nvcc --version | tail -n 2
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda}"
cargo clippy -p iota-model --features cuda --all-targets -- -D warnings
echo "iota-model compiles with --features cuda (CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP})"

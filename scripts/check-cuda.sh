#!/usr/bin/env bash
# Checks that iota-model compiles and passes clippy with candle's CUDA backend and the crate's
# own kernels (`--features cuda`), on a machine without a GPU; CI runs it (scripts/test.sh):
#
#   scripts/check-cuda.sh
#
# candle and this crate compile their CUDA kernels with nvcc in build scripts, so even `cargo
# check` needs the CUDA compiler: scripts/cuda-toolchain.sh installs CUDA 13.0's from PyPI. Every
# PTX kernel, candle's and this crate's (src/cuda/*.cu), is compiled for real. candle's static
# library of MoE/GGUF kernels is not: a check never links, and compiled for real it is about ten
# minutes of nvcc on two cores, so scripts/lib/nvcc-check-only.sh gives its objects empty
# sources. Its own target directory keeps those objects away from builds that link
# (target/cuda, model/README.md). The target compute capability defaults to 8.0
# (CUDA_COMPUTE_CAP). About two and a half minutes cold on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
eval "$(scripts/cuda-toolchain.sh --compiler-only)"
nvcc --version | tail -n 2
export NVCC="$PWD/scripts/lib/nvcc-check-only.sh"
export CARGO_TARGET_DIR="${IOTA_CUDA_CHECK_TARGET:-target/cuda-check}"
cargo clippy -p iota-model --features cuda --all-targets --locked -- -D warnings
echo "iota-model compiles with --features cuda (CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP})"

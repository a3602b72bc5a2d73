#!/usr/bin/env bash
# Checks that iota-model compiles with candle's CUDA backend (`--features cuda`).
#
# candle compiles its CUDA kernels with nvcc in a build script, so even `cargo check` needs the
# CUDA compiler. If nvcc is missing this installs Debian's `nvidia-cuda-toolkit` from the
# non-free component (root or sudo, network access to the Debian mirror and crates.io). No GPU
# is needed: the target compute capability defaults to 8.0 (CUDA_COMPUTE_CAP=80) when
# nvidia-smi cannot report one. Not part of CI.
#
# This checks compilation only. Debian bookworm's toolkit is CUDA 11.8, so binaries built with it
# look for CUDA 11 libraries that a CUDA 13 machine lacks; model/README.md ("Half precision")
# describes building binaries for a GPU machine from PyPI's CUDA wheels instead.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
fi

if ! command -v nvcc >/dev/null 2>&1; then
    if [ ! -r /etc/os-release ] || ! grep -qi '^ID=debian' /etc/os-release; then
        echo "nvcc not found and this is not Debian: install the CUDA toolkit (nvcc) and re-run." >&2
        exit 1
    fi
    . /etc/os-release
    # Add the contrib/non-free components in a file of our own instead of editing the system's.
    as_root tee /etc/apt/sources.list.d/iota-non-free.sources >/dev/null <<SOURCES
Types: deb
URIs: http://deb.debian.org/debian
Suites: ${VERSION_CODENAME} ${VERSION_CODENAME}-updates
Components: contrib non-free non-free-firmware
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
    as_root apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nvidia-cuda-toolkit
fi

nvcc --version
if [ -z "${CUDA_COMPUTE_CAP:-}" ]; then
    cap=""
    if command -v nvidia-smi >/dev/null 2>&1; then
        cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .' || true)
    fi
    export CUDA_COMPUTE_CAP="${cap:-80}"
fi
echo "CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP}"

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda}"
cargo check -p iota-model --features cuda --all-targets
echo "iota-model compiles with --features cuda"

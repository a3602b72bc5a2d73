#!/usr/bin/env bash
# nvcc for `cargo check` and `cargo clippy` of the `cuda` feature (scripts/check-cuda.sh):
# candle-kernels' build script compiles its PTX kernels and, separately, a static library of
# MoE/GGUF kernels for the card's SASS, about ten minutes of nvcc on two cores. A check never
# links, so each object compile (`-c`) gets an empty translation unit instead of its source;
# every other call, PTX included (candle's and this project's kernels), is the real nvcc's.
set -euo pipefail
real=${IOTA_REAL_NVCC:-nvcc}
object=false
for arg in "$@"; do
    if [ "$arg" = -c ]; then object=true; fi
done
if ! $object; then
    exec "$real" "$@"
fi
empty=$(mktemp --suffix=.cu)
trap 'rm -f "$empty"' EXIT
args=()
for arg in "$@"; do
    case "$arg" in
    *.cu) args+=("$empty") ;;
    *) args+=("$arg") ;;
    esac
done
"$real" "${args[@]}"

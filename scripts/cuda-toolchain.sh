#!/usr/bin/env bash
# A CUDA 13.0 toolchain from PyPI's wheels, for machines without a GPU or a system toolkit:
#
#   eval "$(scripts/cuda-toolchain.sh [--compiler-only] [DIR])"   # DIR: target/cuda-toolchain
#
# (--compiler-only: nvcc and the headers alone, about a fifth of the download, enough to compile
# kernels to PTX but not to link; CI uses it.)
# installs (once) nvcc, its headers and the CUDA libraries candle links against into a venv in
# DIR, makes DIR/home a CUDA_HOME (lib/ holds unversioned links to the wheels' libraries and a
# stub libcuda.so.1 with every driver entry point cudarc binds, for linking where no driver is
# installed; on a GPU machine the driver's own libcuda.so.1 is loaded instead) and prints the
# exports that point cargo at it. The versions are pinned to the CUDA of the GPU machines' driver
# (13.0): candle loads PTX at run time, which an older driver refuses from a newer nvcc, and
# cudarc only knows the CUDA versions it was released with.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
compiler_only=false
if [ "${1:-}" = --compiler-only ]; then
    compiler_only=true
    shift
fi
dir=${1:-$root/target/cuda-toolchain}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
python=${PYTHON:-python3}

if [ ! -x "$dir/venv/bin/python" ]; then
    "$python" -m venv "$dir/venv" >&2
fi
compiler=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
    nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96)
libraries=(nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.5.25)
if [ ! -e "$dir/venv/.compiler" ]; then
    "$dir/venv/bin/pip" install -q --disable-pip-version-check "${compiler[@]}" >&2
    touch "$dir/venv/.compiler"
fi
if ! $compiler_only && [ ! -e "$dir/venv/.installed" ]; then
    "$dir/venv/bin/pip" install -q --disable-pip-version-check "${libraries[@]}" >&2
    touch "$dir/venv/.installed"
fi
cu=$(echo "$dir"/venv/lib/python3*/site-packages/nvidia/cu13)
home=$dir/home
if $compiler_only; then
    echo "export PATH=\"$cu/bin:\$PATH\""
    exit 0
fi
if [ ! -e "$home/lib/libcuda.so" ]; then
    mkdir -p "$home/lib"
    ln -sfn "$cu/include" "$home/include"
    ln -sfn "$cu/bin" "$home/bin"
    for lib in cudart cublas cublasLt curand nvrtc; do
        so=$(ls "$cu"/lib/lib$lib.so.* | head -n1)
        ln -sf "$so" "$home/lib/lib$lib.so"
    done
    # The entry points cudarc declares, each an empty function: enough for the linker.
    sys=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null | tail -n1 || true)
    if [ -z "$sys" ]; then
        cargo fetch --manifest-path "$root/Cargo.toml" >&2
        sys=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs | tail -n1)
    fi
    grep -o 'fn cu[A-Za-z0-9_]*' "$sys" | sort -u | sed 's/^fn \(.*\)/void \1(void) {}/' >"$home/cuda_stub.c"
    gcc -shared -fPIC -o "$home/lib/libcuda.so.1" -Wl,-soname,libcuda.so.1 "$home/cuda_stub.c"
    ln -sf libcuda.so.1 "$home/lib/libcuda.so"
fi
echo "export PATH=\"$cu/bin:\$PATH\""
echo "export CUDA_HOME=\"$home\""
echo "export CUDA_COMPUTE_CAP=\"${CUDA_COMPUTE_CAP:-90}\""

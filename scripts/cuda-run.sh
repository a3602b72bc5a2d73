#!/usr/bin/env bash
# Runs the CUDA checks on a GPU machine from binaries built elsewhere with `--features cuda`
# (model/README.md, "Half precision", says how to build them without a GPU):
#
#   scripts/cuda-run.sh DIR [OUT]
#
# DIR holds `model-tests` and `miner-tests` (the crates' release test binaries), `replay_error`
# (model example) and `model-bench` (model bench); with `miner-integration` (the miner's
# integration tests, whose `training::` ones run) and DATABASE_URL set, it also trains a real run with every miner on GPU 0. The CUDA 13 libraries are taken from where
# the machine has them (a system toolkit or the nvidia-* Python wheels); IOTA_REQUIRE_CUDA makes
# every GPU test fail rather than skip when the device does not answer. Logs go to OUT
# (default: a temporary directory); a summary is printed last.
set -uo pipefail
bin=$(cd "$1" && pwd)
out=${2:-$(mktemp -d)}
mkdir -p "$out"

libdirs=$(find / \( -path /proc -o -path /sys -o -path /dev -o -path "$bin" \) -prune -o \
    \( -name 'libcublas.so.13' -o -name 'libcurand.so.10' -o -name 'libnvrtc.so.13' -o -name 'libcudart.so.13' \) -print 2>/dev/null |
    xargs -r -n1 dirname | sort -u | paste -sd:)
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export IOTA_REQUIRE_CUDA=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader | tee "$out/gpu.txt"
echo "libraries: $LD_LIBRARY_PATH" | tee -a "$out/gpu.txt"

status=()
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    status+=("$name: exit $rc in $((SECONDS - t0)) s")
    tail -n 25 "$out/$name.log"
}

step model-tests 150 "$bin/model-tests" --test-threads 8
if [ -x "$bin/miner-tests" ]; then
    step miner-cuda 60 "$bin/miner-tests" cuda_memory_and_throughput_are_measured --nocapture
fi
if [ -x "$bin/miner-integration" ] && [ -n "${DATABASE_URL:-}" ]; then
    # Evidence that the miners' tensors live on the GPU: its per-process memory while they train.
    (while sleep 1; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; done) \
        >"$out/gpu-apps.log" 2>&1 &
    sampler=$!
    step training-cuda 200 env IOTA_TEST_DEVICE=cuda:0 "$bin/miner-integration" training:: --test-threads 1
    kill "$sampler"
    echo "GPU memory of the training process, largest sample: $(sort -t, -k2 -n "$out/gpu-apps.log" | tail -n 1)"
fi

if [ "${ROUNDS:-8}" != 0 ]; then
    step replay-error 150 "$bin/replay_error" --rounds "${ROUNDS:-8}"
fi
# The card's memory in use while the stages run, sampled every 100 ms (the largest sample is an
# upper bound on the bench's own peak: nothing else runs).
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$out/bench-memory.log" 2>&1 &
sampler=$!
step bench-device 200 env BENCH_ITERS="${BENCH_ITERS:-5}" BENCH_SEQ="${BENCH_SEQ:-800}" \
    BENCH_CONFIG_OUT="$out/config.json" "$bin/model-bench" --bench device
kill "$sampler"
echo "GPU memory in use during the device bench, largest sample: $(sort -n "$out/bench-memory.log" | tail -n 1) MiB"
# PyTorch on the same stages and shapes (bf16 autocast, SDPA), where the machine has it.
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null && [ -s "$out/config.json" ]; then
    step torch-stages 200 python3 "$(dirname "$0")/reference/torch_stage_speed.py" \
        "$out/config.json" "${BENCH_BATCH:-4}" "${BENCH_SEQ:-800}" "${BENCH_ITERS:-5}"
fi

echo
grep -E '^test result|panicked|FAILED' "$out/model-tests.log" | head -5
grep -E 'gpu_matches_cpu|bf16_cuda|cuda_attention' "$out/model-tests.log"
grep -E 'free .* GB|test result' "$out/miner-cuda.log" 2>/dev/null
grep -E '^\| ' "$out/bench-device.log"
cat "$out/torch-stages.log" 2>/dev/null
printf '%s\n' "${status[@]}"

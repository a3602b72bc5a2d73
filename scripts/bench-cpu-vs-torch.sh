#!/usr/bin/env bash
# candle against PyTorch on the CPU, same model (`small` by default), same micro-batch (4x128),
# f32, forward+backward of the whole model, at 1 thread and at the machine's core count (`THREADS`), interleaved in one run so that
# all see the same machine load. candle runs as built by default (its own `gemm` kernel) and
# with the `openblas` feature (system OpenBLAS; skipped when libopenblas is not installed), the
# latter once with the kernels OpenBLAS picks itself and, on an AVX-512 CPU, once more with
# OPENBLAS_CORETYPE=SkylakeX (OpenBLAS 0.3.21 falls back to AVX2 kernels on CPUs it does not
# know, AMD Zen 5 among them), and once more (its own gemm) with each micro-batch cut in two runs
# trained side by side (`StageOptions::sub_batches`, `iota miner --sub-batches 2`), element-wise
# operations on one thread as `iota miner` then runs them. On an AVX-512 CPU, candle's gemm also
# runs built without the crate's `avx512` feature (its AVX2 kernels). Prints a table of median
# tokens/s and the ratios to PyTorch.
#
#   scripts/bench-cpu-vs-torch.sh                 # ROUNDS=3 ITERS=5 CONFIG=small BATCH=4 SEQ=128
#   TORCH_PYTHON=/path/to/venv/bin/python scripts/bench-cpu-vs-torch.sh
#
# Needs PyTorch: python3 -m venv /tmp/ref-venv && /tmp/ref-venv/bin/pip install torch numpy
# and, for the OpenBLAS columns, Debian's libopenblas-dev.
set -euo pipefail
cd "$(dirname "$0")/.."
cores="$(nproc)"
# 1 thread and the machine's core count (the count a dedicated miner runs at).
THREADS="${THREADS:-$( [ "$cores" -gt 1 ] && echo "1 $cores" || echo 1 )}"
ROUNDS="${ROUNDS:-3}" ITERS="${ITERS:-5}" CONFIG="${CONFIG:-small}" BATCH="${BATCH:-4}" SEQ="${SEQ:-128}"
PY="${TORCH_PYTHON:-python3}"
"$PY" -c "import torch" 2>/dev/null || { echo "no torch for $PY; set TORCH_PYTHON" >&2; exit 1; }
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
cargo build -q --release -p iota-model --example speed
cp target/release/examples/speed "$tmp/speed-gemm"
# Variants: name, binary, extra environment, the example's mode, element-wise threads (t: the
# thread count of the row).
variants=("gemm|$tmp/speed-gemm||monolithic|t" "gemm-runs2|$tmp/speed-gemm||sub-batched:2|1")
if grep -qw avx512f /proc/cpuinfo; then
  # candle's gemm without the `avx512` feature: its AVX2 kernels, as before that feature.
  cargo build -q --release -p iota-model --no-default-features --example speed
  cp target/release/examples/speed "$tmp/speed-gemm-avx2"
  variants+=("gemm-avx2|$tmp/speed-gemm-avx2||monolithic|t")
fi
if ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\b'; then
  cargo build -q --release -p iota-model --features openblas --example speed
  cp target/release/examples/speed "$tmp/speed-blas"
  variants+=("openblas|$tmp/speed-blas||monolithic|t")
  if grep -qw avx512f /proc/cpuinfo; then
    variants+=("openblas-skx|$tmp/speed-blas|OPENBLAS_CORETYPE=SkylakeX|monolithic|t")
  fi
else
  echo "libopenblas not installed (apt-get install libopenblas-dev): no OpenBLAS columns" >&2
fi
cfg_json="$tmp/config.json"
"$tmp/speed-gemm" --print-config "$CONFIG" > "$cfg_json"
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
echo "load average before: $load_before" >&2
for r in $(seq "$ROUNDS"); do
  for t in $THREADS; do
    for v in "${variants[@]}"; do
      IFS='|' read -r name bin extra mode ew <<< "$v"
      [ "$ew" = t ] && ew=$t
      c=$(env $extra CANDLE_NUM_THREADS=$ew RAYON_NUM_THREADS=$t "$bin" "$CONFIG" "$BATCH" "$SEQ" "$ITERS" \
        "$mode" 2> "$tmp/err" | sed 's/.*=//')
      echo "$name $t $c" >> "$tmp/runs"
      echo "round $r, $t thread(s): candle $name $c tokens/s ($(grep '^matmul' "$tmp/err"))" >&2
    done
    p=$(OMP_NUM_THREADS=$t "$PY" scripts/reference/torch_speed.py "$cfg_json" "$t" "$BATCH" "$SEQ" "$ITERS" | sed 's/.*=//')
    echo "torch $t $p" >> "$tmp/runs"
    echo "round $r, $t thread(s): torch $p tokens/s" >&2
  done
done
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"
echo "load average after: $load_after" >&2
"$PY" - "$tmp/runs" "$CONFIG" "$BATCH" "$SEQ" "$load_before" "$load_after" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
names = list(dict.fromkeys(r[0] for r in rows if r[0] != "torch"))
label = {"gemm": "candle (gemm)", "openblas": "candle + OpenBLAS",
         "openblas-skx": "candle + OpenBLAS SkylakeX",
         "gemm-runs2": "candle (gemm), 2 runs side by side",
         "gemm-avx2": "candle (gemm, AVX2 only)"}
threads = sorted({r[1] for r in rows}, key=int)
med = {(n, t): statistics.median(float(r[2]) for r in rows if r[0] == n and r[1] == t)
       for n in names + ["torch"] for t in threads}
print(f"## CPU forward+backward, `{sys.argv[2]}`, micro-batch {sys.argv[3]}x{sys.argv[4]}, f32 (median of rounds, tokens/s)\n")
print("| threads | " + " | ".join(label.get(n, n) for n in names) + " | PyTorch | "
      + " | ".join(f"{label.get(n, n)} / PyTorch" for n in names) + " |")
print("|---" * (2 * len(names) + 2) + "|")
for t in threads:
    p = med[("torch", t)]
    print(f"| {t} | " + " | ".join(f"{med[(n, t)]:.0f}" for n in names) + f" | {p:.0f} | "
          + " | ".join(f"{med[(n, t)] / p:.2f}" for n in names) + " |")
best_p = max(med[("torch", t)] for t in threads)
print()
for n in names:
    best = max(med[(n, t)] for t in threads)
    print(f"best {label.get(n, n)} / best PyTorch: {best / best_p:.2f}")
print(f"\nload average before: {sys.argv[5]}; after: {sys.argv[6]}")
PY

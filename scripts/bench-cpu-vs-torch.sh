#!/usr/bin/env bash
# candle against PyTorch on the CPU, same model (`small` by default), same micro-batch (4x128),
# f32, forward+backward of the whole model, at 1 and 2 threads, interleaved in one run so that
# both see the same machine load. Prints a table of median tokens/s and the candle/PyTorch ratio.
#
#   scripts/bench-cpu-vs-torch.sh                 # ROUNDS=3 ITERS=5 CONFIG=small BATCH=4 SEQ=128
#   TORCH_PYTHON=/path/to/venv/bin/python scripts/bench-cpu-vs-torch.sh
#
# Needs PyTorch: python3 -m venv /tmp/ref-venv && /tmp/ref-venv/bin/pip install torch numpy
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-3}" ITERS="${ITERS:-5}" CONFIG="${CONFIG:-small}" BATCH="${BATCH:-4}" SEQ="${SEQ:-128}"
PY="${TORCH_PYTHON:-python3}"
"$PY" -c "import torch" 2>/dev/null || { echo "no torch for $PY; set TORCH_PYTHON" >&2; exit 1; }
cargo build -q --release -p iota-model --example speed
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
cfg_json="$tmp/config.json"
target/release/examples/speed --print-config "$CONFIG" > "$cfg_json"
for r in $(seq "$ROUNDS"); do
  for t in 1 2; do
    c=$(CANDLE_NUM_THREADS=$t RAYON_NUM_THREADS=$t target/release/examples/speed "$CONFIG" "$BATCH" "$SEQ" "$ITERS" | sed 's/.*=//')
    p=$(OMP_NUM_THREADS=$t "$PY" scripts/reference/torch_speed.py "$cfg_json" "$t" "$BATCH" "$SEQ" "$ITERS" | sed 's/.*=//')
    echo "$t $c $p" >> "$tmp/runs"
    echo "round $r, $t thread(s): candle $c tokens/s, torch $p tokens/s" >&2
  done
done
"$PY" - "$tmp/runs" "$CONFIG" "$BATCH" "$SEQ" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
print(f"## CPU forward+backward, `{sys.argv[2]}`, micro-batch {sys.argv[3]}x{sys.argv[4]}, f32 (median of rounds)\n")
print("| threads | candle tokens/s | PyTorch tokens/s | candle / PyTorch |")
print("|---|---|---|---|")
for t in ("1", "2"):
    c = statistics.median(float(r[1]) for r in rows if r[0] == t)
    p = statistics.median(float(r[2]) for r in rows if r[0] == t)
    print(f"| {t} | {c:.0f} | {p:.0f} | {c / p:.2f} |")
best_c = max(statistics.median(float(r[1]) for r in rows if r[0] == t) for t in ("1", "2"))
best_p = max(statistics.median(float(r[2]) for r in rows if r[0] == t) for t in ("1", "2"))
print(f"\nbest candle / best PyTorch: {best_c / best_p:.2f}")
PY

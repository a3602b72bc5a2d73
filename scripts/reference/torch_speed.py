#!/usr/bin/env python3
"""PyTorch forward+backward tokens/s on the same model and shapes as the candle `speed` example.

    python torch_speed.py CONFIG_JSON THREADS BATCH SEQ ITERS

Prints one line: `tokens_per_s=<float>` (median over ITERS timed iterations after one warm-up).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llama_reference import loss_of, param_shapes  # noqa: E402


def main():
    cfg = json.loads(Path(sys.argv[1]).read_text())
    threads, batch, seq, iters = (int(a) for a in sys.argv[2:6])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    params = {}
    for name, shape in param_shapes(cfg):
        t = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape) * cfg["init_std"]
        params[name] = t.requires_grad_(True)
    tokens = torch.randint(0, cfg["vocab_size"], (batch, seq))
    targets = torch.randint(0, cfg["vocab_size"], (batch, seq))
    times = []
    for it in range(iters + 1):
        t0 = time.perf_counter()
        loss = loss_of(params, tokens, targets, cfg)
        loss.backward()
        dt = time.perf_counter() - t0
        for p in params.values():
            p.grad = None
        if it > 0:
            times.append(dt)
    print(f"tokens_per_s={batch * seq / statistics.median(times):.1f}")


if __name__ == "__main__":
    main()

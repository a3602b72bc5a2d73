#!/usr/bin/env python3
"""PyTorch forward+backward time of each stage of a config, as one miner holds it, on a GPU.

    python torch_stage_speed.py CONFIG_JSON BATCH SEQ ITERS

The same stage shapes as candle's `cargo bench -p iota-model --bench model -- device`: stage 0
embeds tokens, the middle stages decode a `bottleneck_dim`-wide input (linear, ReLU), every
stage but the last encodes its output back to `bottleneck_dim`, the last ends in RMSNorm, the
LM head and cross-entropy. Blocks are Llama's (RMSNorm, grouped-query attention with RoPE,
SwiGLU). Weights are f32; compute is bf16 autocast with SDPA's fused causal attention, which is
how PyTorch users train such a model. Backward of a stage that sends activations uses a random
upstream gradient. Prints one line per stage: `stage=K ms=<median> tokens_per_s=<float>`.
"""

import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def block(x, p, cfg, cos, sin):
    b, t, d = x.shape
    h, kv = cfg["n_heads"], cfg["n_kv_heads"]
    hd = d // h
    y = rms(x, p["attn_norm"], cfg["norm_eps"])
    q = (y @ p["wq"].t()).view(b, t, h, hd).transpose(1, 2)
    k = (y @ p["wk"].t()).view(b, t, kv, hd).transpose(1, 2)
    v = (y @ p["wv"].t()).view(b, t, kv, hd).transpose(1, 2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x = x + a.transpose(1, 2).reshape(b, t, d) @ p["wo"].t()
    y = rms(x, p["ffn_norm"], cfg["norm_eps"])
    return x + (F.silu(y @ p["w1"].t()) * (y @ p["w3"].t())) @ p["w2"].t()


def stage_params(cfg, k, dev):
    d, f, bn = cfg["d_model"], cfg["d_ff"], cfg["bottleneck_dim"]
    kv_d = d // cfg["n_heads"] * cfg["n_kv_heads"]
    last = k == len(cfg["stages"]) - 1

    def w(*shape):
        return (torch.randn(*shape, device=dev) * cfg["init_std"]).requires_grad_(True)

    p = {"blocks": []}
    if k == 0:
        p["embed"] = w(cfg["vocab_size"], d)
    else:
        p["decoder"] = w(d, bn)
    for _ in range(cfg["stages"][k]):
        p["blocks"].append({
            "attn_norm": torch.ones(d, device=dev, requires_grad=True),
            "ffn_norm": torch.ones(d, device=dev, requires_grad=True),
            "wq": w(d, d), "wk": w(kv_d, d), "wv": w(kv_d, d), "wo": w(d, d),
            "w1": w(f, d), "w3": w(f, d), "w2": w(d, f),
        })
    if last:
        p["norm"] = torch.ones(d, device=dev, requires_grad=True)
        p["head"] = w(cfg["vocab_size"], d)
    else:
        p["encoder"] = w(bn, d)
    return p


def params_of(p):
    yield from (v for k, v in p.items() if k != "blocks")
    for b in p["blocks"]:
        yield from b.values()


def pass_of(p, cfg, k, x, targets, up, cos, sin):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = F.embedding(x, p["embed"]) if k == 0 else F.relu(x @ p["decoder"].t())
        for b in p["blocks"]:
            h = block(h, b, cfg, cos, sin)
        if "head" in p:
            logits = rms(h, p["norm"], cfg["norm_eps"]) @ p["head"].t()
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
        else:
            out = h @ p["encoder"].t()
            out.backward(up)


def main():
    cfg = json.loads(Path(sys.argv[1]).read_text())
    batch, seq, iters = (int(a) for a in sys.argv[2:5])
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hd = cfg["d_model"] // cfg["n_heads"]
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, device=dev).float() / hd)
    ang = torch.outer(torch.arange(seq, device=dev).float(), inv)
    cos, sin = ang.cos(), ang.sin()
    for k in range(len(cfg["stages"])):
        p = stage_params(cfg, k, dev)
        if k == 0:
            x = torch.randint(0, cfg["vocab_size"], (batch, seq), device=dev)
        else:
            x = torch.randn(batch, seq, cfg["bottleneck_dim"], device=dev)
        targets = torch.randint(0, cfg["vocab_size"], (batch, seq), device=dev)
        up = torch.randn(batch, seq, cfg["bottleneck_dim"], device=dev) * 1e-3
        times = []
        for it in range(iters + 1):
            for q in params_of(p):
                q.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            pass_of(p, cfg, k, x, targets, up, cos, sin)
            end.record()
            torch.cuda.synchronize()
            if it > 0:
                times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        print(f"stage={k} ms={ms:.1f} tokens_per_s={batch * seq / ms * 1e3:.0f}", flush=True)
        del p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

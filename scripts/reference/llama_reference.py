#!/usr/bin/env python3
"""Independent PyTorch reference of the iota-model Llama (with residual bottlenecks).

Reads `<case>.inputs.safetensors` (parameters by canonical name, `batch.tokens`,
`batch.targets`) and `<case>.config.json` from the golden directory, computes in float64 the
mean next-token cross-entropy over all tokens and the gradient of every parameter with torch
autograd, and writes `<case>.golden.safetensors` (`loss` as F64, `grad.<name>` as F32).

The model is written from the architecture description (Llama-3 style: RMSNorm, rotate-half
RoPE, grouped-query attention, SwiGLU, untied head; the bottleneck as in model/README.md), not
translated from the Rust code. Run by hand; the outputs are committed and the Rust test
`model/tests/golden.rs` compares against them:

    python3 -m venv .venv && .venv/bin/pip install torch numpy
    .venv/bin/python scripts/reference/llama_reference.py scripts/reference/golden
"""

import json
import struct
import sys
from pathlib import Path

import numpy as np
import torch

DTYPES = {"F32": np.float32, "F64": np.float64, "U32": np.uint32, "I64": np.int64}


def read_safetensors(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        arr = np.frombuffer(raw[base + start : base + end], dtype=DTYPES[info["dtype"]])
        out[name] = arr.reshape(info["shape"]).copy()
    return out


def write_safetensors(path, tensors):
    names = sorted(tensors)
    header, offset, blobs = {}, 0, []
    for name in names:
        arr = np.ascontiguousarray(tensors[name])
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64"}[arr.dtype]
        data = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(cfg, seq, dtype=torch.float64):
    if cfg["rope_scaling"] is not None:
        raise SystemExit("rope_scaling is not implemented in the reference")
    hd = cfg["d_model"] // cfg["n_heads"]
    i = torch.arange(hd // 2, dtype=torch.float64)
    inv_freq = cfg["rope_theta"] ** (-2.0 * i / hd)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def rotate(x, cos, sin):
    # Rotate-half layout: the pair (j, j + hd/2) turns by pos * inv_freq[j].
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(x, p, prefix, cfg, cos, sin):
    b, t, d = x.shape
    h, kv = cfg["n_heads"], cfg["n_kv_heads"]
    hd = d // h
    q = (x @ p[f"{prefix}.attn.wq"].T).view(b, t, h, hd).transpose(1, 2)
    k = (x @ p[f"{prefix}.attn.wk"].T).view(b, t, kv, hd).transpose(1, 2)
    v = (x @ p[f"{prefix}.attn.wv"].T).view(b, t, kv, hd).transpose(1, 2)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    # Query head j reads key/value head j // (h / kv).
    k = k.repeat_interleave(h // kv, dim=1)
    v = v.repeat_interleave(h // kv, dim=1)
    scores = q @ k.transpose(-1, -2) / hd**0.5
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(causal, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(b, t, h * hd) @ p[f"{prefix}.attn.wo"].T


def block(x, p, i, cfg, cos, sin):
    prefix = f"blocks.{i}"
    eps = cfg["norm_eps"]
    d = cfg["d_model"]
    skip = None
    if f"{prefix}.decoder.weight" in p:
        # Receiving side of a bottleneck: decode b -> d for attention; the b-vector itself is
        # the residual of the first b channels.
        skip = x
        x = torch.relu(x @ p[f"{prefix}.decoder.weight"].T)
    a = attention(rms_norm(x, p[f"{prefix}.attn_norm.weight"], eps), p, prefix, cfg, cos, sin)
    if skip is not None:
        hres = a + torch.nn.functional.pad(skip, (0, d - skip.shape[-1]))
    else:
        hres = x + a
    n = rms_norm(hres, p[f"{prefix}.ffn_norm.weight"], eps)
    f = (torch.nn.functional.silu(n @ p[f"{prefix}.ffn.w_gate"].T) * (n @ p[f"{prefix}.ffn.w_up"].T)) @ p[
        f"{prefix}.ffn.w_down"
    ].T
    if f"{prefix}.encoder.weight" in p:
        # Sending side: project silu(f) to b and carry the first b residual channels.
        bdim = p[f"{prefix}.encoder.weight"].shape[0]
        return torch.nn.functional.silu(f) @ p[f"{prefix}.encoder.weight"].T + hres[..., :bdim]
    return hres + f


def loss_of(p, tokens, targets, cfg):
    cos, sin = rope_tables(cfg, tokens.shape[1], p["embed.weight"].dtype)
    x = p["embed.weight"][tokens]
    for i in range(sum(cfg["stages"])):
        x = block(x, p, i, cfg, cos, sin)
    x = rms_norm(x, p["norm.weight"], cfg["norm_eps"])
    logits = x @ p["head.weight"].T
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_shapes(cfg):
    """Canonical parameter names and shapes of the whole model (as ModelConfig::stage_param_shapes)."""
    d, h, kv, ff, b = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["d_ff"], cfg["bottleneck_dim"]
    hd = d // h
    has_bneck = b != d
    out = [("embed.weight", (cfg["vocab_size"], d))]
    first = 0
    for k, n in enumerate(cfg["stages"]):
        for i in range(first, first + n):
            p = f"blocks.{i}"
            if k > 0 and i == first and has_bneck:
                out.append((f"{p}.decoder.weight", (d, b)))
            out += [
                (f"{p}.attn_norm.weight", (d,)),
                (f"{p}.attn.wq", (h * hd, d)),
                (f"{p}.attn.wk", (kv * hd, d)),
                (f"{p}.attn.wv", (kv * hd, d)),
                (f"{p}.attn.wo", (d, h * hd)),
                (f"{p}.ffn_norm.weight", (d,)),
                (f"{p}.ffn.w_gate", (ff, d)),
                (f"{p}.ffn.w_up", (ff, d)),
                (f"{p}.ffn.w_down", (d, ff)),
            ]
            if k + 1 < len(cfg["stages"]) and i == first + n - 1 and has_bneck:
                out.append((f"{p}.encoder.weight", (b, d)))
        first += n
    out += [("norm.weight", (d,)), ("head.weight", (cfg["vocab_size"], d))]
    return out


def run_case(golden_dir, case):
    cfg = json.loads((golden_dir / f"{case}.config.json").read_text())
    inputs = read_safetensors(golden_dir / f"{case}.inputs.safetensors")
    tokens = torch.from_numpy(inputs.pop("batch.tokens").astype(np.int64))
    targets = torch.from_numpy(inputs.pop("batch.targets").astype(np.int64))
    params = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in inputs.items()}
    loss = loss_of(params, tokens, targets, cfg)
    loss.backward()
    out = {"loss": np.array([loss.item()], dtype=np.float64)}
    for name, t in params.items():
        out[f"grad.{name}"] = t.grad.numpy().astype(np.float32)
    write_safetensors(golden_dir / f"{case}.golden.safetensors", out)
    print(f"{case}: loss {loss.item():.12f}, {len(params)} parameter gradients, torch {torch.__version__}")


def main():
    golden_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "scripts/reference/golden")
    torch.set_num_threads(1)
    cases = sorted(p.name.split(".")[0] for p in golden_dir.glob("*.inputs.safetensors"))
    if not cases:
        raise SystemExit(f"no *.inputs.safetensors in {golden_dir}")
    for case in cases:
        run_case(golden_dir, case)


if __name__ == "__main__":
    main()

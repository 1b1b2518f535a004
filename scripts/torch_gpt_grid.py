#!/usr/bin/env python3
"""scripts/torch_gpt_grid.py: the PyTorch eager peer of scripts/offload_bench.sh's grid — one GPT-2-
family shape (--depth layers x --width channels, heads of 128) trained at B x T in bf16 autocast with
fused AdamW, no offload; prints one JSON line: the parameter count, tok/s and peak memory, or
"oom": true when it does not fit. One shape per process, so an out-of-memory leaves nothing behind.

Usage: python3 scripts/torch_gpt_grid.py --depth 48 --width 1600 [-B 8] [-T 1024] [--steps 4]
Needs PyTorch with CUDA (the GPU machine's PyTorch 2.11).
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

V = 50304


class Block(nn.Module):
    def __init__(s, C, H):
        super().__init__()
        s.H = H
        s.ln1, s.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        s.qkv, s.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        s.fc, s.out = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, s.H, C // s.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + s.out(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(s, L, C, T):
        super().__init__()
        s.wte, s.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        s.blocks = nn.ModuleList(Block(C, max(1, C // 128)) for _ in range(L))
        s.ln = nn.LayerNorm(C)

    def forward(s, idx, targets):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in s.blocks:
            x = b(x)
        logits = F.linear(s.ln(x), s.wte.weight)  # tied head
        return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("-B", type=int, default=8)
    ap.add_argument("-T", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    out = {"impl": "torch-eager", "depth": a.depth, "width": a.width, "B": a.B, "T": a.T,
           "gpu": torch.cuda.get_device_name()}
    try:
        model = GPT(a.depth, a.width, a.T).cuda()
        out["params"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        times = []
        for _ in range(a.steps):
            x = torch.randint(0, V, (a.B, a.T), device="cuda")
            torch.cuda.synchronize()
            t0 = time.time()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.time() - t0)
        step = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
        out.update(oom=False, step_ms=round(step * 1e3, 1), tok_s=round(a.B * a.T / step),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    except torch.cuda.OutOfMemoryError:
        out.update(oom=True, peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The PyTorch peer of `blutrain bench --device cpu --model gpt2:demo-byte -B 16 -T 64`: the shared
peer's GPT-2 (../shared/peers/torch_gpt2.py, nanoGPT-style) at the demo's shape (257 ids, 4 layers,
4 heads, 128 wide) on the CPU with 2 threads, AdamW and clipping as the trainer runs them; prints
the median step of steps 11-60 as one JSON line. Debian's torch 1.13 has no
scaled_dot_product_attention: the math path is written out for it.
Usage: /usr/bin/python3 scripts/bench_cpu_peer.py [PEERS_DIR]
"""
import json, os, statistics, sys, time
import math
import torch
import torch.nn.functional as F
if not hasattr(F, "scaled_dot_product_attention"):  # Debian's torch 1.13: the math path by hand
    def _sdpa(q, k, v, is_causal=True):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return F.softmax(att, dim=-1) @ v
    F.scaled_dot_product_attention = _sdpa
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "shared", "peers"))
from torch_gpt2 import GPT

torch.manual_seed(0)
torch.set_num_threads(2)
B, T = 16, 64
m = GPT(V=257, T=T, L=4, C=128, H=4)
opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
x = torch.randint(0, 257, (B, T)); y = torch.randint(0, 257, (B, T))
times = []
for i in range(60):
    t0 = time.perf_counter()
    loss = m(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
ms = statistics.median(times[10:]) * 1e3
print(json.dumps({"impl": f"torch-{torch.__version__}", "model": "gpt2:demo-byte shape", "B": B, "T": T,
                  "step_ms": round(ms, 2), "tok_s": round(B * T / ms * 1e3)}))

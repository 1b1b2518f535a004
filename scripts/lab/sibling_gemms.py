#!/usr/bin/env python3
"""Sibling projections (linears that read the same input) as separate GEMMs or as one GEMM over
their weights concatenated, forward and backward, bf16, timed with PyTorch's cuBLAS on one GPU.

    python3 scripts/lab/sibling_gemms.py

Shapes: llama-250m at B=8, T=1024 (hidden 1024; q 1024, k and v 256 each; gate and up 2816 each).
Each line: the group, separate or fused, ms for forward + backward (the input's and the weights'
gradients; separate sums the input gradients as autograd does), and the difference. Fused pays
for concatenating the weights every step (as a model with separate parameters would).
"""
import json

import torch
import torch.nn.functional as F

from gemm_shapes import timed  # the same CUDA-event timing, beside this file


def group(name, tokens, c, outs):
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(tokens, c, device=dev, dtype=dt, requires_grad=True)
    ws = [(torch.randn(n, c, device=dev, dtype=dt) * 0.02).requires_grad_() for n in outs]
    dys = [torch.randn(tokens, n, device=dev, dtype=dt) for n in outs]
    dy_cat = torch.cat(dys, 1)

    def clear():
        x.grad = None
        for w in ws:
            w.grad = None

    def separate():
        clear()
        ys = [F.linear(x, w) for w in ws]
        torch.autograd.backward(ys, dys)

    def fused():
        clear()
        y = F.linear(x, torch.cat(ws, 0))
        y.backward(dy_cat)

    sep, fus = timed(separate), timed(fused)
    print(json.dumps({"group": name, "outs": outs, "separate_ms": round(sep, 4), "fused_ms": round(fus, 4),
                      "saved_ms": round(sep - fus, 4)}))
    return sep - fus


def main():
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}))
    tokens, layers = 8 * 1024, 16
    saved = group("qkv", tokens, 1024, [1024, 256, 256]) + group("gate_up", tokens, 1024, [2816, 2816])
    print(json.dumps({"model": "llama-250m", "layers": layers, "saved_ms_per_step": round(saved * layers, 3)}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The GEMMs of one bf16 training step, timed one by one with PyTorch (cuBLAS/cuBLASLt), to see how
far each shape is from the GPU's GEMM ceiling and how much of the step a faster GEMM could take.

    python3 scripts/lab/gemm_shapes.py [gpt2|llama|both]

Per model: every distinct (M, N, K) of the forward (Y = X W^T), the input gradient (dX = dY W) and
the weight gradient (dW = dY^T X), its count per step, time and TFLOP/s; the step's GEMM total; what
the total would be at the large square GEMM's rate. Shapes: GPT-2 124M at B=16, T=1024 (fused QKV,
MLP 4x, tied 50,304-row head); llama-250m at B=8, T=1024 (hidden 1024, 16 layers, 16 heads of 64,
4 KV heads, fused QKV 1536 and gate+up 5632, MLP 2816, untied 32,000-row head).
"""
import json
import sys

import torch


def timed(fn, reps=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def gemm_ms(m, n, k, kind):
    """One GEMM of the step: forward (M x K)(K x N), input gradient, or weight gradient."""
    dev, dt = "cuda", torch.bfloat16
    if kind == "fwd":  # Y[M,N] = X[M,K] W[N,K]^T
        x, w = torch.randn(m, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt)
        return timed(lambda: torch.matmul(x, w.t()))
    if kind == "dgrad":  # dX[M,K] = dY[M,N] W[N,K]
        dy, w = torch.randn(m, n, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt)
        return timed(lambda: torch.matmul(dy, w))
    dy, x = torch.randn(m, n, device=dev, dtype=dt), torch.randn(m, k, device=dev, dtype=dt)
    return timed(lambda: torch.matmul(dy.t(), x))  # dW[N,K] = dY^T X


def model_gemms(name):
    if name == "gpt2":
        tokens, layers, c, vocab = 16 * 1024, 12, 768, 50304
        per_layer = [(3 * c, c), (c, c), (4 * c, c), (c, 4 * c)]  # (N, K): qkv, proj, fc, fc proj
    else:
        tokens, layers, c, vocab = 8 * 1024, 16, 1024, 32000
        per_layer = [(1536, c), (c, c), (5632, c), (c, 2816)]  # qkv, o, gate+up, down
    shapes = {}
    for n, k in per_layer:
        shapes[(tokens, n, k)] = shapes.get((tokens, n, k), 0) + layers
    shapes[(tokens, vocab, c)] = shapes.get((tokens, vocab, c), 0) + 1
    return shapes


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "both"
    big = 8192
    big_ms = gemm_ms(big, big, big, "fwd")
    big_tflops = 2 * big**3 / big_ms / 1e9
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "square_8192_tflops": round(big_tflops, 1)}))
    for name in (["gpt2", "llama"] if which == "both" else [which]):
        total_ms = total_flop = 0.0
        for (m, n, k), count in model_gemms(name).items():
            for kind in ("fwd", "dgrad", "wgrad"):
                ms = gemm_ms(m, n, k, kind)
                flop = 2.0 * m * n * k
                total_ms += ms * count
                total_flop += flop * count
                print(json.dumps({"model": name, "M": m, "N": n, "K": k, "kind": kind, "count": count,
                                  "ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}))
        print(json.dumps({"model": name, "gemm_ms_per_step": round(total_ms, 2),
                          "tflops": round(total_flop / total_ms / 1e9, 1),
                          "at_square_rate_ms": round(total_flop / big_tflops / 1e9, 2)}))


if __name__ == "__main__":
    main()

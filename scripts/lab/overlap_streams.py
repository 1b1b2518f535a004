#!/usr/bin/env python3
"""Does a memory-bound kernel hide under a GEMM when the two run on separate streams?

    python3 scripts/lab/overlap_streams.py

For llama-250m's backward shapes (8,192 tokens): each weight-gradient GEMM alone, a memory-bound
op alone (a SwiGLU-backward-sized product and an RMSNorm-sized one), then both issued on two
streams at once (20 of each per timed step), and a weight-gradient GEMM beside an input-gradient GEMM. Prints JSON lines:
alone_ms (sum of the two alone), both_ms, hidden (the share of the shorter one that disappeared).
"""
import json

import torch

dev, dt = "cuda", torch.bfloat16
tokens = 8 * 1024


def timed(fn, reps=40):
    for _ in range(5):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


INNER = 20  # kernels per stream per timed step, so the host's stream and event calls stay hidden


def timed_inner(fn):
    def many():
        for _ in range(INNER):
            fn()
    return timed(many) / INNER


def both(f, g, reps=40):
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def step():
        ev = torch.cuda.Event()
        ev.record(main)
        s1.wait_event(ev)
        s2.wait_event(ev)
        with torch.cuda.stream(s1):
            for _ in range(INNER):
                f()
        with torch.cuda.stream(s2):
            for _ in range(INNER):
                g()
        main.wait_stream(s1)
        main.wait_stream(s2)

    return timed(step, reps) / INNER


def wgrad(n, k):  # dW[n, k] = dY[T, n]^T X[T, k]
    dy, x = torch.randn(tokens, n, device=dev, dtype=dt), torch.randn(tokens, k, device=dev, dtype=dt)
    return lambda: torch.mm(dy.t(), x)


def dgrad(n, k):  # dX[T, k] = dY[T, n] W[n, k]
    dy, w = torch.randn(tokens, n, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt)
    return lambda: torch.mm(dy, w)


def pointwise(cols):  # reads two [T, cols] bf16, writes one
    a, b = torch.randn(tokens, cols, device=dev, dtype=dt), torch.randn(tokens, cols, device=dev, dtype=dt)
    c = torch.empty_like(a)
    return lambda: torch.mul(a, b, out=c)


def report(name, f, g):
    tf, tg = timed_inner(f), timed_inner(g)
    tb = both(f, g)
    hidden = (tf + tg - tb) / min(tf, tg)
    print(json.dumps({"case": name, "a_ms": round(tf, 4), "b_ms": round(tg, 4), "alone_ms": round(tf + tg, 4),
                      "both_ms": round(tb, 4), "hidden": round(hidden, 3)}))


def main():
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}))
    gemms = {"wgrad down [1024,2816]": wgrad(1024, 2816), "wgrad gate_up [5632,1024]": wgrad(5632, 1024),
             "wgrad o [1024,1024]": wgrad(1024, 1024), "wgrad qkv [1536,1024]": wgrad(1536, 1024)}
    mems = {"swiglu-size mul [T,5632]": pointwise(5632), "norm-size mul [T,1024]": pointwise(1024)}
    for gn, g in gemms.items():
        for mn, m in mems.items():
            report(gn + " + " + mn, g, m)
    report("wgrad o + dgrad o", gemms["wgrad o [1024,1024]"], dgrad(1024, 1024))
    report("wgrad qkv + dgrad qkv", gemms["wgrad qkv [1536,1024]"], dgrad(1536, 1024))
    report("wgrad down + dgrad down", gemms["wgrad down [1024,2816]"], dgrad(1024, 2816))


if __name__ == "__main__":
    main()

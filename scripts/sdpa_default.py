"""Times PyTorch's scaled_dot_product_attention with no backend forced (what a user gets) for
GPT-2 shapes, causal, bf16 and fp32, forward and forward+backward; prints one JSON line each.
Usage: python3 scripts/sdpa_default.py [B H T D]"""
import json, sys, torch
import torch.nn.functional as F

B, H, T, D = ([int(a) for a in sys.argv[1:5]] + [16, 12, 1024, 64][len(sys.argv[1:5]):])


def bench(f, n=50):
    for _ in range(5): f()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n


for dt in (torch.bfloat16, torch.float32):
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, T, D, device="cuda", dtype=dt)
    fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    fb = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        torch.cuda.synchronize()
    kernels = sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    print(json.dumps({"sdpa": "default", "dtype": str(dt), "B": B, "H": H, "T": T, "D": D,
                      "fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(fb, 4), "kernels": kernels}))

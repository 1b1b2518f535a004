"""Times PyTorch's scaled_dot_product_attention with no backend forced (what a user gets) for
GPT-2 shapes, causal, bf16 and fp32, forward and forward+backward; prints one JSON line each.

The forward+backward is timed as BluTrain's FlashAttentionPerf test times its own: the inputs'
gradients are released before each backward (`x.grad = None`, what zero_grad(set_to_none=True)
does), so that no gradient-accumulation adds are counted. ../shared/peers/attention.py keeps the
gradients, so its fwd+bwd includes three `grad += new` kernels; both figures are printed
(`fwd_bwd_ms`, `fwd_bwd_accum_ms`). `kernels` lists each CUDA kernel of one forward+backward with
its time in microseconds (torch.profiler), so the two implementations can be compared piece by piece.
Usage: python3 scripts/sdpa_default.py [B H T D [HKV]] (HKV < H: grouped-query, enable_gqa=True)"""
import json, sys, torch
import torch.nn.functional as F

B, H, T, D = ([int(a) for a in sys.argv[1:5]] + [16, 12, 1024, 64][len(sys.argv[1:5]):])
HKV = int(sys.argv[5]) if len(sys.argv) > 5 else H


def bench(f, n=50):
    for _ in range(5): f()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n


for dt in (torch.bfloat16, torch.float32):
    q, k, v = (torch.randn(B, H if i == 0 else HKV, T, D, device="cuda", dtype=dt, requires_grad=True) for i in range(3))
    g = torch.randn(B, H, T, D, device="cuda", dtype=dt)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=HKV != H)

    def fwdbwd():
        q.grad = k.grad = v.grad = None
        fwd().backward(g)

    fwd_ms = bench(fwd)
    fb = bench(fwdbwd)
    fb_accum = bench(lambda: fwd().backward(g))  # gradients accumulate, as in attention.py
    q.grad = k.grad = v.grad = None
    fwdbwd()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fwdbwd()
        torch.cuda.synchronize()
    kernels = [[e.name[:70], round(e.time_range.elapsed_us(), 1)] for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    print(json.dumps({"sdpa": "default", "dtype": str(dt), "B": B, "H": H, "Hkv": HKV, "T": T, "D": D,
                      "fwd_ms": round(fwd_ms, 4), "fwd_bwd_ms": round(fb, 4), "fwd_bwd_accum_ms": round(fb_accum, 4),
                      "kernels_us": kernels}))

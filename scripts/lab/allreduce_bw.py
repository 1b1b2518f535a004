# NCCL all-reduce timing through PyTorch (torchrun --nproc_per_node N): isolated, on idle GPUs, for
# the sizes DDP's buckets have in GPT-2 124M (fp32 gradients). Prints one JSON line per size on rank 0.
import json, os, torch, torch.distributed as dist
dist.init_process_group("nccl")
r = dist.get_rank(); torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
for mib in (1, 25, 100, 147, 474):
    x = torch.randn(mib * 262144, device="cuda")
    for _ in range(3): dist.all_reduce(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10): dist.all_reduce(x)
    e.record(); torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 10
    n = dist.get_world_size()
    if r == 0:
        print(json.dumps({"mib": mib, "ms": round(ms, 3), "busbw_gbs": round(2 * (n - 1) / n * mib * 1.048576e6 / ms / 1e6, 1)}))
dist.destroy_process_group()

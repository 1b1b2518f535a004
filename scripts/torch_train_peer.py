"""PyTorch peer for `blutrain train` on real data: the same GPT-2 model as ../shared/peers/torch_gpt2.py
(imported from there), trained on the same llm.c token shards in the same order as BluTrain's
DataLoader without shuffling (window k·world + rank of B·T+1 tokens, shards in name order), with
BluTrain's defaults: AdamW (betas 0.9/0.95, eps 1e-8, weight decay on ≥2-d parameters), gradient
clipping at 1.0, linear warmup then cosine to --min-lr. At the end it prints one JSON line with the
validation loss over the first --val-batches windows of the val shards each rank reads (at most one
pass), averaged over the ranks as BluTrain's trainer does, so it can be compared with `blutrain
train ... --val-batches N` after the same number of steps.
Under torchrun it trains with DDP (B per GPU), like `blutrain launch -n N -- blutrain train --dp N`.

  python3 scripts/torch_train_peer.py --data-dir DIR --steps 200 -B 16 -T 1024 --mode bf16
  python3 -m torch.distributed.run --standalone --nproc_per_node 8 scripts/torch_train_peer.py ...
"""
import argparse, glob, json, math, os, sys, time

import numpy as np
import torch
import torch.distributed as dist

ap = argparse.ArgumentParser()
ap.add_argument("--data-dir", required=True)
ap.add_argument("--peers", default=os.environ.get("BLU_PEERS", os.path.join(os.path.dirname(__file__), "../../shared/peers")))
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("-B", type=int, default=16)
ap.add_argument("-T", type=int, default=1024)
ap.add_argument("--mode", default="bf16", choices=["fp32", "tf32", "bf16"])
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--min-lr", type=float, default=1e-4)
ap.add_argument("--warmup", type=int, default=20)
ap.add_argument("--val-batches", type=int, default=20)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run without a GPU (needs PyTorch >= 2.0: the peers model calls scaled_dot_product_attention; Debian 12 python3-torch 1.13 lacks it)")
a = ap.parse_args()
sys.path.insert(0, a.peers)
from torch_gpt2 import GPT  # noqa: E402  (the peers' model, not a copy)

WORLD, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def shard_tokens(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    if header[0] != 20240520 or header[1] != 1:
        sys.exit(f"{path}: not an llm.c token shard (magic {header[0]}, version {header[1]})")
    toks = np.fromfile(path, dtype=np.uint16, offset=1024)
    if len(toks) != header[2]:
        sys.exit(f"{path}: header says {header[2]} tokens, file holds {len(toks)}")
    return toks


def windows(pattern, B, T, rank, world):
    """BluTrain's DataLoader order (no shuffle): yields (x, y) int64 arrays [B, T] forever."""
    files = sorted(glob.glob(pattern))
    if not files:
        sys.exit(f"no shards match {pattern}")
    n = B * T
    while True:
        for f in files:
            toks = shard_tokens(f)
            for k in range((len(toks) - 1) // (n * world)):
                w = toks[(k * world + rank) * n:(k * world + rank) * n + n + 1].astype(np.int64)
                yield w[:-1].reshape(B, T), w[1:].reshape(B, T)


def lr_at(step):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    if step >= a.steps:
        return a.min_lr
    r = (step - a.warmup) / (a.steps - a.warmup)
    return a.min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (a.lr - a.min_lr)


if WORLD > 1:
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
dev = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if a.device == "cuda" else "cpu"
if a.device == "cuda":
    torch.cuda.set_device(dev)
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = a.mode == "tf32"
torch.manual_seed(a.seed)
model = GPT(T=a.T).to(dev)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if a.device == "cuda" else {}))
step_fn = model if WORLD == 1 else torch.nn.parallel.DistributedDataParallel(
    model, device_ids=[torch.cuda.current_device()] if a.device == "cuda" else None)
bf16 = a.mode == "bf16" and a.device == "cuda"
train = windows(os.path.join(a.data_dir, "*_train_*.bin"), a.B, a.T, RANK, WORLD)
t0 = time.perf_counter()
for step in range(a.steps):
    x, y = next(train)
    for g in opt.param_groups:
        g["lr"] = lr_at(step)
    with torch.autocast(a.device, dtype=torch.bfloat16, enabled=bf16):
        loss = step_fn(torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
if a.device == "cuda":
    torch.cuda.synchronize()
train_s = time.perf_counter() - t0
last = loss.item()
model.eval()
val_pattern = os.path.join(a.data_dir, "*_val_*.bin")
per_pass = sum((len(shard_tokens(f)) - 1) // (a.B * a.T * WORLD) for f in sorted(glob.glob(val_pattern)))
n_val = min(a.val_batches, per_pass)  # as BluTrain's evaluate: at most one pass
if n_val < 1:
    sys.exit(f"{val_pattern}: not one validation window of {a.B}x{a.T} tokens per rank")
val = windows(val_pattern, a.B, a.T, RANK, WORLD)
with torch.no_grad(), torch.autocast(a.device, dtype=torch.bfloat16, enabled=bf16):
    vals = [step_fn(torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)).item()
            for x, y in (next(val) for _ in range(n_val))]
val_loss = sum(vals) / len(vals)
if WORLD > 1:  # the mean over every rank's windows, as BluTrain's trainer reports it
    v = torch.tensor([val_loss], dtype=torch.float64, device=dev)
    dist.all_reduce(v)
    val_loss = v.item() / WORLD
if RANK == 0:
    print(json.dumps({"peer": "pytorch-" + torch.__version__, "mode": a.mode, "world": WORLD, "B": a.B, "T": a.T,
                      "steps": a.steps, "last_loss": round(last, 4), "val_loss": round(val_loss, 4), "val_batches": n_val * WORLD,
                      "train_s": round(train_s, 2), "tok_s": round(WORLD * a.B * a.T * a.steps / train_s)}))
if WORLD > 1:
    dist.destroy_process_group()

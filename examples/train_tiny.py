#!/usr/bin/env python3
"""Trains a tiny byte-level GPT from Python with the blutrain module, no notebook and no data
preparation: the bytes of a text file (this repository's README.md unless one is given) are the
tokens, batches are NumPy arrays handed to BluTrain through DLPack, and the optimizer's step runs the
forward and backward. It prints the loss as it falls and a sample, and exits non-zero when the loss
did not fall (ctest runs it as Examples.PythonTrainTiny).

    python3 examples/train_tiny.py [TEXT_FILE] [--steps N] [--device cpu|cuda]

with the module on the path (`PYTHONPATH=build/python`, or the build's python/ folder as the
first argument's sibling: see docs/python.md)."""
import argparse
import math
import os
import sys
import time

import numpy as np

here = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("text", nargs="?", default=os.path.join(here, "..", "README.md"))
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--device", default="cpu")
ap.add_argument("--module-dir", default=os.environ.get("BLUTRAIN_PYTHON", ""),
                help="the folder holding the built module (default: PYTHONPATH)")
args = ap.parse_args()
if args.module_dir:
    sys.path.insert(0, args.module_dir)
import blutrain as bt  # noqa: E402

data = np.frombuffer(open(args.text, "rb").read(), dtype=np.uint8).astype(np.int32)
split = int(len(data) * 0.9)
train, val = data[:split], data[split:]
B, T = 8, 64
rng = np.random.default_rng(0)


def batch(src):
    starts = rng.integers(0, len(src) - T - 1, size=B)
    x = np.stack([src[s:s + T] for s in starts])
    y = np.stack([src[s + 1:s + T + 1] for s in starts])
    # DLPack: the arrays' memory becomes BluTrain tensors (moved to the device when asked).
    tx, ty = bt.from_dlpack(x), bt.from_dlpack(y)
    return (tx.to(args.device), ty.to(args.device)) if args.device != "cpu" else (tx, ty)


model = bt.build_model("gpt2:demo-byte", seed=1, device=args.device)  # 256 bytes + end-of-text
opt = bt.Optimizer(model, lr=2e-3, weight_decay=0.1)
print(f"{model.num_parameters():,} parameters on {args.device}; {len(train):,} training bytes of {args.text}")


def val_loss():
    model.eval()
    losses = [model.loss(*batch(val)).item() for _ in range(8)]
    model.train()
    return sum(losses) / len(losses)


first_val = val_loss()
t0 = time.time()
for step in range(1, args.steps + 1):
    x, y = batch(train)
    lr = 2e-3 * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
    loss = opt.step(lambda i: model.loss(x, y), lr=lr)["loss"]
    if step % 25 == 0 or step == 1:
        print(f"step {step:4d}  loss {loss:.4f}  lr {lr:.2e}  {(time.time() - t0) / step * 1e3:.0f} ms/step")
last_val = val_loss()
model.eval()
prompt = list(b"The ")
sample = bytes(t for t in model.generate(prompt, 120, temperature=0.8, seed=7) if t < 256)
print(f"validation loss {first_val:.3f} -> {last_val:.3f} (uniform over bytes: {math.log(256):.3f})")
print("sample:", (bytes(prompt) + sample).decode("utf-8", "replace"))
if not last_val < first_val - 1.0:
    sys.exit(f"train_tiny: the validation loss did not fall by a nat ({first_val:.3f} -> {last_val:.3f})")

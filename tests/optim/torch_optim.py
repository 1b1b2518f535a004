"""PyTorch side of tests/optim/optim_oracle_test.cpp: runs torch.optim.AdamW / SGD (single-tensor
path, foreach=False) over the parameters, per-step gradients and learning rates it is given, and
torch.nn.utils.clip_grad_norm_ over given gradients.

Inputs: "<case>.p.<name>" initial parameters, "<case>.g<step>.<name>" the gradient of <name> at
<step> (absent: no gradient that step). Outputs: "<case>.p<step>.<name>" parameters after <step>;
for clip cases "<case>.norm" and "<case>.g.<name>" (gradients after clipping)."""
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/common")
import st_py  # noqa: E402


def run_optim(case, tensors, results):
    cid = case["id"]
    params = {}
    groups = []
    for g in case["groups"]:
        ps = []
        for name in g["params"]:
            params[name] = tensors[f"{cid}.p.{name}"].clone().requires_grad_(True)
            ps.append(params[name])
        groups.append({"params": ps, "weight_decay": g["weight_decay"]})
    lrs = case["lr"]
    if case["opt"] == "adamw":
        opt = torch.optim.AdamW(groups, lr=lrs[0], betas=(case["beta1"], case["beta2"]), eps=case["eps"],
                                foreach=False)
    else:
        opt = torch.optim.SGD(groups, lr=lrs[0], momentum=case["momentum"], nesterov=case["nesterov"],
                              foreach=False)
    for step in range(case["steps"]):
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        for name, p in params.items():
            g = tensors.get(f"{cid}.g{step}.{name}")
            p.grad = None if g is None else g.clone()
        opt.step()
        for name, p in params.items():
            results[f"{cid}.p{step}.{name}"] = p.detach().clone()


def run_clip(case, tensors, results):
    cid = case["id"]
    params = []
    for name in case["names"]:
        p = torch.zeros_like(tensors[f"{cid}.g.{name}"], requires_grad=True)
        p.grad = tensors[f"{cid}.g.{name}"].clone()
        params.append((name, p))
    norm = torch.nn.utils.clip_grad_norm_([p for _, p in params], case["max_norm"])
    results[f"{cid}.norm"] = norm.detach().to(torch.float64).reshape([])
    for name, p in params:
        results[f"{cid}.g.{name}"] = p.grad.clone()


def main(inputs_path, manifest_path, out_path):
    tensors = st_py.read(inputs_path)
    manifest = json.load(open(manifest_path))
    results = {}
    for case in manifest["optim"]:
        run_optim(case, tensors, results)
    for case in manifest["clip"]:
        run_clip(case, tensors, results)
    st_py.write(out_path, results)


if __name__ == "__main__":
    main(*sys.argv[1:4])

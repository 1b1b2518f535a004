"""PyTorch side of tests/ops/oracle_test.cpp: evaluates each case's expression on its inputs,
back-propagates the given upstream gradient, and writes outputs and input gradients."""
import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/common")
import st_py  # noqa: E402


def main(inputs_path, manifest_path, out_path):
    tensors = st_py.read(inputs_path)
    manifest = json.load(open(manifest_path))
    results = {}
    for case in manifest:
        cid = case["id"]
        env = {"torch": torch, "F": F}
        for i in range(case["n_inputs"]):
            key = f"{cid}_x{i}"
            x = tensors.get(key)
            if x is not None:
                x = x.clone()
                if i in case["grad_inputs"]:
                    x.requires_grad_(True)
            env[f"x{i}"] = x
        out = eval(case["expr"], env)
        results[f"{cid}_out"] = out.detach().contiguous()
        if case["grad_inputs"]:
            out.backward(tensors[f"{cid}_r"])
            for i in case["grad_inputs"]:
                g = env[f"x{i}"].grad
                results[f"{cid}_g{i}"] = (g if g is not None else torch.zeros_like(env[f"x{i}"])).contiguous()
    st_py.write(out_path, results)


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""PyTorch side of tests/core/dtype_test.cpp: casts float32 values to bfloat16 and float16 and
back, and widens every 16-bit pattern to float32, so the C++ conversions can be compared bit for bit."""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/common")
import st_py  # noqa: E402


def main(inputs_path, _manifest_path, out_path):
    t = st_py.read(inputs_path)
    x = t["x"]
    bf, hf = x.to(torch.bfloat16), x.to(torch.float16)
    st_py.write(out_path, {
        "bf16": bf,
        "f16": hf,
        "bf16_f32": bf.to(torch.float32),
        "f16_f32": hf.to(torch.float32),
        "all_bf16_f32": t["all_bf16"].to(torch.float32),
        "all_f16_f32": t["all_f16"].to(torch.float32),
    })


if __name__ == "__main__":
    main(*sys.argv[1:4])

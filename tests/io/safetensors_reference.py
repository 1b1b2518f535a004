"""PyTorch side of tests/io/safetensors_test.cpp (the PyOracle tests).

    safetensors_reference.py write PATH    writes the fixed tensor set below with st_py
    safetensors_reference.py verify PATH   reads PATH with st_py, compares with the fixed set
                                           value by value (bitwise), exits 1 on any difference

The fixed set is built the same way on the C++ side (make_fixture in safetensors_test.cpp):
keep the two in step.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
import st_py  # noqa: E402

METADATA = {"format": "pt", "note": "blu \u00fcn\u00efcode"}


def fixture():
    f32 = lambda vals: torch.tensor(vals, dtype=torch.float32)  # noqa: E731
    return {
        "w.f32": f32([i * 0.5 - 1.25 for i in range(6)]).reshape(2, 3),
        "w.f64": torch.tensor([(i + 1) / 7 for i in range(3)], dtype=torch.float64),
        # double -> float -> bf16 / f16, rounding to nearest-even at each step
        "w.bf16": f32([(i + 1) / 3 for i in range(4)]).to(torch.bfloat16),
        "w.f16": f32([(i - 1.7) * 3.1 for i in range(4)]).to(torch.float16).reshape(2, 2),
        "i.i32": torch.tensor([i * i - 7 for i in range(5)], dtype=torch.int32),
        "i.i64": torch.tensor([-(1 << 40), (1 << 62) + 5], dtype=torch.int64),
        "u.u8": torch.tensor([(i * 50) % 256 for i in range(6)], dtype=torch.uint8),
        "b.bool": torch.tensor([True, False, True]),
        "e.empty": torch.empty(0, 4, dtype=torch.float32),
        "s.scalar": torch.tensor(42.5, dtype=torch.float32),
    }


def same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}.get(a.dtype)
    if view is not None:
        a, b = a.contiguous().view(view), b.contiguous().view(view)
    return bool(torch.equal(a, b))


def main():
    cmd, path = sys.argv[1], sys.argv[2]
    want = fixture()
    if cmd == "write":
        st_py.write(path, want, METADATA)
        return 0
    if cmd == "verify":
        got = st_py.read(path)
        meta = st_py.read_metadata(path)
        bad = []
        if set(got) != set(want):
            bad.append(f"names: got {sorted(got)}, expected {sorted(want)}")
        for name in sorted(set(got) & set(want)):
            if not same_bits(got[name], want[name]):
                bad.append(f"{name}: got {got[name].dtype} {tuple(got[name].shape)} {got[name].tolist()}, "
                           f"expected {want[name].dtype} {tuple(want[name].shape)} {want[name].tolist()}")
        if meta != METADATA:
            bad.append(f"metadata: got {meta}, expected {METADATA}")
        # Our layout must be the reference layout: re-serializing gives the same bytes.
        with open(path, "rb") as f:
            if f.read() != st_py.serialize(want, METADATA):
                bad.append("file bytes differ from st_py.serialize of the same tensors")
        for line in bad:
            print("MISMATCH", line)
        return 1 if bad else 0
    print(f"unknown command {cmd!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

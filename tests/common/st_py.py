"""st_py: a minimal safetensors reader/writer for test oracles that exchange tensors with PyTorch.

Needs only the standard library and torch (no `safetensors` package, no numpy for bf16). Files it
writes follow the same layout as the reference writer and as blu::SafeTensorsWriter: tensors
sorted by the reference's dtype order descending then by name, compact JSON header padded with
spaces to a multiple of 8 bytes. The reader checks the structural rules (header bounds, offsets
tiling the data section exactly, sizes matching shape x dtype).

    import st_py
    st_py.write(path, {"w": torch.randn(2, 3, dtype=torch.bfloat16)}, metadata={"step": "10"})
    tensors = st_py.read(path)            # dict[name, torch.Tensor]
    meta = st_py.read_metadata(path)      # dict[str, str]
"""
import json
import math
import struct
import sys

import torch

MAX_HEADER_BYTES = 100_000_000

# safetensors name -> (torch dtype, bytes per element, rank in the reference's Dtype enum).
# The reference writer sorts by that rank, descending (so I64 before F64, BF16 before F16).
_DTYPES = {
    "BOOL": (torch.bool, 1, 0),
    "U8": (torch.uint8, 1, 1),
    "I8": (torch.int8, 1, 2),
    "I16": (torch.int16, 2, 5),
    "F16": (torch.float16, 2, 7),
    "BF16": (torch.bfloat16, 2, 8),
    "I32": (torch.int32, 4, 9),
    "F32": (torch.float32, 4, 11),
    "F64": (torch.float64, 8, 12),
    "I64": (torch.int64, 8, 13),
}
_NAME_OF = {v[0]: k for k, v in _DTYPES.items()}

# Same-size dtypes that .numpy() understands, to get raw bytes out of any tensor.
_BYTES_VIEW = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}

assert sys.byteorder == "little", "safetensors data is little-endian; st_py assumes a little-endian host"


def _fail(path, msg):
    raise ValueError(f"safetensors {path}: {msg}")


def _parse(buf, path):
    if len(buf) < 8:
        _fail(path, f"file is {len(buf)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER_BYTES:
        _fail(path, f"header length {n} exceeds {MAX_HEADER_BYTES}")
    if 8 + n > len(buf):
        _fail(path, f"header length {n} runs past the end of the file")
    text = bytes(buf[8 : 8 + n]).decode("utf-8")  # raises on invalid UTF-8
    if not text.startswith("{"):
        _fail(path, "header must start with '{'")

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(keys) != len(set(keys)):
            _fail(path, f"duplicate keys in header: {keys}")
        return dict(pairs)

    header = json.loads(text, object_pairs_hook=no_duplicates)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        _fail(path, "__metadata__ must be a map of strings")
    entries = []
    for name, info in header.items():
        if set(info) != {"dtype", "shape", "data_offsets"}:
            _fail(path, f"tensor {name!r}: fields {sorted(info)}, expected dtype, shape, data_offsets")
        if info["dtype"] not in _DTYPES:
            _fail(path, f"tensor {name!r}: unsupported dtype {info['dtype']!r}")
        shape = info["shape"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            _fail(path, f"tensor {name!r}: bad shape {shape}")
        begin, end = info["data_offsets"]
        size = _DTYPES[info["dtype"]][1]
        if end - begin != math.prod(shape) * size:
            _fail(path, f"tensor {name!r}: shape {shape} x {info['dtype']} != data_offsets [{begin}, {end}]")
        entries.append((begin, end, name, info["dtype"], shape))
    entries.sort()
    pos = 0
    for begin, end, name, _, _ in entries:
        if begin != pos:
            _fail(path, f"tensor {name!r}: data_offsets begin {begin}, expected {pos} (gap or overlap)")
        pos = end
    if pos != len(buf) - 8 - n:
        _fail(path, f"tensors cover {pos} bytes of a {len(buf) - 8 - n}-byte data section")
    return 8 + n, entries, metadata


def read(path):
    """Returns dict[name, torch.Tensor] (CPU, contiguous, owning its memory)."""
    with open(path, "rb") as f:
        buf = bytearray(f.read())
    start, entries, _ = _parse(buf, path)
    out = {}
    for begin, end, name, dt, shape in entries:
        dtype = _DTYPES[dt][0]
        if end == begin:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            chunk = bytearray(buf[start + begin : start + end])  # own copy: frombuffer shares memory
            out[name] = torch.frombuffer(chunk, dtype=dtype).reshape(shape)
    return out


def read_metadata(path):
    with open(path, "rb") as f:
        return _parse(bytearray(f.read()), path)[2]


def _tensor_bytes(t):
    t = t.detach().cpu().contiguous()
    view = _BYTES_VIEW.get(t.dtype)
    if view is not None:
        t = t.view(view) if t.dtype != torch.bool else t.to(view)
    return t.numpy().tobytes()


def serialize(tensors, metadata=None):
    """The file's bytes for dict[name, torch.Tensor] (+ optional dict[str, str] metadata)."""
    items = []
    for name, t in tensors.items():
        if t.dtype not in _NAME_OF:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name here")
        dt = _NAME_OF[t.dtype]
        items.append((-_DTYPES[dt][2], name.encode("utf-8"), name, dt, list(t.shape), _tensor_bytes(t)))
    items.sort(key=lambda x: (x[0], x[1]))
    header = {}
    if metadata:
        header["__metadata__"] = {k: str(metadata[k]) for k in sorted(metadata)}
    offset = 0
    for _, _, name, dt, shape, data in items:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(x[5] for x in items)


def write(path, tensors, metadata=None):
    with open(path, "wb") as f:
        f.write(serialize(tensors, metadata))

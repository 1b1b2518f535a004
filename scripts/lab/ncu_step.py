"""Where one training step's GPU time goes, kernel by kernel, from an ncu trace of a `blutrain bench`
run (`gpu_run.sh kernels` makes one per model: `ncu --graph-profiling node --cache-control none
--clock-control none --metrics gpu__time_duration.sum,dram__bytes.sum --csv --print-units base`).
Each kernel runs alone under ncu, so the sum is the step without overlap or launch gaps; the
compiled step's CUDA graphs are profiled node by node. The step is the last one in the trace: the
kernels after the second-to-last group of AdamW launches up to and including the last group.
Prints a table by category (launches, ms, share, DRAM GB) and the `top` (default 25) kernels.
Usage: python3 scripts/lab/ncu_step.py trace.csv[.gz] [top]"""
import collections
import csv
import gzip
import re
import sys


def short(name):
    # A column sum taken by another kernel's rows (colsum.cuh) keeps the row functor's name.
    rows = re.search(r"colsum_partial_kernel<[^,]*, blu::(?:<unnamed>::)?(\w+)<", name)
    suffix = "" if not rows or rows.group(1) == "ColsumLoad" else "/" + rows.group(1)
    name = re.sub(r"\(.*", "", name.replace("void ", "", 1))
    while re.search(r"<[^<>]*>", name):
        name = re.sub(r"<[^<>]*>", "", name)
    name = name.replace("blu::", "").replace("(anonymous namespace)::", "").replace("cuda::", "")
    while "::::" in name:
        name = name.replace("::::", "::")
    return (name.lstrip(":") + suffix)[:70]


def category(s):
    if s.startswith("nvjet") or "splitKreduce" in s or "gemm" in s.lower():
        return "GEMMs (cuBLASLt)"
    if s.startswith("flash"):
        return "attention"
    if "adamw" in s or "sum_squares" in s:
        return "AdamW, gradient norm"
    if "layer_norm" in s or "rms_norm" in s:
        return "norms"
    if "cross_entropy" in s or "count_targets" in s:
        return "loss"
    if "Gelu" in s:
        return "GELU, SwiGLU, rotary, adds"
    if "colsum" in s or "reduce_" in s or "sum_leading" in s:
        return "bias and embedding sums"
    if "embedding" in s or "Radix" in s or "philox" in s:
        return "embedding"
    if "gelu" in s or "swiglu" in s or "rotary" in s or s.startswith("map_"):
        return "GELU, SwiGLU, rotary, adds"
    if "memset" in s:
        return "small memsets (graph nodes as kernels)"
    return "other"


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        lines = [line for line in f if line.startswith('"')]
    kernels = {}
    for r in csv.DictReader(lines):
        k = kernels.setdefault(int(r["ID"]), {"name": short(r["Kernel Name"]), "grid": r["Grid Size"]})
        k[r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
    ids = sorted(kernels)
    adam = [j for j, i in enumerate(ids) if "adamw" in kernels[i]["name"]]
    # Groups of consecutive AdamW launches end the steps.
    ends = [j for n, j in enumerate(adam) if n + 1 == len(adam) or adam[n + 1] != j + 1]
    if len(ends) < 2:
        sys.exit(f"{path}: fewer than two optimizer steps in the trace")
    step = [kernels[i] for i in ids[ends[-2] + 1 : ends[-1] + 1]]
    cats = collections.defaultdict(lambda: [0, 0.0, 0.0])
    per = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k in step:
        ms, gb = k.get("gpu__time_duration.sum", 0) / 1e6, k.get("dram__bytes.sum", 0) / 1e9
        for d, key in ((cats, category(k["name"])), (per, k["name"])):
            d[key][0] += 1
            d[key][1] += ms
            d[key][2] += gb
    total = sum(v[1] for v in cats.values())
    print("| category | launches | ms | share | DRAM GB |\n|---|---|---|---|---|")
    for c, (n, ms, gb) in sorted(cats.items(), key=lambda x: -x[1][1]):
        print(f"| {c} | {n} | {ms:.2f} | {100 * ms / total:.0f}% | {gb:.1f} |")
    print(f"| all | {len(step)} | {total:.2f} | | {sum(v[2] for v in cats.values()):.1f} |\n")
    print(f"{'ms':>8} {'launches':>8} {'GB':>7} {'GB/s':>6}  kernel")
    for name, (n, ms, gb) in sorted(per.items(), key=lambda x: -x[1][1])[:top]:
        print(f"{ms:8.3f} {n:8d} {gb:7.3f} {gb / ms * 1e3 if ms else 0:6.0f}  {name}")


if __name__ == "__main__":
    main()

"""The figures of a `gpu_run.sh compiledab` log, as they are quoted in docs/performance.md: per model
and variant the runs' tok/s, their median, the median against the first variant's, each pair's
sign (is the variant ahead in every alternation?), the peak, and the median against the
torch.compile peer of the same call (its JSON line: GPT-2 without "model", Llama with it) with the
peak's ratio.
Usage: python3 scripts/ab_summary.py compiledab.log"""
import json
import statistics
import sys


def main():
    runs = {}  # (model, variant) -> [(tok_s, peak_mib)], in the log's order
    order = []
    peers = {}
    for line in open(sys.argv[1]):
        line = line.strip()
        if line.startswith("{"):
            d = json.loads(line)
            peers["llama" if "model" in d else "gpt2"] = d
            continue
        f = line.split()
        if len(f) < 5 or not f[2].isdigit():
            continue  # timelines, power samples
        key = (f[0], f[1])
        if key not in runs:
            order.append(key)
        runs.setdefault(key, []).append((int(f[2]), int(f[4])))
    for model in dict.fromkeys(m for m, _ in order):
        variants = [v for m, v in order if m == model]
        base = [t for t, _ in runs[(model, variants[0])]]
        peer = peers.get(model)
        for v in variants:
            toks = [t for t, _ in runs[(model, v)]]
            med = statistics.median(toks)
            line = f"{model} {v}: {' / '.join(f'{t:,}' for t in toks)}  median {med:,.0f}"
            if v != variants[0]:
                ahead = sum(a > b for a, b in zip(toks, base))
                line += f"  {100 * (med / statistics.median(base) - 1):+.1f}% ({ahead} of {min(len(toks), len(base))} pairs ahead)"
            peak = runs[(model, v)][-1][1]
            line += f"  peak {peak:,} MiB"
            if peer:
                line += f"  {med / peer['tok_s']:.2f}x torch.compile ({peer['tok_s']:,}), memory {peak / peer['peak_alloc_mib']:.2f}x"
            print(line)


if __name__ == "__main__":
    main()

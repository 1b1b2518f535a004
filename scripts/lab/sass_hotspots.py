"""Reads the per-instruction SASS page that `gpu_run.sh attnsass` writes (ncu --page source --csv
--print-source sass): how many warp-instructions the kernel executed, split by how often each line
ran (a loop body's lines share one count: a tile loop's count is tiles × warps), the opcode mix of
the most executed block, the stall samples by reason, and the instructions with the most samples.
Usage: python3 scripts/lab/sass_hotspots.py sass_bwd_wgmma.csv [--top N] [--list COUNT]
(--list prints every line that ran COUNT times, in address order, with its top stall reasons)."""
import argparse, collections, csv, re, sys

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--top", type=int, default=20)
ap.add_argument("--list", type=int, default=None)
args = ap.parse_args()

with open(args.csv, newline="") as f:
    rows = [r for r in csv.reader(f)]
header_at = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
if header_at is None:
    sys.exit(f"{args.csv}: no 'Address' header row (not an ncu source page in CSV)")
hdr, data = rows[header_at], [r for r in rows[header_at + 1:] if len(r) == len(rows[header_at])]
col = {name: i for i, name in enumerate(hdr)}
for need in ("Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"):
    if need not in col:
        sys.exit(f"{args.csv}: column '{need}' missing (got {', '.join(hdr[:8])}, ...)")
reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]


def num(r, name):
    v = r[col[name]].replace(",", "")
    return int(float(v)) if v else 0


def opcode(src):
    parts = re.sub(r"^@!?U?P\w+\s+", "", src.strip()).split()
    return parts[0].split(".")[0] if parts else ""


lines = []
for r in data:
    stalls = {x[len("stall_"):]: num(r, x) for x in reasons}
    lines.append((r[col["Address"]], num(r, "Instructions Executed"), num(r, "Warp Stall Sampling (All Samples)"),
                  r[col["Source"]].strip(), stalls))

total = sum(n for _, n, _, _, _ in lines)
samples = collections.Counter()
for *_, st in lines:
    samples.update(st)
n_samples = sum(samples.values()) or 1
by_count = collections.Counter()
for _, n, *_ in lines:
    by_count[n] += n
print(f"{args.csv}: {total:,} warp-instructions, {n_samples:,} stall samples")
print("most executed blocks (lines that ran N times: N, lines, share of all instructions):")
for n, tot in by_count.most_common(6):
    k = sum(1 for _, c, *_ in lines if c == n)
    print(f"  {n:>10,} x {k:4d} lines  {100 * tot / max(total, 1):5.1f}%")
hot = by_count.most_common(1)[0][0] if by_count else 0
mix = collections.Counter(opcode(s) for _, n, _, s, _ in lines if n == hot)
print(f"opcodes of the block that ran {hot:,} times:", ", ".join(f"{o} {c}" for o, c in mix.most_common(14)))
print("stall samples by reason:", ", ".join(f"{k} {100 * v / n_samples:.1f}%" for k, v in samples.most_common(9)))
print(f"top {args.top} instructions by samples:")
for addr, n, s, src, st in sorted(lines, key=lambda x: -x[2])[: args.top]:
    why = " ".join(f"{k}:{v}" for k, v in sorted(st.items(), key=lambda kv: -kv[1])[:2] if v)
    print(f"  {addr[-6:]} {n:>10,} {s:6d}  {src[:60]:60s} {why}")
if args.list is not None:
    for addr, n, s, src, st in lines:
        if n == args.list:
            why = " ".join(f"{k}:{v}" for k, v in sorted(st.items(), key=lambda kv: -kv[1])[:2] if v)
            print(f"  {addr[-6:]} {s:6d}  {src[:70]:70s} {why}")

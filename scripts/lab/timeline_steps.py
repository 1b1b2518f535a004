"""Where a timed training step's wall time goes, from a kernel timeline of a `blutrain bench` run
(scripts/lab/kernel_timeline.cpp: rows kind,start_ns,end_ns,stream,name). A step ends with its
AdamW launches; it spans from the first GPU activity after the previous step's last AdamW kernel
to its own last one. Per step: the span, the time some kernel or copy runs (busy), the rest (gaps
between them), and how many; then, over the steps after the first `skip`, the median of each, the
kernel time by category (scripts/lab/ncu_step.py's), and the largest gaps with the kernels on
either side. Usage: python3 scripts/lab/timeline_steps.py timeline.csv[.gz] [skip=4] [top=15]"""
import collections
import gzip
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_step import category, short  # noqa: E402


def read(path):
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt") as f:
        for line in f:
            parts = line.rstrip("\n").split(",", 4)
            if len(parts) < 5:
                continue
            kind, start, end, _stream, what = parts
            name = short(what.replace("(anonymous namespace)::", "")) if kind == "K" else {"C": "memcpy", "S": "memset"}[kind]
            rows.append((int(start), int(end), name))
    rows.sort()
    return rows


def steps_of(rows):
    # Indices of the last AdamW kernel of each group of consecutive AdamW launches.
    ends = []
    for i, (_, _, name) in enumerate(rows):
        if "adamw" in name and (i + 1 == len(rows) or "adamw" not in rows[i + 1][2]):
            ends.append(i)
    out, first = [], 0
    for e in ends:
        out.append(rows[first:e + 1])
        first = e + 1
    return out


def analyse(step):
    span = step[-1][1] - step[0][0]
    busy, gaps, cursor = 0, [], step[0][0]
    for i, (s, e, name) in enumerate(step):
        if s > cursor:
            gaps.append((s - cursor, step[i - 1][2] if i else "-", name))
        busy += max(0, e - max(s, cursor))
        cursor = max(cursor, e)
    return span, busy, gaps


def main():
    path = sys.argv[1]
    skip = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    steps = steps_of(read(path))
    print(f"{len(steps)} steps; per step: span ms, busy ms, gaps ms (count), launches")
    spans, busys, cats, all_gaps = [], [], collections.Counter(), []
    for k, st in enumerate(steps):
        span, busy, gaps = analyse(st)
        print(f"  step {k}: {span / 1e6:7.3f} {busy / 1e6:7.3f} {(span - busy) / 1e6:6.3f} ({len(gaps)}) {len(st)}")
        if k < skip:
            continue
        spans.append(span)
        busys.append(busy)
        for s, e, name in st:
            cats[category(name)] += e - s
        all_gaps.extend(gaps)
    if not spans:
        return
    n = len(spans)
    span, busy = statistics.median(spans), statistics.median(busys)
    print(f"median of steps {skip}..: span {span / 1e6:.3f} ms, busy {busy / 1e6:.3f}, gaps {(span - busy) / 1e6:.3f}")
    print("kernel time by category (ms a step):")
    for c, t in cats.most_common():
        print(f"  {t / n / 1e6:7.3f}  {c}")
    by_pair = collections.defaultdict(lambda: [0, 0])
    for g, before, after in all_gaps:
        key = (category(before), category(after))
        by_pair[key][0] += g
        by_pair[key][1] += 1
    print("gaps by the categories on either side (µs a step, count a step):")
    for (b, a), (g, c) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {g / n / 1e3:8.1f} {c / n:6.1f}  {b} -> {a}")
    print("largest gaps (µs):")
    for g, before, after in sorted(all_gaps, reverse=True)[:top]:
        print(f"  {g / 1e3:8.1f}  {before} -> {after}")


if __name__ == "__main__":
    main()

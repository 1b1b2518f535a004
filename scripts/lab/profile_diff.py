#!/usr/bin/env python3
"""Compares the `profile` of two `blutrain bench --profile` JSON lines (device time per op name of
one step: an event after every op on the compute stream, no synchronisation, so ops running beside
collectives show their slowdown), e.g. one GPU against rank 0 of DDP: each op's time in both,
sorted by how much it grew, and the sums.

    python3 scripts/lab/profile_diff.py base.json other.json [rows]
"""
import json
import sys


def load(path: str) -> tuple:
    with open(path) as f:
        line = next(l for l in f if '"profile"' in l)
    d = json.loads(line)
    p = d["profile"]
    return {o["op"]: (o["ms"], o["calls"]) for o in p["ops"]}, p["sum_ms"], d.get("tok_s")


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    (base, sb, tb), (other, so, to) = load(sys.argv[1]), load(sys.argv[2])
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    keys = sorted(set(base) | set(other), key=lambda k: other.get(k, (0, 0))[0] - base.get(k, (0, 0))[0], reverse=True)
    print(f"{sys.argv[1]} -> {sys.argv[2]}: op sum {sb:.2f} -> {so:.2f} ms ({so - sb:+.2f}); tok/s {tb} -> {to}")
    print(f"{'op':34} {'base ms':>8} {'n':>5} {'other ms':>8} {'n':>5} {'grew ms':>8}")
    for k in keys[:rows]:
        (b, bn), (o, on) = base.get(k, (0, 0)), other.get(k, (0, 0))
        print(f"{k:34} {b:8.3f} {bn:5d} {o:8.3f} {on:5d} {o - b:+8.3f}")
    print(f"... and the ops that shrank most: " + ", ".join(
        f"{k} {other.get(k, (0, 0))[0] - base.get(k, (0, 0))[0]:+.3f}" for k in keys[-3:]))


if __name__ == "__main__":
    main()

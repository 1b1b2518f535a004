"""Summarises an `ncu --csv --metrics gpu__time_duration.sum` report: per kernel (name and grid),
the number of launches and the mean and minimum duration in microseconds, in launch order of first
appearance. Usage: python3 scripts/lab/ncu_summary.py report.csv"""
import csv, sys

SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
rows = {}
with open(sys.argv[1], newline="") as f:
    lines = [line for line in f if line.startswith('"')]  # skip ncu's own ==PROF== lines
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    us = float(r["Metric Value"].replace(",", "")) * SCALE[r["Metric Unit"]]
    key = (r["Kernel Name"][:90], r["Grid Size"])
    rows.setdefault(key, []).append(us)
if not rows:
    sys.exit(f"{sys.argv[1]}: no gpu__time_duration.sum rows")
print(f"{'launches':>8} {'mean us':>9} {'min us':>9}  grid / kernel")
for (name, grid), v in rows.items():
    print(f"{len(v):8d} {sum(v) / len(v):9.1f} {min(v):9.1f}  {grid} {name}")

#!/usr/bin/env bash
# Bench variants (as gpu_run.sh variants: "ENV=V ... | bench args;...") with nvidia-smi sampling
# every 50 ms: per run, GPU 0's median SM clock and power while it is busy (utilisation > 50%), and
# the share of samples with a power-cap clock event. Run after `source scripts/gpu_run.sh`.
set -uo pipefail
pack="${pack:-/tmp/blupack}"
IFS=';' read -ra runs <<< "${VARIANTS:-}"
for v in "${runs[@]}"; do
  envs="${v%%|*}"; args="${v#*|}"
  n=$(sed -n 's/.*--dp \([0-9]*\).*/\1/p' <<< "$args"); n="${n:-1}"
  if [ "$n" = 1 ]; then cmd=("$pack/blutrain"); else cmd=("$pack/blutrain" launch -n "$n" -- "$pack/blutrain"); fi
  nvidia-smi --query-gpu=index,utilization.gpu,clocks.sm,power.draw,clocks_event_reasons.sw_power_cap \
    --format=csv,noheader,nounits -lms 50 > /tmp/smi.csv &
  smi=$!
  line=$(env $envs timeout 200 "${cmd[@]}" bench --device cuda --precision "${MODE:-bf16}" -B "${B:-16}" \
    -T "${T:-1024}" --steps "${STEPS:-40}" $args 2>&1 | grep -E '^\{|^\[rank 0\] \{' | tail -1)
  kill $smi; wait $smi 2>/dev/null
  python3 - "$v" "$line" <<'PY'
import json, statistics, sys
v, line = sys.argv[1], sys.argv[2]
j = json.loads(line[line.index('{'):]) if '{' in line else {}
rows = [r.split(', ') for r in open('/tmp/smi.csv') if r.count(',') >= 4]
busy = [r for r in rows if r[0] == '0' and r[1].strip().isdigit() and int(r[1]) > 50]
clk = statistics.median(float(r[2]) for r in busy) if busy else 0
pw = statistics.median(float(r[3]) for r in busy) if busy else 0
cap = sum('Active' in r[4] for r in busy) / max(len(busy), 1)
print(f"{v.strip():60s} tok_s {j.get('tok_s')} fwd_bwd {j.get('phases_ms', {}).get('fwd_bwd')} "
      f"wait {j.get('phases_ms', {}).get('comm_wait')} | GPU0 busy samples {len(busy)}: SM {clk:.0f} MHz, "
      f"{pw:.0f} W, power-capped {cap:.0%}")
PY
done

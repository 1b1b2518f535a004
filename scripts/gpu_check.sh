#!/usr/bin/env bash
# The GPU checks in one command, on the GPU machine (device tool), from the repo root with .devpack
# carried (scripts/gpu_pack.sh): the whole CUDA test binary, then bf16 training steps of GPT-2 124M
# (B=16, T=1024) and Llama llama-250m (B=8, T=1024), each repeated REPS times (3) beside its
# PyTorch peer (eager and torch.compile) in the same run. Fails (exit 1, "ok": false in the summary)
# when a test fails, or when a benchmark's best tok/s falls below the reference recorded for this
# GPU kind in scripts/gpu_reference.json by more than its run-to-run spread. Prints one JSON summary
# line, with the test binary's summary lines in "tests".
#   bash scripts/gpu_check.sh            # OUT=<dir> keeps the logs
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/out}"
mkdir -p "$out"
status=0
TEST_TAIL=30 bash scripts/gpu_run.sh tests | tee "$out/check_tests.log"
grep -qE "^\[  PASSED  \]" "$out/test_cuda.log" && ! grep -qE "^\[  FAILED  \]" "$out/test_cuda.log" || status=1
tests_ok=$([ "$status" = 0 ] && echo true || echo false)
pack=/tmp/blupack
export LD_LIBRARY_PATH="$pack:${LD_LIBRARY_PATH:-}"
reps="${REPS:-3}"
: > "$out/check_bench.log"
for i in $(seq "$reps"); do
  timeout 150 "$pack/blutrain" bench --device cuda --model gpt2:d12 --precision bf16 -B 16 -T 1024 --steps 20 2>&1 \
    | grep '^{' >> "$out/check_bench.log"
  timeout 200 "$pack/blutrain" bench --device cuda --model llama:llama-250m --precision bf16 -B 8 -T 1024 --steps 20 --lr 3e-4 --beta2 0.95 \
    2>&1 | grep '^{' >> "$out/check_bench.log"
done
timeout 300 python3 .devpack/peers/torch_gpt2.py bf16,bf16c 16 1024 20 2>&1 | grep '^{' >> "$out/check_bench.log"
timeout 400 python3 .devpack/peers/torch_llama.py bf16,bf16c --model llama-250m -B 8 -T 1024 --steps 20 2>&1 \
  | grep '^{' >> "$out/check_bench.log"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
python3 - "$out/check_bench.log" "$gpu" scripts/gpu_reference.json "$out/test_cuda.log" "$tests_ok" <<'PY' || status=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
gpu, ref = sys.argv[2], json.load(open(sys.argv[3]))
kind = next((k for k in ref if k in gpu), None)
best = {}
for r in rows:
    if "impl" in r:
        best[r["model"]] = max(best.get(r["model"], 0), r["tok_s"])
peers = {(r.get("model", "d12"), r["mode"]): r.get("tok_s") for r in rows if "peer" in r}
ok, report = True, {"gpu": gpu, "blutrain": best, "peers": {f"{m}/{k}": v for (m, k), v in peers.items()}}
# The test binary's verdict in the summary too: its PASSED/SKIPPED/FAILED lines, each failed test
# by name; a failed test makes ok false.
report["tests"] = [l.strip() for l in open(sys.argv[4]) if l.startswith(("[  PASSED  ]", "[  SKIPPED ]", "[  FAILED  ]"))]
ok = sys.argv[5] == "true"
for model, tok_s in best.items():
    if kind is None:
        report["note"] = f"no reference for {gpu} in gpu_reference.json"
        break
    r = ref[kind].get(model)
    if r and tok_s < r["tok_s"] * (1 - r["spread"]):
        ok = False
        report.setdefault("slower", []).append(f"{model}: {tok_s} < {r['tok_s']} x (1 - {r['spread']})")
report["ok"] = ok
print(json.dumps(report))
sys.exit(0 if ok else 1)
PY
exit $status

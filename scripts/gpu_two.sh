#!/usr/bin/env bash
# The runs on two GPUs of one host (device tool, kind nvidia-h200-x2 or nvidia-h100-x2), from the
# repo root with .devpack carried (scripts/gpu_pack.sh; the real-text steps need the GPT-2 shards of
# the fortunes in .devpack/fortunes_gpt2). Each step is one table; its JSON lines go to $OUT:
#   tests   — the two-rank NCCL tests of test_cuda (collectives, DDP, ZeRO-1/2, TP, flight recorder)
#   dp      — GPT-2 124M bf16 at B=16 and 32 per GPU (DP_BATCHES): blutrain on one GPU, and on two
#             with DDP and ZeRO-1/2/3; beside torch_gpt2.py on one GPU and under torchrun (DDP) and
#             torch_parallel.py fsdp
#   dpwin   — DDP at B=16 and 32 per GPU with its all-reduce through NCCL and through the peer
#             window (PW_MIB, default 128), alternated twice, beside one GPU
#   dpwire  — DDP at B=16 and 32 per GPU (DP_BATCHES) with its gradient buckets travelling in fp32
#             and in bf16 (BLU_DDP_REDUCE_DTYPE=bf16, dist/ddp.h), alternated twice, beside one GPU
#   dpstack — DDP at B=16 per GPU: each GPU alone (CUDA_VISIBLE_DEVICES), then NCCL, the peer
#             window, the bf16 wire and both together, alternated twice, and --skip-comm; each GPU
#             alone again at the end
#   dpcompiled — GPT-2 124M bf16 at B=16 per GPU under DDP, ZeRO-1 and ZeRO-2 (COMPILED_ZERO), eager
#             and --compile alternated twice
#   dpops   — bench --profile (device time per op of one step, an event after each op, no sync)
#             on one GPU and on DDP rank 0 at B=16, twice each, then the ops whose time grew most
#             under DDP (scripts/lab/profile_diff.py); PROF_ENV="VAR=VALUE" for a third DDP variant
#   layouts — (LAYOUT_SPECS: "LAYOUT|B;..." instead of the list below) for each model in LAYOUT_MODELS (gpt2:d24 gpt2:d48 llama:llama3.2-1b), a global batch of
#             8 sequences of 1024 tokens per step: one GPU, then bench --parallel with TP=2 (with and
#             without SP), PP=2 (1F1B and interleaved, 4 micro-batches of 2), replicate(2) and auto —
#             each beside the planner's prediction — and torch_parallel.py tp|pp|ddp (GPT-2) or
#             torch_llama.py under torchrun (Llama) on the same batch (LAYOUT_PEERS=0: without them)
#   tpoverlap — for each model in TP_MODELS (gpt2:d24 llama:llama3.2-1b), B=8, T=1024: one GPU, then
#             each of TP_SPECS ("split(2)" "split(2, sp=true)") with BLU_TP_OVERLAP=0 (every column
#             linear its own collective, waited where issued) and 1 (early input-gradient
#             collectives, shared column inputs: dist/tensor_parallel.h), alternated twice
#   python  — the Python module's CUDA tests (tests/python/test_blutrain_cuda.py) with the module
#             built for this machine's Python (scripts/python_module.sh into .devpack/python)
#   offload — ZeRO-3 with the optimizer state offloaded on two GPUs beside ZeRO-3 and PyTorch FSDP2
#             with CPU offload (GPT-2 d48, B=8 per GPU), then larger shapes (OFFLOAD_SHAPES)
#   faults  — a 5 s timeout: rank 1 stalled before step 3 (BLU_TEST_STALL) ends the job, the flight
#             recorder names each rank's last collective; rank 1 killed with SIGKILL mid-run
#   hetero  — a co-running matmul load on GPU 1 (no setting of the GPU is changed): replicate(2)
#             with even rows beside replicate(2, weights=probe) (HETERO_SPECS "a;b;...",
#             HETERO_MODEL, HETERO_B: other layouts, e.g. split(2) beside split(2, widths=probe))
#   realtext — GPT-2 124M on the fortunes (GPT-2 tokens), bf16, REAL_STEPS (250) steps of 8 x 1024
#             tokens: one GPU with two seeds (the seed-to-seed spread), DP, TP and PP on two
#             (REAL_ONLY=TEXT: only the runs whose arguments hold TEXT)
# Usage: bash scripts/gpu_two.sh STEP... ; STEPS (steps of each bench, default 15).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
# NVLink multicast stays off (the workplace's rule for shared hosts), in every child as well.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
bt="$pack/blutrain"
peers=.devpack/peers
S="${STEPS:-15}"
trun=(python3 -m torch.distributed.run --standalone --nproc_per_node 2)
json() { grep '{"' | sed 's/^[^{]*//'; }  # the JSON lines (behind launch's rank prefixes)
row() { tee -a "$out/$1.log" | json | cut -c1-"${WIDTH:-330}"; }  # all output to STEP.log, JSON shown
since() { awk -v t0="$1" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.1f", t1 - t0 }'; }

# GPT-2 124M DDP at each B of DP_BATCHES beside one GPU, alternated twice with and without the
# environment setting VAR=VALUE (dpwin, dpwire); rows to STEP.log.
dp_alternate() {  # STEP VAR=VALUE
  for b in ${DP_BATCHES:-16 32}; do
    common=(bench --device cuda --model gpt2:d12 --precision bf16 -B "$b" -T 1024 --steps "$S")
    timeout 120 "$bt" "${common[@]}" 2>&1 | row "$1"
    for rep in 1 2; do
      timeout 150 "$bt" launch -n 2 -- "$bt" "${common[@]}" --dp 2 2>&1 | row "$1"
      env "$2" timeout 150 "$bt" launch -n 2 -- "$bt" "${common[@]}" --dp 2 2>&1 | row "$1"
    done
  done
}

for step in "$@"; do
  echo "== $step"
  case "$step" in
    tests)
      timeout 300 "$pack/test_cuda" --gtest_filter='Nccl.*:TpNccl.*:NcclFlight.*' 2>&1 | tee "$out/two_tests.log" \
        | grep -vE "^\[ +(OK|RUN) " | tail -20 ;;
    dp)
      for b in ${DP_BATCHES:-16 32}; do
        common=(bench --device cuda --model gpt2:d12 --precision bf16 -B "$b" -T 1024 --steps "$S")
        timeout 120 "$bt" "${common[@]}" 2>&1 | row dp
        for z in 0 1 2 3; do
          timeout 150 "$bt" launch -n 2 -- "$bt" "${common[@]}" --dp 2 --zero "$z" 2>&1 | row dp
        done
        timeout 200 python3 "$peers/torch_gpt2.py" bf16 "$b" 1024 "$S" 2>&1 | row dp
        timeout 250 "${trun[@]}" "$peers/torch_gpt2.py" bf16 "$b" 1024 "$S" 2>&1 | row dp
        timeout 250 "${trun[@]}" "$peers/torch_parallel.py" fsdp --model d12 -B "$b" -T 1024 --steps "$S" 2>&1 | row dp
      done ;;
    tpoverlap)
      for m in ${TP_MODELS:-gpt2:d24 llama:llama3.2-1b}; do
        common=(bench --device cuda --model "$m" --precision bf16 -T 1024 --steps "$S" -B 8)
        [[ "$m" == llama* ]] && common+=(--lr 3e-4 --beta2 0.95)
        timeout 200 "$bt" "${common[@]}" 2>&1 | row tpoverlap
        specs=("split(2)" "split(2, sp=true)")
        [ -n "${TP_SPECS:-}" ] && IFS=';' read -ra specs <<< "$TP_SPECS"
        for spec in "${specs[@]}"; do
          for ov in 0 1 0 1; do
            echo "{\"model\": \"$m\", \"parallel\": \"$spec\", \"BLU_TP_OVERLAP\": $ov}" | row tpoverlap
            BLU_TP_OVERLAP=$ov timeout 150 "$bt" launch -n 2 -- "$bt" "${common[@]}" --parallel "$spec" 2>&1 | row tpoverlap
          done
        done
      done ;;
    python)
      mkdir -p /tmp/blupy && for f in .devpack/python/*.xz; do xz -dc "$f" > "/tmp/blupy/$(basename "${f%.xz}")"; done
      python3 --version; ls /tmp/blupy
      timeout 300 python3 tests/python/test_blutrain_cuda.py /tmp/blupy 2>&1 | tee "$out/python.log" | tail -25 ;;
    dpwire)
      dp_alternate dpwire BLU_DDP_REDUCE_DTYPE=bf16 ;;
    dpwin)
      # DDP's all-reduce through NCCL and through the copy-engine peer window
      # (BLU_NCCL_PEER_WINDOW_MIB, dist/nccl_peer_window.h), alternated twice, beside one GPU.
      dp_alternate dpwin "BLU_NCCL_PEER_WINDOW_MIB=${PW_MIB:-128}" ;;
    dpstack)
      common=(bench --device cuda --model gpt2:d12 --precision bf16 -B 16 -T 1024 --steps "${S}")
      one() { for g in 0 1; do echo "{\"alone_on_gpu\": $g}" | row dpstack; CUDA_VISIBLE_DEVICES=$g timeout 100 "$bt" "${common[@]}" 2>&1 | row dpstack; done; }
      one
      for rep in 1 2; do
        for v in "BLU_DDP_REDUCE_DTYPE=f32" "BLU_NCCL_PEER_WINDOW_MIB=128" "BLU_DDP_REDUCE_DTYPE=bf16" \
                 "BLU_NCCL_PEER_WINDOW_MIB=128 BLU_DDP_REDUCE_DTYPE=bf16"; do
          echo "{\"ddp_env\": \"$v\"}" | row dpstack
          env $v timeout 120 "$bt" launch -n 2 -- "$bt" "${common[@]}" --dp 2 2>&1 | row dpstack
        done
      done
      echo '{"ddp": "--skip-comm"}' | row dpstack
      timeout 120 "$bt" launch -n 2 -- "$bt" "${common[@]}" --dp 2 --skip-comm 2>&1 | row dpstack
      one ;;
    dpcompiled)
      common=(bench --device cuda --model gpt2:d12 --precision bf16 -B 16 -T 1024 --steps "$S" --dp 2)
      for z in ${COMPILED_ZERO:-0 1 2}; do
        for rep in 1 2; do
          for v in eager compiled; do
            extra=(); [ "$v" = compiled ] && extra=(--compile)
            echo "{\"zero\": $z, \"run\": \"$v\"}" | row dpcompiled
            timeout 150 "$bt" launch -n 2 -- "$bt" "${common[@]}" --zero "$z" "${extra[@]}" 2>&1 | row dpcompiled
          done
        done
      done ;;
    dpops)
      common=(bench --device cuda --model gpt2:d12 --precision bf16 -B 16 -T 1024 --steps "$S" --profile)
      for rep in 1 2; do
        timeout 120 "$bt" "${common[@]}" 2>&1 | tee -a "$out/dpops.log" | json > "$out/ops_one_$rep.json"
        timeout 150 "$bt" launch -n 2 -- "$bt" "${common[@]}" --dp 2 2>&1 | tee -a "$out/dpops.log" | json > "$out/ops_ddp_$rep.json"
        [ -z "${PROF_ENV:-}" ] || env $PROF_ENV timeout 150 "$bt" launch -n 2 -- "$bt" "${common[@]}" --dp 2 2>&1 \
          | tee -a "$out/dpops.log" | json > "$out/ops_var_$rep.json"
      done
      python3 scripts/lab/profile_diff.py "$out"/ops_one_1.json "$out"/ops_ddp_1.json | tee "$out/dpops.txt"
      python3 scripts/lab/profile_diff.py "$out"/ops_one_2.json "$out"/ops_ddp_2.json | tee -a "$out/dpops.txt"
      [ -z "${PROF_ENV:-}" ] || python3 scripts/lab/profile_diff.py "$out"/ops_ddp_1.json "$out"/ops_var_1.json | tee -a "$out/dpops.txt" ;;
    layouts)
      for m in ${LAYOUT_MODELS:-gpt2:d24 gpt2:d48 llama:llama3.2-1b}; do
        common=(bench --device cuda --model "$m" --precision bf16 -T 1024 --steps "$S")
        [[ "$m" == llama* ]] && common+=(--lr 3e-4 --beta2 0.95)
        timeout 200 "$bt" "${common[@]}" -B 8 2>&1 | row layouts
        # Global batch 8: TP ranks share 8 rows, a pipeline runs 4 micro-batches of 2, replicas 4 each.
        specs=("split(2)|8" "split(2, sp=true)|8" "pipeline(2, schedule=1f1b, micro=4)|2"
               "pipeline(2, schedule=interleaved, micro=4)|2" "replicate(2)|4" "auto|4")
        [ -n "${LAYOUT_SPECS:-}" ] && IFS=';' read -ra specs <<< "$LAYOUT_SPECS"
        for spec in "${specs[@]}"; do
          timeout "${LAYOUT_TIMEOUT:-150}" "$bt" launch -n 2 -- "$bt" "${common[@]}" --parallel "${spec%|*}" -B "${spec#*|}" 2>&1 | row layouts
        done
        if [ "${LAYOUT_PEERS:-1}" = 0 ]; then
          :
        elif [[ "$m" == gpt2:* ]]; then
          size="${m#gpt2:}"
          timeout 250 "${trun[@]}" "$peers/torch_parallel.py" tp --model "$size" -B 8 -T 1024 --steps "$S" 2>&1 | row layouts
          timeout 250 "${trun[@]}" "$peers/torch_parallel.py" pp --model "$size" -B 8 -T 1024 --steps "$S" --microbatches 4 2>&1 | row layouts
          timeout 250 "${trun[@]}" "$peers/torch_parallel.py" ddp --model "$size" -B 4 -T 1024 --steps "$S" 2>&1 | row layouts
        else
          timeout 250 python3 "$peers/torch_llama.py" bf16 --model "${m#llama:}" -B 8 -T 1024 --steps "$S" 2>&1 | row layouts
          timeout 300 "${trun[@]}" "$peers/torch_llama.py" bf16 --model "${m#llama:}" -B 4 -T 1024 --steps "$S" 2>&1 | row layouts
        fi
      done ;;
    offload)
      # ZeRO-3 with AdamW's moments offloaded (streamed through the GPU) on two GPUs, beside ZeRO-3
      # without and PyTorch FSDP2 with CPU offload, GPT-2 d48 at B=8 per GPU; then larger GPT
      # shapes (OFFLOAD_SHAPES "DEPTHxWIDTH ...") with ZeRO-3 + offload alone.
      common=(bench --device cuda --precision bf16 -T 1024 --steps "$S")
      for extra in "" "--offload-state optimizer --offload-update gpu"; do
        # shellcheck disable=SC2086
        timeout 300 "$bt" launch -n 2 -- "$bt" "${common[@]}" --model gpt2:d48 -B 8 --dp 2 --zero 3 $extra 2>&1 | row offload
      done
      timeout 300 "${trun[@]}" "$peers/torch_parallel.py" fsdp_offload --model d48 -B 8 -T 1024 --steps "$S" 2>&1 | row offload
      for shape in ${OFFLOAD_SHAPES:-48x3200 64x4096}; do
        d=${shape%x*} w=${shape#*x}
        mkdir -p "/tmp/gpt_$shape"
        printf '{"model_type": "gpt2", "n_layer": %d, "n_embd": %d, "n_head": %d, "vocab_size": 50304, "n_positions": 1024}\n' \
          "$d" "$w" $((w / 128)) > "/tmp/gpt_$shape/config.json"
        echo "-- $shape"
        timeout 400 "$bt" launch -n 2 -- "$bt" "${common[@]}" --model "/tmp/gpt_$shape/config.json" -B "${OFFLOAD_B:-8}" \
          --dp 2 --zero 3 --offload-state optimizer --offload-update gpu 2>&1 | row offload
      done ;;
    faults)
      data=.devpack/fortunes_gpt2
      train=(train --device cuda --dp 2 --model d12 --data-dir "$data" -B 4 -T 512 --steps 40 --log-every 1
             --val-every 0 --sample-every 0 --ckpt-every 0 --dist-timeout 5 --dist-work-timeout 5)
      rm -rf /tmp/stall && t0=$(date +%s.%N)
      BLU_TEST_STALL=1:3 timeout 120 "$bt" launch -n 2 -- "$bt" "${train[@]}" --out /tmp/stall > "$out/faults.log" 2>&1
      rc=$?
      echo "stall: exit $rc after $(since "$t0") s (rank 1 sleeps before step 3; 5 s timeout)"
      grep -iE "time|stall|error|abort" "$out/faults.log" | grep -v "^.*step .* ms" | head -8
      "$bt" info --flight /tmp/stall 2>&1 | tee "$out/stall_flight.txt" | head -12
      rm -rf /tmp/kill
      timeout 120 "$bt" launch -n 2 -- "$bt" "${train[@]}" --out /tmp/kill > /tmp/kill.log 2>&1 &
      job=$!
      for _ in $(seq 600); do grep -qE "step +5/" /tmp/kill.log 2>/dev/null && break; sleep 0.1; done
      victim=""
      for p in $(pgrep -f "$bt train"); do tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "RANK=1" && victim=$p; done
      t0=$(date +%s.%N)
      [ -n "$victim" ] && kill -9 "$victim"
      wait "$job"; rc=$?
      echo "kill: rank 1 (pid ${victim:-not found}) killed at step 5; the job exited $rc after $(since "$t0") s"
      cat /tmp/kill.log >> "$out/faults.log"
      grep -iE "rank 1|error|signal|killed" /tmp/kill.log | grep -vE "step +[0-9]+/" | head -8 ;;
    hetero)
      common=(bench --device cuda --model "${HETERO_MODEL:-gpt2:d12}" --precision bf16 -B "${HETERO_B:-16}" -T 1024 --steps "$S")
      python3 -c "
import time, torch
a = torch.randn(8192, 8192, device='cuda:1', dtype=torch.bfloat16)
t = time.time()
while time.time() - t < ${HETERO_LOAD_S:-240}:
    for _ in range(20): a @ a
    torch.cuda.synchronize(1)
" &
      load=$!
      sleep 5
      specs=("replicate(2)" "replicate(2, weights=probe)" "replicate(2)")
      [ -n "${HETERO_SPECS:-}" ] && IFS=';' read -ra specs <<< "$HETERO_SPECS"
      for spec in "${specs[@]}"; do
        timeout 200 "$bt" launch -n 2 -- "$bt" "${common[@]}" --parallel "$spec" 2>&1 | row hetero
      done
      kill "$load"; wait "$load" 2>/dev/null ;;
    realtext)
      data=.devpack/fortunes_gpt2
      common=(train --model d12 --data-dir "$data" --device cuda --precision bf16 -T 1024 --steps "${REAL_STEPS:-250}"
              --lr 6e-4 --warmup 25 --val-every "${REAL_STEPS:-250}" --log-every 50 --sample-every 0)
      # Every run scores the same 32 validation sequences (rows per replica x val batches x replicas).
      run_train() {  # RANKS ARGS...
        local n="$1"; shift
        [ -n "${REAL_ONLY:-}" ] && [[ "$*" != *"$REAL_ONLY"* ]] && return
        echo "-- $*"
        if [ "$n" = 1 ]; then cmd=("$bt"); else cmd=("$bt" launch -n "$n" -- "$bt"); fi
        timeout "${REAL_TIMEOUT:-300}" "${cmd[@]}" "${common[@]}" "$@" 2>&1 | tee -a "$out/realtext.log" \
          | grep -E "val loss|step +${REAL_STEPS:-250}/|rror" | tail -2
      }
      run_train 1 --seed 1337 -B 8 --val-batches 4
      run_train 1 --seed 7 -B 8 --val-batches 4
      run_train 2 --dp 2 -B 4 --val-batches 4
      run_train 2 --parallel "split(2)" -B 8 --val-batches 4
      run_train 2 --parallel "pipeline(2, schedule=1f1b, micro=2)" -B 4 --val-batches 8 ;;
    *) echo "unknown step $step" ;;
  esac
done

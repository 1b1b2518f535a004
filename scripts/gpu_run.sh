#!/usr/bin/env bash
# Runs on the GPU machine (device tool) from the repo root, with .devpack carried (made here by
# scripts/gpu_pack.sh): unpacks the prebuilt binaries and the host libraries they need, then runs
# the steps named in $@, logging to $OUT:
#   tests — test_cuda: every CUDA op against the CPU, allocator, copies, flash attention
#           (TEST_BIN: another test_cuda, e.g. a branch's, unpacked beside; TEST_FILTER, TEST_TIMEOUT)
#   ceil  — the GPU's measured ceilings (../shared/peers/ceilings.py)
#   bench — blutrain bench per precision beside the PyTorch peer in the same run
#   attn  — flash-attention timing beside PyTorch's SDPA peer (each backend, and the default pick)
#   gpt2  — GPT-2 124M on the GPU vs PyTorch on the same GPU (same weights and batch)
#   dist  — (DIST_N GPUs, default 2) NCCL tests (DIST_TESTS=0: skipped); bench on 1 GPU, on DIST_N with DDP, ZeRO-1 and
#           ZeRO-2, beside PyTorch single-GPU and DDP under torchrun
#   variants — more bench runs with other environments/arguments (VARIANTS, see below; CLOCKS=1
#           adds GPU 0's median SM clock and power during each run)
#   trainval — blutrain train beside scripts/torch_train_peer.py (same model, shards, order, steps
#           and schedule) per precision in MODES; each prints its validation loss at the end
#           (DATA: a folder of shards carried in .devpack; TRAIN_ARGS: more arguments to both)
#   disttrainval — the same on DIST_N GPUs (default 2): `blutrain launch -n N -- blutrain train
#           --dp N` beside scripts/torch_train_peer.py under torchrun (DDP), per precision in MODES
#   attndetail — ncu sections (throughput, stalls, top stall sites) of our wgmma attention kernels
#           beside cuDNN's (files ncu_ours.txt, ncu_cudnn.txt)
#   attnsass — per-instruction SASS of our wgmma attention kernels: executed instructions and
#           warp-stall samples by reason (ncu source page, files sass_fwd.csv, sass_bwd.csv), for
#           scripts/lab/sass_hotspots.py
#   kernels — one --gemm-tune on step of GPT-2 124M (B=16) and llama-250m (B=8), bf16, kernel by
#           kernel under ncu (time and DRAM bytes), summarised by scripts/lab/ncu_step.py, for each
#           mode in KERNEL_MODES (compiled, eager; default compiled)
#   profile — blutrain bench --profile (MODE, default bf16): device time per op, summarised by
#           scripts/bench_summary.py; one run per `;`-separated argument set in PROFILE_RUNS
#   llama — blutrain bench --model llama:NAME beside ../shared/peers/torch_llama.py (eager and
#           torch.compile) in the same run, for each NAME in LLAMA_MODELS (default llama-250m
#           llama3.2-1b), bf16, B=LLAMA_B (8), T=LLAMA_T (1024)
#   gpt2cmp — the bf16 GPT-2 124M step of this build and of the base build packed beside it
#           (blutrain_base: gpu_pack.sh BASE=<build dir>), alternated REPS times (3), beside
#           torch_gpt2.py: the new build must stay within the base build's run-to-run spread;
#           CMP_BINS names the binaries alternated (a third: blutrain_mid, gpu_pack.sh MID=<dir>)
#   llamacmp — the same for llama-250m (set B=8) beside torch_llama.py
#   memory — GPT-2 124M (B=16) and llama-250m (B=8), bf16, T=1024: eager, each --recompute setting,
#           --offload-activations and --compile, beside torch_gpt2.py / torch_llama.py (eager and
#           torch.compile) in the same run
#   compiled — GPT-2 124M (B=16) and llama-250m (B=8), bf16, T=1024: eager and --compile
#           alternated REPS times (2), beside torch_gpt2.py / torch_llama.py (eager and
#           torch.compile) in the same run; the compiled runs print the host time per step
#   segments — GPT-2 124M (B=16) and llama-250m (B=8), bf16, T=1024: eager, and --compile with the
#           step's first graph segment 64 launches long (BLU_COMPILE_FIRST_SEGMENT=0), 4, and 2 (the
#           default), alternated REPS times (2), beside torch_gpt2.py / torch_llama.py
#   compiledab — the tuned compiled step (`--compile --gemm-tune on`, 30 steps) of GPT-2 124M (B=16)
#           and llama-250m (B=8) under each variant of AB_RUNS ("label|binary|environment;…",
#           default "base|blutrain_base|;new|blutrain|"; a binary packed by gpu_pack.sh BASE=/MID=),
#           alternated REPS times (3; even ones in reverse order), each variant with its own tuning
#           table filled by a first run,
#           then torch_gpt2.py / torch_llama.py bf16c, summarised by scripts/ab_summary.py (medians,
#           pairs ahead, ratios to the peers; compiledab_summary.txt). TIMELINE=1: one CUPTI timeline a
#           variant and model (.devpack/lab/libkernel_timeline.so and libcupti.so.13, scripts/lab/README.md),
#           summarised by scripts/lab/timeline_steps.py. POWER=1: nvidia-smi's power and SM clock
#           every 100 ms through a 150-step run of the first variant and of each peer (the median of
#           the samples above 400 W). AB_ARGS: more bench arguments for both models (e.g.
#           "--compile-remat --loss-chunks 4"), AB_LLAMA_ARGS: more for llama-250m alone; AB_MODELS: which
#           of the two run ("gpt2 llama")
#   lab   — each program named in LAB (space-separated), built here from scripts/lab/*.cu and
#           carried in .devpack/lab, run in turn (output in lab.log)
#   recompute — the same two models, bf16, eager and --compile under each --recompute setting
#           (RECOMPUTE: selective block:2 block), beside torch_gpt2.py / torch_llama.py (bf16c)
#   autobudget — BUDGET_MODEL (d12: GPT-2 124M; or llama:llama-250m) bf16, B=BUDGET_B (16),
#           trained --compile on the fortunes (BUDGET_STEPS, 40; GPT-2 tokens, or BUDGET_DATA=byte:
#           bytes, prepared there) under --recompute auto with each --gpu-memory-budget in BUDGETS
#           (GiB: 7.5 5.6 4.2), BUDGET_ARGS added: the setting the planner picks, the predicted and
#           the measured peak, tok/s; then the model's torch.compile peer (BUDGET_PEER=0: not)
#   check — performance.md's current check: GPT-2 124M and llama-250m tuned and compiled, at full speed
#           (CHECK_GPT2_FULL, CHECK_LLAMA_FULL: more arguments, none by default)
#           and in at most 0.6x of torch.compile's memory (CHECK_GPT2_LOW, CHECK_LLAMA_LOW), REPS
#           (2) times in turn, between two runs of both torch.compile peers (check.log)
#   precisions — the same two models in fp32 and tf32 (PRECISIONS), eager and --compile, REPS (1)
#   fuseexport — GPT-2 124M (B=16) and llama-250m (B=8), bf16, T=1024: one short `bench --compile
#           --compile-export` each, writing the captured steps to $OUT/graphs (fused where MLIR is:
#           `blutrain compile --from-graph`, docs/compiler_mlir.md "Fusion plans for the GPU"), and two
#           steps of fusedtext's training step (FUSED_MODEL)
#   fused — the same two steps eager, compiled unfused and compiled fused (plans from the kernel
#           cache carried in .devpack/kcache; NVRTC compiles the region kernels at first use),
#           alternated REPS times (2), beside torch_gpt2.py / torch_llama.py (eager and
#           torch.compile) in the same run
#   fusedtext — FUSED_MODEL (d12: GPT-2 124M on GPT-2 tokens; llama:llama-250m: on bytes, prepared
#           there) bf16, B=8, trained on the fortunes (FUSED_STEPS, 250) with each argument set of
#           FUSED_RUNS (eagerly with two seeds and compiled fused with the first; fuseexport exports
#           this step too, so its plan is in the carried cache): validation losses
#   offload — scripts/offload_bench.sh with GRID=0 (GPT-2 d48 with its AdamW state on the host vs
#           not, beside torch_parallel.py fsdp_offload under torchrun with one process)
#   planner1 — the planner on one GPU: `bench --parallel` (one rank) for each model in PLAN_MODELS
#           (gpt2:d12 gpt2:d24 llama:llama-250m) and layout in PLAN_LAYOUTS (replicate(1),
#           pipeline(1, micro=2): the pipeline's code path on one rank), bf16, B=PLAN_B (8),
#           T=1024: the prediction beside the measured step and peak, and the error
#   demo  — the README's first run (scripts/demo.sh) on the GPU: its GPU preset, the fortunes
#           carried in .devpack/fortunes (gpu_pack.sh copies them), the shards prepared there
#   attnprof — the time of each kernel of BluTrain's bf16 attention forward+backward (ncu), beside
#           PyTorch's per-kernel times (scripts/sdpa_default.py)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
B="${B:-16}"; T="${T:-1024}"; STEPS="${STEPS:-20}"
# The real-text step of fuseexport and fusedtext (the same options, so the same captured step).
fused_model="${FUSED_MODEL:-d12}"
if [ "$fused_model" = d12 ]; then
  fusedtext_args=(train --model d12 --data-dir .devpack/fortunes_gpt2 --lr 6e-4)
else  # a Llama preset on the fortunes' bytes
  fusedtext_args=(train --model "$fused_model" --data-dir /tmp/fortunes_byte --lr 3e-4)
fi
fusedtext_args+=(--device cuda --precision bf16 -B 8 -T 1024 --warmup 25 --log-every 50 --sample-every 0 --val-batches 4)
fortunes_bytes() {  # the fortunes as bytes in /tmp/fortunes_byte, for a Llama model
  [ -f /tmp/fortunes_byte/shards.json ] || "$pack/blutrain" prepare --input .devpack/fortunes --out /tmp/fortunes_byte \
    --name fortunes --val-fraction 0.05 --tokenizer byte --overwrite > /dev/null
}
# GPT-2 124M (B=16) and llama-250m (B=8), bf16, T=1024, 20 steps, each with ARGS (and the
# environment ENVS, "" for none); the JSON lines and errors go to $out/LOG. PAIR_MODELS (default
# "gpt2 llama") names which of the two run, here and in peers_pair.
PAIR_MODELS="${PAIR_MODELS:-gpt2 llama}"
bench_pair() {  # LOG ENVS ARGS...
  local log="$1" envs="$2"; shift 2
  [[ " $PAIR_MODELS " == *" gpt2 "* ]] &&
  env $envs timeout 150 "$pack/blutrain" bench --device cuda --model gpt2:d12 --precision bf16 -B 16 -T 1024 \
    --steps 20 "$@" 2>&1 | grep -E '^\{|fusion|recompute:|rror' | tee -a "$out/$log" | cut -c1-400
  [[ " $PAIR_MODELS " == *" llama "* ]] &&
  env $envs timeout 200 "$pack/blutrain" bench --device cuda --model llama:llama-250m --precision bf16 -B 8 -T 1024 \
    --steps 20 --lr 3e-4 --beta2 0.95 "$@" 2>&1 | grep -E '^\{|fusion|recompute:|rror' | tee -a "$out/$log" | cut -c1-400
  return 0
}
# The PyTorch peers of bench_pair's two steps in MODES (bf16,bf16c: eager and torch.compile).
peers_pair() {  # LOG MODES
  [[ " $PAIR_MODELS " == *" gpt2 "* ]] &&
  timeout 300 python3 .devpack/peers/torch_gpt2.py "$2" 16 1024 20 2>&1 | grep '^{' | tee -a "$out/$1"
  [[ " $PAIR_MODELS " == *" llama "* ]] &&
  timeout 400 python3 .devpack/peers/torch_llama.py "$2" --model llama-250m -B 8 -T 1024 --steps 20 2>&1 \
    | grep '^{' | tee -a "$out/$1"
  return 0
}
for step in "$@"; do
  case "$step" in
    gpt2)
      # GPT-2 124M on the GPU against PyTorch on the same GPU (fp32 and bf16).
      BLU_TEST_DIR="$PWD/tests" BLU_TORCH_PYTHON=python3 timeout 400 "$pack/test_cuda" \
        --gtest_filter='Gpt2OracleCuda.*' 2>&1 | tee "$out/gpt2.log" | grep -vE "^\[ +(OK|RUN) " | tail -40 ;;
    tests)
      # The GPT-2 oracle tests run PyTorch (python3 here) on the test data of this checkout.
      BLU_TEST_DIR="$PWD/tests" BLU_TORCH_PYTHON=python3 timeout "${TEST_TIMEOUT:-300}" "${TEST_BIN:-$pack/test_cuda}" --gtest_brief=1 ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} 2>&1 \
        | tee "$out/test_cuda.log" | grep -vE "^\[ +(OK|RUN) " | tail -${TEST_TAIL:-80} ;;
    ceil)
      timeout 120 python3 .devpack/peers/ceilings.py 2>&1 | tee "$out/ceilings.log" ;;
    bench)
      for p in ${MODES:-fp32 tf32 bf16}; do
        timeout 150 "$pack/blutrain" bench --device cuda --precision "$p" -B "$B" -T "$T" --steps "$STEPS" \
          --peak-tflops "${PEAK:-0}" ${BENCH_ARGS:-} 2>&1 | tee -a "$out/bench.log" | tail -3
      done
      timeout 300 python3 .devpack/peers/torch_gpt2.py "${PEER_MODES:-fp32,tf32,bf16,bf16c}" "$B" "$T" "$STEPS" 2>&1 \
        | tee -a "$out/bench.log" | tail -8 ;;
    dist)
      # 2 GPUs: NCCL tests, then single-GPU vs 2-GPU data parallel (and ZeRO-1) beside PyTorch DDP.
      n="${DIST_N:-2}"
      [ "${DIST_TESTS:-1}" = 1 ] && timeout 180 "$pack/test_cuda" --gtest_filter='Nccl.*' 2>&1 | tee "$out/nccl.log" |
        grep -vE "^\[ +(OK|RUN) " | tail -20
      for args in "" "--dp $n" "--dp $n --zero 1" "--dp $n --zero 2"; do
        if [ -z "$args" ]; then cmd=("$pack/blutrain"); else cmd=("$pack/blutrain" launch -n "$n" -- "$pack/blutrain"); fi
        timeout 200 "${cmd[@]}" bench --device cuda --precision "${MODE:-bf16}" -B "$B" -T "$T" --steps "$STEPS" $args \
          2>&1 | tee -a "$out/dist.log" | grep -E '^\{|^\[rank 0\] \{|rror' | tail -3
      done
      timeout 200 python3 .devpack/peers/torch_gpt2.py "${MODE:-bf16}" "$B" "$T" "$STEPS" 2>&1 | tee -a "$out/dist.log" | tail -2
      timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node "$n" .devpack/peers/torch_gpt2.py \
        "${MODE:-bf16}" "$B" "$T" "$STEPS" 2>&1 | tee -a "$out/dist.log" | grep -E '^\{|rror' | tail -3 ;;
    variants)
      # Extra multi-GPU bench runs to compare settings in one call: VARIANTS is a ';'-separated
      # list of "ENV=V ... | bench args", e.g. "NCCL_MAX_CTAS=8 | --dp 2;  | --dp 2 --bucket-mib 100".
      IFS=';' read -ra runs <<< "${VARIANTS:-}"
      for v in "${runs[@]}"; do
        envs="${v%%|*}"; args="${v#*|}"
        n=$(sed -n 's/.*--dp \([0-9]*\).*/\1/p' <<< "$args"); n="${n:-1}"
        echo "== ${envs} | ${args}" | tee -a "$out/variants.log"
        if [ "$n" = 1 ]; then cmd=("$pack/blutrain"); else cmd=("$pack/blutrain" launch -n "$n" -- "$pack/blutrain"); fi
        # CLOCKS=1: GPU 0 sampled every 50 ms; its median SM clock and power while busy are printed,
        # and the share of those samples under the software power cap.
        [ "${CLOCKS:-0}" = 1 ] && { nvidia-smi --query-gpu=index,utilization.gpu,clocks.sm,power.draw,clocks_event_reasons.sw_power_cap \
          --format=csv,noheader,nounits -lms 50 > /tmp/smi.csv & smi=$!; }
        env $envs timeout 200 "${cmd[@]}" bench --device cuda --precision "${MODE:-bf16}" -B "$B" -T "$T" \
          --steps "$STEPS" $args 2>&1 | tee -a "$out/variants.log" | grep -E '^\{|^\[rank 0\] \{|rror' | tail -3
        [ "${CLOCKS:-0}" = 1 ] && { kill $smi; wait $smi 2>/dev/null; python3 -c "
import statistics as s
b = [r.strip().split(', ') for r in open('/tmp/smi.csv') if r.startswith('0, ') and r.count(',') == 4]
b = [r for r in b if r[1].isdigit() and int(r[1]) > 50]
print(f'GPU 0 busy: {len(b)} samples, SM {s.median(float(r[2]) for r in b):.0f} MHz, {s.median(float(r[3]) for r in b):.0f} W, '
      f'power-capped {sum(r[4] == \"Active\" for r in b) / len(b):.0%}' if b else 'GPU 0: no busy samples')
" | tee -a "$out/variants.log"; }
      done ;;
    attn)
      timeout 120 "$pack/test_cuda" --gtest_filter='FlashAttentionPerf*' 2>&1 | tee "$out/attn.log" | tail -15
      timeout 120 python3 .devpack/peers/attention.py 16 12 1024 64 2>&1 | tee -a "$out/attn.log" | tail -12
      timeout 120 python3 scripts/sdpa_default.py 16 12 1024 64 2>&1 | grep '^{' | tee -a "$out/attn.log" ;;
    trainval)
      data="${DATA:-.devpack/fortunes}"
      for m in ${MODES:-bf16 tf32 fp32}; do
        timeout 300 "$pack/blutrain" train --model d12 --data-dir "$data" --device cuda --precision "$m" -B "$B" -T "$T" \
          --steps "$STEPS" ${TRAIN_ARGS:-} 2>&1 | tee -a "$out/trainval.log" | grep -E "^  (train loss|val loss|tokens|peak)|rror"
        timeout 300 python3 scripts/torch_train_peer.py --peers .devpack/peers --data-dir "$data" --mode "$m" -B "$B" \
          -T "$T" --steps "$STEPS" ${TRAIN_ARGS:-} 2>&1 | tee -a "$out/trainval.log" | grep -E "^\{|rror"
      done ;;
    profile)
      # One profile per `;`-separated argument set in PROFILE_RUNS (default: one, no arguments),
      # written to profile.log, profile_2.log, ...
      IFS=';' read -r -a runs <<< "${PROFILE_RUNS:- }"
      i=0
      for args in "${runs[@]}"; do
        i=$((i + 1)); log="$out/profile$([ "$i" = 1 ] || echo "_$i").log"
        echo "== profile $i:$args"
        timeout 150 "$pack/blutrain" bench --device cuda --precision "${MODE:-bf16}" -B "$B" -T "$T" --steps "$STEPS" \
          --profile $args > "$log" 2>&1
        python3 scripts/bench_summary.py "$log"
      done ;;
    kernels)
      # One step of each model kernel by kernel (ncu, each kernel alone: no overlap or launch
      # gaps) for each mode of KERNEL_MODES (compiled: --compile; eager), after a short run that
      # fills the GEMM tuning table the traced run reads; KERNEL_ARGS added to both. Summaries:
      # scripts/lab/ncu_step.py (files kernels_MODEL_MODE.txt).
      for mode in ${KERNEL_MODES:-compiled}; do
        for m in "gpt2:d12 -B 16" "llama:llama-250m -B 8 --lr 3e-4 --beta2 0.95"; do
          n="${m%%:*}_$mode"
          args=(bench --device cuda --model $m --precision bf16 -T 1024 --gemm-tune on ${KERNEL_ARGS:-})
          [ "$mode" = compiled ] && args+=(--compile)
          BLU_GEMM_TUNE_FILE=/tmp/kernels_tune.tsv timeout 100 "$pack/blutrain" "${args[@]}" --steps 4 > /dev/null 2>&1
          BLU_GEMM_TUNE_FILE=/tmp/kernels_tune.tsv timeout 250 ncu --graph-profiling node --cache-control none \
            --clock-control none --metrics gpu__time_duration.sum,dram__bytes.sum --csv --print-units base \
            "$pack/blutrain" "${args[@]}" --steps 3 > "$out/kernels_$n.csv" 2> "$out/kernels_$n.err"
          echo "== $n"
          python3 scripts/lab/ncu_step.py "$out/kernels_$n.csv" 40 | tee "$out/kernels_$n.txt" | head -14
          gzip -f "$out/kernels_$n.csv"
        done
      done ;;
    disttrainval)
      data="${DATA:-.devpack/fortunes}"; n="${DIST_N:-2}"
      for m in ${MODES:-bf16 tf32 fp32}; do
        timeout 400 "$pack/blutrain" launch -n "$n" -- "$pack/blutrain" train --model d12 --data-dir "$data" \
          --device cuda --dp "$n" --precision "$m" -B "$B" -T "$T" --steps "$STEPS" ${TRAIN_ARGS:-} 2>&1 \
          | tee -a "$out/disttrainval.log" | grep -E "^\[rank 0\]   (train loss|val loss|tokens|peak)|rror"
        timeout 400 python3 -m torch.distributed.run --standalone --nproc_per_node "$n" scripts/torch_train_peer.py \
          --peers .devpack/peers --data-dir "$data" --device cuda --mode "$m" -B "$B" -T "$T" --steps "$STEPS" \
          ${TRAIN_ARGS:-} 2>&1 | tee -a "$out/disttrainval.log" | grep -E "^\{|rror"
      done ;;
    llama)
      for m in ${LLAMA_MODELS:-llama-250m llama3.2-1b}; do
        timeout 200 "$pack/blutrain" bench --device cuda --model "llama:$m" --precision bf16 -B "${LLAMA_B:-8}" \
          -T "${LLAMA_T:-1024}" --steps "$STEPS" --lr 3e-4 --beta2 0.95 2>&1 | tee -a "$out/llama.log" | grep -E '^\{|rror' | tail -2
        timeout 400 python3 .devpack/peers/torch_llama.py "${LLAMA_PEER_MODES:-bf16,bf16c}" --model "$m" \
          -B "${LLAMA_B:-8}" -T "${LLAMA_T:-1024}" --steps "$STEPS" 2>&1 | tee -a "$out/llama.log" | grep -E '^\{|rror' | tail -3
      done ;;
    compiledab)
      export LD_LIBRARY_PATH="$PWD/.devpack/lab:$LD_LIBRARY_PATH"
      IFS=';' read -r -a ab_runs <<< "${AB_RUNS:-base|blutrain_base|;new|blutrain|}"
      ab_models=()
      for m in ${AB_MODELS:-gpt2 llama}; do case "$m" in
        gpt2) ab_models+=("gpt2|--model gpt2:d12 -B 16 ${AB_ARGS:-}") ;;
        llama) ab_models+=("llama|--model llama:llama-250m -B 8 --lr 3e-4 --beta2 0.95 ${AB_ARGS:-} ${AB_LLAMA_ARGS:-}") ;;
        *) echo "compiledab: AB_MODELS names gpt2 and llama, got '$m'" >&2; exit 2 ;;
      esac; done
      ab_bench() {  # VARIANT MODEL STEPS [ENV...]: prints tok/s, step ms, peak MiB, memsets made kernels
        local label bin envs m; IFS='|' read -r label bin envs <<< "$1"; IFS='|' read -r _ m <<< "$2"
        env $envs BLU_GEMM_TUNE_FILE="/tmp/ab_tune_$label.tsv" "${@:4}" timeout 150 "$pack/$bin" bench --device cuda \
          --precision bf16 -T 1024 --compile --gemm-tune on --steps "$3" $m 2>&1 | grep -E '^\{' | python3 -c \
          'import json,sys; d=json.loads(sys.stdin.read()); c=d.get("compile",{}); print(round(d["tok_s"]), d["step_ms"], d["peak_alloc_mib"], c.get("graph_memsets_lowered"))'
      }
      for v in "${ab_runs[@]}"; do for m in "${ab_models[@]}"; do ab_bench "$v" "$m" 4 > /dev/null; done; done
      # Even alternations run the variants in reverse order: in a fixed order the first of each pair
      # was ahead six times in six by 0.1-1.0% with the same code on both sides (CHANGELOG, 2026-12-02).
      for i in $(seq "${REPS:-3}"); do for m in "${ab_models[@]}"; do
        vs=(); for v in "${ab_runs[@]}"; do if ((i % 2 == 0)); then vs=("$v" "${vs[@]}"); else vs+=("$v"); fi; done
        for v in "${vs[@]}"; do
          echo "${m%%|*} ${v%%|*} $(ab_bench "$v" "$m" 30)" | tee -a "$out/compiledab.log"
        done
      done; done
      peers_pair compiledab.log bf16c
      python3 scripts/ab_summary.py "$out/compiledab.log" | tee "$out/compiledab_summary.txt"
      if [ "${TIMELINE:-0}" = 1 ]; then for m in "${ab_models[@]}"; do for v in "${ab_runs[@]}"; do
        f="$out/timeline_${m%%|*}_${v%%|*}.csv"
        ab_bench "$v" "$m" 14 CUDA_INJECTION64_PATH="$PWD/.devpack/lab/libkernel_timeline.so" BLU_TIMELINE_FILE="$f" > /dev/null
        echo "${m%%|*} ${v%%|*} memsets $(grep -c '^S' "$f") $(python3 scripts/lab/timeline_steps.py "$f" 4 6 | grep '^median')" \
          | tee -a "$out/compiledab.log"
        gzip -f "$f"
      done; done; fi
      if [ "${POWER:-0}" = 1 ]; then
        sampled() {  # NAME COMMAND...: the command with nvidia-smi sampling beside it
          nvidia-smi --query-gpu=power.draw,clocks.sm --format=csv,noheader,nounits -lms 100 > "$out/power_$1.txt" &
          local p=$!; "${@:2}" > /dev/null 2>&1; kill $p
          echo "$1 $(python3 -c 'import statistics,sys; r=[tuple(map(float,l.split(","))) for l in open(sys.argv[1]) if l.strip() and "N/A" not in l]; h=[x for x in r if x[0]>400]; print(statistics.median(x[0] for x in h), "W", statistics.median(x[1] for x in h), "MHz") if h else print("no samples above 400 W")' "$out/power_$1.txt")" | tee -a "$out/compiledab.log"
        }
        for m in "${ab_models[@]}"; do sampled "ours_${m%%|*}" ab_bench "${ab_runs[0]}" "$m" 150; done
        sampled peer_gpt2 timeout 400 python3 .devpack/peers/torch_gpt2.py bf16c 16 1024 150
        sampled peer_llama timeout 500 python3 .devpack/peers/torch_llama.py bf16c --model llama-250m -B 8 -T 1024 --steps 150
      fi ;;
    lab)
      for prog in ${LAB:-}; do
        echo "== $prog" | tee -a "$out/lab.log"
        timeout 300 ".devpack/lab/$prog" 2>&1 | tee -a "$out/lab.log"
      done ;;
    gpt2cmp|llamacmp)
      modes="${PEER_MODES:-bf16,bf16c}"
      if [ "$step" = llamacmp ]; then
        model=(--model llama:llama-250m --lr 3e-4 --beta2 0.95)
        peer=(torch_llama.py "$modes" --model llama-250m -B "$B" -T "$T" --steps "$STEPS")
      else
        model=() peer=(torch_gpt2.py "$modes" "$B" "$T" "$STEPS")
      fi
      for i in $(seq "${REPS:-3}"); do
        for b in ${CMP_BINS:-blutrain_base blutrain}; do
          echo -n "$b " | tee -a "$out/$step.log"
          timeout 150 "$pack/$b" bench --device cuda --precision bf16 -B "$B" -T "$T" --steps "$STEPS" "${model[@]}" 2>&1 \
            | tee -a "$out/$step.log" | grep -E '^\{|rror' | tail -1
        done
      done
      timeout 400 python3 ".devpack/peers/${peer[0]}" "${peer[@]:1}" 2>&1 \
        | tee -a "$out/$step.log" | grep -E '^\{|rror' | tail -3 ;;
    attnprof)
      timeout 300 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
        --launch-skip "${NCU_SKIP:-0}" --launch-count "${NCU_COUNT:-400}" "$pack/test_cuda" \
        --gtest_filter="${NCU_FILTER:-FlashAttentionPerf.Gpt2Bf16Causal}" > "$out/ncu_attn.csv" 2> "$out/ncu_attn.err"
      python3 scripts/lab/ncu_summary.py "$out/ncu_attn.csv" | tee "$out/attnprof.log"
      timeout 120 python3 scripts/sdpa_default.py 16 12 1024 64 2>&1 | grep '^{' | tee -a "$out/attnprof.log" ;;
    attndetail)
      # The same ncu sections (throughput, warp stalls, top stall sites, memory) for our wgmma
      # forward and backward kernels and for cuDNN's, the third launch of each, side by side.
      secs="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats
        --section SourceCounters --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
      for k in fwd_wgmma_solo bwd_wgmma; do
        timeout 150 ncu $secs --clock-control none -k "regex:flash_$k" --launch-skip 2 --launch-count 1 "$pack/test_cuda" \
          --gtest_filter="${NCU_FILTER:-FlashAttentionPerf.Gpt2Bf16Causal}" > "$out/ncu_ours_$k.txt" 2>&1
      done
      for k in fprop bprop; do
        timeout 150 ncu $secs --clock-control none -k "regex:cudnn.*$k" --launch-skip 2 --launch-count 1 \
          python3 scripts/sdpa_default.py 16 12 1024 64 > "$out/ncu_cudnn_$k.txt" 2>&1
      done
      grep -hE "^  [a-zA-Z_]|Duration|Throughput|Issue Slots|No Eligible|Registers Per|Achieved Occ|Executed Ipc" \
        "$out"/ncu_ours_*.txt "$out"/ncu_cudnn_*.txt | head -120 ;;
    memory)
      for args in "" "--recompute selective" "--recompute block" "--recompute block:2" "--offload-activations" \
                  "--compile --compile-log"; do
        timeout 150 "$pack/blutrain" bench --device cuda --model gpt2:d12 --precision bf16 -B 16 -T 1024 --steps 20 $args \
          2>&1 | grep -E '^\{|compile|error' | tee -a "$out/memory.log" | cut -c1-400
        timeout 200 "$pack/blutrain" bench --device cuda --model llama:llama-250m --precision bf16 -B 8 -T 1024 --steps 20 \
          --lr 3e-4 --beta2 0.95 $args 2>&1 | grep -E '^\{|compile|error' | tee -a "$out/memory.log" | cut -c1-400
      done
      timeout 300 python3 .devpack/peers/torch_gpt2.py bf16,bf16c 16 1024 20 2>&1 | grep '^{' | tee -a "$out/memory.log"
      timeout 400 python3 .devpack/peers/torch_llama.py bf16,bf16c --model llama-250m -B 8 -T 1024 --steps 20 2>&1 \
        | grep '^{' | tee -a "$out/memory.log" ;;
    compiled)
      for rep in $(seq "${REPS:-2}"); do
        for args in "" "--compile"; do bench_pair compiled.log "" $args; done
      done
      grep -o '"compile":{[^}]*}' "$out/compiled.log" || true
      peers_pair compiled.log bf16,bf16c ;;
    segments)
      for rep in $(seq "${REPS:-2}"); do
        for v in " | " "BLU_COMPILE_FIRST_SEGMENT=0 | --compile" "BLU_COMPILE_FIRST_SEGMENT=4 | --compile" "BLU_COMPILE_FIRST_SEGMENT=2 | --compile"; do
          echo "== $v" >> "$out/segments.log"
          bench_pair segments.log "${v%%|*}" ${v#*|}
        done
      done
      peers_pair segments.log bf16,bf16c ;;
    recompute)
      for r in ${RECOMPUTE:-selective block:2 block}; do
        for args in "" "--compile"; do
          echo "== $r $args" >> "$out/recompute.log"
          bench_pair recompute.log "" --recompute "$r" $args
        done
      done
      peers_pair recompute.log bf16c ;;
    remat)
      # The compiler's own recompute (compiler/remat.h) against the plain compiled step, alternated
      # REPS times, then the torch.compile peers in the same call.
      for rep in $(seq "${REPS:-2}"); do
        for r in ${RECOMPUTE:-none}; do
          for args in "--compile" "--compile --compile-remat --compile-log"; do
            echo "== $r $args" >> "$out/remat.log"
            bench_pair remat.log "" --recompute "$r" $args
          done
        done
      done
      grep -h "compile: recompute" "$out/remat.log" | sort -u | cut -c1-300
      peers_pair remat.log bf16c ;;
    check)
      # performance.md's current check: the tuned compiled step of GPT-2 124M (B=16) and llama-250m
      # (B=8), as fast as it goes and in at most 0.6x of torch.compile's memory (CHECK_GPT2_LOW,
      # CHECK_LLAMA_LOW: the arguments for that), REPS (2) times in turn, with both torch.compile
      # peers before and after (their step moves from call to call, Llama's most); check.log, and a
      # table at the end: each setting's runs, their ratios to both peers, and its peaks (the most
      # allocated, and the most the allocator reserved: torch.cuda.max_memory_allocated and
      # max_memory_reserved on the peers' side) against the smaller of the peers' peaks.
      g=("$pack/blutrain" bench --device cuda --precision bf16 -T 1024 --steps 30 --compile --gemm-tune on)
      G="--model gpt2:d12 -B 16"; L="--model llama:llama-250m -B 8 --lr 3e-4 --beta2 0.95"
      low_g="${CHECK_GPT2_LOW:---compile-remat --loss-chunks 4 --master-weights split}"
      low_l="${CHECK_LLAMA_LOW:---compile-remat --loss-chunks 4 --recompute mlp-first:9 --master-weights split}"
      peers_pair check.log bf16c > /dev/null
      full_g="${CHECK_GPT2_FULL:-}"; full_l="${CHECK_LLAMA_FULL:-}"
      for rep in $(seq "${REPS:-2}"); do
        for cfg in "$G|$full_g" "$G|$low_g" "$L|$full_l" "$L|$low_l"; do
          echo "== ${cfg%%|*} ${cfg#*|}" >> "$out/check.log"
          timeout 150 "${g[@]}" ${cfg%%|*} ${cfg#*|} 2>&1 | grep -E '^\{|rror' >> "$out/check.log"
        done
      done
      peers_pair check.log bf16c > /dev/null
      python3 - "$out/check.log" <<'PY'
import json, sys
# runs: config -> [(tok/s, peak allocated MiB, peak reserved MiB)]; peers: model -> the same
cur, runs, peers = '', {}, {}
for line in open(sys.argv[1]):
    if line.startswith('=='):
        cur = line[3:].strip()
    elif line.startswith('{'):
        j = json.loads(line)
        r = (j['tok_s'], j['peak_alloc_mib'], j.get('peak_reserved_mib', 0))
        if 'peer' in j:
            peers.setdefault('llama' if 'llama' in j.get('model', '') else 'gpt2', []).append(r)
        else:
            runs.setdefault(cur, []).append(r)
    else:
        print(line.strip()[:200])
for model, ps in peers.items():
    print(f"torch.compile {model}: " + " / ".join(f"{t:,.0f}" for t, _, _ in ps) + " tok/s, allocated " +
          " / ".join(f"{m:,}" for _, m, _ in ps) + " MiB, reserved " + " / ".join(f"{r:,}" for _, _, r in ps) + " MiB")
for cfg, rs in runs.items():
    ps = peers.get('llama' if 'llama' in cfg else 'gpt2', [])
    alloc, res = max(m for _, m, _ in rs), max(r for _, _, r in rs)
    line = " / ".join(f"{t:,.0f}" for t, _, _ in rs) + f" tok/s, allocated {alloc:,} MiB, reserved {res:,} MiB"
    if ps:
        ratios = [t / p for t, _, _ in rs for p, _, _ in ps]
        line += (f": {min(ratios):.2f}-{max(ratios):.2f}x torch.compile in {alloc / min(m for _, m, _ in ps):.3f}x its"
                 f" allocated and {res / min(r for _, _, r in ps):.3f}x its reserved memory")
    print(f"{line}  ({cfg})")
PY
      ;;
    chunks)
      # The head's loss in row pieces (--loss-chunks, ops/fused.h) beside the settings in CHUNK_RUNS
      # (`;`-separated bench arguments), alternated REPS times, then the torch.compile peers.
      IFS=';' read -r -a runs <<< "${CHUNK_RUNS:---compile;--compile --loss-chunks 8;--compile --compile-remat --loss-chunks 8}"
      for rep in $(seq "${REPS:-2}"); do
        for args in "${runs[@]}"; do
          echo "== $args" >> "$out/chunks.log"
          bench_pair chunks.log "" $args
        done
      done
      peers_pair chunks.log bf16c ;;
    autobudget)
      model="${BUDGET_MODEL:-d12}"; data="${BUDGET_DATA:-.devpack/fortunes_gpt2}"
      if [ "$data" = byte ]; then
        data=/tmp/fortunes_byte
        fortunes_bytes
      fi
      for b in ${BUDGETS:-7.5 5.6 4.2}; do
        echo "-- $model --gpu-memory-budget $b ${BUDGET_ARGS:-}" | tee -a "$out/autobudget.log"
        timeout 200 "$pack/blutrain" train --model "$model" --data-dir "$data" --device cuda --precision bf16 \
          -B "${BUDGET_B:-16}" -T 1024 --steps "${BUDGET_STEPS:-40}" --lr 6e-4 --warmup 10 --log-every 10 \
          --sample-every 0 --val-every 1000 --compile --recompute auto --gpu-memory-budget "$b" \
          --out "/tmp/autobudget_${model//:/_}_$b" --overwrite ${BUDGET_ARGS:-} 2>&1 | tee -a "$out/autobudget.log" \
          | grep -E "recompute auto|predicted peak|compiled steps:|step +[0-9]+0/|peak memory|rror" | cut -c1-220
      done
      if [ "${BUDGET_PEER:-1}" = 1 ]; then
        if [ "$model" = d12 ]; then
          timeout 300 python3 .devpack/peers/torch_gpt2.py bf16c 16 1024 20 2>&1 | grep '^{' | tee -a "$out/autobudget.log"
        else
          timeout 400 python3 .devpack/peers/torch_llama.py bf16c --model "${model#llama:}" -B "${BUDGET_B:-16}" -T 1024 \
            --steps 20 2>&1 | grep '^{' | tee -a "$out/autobudget.log"
        fi
      fi ;;
    precisions)
      for rep in $(seq "${REPS:-1}"); do
        for p in ${PRECISIONS:-fp32 tf32}; do
          for args in "" "--compile"; do
            timeout 150 "$pack/blutrain" bench --device cuda --model gpt2:d12 --precision "$p" -B 16 -T 1024 --steps 10 \
              $args 2>&1 | grep -E '^\{|rror' | tee -a "$out/precisions.log" | cut -c1-200
            timeout 200 "$pack/blutrain" bench --device cuda --model llama:llama-250m --precision "$p" -B 8 -T 1024 \
              --steps 10 --lr 3e-4 --beta2 0.95 $args 2>&1 | grep -E '^\{|rror' | tee -a "$out/precisions.log" | cut -c1-200
          done
        done
      done ;;
    fuseexport)
      timeout 150 "$pack/blutrain" bench --device cuda --model gpt2:d12 --precision bf16 -B 16 -T 1024 --steps 3 \
        --compile --compile-log --compile-export "$out/graphs" 2>&1 | grep -E 'fusion plan|^\{|rror' | cut -c1-400
      timeout 200 "$pack/blutrain" bench --device cuda --model llama:llama-250m --precision bf16 -B 8 -T 1024 --steps 3 \
        --lr 3e-4 --beta2 0.95 --compile --compile-log --compile-export "$out/graphs" 2>&1 \
        | grep -E 'fusion plan|^\{|rror' | cut -c1-400
      [ "$fused_model" = d12 ] || fortunes_bytes
      timeout 200 "$pack/blutrain" "${fusedtext_args[@]}" --steps 2 --out /tmp/fuseexport_train --compile --compile-log \
        --compile-export "$out/graphs" 2>&1 | grep -E 'fusion plan|rror' | cut -c1-400
      ls -la "$out/graphs" ;;
    fused)
      export BLU_KERNEL_CACHE="$PWD/.devpack/kcache"
      for rep in $(seq "${REPS:-2}"); do
        for args in "" "--compile --compile-fuse off" "--compile --compile-log"; do
          bench_pair fused.log "" $args
        done
      done
      peers_pair fused.log bf16,bf16c ;;
    fusedtext)
      export BLU_KERNEL_CACHE="$PWD/.devpack/kcache"
      [ "$fused_model" = d12 ] || fortunes_bytes
      IFS=';' read -r -a runs <<< "${FUSED_RUNS:---seed 1337;--seed 7;--seed 1337 --compile --compile-log}"
      for args in "${runs[@]}"; do
        echo "-- $args"
        timeout 300 "$pack/blutrain" "${fusedtext_args[@]}" --steps "${FUSED_STEPS:-250}" --val-every "${FUSED_STEPS:-250}" \
          --out "/tmp/fusedtext_${args// /_}" --overwrite $args 2>&1 | tee -a "$out/fusedtext.log" \
          | grep -E "val loss|fusion:|fusion plan|recompute:|compiled steps|step +${FUSED_STEPS:-250}/|rror" | cut -c1-300 | tail -7
      done ;;
    offload)
      GRID=0 PEERS="$PWD/.devpack/peers" timeout 580 bash scripts/offload_bench.sh "$pack" 2>&1 | tee "$out/offload.log" | tail -30 ;;
    planner1)
      IFS=';' read -r -a layouts <<< "${PLAN_LAYOUTS:-replicate(1);pipeline(1, micro=2)}"
      for m in ${PLAN_MODELS:-gpt2:d12 gpt2:d24 llama:llama-250m}; do
        for l in "${layouts[@]}"; do
          echo -n "$m $l " | tee -a "$out/planner1.log"
          timeout 200 "$pack/blutrain" bench --device cuda --precision bf16 --model "$m" -B "${PLAN_B:-8}" -T 1024 \
            --steps "${STEPS:-10}" --parallel "$l" 2>&1 | tee -a "$out/planner1.log" | grep -E '^\{|rror' | tail -1 \
            | python3 -c 'import json,sys
for line in sys.stdin:
    if not line.startswith("{"): print(line.strip()); continue
    j = json.loads(line); p = j["predicted"]; e = j["error"]
    print("step %.2f ms (predicted %.2f, error %+.1f%%), peak %d MiB (predicted %.0f, error %+.1f%%), %d tok/s" % (
        j["step_ms"], p["step_ms"], 100 * e["step"], j["peak_alloc_mib"], p["memory_mib"], 100 * e["memory"], j["tok_s"]))'
        done
      done ;;
    demo)
      mkdir -p /tmp/demobuild && ln -sf "$pack/blutrain" /tmp/demobuild/blutrain
      BUILD=/tmp/demobuild FORTUNES="$PWD/.devpack/fortunes" timeout 500 bash scripts/demo.sh 2>&1 \
        | tee "$out/demo.log" | grep -vE "^step .*(00|50)/" | tail -60
      cp -r runs/demo "$out/demo_run" 2>/dev/null || true ;;
    attnsass)
      for k in fwd_wgmma_solo bwd_wgmma; do
        timeout 200 ncu --section SourceCounters --section WarpStateStats --section InstructionStats \
          --import-source no --clock-control none -k "regex:flash_$k" --launch-skip 2 --launch-count 1 \
          -f -o "/tmp/sass_$k" "$pack/test_cuda" --gtest_filter="${NCU_FILTER:-FlashAttentionPerf.Gpt2Bf16Causal}" \
          > "$out/ncu_sass_$k.log" 2>&1
        ncu -i "/tmp/sass_$k.ncu-rep" --page source --csv --print-source sass > "$out/sass_$k.csv" 2>> "$out/ncu_sass_$k.log"
        tail -3 "$out/ncu_sass_$k.log"; wc -l "$out/sass_$k.csv"; head -c 600 "$out/sass_$k.csv"; echo
      done ;;
  esac
done

#!/usr/bin/env bash
# scripts/offload_bench.sh: the optimizer-state offload measurements on one GPU (docs/offload.md),
# BluTrain beside PyTorch in one run. Prints one JSON line per measurement:
#   1. GPT-2 d48 (1.5B), bf16, B=8, T=1024: AdamW state on the GPU vs on the host (update on the
#      CPU and streamed through the GPU; with the fp32 masters, and their gradients, on the host
#      too), at 64K tokens per optimizer step (8 micro-batches) and at B=8 without accumulation —
#      tok/s and device bytes per parameter (bench's JSON);
#   2. ../shared/peers/torch_parallel.py fsdp_offload (FSDP2, CPU offload) under torchrun with one
#      process, same model and batch;
#   3. a grid of GPT shapes (widths x depths, B=8, T=1024): the largest that trains with its state
#      offloaded (BluTrain: --offload-state $STATE, default master+grads, with --recompute
#      $RECOMPUTE, default block), and the largest that trains in PyTorch eager (bf16 autocast,
#      fused AdamW: scripts/torch_gpt_grid.py), each shape tried in its own process. The host
#      holds 16 bytes per parameter in every offload layout: it binds near 8B on a 125 GiB host.
# Usage (on the GPU machine, from the repository root, after a CUDA build in build-cuda):
#   scripts/offload_bench.sh [BUILD_DIR]      env: STEPS (default 6), GRID=0 to skip the grid,
#                                             WIDTHS, DEPTHS, STATE, RECOMPUTE (the grid's)
set -u
BUILD=${1:-build-cuda}
BIN=$BUILD/blutrain
STEPS=${STEPS:-6}
PY=${PYTHON:-python3}
PEERS=${PEERS:-$(cd "$(dirname "$0")/.." && pwd)/../shared/peers}
[ -x "$BIN" ] || { echo "offload_bench: no $BIN (build first)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2

bench() { "$BIN" bench --device cuda --precision bf16 -B 8 -T 1024 --steps "$STEPS" "$@" 2>&1 | tail -1; }

echo "# 1. d48, 64K tokens per optimizer step (B=8 x T=1024 x 8 micro-batches)"
bench --model gpt2:d48 --grad-accum 8
bench --model gpt2:d48 --grad-accum 8 --offload-state optimizer --offload-update cpu
bench --model gpt2:d48 --grad-accum 8 --offload-state optimizer --offload-update gpu
bench --model gpt2:d48 --grad-accum 8 --offload-state master --offload-update cpu
bench --model gpt2:d48 --grad-accum 8 --offload-state master+grads --offload-update cpu
echo "# 1b. d48, B=8 without accumulation (the state's transfers dominate)"
bench --model gpt2:d48
bench --model gpt2:d48 --offload-state optimizer --offload-update cpu
bench --model gpt2:d48 --offload-state optimizer --offload-update gpu
bench --model gpt2:d48 --offload-state master --offload-update cpu
bench --model gpt2:d48 --offload-state master+grads --offload-update cpu

echo "# 2. PyTorch FSDP2 with CPU offload, one process"
torchrun --standalone --nproc_per_node 1 "$PEERS/torch_parallel.py" fsdp_offload --model d48 -B 8 -T 1024 \
  --steps "$STEPS" 2>&1 | tail -3

[ "${GRID:-1}" = 0 ] && exit 0
echo "# 3. grid: widths x depths of the GPT family, B=8, T=1024"
WIDTHS=${WIDTHS:-"1600 2048 2560 3200 4096"}
DEPTHS=${DEPTHS:-"24 36 48 64 80"}
TMP=$(mktemp -d)
for w in $WIDTHS; do
  for d in $DEPTHS; do
    h=$((w / 128))
    cfg=$TMP/gpt_${d}x${w}/config.json
    mkdir -p "$(dirname "$cfg")"
    printf '{"model_type": "gpt2", "n_layer": %d, "n_embd": %d, "n_head": %d, "vocab_size": 50304, "n_positions": 1024}\n' \
      "$d" "$w" "$h" > "$cfg"
    echo "## ${d} x ${w}"
    timeout 900 "$BIN" bench --model "$cfg" --device cuda --precision bf16 -B 8 -T 1024 --steps 4 \
      --offload-state "${STATE:-master+grads}" --offload-update cpu --recompute "${RECOMPUTE:-block}" 2>&1 | tail -1
    timeout 900 $PY "$(dirname "$0")/torch_gpt_grid.py" --depth "$d" --width "$w" -B 8 -T 1024 --steps 4 2>&1 | tail -1
  done
done
rm -rf "$TMP"

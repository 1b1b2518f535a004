#!/usr/bin/env bash
# scripts/offload_bench.sh: the optimizer-state offload measurements on one GPU (docs/offload.md),
# BluTrain beside PyTorch in one run. Prints one JSON line per measurement:
#   1. GPT-2 d48 (1.5B), bf16, B=8, T=1024: AdamW state on the GPU vs on the host (update on the
#      CPU and streamed through the GPU; with the fp32 masters, and their gradients, on the host
#      too), at 64K tokens per optimizer step (8 micro-batches) and at B=8 without accumulation —
#      tok/s and device bytes per parameter (bench's JSON);
#   2. ../shared/peers/torch_parallel.py fsdp_offload (FSDP2, CPU offload) under torchrun with one
#      process, same model and batch;
#   3. a grid of GPT shapes (widths x depths, heads of 128, B=8, T=1024): the largest that trains
#      with its state offloaded (BluTrain: --offload-state $STATE, default master, with --recompute
#      $RECOMPUTE, default block), and the largest that trains in PyTorch eager (bf16 autocast,
#      fused AdamW: scripts/torch_gpt_grid.py), each shape tried in its own process. The host
#      holds 12 bytes per parameter with the cpu update (16 with master+grads): it binds near 10B
#      on a 125 GiB host.
# Usage (on the GPU machine, from the repository root, after a CUDA build in build-cuda):
#   scripts/offload_bench.sh [BUILD_DIR]      env: STEPS (default 6), GRID=0 to skip the grid,
#                                             ROWS (rows 1 and 1b: none, STATE:UPDATE[:overlap] ...;
#                                             empty: none), PEER=0 to skip row 2,
#                                             WIDTHS, DEPTHS, SHAPES, TORCH_SHAPES, STATE,
#                                             RECOMPUTE, GRID_STEPS, GRID_ARGS (the grid's)
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
# Each row: none (everything on the GPU) or STATE:UPDATE (--offload-state STATE --offload-update UPDATE),
# STATE:cpu:overlap the host update's blocks behind the next forward (--offload-overlap).
ROWS=${ROWS:-"none optimizer:cpu optimizer:gpu master:cpu master:cpu:overlap master+grads:cpu"}
row_args() {
  [ "$1" = none ] && return
  local state=${1%%:*} rest=${1#*:}
  echo "--offload-state $state --offload-update ${rest%%:*}"
  [ "${rest#*:}" = overlap ] && echo "--offload-overlap"
}

echo "# 1. d48, 64K tokens per optimizer step (B=8 x T=1024 x 8 micro-batches)"
for r in $ROWS; do bench --model gpt2:d48 --grad-accum 8 $(row_args "$r"); done
echo "# 1b. d48, B=8 without accumulation (the state's transfers dominate)"
for r in $ROWS; do bench --model gpt2:d48 $(row_args "$r"); done

if [ "${PEER:-1}" != 0 ]; then
echo "# 2. PyTorch FSDP2 with CPU offload, one process"
torchrun --standalone --nproc_per_node 1 "$PEERS/torch_parallel.py" fsdp_offload --model d48 -B 8 -T 1024 \
  --steps "$STEPS" 2>&1 | tail -3
fi

[ "${GRID:-1}" = 0 ] && exit 0
echo "# 3. grid: widths x depths of the GPT family, B=8, T=1024"
# SHAPES (DEPTHxWIDTH ...) tries those points of the grid for BluTrain, TORCH_SHAPES for PyTorch;
# by default every point of WIDTHS x DEPTHS for both.
WIDTHS=${WIDTHS:-"2048 2560 3200 3840"}
DEPTHS=${DEPTHS:-"24 36 48 56 64"}
ALL=""
for w in $WIDTHS; do for d in $DEPTHS; do ALL="$ALL ${d}x${w}"; done; done
TMP=$(mktemp -d)
config() {  # DEPTHxWIDTH -> a config.json (heads of 128)
  local d=${1%x*} w=${1#*x} cfg=$TMP/gpt_$1/config.json
  mkdir -p "$(dirname "$cfg")"
  printf '{"model_type": "gpt2", "n_layer": %d, "n_embd": %d, "n_head": %d, "vocab_size": 50304, "n_positions": 1024}\n' \
    "$d" "$w" "$((w / 128))" > "$cfg"
  echo "$cfg"
}
for s in ${SHAPES:-$ALL}; do
  echo "## BluTrain ${s}"
  log=$(timeout 900 "$BIN" bench --model "$(config "$s")" --device cuda --precision bf16 -B 8 -T 1024 \
    --steps "${GRID_STEPS:-4}" --offload-state "${STATE:-master}" --offload-update cpu --recompute "${RECOMPUTE:-block}" \
    ${GRID_ARGS:-} 2>&1)
  rc=$?
  echo "$log" | tail -1
  [ "$rc" = 0 ] || echo "exit $rc (137: killed, e.g. by the kernel's out-of-memory killer)"
  free -g | sed -n 2p
done
for s in ${TORCH_SHAPES:-$ALL}; do
  echo "## PyTorch eager ${s}"
  timeout 900 $PY "$(dirname "$0")/torch_gpt_grid.py" --depth "${s%x*}" --width "${s#*x}" -B 8 -T 1024 \
    --steps "${GRID_STEPS:-4}" 2>&1 | tail -1
done
rm -rf "$TMP"

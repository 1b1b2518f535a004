#!/usr/bin/env bash
# The README's main job: train the "demo" GPT (4 layers, 128 wide) on Debian's fortunes for about
# three minutes on a 2-core CPU, then sample from it.
#   1. the GPT-2 vocabulary (scripts/fetch_gpt2_vocab.sh, idempotent)
#   2. shards of /usr/share/games/fortunes into data/fortunes (once)
#   3. blutrain train into runs/demo (replaced on every run of this script: --overwrite)
#   4. blutrain sample from runs/demo
# Usage: scripts/demo.sh [extra train flags, e.g. --steps 50]
# Env: BUILD (default: build), FORTUNES (default: /usr/share/games/fortunes).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
build="${BUILD:-build}"
bin="$build/blutrain"
fortunes="${FORTUNES:-/usr/share/games/fortunes}"

if [[ ! -x "$bin" ]]; then
  echo "error: $bin not found; build it first:" >&2
  echo "  cmake -S . -B $build -G Ninja && ninja -C $build blutrain" >&2
  exit 1
fi

scripts/fetch_gpt2_vocab.sh

if ! compgen -G "data/fortunes/fortunes_train_*.bin" >/dev/null; then
  if [[ ! -d "$fortunes" ]]; then
    echo "error: $fortunes not found (Debian: apt-get install fortunes)" >&2
    exit 1
  fi
  "$bin" prepare --input "$fortunes" --out data/fortunes --name fortunes --val-fraction 0.05
fi

# On a machine whose blutrain was built with CUDA and that has a GPU, train there in bf16 with a
# bigger batch and more steps (a few seconds a hundred steps); else the CPU settings.
device_args=(--device cpu --batch-size 4 --seq-len 128 --steps 200)
if "$bin" info 2>/dev/null | grep -qE '^  cuda:0 '; then
  device_args=(--device cuda --precision bf16 --batch-size 32 --seq-len 128 --steps 1000)
  echo "demo: training on the GPU"
fi

"$bin" train \
  --data-dir data/fortunes \
  --model demo \
  "${device_args[@]}" \
  --lr 2e-3 --min-lr 2e-4 --warmup 10 --schedule cosine \
  --weight-decay 0.1 --grad-clip 1.0 \
  --val-every 50 --val-batches 10 \
  --sample-every 50 --sample-tokens 40 \
  --ckpt-every 100 --log-every 10 \
  --out runs/demo --overwrite \
  "$@"

"$bin" sample --ckpt runs/demo "${device_args[@]:0:2}" --prompt "The" --max-new-tokens 64 --temperature 0.8 --top-k 40 --seed 7

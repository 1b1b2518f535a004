#!/usr/bin/env bash
# The README's first run: train a small byte-level GPT (gpt2:demo-byte, 4 layers, 128 wide, 257
# token ids) on Debian's fortunes for about three minutes on a 2-core CPU, print the run's
# baselines beside its validation loss, keep the best-validation checkpoint, then sample from it.
# On a machine whose blutrain has CUDA and a GPU: gpt2:demo-byte-gpu (6 layers, 384 wide) in bf16
# for a few minutes instead.
#   1. byte-level shards of /usr/share/games/fortunes into data/fortunes-byte (once; the folder's
#      shards.json records the tokenizer, so train and sample need no tokenizer flag)
#   2. blutrain train into runs/demo (replaced on every run of this script: --overwrite)
#   3. blutrain sample from runs/demo/best.safetensors, also written to runs/demo/sample.txt
#   4. scripts/check_first_run.py: val loss vs the bigram baseline, sampled words found in the corpus
# Usage: scripts/demo.sh [extra train flags, e.g. --steps 50]
# Env: BUILD (default: build), FORTUNES (default: /usr/share/games/fortunes).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
build="${BUILD:-build}"
bin="$build/blutrain"
fortunes="${FORTUNES:-/usr/share/games/fortunes}"
data=data/fortunes-byte

if [[ ! -x "$bin" ]]; then
  echo "error: $bin not found; build it first:" >&2
  echo "  cmake -S . -B $build -G Ninja && ninja -C $build blutrain" >&2
  exit 1
fi

if [[ ! -f "$data/shards.json" ]] || ! compgen -G "$data/fortunes_train_*.bin" >/dev/null; then
  if [[ ! -d "$fortunes" ]]; then
    echo "error: $fortunes not found (Debian: apt-get install fortunes)" >&2
    exit 1
  fi
  "$bin" prepare --input "$fortunes" --out "$data" --name fortunes --val-fraction 0.05 --tokenizer byte --overwrite
fi

# OpenMP threads that sleep instead of spinning while they wait: on a 2-core machine that also
# runs anything else, spinning threads cost several times the step time.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"

device_args=(--device cpu)
# --block-size 64: the model's positions are the trained ones, so a sample longer than 64 bytes
# slides over trained positions instead of reaching untrained ones.
train_args=(--model gpt2:demo-byte --block-size 64 --batch-size 16 --seq-len 64 --steps 1700 --lr 3e-3 --min-lr 3e-4
            --warmup 50 --val-every 250 --sample-every 500 --log-every 100 --shuffle)
if "$bin" info 2>/dev/null | grep -qE '^  cuda:0 '; then
  device_args=(--device cuda)
  train_args=(--model gpt2:demo-byte-gpu --precision bf16 --batch-size 64 --seq-len 256 --steps 3000 --lr 1e-3
              --min-lr 1e-4 --warmup 100 --val-every 250 --sample-every 1000 --log-every 100 --shuffle)
  echo "demo: training on the GPU"
fi

"$bin" train \
  --data-dir "$data" \
  "${device_args[@]}" "${train_args[@]}" \
  --schedule cosine --weight-decay 0.1 --grad-clip 1.0 \
  --val-batches 10 --keep-best \
  --sample-tokens 200 --ckpt-every 0 \
  --out runs/demo --overwrite \
  "$@"

echo
echo "--- sample from runs/demo/best.safetensors ---"
"$bin" sample --ckpt runs/demo/best.safetensors "${device_args[@]}" --max-new-tokens 400 --temperature 0.5 \
  --top-k 40 --seed 7 | tee runs/demo/sample.txt

if [[ -x /usr/bin/python3 ]]; then
  echo
  /usr/bin/python3 scripts/check_first_run.py runs/demo --corpus "$fortunes" --sample-file runs/demo/sample.txt || true
fi

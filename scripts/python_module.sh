#!/usr/bin/env bash
# Builds the blutrain Python module for another Python than the build's (the GPU machine runs
# Python 3.12; Debian's is 3.11): python/blutrain_module.cpp compiled against PYTHON's headers, and
# linked with the library objects of BUILD (configured with BLU_PYTHON=ON, so they are
# position-independent; a CUDA build gives the CUDA module), xz-compressed into OUT (e.g.
# .devpack/python, carried by the device tool; gpu_two.sh python unpacks it and finds the host
# libraries it loads in gpu_pack.sh's pack).
#   bash scripts/python_module.sh PYTHON OUT [BUILD]
#   bash scripts/python_module.sh ~/.pyenv/versions/3.12.1/bin/python3 .devpack/python build
set -euo pipefail
cd "$(dirname "$0")/.."
py="$1" out="$2" build="${3:-build}"
inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
[ -f "$inc/Python.h" ] || { echo "python_module.sh: no Python.h under $inc" >&2; exit 2; }
objs=$(find "$build/CMakeFiles/blutrain_lib.dir" -name '*.o' | sort)
[ -n "$objs" ] || { echo "python_module.sh: no library objects under $build (build it first)" >&2; exit 2; }
defs=$(sed -n '/blutrain_module.cpp.o:/,/^$/p' "$build/build.ninja" | sed -n 's/^ *DEFINES = //p' | head -1)
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
eval "defs=($defs)"  # the build's quoting (-DBLU_VERSION=\"0.1.0\")
g++ -std=c++20 -O2 -fPIC -fvisibility=hidden -fopenmp "${defs[@]}" -Isrc -isystem "$inc" -isystem /usr/local/cuda/include \
  -c python/blutrain_module.cpp -o "$tmp/module.o"
libs=$(sed -n '/^build python\/blutrain/,/^$/p' "$build/build.ninja" | sed -n 's/^ *LINK_LIBRARIES = //p' | head -1)
# shellcheck disable=SC2086
g++ -shared -flto=auto -fopenmp -o "$out/blutrain$suffix" "$tmp/module.o" $objs $libs -L/usr/local/cuda/lib -Wl,-rpath,'$ORIGIN'
strip "$out/blutrain$suffix"
# Compressed for the device tool's 64 MiB; the host libraries it loads come from gpu_pack.sh's pack.
xz -f -T0 "$out/blutrain$suffix"
du -sh "$out"

# Sourced by the GPU machine's scripts (gpu_run.sh, gpu_two.sh) from the repo root with .devpack
# carried (scripts/gpu_pack.sh): unpacks the prebuilt binaries and the host libraries they need into
# $pack, puts them on LD_LIBRARY_PATH (NCCL, too large to carry, from PyTorch's wheels when the
# system has none), points BLU_GPT2_VOCAB_DIR at the carried GPT-2 vocabulary and sets $out (the
# device tool's $OUT, or /tmp/out).
pack=/tmp/blupack
mkdir -p "$pack" && tar -xJf .devpack/devpack.tar.xz -C "$pack"
export LD_LIBRARY_PATH="$pack:${LD_LIBRARY_PATH:-}"
# NCCL is too large to carry: use the one PyTorch's wheels bring if the system has none. cuBLASLt is
# loaded at run time (backend/cuda/runtime.h: beside the CUDA runtime, else from the library search
# path), so ldd does not list it: look for it beside the runtime ldd resolves, or in ld.so's cache.
cudart="$(ldd "$pack/blutrain" | awk '/libcudart\.so/ {print $3}')"
lt="libcublasLt.so.${cudart##*.so.}"
if ldd "$pack/blutrain" | grep -q "not found" ||
   { [ ! -e "$(dirname "${cudart:-/none/x}")/$lt" ] && ! ldconfig -p | grep -q "$lt"; }; then
  for mod in nvidia.nccl nvidia.cu13 nvidia.cublas nvidia.cuda_runtime; do
    d=$(python3 -c "import importlib; print(list(importlib.import_module('$mod').__path__)[0] + '/lib')" 2>/dev/null) &&
      [ -d "$d" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
  done
  ldd "$pack/blutrain" | grep "not found" || true
fi
out="${OUT:-/tmp/out}"
mkdir -p "$out"
[ -f .devpack/gpt2_vocab/encoder.json ] && export BLU_GPT2_VOCAB_DIR="$PWD/.devpack/gpt2_vocab"

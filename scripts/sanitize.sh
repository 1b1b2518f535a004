#!/usr/bin/env bash
# Sanitizer builds of the CPU code (clang, no CUDA, no Python module; docs/reliability.md):
#   bash scripts/sanitize.sh asan quick   # ASan+UBSan: io, data, store tests; every fuzz corpus + 5 s each
#   bash scripts/sanitize.sh tsan quick   # TSan: store, loader and Gloo process-group tests
#   bash scripts/sanitize.sh MODE rotate  # one share of the remaining tests, picked by the commit hash
#   bash scripts/sanitize.sh MODE full    # quick and every share
# asan builds in build-asan (with the fuzz targets of fuzz/), tsan in build-tsan; both through
# ccache. A sanitizer report fails the run (-fno-sanitize-recover, halt_on_error).
# BLU_SAN_SHARE=K picks share K instead of the commit hash's; BLU_FUZZ_SECONDS sets the fuzzing
# time per target (5).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
mode="${1:?asan or tsan}" scope="${2:-quick}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}"
jobs="${BLU_JOBS:-$(nproc)}"
common=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ -DBLU_CUDA=OFF -DBLU_PYTHON=OFF
        -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# One OpenMP thread per process: Debian's libomp is not built for TSan, and the tests' ranks are
# processes of their own.
export OMP_NUM_THREADS=1
case "$mode" in
  asan)
    build=build-asan
    cmake -S . -B "$build" "${common[@]}" -DBLU_SANITIZE=address,undefined -DBLU_FUZZ=ON >/dev/null
    export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
    quick=("io:*" "data:*" "dist:TcpStore*")
    # The remaining shares (a share per push in CI). The dist tests are two (~100 s each under ASan
    # on a 2-core machine: pipelines, tensor parallelism, the planner and launches; the rest).
    shares=("core:*" "memory:*" "autograd:*" "nn:*" "optim:*" "ops:*" "train:*" "gpt2:*" "models:*"
            "dist:Pipeline*:TensorParallel*:Planner*:Launch*:GlooCollectives*"
            "dist:-TcpStore*:Pipeline*:TensorParallel*:Planner*:Launch*:GlooCollectives*" "offload:*"
            "compiler:Compiler*:FusionPlan*:Epilogue*")
    ;;
  tsan)
    build=build-tsan
    cmake -S . -B "$build" "${common[@]}" -DBLU_SANITIZE=thread >/dev/null
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
    # Suppressions, each with its reason, once a run shows which are needed (libgloo is not
    # instrumented).
    [ ! -f .ci/tsan.supp ] || TSAN_OPTIONS+=":suppressions=$root/.ci/tsan.supp"
    quick=("dist:TcpStore*:GlooCollectives*:DistWorker*" "data:Loader*:NgramBaselineLoader*" "offload:Offload.UpdateBehind*")
    shares=("dist:DataParallel*:Ddp*:Consistency*:DistStartup*" "dist:Zero*:Sharded*:Hetero*"
            "dist:Pipeline*:TensorParallel*:Annotations*:Planner*" "dist:DistCli*:Launch*:DistEnv*:DeviceMesh*")
    ;;
  *) echo "sanitize.sh: expected asan or tsan, got '$mode'" >&2; exit 2 ;;
esac

case "$scope" in
  quick) sets=("${quick[@]}") ;;
  rotate)
    hash="$(git rev-parse HEAD 2>/dev/null || echo 0)"
    k="${BLU_SAN_SHARE:-$((16#${hash:0:6} % ${#shares[@]}))}"
    echo "sanitize.sh: $mode share $k of ${#shares[@]}: ${shares[$k]}"
    sets=("${shares[$k]}") ;;
  full) sets=("${quick[@]}" "${shares[@]}") ;;
  *) echo "sanitize.sh: expected quick, rotate or full, got '$scope'" >&2; exit 2 ;;
esac

targets=()
for s in "${sets[@]}"; do targets+=("test_${s%%:*}"); done
if [ "$mode" = asan ] && [ "$scope" != rotate ]; then
  mapfile -t fuzzers < <(cd fuzz && ls *.cpp | sed 's/\.cpp$//')
  for f in "${fuzzers[@]}"; do targets+=("fuzz_$f"); done
fi
mapfile -t targets < <(printf '%s\n' "${targets[@]}" | sort -u)
cmake --build "$build" -j"$jobs" --target "${targets[@]}"

failed=()
for s in "${sets[@]}"; do
  bin="test_${s%%:*}" filter="${s#*:}"
  echo "sanitize.sh: $mode $bin --gtest_filter=$filter"
  (cd "$build/tests" && "./$bin" --gtest_filter="$filter" --gtest_brief=1) || failed+=("$bin:$filter")
done
if [ "$mode" = asan ] && [ "$scope" != rotate ]; then
  for f in "${fuzzers[@]}"; do
    bash scripts/fuzz.sh "$build" "$f" "${BLU_FUZZ_SECONDS:-5}" || failed+=("fuzz_$f")
  done
fi
if ((${#failed[@]})); then
  echo "sanitize.sh: $mode FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "sanitize.sh: $mode $scope passed"

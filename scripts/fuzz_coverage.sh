#!/usr/bin/env bash
# Line coverage of a parser under its fuzz target's corpus: compiles the target and the parser's
# source files with clang's source-based coverage (linking the rest from an ASan build's objects),
# runs every input of the corpus once, and prints llvm-cov's report for those files and the lines
# no input ran.
#   bash scripts/fuzz_coverage.sh BUILD_DIR NAME CORPUS_DIR SOURCE...
#   bash scripts/fuzz_coverage.sh build-asan safetensors /tmp/corpus/safetensors src/blu/io/safetensors.cpp
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "$1" && pwd)" name="$2" corpus="$3"
shift 3
cd "$root"
work="$(mktemp -d "${TMPDIR:-/tmp}/blu-fuzzcov-XXXXXX")"
trap 'rm -rf "$work"' EXIT
# The build's objects minus the ones compiled here, linked whole as the fuzz target links them:
# the model families register themselves from static initialisers nothing else references.
objs=()
while IFS= read -r o; do
  skip=0
  for s in "$@"; do [[ "$o" == *"/$s.o" ]] && skip=1; done
  ((skip)) || objs+=("$o")
done < <(find "$build/CMakeFiles/blutrain_lib.dir" -name '*.o')
llvm-ar rcs "$work/rest.a" "${objs[@]}"
flags=(-std=c++20 -O1 -g -fsanitize=address,undefined -fprofile-instr-generate -fcoverage-mapping -Isrc
       -I/usr/include/x86_64-linux-gnu/openblas-pthread -DBLU_VERSION=\"0.1.0\" -DBLU_SOURCE_DIR=\"$root\")
cov_objs=()
for s in "$@"; do
  o="$work/${s//\//_}.o"  # by path: two sources may share a name (models/*/hf.cpp)
  clang++ "${flags[@]}" -c "$s" -o "$o"
  cov_objs+=("$o")
done
clang++ "${flags[@]}" -fsanitize=fuzzer "fuzz/$name.cpp" "${cov_objs[@]}" -Wl,--whole-archive "$work/rest.a" -Wl,--no-whole-archive \
  -lxxhash -lcrypto -lz -lgloo -lopenblas -fopenmp -lpthread -o "$work/cov"
LLVM_PROFILE_FILE="$work/cov.profraw" "$work/cov" -runs=0 "$corpus" "fuzz/corpus/$name" >"$work/run.log" 2>&1 ||
  { tail -20 "$work/run.log"; exit 1; }
llvm-profdata merge -sparse "$work/cov.profraw" -o "$work/cov.profdata"
# BLU_COV_FUNCTIONS=1: per function (a file that holds more than the parser).
llvm-cov report "$work/cov" -instr-profile="$work/cov.profdata" ${BLU_COV_FUNCTIONS:+-show-functions} "$@"
# The lines the corpus never ran, to compare with what the parser's own tests reach.
llvm-cov show "$work/cov" -instr-profile="$work/cov.profdata" "$@" | grep -E '^ +[0-9]+\| +0\|' || true

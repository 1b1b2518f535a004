#!/usr/bin/env bash
# Replays a fuzz target's seed corpus (fuzz/corpus/NAME/), then fuzzes it for SECONDS, on one core.
# New inputs go to a temporary folder (or $BLU_FUZZ_CORPUS/NAME, kept, e.g. for a coverage report),
# never into the repository; a crash leaves its input in $BLU_FUZZ_ARTIFACTS (default: the build's
# fuzz/artifacts/) and fails.
#   bash scripts/fuzz.sh BUILD_DIR NAME [SECONDS] [extra libFuzzer flags...]
#   bash scripts/fuzz.sh build-asan safetensors 0          # replay only
#   bash scripts/fuzz.sh build-asan safetensors 3600 -runs=10000000
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$1" name="$2" seconds="${3:-5}"
shift $(($# < 3 ? $# : 3))
bin="$build/fuzz/fuzz_$name"
seeds="$root/fuzz/corpus/$name"
[ -x "$bin" ] || { echo "fuzz.sh: no $bin (configure with -DBLU_FUZZ=ON and build it)" >&2; exit 2; }
[ -d "$seeds" ] || { echo "fuzz.sh: no seed corpus $seeds" >&2; exit 2; }
artifacts="${BLU_FUZZ_ARTIFACTS:-$build/fuzz/artifacts}/$name"
mkdir -p "$artifacts"
work="$(mktemp -d "${TMPDIR:-/tmp}/blu-fuzz-corpus-XXXXXX")"
trap 'rm -rf "$work"' EXIT
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# Replay: every seed once (files as arguments: libFuzzer only runs them).
mapfile -t files < <(find "$seeds" -type f | sort)
"$bin" -rss_limit_mb=2048 "${files[@]}" > "$work/replay.log" 2>&1 || { cat "$work/replay.log"; exit 1; }
echo "fuzz.sh: $name replayed ${#files[@]} seed(s)"
if [ "$seconds" -gt 0 ]; then
  corpus="$work/corpus"
  [ -z "${BLU_FUZZ_CORPUS:-}" ] || corpus="$BLU_FUZZ_CORPUS/$name"
  mkdir -p "$corpus"
  "$bin" -max_total_time="$seconds" -rss_limit_mb=2048 -max_len=65536 -timeout=20 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "$@" "$corpus" "$seeds" 2>&1 | grep -v "^#[0-9]*.*\(NEW\|REDUCE\|pulse\)" | tail -40
  exit "${PIPESTATUS[0]}"
fi

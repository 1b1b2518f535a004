#!/usr/bin/env bash
# Everything CI runs in shares, at once — run before an issue is resolved (docs/reliability.md):
# the Release build and CPU suite, the whole CPU suite's sanitizer shares under ASan+UBSan and the
# threaded tests under TSan, and BLU_FUZZ_SECONDS (default 300) of fuzzing per target.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
bash scripts/setup.sh
bash scripts/test.sh
echo "ci_full: release took $((SECONDS - t0)) s"
t1=$SECONDS
BLU_FUZZ_SECONDS="${BLU_FUZZ_SECONDS:-300}" bash scripts/sanitize.sh asan full
echo "ci_full: asan took $((SECONDS - t1)) s"
t2=$SECONDS
bash scripts/sanitize.sh tsan full
echo "ci_full: tsan took $((SECONDS - t2)) s"
echo "ci_full: all took $SECONDS s"

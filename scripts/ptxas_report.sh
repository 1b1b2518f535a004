#!/usr/bin/env bash
# Registers, shared memory and spills of every kernel in one CUDA source, compiled as the CUDA
# build compiles it (needs build-cuda/compile_commands.json). Usage: scripts/ptxas_report.sh FILE [filter]
set -euo pipefail
file=$(realpath "$1"); filter="${2:-.}"
cmd=$(python3 -c "
import json, sys
for e in json.load(open('build-cuda/compile_commands.json')):
    if e['file'] == sys.argv[1]: print(e['command'])" "$file")
[ -n "$cmd" ] || { echo "ptxas_report: $file is not in build-cuda/compile_commands.json" >&2; exit 1; }
cmd="${cmd%% -o *} -o /tmp/ptxas_report.o -Xptxas -v"
(cd build-cuda && eval "$cmd") 2>&1 | awk '/Compiling entry function/ {fn=$0} /Used [0-9]+ registers/ {print fn " :: " $0}' \
  | sed -E "s/.*entry function '([^']*)'.*:: ptxas info *: /\1 /" | c++filt | grep -E "$filter" || true

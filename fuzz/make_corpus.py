#!/usr/bin/env python3
"""Writes the seed corpora of fuzz/corpus/<target>/: a few small valid inputs per parser (and the
committed legacy checkpoints of tests/train/data), so each fuzzer starts from inputs that reach
deep into its parser. Run from anywhere: python3 fuzz/make_corpus.py (writes its seeds over the folders' files of the
same names; inputs added by hand, the reproducers of past findings, stay)."""
import json, os, struct

root = os.path.dirname(os.path.abspath(__file__))
corpus = os.path.join(root, "corpus")
tests = os.path.join(root, "..", "tests")


def put(target, name, data):
    d = os.path.join(corpus, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)] -> file bytes (compact JSON, padded to 8)."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data



# safetensors
f32 = struct.pack("<4f", 1, 2, 3, 4)
put("safetensors", "two_tensors", safetensors([("a", "F32", [2, 2], f32), ("b", "BF16", [3], b"\x80\x3f" * 3)],
                                              {"format": "pt"}))
put("safetensors", "empty_tensor", safetensors([("z", "I64", [0, 5], b""), ("s", "BOOL", [], b"\x01")]))
put("safetensors", "no_tensors", safetensors([], {"k": "v"}))

# shard: llm.c's layout
def shard(tokens, count=None, version=1):
    head = struct.pack("<3i", 20240520, version, len(tokens) if count is None else count) + b"\0" * (1024 - 12)
    return head + struct.pack("<%dH" % len(tokens), *tokens)
put("shard", "ten_tokens", shard(list(range(10))))
put("shard", "empty", shard([]))
put("shard", "count_too_big", shard([1, 2, 3], count=4))

# checkpoint: the committed checkpoints of an older main, and a global-tensor pieces file
legacy = os.path.join(tests, "train", "data", "legacy_765617b")
with open(os.path.join(legacy, "zero", "ckpt_00000002", "ckpt_00000002.safetensors"), "rb") as f:
    put("checkpoint", "legacy_zero_model", f.read())
pieces = [{"key": "p0", "name": "w", "global_shape": [2, 4], "offset": [0, 0]},
          {"key": "p1", "name": "w", "global_shape": [2, 4], "offset": [1, 0]},
          {"key": "p2", "name": "v", "global_shape": [6], "range_begin": 2}]
put("checkpoint", "pieces", safetensors([("p0", "F32", [1, 4], f32), ("p1", "F32", [1, 4], f32),
                                         ("p2", "F32", [4], f32)],
                                        {"format": "blutrain.global_tensors.v1", "pieces": json.dumps(pieces)}))
put("checkpoint", "train_state", safetensors([("model.w", "F32", [4], f32)], {
    "format_version": "2", "checksum": "0000000000000000",
    "train_state": json.dumps({"step": 1, "model_config": {"family": "gpt2", "n_layer": 1},
                               "run": {"tokenizer": "byte"}})}))

# commit: sharded (format 1 and 2) and pipeline COMMIT files
with open(os.path.join(legacy, "zero", "ckpt_00000002", "COMMIT"), "rb") as f:
    put("commit", "legacy_sharded", f.read())
files = [{"name": "a.safetensors", "bytes": 10, "checksum": "0123456789abcdef"}]
put("commit", "sharded_v2", json.dumps({"format_version": 2, "step": 1, "total": 8, "world_size": 1,
                                        "files": files * 2}))
put("commit", "pipeline_v2", json.dumps({"format_version": 2, "stages": 1, "files": files}))
put("commit", "pipeline_v1", json.dumps({"stages": 2}))

# loader_state: what DataLoader::state() writes
state = {"B": 2, "T": 8, "batch": 1, "epoch": 0, "num_shards": 2, "seed": 0, "shard": 1,
         "shard_file": "s_000001.bin", "shuffle": False, "world_size": 1}
put("loader_state", "state", json.dumps(state))
put("loader_state", "other_split", json.dumps(dict(state, B=1, world_size=2, shard=0, shard_file="")))

# model_config: Hugging Face config.json of each family
put("model_config", "llama", json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
    "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "hidden_act": "silu"}))
put("model_config", "gpt2", json.dumps({
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32, "n_head": 2, "n_layer": 2,
    "n_positions": 16, "vocab_size": 100}))
# ... and with every optional key each family checks: Llama 3's rope scaling, head_dim, the biases
# and dropout; GPT-2's activation, epsilon, n_inner and tying (the shapes of Hugging Face's files)
LLAMA3_SEED = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 64, "mlp_bias": False,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 32, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 100}
put("model_config", "llama3_rope_scaling", json.dumps(LLAMA3_SEED))
put("model_config", "gpt2_every_key", json.dumps({
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new", "attn_pdrop": 0.1,
    "bos_token_id": 99, "embd_pdrop": 0.1, "eos_token_id": 99, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
    "n_ctx": 16, "n_embd": 32, "n_head": 2, "n_inner": None, "n_layer": 2, "n_positions": 16, "resid_pdrop": 0.1,
    "tie_word_embeddings": True, "vocab_size": 100}))
put("model_config", "gpt2_n_inner", json.dumps({"model_type": "gpt2", "n_embd": 32, "n_head": 2, "n_inner": 128,
                                                "n_layer": 2, "n_positions": 16, "vocab_size": 100}))

# train_config: `blutrain train --config` files
put("train_config", "flat", "lr = 3e-4\nsteps = 100\nname = \"run\"\nflag = true\nlist = [1, 2, 3]\n")
put("train_config", "section", "# a comment\n[train]\nlr=0.1\nsteps = 5\n'name' = 'x'\n")

# hf_tokenizer: a minimal byte-level BPE tokenizer.json
alphabet = {}
for b in list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256)):
    alphabet[b] = chr(b)
n = 0
for b in range(256):
    if b not in alphabet:
        alphabet[b] = chr(256 + n)
        n += 1
vocab = {alphabet[b]: b for b in range(256)}
vocab["Ġt"], vocab["he"], vocab["Ġthe"] = 256, 257, 258
put("hf_tokenizer", "byte_level", json.dumps({
    "version": "1.0", "added_tokens": [{"id": 259, "content": "<|endoftext|>", "special": True, "normalized": False,
                                        "lstrip": False, "rstrip": False, "single_word": False}],
    "normalizer": None,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
    "post_processor": None, "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": False, "ignore_merges": False,
              "vocab": vocab, "merges": ["Ġ t", "h e", "Ġt he"]}}, ensure_ascii=False))
put("hf_tokenizer", "gpt2_style", json.dumps({
    "added_tokens": [], "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
    "model": {"type": "BPE", "vocab": vocab, "merges": [["h", "e"]]}}, ensure_ascii=False))

# gpt2_tokenizer: encoder.json, NUL, vocab.bpe
enc = dict(vocab)
del enc["Ġthe"]
enc = {k: v for k, v in enc.items() if v < 258}
enc["<|endoftext|>"] = 258
put("gpt2_tokenizer", "tiny", json.dumps(enc, ensure_ascii=False).encode() + b"\0" +
    "#version: 0.2\nĠ t\nh e\n".encode())

# byte_tokenizer: text, and a shard folder's tokenizer record
put("byte_tokenizer", "text", "Hello <|endoftext|> w\xc3\xb6rld\n\0\xff")
put("byte_tokenizer", "record", json.dumps({"tokenizer": "byte", "vocab_size": 257, "separator": "eot"}))
put("byte_tokenizer", "record_path", json.dumps({"tokenizer": "tok/tokenizer.json", "vocab_size": 50257}))

# store_protocol: a client's hello, then requests (op, key, value, arg)
def lp(b):
    return struct.pack("<I", len(b)) + b
def req(op, key, value=b"", arg=0):
    return bytes([op]) + lp(key) + lp(value) + struct.pack("<q", arg)
hello = struct.pack("<II", 0x53554C42, 1) + lp(b"blutrain") + bytes(range(32))
put("store_protocol", "session", hello + req(1, b"k", b"v") + req(2, b"k", arg=1000) + req(3, b"n", arg=5) +
    req(3, b"n", arg=-2) + req(4, b"k") + req(5, b"k") + req(6, b"k", arg=10))
put("store_protocol", "requests_only", b"R" + req(3, b"c", arg=2**62) + req(3, b"c", arg=2**62) + req(1, b"x" * 10, b"y" * 200))
put("store_protocol", "other_job", struct.pack("<II", 0x53554C42, 1) + lp(b"other") + bytes(32))

# exported_graph: a hand-written three-op chain with every attribute type and a view. Beside it
# the corpus keeps gpt2_tiny_step, written by `blutrain bench --device cpu --model gpt2:tiny -B 1
# -T 8 --compile --compile-export DIR`, not by this script; fusion_plan reads it as its graph.
chain = ("b 128 cpu 4\nb 128 cpu 0\nb 128 cpu 0\nb 128 cpu 7\n"
         "v 0 [4, 8] [8, 1] 0 f32 cpu -1\nv 1 [4, 8] [8, 1] 0 f32 cpu 0\nv 2 [4, 8] [8, 1] 0 f32 cpu 1\n"
         "v 3 [4, 8] [8, 1] 0 f32 cpu 2\nv 2 [8, 4] [1, 8] 0 f32 cpu 3\n"
         "o 0 mul_scalar ( 0 ) ( 1 ) views writes value#1\n"
         "o 0 add_scalar ( 1 ) ( 2 ) views writes value#1 dim#0=-1 keep#2=1 dtype#3=bf16 shape#4=[4, 8]\n"
         "o 0 gelu ( 2 ) ( 3 ) views writes approximate#2=1\n"
         "o 1 permute ( 2 ) ( 4 ) views 0:0 writes dims#4=[1, 0]\n"
         "inputs 0\noutputs 3 4\n")
put("exported_graph", "chain", "blu-fusion-graph 1\ntarget cuda-sm_90a -gelu\n" + chain)

# fusion_plan: plans for gpt2:tiny's step (the target reads exported_graph/gpt2_tiny_step): beside
# gpt2_tiny_step, the plan `blutrain compile --from-graph` made for it (kept, not written here),
# regions of the step's other fusible ops
put("fusion_plan", "other_regions", "blu-fusion-plan 1\nstructure 0\nregion pointwise 1024 100 101 102\n"
    "region rows 2048 150 151\nregion pointwise 64 280 281 282 283 284 285 286 287 288 289 290\n")

# gemm_tune_table: lines of a table `bench --gemm-tune on` wrote on an H200, and damaged ones
algo = "0000001d00000042 0000000100000023 0000000000000000 0003000000000001 0001fc3400000001 " \
       "0000000e0000000e 00000044000e000e 0000000000000000"
key = "NVIDIA H200 lt130100 dt2 c320 cm2 ep0 t00 b0 M16384 N3072 K768 B1 ld768,3072,3072 s0,0,0 aux0 al16,16,16,16,16"
put("gemm_tune_table", "table", "# blutrain gemm tuning v1\n" + key + "\t" + algo + "\t0.120592\n" +
    key.replace("N3072", "N768") + "\t" + algo + "\t0.0311\n")
put("gemm_tune_table", "damaged", "# blutrain gemm tuning v1\n" + key + "\t" + algo[:-1] + "\t0.1\n\n" + key + "\t" +
    algo + "\t-1\n" + key + "\t" + algo + "\tnan\n\t" + algo + "\t1\n")

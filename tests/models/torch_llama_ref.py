"""PyTorch side of tests/models/llama_oracle_test.cpp: Hugging Face's LlamaForCausalLM written out
in plain PyTorch 1.13 (transformers is not needed) — RMSNorm in fp32, RoPE in the rotate-half
layout with HF's fp32 inverse frequencies and optional Llama 3 scaling, grouped-query attention by
repeating each key/value head over its group, the SwiGLU MLP, no biases, a tied or untied head —
under HF's parameter names.

Either it writes a model (config.json + model.safetensors, or shards + model.safetensors.index.json)
for BluTrain to import, or it loads the folder BluTrain exported (strict: every HF name, no extra).
Then it runs one batch and writes the logits, the loss and every parameter's gradient; with
"adamw", it runs that many steps on the same batch and writes the loss before each step and the
parameters after the last.

    torch_llama_ref.py inputs.safetensors manifest.json out.safetensors
inputs: idx [B, T], targets [B, T] (i64; -1 is ignored)
manifest: {"model_dir": path,
           "write": {"hf_config": {...config.json...}, "seed": int, "std": float,
                     "dtype": "float32" | "bfloat16", "shard_bytes": int (0: one file),
                     "lm_head_when_tied": bool}     (absent: load model_dir instead)
           "adamw": {"steps", "lr", "weight_decay", "betas", "eps"} (optional)}
out: logits, loss, grad.<name>, init.<name> (the weights the model started from, f32),
     losses (f64), param.<name>
"""
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
import st_py  # noqa: E402


def rope_inv_freq(c):
    """HF's default RoPE inverse frequencies (fp32), with _compute_llama3_parameters' scaling."""
    D = c["hidden_size"] // c["num_attention_heads"]
    base = c.get("rope_theta", 10000.0)
    inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    s = c.get("rope_scaling")
    if not s:
        return inv
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, C, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(C)), eps

    def forward(self, x):
        dt = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dt)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        C = c["hidden_size"]
        self.H, self.KV = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
        self.D = C // self.H
        self.q_proj = nn.Linear(C, self.H * self.D, bias=False)
        self.k_proj = nn.Linear(C, self.KV * self.D, bias=False)
        self.v_proj = nn.Linear(C, self.KV * self.D, bias=False)
        self.o_proj = nn.Linear(self.H * self.D, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.KV, self.D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.KV, self.D).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.H // self.KV  # HF's repeat_kv: query head h uses key/value head h // rep
        k = k[:, :, None].expand(B, self.KV, rep, T, self.D).reshape(B, self.H, T, self.D)
        v = v[:, :, None].expand(B, self.KV, rep, T, self.D).reshape(B, self.H, T, self.D)
        att = (q @ k.transpose(2, 3)) * self.D ** -0.5
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, self.H * self.D))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        C, I = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(C, I, bias=False)
        self.up_proj = nn.Linear(C, I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        eps = c.get("rms_norm_eps", 1e-6)
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c.get("rms_norm_eps", 1e-6))


class LlamaForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = LlamaModel(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.tied = c.get("tie_word_embeddings", False)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq = rope_inv_freq(c)

    def forward(self, idx, targets):
        T = idx.size(1)
        freqs = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def hf_state(self):
        """HF's state dict: lm_head.weight dropped when tied (save_pretrained does that)."""
        state = dict(self.state_dict())
        if self.tied:
            del state["lm_head.weight"]
        return state


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_model(model, w, model_dir):
    g = torch.Generator().manual_seed(w["seed"])
    dtype = DTYPES[w.get("dtype", "float32")]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * w["std"])
            else:  # norm weights around one, so that a norm that ignores its weight shows
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            p.copy_(p.to(dtype).float())  # the model computes with exactly the values written
    os.makedirs(model_dir, exist_ok=True)
    state = {k: v.to(dtype) for k, v in model.hf_state().items()}
    if model.tied and w.get("lm_head_when_tied"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(w["hf_config"], f, indent=2)
    shard_bytes = w.get("shard_bytes", 0)
    if not shard_bytes:
        st_py.write(os.path.join(model_dir, "model.safetensors"), state, metadata={"format": "pt"})
        return
    shards, size = [[]], 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        st_py.write(os.path.join(model_dir, file), {n: state[n] for n in names}, metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def load_model(model_dir):
    c = json.load(open(os.path.join(model_dir, "config.json")))
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama", c
    assert c["hidden_act"] == "silu" and not c["attention_bias"] and not c["mlp_bias"], c
    model = LlamaForCausalLM(c)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        state = {}
        for file in sorted(set(json.load(open(index))["weight_map"].values())):
            state.update(st_py.read(os.path.join(model_dir, file)))
    else:
        state = st_py.read(os.path.join(model_dir, "model.safetensors"))
    if model.tied:
        assert "lm_head.weight" not in state, "a tied export carries no lm_head.weight"
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model


def main(inputs_path, manifest_path, out_path):
    torch.manual_seed(0)
    manifest = json.load(open(manifest_path))
    inputs = st_py.read(inputs_path)
    if "write" in manifest:
        model = LlamaForCausalLM(manifest["write"]["hf_config"])
        write_model(model, manifest["write"], manifest["model_dir"])
    else:
        model = load_model(manifest["model_dir"])
    out = {"init." + n: p.detach().clone() for n, p in model.named_parameters()}

    idx, targets = inputs["idx"].long(), inputs["targets"].long()
    logits, loss = model(idx, targets)
    loss.backward()
    out.update({"logits": logits.detach(), "loss": loss.detach()})
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().clone()

    adamw = manifest.get("adamw")
    if adamw:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": adamw["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=adamw["lr"], betas=tuple(adamw["betas"]), eps=adamw["eps"])
        losses = []
        for step in range(adamw["steps"]):
            if step > 0:  # step 0 reuses the gradients above
                opt.zero_grad(set_to_none=True)
                _, loss = model(idx, targets)
                loss.backward()
            losses.append(loss.item())
            opt.step()
        out["losses"] = torch.tensor(losses, dtype=torch.float64)
        for name, p in model.named_parameters():
            out["param." + name] = p.detach().clone()
    st_py.write(out_path, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])

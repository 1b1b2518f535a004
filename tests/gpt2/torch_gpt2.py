"""PyTorch side of tests/gpt2/gpt2_oracle_test.cpp: a compact nanoGPT-style GPT-2 with Hugging
Face parameter names, loaded from the safetensors file BluTrain exported (HF layout: Conv1D
weights [in, out] are transposed into nn.Linear's [out, in]). Runs one batch and writes the
logits, the loss and every parameter's gradient; then, if asked, runs AdamW steps on the same
batch and writes the loss before each step and the parameters after the last one.

    torch_gpt2.py inputs.safetensors manifest.json out.safetensors
manifest: {"weights": path, "config": {n_layer, n_head, n_embd, block_size, vocab_size},
           "adamw": {"steps", "lr", "weight_decay", "betas", "eps"} (optional)}
"""
import json
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/common")
import st_py  # noqa: E402

CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head, self.n_embd = c["n_head"], c["n_embd"]
        self.c_attn = nn.Linear(self.n_embd, 3 * self.n_embd)
        self.c_proj = nn.Linear(self.n_embd, self.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c["n_embd"], 4 * c["n_embd"])
        self.c_proj = nn.Linear(4 * c["n_embd"], c["n_embd"])

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c["n_embd"])
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c["n_embd"])
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.wpe = nn.Embedding(c["block_size"], c["n_embd"])
        self.h = nn.ModuleList(Block(c) for _ in range(c["n_layer"]))
        self.ln_f = nn.LayerNorm(c["n_embd"])

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied output projection
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def main(inputs_path, manifest_path, out_path):
    torch.manual_seed(0)
    manifest = json.load(open(manifest_path))
    inputs = st_py.read(inputs_path)
    model = GPT(manifest["config"])
    weights = st_py.read(manifest["weights"])
    state = {}
    for name, t in weights.items():
        state[name] = t.t().contiguous() if name.endswith(CONV1D) else t
    model.load_state_dict(state, strict=True)
    # "device": "cuda" runs the reference on the GPU in IEEE fp32 (no TF32 anywhere).
    device = manifest.get("device", "cpu")
    if device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        model = model.to(device)

    idx, targets = inputs["idx"].long().to(device), inputs["targets"].long().to(device)
    logits, loss = model(idx, targets)
    loss.backward()
    out = {"logits": logits.detach().cpu(), "loss": loss.detach().cpu()}
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().cpu().clone()

    adamw = manifest.get("adamw")
    if adamw:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": adamw["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=adamw["lr"], betas=tuple(adamw["betas"]), eps=adamw["eps"])
        losses = []
        for step in range(adamw["steps"]):
            if step > 0:  # step 0 reuses the gradients written above
                opt.zero_grad(set_to_none=True)
                _, loss = model(idx, targets)
                loss.backward()
            losses.append(loss.item())
            opt.step()
        out["losses"] = torch.tensor(losses, dtype=torch.float64)
        for name, p in model.named_parameters():
            out["param." + name] = p.detach().cpu().clone()
    st_py.write(out_path, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])

#!/usr/bin/python3
"""PyTorch reference of Huginn-0125 (model_type "huginn_raven"), written from the published
modeling code (seal-rg/recurrent-pretraining, recpre/raven_modeling_minimal.py) for parity tests.

Parameter names are the published ones, so `state_dict()` is the original checkpoint layout
(with the `freqs_cis` buffer, which the engine ignores). The forward pass:
    x = wte[t] * embed_scale;  x = prelude(x);  e = x
    s = s0  (zeros here, as tl_score; the original draws a truncated normal, see `initial_state`)
    repeat num_steps:  s = core_block(adapter([s ; e]))
    logits = lm_head(ln_f(coda(ln_f(s))))
Each block is a "sandwich": x = norm_2(x + attn(norm_1 x)); x = norm_4(x + mlp(norm_3 x)).
Attention: fused Wqkv (q, k, v rows), qk_bias [2, 1, H, hd] added to q and k before RoPE, RoPE on
interleaved pairs (2i, 2i+1) with base rope_base. MLP: fc = [gate rows ; up rows], silu(gate) * up.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_interleaved(x, positions, theta):
    """x [B, T, H, hd]; pair (2i, 2i+1) turned by positions * theta^(-2i/hd), angles in float64."""
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = positions.to(torch.float64)[:, None] * inv                     # [T, hd/2]
    cos, sin = ang.cos().to(x.dtype)[None, :, None], ang.sin().to(x.dtype)[None, :, None]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, self.H = c["n_embd"], c["n_heads"]
        self.hd = d // self.H
        self.qk_bias_on = c.get("qk_bias", True)
        self.theta = c.get("rope_base", 50000.0)
        self.Wqkv = nn.Linear(d, 3 * d, bias=False)
        if self.qk_bias_on:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.H, self.hd))
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x, positions):
        B, T, d = x.shape
        q, k, v = self.Wqkv(x).split(d, dim=-1)
        q, k, v = (t.view(B, T, self.H, self.hd) for t in (q, k, v))
        if self.qk_bias_on:
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]  # before RoPE
        q, k = rope_interleaved(q, positions, self.theta), rope_interleaved(k, positions, self.theta)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = scores.masked_fill(future, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, d))


class GatedMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(c["n_embd"], 2 * c["intermediate_size"], bias=False)
        self.proj = nn.Linear(c["intermediate_size"], c["n_embd"], bias=False)

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, eps = c["n_embd"], c.get("norm_eps", 1e-6)
        self.norm_1, self.attn = RMSNorm(d, eps), Attention(c)
        self.norm_2, self.mlp = RMSNorm(d, eps), GatedMLP(c)
        self.norm_3, self.norm_4 = RMSNorm(d, eps), RMSNorm(d, eps)

    def forward(self, x, positions):
        x = self.norm_2(x + self.attn(self.norm_1(x), positions))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class Huginn(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        d, V = c["n_embd"], c.get("padded_vocab_size", c["vocab_size"])
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, d),
            prelude=nn.ModuleList(SandwichBlock(c) for _ in range(c["n_layers_in_prelude"])),
            adapter=nn.Linear(2 * d, d, bias=c.get("bias", False)),
            core_block=nn.ModuleList(SandwichBlock(c) for _ in range(c["n_layers_in_recurrent_block"])),
            coda=nn.ModuleList(SandwichBlock(c) for _ in range(c["n_layers_in_coda"])),
            ln_f=RMSNorm(d, c.get("norm_eps", 1e-6)),
        ))
        self.lm_head = nn.Linear(d, V, bias=False)
        if c.get("tie_embeddings", True):
            self.lm_head.weight = self.transformer.wte.weight
        # the published model keeps its RoPE table as a persistent buffer [1, T, 1, hd/2, 2]
        hd = d // c["n_heads"]
        inv = 1.0 / (c.get("rope_base", 50000.0) ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(c["block_size"], dtype=torch.float32), inv)
        self.register_buffer("freqs_cis", torch.stack([ang.cos(), ang.sin()], -1)[None, :, None], persistent=True)

    @property
    def embed_scale(self):
        return self.c.get("init_values", {}).get("embed_scale", math.sqrt(self.c["n_embd"]))

    @property
    def state_std(self):
        return self.c.get("init_values", {}).get("std", math.sqrt(2 / (5 * self.c["n_embd"])))

    def initial_state(self, e):
        """The original's random start: trunc_normal(0, std, [-3 std, 3 std]) * embed_scale, from
        torch's global generator. TinyLoop's tl_score (and these goldens) start from zeros."""
        s = torch.empty_like(e)
        std = self.state_std
        nn.init.trunc_normal_(s, 0.0, std, -3 * std, 3 * std)
        return s * self.embed_scale

    def forward(self, tokens, num_steps, state=None):
        """tokens [B, T] -> logits [B, T, V] at recurrence num_steps (zero initial state)."""
        T = tokens.shape[1]
        positions = torch.arange(T)
        x = self.transformer.wte(tokens) * self.embed_scale
        for block in self.transformer.prelude:
            x = block(x, positions)
        e = x
        s = torch.zeros_like(e) if state is None else state
        for _ in range(num_steps):
            s = self.transformer.adapter(torch.cat([s, e], dim=-1))
            for block in self.transformer.core_block:
                s = block(s, positions)
        x = self.transformer.ln_f(s)
        for block in self.transformer.coda:
            x = block(x, positions)
        return self.lm_head(self.transformer.ln_f(x))


def config(d=32, heads=4, ff=48, vocab=96, prelude=1, core=2, coda=1, recurrence=4, **extra):
    """A tiny config.json with the published field names and values of Huginn-0125's kind."""
    c = {"architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
         "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
         "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
         "n_embd": d, "n_heads": heads, "num_key_value_heads": heads, "head_dim": d // heads,
         "n_layers": prelude + core + coda, "n_layers_in_prelude": prelude,
         "n_layers_in_recurrent_block": core, "n_layers_in_coda": coda,
         "intermediate_size": ff, "mean_recurrence": recurrence, "mean_backprop_depth": 2,
         "block_size": 32, "vocab_size": vocab, "padded_vocab_size": vocab, "padding_multiple": 16,
         "norm_eps": 1e-6, "rope_base": 50000, "qk_bias": True, "bias": False,
         "tie_embeddings": True, "tie_word_embeddings": True, "injection_type": "linear",
         "state_init": "like-init", "sampling_scheme": "poisson-lognormal-filling",
         "test_time_noise": 0, "test_time_noise_type": "fixed",
         "bos_token_id": vocab - 4, "eos_token_id": vocab - 3, "pad_token_id": vocab - 1,
         "torch_dtype": "float32"}
    c.update(extra)
    return c


def random_model(c, seed):
    """Random weights at scales where every part of the forward pass shows in the logits."""
    torch.manual_seed(seed)
    m = Huginn(c)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("ln_f.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("qk_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("wte.weight"):
                p.copy_(m.state_std * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return m

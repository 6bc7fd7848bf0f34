#!/usr/bin/python3
"""PyTorch reference of Ouro (model_type "ouro", OuroForCausalLM), written from the published
modeling code (modeling_ouro.py on the hub; vllm/model_executor/models/ouro.py) for parity tests.

Parameter names are the published ones, so `state_dict()` is the original checkpoint layout.
The forward pass (no prelude, coda or injection: the whole stack is looped):
    h = embed_tokens[t]
    repeat total_ut_steps (pass u, KV slot u * num_hidden_layers + layer):
        for each layer:  h = h + input_layernorm_2(attn(input_layernorm h))
                         h = h + post_attention_layernorm_2(mlp(post_attention_layernorm h))
        h = norm(h)                       # after every pass; feeds the next pass
        gate_u = sigmoid(early_exit_gate(h))
    logits = lm_head(h)                   # the last pass's normed output, no further norm
RoPE is the Hugging Face "rotate half" form; attention is grouped-query; MLP is SwiGLU.
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
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, self.H, self.KV = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = d // self.H
        self.theta = c.get("rope_theta", 10000.0)
        self.q_proj = nn.Linear(d, self.H * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.KV * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.KV * self.hd, bias=False)
        self.o_proj = nn.Linear(self.H * self.hd, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        inv = self.theta ** (-torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv
        ang = torch.cat([ang, ang], -1)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.H // self.KV
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        att = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, self.H * self.hd))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, f = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-6)
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm, self.input_layernorm_2 = RMSNorm(d, eps), RMSNorm(d, eps)
        self.post_attention_layernorm, self.post_attention_layernorm_2 = RMSNorm(d, eps), RMSNorm(d, eps)

    def forward(self, h):
        h = h + self.input_layernorm_2(self.self_attn(self.input_layernorm(h)))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c["hidden_size"]
        self.embed_tokens = nn.Embedding(c["vocab_size"], d)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(d, c.get("rms_norm_eps", 1e-6))
        self.early_exit_gate = nn.Linear(d, 1)


class Ouro(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens, passes):
        """tokens [B, T] -> (logits [B, T, V] after `passes` passes, gate sigmoids [passes, B, T])."""
        h = self.model.embed_tokens(tokens)
        gates = []
        for _ in range(passes):
            for layer in self.model.layers:
                h = layer(h)
            h = self.model.norm(h)
            gates.append(torch.sigmoid(self.model.early_exit_gate(h)[..., 0]))
        return self.lm_head(h), torch.stack(gates)


def exit_pass(lambdas, threshold):
    """Ouro's exit rule per token: p_u = lambda_u * prod_{v<u}(1 - lambda_v), the last pass taking
    the remainder; exit at the first pass whose cumulative p reaches threshold, else the last.
    lambdas [passes, T] -> 1-based exit pass per token [T]."""
    passes = lambdas.shape[0]
    remaining, cdf = torch.ones_like(lambdas[0]), torch.zeros_like(lambdas[0])
    exit_at = torch.full(lambdas[0].shape, passes, dtype=torch.long)
    for u in range(passes):
        p = lambdas[u] * remaining if u < passes - 1 else remaining
        remaining = remaining * (1 - lambdas[u])
        cdf = cdf + p
        first = (cdf >= threshold) & (exit_at == passes) & (u < passes - 1)
        exit_at[first] = u + 1
    return exit_at


def closest_to_threshold(lambdas, thresholds):
    """How near any pass's cumulative exit probability (last pass excluded) comes to a threshold:
    a golden exit depth is only meaningful when this is well above float32 rounding."""
    remaining, cdf, closest = torch.ones_like(lambdas[0]), torch.zeros_like(lambdas[0]), float("inf")
    for u in range(lambdas.shape[0] - 1):
        cdf = cdf + lambdas[u] * remaining
        remaining = remaining * (1 - lambdas[u])
        for q in thresholds:
            closest = min(closest, (cdf - q).abs().min().item())
    return closest


def config(d=32, heads=4, kv_heads=2, ff=64, vocab=80, layers=2, passes=4, **extra):
    """A tiny config.json with the published field names of Ouro-1.4B's kind."""
    c = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_act": "silu",
         "hidden_size": d, "intermediate_size": ff, "num_attention_heads": heads,
         "num_key_value_heads": kv_heads, "num_hidden_layers": layers, "max_position_embeddings": 32,
         "max_window_layers": layers, "layer_types": ["full_attention"] * layers,
         "use_sliding_window": False, "sliding_window": None, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
         "total_ut_steps": passes, "early_exit_threshold": 1.0, "initializer_range": 0.02,
         "attention_dropout": 0.0, "use_cache": True, "vocab_size": vocab,
         "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    c.update(extra)
    return c


def random_model(c, seed):
    torch.manual_seed(seed)
    m = Ouro(c)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("early_exit_gate.bias"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return m

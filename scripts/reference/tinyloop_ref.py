#!/usr/bin/python3
"""PyTorch reference of the TinyLoop model family (SPEC §1): the numerical ground truth.

The engine's logits must match `LoopedLM.forward` (f32: max abs diff <= 1e-4). Parameter names
are the SPEC tensor names, so `state_dict()` *is* the checkpoint layout. safetensors is read and
written by hand (the `safetensors` package is not available on the build machines).
"""
import json
import math
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

REQUIRED = ("vocab_size", "d_model", "n_heads", "d_ff", "max_seq_len", "n_prelude", "n_block",
            "n_coda", "default_loops", "norm", "mlp", "pos_encoding")
DEFAULTS = {"beta": 1.0, "injection": "add", "loop_update": "replace", "state_norm": False,
            "bias": False, "norm_eps": 1e-5, "rope_theta": 10000.0, "tie_embeddings": False}
CHOICES = {"norm": ("layernorm", "rmsnorm"), "mlp": ("gelu", "swiglu"),
           "pos_encoding": ("learned", "rope"), "injection": ("none", "add", "concat"),
           "loop_update": ("replace", "residual")}


def normalize_config(config):
    """SPEC defaults applied; unknown fields are kept untouched (and ignored by the model)."""
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ValueError(f"config: missing required field(s): {', '.join(missing)}")
    c = dict(DEFAULTS)
    c.update(config)
    c.setdefault("n_kv_heads", c["n_heads"])
    c.setdefault("max_loops", 4 * c["default_loops"])
    for k, allowed in CHOICES.items():
        if c[k] not in allowed:
            raise ValueError(f"config: {k} must be one of {allowed}, got {c[k]!r}")
    if c["d_model"] % c["n_heads"] or c["n_heads"] % c["n_kv_heads"]:
        raise ValueError("config: d_model must divide by n_heads and n_heads by n_kv_heads")
    if c["pos_encoding"] == "rope" and (c["d_model"] // c["n_heads"]) % 2:
        raise ValueError("config: rope needs an even head_dim")
    if min(c["n_prelude"], c["n_block"], c["n_coda"]) < 0 or c["default_loops"] < 1 \
            or c["max_loops"] < c["default_loops"]:
        raise ValueError("config: layer counts must be >= 0 and 1 <= default_loops <= max_loops")
    return c


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(c):
    if c["norm"] == "layernorm":
        return nn.LayerNorm(c["d_model"], eps=c["norm_eps"])  # weight + bias, always
    return RMSNorm(c["d_model"], c["norm_eps"])


def rope_cos_sin(positions, head_dim, theta, dtype):
    """HF Llama tables: angle[p, i] = p * theta^(-2i/hd), duplicated over both halves.
    Computed in float64 whatever the model dtype, so the reference carries no table error."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = positions.to(torch.float64)[..., None] * inv_freq           # [B, T, hd/2]
    ang = torch.cat([ang, ang], dim=-1)[:, None]                       # [B, 1, T, hd]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, bias = c["d_model"], c["bias"]
        self.n_heads, self.n_kv = c["n_heads"], c["n_kv_heads"]
        self.hd = d // self.n_heads
        self.q = nn.Linear(d, self.n_heads * self.hd, bias=bias)
        self.k = nn.Linear(d, self.n_kv * self.hd, bias=bias)
        self.v = nn.Linear(d, self.n_kv * self.hd, bias=bias)
        self.o = nn.Linear(self.n_heads * self.hd, d, bias=bias)

    def forward(self, x, rope):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)   # [B, H, T, hd]
        k = self.k(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # GQA: query head h reads KV head h // (n_heads / n_kv_heads)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, f, bias = c["d_model"], c["d_ff"], c["bias"]
        self.swiglu = c["mlp"] == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(d, f, bias=bias)
        self.up = nn.Linear(d, f, bias=bias)
        self.down = nn.Linear(f, d, bias=bias)

    def forward(self, x):
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Layer(nn.Module):
    """Pre-norm: x + Attn(Norm(x)), then x + MLP(Norm(x))."""

    def __init__(self, c):
        super().__init__()
        self.attn_norm, self.attn = make_norm(c), Attention(c)
        self.mlp_norm, self.mlp = make_norm(c), MLP(c)

    def forward(self, x, rope):
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class LoopedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = self.config = normalize_config(config)
        d, V = c["d_model"], c["vocab_size"]
        self.tok_embed = nn.Embedding(V, d)
        if c["pos_encoding"] == "learned":
            self.pos_embed = nn.Embedding(c["max_seq_len"], d)
        self.prelude = nn.ModuleList(Layer(c) for _ in range(c["n_prelude"]))
        self.block = nn.ModuleList(Layer(c) for _ in range(c["n_block"]))
        self.coda = nn.ModuleList(Layer(c) for _ in range(c["n_coda"]))
        if c["injection"] == "concat":
            self.inject = nn.Linear(2 * d, d, bias=c["bias"])
        if c["state_norm"]:
            self.state_norm = make_norm(c)
        self.final_norm = make_norm(c)
        if not c["tie_embeddings"]:
            # no module at all when tied, so state_dict() has no lm_head.weight
            self.lm_head = nn.Linear(d, V, bias=False)

    def _inject(self, s, e):
        how = self.config["injection"]
        if how == "none":
            return s
        if how == "add":
            return s + e
        return self.inject(torch.cat([s, e], dim=-1))  # state first

    def _loop_step(self, s, e, rope):
        u = self._inject(s, e)
        b = u
        for layer in self.block:
            b = layer(b, rope)
        beta = self.config["beta"]
        if self.config["loop_update"] == "replace":
            s = s + beta * (b - s)
        else:
            s = s + beta * (b - u)
        if self.config["state_norm"]:
            s = self.state_norm(s)
        return s

    def forward(self, tokens, loops, positions=None, backprop_loops=None):
        """tokens [B, T] long -> logits [B, T, vocab]. positions: [T] or [B, T] (default 0..T-1);
        the causal mask follows the sequence index. loops >= 1 is not capped at max_loops here.
        backprop_loops=k: only the last k loop iterations are differentiated (truncated BPTT)."""
        c = self.config
        if loops < 1:
            raise ValueError("loops must be >= 1")
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device)
        positions = positions.expand(B, T)
        x = self.tok_embed(tokens)
        rope = None
        if c["pos_encoding"] == "learned":
            x = x + self.pos_embed(positions)
        else:
            rope = rope_cos_sin(positions, c["d_model"] // c["n_heads"], c["rope_theta"], x.dtype)
        for layer in self.prelude:
            x = layer(x, rope)
        e = x
        s = e if c["injection"] == "none" else torch.zeros_like(e)
        n_frozen = 0 if backprop_loops is None else max(0, loops - backprop_loops)
        for l in range(loops):
            if l < n_frozen:
                with torch.no_grad():
                    s = self._loop_step(s, e, rope)
                s = s.detach()
            else:
                s = self._loop_step(s, e, rope)
        x = s if c["loop_update"] == "replace" else self._inject(s, e)
        for layer in self.coda:
            x = layer(x, rope)
        x = self.final_norm(x)
        w = self.tok_embed.weight if c["tie_embeddings"] else self.lm_head.weight
        return F.linear(x, w)


# ---------------------------------------------------------------- safetensors, by hand

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
_NAMES = {v: k for k, v in _DTYPES.items()}
CKPT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
assert sys.byteorder == "little", "safetensors data is little-endian; this code assumes a LE host"


def _raw_bytes(t):
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)  # numpy has no bf16; the bits are what we want anyway
    return t.numpy().tobytes()


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> tensor (dict order = header order = data order)."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        data = _raw_bytes(t)
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    header["__metadata__"] = {str(k): str(v) for k, v in (metadata or {"format": "pt"}).items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # keeps the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for data in blobs:
            f.write(data)


def read_safetensors(path):
    """-> (dict name -> tensor in the file's dtype, metadata dict)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    base, out = 8 + n, {}
    for name, info in header.items():
        dt = _DTYPES.get(info["dtype"])
        if dt is None:  # (was a KeyError: quantised checkpoints hold I8 tensors)
            q = meta.get("tinyloop_quantization")
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which this reader "
                             f"does not read ({', '.join(_DTYPES)})"
                             + (f"; the file is a {q} checkpoint" if q else ""))
        begin, end = info["data_offsets"]
        numel = math.prod(info["shape"])
        if end - begin != numel * torch.tensor([], dtype=dt).element_size() or base + end > len(raw):
            raise ValueError(f"{path}: bad data_offsets for {name}")
        buf = bytearray(raw[base + begin:base + end])
        t = torch.frombuffer(buf, dtype=dt) if numel else torch.empty(0, dtype=dt)
        out[name] = t.reshape(info["shape"])
    return out, meta


def save_checkpoint(model, config, directory, dtype="f32"):
    """config.json is written as given (optional fields stay omitted); weights in `dtype`."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    dt = CKPT_DTYPES[dtype]
    tensors = {k: v.to(dt) for k, v in model.state_dict().items()}  # RNE for f16 and bf16
    write_safetensors(os.path.join(directory, "model.safetensors"), tensors)


def load_checkpoint(directory, dtype=torch.float32):
    """-> (model in eval mode, weights converted to `dtype`; config dict as stored)."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    model = LoopedLM(config)
    tensors, _ = read_safetensors(os.path.join(directory, "model.safetensors"))
    want = model.state_dict()
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(f"{directory}: missing tensors {missing}, unexpected tensors {extra}")
    for k, t in tensors.items():
        if list(t.shape) != list(want[k].shape):
            raise ValueError(f"{directory}: {k} has shape {list(t.shape)}, "
                             f"config wants {list(want[k].shape)}")
    model.load_state_dict({k: t.to(torch.float32) for k, t in tensors.items()})
    return model.to(dtype).eval(), config

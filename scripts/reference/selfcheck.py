#!/usr/bin/python3
"""Self-check of the reference (run: /usr/bin/python3 scripts/reference/selfcheck.py).

(a) checkpoint save/load round trip (f32 exact; f16/bf16 give exactly the rounded weights);
(b) a plain config (loops = 1 or n_block = 0, injection none) equals an independent pre-norm
    transformer written below from the SPEC text alone (explicit formulas, per-head loops);
(c) the rotate-half RoPE equals a direct complex-number rotation of (x_i, x_{i+hd/2}) pairs;
(d) the independent code, extended with the SPEC loop, reproduces every golden set;
(e) backprop_loops changes gradients only, never the logits.
"""
import math
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from make_checkpoint import build  # noqa: E402
from tinyloop_ref import (load_checkpoint, normalize_config, read_safetensors,  # noqa: E402
                          rope_cos_sin, rotate_half, save_checkpoint)

GOLDEN = os.path.join(HERE, "..", "..", "tests", "data", "golden")
torch.set_num_threads(1)
DT = torch.float64


# ------------------------------------------------ independent implementation (from SPEC text)

def norm(W, prefix, c, x):
    w = W[prefix + ".weight"]
    if c["norm"] == "rmsnorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c["norm_eps"]) * w
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + c["norm_eps"]) * w + W[prefix + ".bias"]


def lin(W, prefix, x):
    y = x @ W[prefix + ".weight"].T
    return y + W[prefix + ".bias"] if prefix + ".bias" in W else y


def rope_complex(x, pos, theta):
    """x [T, hd]: the pair (x_i, x_{i+hd/2}) is the complex number x_i + j x_{i+hd/2}."""
    h = x.shape[-1] // 2
    z = torch.complex(x[..., :h], x[..., h:])
    freq = theta ** (-2.0 * torch.arange(h, dtype=DT) / x.shape[-1])
    z = z * torch.polar(torch.ones_like(freq), pos.to(DT)[:, None] * freq)
    return torch.cat([z.real, z.imag], dim=-1)


def layer(W, P, c, x, pos):
    T, d = x.shape
    H, KV = c["n_heads"], c["n_kv_heads"]
    hd = d // H
    a = norm(W, P + ".attn_norm", c, x)
    q, k, v = lin(W, P + ".attn.q", a), lin(W, P + ".attn.k", a), lin(W, P + ".attn.v", a)
    heads = []
    for h in range(H):
        g = h // (H // KV)
        qh, kh, vh = q[:, h * hd:(h + 1) * hd], k[:, g * hd:(g + 1) * hd], v[:, g * hd:(g + 1) * hd]
        if c["pos_encoding"] == "rope":
            qh, kh = rope_complex(qh, pos, c["rope_theta"]), rope_complex(kh, pos, c["rope_theta"])
        out = torch.zeros(T, hd, dtype=DT)
        for t in range(T):  # position t attends to 0..t
            sc = (kh[:t + 1] @ qh[t]) / math.sqrt(hd)
            p = torch.exp(sc - sc.max())
            out[t] = (p / p.sum()) @ vh[:t + 1]
        heads.append(out)
    x = x + lin(W, P + ".attn.o", torch.cat(heads, dim=-1))
    m = norm(W, P + ".mlp_norm", c, x)
    if c["mlp"] == "gelu":
        u = lin(W, P + ".mlp.up", m)
        hmid = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
    else:
        gt = lin(W, P + ".mlp.gate", m)
        hmid = gt / (1 + torch.exp(-gt)) * lin(W, P + ".mlp.up", m)
    return x + lin(W, P + ".mlp.down", hmid)


def independent_forward(W, config, tokens, loops):
    c = normalize_config(config)
    pos = torch.arange(len(tokens))
    x = W["tok_embed.weight"][tokens]
    if c["pos_encoding"] == "learned":
        x = x + W["pos_embed.weight"][pos]
    for i in range(c["n_prelude"]):
        x = layer(W, f"prelude.{i}", c, x, pos)
    e = x

    def inject(s):
        if c["injection"] == "none":
            return s
        if c["injection"] == "add":
            return s + e
        return lin(W, "inject", torch.cat([s, e], dim=-1))

    s = e if c["injection"] == "none" else torch.zeros_like(e)
    for _ in range(loops):
        u = inject(s)
        b = u
        for i in range(c["n_block"]):
            b = layer(W, f"block.{i}", c, b, pos)
        s = s + c["beta"] * ((b - s) if c["loop_update"] == "replace" else (b - u))
        if c["state_norm"]:
            s = norm(W, "state_norm", c, s)
    x = s if c["loop_update"] == "replace" else inject(s)
    for i in range(c["n_coda"]):
        x = layer(W, f"coda.{i}", c, x, pos)
    head = W["tok_embed.weight"] if c["tie_embeddings"] else W["lm_head.weight"]
    return norm(W, "final_norm", c, x) @ head.T


# --------------------------------------------------------------------------------- checks

BASE = {"vocab_size": 50, "d_model": 32, "n_heads": 4, "d_ff": 64, "max_seq_len": 32,
        "n_prelude": 1, "n_block": 2, "n_coda": 1, "default_loops": 2, "norm": "rmsnorm",
        "mlp": "swiglu", "pos_encoding": "rope", "bos_token_id": 0, "eos_token_id": 1}
tokens = torch.randint(0, 50, (2, 19), generator=torch.Generator().manual_seed(7))
failures = []


def check(what, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {what} {detail}")
    if not ok:
        failures.append(what)


def maxdiff(a, b):
    return (a.double() - b.double()).abs().max().item()


# (a)
cfg = dict(BASE, injection="concat", loop_update="residual", state_norm=True, bias=True)
model = build(cfg, seed=3).eval()
with tempfile.TemporaryDirectory() as tmp:
    for dtype, tdt in (("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)):
        save_checkpoint(model, cfg, tmp, dtype)
        loaded, cfg2 = load_checkpoint(tmp)
        same_w = all(torch.equal(v.to(tdt).float(), loaded.state_dict()[k])
                     for k, v in model.state_dict().items())
        check(f"(a) {dtype} round trip: config, names and rounded weights", cfg2 == cfg and same_w)
        raw = open(os.path.join(tmp, "model.safetensors"), "rb").read()
        save_checkpoint(loaded.to(tdt).float(), cfg, tmp, dtype)
        check(f"(a) {dtype} save(load(x)) is byte-identical",
              raw == open(os.path.join(tmp, "model.safetensors"), "rb").read())
        n = int.from_bytes(raw[:8], "little")
        check(f"(a) {dtype} header padded to 8 bytes", n % 8 == 0 and raw[8 + n - 1:8 + n] in b" }")
        if dtype == "f32":
            with torch.no_grad():
                check("(a) f32 round trip gives identical logits",
                      torch.equal(model(tokens, 3), loaded(tokens, 3)))

x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])  # bf16 ties: round to even
check("(a) bf16 rounding is round-to-nearest-even",
      x.to(torch.bfloat16).float().tolist() == [1.0, 1 + 2**-6, -1.0])

# (b)
plain = [
    ("gpt2-shaped, loops=1, injection none", dict(BASE, n_prelude=0, n_block=1, n_coda=0,
     injection="none", norm="layernorm", mlp="gelu", pos_encoding="learned", bias=True,
     tie_embeddings=True), 1),
    ("n_block=0, injection none, loops=3, GQA", dict(BASE, n_block=0, n_kv_heads=2,
     injection="none", norm_eps=1e-3), 3),
    ("loops=1, injection none, MQA, rope_theta=100", dict(BASE, n_prelude=0, n_coda=0,
     n_kv_heads=1, injection="none", rope_theta=100.0, bias=True), 1),
]
for what, cfg, loops in plain:
    m = build(cfg, seed=5).double().eval()
    W = {k: v.double() for k, v in m.state_dict().items()}
    with torch.no_grad():
        ref = m(tokens, loops)
    diff = max(maxdiff(ref[b], independent_forward(W, cfg, tokens[b], loops)) for b in range(2))
    check(f"(b) plain transformer: {what}", diff < 1e-10, f"max diff {diff:.1e}")

# (c)
g = torch.Generator().manual_seed(11)
for hd, theta in ((8, 10000.0), (16, 500000.0), (64, 10000.0)):
    x = torch.randn(2, 3, 40, hd, generator=g, dtype=DT)
    pos = torch.randint(0, 5000, (2, 40), generator=g)
    cos, sin = rope_cos_sin(pos, hd, theta, DT)
    rot = x * cos + rotate_half(x) * sin
    want = torch.stack([torch.stack([rope_complex(x[b, h], pos[b], theta) for h in range(3)])
                        for b in range(2)])
    check(f"(c) rope rotate-half == complex, hd {hd}, theta {theta:g}",
          maxdiff(rot, want) < 1e-12, f"max diff {maxdiff(rot, want):.1e}")

# (d)
cases = sorted(n for n in os.listdir(GOLDEN) if os.path.isdir(os.path.join(GOLDEN, n))) \
    if os.path.isdir(GOLDEN) else []
check("(d) golden sets present", len(cases) > 0, f"({len(cases)})")
for name in cases:
    d = os.path.join(GOLDEN, name)
    m, cfg = load_checkpoint(d, DT)
    W = {k: v for k, v in m.state_dict().items()}
    gold, meta = read_safetensors(os.path.join(d, "golden.safetensors"))
    diff = 0.0
    for i in range(int(meta["n_sequences"])):
        t, L = gold[f"tokens.{i}"].long(), int(gold[f"loops.{i}"])
        diff = max(diff, maxdiff(independent_forward(W, cfg, t, L), gold[f"logits.{i}"]))
    check(f"(d) independent forward reproduces golden {name}", diff < 1e-5, f"max diff {diff:.1e}")

# (e)
cfg = dict(BASE, loop_update="residual")
m = build(cfg, seed=9)
grads = {}
for k in (None, 2):
    m.zero_grad()
    z = m(tokens, 5, backprop_loops=k)
    z.square().mean().backward()
    grads[k] = (z.detach(), m.block[0].attn.q.weight.grad.clone(), m.prelude[0].mlp.up.weight.grad)
check("(e) backprop_loops: same logits, other block gradient",
      torch.equal(grads[None][0], grads[2][0]) and not torch.allclose(grads[None][1], grads[2][1])
      and grads[2][2] is not None)

print("selfcheck:", "FAILED " + ", ".join(failures) if failures else "all passed")
sys.exit(1 if failures else 0)

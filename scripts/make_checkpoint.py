#!/usr/bin/python3
"""Write a randomly initialised TinyLoop checkpoint (config.json + model.safetensors).

  make_checkpoint.py --config cfg.json --out DIR [--dtype f16] [--seed 1] [--n_block 3 ...]

Every config.json field can be overridden by a flag of the same name. Without --config a small
default config is used. The init keeps logits at a std of ~1-3 for every option and depth.
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference"))
from tinyloop_ref import CKPT_DTYPES, LoopedLM, save_checkpoint  # noqa: E402

DEFAULT_CONFIG = {
    "vocab_size": 256, "d_model": 64, "n_heads": 4, "d_ff": 256, "max_seq_len": 128,
    "n_prelude": 1, "n_block": 2, "n_coda": 1, "default_loops": 4, "norm": "rmsnorm",
    "mlp": "swiglu", "pos_encoding": "rope", "bos_token_id": 0, "eos_token_id": 1,
}


def _bool(s):
    if s.lower() in ("1", "true", "yes"):
        return True
    if s.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {s}")


FIELD_TYPES = {
    "vocab_size": int, "d_model": int, "n_heads": int, "n_kv_heads": int, "d_ff": int,
    "max_seq_len": int, "n_prelude": int, "n_block": int, "n_coda": int, "default_loops": int,
    "max_loops": int, "beta": float, "injection": str, "loop_update": str, "state_norm": _bool,
    "norm": str, "norm_eps": float, "mlp": str, "bias": _bool, "pos_encoding": str,
    "rope_theta": float, "tie_embeddings": _bool, "bos_token_id": int, "eos_token_id": int,
}


def init_weights(model, seed):
    """Deterministic init from `seed` (independent of torch's global RNG).

    Norm weights are 1 + noise and all biases are non-zero, so that a golden test notices a
    missing or misplaced one. Input projections have unit gain (attention is neither uniform nor
    one-hot); output projections gain 0.5, so that no layer drowns the residual stream. Logits
    come after final_norm, so their scale is set by the head alone: std ~2 at any depth."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    d = c["d_model"]

    def randn(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf, kind = name.split(".")[-2], name.split(".")[-1]
            if "norm" in leaf:
                p.copy_(randn(p.shape, 0.1, 1.0 if kind == "weight" else 0.0))
            elif kind == "bias":
                p.copy_(randn(p.shape, 0.1))
            elif name == "tok_embed.weight":
                p.copy_(randn(p.shape, min(1.0, 2 / math.sqrt(d)) if c["tie_embeddings"] else 1.0))
            elif name == "pos_embed.weight":
                p.copy_(randn(p.shape, 0.5))
            elif name == "lm_head.weight":
                p.copy_(randn(p.shape, 2 / math.sqrt(d)))
            else:
                gain = 0.5 if leaf in ("o", "down") else 1.0
                p.copy_(randn(p.shape, gain / math.sqrt(p.shape[1])))
    return model


def build(config, seed):
    return init_weights(LoopedLM(config), seed)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", help="base config.json (default: a small built-in config)")
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--dtype", choices=sorted(CKPT_DTYPES), default="f32")
    ap.add_argument("--seed", type=int, default=0)
    for k, t in FIELD_TYPES.items():
        ap.add_argument("--" + k, type=t, default=None, metavar=t.__name__.lstrip("_").upper())
    a = ap.parse_args()

    torch.set_num_threads(1)
    if a.config:
        with open(a.config) as f:
            config = json.load(f)
    else:
        config = dict(DEFAULT_CONFIG)
    config.update({k: getattr(a, k) for k in FIELD_TYPES if getattr(a, k) is not None})
    model = build(config, a.seed)
    save_checkpoint(model, config, a.out, a.dtype)

    c = model.config
    n_params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, c["vocab_size"], (1, min(32, c["max_seq_len"])),
                           generator=torch.Generator().manual_seed(a.seed))
    with torch.no_grad():
        stats = []
        for L in sorted({1, c["default_loops"], c["max_loops"]}):
            z = model(tokens, L)
            stats.append(f"loops {L}: logit std {z.std():.2f}, max |logit| {z.abs().max():.2f}")
    print(f"wrote {a.out} ({n_params} parameters, {a.dtype}); " + "; ".join(stats))


if __name__ == "__main__":
    main()

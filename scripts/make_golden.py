#!/usr/bin/python3
"""Regenerate tests/data/golden/<case>/ {config.json, model.safetensors, golden.safetensors}.

golden.safetensors holds, per sequence i: tokens.{i} (I32 [n]), loops.{i} (I32 [1]) and
logits.{i} (F32 [n, vocab]) from the reference run in float64 on the checkpoint's own (possibly
16-bit) weights. Deterministic: fixed seeds, single thread, so a rerun rewrites identical bytes.
"""
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "reference"))
from regen_args import parse_out  # noqa: E402

OUT = os.path.join(HERE, "..", "tests", "data", "golden")
if __name__ == "__main__":
    OUT = parse_out(__doc__, OUT, "the cases")  # (before PyTorch loads: --help needs none)

import torch  # noqa: E402

from make_checkpoint import build  # noqa: E402
from tinyloop_ref import load_checkpoint, save_checkpoint, write_safetensors  # noqa: E402
BOS_EOS = {"bos_token_id": 0, "eos_token_id": 1}


def cfg(d, heads, ff, vocab, pre, blk, coda, loops, norm, mlp, pos, **opt):
    c = {"vocab_size": vocab, "d_model": d, "n_heads": heads, "d_ff": ff, "max_seq_len": 32,
         "n_prelude": pre, "n_block": blk, "n_coda": coda, "default_loops": loops,
         "norm": norm, "mlp": mlp, "pos_encoding": pos, **BOS_EOS}
    c.update(opt)
    return c


# name: (checkpoint dtype, config, [(sequence length, loops), ...]); loops go up to max_loops
CASES = {
    # n_block > 0 at loops = 1 is an ordinary transformer (how we compare with other engines)
    "gpt2_like": ("f32", cfg(32, 4, 128, 96, 0, 2, 0, 1, "layernorm", "gelu", "learned",
                             bias=True, tie_embeddings=True, max_loops=1,
                             bos_token_id=95, eos_token_id=95),
                  [(1, 1), (9, 1), (24, 1)]),
    "llama_like": ("f32", cfg(32, 4, 64, 80, 0, 2, 0, 1, "rmsnorm", "swiglu", "rope",
                              n_kv_heads=2, bias=False, rope_theta=500000.0, norm_eps=1e-6,
                              max_loops=1),
                   [(3, 1), (17, 1), (24, 1)]),
    # only required fields: every optional default applies; an unknown field must be ignored
    "defaults_extra_field": ("f32", dict(cfg(24, 3, 64, 50, 1, 1, 1, 2, "rmsnorm", "gelu",
                                             "learned", max_seq_len=24),
                                         extra_field={"note": "ignored", "list": [1, 2]}),
                             [(5, 1), (12, 2), (24, 8)]),
    # n_block = 0: the loop is the identity, so these are plain transformers at any depth
    "nblock0_none": ("f32", cfg(32, 2, 64, 64, 2, 0, 1, 1, "layernorm", "swiglu", "rope",
                                injection="none", bias=True),
                     [(6, 1), (20, 4)]),
    "nblock0_add_residual": ("f32", cfg(16, 2, 48, 40, 1, 0, 2, 1, "rmsnorm", "gelu", "learned",
                                        loop_update="residual", beta=0.5, tie_embeddings=True),
                             [(1, 1), (11, 2), (24, 3)]),
    "add_replace_beta_statenorm_ln": ("f32", cfg(32, 4, 96, 64, 1, 2, 1, 3, "layernorm", "gelu",
                                                 "learned", beta=0.6, state_norm=True),
                                      [(4, 1), (15, 3), (22, 12)]),
    "add_residual_statenorm_rms_gqa2": ("f32", cfg(32, 4, 64, 72, 1, 2, 1, 4, "rmsnorm",
                                                   "swiglu", "rope", n_kv_heads=2,
                                                   loop_update="residual", state_norm=True,
                                                   bias=True),
                                        [(1, 1), (8, 2), (16, 7), (24, 16)]),
    "concat_replace_bias": ("f32", cfg(32, 4, 64, 64, 1, 1, 0, 2, "layernorm", "gelu", "learned",
                                       injection="concat", bias=True, max_loops=6),
                            [(2, 1), (13, 4), (24, 6)]),
    "concat_residual_mqa": ("f32", cfg(32, 4, 64, 56, 0, 2, 1, 5, "rmsnorm", "swiglu", "rope",
                                       n_kv_heads=1, injection="concat", loop_update="residual",
                                       beta=0.8, max_loops=10),
                            [(7, 1), (18, 5), (24, 10)]),
    "none_replace_beta_rope1000": ("f32", cfg(24, 3, 48, 48, 1, 2, 0, 2, "rmsnorm", "gelu",
                                              "rope", injection="none", beta=0.5,
                                              rope_theta=1000.0),
                                   [(10, 1), (24, 2), (19, 8)]),
    "none_residual_eps": ("f32", cfg(32, 2, 64, 64, 0, 2, 2, 2, "layernorm", "swiglu", "learned",
                                     injection="none", loop_update="residual", beta=1.5,
                                     bias=True, norm_eps=1e-2),
                          [(1, 1), (14, 2), (24, 8)]),
    "deep_residual": ("f32", cfg(32, 4, 64, 64, 1, 1, 1, 8, "rmsnorm", "gelu", "rope",
                                 loop_update="residual", max_loops=32),
                      [(12, 1), (24, 17), (20, 32)]),
    "f16_tied_statenorm_ln": ("f16", cfg(64, 4, 128, 128, 1, 2, 1, 4, "layernorm", "gelu",
                                         "learned", state_norm=True, bias=True,
                                         tie_embeddings=True),
                              [(5, 1), (24, 4), (16, 16)]),
    "f16_concat_residual_gqa": ("f16", cfg(64, 8, 96, 100, 1, 1, 1, 3, "rmsnorm", "swiglu",
                                           "rope", n_kv_heads=2, injection="concat",
                                           loop_update="residual", max_loops=8),
                                [(1, 1), (21, 3), (24, 8)]),
    "bf16_tied_rope_residual": ("bf16", cfg(48, 6, 96, 112, 1, 2, 1, 3, "rmsnorm", "gelu",
                                            "rope", n_kv_heads=3, loop_update="residual",
                                            state_norm=True, bias=True, tie_embeddings=True,
                                            rope_theta=500000.0, max_loops=12),
                                [(9, 1), (24, 6), (13, 12)]),
    "bf16_none_mqa_ln": ("bf16", cfg(32, 2, 64, 64, 1, 2, 1, 2, "layernorm", "swiglu",
                                     "learned", n_kv_heads=1, injection="none", beta=0.75),
                         [(1, 1), (6, 2), (24, 8)]),
}


def make_case(name, dtype, config, seqs, seed):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    save_checkpoint(build(config, seed), config, d, dtype)
    # reload so the logits come from exactly the stored (rounded) weights
    model, _ = load_checkpoint(d, dtype=torch.float64)
    c = model.config
    g = torch.Generator().manual_seed(1000 + seed)
    out, spread = {}, []
    for i, (n, loops) in enumerate(seqs):
        assert 1 <= loops <= c["max_loops"] and n <= c["max_seq_len"], (name, n, loops)
        tokens = torch.randint(0, c["vocab_size"], (n,), generator=g)
        with torch.no_grad():
            logits = model(tokens[None], loops)[0]
        out[f"tokens.{i}"] = tokens.to(torch.int32)
        out[f"loops.{i}"] = torch.tensor([loops], dtype=torch.int32)
        out[f"logits.{i}"] = logits.to(torch.float32)
        spread.append(f"L{loops}:{logits.std():.2f}")
    write_safetensors(os.path.join(d, "golden.safetensors"), out,
                      {"format": "pt", "case": name, "n_sequences": len(seqs),
                       "checkpoint_dtype": dtype})
    print(f"{name:34s} {dtype:4s} logit std {' '.join(spread)}")


def main():
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    for seed, (name, (dtype, config, seqs)) in enumerate(CASES.items(), start=1):
        make_case(name, dtype, config, seqs, seed)


if __name__ == "__main__":
    main()

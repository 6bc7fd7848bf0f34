#!/usr/bin/python3
"""Regenerate tests/data/hf/<case>/: tiny random Huginn and Ouro checkpoints in each family's
original Hugging Face layout (config.json + model.safetensors, or shards + index), and
golden.safetensors with, per sequence i: tokens.{i} (I32 [n]), loops.{i} (I32 [1]),
logits.{i} (F32 [n, vocab]) from the reference in float64 on the stored (rounded) weights, and
for Ouro gates.{i} (F32 [loops, n]): each pass's exit-gate sigmoid, and the gate-based exit
depth: exit_q (F32 [k]) thresholds, exits.{i} (I32 [k, n]) the 1-based pass each token exits at
under Ouro's rule (ouro_ref.exit_pass) over EXIT_PASSES passes of the full-depth forward.
Deterministic (fixed seeds, one thread): a rerun rewrites identical bytes.
"""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "reference"))
from regen_args import parse_out  # noqa: E402

OUT = os.path.join(HERE, "..", "tests", "data", "hf")
if __name__ == "__main__":
    OUT = parse_out(__doc__, OUT, "the cases")  # (before PyTorch loads: --help needs none)

import torch  # noqa: E402

import huginn_ref  # noqa: E402
import ouro_ref  # noqa: E402
from tinyloop_ref import CKPT_DTYPES, read_safetensors, write_safetensors  # noqa: E402
SEQS = [(1, 1), (9, 1), (17, 2), (24, 4), (13, 3)]  # (length, recurrence); 4 = the trained depth
EXIT_PASSES = 4
EXIT_Q = [0.3, 0.6, 0.9, 0.95]  # thresholds whose exits the goldens keep (cumulative sums stay clear of them)


def save(model, config, directory, dtype, shards, drop=()):
    """config.json and the weights in `dtype`, in one file or `shards` files + index (HF layout).
    Tied heads: the stored copy of lm_head.weight is kept unless it is in `drop`."""
    os.makedirs(directory, exist_ok=True)
    config = dict(config, torch_dtype={"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[dtype])
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    dt = CKPT_DTYPES[dtype]
    tensors = {k: (v if k == "freqs_cis" else v.to(dt)) for k, v in model.state_dict().items() if k not in drop}
    if shards == 1:
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
        return
    names = list(tensors)
    per = (len(names) + shards - 1) // shards
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s * per:(s + 1) * per]}
        write_safetensors(os.path.join(directory, fname), part)
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")


def reload(family, config, directory):
    """The reference model with exactly the stored (rounded) weights, in float64."""
    tensors = {}
    for fname in sorted(os.listdir(directory)):
        if fname.endswith(".safetensors") and fname != "golden.safetensors":
            tensors.update(read_safetensors(os.path.join(directory, fname))[0])
    model = family.Huginn(config) if family is huginn_ref else family.Ouro(config)
    state = {k: t.to(torch.float64) for k, t in tensors.items()}
    tied = "lm_head.weight" not in state
    model.load_state_dict(state, strict=not tied)
    return model.double().eval()


def make_case(name, family, config, dtype, shards, seed, drop=()):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    save(family.random_model(config, seed), config, d, dtype, shards, drop)
    model = reload(family, config, d)
    vocab = config.get("padded_vocab_size", config["vocab_size"])
    g = torch.Generator().manual_seed(500 + seed)
    out, spread, closest = {}, [], []
    for i, (n, loops) in enumerate(SEQS):
        tokens = torch.randint(0, vocab, (n,), generator=g)
        with torch.no_grad():
            if family is huginn_ref:
                logits = model(tokens[None], loops)[0]
            else:
                logits, gates = model(tokens[None], loops)
                logits = logits[0]
                out[f"gates.{i}"] = gates[:, 0].to(torch.float32)
                _, full = model(tokens[None], EXIT_PASSES)
                out[f"exits.{i}"] = torch.stack([ouro_ref.exit_pass(full[:, 0], q) for q in EXIT_Q]).to(torch.int32)
                closest.append(ouro_ref.closest_to_threshold(full[:, 0], EXIT_Q))
        out[f"tokens.{i}"] = tokens.to(torch.int32)
        out[f"loops.{i}"] = torch.tensor([loops], dtype=torch.int32)
        out[f"logits.{i}"] = logits.to(torch.float32)
        spread.append(f"L{loops}:{logits.std():.2f}")
    if closest:
        out["exit_q"] = torch.tensor(EXIT_Q, dtype=torch.float32)
        spread.append(f"exit margin {min(closest):.1e}")
    write_safetensors(os.path.join(d, "golden.safetensors"), out,
                      {"format": "pt", "case": name, "checkpoint_dtype": dtype})
    print(f"{name:28s} {dtype:4s} shards {shards} logit std {' '.join(spread)}")


def main():
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    hc, oc = huginn_ref.config(), ouro_ref.config()
    oc_tied = ouro_ref.config(tie_word_embeddings=True, early_exit_threshold=0.6)
    # single-file and sharded folders of the same weights must give identical logits
    make_case("huginn_f32", huginn_ref, hc, "f32", 1, 1, drop=("lm_head.weight",))
    make_case("huginn_f32_sharded", huginn_ref, hc, "f32", 3, 1)  # stores the tied head's copy
    make_case("huginn_bf16", huginn_ref, hc, "bf16", 1, 2, drop=("lm_head.weight",))
    make_case("ouro_f32", ouro_ref, oc, "f32", 1, 3)
    make_case("ouro_f32_sharded", ouro_ref, oc, "f32", 2, 3)
    make_case("ouro_bf16_tied", ouro_ref, oc_tied, "bf16", 2, 4)


if __name__ == "__main__":
    main()

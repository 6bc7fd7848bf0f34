#!/usr/bin/python3
"""Per-depth evaluation of a TinyLoop checkpoint on the held-out text.

    scripts/train/eval.py --model models/tinyloop-austen [--out MODEL/eval.md] [--threads 2]

Reports, for loop depths 1, 2, 3, 4, 6, 8, 12, 16 (--depths; by default those up to the
checkpoint's max_loops):
- validation loss (nats/token) and perplexity, on build/corpus/val.txt tokenised with the
  model's tokenizer.json into one stream (documents separated by <|endoftext|>), cut into
  non-overlapping 256-token windows (each predicts its 256 next tokens with in-window context);
- teacher-forced agreement with the default depth: the fraction of those positions where the
  argmax next token equals the default depth's argmax, and the mean KL(p_default || p_depth);
- free-running greedy agreement with the default depth: --n-prompts held-out prompts (<|endoftext|>
  + the first 31 tokens of evenly spaced validation documents), 64 greedy tokens each at every
  depth (KV-cached incremental decoding, checked against the full forward), compared with the
  default depth's continuation: the fraction of equal tokens position by position and the mean
  length of the identical prefix;
- the mean relative loop-state change ||s_l - s_{l-1}|| / ||s_l|| (per token, averaged) for
  l = 1..max depth, on the same windows (the early-exit signal).

All depths come from one pass: the loop state after l iterations does not depend on how many
follow, so the loop runs once to the deepest depth and the coda + head are applied to the state
at each requested depth (checked against LoopedLM.forward on the first batch).

Prints a markdown report and writes it to --out (checked first; written once the evaluation
succeeded). Reads f32/f16/bf16 checkpoints: a q8/q4 one goes to tinyloop-quant-eval.
"""
import argparse
import json
import math
import os
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_DEPTHS = "1,2,3,4,6,8,12,16"


def parse_args():
    ap = argparse.ArgumentParser(description="per-depth evaluation of a TinyLoop checkpoint", allow_abbrev=False)
    ap.add_argument("--model", default="models/tinyloop-austen", help="checkpoint directory")
    ap.add_argument("--out", default=None, help="markdown report (default: MODEL/eval.md)")
    ap.add_argument("--corpus-dir", default="build/corpus")
    ap.add_argument("--val", default=None, help="validation text (default CORPUS_DIR/val.txt)")
    ap.add_argument("--depths", default=None,
                    help=f"comma-separated loop counts (default {DEFAULT_DEPTHS}, "
                         "those up to the checkpoint's max_loops)")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="cap on teacher-forced tokens (0: the whole validation text)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n-prompts", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="including the leading BOS")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    # (a depth of 0 was a KeyError, no prompts a ValueError from deep in the run)
    try:
        depths = [int(d) for d in (a.depths or DEFAULT_DEPTHS).split(",")]
    except ValueError:
        ap.error(f"--depths must be a comma-separated list of loop counts, got {a.depths!r}")
    if min(depths) < 1:
        ap.error(f"--depths must be loop counts of 1 or more, got {a.depths!r}")
    for name in ("seq", "batch", "n_prompts", "gen_tokens", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(a, name)}")
    if a.prompt_tokens < 2:
        ap.error(f"--prompt-tokens counts the leading BOS: 2 or more, got {a.prompt_tokens}")
    if a.max_tokens < 0:
        ap.error(f"--max-tokens must be 0 (all) or more, got {a.max_tokens}")
    # the files, before torch loads and the evaluation runs (they were tracebacks, and an
    # unwritable --out an error after the whole evaluation)
    model_dir = a.model
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json")
               if not os.path.isfile(os.path.join(model_dir, f))]
    if missing:
        ap.error(f"--model {model_dir}: " + ("no such directory" if not os.path.isdir(model_dir) else
                                     "no " + ", ".join(missing)) + " (a checkpoint directory)")
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        ap.error(f"--model {model_dir}: config.json: {e}")
    default_loops = config.get("default_loops") if isinstance(config, dict) else None
    max_loops = (config.get("max_loops", min(4 * default_loops, 4096))  # SPEC §1's default
                 if isinstance(default_loops, int) else None)
    if not (isinstance(default_loops, int) and isinstance(max_loops, int)
            and 1 <= default_loops <= max_loops):
        ap.error(f"--model {model_dir}: config.json needs 1 <= default_loops <= max_loops")
    try:
        with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        meta = header.get("__metadata__") or {}
        dtypes = {t["dtype"] for k, t in header.items() if k != "__metadata__"}
    except (OSError, ValueError, AttributeError, TypeError, KeyError, struct.error):
        ap.error(f"--model {model_dir}: model.safetensors is not a safetensors file")
    # (a q8/q4 checkpoint was a KeyError from deep in the loader)
    quant = meta.get("tinyloop_quantization") if isinstance(meta, dict) else None
    odd = sorted(dtypes - {"F64", "F32", "F16", "BF16"})
    if quant or odd:
        ap.error(f"--model {model_dir} " + (f"is a {quant} checkpoint" if quant else
                                    f"holds {'/'.join(odd)} tensors")
                 + "; eval.py reads f32/f16/bf16 ones: for quantised weights use "
                 "build/scripts/tools/tinyloop-quant-eval REF_DIR QUANT_DIR --text FILE")
    # depths past max_loops are past what the engine runs
    if a.depths is None:
        a.depths = ",".join(str(d) for d in depths if d <= max_loops)
    elif max(depths) > max_loops:
        ap.error(f"--depths must be loop counts up to the checkpoint's max_loops ({max_loops}), "
                 f"got {a.depths!r}")
    max_seq_len = config.get("max_seq_len")
    if isinstance(max_seq_len, int) and a.prompt_tokens + a.gen_tokens > max_seq_len:
        ap.error(f"--prompt-tokens + --gen-tokens must be at most the checkpoint's max_seq_len "
                 f"({max_seq_len}), got {a.prompt_tokens} + {a.gen_tokens}")
    if a.val:
        if not os.path.isfile(a.val):
            ap.error(f"--val {a.val}: no such file")
    elif not os.path.isfile(os.path.join(a.corpus_dir, "val.txt")):
        ap.error(f"--corpus-dir {a.corpus_dir}: "
                 + ("no val.txt" if os.path.isdir(a.corpus_dir) else "no such directory")
                 + " (scripts/train/corpus.py makes it)")
    a.out = a.out or os.path.join(model_dir, "eval.md")
    if os.path.isdir(a.out):
        ap.error(f"--out {a.out} is a directory; it names the report file")
    sys.path.insert(0, HERE)
    from corpus import dir_problem
    if os.path.exists(a.out):  # rewritten in place: its directory may be read-only
        why = None if os.access(a.out, os.W_OK) else "not writable"
    else:
        why = dir_problem(os.path.dirname(a.out) or ".")
    if why:
        ap.error(f"--out {a.out}: {why}")
    return a


args = parse_args()
os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
os.environ["OMP_NUM_THREADS"] = str(args.threads)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts", "reference"))
from bpe import Tokenizer, encode_docs  # noqa: E402
from corpus import read_docs  # noqa: E402
from tinyloop_ref import load_checkpoint, rope_cos_sin, rotate_half  # noqa: E402


# ------------------------------------------------------------------------------ all depths

def head(model, s, e):
    """Loop state -> logits (coda, final norm, lm head), as at the end of LoopedLM.forward."""
    c = model.config
    x = s if c["loop_update"] == "replace" else model._inject(s, e)
    for layer in model.coda:
        x = layer(x, None if c["pos_encoding"] == "learned" else model._rope)
    x = model.final_norm(x)
    w = model.tok_embed.weight if c["tie_embeddings"] else model.lm_head.weight
    return F.linear(x, w)


def all_depths(model, tokens, depths):
    """-> ({depth: logits}, [rel state change for l = 1..max(depths)])."""
    c = model.config
    B, T = tokens.shape
    pos = torch.arange(T).expand(B, T)
    x = model.tok_embed(tokens)
    model._rope = None
    if c["pos_encoding"] == "learned":
        x = x + model.pos_embed(pos)
    else:
        model._rope = rope_cos_sin(pos, c["d_model"] // c["n_heads"], c["rope_theta"], x.dtype)
    for layer in model.prelude:
        x = layer(x, model._rope)
    e = x
    s = e if c["injection"] == "none" else torch.zeros_like(e)
    out, changes = {}, []
    for l in range(1, max(depths) + 1):
        prev = s
        s = model._loop_step(s, e, model._rope)
        changes.append(((s - prev).norm(dim=-1) / s.norm(dim=-1).clamp_min(1e-12)))
        if l in depths:
            out[l] = head(model, s, e)
    return out, changes


# ------------------------------------------------------------------------------ KV-cached decoding

def attn_cached(attn, x, rope, cache):
    B, T, _ = x.shape
    q = attn.q(x).view(B, T, attn.n_heads, attn.hd).transpose(1, 2)
    k = attn.k(x).view(B, T, attn.n_kv, attn.hd).transpose(1, 2)
    v = attn.v(x).view(B, T, attn.n_kv, attn.hd).transpose(1, 2)
    if rope is not None:
        cos, sin = rope
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    rep = attn.n_heads // attn.n_kv
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "k" in cache:
        k = torch.cat([cache["k"], k], dim=2)
        v = torch.cat([cache["v"], v], dim=2)
    cache["k"], cache["v"] = k, v
    P = k.shape[2] - T
    scores = q @ k.transpose(-1, -2) / math.sqrt(attn.hd)
    future = torch.ones(T, P + T, dtype=torch.bool).triu(P + 1)
    att = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return attn.o((att @ v).transpose(1, 2).reshape(B, T, attn.n_heads * attn.hd))


def layer_cached(layer, x, rope, cache):
    x = x + attn_cached(layer.attn, layer.attn_norm(x), rope, cache)
    return x + layer.mlp(layer.mlp_norm(x))


def forward_cached(model, tokens, start, loops, caches):
    """Next-token logits for `tokens` (new positions start..start+T-1) at depth `loops`;
    caches: dict keyed by layer instance, filled as we go (same slots as the engine's cache)."""
    c = model.config
    B, T = tokens.shape
    pos = torch.arange(start, start + T).expand(B, T)
    x = model.tok_embed(tokens)
    rope = None
    if c["pos_encoding"] == "learned":
        x = x + model.pos_embed(pos)
    else:
        rope = rope_cos_sin(pos, c["d_model"] // c["n_heads"], c["rope_theta"], x.dtype)
    for i, layer in enumerate(model.prelude):
        x = layer_cached(layer, x, rope, caches.setdefault(("p", i), {}))
    e = x
    s = e if c["injection"] == "none" else torch.zeros_like(e)
    for l in range(loops):
        u = model._inject(s, e)
        b = u
        for j, layer in enumerate(model.block):
            b = layer_cached(layer, b, rope, caches.setdefault(("b", l, j), {}))
        s = s + c["beta"] * (b - s) if c["loop_update"] == "replace" else s + c["beta"] * (b - u)
        if c["state_norm"]:
            s = model.state_norm(s)
    x = s if c["loop_update"] == "replace" else model._inject(s, e)
    for i, layer in enumerate(model.coda):
        x = layer_cached(layer, x, rope, caches.setdefault(("c", i), {}))
    x = model.final_norm(x)
    w = model.tok_embed.weight if c["tie_embeddings"] else model.lm_head.weight
    return F.linear(x, w)


def greedy(model, prompts, loops, n_new):
    """prompts [B, P] -> (generated ids [B, n_new], logits of each step [B, n_new, V])."""
    caches = {}
    logits = forward_cached(model, prompts, 0, loops, caches)[:, -1]
    out, steps = [], []
    pos = prompts.shape[1]
    for _ in range(n_new):
        nxt = logits.argmax(-1)
        out.append(nxt)
        steps.append(logits)
        logits = forward_cached(model, nxt[:, None], pos, loops, caches)[:, -1]
        pos += 1
    return torch.stack(out, 1), torch.stack(steps, 1)


# ------------------------------------------------------------------------------ main

def main():
    torch.set_num_threads(args.threads)
    t0 = time.time()
    try:
        model, config = load_checkpoint(args.model)
    except ValueError as e:  # the config's or the tensors' own error, in a line
        sys.exit(f"eval: {e}")
    c = model.config
    tok = Tokenizer(os.path.join(args.model, "tokenizer.json"))
    if tok.vocab_size != c["vocab_size"]:
        sys.exit(f"tokenizer has {tok.vocab_size} ids, model {c['vocab_size']}")
    depths = sorted({int(d) for d in args.depths.split(",")})
    D = c["default_loops"]
    if D not in depths:
        depths = sorted(depths + [D])
    seq = min(args.seq, c["max_seq_len"])
    val_path = args.val or os.path.join(args.corpus_dir, "val.txt")
    docs = read_docs(val_path)
    stream = np.array(encode_docs(tok, docs), dtype=np.int64)
    n_win = (len(stream) - 1) // seq
    if args.max_tokens:
        n_win = min(n_win, max(1, args.max_tokens // seq))
    if n_win < 1:
        sys.exit("validation text too short")

    # ---- teacher forced
    loss = {d: 0.0 for d in depths}
    agree = {d: 0 for d in depths}
    kl = {d: 0.0 for d in depths}
    change = torch.zeros(max(depths), dtype=torch.float64)
    n_tok, checked = 0, None
    with torch.no_grad():
        for i in range(0, n_win, args.batch):
            rows = [stream[j * seq:j * seq + seq + 1] for j in range(i, min(n_win, i + args.batch))]
            xy = torch.from_numpy(np.stack(rows))
            x, y = xy[:, :-1], xy[:, 1:].reshape(-1)
            logits, changes = all_depths(model, x, depths)
            if checked is None:  # the one-pass trick must equal the reference forward
                checked = max((logits[d] - model(x, d)).abs().max().item() for d in (depths[0], D))
                if checked > 1e-3:
                    sys.exit(f"all-depth pass disagrees with LoopedLM.forward ({checked:.2e})")
            ref_lp = F.log_softmax(logits[D].reshape(-1, c["vocab_size"]), -1)
            ref_arg = ref_lp.argmax(-1)
            for d in depths:
                lp = F.log_softmax(logits[d].reshape(-1, c["vocab_size"]), -1)
                loss[d] += F.nll_loss(lp, y, reduction="sum").item()
                agree[d] += (lp.argmax(-1) == ref_arg).sum().item()
                kl[d] += (ref_lp.exp() * (ref_lp - lp)).sum().item()
            for l, ch in enumerate(changes):
                change[l] += ch.double().sum()
            n_tok += y.numel()
    t_tf = time.time() - t0

    # ---- free running
    t1 = time.time()
    P = args.prompt_tokens
    cand = [d for d in docs if len(tok.encode_ordinary(d)) >= P - 1]
    if not cand:
        sys.exit(f"eval: no validation document has the {P - 1} tokens a prompt takes (--prompt-tokens {P})")
    n_p = min(args.n_prompts, len(cand))
    picks = [cand[int(k * len(cand) / n_p)] for k in range(n_p)]
    prompts = torch.tensor([[tok.eot_id] + tok.encode_ordinary(d)[:P - 1] for d in picks])
    gen = {}
    with torch.no_grad():
        for d in depths:
            gen[d], steps = greedy(model, prompts, d, args.gen_tokens)
            if d == D:  # the cached decoder must match a full forward of the same sequence
                full = model(torch.cat([prompts, gen[d]], 1), d)[:, P - 1:-1]
                cache_diff = (full - steps).abs().max().item()
                if cache_diff > 1e-3:
                    sys.exit(f"cached decoding disagrees with LoopedLM.forward ({cache_diff:.2e})")
    ref = gen[D]
    t_fr = time.time() - t1

    # ---- report
    def prefix_len(a, b):
        neq = (a != b)
        return torch.where(neq.any(1), neq.int().argmax(1), torch.full((a.shape[0],), a.shape[1]))

    lines = [f"# Evaluation of `{args.model}`", "",
             f"Validation text `{val_path}`: {len(stream)} tokens; teacher-forced on {n_tok} "
             f"tokens ({n_win} windows of {seq}); free-running on {n_p} prompts of {P} tokens "
             f"+ {args.gen_tokens} greedy tokens. Default depth {D}. "
             f"Time {t_tf:.0f}s + {t_fr:.0f}s at {args.threads} thread(s). "
             f"Checks: one-pass vs forward {checked:.1e}, cached vs forward {cache_diff:.1e}.", "",
             f"| depth | val loss | ppl | Δ loss vs {D} | TF argmax agreement with {D} "
             f"| KL({D} ‖ depth) | free-run token agreement | free-run identical prefix |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in depths:
        L = loss[d] / n_tok
        fr = (gen[d] == ref).double().mean().item()
        pl = prefix_len(gen[d], ref).double().mean().item()
        lines.append(f"| {d} | {L:.4f} | {math.exp(L):.1f} | {L - loss[D] / n_tok:+.4f} "
                     f"| {100 * agree[d] / n_tok:.1f}% | {kl[d] / n_tok:.4f} | {100 * fr:.1f}% "
                     f"| {pl:.1f} / {args.gen_tokens} |")
    lines += ["", "Mean relative loop-state change ||s_l - s_(l-1)|| / ||s_l|| "
              "(s_0 = 0 with additive injection, so loop 1 is 1):", "",
              "| loop l | " + " | ".join(str(l + 1) for l in range(len(change))) + " |",
              "|---|" + "---:|" * len(change),
              "| change | " + " | ".join(f"{v / n_tok:.4f}" for v in change.tolist()) + " |",
              "", f"Greedy samples at depth {D}, {args.gen_tokens} tokens past each prompt "
              "(prompt ‖ continuation; each prompt led by <|endoftext|>, left out here):", ""]
    for k in range(min(3, n_p)):
        p = tok.decode(prompts[k, 1:].tolist())
        g = tok.decode(ref[k].tolist())
        lines.append(f"- {p!r} ‖ {g!r}")
    report = "\n".join(lines) + "\n"
    print(report)
    # (only now: a failed evaluation leaves an earlier report as it was)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Trains a small looped (recurrent-depth) LM with the PyTorch reference module, so the weights
are exactly what the C engine runs, and writes a SPEC §1 checkpoint directory.

    scripts/train/train.py [--minutes 75] [--threads 2] [--seed 0] [--out models/tinyloop-austen]

Data: build/corpus/{train,val}.txt (scripts/train/corpus.py) tokenised with
build/corpus/tokenizer.json (scripts/train/bpe.py). Documents are joined into one token stream
separated by <|endoftext|> (also BOS/EOS). Each epoch cuts the stream into 256+1-token windows at
a random phase and visits them in a random order.

Recipe (TRAINING-NOTES.md): per batch a random loop depth L in 1..8, weighted mildly toward deep
loops (P(L) proportional to 1 + deep_bias * (L-1)/7; deep_bias 1 makes L=8 twice as likely as
L=1); truncated backprop through the last 4 loops (`backprop_loops=4`); AdamW (lr 2e-3, betas
0.9/0.95, weight decay 0.1 on matrices, none on norms), gradient clipping 1.0; linear warmup over
the first 3% of the time budget then cosine decay to 10% of the peak, both by WALL CLOCK, so the
run ends on time whatever the machine load (`--steps N` switches the schedule to steps, which
makes a run bit-reproducible for a given thread count). Validation loss at depth 8 on a fixed
slice of val.txt at the start, every --val-every minutes and at the end; the checkpoint (f16) is
written at every validation, so an interrupted run still leaves a usable model. Ctrl-C / SIGTERM
stops cleanly (final validation + save; training.json then says "finished": false and names the
signal in "interrupted_by_signal", and the exit status is 128 + the signal's number).

Options are checked before anything runs (--check-args: only that, before the corpus exists),
--out included, so a bad value fails in one line rather than after the training.

Output directory: config.json, model.safetensors (f16), tokenizer.json, training.json (arguments,
tokens seen, loss history, input hashes, software versions).
"""
import argparse
import json
import math
import os
import shutil
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def parse_args():
    # (allow_abbrev off: run.sh reads --out, --threads and --corpus-dir whole, so "--ou X"
    # trained into X and evaluated the shipped model)
    ap = argparse.ArgumentParser(description="train a TinyLoop looped LM (CPU)", allow_abbrev=False)
    ap.add_argument("--minutes", type=float, default=75.0, help="wall-clock budget, all included")
    ap.add_argument("--steps", type=int, default=0,
                    help="schedule by this many steps instead of wall clock (0: wall clock)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="models/tinyloop-austen")
    ap.add_argument("--corpus-dir", default="build/corpus")
    ap.add_argument("--tokenizer", default=None, help="default: CORPUS_DIR/tokenizer.json")
    # model
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--n-prelude", type=int, default=1)
    ap.add_argument("--n-block", type=int, default=2)
    ap.add_argument("--n-coda", type=int, default=1)
    ap.add_argument("--loop-update", choices=("replace", "residual"), default="replace")
    ap.add_argument("--no-state-norm", action="store_true")
    ap.add_argument("--default-loops", type=int, default=8)
    ap.add_argument("--max-loops", type=int, default=16)
    # optimisation
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256, help="training context (<= max_seq_len 256)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of the budget")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--min-depth", type=int, default=1)
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--deep-bias", type=float, default=1.0,
                    help="P(L) ~ 1 + deep_bias*(L-min)/(max-min); 0 = uniform")
    ap.add_argument("--backprop-loops", type=int, default=4)
    # logging / validation
    ap.add_argument("--log-every", type=float, default=30.0, help="seconds between progress lines")
    ap.add_argument("--val-every", type=float, default=10.0, help="minutes between validations")
    ap.add_argument("--val-tokens", type=int, default=16384, help="val tokens per validation")
    ap.add_argument("--val-depth", type=int, default=8)
    ap.add_argument("--check-args", action="store_true",
                    help="check the options and exit, before the corpus exists (run.sh does)")
    a = ap.parse_args()
    check_args(ap, a)
    return a


MAX_LOOPS = 4096      # the engine's ceiling (engine/src/config.c)
MAX_LAYERS = 4096
MAX_DIM = 1 << 20


def check_args(ap, a):
    """Refuses in one line, before torch loads, the values that crashed deep in a run, missing
    corpus files (tracebacks) and an --out that only failed at the first save, after training."""
    def need(ok, opt, allowed):
        if not ok:
            v = getattr(a, opt.lstrip("-").replace("-", "_"))
            ap.error(f"{opt} must be {allowed}, got {v:g}" if isinstance(v, float)
                     else f"{opt} must be {allowed}, got {v}")
    need(a.steps >= 0, "--steps", "0 (wall clock) or more")
    need(a.steps or 0 < a.minutes < math.inf, "--minutes",
         "more than 0 and finite (or give --steps N)")
    need(a.threads >= 1, "--threads", "1 or more")
    need(0 <= a.seed < 1 << 64, "--seed", "0 .. 2^64-1")
    need(1 <= a.d_model <= MAX_DIM, "--d-model", f"1 .. {MAX_DIM}")
    need(1 <= a.n_heads <= a.d_model, "--n-heads", f"1 .. --d-model ({a.d_model})")
    need(1 <= a.d_ff <= MAX_DIM, "--d-ff", f"1 .. {MAX_DIM}")
    if a.d_model % a.n_heads:
        ap.error(f"--n-heads {a.n_heads} does not divide --d-model {a.d_model}")
    if a.d_model // a.n_heads % 2:
        ap.error(f"--d-model {a.d_model} / --n-heads {a.n_heads} = head dim "
                 f"{a.d_model // a.n_heads}: RoPE needs an even head dim")
    for opt in ("--n-prelude", "--n-block", "--n-coda"):
        need(0 <= getattr(a, opt[2:].replace("-", "_")) <= MAX_LAYERS, opt, f"0 .. {MAX_LAYERS}")
    need(1 <= a.max_loops <= MAX_LOOPS, "--max-loops", f"1 .. {MAX_LOOPS} (the engine's ceiling)")
    loops = f"1 .. --max-loops ({a.max_loops})"
    need(1 <= a.default_loops <= a.max_loops, "--default-loops", loops)
    need(1 <= a.batch, "--batch", "1 or more")
    need(1 <= a.seq <= 256, "--seq", "1 .. 256 (max_seq_len)")
    need(0 < a.lr < math.inf, "--lr", "more than 0 and finite")
    need(0 <= a.min_lr_ratio <= 1, "--min-lr-ratio", "0 .. 1")
    need(0 <= a.warmup <= 1, "--warmup", "0 .. 1 (a fraction of the budget)")
    need(0 <= a.weight_decay < math.inf, "--weight-decay", "0 or more and finite")
    need(a.clip > 0, "--clip", "more than 0")
    need(1 <= a.min_depth <= a.max_loops, "--min-depth", loops)
    need(a.min_depth <= a.max_depth <= a.max_loops, "--max-depth",
         f"--min-depth ({a.min_depth}) .. --max-loops ({a.max_loops})")
    # (below -1 the deepest depths get negative probabilities)
    need(-1 <= a.deep_bias < math.inf, "--deep-bias", "-1 or more and finite")
    need(a.backprop_loops >= 1, "--backprop-loops", "1 or more")
    need(a.log_every >= 0, "--log-every", "0 or more (seconds)")
    need(a.val_every >= 0, "--val-every", "0 or more (minutes)")
    need(a.val_tokens >= 1, "--val-tokens", "1 or more")
    need(1 <= a.val_depth <= a.max_loops, "--val-depth", loops)
    if a.tokenizer is not None and not os.path.isfile(a.tokenizer):
        ap.error(f"--tokenizer {a.tokenizer}: no such file")
    if not a.check_args:  # run.sh checks before it makes the corpus
        d = a.corpus_dir
        need_files = ["train.txt", "val.txt"] + ([] if a.tokenizer else ["tokenizer.json"])
        missing = [f for f in need_files if not os.path.isfile(os.path.join(d, f))]
        if missing:
            ap.error(f"--corpus-dir {d}: " + ("no such directory" if not os.path.isdir(d) else
                                              "no " + ", ".join(missing))
                     + " (scripts/train/corpus.py makes train.txt and val.txt, "
                     "scripts/train/bpe.py tokenizer.json)")
    sys.path.insert(0, HERE)
    from corpus import dir_problem
    why = dir_problem(a.out)
    if not why and not a.check_args:
        try:
            os.makedirs(a.out, exist_ok=True)
        except OSError as e:
            why = e.strerror
    if why:
        ap.error(f"--out {a.out}: {why}")
    if a.check_args:
        sys.exit(0)


args = parse_args()
# Debian's torch: OpenBLAS pool for GEMMs + OpenMP for the rest; they must not oversubscribe
# (TRAINING-NOTES.md). Must be set before torch is imported.
os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
os.environ["OMP_NUM_THREADS"] = str(args.threads)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts", "reference"))
from bpe import Tokenizer, encode_docs, file_sha256  # noqa: E402
from corpus import read_docs  # noqa: E402
from tinyloop_ref import LoopedLM, save_checkpoint  # noqa: E402


def log(msg):
    print(time.strftime("%H:%M:%S ") + msg, flush=True)


def fmt_time(s):
    s = max(0, int(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def make_config(tok):
    eot = tok.eot_id
    return {
        "vocab_size": tok.vocab_size, "d_model": args.d_model, "n_heads": args.n_heads,
        "n_kv_heads": args.n_heads, "d_ff": args.d_ff, "max_seq_len": 256,
        "n_prelude": args.n_prelude, "n_block": args.n_block, "n_coda": args.n_coda,
        "default_loops": args.default_loops, "max_loops": args.max_loops, "beta": 1.0,
        "injection": "add", "loop_update": args.loop_update,
        "state_norm": not args.no_state_norm, "norm": "rmsnorm", "norm_eps": 1e-5,
        "mlp": "swiglu", "bias": False, "pos_encoding": "rope", "rope_theta": 10000.0,
        "tie_embeddings": True, "bos_token_id": eot, "eos_token_id": eot,
    }


def init_weights(model, c):
    """GPT-2 style: N(0, 0.02) for every matrix and the (tied) embedding, residual output
    projections scaled by 1/sqrt(2 * layers); norms start at 1."""
    n_layers = c["n_prelude"] + c["n_block"] + c["n_coda"]
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02
            if name.endswith("attn.o.weight") or name.endswith("mlp.down.weight"):
                std /= math.sqrt(2 * n_layers)
            torch.nn.init.normal_(p, 0.0, std)
        elif name.endswith(".bias"):
            torch.nn.init.zeros_(p)


class Windows:
    """Epochs over the token stream: windows of seq+1 tokens at a random phase, shuffled."""

    def __init__(self, stream, seq, rng):
        self.stream, self.seq, self.rng = stream, seq, rng
        self.order, self.pos, self.epoch = [], 0, 0

    def _new_epoch(self):
        phase = int(self.rng.integers(0, self.seq))
        n = (len(self.stream) - phase - 1) // self.seq
        self.order = phase + self.seq * self.rng.permutation(n)
        self.pos = 0
        self.epoch += 1

    def batch(self, b):
        rows = []
        while len(rows) < b:
            if self.pos >= len(self.order):
                self._new_epoch()
            s = int(self.order[self.pos])
            self.pos += 1
            rows.append(self.stream[s:s + self.seq + 1])
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        return x[:, :-1], x[:, 1:]


@torch.no_grad()
def validate(model, val_stream, depth, n_tokens, seq, batch):
    model.eval()
    n_win = max(1, min(n_tokens // seq, (len(val_stream) - 1) // seq))
    tot, cnt = 0.0, 0
    for i in range(0, n_win, batch):
        rows = [val_stream[j * seq:j * seq + seq + 1] for j in range(i, min(n_win, i + batch))]
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        logits = model(x[:, :-1], depth)
        tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               reduction="sum").item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


def check_blas():
    """Debian's torch calls whatever libblas.so.3 the alternatives system points to. With only
    libblas3 (the reference BLAS) installed, GEMMs run ~30x slower (~5 GFLOP/s instead of ~140
    on one core): install libopenblas0-pthread (scripts/train/run.sh does)."""
    torch.ones(64, 64) @ torch.ones(64, 64)
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "blas" in line.lower()}
    except OSError:
        return
    if libs and not any("openblas" in p for p in libs):
        log("WARNING: torch is using the reference BLAS (" + ", ".join(sorted(libs)) + "); "
            "training will be ~10x slower. Fix: apt-get install libopenblas0-pthread")


def main():
    torch.set_num_threads(args.threads)
    check_blas()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    tok_path = args.tokenizer or os.path.join(args.corpus_dir, "tokenizer.json")
    train_path = os.path.join(args.corpus_dir, "train.txt")
    val_path = os.path.join(args.corpus_dir, "val.txt")

    t_start = time.time()
    budget = args.minutes * 60.0
    tok = Tokenizer(tok_path)
    train_stream = np.array(encode_docs(tok, read_docs(train_path)), dtype=np.int32)
    val_stream = np.array(encode_docs(tok, read_docs(val_path)), dtype=np.int32)
    log(f"data: train {len(train_stream)} tokens, val {len(val_stream)} tokens "
        f"(tokenised in {time.time() - t_start:.1f}s)")
    # (fewer and Windows looked for a window forever; an empty val.txt validated on nothing)
    if len(train_stream) < 2 * args.seq:
        sys.exit(f"train: {train_path} has {len(train_stream)} tokens; --seq {args.seq} "
                 f"needs {2 * args.seq} (a window at any phase)")
    if len(val_stream) < 2:
        sys.exit(f"train: {val_path} has no text to validate on")

    config = make_config(tok)
    model = LoopedLM(config)
    init_weights(model, model.config)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f} M parameters, config {json.dumps(config)}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    depths = np.arange(args.min_depth, args.max_depth + 1)
    span = max(1, args.max_depth - args.min_depth)
    weights = 1.0 + args.deep_bias * (depths - args.min_depth) / span
    depth_p = weights / weights.sum()
    data = Windows(train_stream, args.seq, rng)

    stop = {"signal": None}

    def on_signal(signum, frame):
        if stop["signal"]:
            raise KeyboardInterrupt
        log(f"signal {signum}: stopping after this step (again to abort)")
        stop["signal"] = signum
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    history = {"val": [], "train": []}
    meta = {
        "args": {k: v for k, v in vars(args).items() if k != "check_args"}, "n_params": n_params,
        "corpus": {"train_sha256": file_sha256(train_path), "val_sha256": file_sha256(val_path),
                   "tokenizer_sha256": file_sha256(tok_path), "train_tokens": len(train_stream),
                   "val_tokens": len(val_stream)},
        "software": {"torch": torch.__version__, "python": sys.version.split()[0]},
        "depth_distribution": {int(d): round(float(p), 4) for d, p in zip(depths, depth_p)},
        "history": history,
    }

    def save(step, tokens_seen, final, stopped_by=None):
        save_checkpoint(model, config, args.out, dtype="f16")
        shutil.copyfile(tok_path, os.path.join(args.out, "tokenizer.json"))
        # a run a signal stopped is not a finished one: its schedule did not run out
        meta.update(steps=step, tokens_seen=tokens_seen, elapsed_s=round(time.time() - t_start, 1),
                    finished=final and not stopped_by,
                    interrupted_by_signal=stopped_by and signal.Signals(stopped_by).name)
        with open(os.path.join(args.out, "training.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")

    def run_val(step, tokens_seen):
        t0 = time.time()
        loss = validate(model, val_stream, args.val_depth, args.val_tokens, args.seq, args.batch)
        dt = time.time() - t0
        history["val"].append({"step": step, "tokens": tokens_seen,
                               "elapsed_s": round(time.time() - t_start, 1),
                               "depth": args.val_depth, "loss": round(loss, 4)})
        log(f"val: step {step} depth {args.val_depth} loss {loss:.4f} "
            f"(ppl {math.exp(loss):.1f}, {dt:.1f}s)")
        return dt

    model.train()
    val_cost = run_val(0, 0)
    reserve = val_cost + 5.0            # time kept for the final validation and save
    t_train = time.time()               # the schedule runs from here
    sched_budget = max(1.0, budget - (t_train - t_start) - reserve)
    next_val = t_train + args.val_every * 60.0
    next_log = t_train + args.log_every
    step, tokens_seen = 0, 0
    acc_loss, acc_n, acc_tok, acc_depth, acc_t = 0.0, 0, 0, 0, time.time()

    while not stop["signal"]:
        now = time.time()
        if args.steps:
            frac = step / args.steps
            if step >= args.steps:
                break
        else:
            frac = (now - t_train) / sched_budget
            if frac >= 1.0:
                break
        warm = args.warmup
        lr_f = frac / warm if frac < warm else \
            args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(
                math.pi * min(1.0, (frac - warm) / max(1e-9, 1 - warm))))
        lr = args.lr * max(lr_f, 1e-3)
        for g in opt.param_groups:
            g["lr"] = lr

        depth = int(rng.choice(depths, p=depth_p))
        x, y = data.batch(args.batch)
        logits = model(x, depth, backprop_loops=args.backprop_loops)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        acc_loss += loss.item()
        acc_n += 1
        acc_tok += x.numel()
        acc_depth += depth

        now = time.time()
        if now >= next_log:
            el = now - t_start
            eta = (args.steps - step) * (now - t_train) / step if args.steps else budget - el
            log(f"step {step} | {acc_tok / (now - acc_t):.0f} tok/s | loss {acc_loss / acc_n:.4f} "
                f"| mean depth {acc_depth / acc_n:.1f} | lr {lr:.2e} | tokens {tokens_seen} "
                f"(epoch {data.epoch}) | elapsed {fmt_time(el)} | eta {fmt_time(eta)}")
            history["train"].append({"step": step, "tokens": tokens_seen,
                                     "elapsed_s": round(el, 1),
                                     "loss": round(acc_loss / acc_n, 4),
                                     "tok_per_s": round(acc_tok / (now - acc_t), 1)})
            acc_loss, acc_n, acc_tok, acc_depth, acc_t = 0.0, 0, 0, 0, now
            next_log = now + args.log_every
        if now >= next_val and (args.steps or now - t_train < sched_budget - 60):
            val_cost = run_val(step, tokens_seen)
            save(step, tokens_seen, final=False)
            next_val = time.time() + args.val_every * 60.0
            acc_t += val_cost  # keep the tok/s figure about training only

    stopped_by = stop["signal"]  # (one during the final validation comes after the schedule)
    run_val(step, tokens_seen)
    save(step, tokens_seen, final=True, stopped_by=stopped_by)
    el = time.time() - t_start
    log(f"{'stopped by ' + signal.Signals(stopped_by).name if stopped_by else 'done'}: "
        f"{step} steps, {tokens_seen} tokens in {fmt_time(el)} "
        f"({tokens_seen / max(1e-9, time.time() - t_train):.0f} tok/s overall); "
        f"checkpoint in {args.out}")
    if stopped_by:  # as a shell reports a signal, so run.sh does not evaluate a stopped run
        sys.exit(128 + stopped_by)


if __name__ == "__main__":
    main()

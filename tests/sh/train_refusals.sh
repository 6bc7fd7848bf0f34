#!/bin/sh
# The training scripts refuse bad options in one line (exit 2) before any work and before
# PyTorch loads (they were tracebacks, a hang, or an error after the whole training), and
# scripts/train/run.sh --help prints its usage and does nothing else (it ran the corpus and
# BPE steps, then evaluated the shipped model and rewrote its eval.md).
#   tests/sh/train_refusals.sh PYTHON3 QUANTIZE SCRATCH     (run from the repository root)
set -u
py=$1 quantize=$2 scratch=$3
failed=0
# expect STATUS TEXT COMMAND...: COMMAND exits STATUS and its last stderr line holds TEXT ("":
# no stderr)
expect() {
    want_status=$1 want_text=$2
    shift 2
    "$@" > "$scratch/out" 2> "$scratch/err"
    status=$?
    last=$(tail -n 1 "$scratch/err")
    if [ -z "$want_text" ]; then matched=$([ -z "$last" ] && echo yes)
    else matched=$(printf '%s\n' "$last" | grep -qF -- "$want_text" && echo yes); fi
    if [ "$status" != "$want_status" ] || [ "$matched" != yes ]; then
        echo "FAIL: $* -> exit $status, '$last' (want exit $want_status, '$want_text')"
        failed=1
    fi
}
rm -rf "$scratch" && mkdir -p "$scratch"
# (functions, not "$py scripts/...": a python3 whose path holds a blank split there)
train() { "$py" scripts/train/train.py "$@"; }
evaluate() { "$py" scripts/train/eval.py "$@"; }
expect 2 "train.py: error: --seq must be 1 .. 256 (max_seq_len), got 0" train --seq 0
expect 2 "train.py: error: --seq must be 1 .. 256 (max_seq_len), got 257" train --seq 257
expect 2 "train.py: error: --batch must be 1 or more, got 0" train --batch 0
expect 2 "train.py: error: --threads must be 1 or more, got 0" train --threads 0
expect 2 "train.py: error: --minutes must be more than 0 and finite (or give --steps N), got 0" train --minutes 0
expect 2 "train.py: error: --n-heads 3 does not divide --d-model 256" train --n-heads 3
expect 2 "train.py: error: --d-model 64 / --n-heads 64 = head dim 1: RoPE needs an even head dim" train --d-model 64 --n-heads 64
expect 2 "train.py: error: --default-loops must be 1 .. --max-loops (16), got 17" train --default-loops 17
expect 2 "train.py: error: --max-loops must be 1 .. 4096 (the engine's ceiling), got 4097" train --max-loops 4097
expect 2 "train.py: error: --val-depth must be 1 .. --max-loops (16), got 17" train --val-depth 17
expect 2 "train.py: error: --corpus-dir $scratch/none: no such directory" train --corpus-dir "$scratch/none"
expect 2 "train.py: error: --out README.md: README.md is not a directory" train --check-args --out README.md
expect 2 "train.py: error: --out /proc/tinyloop-x: cannot write in /proc" train --check-args --out /proc/tinyloop-x
expect 0 "" train --check-args --out "$scratch/model"
expect 2 "eval.py: error: --model $scratch/none: no such directory (a checkpoint directory)" evaluate --model "$scratch/none"
expect 2 "eval.py: error: --depths must be loop counts up to the checkpoint's max_loops (16), got '8,17'" evaluate --depths 8,17
expect 2 "eval.py: error: --corpus-dir $scratch/none: no such directory" evaluate --corpus-dir "$scratch/none"
expect 2 "eval.py: error: --out models/tinyloop-austen is a directory; it names the report file" \
    evaluate --val README.md --out models/tinyloop-austen
expect 2 "eval.py: error: --out /proc/tinyloop-x/eval.md: cannot write in /proc" evaluate --val README.md --out /proc/tinyloop-x/eval.md
"$quantize" --type q8 models/tinyloop-austen "$scratch/q8" > /dev/null
expect 2 "eval.py: error: --model $scratch/q8 is a q8 checkpoint; eval.py reads f32/f16/bf16 ones" evaluate --model "$scratch/q8"
# run.sh --help: its usage, nothing run, nothing written (the shipped model's files untouched)
before=$(ls -l --time-style=+%s.%N models/tinyloop-austen)
expect 0 "" sh scripts/train/run.sh --help
grep -q "Reproduces the shipped model end to end" "$scratch/out" || { echo "FAIL: run.sh --help printed no usage"; failed=1; }
! grep -q "== corpus" "$scratch/out" || { echo "FAIL: run.sh --help ran the pipeline"; failed=1; }
[ "$before" = "$(ls -l --time-style=+%s.%N models/tinyloop-austen)" ] || { echo "FAIL: run.sh --help changed models/tinyloop-austen"; failed=1; }
[ "$failed" = 0 ] && echo "train refusals: all as expected"
exit $failed

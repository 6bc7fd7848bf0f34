#!/bin/sh
# Reproduces the shipped model end to end: corpus -> BPE -> training -> evaluation.
#
#   scripts/train/run.sh [train.py arguments...]
#   scripts/train/run.sh -h | --help                           # this text
#   e.g. scripts/train/run.sh                                  # full run: 75 min, 2 threads
#        scripts/train/run.sh --minutes 2 --threads 1 --out /tmp/smoke-model   # smoke test
#
# Arguments go to scripts/train/train.py unchanged (its options: /usr/bin/python3
# scripts/train/train.py --help), which checks them, --out included, before anything runs
# (--check-args: only that); --out, --threads and --corpus-dir are also used for the evaluation
# (report in OUT/eval.md), which follows a completed training only (a run stopped by a signal
# exits non-zero). Run from anywhere; paths are relative to the repository root.
# Needs Debian packages (installed with apt-get when missing and run as root):
# python3-torch, python3-numpy, python3-regex, libopenblas0-pthread (without it Debian's torch
# falls back to the reference BLAS, ~10x slower), plus r-base-core, r-cran-janeaustenr,
# fortunes, fortunes-min (scripts/train/corpus.py installs those).
set -eu
# (--help went on to train.py, whose help exits 0: run.sh then evaluated the default OUT,
# rewriting the shipped model's eval.md)
check_only=
for a in "$@"; do
    case "$a" in
        -h|--help) sed -n '2,/^set -eu/{s/^# \{0,1\}//p;}' "$(readlink -f "$0")"; exit 0 ;;
        --check-args) check_only=1 ;;
    esac
done
cd "$(dirname "$(readlink -f "$0")")/../.."

OUT=models/tinyloop-austen
THREADS=2
CORPUS=build/corpus
prev=
for a in "$@"; do
    case "$prev" in
        --out) OUT=$a ;;
        --threads) THREADS=$a ;;
        --corpus-dir) CORPUS=$a ;;
    esac
    case "$a" in
        --out=*) OUT=${a#--out=} ;;
        --threads=*) THREADS=${a#--threads=} ;;
        --corpus-dir=*) CORPUS=${a#--corpus-dir=} ;;
    esac
    prev=$a
done

PY=/usr/bin/python3
# train.py refuses bad options (OUT included) before the packages and the corpus; where there is
# no python3 yet (python3-torch brings it), right after the packages
checked=
check() {
    $PY scripts/train/train.py --check-args "$@" || exit
    if [ -n "$check_only" ]; then exit 0; fi
    checked=1
}
if [ -x $PY ]; then check "$@"; fi

missing=
for p in python3-torch python3-numpy python3-regex libopenblas0-pthread; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "run.sh: missing Debian packages:$missing (apt-get install --no-install-recommends$missing)" >&2
        exit 1
    fi
    echo "run.sh: installing$missing"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing ||
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing; }
fi

if [ -z "$checked" ]; then check "$@"; fi
echo "== corpus"; $PY scripts/train/corpus.py --out "$CORPUS"
echo "== bpe";    $PY scripts/train/bpe.py --corpus "$CORPUS/train.txt" --out "$CORPUS/tokenizer.json"
echo "== train";  $PY scripts/train/train.py "$@"
echo "== eval";   $PY scripts/train/eval.py --model "$OUT" --corpus-dir "$CORPUS" --threads "$THREADS" --out "$OUT/eval.md"

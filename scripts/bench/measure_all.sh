#!/usr/bin/env bash
# The figures of the closing notes and the model card, in one run (about 15 minutes on a
# quiet 2-core machine), but for the card's loss and agreement by depth: those are
# scripts/train/eval.py's (PyTorch). Writes build/measure/*.txt (+ the sweep's CSV and chart).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
out=build/measure
mkdir -p "$out"
bench=build/scripts/bench/tinyloop-bench
cmake --build build -j2 --target tinyloop-bench tinyloop >/dev/null

echo "== engine benchmark: GPT-2-small shape (f32, f16) and a 400M-class looped model"
for dt in f32 f16; do
  $bench --preset gpt2-small --dtype $dt --decode 32 --repeat 3 --sgemm | tee "$out/bench-gpt2-$dt.txt"
done
$bench --preset looped-400m --dtype f16 --prompt-len 64 --decode 8 --repeat 3 | tee "$out/bench-looped400m.txt"
$bench --model models/tinyloop-austen --decode 64 --repeat 5 | tee "$out/bench-shipped.txt"

echo "== Lua path overhead"
luajit scripts/bench/lua_overhead.lua --tokens 160 --repeat 5 | tee "$out/lua-overhead.txt"

echo "== early exit"
luajit scripts/early_exit_eval.lua | tee "$out/early-exit.txt"

echo "== speculative sweep"
luajit scripts/sweep.lua --max-tokens 64 --repeats 3 --draft-loops 1,2,3 --draft-ahead 2,3,4,5,6,8 \
  --K 1,2 --max-nodes 24 --out "$out/sweep" | tee "$out/sweep.txt" # (the model card's grid)

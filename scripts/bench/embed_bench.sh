#!/usr/bin/env bash
# embed_bench.sh: load benchmark of scripts/serve's POST /v1/embeddings (not a test). Loopback
# only, bounded in time and connections. First the engine alone over the same inputs in one
# process, tokens/s: tl_embed an input at a time (model:embed) and tl_embed_batch a request's
# inputs at once (model:embed_batch, what the server runs). Then the server: C clients post requests of INPUTS
# token-id inputs of LEN ids back to back for D seconds (wrk with serve_load.lua's embed mode),
# while a second wrk probes /health every 100 ms; it prints requests/s, inputs/s, tokens/s (the
# usage's prompt tokens) against the engine alone, /health p50/p99, and non-2xx counts. The
# forward passes run in nginx's thread pool (--embed-jobs at once), never on the event loop:
# /health's latency is the figure that says so.
#   scripts/bench/embed_bench.sh [--model DIR] [--clients 2] [--duration 20] [--inputs 16]
#                                [--len 64] [--threads 2] [--embed-jobs 2] [--port N]
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
model=models/tinyloop-austen clients=2 duration=20 inputs=16 len=64 threads=2 jobs=2 port=$((30000 + RANDOM % 20000))
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift 2 ;; --clients) clients=$2; shift 2 ;; --duration) duration=$2; shift 2 ;;
    --inputs) inputs=$2; shift 2 ;; --len) len=$2; shift 2 ;; --threads) threads=$2; shift 2 ;;
    --embed-jobs) jobs=$2; shift 2 ;; --port) port=$2; shift 2 ;;
    *) echo "embed_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
[ "$clients" -le 64 ] && [ "$duration" -le 600 ] && [ "$inputs" -le 2048 ] || {
  echo "embed_bench: at most 64 clients, 600 s, 2048 inputs" >&2; exit 2; }
command -v wrk >/dev/null 2>&1 || { TINYLOOP_SETUP_EXTRA="wrk" scripts/setup || true; }
command -v wrk >/dev/null 2>&1 || { echo "embed_bench: needs wrk (Debian: apt-get install wrk)" >&2; exit 2; }
vocab=$(grep -o '"vocab_size": *[0-9]*' "$model/config.json" | grep -o '[0-9]*$')

echo "== engine alone: $inputs inputs of $len ids, $threads threads (model:embed each, then model:embed_batch)"
alone=$(luajit - "$model" "$threads" "$vocab" "$inputs" "$len" <<'LUA'
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local tl = require "tinyloop"
local m = assert(tl.load(arg[1], { threads = tonumber(arg[2]) }))
local vocab, inputs, len = tonumber(arg[3]), tonumber(arg[4]), tonumber(arg[5])
local function now() local f = io.popen("date +%s.%N"); local t = tonumber(f:read("*l")); f:close(); return t end
local lists = {}
for i = 1, inputs do lists[i] = {} for k = 1, len do lists[i][k] = (i * 104729 + k * 31) % vocab end end
m:embed(lists[1])
local function rate(run)
  local t0, rounds = now(), 0
  repeat run(); rounds = rounds + 1 until now() - t0 > 3
  return rounds * inputs * len / (now() - t0)
end
local each = rate(function() for i = 1, inputs do m:embed(lists[i]) end end)
local batch = rate(function() m:embed_batch(lists) end)
io.stderr:write(("engine alone: model:embed one input at a time %.1f tokens/s, model:embed_batch %.1f (x%.2f)\n")
  :format(each, batch, batch / each))
print(("%.1f"):format(batch))
LUA
)

work=$(mktemp -d)
serve_pid=""
cleanup() { [ -n "$serve_pid" ] && kill -TERM "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
scripts/serve --port "$port" --model "$model" --threads "$threads" --embed-jobs "$jobs" > "$work/serve.log" 2>&1 &
serve_pid=$!
base="http://127.0.0.1:$port"
for _ in $(seq 300); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' $base/health 2>/dev/null)" = 200 ] && break
  kill -0 "$serve_pid" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
  sleep 0.1
done

echo "== load: $clients clients posting $inputs inputs of $len ids for $duration s, /health probed every 100 ms"
wrk -t 1 -c "$clients" -d "${duration}s" --timeout 120s -s scripts/bench/serve_load.lua "$base/v1/embeddings" \
    -- embed "$vocab" "$inputs" "$len" > "$work/load.txt" 2>&1 &
load_pid=$!
wrk -t 1 -c 1 -d "${duration}s" --timeout 10s -s scripts/bench/serve_load.lua "$base/health" -- probe 100 > "$work/health.txt" 2>&1 &
health_pid=$!
wait "$load_pid" "$health_pid" || true
field() { grep '^serve_load ' "$1" | tr ' ' '\n' | awk -F= -v k="$2" '$1 == k { print $2 }'; }
for f in load health; do grep -q '^serve_load ' "$work/$f.txt" || { cat "$work/$f.txt" >&2; echo "embed_bench: wrk ($f) printed no summary" >&2; exit 1; }; done
secs=$(field "$work/load.txt" secs) ok=$(field "$work/load.txt" ok) tokens=$(field "$work/load.txt" tokens)
tps=$(awk -v t="$tokens" -v s="$secs" 'BEGIN { printf "%.1f", t / s }')
echo "requests/s           $(awk -v n="$ok" -v s="$secs" 'BEGIN { printf "%.2f", n / s }')  ($ok answered 200, $(( $(field "$work/load.txt" fivexx) + $(field "$work/load.txt" other) )) not, $(field "$work/load.txt" sock_errors) socket errors)"
echo "inputs/s             $(awk -v n="$ok" -v i="$inputs" -v s="$secs" 'BEGIN { printf "%.1f", n * i / s }')"
echo "tokens/s             $tps  (engine alone $alone: x$(awk -v a="$tps" -v b="$alone" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }'))"
echo "request latency ms   p50 $(field "$work/load.txt" lat_p50_ms)  p99 $(field "$work/load.txt" lat_p99_ms)"
echo "/health ms           p50 $(field "$work/health.txt" lat_p50_ms)  p99 $(field "$work/health.txt" lat_p99_ms)  max $(field "$work/health.txt" lat_max_ms)  ($(field "$work/health.txt" completed) probes)"

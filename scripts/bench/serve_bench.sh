#!/usr/bin/env bash
# serve_bench.sh: load benchmark of scripts/serve (not a test). Loopback only, bounded in
# time and connections. Streams token-id prompts from N clients for D seconds after a
# single-client baseline, probes /health meanwhile, and prints requests/s, aggregate
# tokens/s against the single client's, p50/p99 time to first token, p50/p99 /health latency,
# 5xx counts, the workers' RSS at the 10th and the 60th second, a disconnect check, and a
# verdict line per criterion of issue 13's "Done when".
#   scripts/bench/serve_bench.sh [--model DIR] [--clients 8] [--duration 60] [--baseline 15]
#                                [--threads 2] [--max-tokens 64] [--port N] [--workers 1]
#   --model /tmp/gpt2-f16   a checkpoint written by
#                           build/scripts/bench/tinyloop-bench --preset gpt2-small --dtype f16 --keep
# Without --model it writes (once) such a random GPT-2-small-shaped f16 checkpoint to
# build/bench-gpt2-small-f16 with tinyloop-bench.
set -euo pipefail
cd "$(dirname "$0")/../.."
model="" clients=8 duration=60 baseline=15 threads=2 max_tokens=64 workers=1 port=$((30000 + RANDOM % 20000))
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift 2 ;; --clients) clients=$2; shift 2 ;; --duration) duration=$2; shift 2 ;;
    --baseline) baseline=$2; shift 2 ;; --threads) threads=$2; shift 2 ;; --max-tokens) max_tokens=$2; shift 2 ;;
    --port) port=$2; shift 2 ;; --workers) workers=$2; shift 2 ;;
    *) echo "serve_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
[ "$clients" -le 64 ] && [ "$duration" -le 600 ] || { echo "serve_bench: at most 64 clients and 600 s" >&2; exit 2; }

if [ -z "$model" ]; then
  model=build/bench-gpt2-small-f16
  if [ ! -f "$model/model.safetensors" ]; then
    cmake --build build -j2 --target tinyloop-bench >/dev/null
    out=$(build/scripts/bench/tinyloop-bench --preset gpt2-small --dtype f16 --keep --threads 1 \
          --prompt-len 8 --decode 1 --repeat 1 --stream-passes 1 --stream-mb 64 2>&1)
    written=$(printf '%s\n' "$out" | grep -o '/[^ ]*tinyloop-bench[^ ]*' | head -n 1)
    [ -d "$written" ] || { printf '%s\n' "$out" >&2; echo "serve_bench: no checkpoint path in the output above" >&2; exit 1; }
    rm -rf "$model" && mv "$written" "$model"
    chmod -R a+rX "$model" # nginx workers started by root run as nobody
  fi
fi
vocab=$(grep -o '"vocab_size": *[0-9]*' "$model/config.json" | grep -o '[0-9]*$')

work=$(mktemp -d)
serve_pid=""
cleanup() { [ -n "$serve_pid" ] && kill -TERM "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
scripts/serve --port "$port" --model "$model" --threads "$threads" --max-active "$clients" --workers "$workers" \
  --prefix "$work/prefix" > "$work/serve.log" 2>&1 &
serve_pid=$!
base=http://127.0.0.1:$port
for _ in $(seq 1 600); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' $base/health 2>/dev/null)" = 200 ] && break; sleep 0.1
done
master=""
for _ in $(seq 1 100); do
  master=$(sed -n 's/.*nginx pid \([0-9]*\).*/\1/p' "$work/serve.log"); [ -n "$master" ] && break; sleep 0.1
done
[ -n "$master" ] || { cat "$work/serve.log" >&2; echo "serve_bench: the server did not start" >&2; exit 1; }
worker_pids=$(pgrep -P "$master" | paste -sd' ')
[ -n "$worker_pids" ] || { echo "serve_bench: no nginx worker under pid $master" >&2; exit 1; }
rss_kb() { local t=0 p; for p in $worker_pids; do t=$((t + $(awk '/VmRSS/ { print $2 }' "/proc/$p/status"))); done; echo $t; }

now_ms() { date +%s%3N; }
# One streaming client: requests back to back until the deadline; per request one line
# "status ttft_ms tokens".
client() {
  local i=$1 deadline=$2 outf=$3 ids body
  ids=$(for k in $(seq 1 16); do echo $(( (i * 7919 + k * 104729) % vocab )); done | paste -sd,)
  body="{\"prompt\": [$ids], \"max_tokens\": $max_tokens, \"ignore_eos\": true, \"stream\": true, \"seed\": $i, \"temperature\": 0.8}"
  while [ "$(now_ms)" -lt "$deadline" ]; do
    # The server sends headers with the first token: time to first byte = time to first token.
    local w tokens
    w=$(curl -sN -m 300 -o "$outf.body" -w '%{http_code} %{time_starttransfer}' -H 'Content-Type: application/json' \
        -d "$body" "$base/v1/completions" || true)
    tokens=$(grep -o '"completion_tokens":[0-9]*' "$outf.body" | grep -o '[0-9]*$' || echo 0)
    echo "${w% *} $(awk -v t="${w#* }" 'BEGIN { printf "%.1f", t * 1000 }') ${tokens:-0}" >> "$outf"
  done
}
pctl() { sort -n | awk -v p="$1" '{a[NR]=$1} END { if (NR == 0) { print "n/a"; exit } i = int(NR * p / 100 + 0.999); if (i < 1) i = 1; print a[i] }'; }

echo "== model $model ($(du -sh "$model" | cut -f1)), $threads threads, serve on $base"
echo "== baseline: 1 streaming client for $baseline s"
t0=$(now_ms); client 0 $((t0 + baseline * 1000)) "$work/base.txt"; t1=$(now_ms)
base_tps=$(awk -v ms=$((t1 - t0)) '{ t += $3 } END { printf "%.2f", t / (ms / 1000) }' "$work/base.txt")
echo "single client: $base_tps tokens/s"

echo "== load: $clients streaming clients for $duration s, /health probed every 100 ms"
start=$(now_ms); deadline=$((start + duration * 1000))
for i in $(seq 1 "$clients"); do client "$i" "$deadline" "$work/c$i.txt" & done
( while [ "$(now_ms)" -lt "$deadline" ]; do
    curl -s -o /dev/null -w '%{http_code} %{time_total}\n' "$base/health" >> "$work/health.txt"; sleep 0.1
  done ) &
# RSS of the worker(s) at the 10th second and at the 60th (or the end of a shorter run).
sleep 10; rss10=$(rss_kb)
rss_at=$(( duration < 60 ? duration : 60 ))
while [ "$(now_ms)" -lt $((start + rss_at * 1000)) ]; do sleep 0.5; done
rss_late=$(rss_kb)
while [ "$(now_ms)" -lt "$deadline" ]; do sleep 1; done
wait $(jobs -p | grep -v "^$serve_pid$") 2>/dev/null || true
end=$(now_ms)
cat "$work"/c[0-9]*.txt > "$work/all.txt"
secs=$(awk -v ms=$((end - start)) 'BEGIN { printf "%.1f", ms / 1000 }')
reqs=$(awk '$1 == 200' "$work/all.txt" | wc -l)
fivexx=$(awk '$1 ~ /^5/' "$work/all.txt" | wc -l)
other=$(awk '$1 != 200 && $1 !~ /^5/' "$work/all.txt" | wc -l)
agg_tps=$(awk -v s="$secs" '$1 == 200 { t += $3 } END { printf "%.2f", t / s }' "$work/all.txt")
health_5xx=$(awk '$1 !~ /^2/' "$work/health.txt" | wc -l)
echo "wall                 $secs s"
echo "requests/s           $(awk -v r="$reqs" -v s="$secs" 'BEGIN { printf "%.3f", r / s }')  ($reqs completed, $fivexx 5xx, $other other)"
echo "aggregate tokens/s   $agg_tps  (single client $base_tps: x$(awk -v a="$agg_tps" -v b="$base_tps" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }'))"
echo "TTFT ms              p50 $(awk '$1 == 200 { print $2 }' "$work/all.txt" | pctl 50)  p99 $(awk '$1 == 200 { print $2 }' "$work/all.txt" | pctl 99)"
echo "/health ms           p50 $(awk '{ print $2 * 1000 }' "$work/health.txt" | pctl 50)  p99 $(awk '{ print $2 * 1000 }' "$work/health.txt" | pctl 99)  ($(wc -l < "$work/health.txt") probes, $health_5xx not 2xx)"
echo "worker RSS           ${rss10} kB at 10 s -> ${rss_late} kB at ${rss_at} s ($(awk -v a="$rss10" -v b="$rss_late" 'BEGIN { printf "%+.2f%%", (b - a) * 100 / a }'))  (worker pids: $worker_pids)"

# A disconnect mid-stream: the server must stop that generation within one token.
m0=$(curl -s "$base/metrics")
curl -sN -m 60 -H 'Content-Type: application/json' \
  -d "{\"prompt\": [1, 2, 3], \"max_tokens\": 200, \"ignore_eos\": true, \"stream\": true}" "$base/v1/completions" | head -n 1 >/dev/null || true # curl dies of the closed pipe
sleep 1
m1=$(curl -s "$base/metrics")
msum() { printf '%s\n' "$1" | awk -v n="$2" 'index($0, n) == 1 { s += $NF } END { print s + 0 }'; }
cancel_d=$(( $(msum "$m1" tinyloop_cancelled_total) - $(msum "$m0" tinyloop_cancelled_total) ))
after_d=$(( $(msum "$m1" tinyloop_engine_steps_after_cancel_total) - $(msum "$m0" tinyloop_engine_steps_after_cancel_total) ))
echo "disconnect           $cancel_d cancelled, $after_d steps after the cancel"
server_5xx=$(printf '%s\n' "$m1" | awk '/^tinyloop_requests_total/ && /status="5/ { s += $NF } END { print s + 0 }')
printf '%s\n' "$m1" | grep -E '^tinyloop_engine_(batch_rows|iterations)_total' || true

# The issue's "Done when", as measured here (meaningful only on an otherwise idle machine).
yn() { if [ "$1" = 1 ]; then echo yes; else echo NO; fi; }
health_p99=$(awk '{ print $2 * 1000 }' "$work/health.txt" | pctl 99)
echo "== verdict"
echo "/health p99 < 20 ms             $(yn "$(awk -v p="$health_p99" 'BEGIN { print (p != "n/a" && p < 20) }')")  ($health_p99 ms)"
echo "aggregate >= 4x single client   $(yn "$(awk -v a="$agg_tps" -v b="$base_tps" 'BEGIN { print (b > 0 && a >= 4 * b) }')")"
echo "no 5xx                          $(yn "$(( fivexx + health_5xx + server_5xx == 0 ))")  (clients $fivexx, /health $health_5xx, server-wide $server_5xx)"
echo "RSS growth 10 s -> ${rss_at} s < 5%    $(yn "$(awk -v a="$rss10" -v b="$rss_late" 'BEGIN { print ((b - a) * 100 < 5 * a) }')")"
echo "disconnect stops within 1 step  $(yn "$(( cancel_d >= 1 && after_d <= 1 ))")"

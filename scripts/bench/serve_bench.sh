#!/usr/bin/env bash
# serve_bench.sh: load benchmark of scripts/serve (not a test). Loopback only, bounded in
# time and connections. Streams token-id prompts from N clients for D seconds after a
# single-client baseline, probes /health meanwhile, and prints requests/s, aggregate
# tokens/s against the single client's, p50/p99 time to first token, p50/p99 /health latency,
# 5xx counts, the workers' RSS at the 10th and the 60th second (or the end of a shorter load:
# --duration 20 to 600), a disconnect check, and a
# verdict line per criterion of issue 13's "Done when". Per phase it also prints where the CPU
# went (the workers' compute threads, event loops and other threads; wrk) and the engine's
# rows per compute-CPU-second, a figure that other processes on the machine change little.
# The load is wrk with scripts/bench/serve_load.lua (streams back to back, no process per
# request); /health is probed by a second wrk instance at one request per 100 ms. Tokens,
# statuses and rows per step are differences of the server's /metrics counters before and
# after each phase (wrk's own count of the streamed tokens is printed next to them); TTFT
# p50/p99 come from the difference of the server's TTFT histogram (bucket precision).
#   scripts/bench/serve_bench.sh [--model DIR] [--clients 8] [--duration 60] [--baseline 15]
#                                [--threads 2] [--max-tokens 64] [--prompt-len 16] [--port N]
#                                [--workers 1] [--engine-nice 5] [--no-engine-ref]
#   --model /tmp/gpt2-f16   a checkpoint written by
#                           build/scripts/bench/tinyloop-bench --preset gpt2-small --dtype f16 --keep
# Without --model it writes (once) such a random GPT-2-small-shaped f16 checkpoint to
# build/bench-gpt2-small-f16 with tinyloop-bench.
# First (unless --no-engine-ref) it runs the engine alone, tinyloop-batch-bench with 1 and N
# sessions, before the server starts: decode only, and the same request mix as the load
# (--mix: prompts of --prompt-len tokens, --max-tokens each at temperature 0.8, a finished
# session replaced at once), which the HTTP ratio "N clients / 1 client" cannot exceed: every
# joining request's prompt rows share the passes with the decode rows, and at N rows a row
# costs far more of a step than at one. The verdict prints both ratios.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
engine_ref=1 model="" clients=8 duration=60 baseline=15 threads=2 max_tokens=64 prompt_len=16 workers=1 engine_nice=5 port=$((30000 + RANDOM % 20000))
while [ $# -gt 0 ]; do
  case "$1" in
    --no-engine-ref) ;;
    *) [ $# -ge 2 ] || { echo "serve_bench: $1 needs a value" >&2; exit 2; } ;;
  esac
  case "$1" in
    --model) model=$2; shift 2 ;; --clients) clients=$2; shift 2 ;; --duration) duration=$2; shift 2 ;;
    --baseline) baseline=$2; shift 2 ;; --threads) threads=$2; shift 2 ;; --max-tokens) max_tokens=$2; shift 2 ;;
    --prompt-len) prompt_len=$2; shift 2 ;;
    --port) port=$2; shift 2 ;; --workers) workers=$2; shift 2 ;; --no-engine-ref) engine_ref=0; shift ;;
    --engine-nice) engine_nice=$2; shift 2 ;;
    *) echo "serve_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
for pair in "clients=$clients" "duration=$duration" "baseline=$baseline" "threads=$threads" "max-tokens=$max_tokens" \
            "prompt-len=$prompt_len" "workers=$workers" "port=$port"; do
  case "${pair#*=}" in
    '' | *[!0-9]* | 0*) echo "serve_bench: --${pair%%=*} must be a whole number from 1, got '${pair#*=}'" >&2; exit 2 ;;
  esac
done
[ "$clients" -le 64 ] && [ "$duration" -le 600 ] || { echo "serve_bench: at most 64 clients and 600 s" >&2; exit 2; }
# (the RSS figure compares the 10th second with a later one, and the load's figures are over
# its own duration: a load under 20 s was measured over the 10 s the first sample waits)
[ "$duration" -ge 20 ] || { echo "serve_bench: --duration must be at least 20 s (the worker's RSS is sampled at the 10th)" >&2; exit 2; }
# wrk (the load) and nginx (the server): scripts/setup installs what is missing; without wrk
# every load phase would fail with "command not found" and leave no figures.
if ! command -v wrk >/dev/null 2>&1; then
  TINYLOOP_SETUP_EXTRA="wrk" scripts/setup || true
  command -v wrk >/dev/null 2>&1 || { echo "serve_bench: needs wrk (Debian: apt-get install wrk)" >&2; exit 2; }
fi

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

ref_line="" ref_ratio="" mix_line="" mix_ratio="" mix_eff_one="" mix_eff_many=""
if [ "$engine_ref" = 1 ]; then
  cmake --build build -j2 --target tinyloop-batch-bench >/dev/null 2>&1 || true
  if [ -x build/scripts/bench/tinyloop-batch-bench ]; then
    # the server's step_rows (scripts/serve's default, tl_engine_auto_step_rows: whole passes of
    # 64 rows that leave prompts 32 or more)
    step_rows=$(( 64 * ((clients + 32 + 63) / 64) ))
    ref=$(build/scripts/bench/tinyloop-batch-bench --model "$model" --threads "$threads" --steps 32 --prefix 16 \
          --sessions "1,$clients" --mix "$prompt_len,$max_tokens" --step-rows "$step_rows" 2>&1 || true)
    one=$(printf '%s\n' "$ref" | awk '$1 == 1 && $3 ~ /x$/ { print $2 }')
    many=$(printf '%s\n' "$ref" | awk -v n="$clients" '$1 == n && $3 ~ /x$/ { print $2 }')
    if [ -n "$one" ] && [ -n "$many" ]; then
      ref_ratio=$(awk -v a="$many" -v b="$one" 'BEGIN { printf "%.2f", a / b }')
      ref_line="engine alone (tinyloop-batch-bench, decode only, no HTTP): 1 session $one tok/s, $clients sessions $many tok/s: x$ref_ratio"
    fi
    # "mix N step-rows tok/s ratio p50 / p99 / max CPU% tok-per-CPU-s", the baseline (1) first
    one=$(printf '%s\n' "$ref" | awk '$1 == "mix" && $2 == 1 { print $4; exit }')
    many=$(printf '%s\n' "$ref" | awk -v n="$clients" '$1 == "mix" && $2 == n { v = $4 } END { print v }')
    mix_eff_one=$(printf '%s\n' "$ref" | awk '$1 == "mix" && $2 == 1 { print $12; exit }')
    mix_eff_many=$(printf '%s\n' "$ref" | awk -v n="$clients" '$1 == "mix" && $2 == n { v = $12 } END { print v }')
    if [ -n "$one" ] && [ -n "$many" ]; then
      mix_ratio=$(awk -v a="$many" -v b="$one" 'BEGIN { printf "%.2f", a / b }')
      mix_line="engine alone, the load's mix ($prompt_len-token prompts, $max_tokens tokens at temperature 0.8, no HTTP): 1 session $one tok/s, $clients sessions $many tok/s: x$mix_ratio"
    fi
  fi
fi

work=$(mktemp -d)
serve_pid=""
cleanup() { [ -n "$serve_pid" ] && kill -TERM "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
scripts/serve --port "$port" --model "$model" --threads "$threads" --max-active "$clients" --workers "$workers" \
  --engine-nice "$engine_nice" --prefix "$work/prefix" > "$work/serve.log" 2>&1 &
serve_pid=$!
base=http://127.0.0.1:$port
for _ in $(seq 1 600); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' $base/health 2>/dev/null)" = 200 ] && break
  kill -0 "$serve_pid" 2>/dev/null || break # it refused to start (its reason is in the log)
  sleep 0.1
done
master=""
for _ in $(seq 1 100); do
  master=$(sed -n 's/.*nginx pid \([0-9]*\).*/\1/p' "$work/serve.log"); [ -n "$master" ] && break
  kill -0 "$serve_pid" 2>/dev/null || break
  sleep 0.1
done
[ -n "$master" ] || { cat "$work/serve.log" >&2; echo "serve_bench: the server did not start" >&2; exit 1; }
worker_pids=$(pgrep -P "$master" | paste -sd' ')
[ -n "$worker_pids" ] || { echo "serve_bench: no nginx worker under pid $master" >&2; exit 1; }
rss_kb() { local t=0 p; for p in $worker_pids; do t=$((t + $(awk '/VmRSS/ { print $2 }' "/proc/$p/status"))); done; echo $t; }
# "pid tid cpu-ticks" of every thread of the workers.
thread_ticks() {
  local p t
  for p in $worker_pids; do
    for t in /proc/"$p"/task/*; do
      echo "$p ${t##*/} $(awk '{ sub(/.*\) /, ""); split($0, f, " "); print f[12] + f[13] }' "$t/stat" 2>/dev/null)"
    done
  done
}
# Where the workers' CPU went between thread_ticks dumps $1 and $2, $3 seconds apart:
# "compute% eventloop% other% compute-CPU-seconds". A worker's main thread is its event loop;
# the `threads` x workers busiest other threads are the compute threads (each engine's thread
# and its model's pool workers), the rest mostly the thread pool the handlers wait in.
compute_threads=$(( (threads > 0 ? threads : $(nproc)) * workers ))
cpu_split() {
  awk 'NR == FNR { a[$1 " " $2] = $3; next } ($1 " " $2) in a { print ($1 == $2 ? "E" : "T"), $3 - a[$1 " " $2] }' "$1" "$2" |
    sort -k2,2nr | awk -v k="$compute_threads" -v s="$3" -v hz="$(getconf CLK_TCK)" '
      $1 == "E" { e += $2; next } { n++; if (n <= k) c += $2; else o += $2 }
      END { printf "%.0f %.1f %.1f %.3f\n", 100 * c / hz / s, 100 * e / hz / s, 100 * o / hz / s, c / hz }'
}

now_ms() { date +%s%3N; }
metrics() { curl -s "$base/metrics"; }
# Sum of the series whose line starts with $2 (a name, or a name and labels) in dump $1.
msum() { awk -v n="$2" 'index($0, n) == 1 { s += $NF } END { printf "%.17g\n", s + 0 }' "$1"; }
# The field $2 of wrk's "serve_load k=v ..." line in file $1.
field() { sed -n "s/.*serve_load .* $2=\([^ ]*\).*/\1/p" "$1" | tail -n 1; }
# Quantile $4 (0-1) of histogram $3 between dumps $1 and $2: the buckets' difference,
# interpolated linearly inside the bucket where the quantile falls (as Prometheus'
# histogram_quantile does), so its precision is the bucket width.
hist_q() {
  awk -v h="$3_bucket" -v q="$4" '
    FNR == NR { if (index($0, h) == 1) { match($0, /le="[^"]*"/); a[substr($0, RSTART + 4, RLENGTH - 5)] = $NF } next }
    index($0, h) == 1 { match($0, /le="[^"]*"/); le = substr($0, RSTART + 4, RLENGTH - 5); n++; les[n] = le; d[n] = $NF - a[le] }
    END {
      total = d[n]; if (total <= 0) { print "n/a"; exit }
      rank = q * total; prev_le = 0; prev_c = 0
      for (i = 1; i <= n; i++) {
        if (d[i] >= rank) {
          if (les[i] == "+Inf") { printf ">%.0f\n", prev_le * 1000; exit }
          printf "%.1f\n", (prev_le + (les[i] - prev_le) * (rank - prev_c) / (d[i] - prev_c)) * 1000; exit
        }
        prev_le = les[i]; prev_c = d[i]
      }
    }' "$1" "$2"
}
# wrk streams from N connections (one wrk thread: its event loop is far from busy), each
# starting its next request as soon as the last one ends; $1 connections, $2 seconds,
# $3 output file, $4 seed base. wrk's CPU seconds (user, system) go to $3.cpu.
load() {
  local TIMEFORMAT="%U %S"
  { time wrk -t 1 -c "$1" -d "${2}s" --timeout 120s -s scripts/bench/serve_load.lua "$base/v1/completions" \
      -- stream "$vocab" "$max_tokens" "$4" "$1" "$prompt_len" > "$3" 2>&1; } 2> "$3.cpu"
}
# CPU % of one core that wrk took: its .cpu file $1 over $2 seconds.
wrk_pct() { awk -v s="$2" '{ printf "%.1f", 100 * ($1 + $2) / s }' "$1.cpu"; }

echo "== model $model ($(du -sh "$model" | cut -f1)), $threads threads, serve on $base, load $(cut -d' ' -f1-3 /proc/loadavg)"
[ -n "$ref_line" ] && echo "$ref_line"
[ -n "$mix_line" ] && echo "$mix_line"
echo "== baseline: 1 streaming client (wrk -c 1) for $baseline s"
metrics > "$work/m0"; thread_ticks > "$work/c0"; t0=$(now_ms)
load 1 "$baseline" "$work/base.txt" 1000000000
t1=$(now_ms); thread_ticks > "$work/c1"; metrics > "$work/m1"
base_secs=$(awk -v ms=$((t1 - t0)) 'BEGIN { printf "%.3f", ms / 1000 }')
base_tokens=$(( $(msum "$work/m1" tinyloop_generated_tokens_total) - $(msum "$work/m0" tinyloop_generated_tokens_total) ))
base_tps=$(awk -v t="$base_tokens" -v s="$base_secs" 'BEGIN { printf "%.2f", t / s }')
echo "single client: $base_tps tokens/s  ($base_tokens tokens of completed requests in $base_secs s, server counter; wrk saw $(field "$work/base.txt" tokens) in $(field "$work/base.txt" ok) streams)"

echo "== load: $clients streaming clients (wrk -c $clients) for $duration s, /health probed every 100 ms (wrk -c 1)"
metrics > "$work/m2"; thread_ticks > "$work/c2"
start=$(now_ms)
load "$clients" "$duration" "$work/load.txt" 2000000000 &
load_pid=$!
( TIMEFORMAT="%U %S"; time wrk -t 1 -c 1 -d "${duration}s" --timeout 10s -s scripts/bench/serve_load.lua "$base/health" -- probe 100 \
    > "$work/health.txt" 2>&1 ) 2> "$work/health.txt.cpu" &
health_pid=$!
# RSS of the worker(s) at the 10th second and at the 60th (or the end of a shorter run).
sleep 10; rss10=$(rss_kb)
rss_at=$(( duration < 60 ? duration : 60 ))
while [ "$(now_ms)" -lt $((start + rss_at * 1000)) ]; do sleep 0.5; done
rss_late=$(rss_kb); thread_ticks > "$work/c3"; metrics > "$work/m2b"; late=$(now_ms)
wait "$load_pid" "$health_pid" || true
end=$(now_ms); metrics > "$work/m3"
for f in load health; do grep -q '^serve_load ' "$work/$f.txt" || { cat "$work/$f.txt" >&2; echo "serve_bench: wrk ($f) printed no summary" >&2; exit 1; }; done
secs=$(awk -v ms=$((end - start)) 'BEGIN { printf "%.1f", ms / 1000 }')
d() { awk -v a="$(msum "$work/m2" "$1")" -v b="$(msum "$work/m3" "$1")" 'BEGIN { printf "%.17g\n", b - a }'; }
# A stream that wrk closes at the end of the phase is logged with its status, 200, and
# cancelled: completed requests are the engine-side count of generations run to the end.
reqs=$(d tinyloop_completed_total)
ok200=$(d 'tinyloop_requests_total{endpoint="/v1/completions",status="200"}')
fivexx=$(d 'tinyloop_requests_total{endpoint="/v1/completions",status="5')
other=$(( $(d 'tinyloop_requests_total{endpoint="/v1/completions"') - ok200 - fivexx ))
tokens=$(d tinyloop_generated_tokens_total)
rows=$(d tinyloop_engine_batch_rows_total)
iters=$(d tinyloop_engine_iterations_total)
agg_tps=$(awk -v t="$tokens" -v s="$secs" 'BEGIN { printf "%.2f", t / s }')
health_p50=$(field "$work/health.txt" lat_p50_ms); health_p99=$(field "$work/health.txt" lat_p99_ms)
health_bad=$(( $(field "$work/health.txt" fivexx) + $(field "$work/health.txt" other) + $(field "$work/health.txt" sock_errors) + $(field "$work/health.txt" timeouts) ))
echo "wall                 $secs s  (load $(cut -d' ' -f1-3 /proc/loadavg))"
echo "requests/s           $(awk -v r="$reqs" -v s="$secs" 'BEGIN { printf "%.3f", r / s }')  ($reqs completed, $((ok200 - reqs)) cut at the end, $fivexx 5xx, $other other: server counters; wrk: $(field "$work/load.txt" ok) ok, $(field "$work/load.txt" fivexx) 5xx, $(field "$work/load.txt" broken) broken streams, $(field "$work/load.txt" sock_errors) socket errors, $(field "$work/load.txt" timeouts) timeouts)"
echo "aggregate tokens/s   $agg_tps  (single client $base_tps: x$(awk -v a="$agg_tps" -v b="$base_tps" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }'))  ($tokens tokens of completed requests, server counter; wrk saw $(field "$work/load.txt" tokens); engine stepped $(awk -v r="$rows" -v s="$secs" 'BEGIN { printf "%.1f", r / s }') rows/s)"
wakes=$(d tinyloop_engine_waiter_wakeups_total)
echo "rows per step        $(awk -v r="$rows" -v i="$iters" 'BEGIN { printf "%.2f", (i > 0 ? r / i : 0) }')  ($rows rows in $iters batched steps; $(awk -v w="$wakes" -v r="$rows" 'BEGIN { printf "%.2f", (r > 0 ? w / r : 0) }') handler wake-ups per row: engine counters)"
echo "TTFT ms              p50 $(hist_q "$work/m2" "$work/m3" tinyloop_time_to_first_token_seconds 0.5)  p99 $(hist_q "$work/m2" "$work/m3" tinyloop_time_to_first_token_seconds 0.99)  (server histogram, interpolated in its buckets; single client p50 $(hist_q "$work/m0" "$work/m1" tinyloop_time_to_first_token_seconds 0.5))"
echo "/health ms           p50 $health_p50  p99 $health_p99  max $(field "$work/health.txt" lat_max_ms)  ($(field "$work/health.txt" completed) probes by wrk, $health_bad not 2xx or failed)"
echo "worker RSS           ${rss10} kB at 10 s -> ${rss_late} kB at ${rss_at} s ($(awk -v a="$rss10" -v b="$rss_late" 'BEGIN { printf "%+.2f%%", (b - a) * 100 / a }'))  (worker pids: $worker_pids)"
# Where the CPU went, per phase (load: its first $rss_at s), in % of one core ($(nproc) cores here).
read -r b_comp b_ev b_other b_secs < <(cpu_split "$work/c0" "$work/c1" "$base_secs")
load_secs=$(awk -v ms=$((late - start)) 'BEGIN { printf "%.3f", ms / 1000 }')
read -r l_comp l_ev l_other l_secs < <(cpu_split "$work/c2" "$work/c3" "$load_secs")
echo "CPU % of one core    1 client: compute threads $b_comp, event loop $b_ev, other worker threads $b_other, wrk $(wrk_pct "$work/base.txt" "$base_secs");  $clients clients: compute threads $l_comp, event loop $l_ev, other worker threads $l_other, wrk $(wrk_pct "$work/load.txt" "$secs") + $(wrk_pct "$work/health.txt" "$secs") (/health)  ($(nproc) cores)"
# Rows per CPU-second of the compute threads: the engine's own efficiency, which other
# processes taking the cores change little (unlike tokens/s); against the engine alone on the
# same mix it shows what the server itself costs the engine.
b_rows=$(( $(msum "$work/m1" tinyloop_engine_batch_rows_total) - $(msum "$work/m0" tinyloop_engine_batch_rows_total) ))
l_rows=$(( $(msum "$work/m2b" tinyloop_engine_batch_rows_total) - $(msum "$work/m2" tinyloop_engine_batch_rows_total) ))
per_cpu() { awk -v r="$1" -v c="$2" 'BEGIN { printf "%.1f", (c > 0 ? r / c : 0) }'; }
echo "rows per compute-CPU-s  1 client $(per_cpu "$b_rows" "$b_secs"), $clients clients $(per_cpu "$l_rows" "$l_secs")  (the engine alone on the same mix: ${mix_eff_one:-n/a}, ${mix_eff_many:-n/a})"

# A disconnect mid-stream: the server must stop that generation within one token.
metrics > "$work/m4"
curl -sN -m 60 -H 'Content-Type: application/json' \
  -d "{\"prompt\": [1, 2, 3], \"max_tokens\": 200, \"ignore_eos\": true, \"stream\": true}" "$base/v1/completions" | head -n 1 >/dev/null || true # curl dies of the closed pipe
sleep 1
metrics > "$work/m5"
cancel_d=$(( $(msum "$work/m5" tinyloop_cancelled_total) - $(msum "$work/m4" tinyloop_cancelled_total) ))
after_d=$(( $(msum "$work/m5" tinyloop_engine_steps_after_cancel_total) - $(msum "$work/m4" tinyloop_engine_steps_after_cancel_total) ))
echo "disconnect           $cancel_d cancelled, $after_d steps after the cancel"
server_5xx=$(awk '/^tinyloop_requests_total/ && /status="5/ { s += $NF } END { print s + 0 }' "$work/m5")

# The issue's "Done when", as measured here (meaningful only on an otherwise idle machine).
yn() { if [ "$1" = 1 ]; then echo yes; else echo NO; fi; }
echo "== verdict"
echo "/health p99 < 20 ms             $(yn "$(awk -v p="$health_p99" 'BEGIN { print (p != "n/a" && p < 20) }')")  ($health_p99 ms)"
echo "aggregate >= 4x single client   $(yn "$(awk -v a="$agg_tps" -v b="$base_tps" 'BEGIN { print (b > 0 && a >= 4 * b) }')")  (x$(awk -v a="$agg_tps" -v b="$base_tps" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }'); the engine alone: decode only x${ref_ratio:-n/a}, the load's mix x${mix_ratio:-n/a})"
echo "no 5xx                          $(yn "$(( fivexx + health_bad + server_5xx == 0 ))")  (clients $fivexx, /health $health_bad, server-wide $server_5xx)"
echo "RSS growth 10 s -> ${rss_at} s < 5%    $(yn "$(awk -v a="$rss10" -v b="$rss_late" 'BEGIN { print ((b - a) * 100 < 5 * a) }')")"
echo "disconnect stops within 1 step  $(yn "$(( cancel_d >= 1 && after_d <= 1 ))")"

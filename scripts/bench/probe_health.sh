# probe_health.sh: sourced by the serving benches (grammar_compile_bench.sh,
# event_loop_bench.sh): /health's latency while a load runs, the one probe they share.

# probe_health PORT PID LOG: GET /health on 127.0.0.1:PORT every 10 ms while process PID lives,
# each answer's time (seconds) a line of LOG.
probe_health() {
  : > "$3"
  while kill -0 "$2" 2>/dev/null; do
    curl -s -o /dev/null -w "%{time_total}\n" "http://127.0.0.1:$1/health" >> "$3"
    sleep 0.01
  done
}

# health_figures LOG -> "probes p50 p99 max" (the last three in ms) on one line.
health_figures() {
  sort -n "$1" | awk '{ a[NR] = $1 } END {
    printf "%d %.2f %.2f %.2f\n", NR, 1000 * a[int(NR * 0.5) + 1], 1000 * a[int(NR * 0.99) + 1], 1000 * a[NR] }'
}

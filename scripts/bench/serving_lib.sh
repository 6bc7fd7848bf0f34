# serving_lib.sh: sourced by the serving benches (grammar_compile_bench.sh, event_loop_bench.sh):
# their scratch directory, their server and their /health probe, written once.

# bench_dir: a scratch directory in $dir (readable by nginx's workers), removed at exit with the
# server start_serve started.
bench_dir() {
  dir=$(mktemp -d)
  chmod a+rx "$dir"
  server=""
  trap 'bench_cleanup' EXIT
}
bench_cleanup() {
  if [ -n "$server" ]; then kill -TERM "$server" 2>/dev/null && wait "$server" 2>/dev/null || true; fi
  rm -rf "$dir"
}

# start_serve PORT [scripts/serve options...]: the shipped model served on 127.0.0.1:PORT (its
# files under $dir/prefix, its output in $dir/serve.log) once /health answers; else its output
# and exit 1.
start_serve() {
  local port=$1
  shift
  scripts/serve --port "$port" "$@" --prefix "$dir/prefix" > "$dir/serve.log" 2>&1 &
  server=$!
  for _ in $(seq 300); do curl -s -o /dev/null "http://127.0.0.1:$port/health" && break; sleep 0.1; done
  curl -s -o /dev/null "http://127.0.0.1:$port/health" || { cat "$dir/serve.log" >&2; exit 1; }
}

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

#!/usr/bin/env bash
# grammar_compile_bench.sh: what compiling request grammars costs the other connections of a
# server (not a test). Loopback only. Starts scripts/serve on the shipped model, sends N
# requests one after another, each with a JSON Schema of P properties that no earlier request
# sent (so each compiles: the cache cannot answer), and probes /health every 10 ms meanwhile.
# Prints the requests' times and /health's p50, p99 and maximum latency. Grammars from text
# compile in nginx's thread pool; where they compiled on the event loop, /health waited for
# each compile. With --prompt-kb K the requests are instead prompts of K KB (encoded in the
# pool from 16 KB on; refused afterwards as longer than the shipped model's context). With
# --tools T they are chat requests with T tools of 70 properties each (about 7.7 KB a tool),
# whose rendering (the tools' ordered decoding, the template's tojson of them) is Lua on the
# event loop, paused each 5 ms of it (tinyloop.pause); refused afterwards as longer than the
# context.
#   scripts/bench/grammar_compile_bench.sh [--requests 12] [--properties 3000] [--prompt-kb K | --tools T] [--port N]
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
. scripts/bench/serving_lib.sh
requests=12 properties=3000 prompt_kb=0 tools=0 port=$((30000 + RANDOM % 20000))
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) requests=$2; shift 2 ;; --properties) properties=$2; shift 2 ;; --port) port=$2; shift 2 ;;
    --prompt-kb) prompt_kb=$2; shift 2 ;; --tools) tools=$2; shift 2 ;;
    *) echo "grammar_compile_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
for v in requests properties port; do
  [[ ${!v} =~ ^[1-9][0-9]{0,6}$ ]] || { echo "grammar_compile_bench: --$v must be a positive integer, got '${!v}'" >&2; exit 2; }
done
[[ $prompt_kb =~ ^(0|[1-9][0-9]{0,4})$ ]] || { echo "grammar_compile_bench: --prompt-kb must be a non-negative integer, got '$prompt_kb'" >&2; exit 2; }
[[ $tools =~ ^(0|[1-9][0-9]{0,2})$ ]] || { echo "grammar_compile_bench: --tools must be an integer from 0 to 999, got '$tools'" >&2; exit 2; }
bench_dir
# the bodies: request k's schema has properties p<k>_1 .. p<k>_P
luajit - "$dir" "$requests" "$properties" "$prompt_kb" "$tools" <<'LUA'
local dir, n, p, kb, tools = arg[1], tonumber(arg[2]), tonumber(arg[3]), tonumber(arg[4]), tonumber(arg[5])
local sentence = "It is a truth universally acknowledged. "
local any = '{"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "array", "items": {"type": "string"}}]}'
for k = 1, n do
  local f = assert(io.open(("%s/body%d.json"):format(dir, k), "w"))
  if tools > 0 then
    local list = {}
    for t = 1, tools do
      local props = {}
      for i = 1, 70 do props[i] = ('"a%d_%d": %s'):format(k, i, any) end
      list[t] = ('{"type": "function", "function": {"name": "f%d_%d", "parameters": {"type": "object", "properties": {%s}}}}')
        :format(k, t, table.concat(props, ", "))
    end
    f:write('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": [' .. table.concat(list, ", ") .. "]}")
  elseif kb > 0 then
    f:write("{\"prompt\": \"" .. k .. " " .. sentence:rep(math.ceil(kb * 1024 / #sentence)) .. "\", \"max_tokens\": 1}")
  else
    local props = {}
    for i = 1, p do props[i] = ("\"p%d_%d\": {\"type\": \"string\", \"maxLength\": 20}"):format(k, i) end
    f:write("{\"prompt\": \"It is\", \"max_tokens\": 1, \"response_format\": {\"type\": \"json_schema\", \"json_schema\": " ..
            "{\"name\": \"x\", \"schema\": {\"type\": \"object\", \"properties\": {" .. table.concat(props, ", ") .. "}}}}}")
  end
  f:close()
end
LUA
start_serve "$port" --threads 1 --max-body $(( 1048576 + 2048 * prompt_kb ))
if [ "$tools" -gt 0 ]; then
  echo "grammar_compile_bench: $requests requests, each a chat of $tools tools ($(wc -c < "$dir/body1.json") bytes)"
elif [ "$prompt_kb" -gt 0 ]; then
  echo "grammar_compile_bench: $requests requests, each a prompt of $prompt_kb KB ($(wc -c < "$dir/body1.json") bytes)"
else
  echo "grammar_compile_bench: $requests requests, each a new JSON Schema of $properties properties ($(wc -c < "$dir/body1.json") bytes)"
fi
(
  for k in $(seq 1 "$requests"); do
    curl -s -o /dev/null -w "%{http_code} %{time_total}\n" -H 'Content-Type: application/json' \
      --data-binary @"$dir/body$k.json" "http://127.0.0.1:$port/v1/$([ "$tools" -gt 0 ] && echo chat/completions || echo completions)"
  done
) > "$dir/requests.log" &
load=$!
probe_health "$port" "$load" "$dir/health.log"
wait "$load"
awk -v want="$([ "$prompt_kb" -gt 0 ] || [ "$tools" -gt 0 ] && echo 400 || echo 200)" '{ n++; if ($1 != want) bad++; t += $2 }
  END { printf "requests: %d, %d not %s, mean %.1f ms each\n", n, bad, want, 1000 * t / n }' "$dir/requests.log"
read -r probes p50 p99 max < <(health_figures "$dir/health.log")
printf "/health meanwhile: %d probes, p50 %s ms, p99 %s ms, max %s ms\n" "$probes" "$p50" "$p99" "$max"

#!/usr/bin/env bash
# event_loop_bench.sh: how long one large request holds the server's event loop, API by API
# (not a test). Loopback only. Starts scripts/serve on the shipped model; for each case, a body
# of about 1 MB (the default --max-body), sends N such requests one after another and probes
# /health every 10 ms meanwhile; prints each case's answers (statuses), its mean request time and
# /health's p50, p99 and maximum latency. What a handler does in Lua on the event loop (decoding
# and checking a body, translating another API's request, rendering a chat template) pauses
# each 5 ms of it (tinyloop.pause); what is C does not (cjson's decoding: about 6-13 ms a MB).
#   scripts/bench/event_loop_bench.sh [--requests 2] [--case NAME]... [--port N]
# Cases: chat-tools (120 tools of 70 properties), chat-messages (17,000 messages),
# anthropic-blocks (24,000 text blocks in one turn), anthropic-count (the same, counted),
# responses-items (18,000 input items), ollama-chat (17,000 messages, cut to the context),
# completions-prompts (20,000 prompts: refused, too many choices), tokenize-pieces (990 KB of
# text, each token's piece), detokenize (180,000 ids), llama-ids (/completion, 180,000 ids).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
. scripts/bench/serving_lib.sh
requests=2 port=$((30000 + RANDOM % 20000))
all="chat-tools chat-messages anthropic-blocks anthropic-count responses-items ollama-chat completions-prompts tokenize-pieces detokenize llama-ids"
cases=""
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) requests=$2; shift 2 ;; --port) port=$2; shift 2 ;;
    --case) cases="$cases $2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "event_loop_bench: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
for v in requests port; do
  [[ ${!v} =~ ^[1-9][0-9]{0,5}$ ]] || { echo "event_loop_bench: --$v must be a positive integer, got '${!v}'" >&2; exit 2; }
done
cases=${cases:-$all}
for c in $cases; do
  [[ " $all " == *" $c "* ]] || { echo "event_loop_bench: unknown case '$c' (cases: $all)" >&2; exit 2; }
done
bench_dir
# the bodies: case.json and case.path (the same words each run)
luajit - "$dir" <<'LUA'
local dir = arg[1]
local cjson = require "cjson"
math.randomseed(1)
local words = {}
for w in ("It is a truth universally acknowledged that a single man in possession of a good fortune must be in want of a wife"):gmatch("%S+") do
  words[#words + 1] = w
end
local function text(n)
  local out, len = {}, 0
  while len < n do local w = words[math.random(#words)]; out[#out + 1] = w; len = len + #w + 1 end
  return table.concat(out, " "):sub(1, n)
end
local function ids(n) local t = {} for i = 1, n do t[i] = math.random(0, 3999) end return t end
local function alternating(n) local t = {} for i = 1, n do t[i] = { role = i % 2 == 1 and "user" or "assistant", content = text(20) } end return t end
local function blocks(n) local t = {} for i = 1, n do t[i] = { type = "text", text = text(10) } end return t end
local long = text(990000)
local cases = {
  ["chat-tools"] = { "/v1/chat/completions", function()
    local any = { anyOf = { { type = "string" }, { type = "integer" }, { type = "array", items = { type = "string" } } } }
    local tools = {}
    for t = 1, 120 do
      local properties = {}
      for i = 1, 70 do properties["a" .. i] = any end
      tools[t] = { type = "function", ["function"] = { name = "f" .. t, parameters = { type = "object", properties = properties } } }
    end
    return { messages = { { role = "user", content = "hi" } }, max_tokens = 1, tools = tools }
  end },
  ["chat-messages"] = { "/v1/chat/completions", function() return { messages = alternating(17000), max_tokens = 4 } end },
  ["anthropic-blocks"] = { "/v1/messages", function()
    return { model = "tinyloop-austen", max_tokens = 4, messages = { { role = "user", content = blocks(24000) } } }
  end },
  ["anthropic-count"] = { "/v1/messages/count_tokens", function()
    return { model = "tinyloop-austen", messages = { { role = "user", content = blocks(24000) } } }
  end },
  ["responses-items"] = { "/v1/responses", function()
    local items = {}
    for i = 1, 18000 do items[i] = { role = "user", content = text(20) } end
    return { input = items, max_output_tokens = 4 }
  end },
  ["ollama-chat"] = { "/api/chat", function()
    return { model = "tinyloop-austen", stream = false, options = { num_predict = 4 }, messages = alternating(17000) }
  end },
  ["completions-prompts"] = { "/v1/completions", function()
    local prompts = {}
    for i = 1, 20000 do prompts[i] = text(40) end
    return { prompt = prompts, max_tokens = 1 }
  end },
  ["tokenize-pieces"] = { "/tokenize", function() return { content = long, with_pieces = true } end },
  ["detokenize"] = { "/detokenize", function() return { tokens = ids(180000) } end },
  ["llama-ids"] = { "/completion", function() return { prompt = ids(180000), n_predict = 4 } end },
}
for name, case in pairs(cases) do
  local body = cjson.encode(case[2]())
  assert(#body <= 1048576, name .. " is over 1 MB")
  local f = assert(io.open(dir .. "/" .. name .. ".json", "w")); f:write(body); f:close()
  f = assert(io.open(dir .. "/" .. name .. ".path", "w")); f:write(case[1]); f:close()
end
LUA
start_serve "$port" --threads 1
echo "event_loop_bench: $requests requests a case, one after another, /health probed every 10 ms"
for c in $cases; do
  (
    for _ in $(seq 1 "$requests"); do
      curl -s -o /dev/null -w "%{http_code} %{time_total}\n" -H 'Content-Type: application/json' \
        --data-binary @"$dir/$c.json" "http://127.0.0.1:$port$(cat "$dir/$c.path")"
    done
  ) > "$dir/requests.log" &
  load=$!
  probe_health "$port" "$load" "$dir/health.log"
  wait "$load"
  statuses=$(awk '{ print $1 }' "$dir/requests.log" | sort | uniq -c | awk '{ printf "%s%dx%s", (NR > 1 ? " " : ""), $1, $2 }')
  mean=$(awk '{ t += $2 } END { printf "%.0f", 1000 * t / NR }' "$dir/requests.log")
  read -r probes p50 p99 max < <(health_figures "$dir/health.log")
  printf "%-20s %5d KB  %-8s %6d ms a request  /health: %3d probes, p50 %6.1f ms, p99 %6.1f ms, max %6.1f ms\n" \
         "$c" "$(( $(wc -c < "$dir/$c.json") / 1024 ))" "$statuses" "$mean" "$probes" "$p50" "$p99" "$max"
done

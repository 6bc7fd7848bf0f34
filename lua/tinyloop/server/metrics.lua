-- tinyloop.server.metrics: counters, gauges and histograms in an nginx shared dict (so every
-- worker adds to the same figures), rendered in the Prometheus text format.
local _M = {}

local pairs, ipairs, tostring, tonumber, format, concat, sort = pairs, ipairs, tostring, tonumber, string.format, table.concat, table.sort

local dict -- ngx.shared[name], set by init
-- (the page's sections in one order in every process: pairs' is LuaJIT's per-VM hash order)
local ordered_pairs = require("tinyloop.ordered").pairs

-- Latency buckets in seconds, shared by the two histograms.
local BUCKETS = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30 }
local HISTOGRAMS = {
    ttft = { name = "tinyloop_time_to_first_token_seconds", help = "Time from the request's arrival to its first token." },
    tpot = { name = "tinyloop_time_per_output_token_seconds", help = "Time between consecutive tokens of a request." },
}

-- Each worker's engine counters (C, in the worker's own process) are copied into the dict
-- under "engine:<worker id>:<field>" by that worker (publish_engine, on a short timer and
-- before it answers /metrics), so that whichever worker answers shows every worker's engine.
local ENGINE_FIELDS = { "active", "queued", "submitted", "finished", "cancelled", "failed", "rejected",
                        "iterations", "rows", "steps_after_cancel", "waiter_wakeups",
                        "partial_prefills", "kv_budget_bytes", "kv_reserved_bytes", "kv_waiting", "prefill_waiting" }

-- mem: the worker's model:memory() (its KV pages in use and kept, its weights) and its grammar
-- cache (request.grammar_cache_stats).
local MEMORY_FIELDS = { "kv_bytes", "kv_spare_bytes", "weight_bytes", "grammar_cache_grammars", "grammar_cache_bytes",
                        "grammar_cache_evictions" }
function _M.publish_engine(worker, c, mem)
    local prefix = "engine:" .. worker .. ":"
    dict:set(prefix .. "pid", ngx.worker.pid()) -- (whose figures these are: render shows live ones)
    for i = 1, #ENGINE_FIELDS do
        local f = ENGINE_FIELDS[i]
        dict:set(prefix .. f, c and tonumber(c[f]) or 0)
    end
    for i = 1, #MEMORY_FIELDS do
        local f = MEMORY_FIELDS[i]
        dict:set(prefix .. f, mem and mem[f] or 0)
    end
end

-- A stopping worker: its sessions are gone (its totals stay until a new worker of the same
-- id overwrites them, which Prometheus reads as a counter reset; with none, render leaves
-- its series out once its process has gone).
function _M.engine_stopped(worker)
    -- (a reload's new worker of this id may have published already: its figures stay)
    local owner = dict:get("engine:" .. worker .. ":pid")
    if owner and owner ~= ngx.worker.pid() then return end
    dict:set("engine:" .. worker .. ":active", 0)
    dict:set("engine:" .. worker .. ":queued", 0)
    dict:set("engine:" .. worker .. ":kv_bytes", 0)
    dict:set("engine:" .. worker .. ":kv_reserved_bytes", 0)
    dict:set("engine:" .. worker .. ":kv_waiting", 0)
    dict:set("engine:" .. worker .. ":prefill_waiting", 0)
end

function _M.init(dict_name)
    dict = type(dict_name) == "string" and ngx.shared[dict_name] or nil
    if not dict then
        error(("tinyloop.server: lua_shared_dict %s is not declared (the metrics are kept there): add " ..
               "`lua_shared_dict %s 1m;` to the http block"):format(tostring(dict_name), tostring(dict_name)))
    end
end

local function incr(key, n)
    local ok, err = dict:incr(key, n or 1, 0)
    if not ok then ngx.log(ngx.WARN, "tinyloop metrics: ", err) end
end
_M.incr = incr

-- The bucket of value v (seconds): the first whose bound it is at most (Prometheus's `le`),
-- v rounded to the microsecond first: a difference of two millisecond clock readings (nginx's
-- monotonic time, whole milliseconds in seconds) of 10 ms came out 0.0100000002, past its
-- bucket's bound, half the time. -> 1 .. #BUCKETS + 1 (the last: +Inf only).
function _M.bucket_of(v)
    v = math.floor(v * 1e6 + 0.5) / 1e6
    for i = 1, #BUCKETS do
        if v <= BUCKETS[i] then return i end
    end
    return #BUCKETS + 1
end

-- Adds `count` observations of value v (seconds). Buckets are stored non-cumulative (one incr
-- per observation) and summed when rendered.
function _M.observe(h, v, count)
    count = count or 1
    local b = _M.bucket_of(v)
    incr(h .. ":b" .. b, count)
    incr(h .. ":sum", v * count)
    incr(h .. ":count", count)
end

-- Requests by endpoint and status: endpoints are a fixed set, so labels stay bounded.
local ENDPOINTS = { ["/v1/completions"] = true, ["/v1/chat/completions"] = true, ["/v1/responses"] = true, ["/v1/messages"] = true, ["/v1/messages/count_tokens"] = true, ["/api/chat"] = true, ["/api/generate"] = true,
                    ["/api/show"] = true, ["/api/tags"] = true, ["/api/ps"] = true, ["/api/version"] = true, ["/"] = true, ["/v1/models"] = true, ["/health"] = true, ["/v1/health"] = true,
                    ["/metrics"] = true, ["/tokenize"] = true, ["/detokenize"] = true, ["/v1/embeddings"] = true,
                    ["/api/embed"] = true, ["/api/embeddings"] = true, ["/v1/rerank"] = true, ["/rerank"] = true, ["/v2/rerank"] = true, ["/reranking"] = true, ["/v1/reranking"] = true,
                    ["/v1/score"] = true, ["/score"] = true, ["/completion"] = true, ["/completions"] = true, ["/props"] = true,
                    ["/embedding"] = true, ["/embeddings"] = true, ["/apply-template"] = true,
                    ["/models"] = true, ["/chat/completions"] = true }
-- The locations that serve a family of paths, an id in each, under one label apiece (a
-- model's or a stored response's page was "other", with unknown paths).
local FAMILIES = { { "/v1/models/", "/v1/models/{id}" }, { "/v1/responses/", "/v1/responses/{id}" } }
-- (an app's nginx.conf may mount a handler under a prefix of its own, /llm/v1/completions: the
-- endpoint its path ends in, at a "/"; the families' ids are read after their own part)
local function endpoint_label(uri)
    if ENDPOINTS[uri] then return uri end
    for _, family in ipairs(FAMILIES) do
        local at = uri:find(family[1], 1, true)
        if at and #uri > at + #family[1] - 1 then return family[2] end
    end
    local from = uri:find("/", 2, true)
    while from do
        local tail = uri:sub(from)
        if tail ~= "/" and ENDPOINTS[tail] then return tail end
        from = uri:find("/", from + 1, true)
    end
    return "other"
end
-- (no_route: the request was answered "no route" (a 404 of the catch-all): "other", whatever
-- its path ends in; /x/health was /health's 404)
function _M.log_request(uri, status, no_route)
    incr("req:" .. (no_route and "other" or endpoint_label(uri)) .. ":" .. tostring(status))
end

local COUNTERS = {
    { "tokens_in", "tinyloop_prompt_tokens_total", "Prompt tokens of admitted generations (one a choice: n choices of a prompt count it n times, as each prefills it or takes it from the prefix pool)." },
    { "tokens_embedded", "tinyloop_embedded_tokens_total", "Input tokens of embeddings requests (/v1/embeddings, /api/embed, /api/embeddings, /embedding, rerank, score)." },
    { "tokens_cached", "tinyloop_prompt_tokens_cached_total", "Prompt tokens whose K/V came from the prefix pool (not computed)." },
    { "tokens_out", "tinyloop_generated_tokens_total", "Tokens generated." },
    { "tool_calls", "tinyloop_tool_calls_total", "Tool calls answered (chat's tool_calls; Responses' function_call items; Anthropic's tool_use; Ollama's tool_calls)." },
    { "cancelled", "tinyloop_cancelled_total", "Generations (one a choice: a request of n choices counts n) and embeddings requests whose client left before their answer ended (a generation stopped within one step; embeddings within a slice of 16 inputs)." },
    { "rejected", "tinyloop_rejected_total", "Requests answered 503 because every session place (or embeddings place) was taken." },
    { "completed", "tinyloop_completed_total", "Generations that ran to their end." },
    { "drafted", "tinyloop_speculative_drafted_total", "Draft tokens (chain) or tree nodes proposed by speculative requests." },
    { "accepted", "tinyloop_speculative_accepted_total", "Draft tokens accepted by the verifier." },
    { "loops_sum", "tinyloop_loops_used_sum", "Sum over the tokens of generations that ran to their end of the loop depth that produced them (a cancelled or failed generation reports no depth)." },
    { "loops_count", "tinyloop_loops_used_count", "Tokens the loop-depth sum covers (those of generations that ran to their end)." },
}
-- Gauges each worker process keeps under its own key ("<name>:<pid>"), summed when rendered
-- over the processes still alive: a worker that died (its sessions with it) or an old one
-- gone after a reload leaves nothing behind, where one shared figure stayed up for good.
local GAUGES = {
    { "active", "tinyloop_sessions_active", "Sessions the engines are stepping now." },
    { "queued", "tinyloop_sessions_queued", "Admitted sessions waiting for a place in a batch." },
}

local ffi = require "tinyloop.ffi"
pcall(ffi.cdef, "int kill(int pid, int sig);")
local function alive(pid)
    -- (signal 0 checks only; EPERM, another user's process, is alive too: errno 1)
    return ffi.C.kill(pid, 0) == 0 or ffi.errno() == 1
end

function _M.gauge(name, n)
    local ok, err = dict:incr(name .. ":" .. ngx.worker.pid(), n, 0)
    if not ok then ngx.log(ngx.WARN, "tinyloop metrics: ", err) end
end

-- A gauge's value: its live processes' figures (the dead ones' keys dropped).
local function gauge_value(name, keys)
    local sum = 0
    for _, k in ipairs(keys) do
        local gname, pid = k:match("^(%a+):(%d+)$")
        if gname == name then
            if alive(tonumber(pid)) then sum = sum + (dict:get(k) or 0) else dict:delete(k) end
        end
    end
    return sum
end

-- The Prometheus text: the dict's figures, which every worker adds to.
function _M.render(responses_store)
    local out = {}
    local function add(...) out[#out + 1] = format(...) end
    add("# HELP tinyloop_requests_total HTTP requests by endpoint and status.\n# TYPE tinyloop_requests_total counter\n")
    local keys = dict:get_keys(0)
    sort(keys)
    for _, k in ipairs(keys) do
        local ep, status = k:match("^req:(.-):(%d+)$")
        if ep then add('tinyloop_requests_total{endpoint="%s",status="%s"} %d\n', ep, status, dict:get(k) or 0) end
    end
    for _, c in ipairs(COUNTERS) do
        add("# HELP %s %s\n# TYPE %s counter\n%s %.17g\n", c[2], c[3], c[2], c[2], dict:get(c[1]) or 0)
    end
    for _, g in ipairs(GAUGES) do
        add("# HELP %s %s\n# TYPE %s gauge\n%s %d\n", g[2], g[3], g[2], g[2], gauge_value(g[1], keys))
    end
    local drafted = dict:get("drafted") or 0
    add("# HELP tinyloop_speculative_acceptance_ratio Accepted over drafted, all speculative requests so far.\n")
    add("# TYPE tinyloop_speculative_acceptance_ratio gauge\ntinyloop_speculative_acceptance_ratio %.6g\n",
        drafted > 0 and (dict:get("accepted") or 0) / drafted or 0)
    local depth_tokens = dict:get("loops_count") or 0
    add("# HELP tinyloop_loops_used_mean Mean loop depth per generated token, all generations that ran to their end so far.\n")
    add("# TYPE tinyloop_loops_used_mean gauge\ntinyloop_loops_used_mean %.6g\n",
        depth_tokens > 0 and (dict:get("loops_sum") or 0) / depth_tokens or 0)
    for h, spec in ordered_pairs(HISTOGRAMS) do
        add("# HELP %s %s\n# TYPE %s histogram\n", spec.name, spec.help, spec.name)
        local cum = 0
        for i = 1, #BUCKETS + 1 do
            cum = cum + (dict:get(h .. ":b" .. i) or 0)
            add('%s_bucket{le="%s"} %d\n', spec.name, BUCKETS[i] and tostring(BUCKETS[i]) or "+Inf", cum)
        end
        add("%s_sum %.6f\n%s_count %d\n", spec.name, dict:get(h .. ":sum") or 0, spec.name, dict:get(h .. ":count") or 0)
    end
    -- Every worker's engine, as it last published its counters (see publish_engine).
    -- (a worker whose process is gone and no new one of its id took over, as after a reload
    -- to fewer workers, is left out: its memory read as held for good)
    local workers, seen = {}, {}
    for _, k in ipairs(keys) do
        local w = k:match("^engine:(%d+):")
        if w and not seen[w] then
            seen[w] = true
            local pid = dict:get("engine:" .. w .. ":pid")
            if not pid or alive(pid) then workers[#workers + 1] = w end
        end
    end
    sort(workers, function(a, b) return tonumber(a) < tonumber(b) end)
    local function get(w, f) return dict:get("engine:" .. w .. ":" .. f) or 0 end
    local function series(name, typ, help, each)
        add("# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
        for _, w in ipairs(workers) do each(w) end
    end
    series("tinyloop_engine_sessions", "gauge", "Sessions each worker's engine holds (state: active, queued).", function(w)
        add('tinyloop_engine_sessions{worker="%s",state="active"} %d\n', w, get(w, "active"))
        add('tinyloop_engine_sessions{worker="%s",state="queued"} %d\n', w, get(w, "queued"))
    end)
    series("tinyloop_engine_requests_total", "counter", "Requests each worker's engine took (submitted) and how they ended (finished includes failed).", function(w)
        for _, f in ipairs({ "submitted", "finished", "failed", "cancelled", "rejected" }) do
            add('tinyloop_engine_requests_total{worker="%s",outcome="%s"} %d\n', w, f, get(w, f))
        end
    end)
    series("tinyloop_engine_memory_bytes", "gauge",
        "Memory each worker's model holds (kind: kv = K/V pages of its sessions, kv_spare = freed pages kept for reuse, weights).",
        function(w)
            add('tinyloop_engine_memory_bytes{worker="%s",kind="kv"} %d\n', w, get(w, "kv_bytes"))
            add('tinyloop_engine_memory_bytes{worker="%s",kind="kv_spare"} %d\n', w, get(w, "kv_spare_bytes"))
            add('tinyloop_engine_memory_bytes{worker="%s",kind="weights"} %d\n', w, get(w, "weight_bytes"))
        end)
    series("tinyloop_engine_kv_budget_bytes", "gauge",
        "Each worker's K/V budget (kind: budget, 0 for none; reserved = the running requests' shares, each its prompt and max_tokens).",
        function(w)
            add('tinyloop_engine_kv_budget_bytes{worker="%s",kind="budget"} %d\n', w, get(w, "kv_budget_bytes"))
            add('tinyloop_engine_kv_budget_bytes{worker="%s",kind="reserved"} %d\n', w, get(w, "kv_reserved_bytes"))
        end)
    series("tinyloop_engine_sessions_waiting_for_memory", "gauge",
        "Queued sessions of each worker that wait for K/V budget, not for a place (kv_budget_mb).",
        function(w) add('tinyloop_engine_sessions_waiting_for_memory{worker="%s"} %d\n', w, get(w, "kv_waiting")) end)
    series("tinyloop_engine_sessions_waiting_for_prefill", "gauge",
        "Queued sessions of each worker that wait for a running one's prefill of the prompt they share, to take it from the prefix pool.",
        function(w) add('tinyloop_engine_sessions_waiting_for_prefill{worker="%s"} %d\n', w, get(w, "prefill_waiting")) end)
    series("tinyloop_grammar_cache_grammars", "gauge", "Compiled grammars each worker keeps for requests that send them again.",
        function(w) add('tinyloop_grammar_cache_grammars{worker="%s"} %d\n', w, get(w, "grammar_cache_grammars")) end)
    series("tinyloop_grammar_cache_bytes", "gauge",
        "Memory the cached grammars of each worker hold: tables and masks, which grow with use (grammar_cache_mb bounds it).",
        function(w) add('tinyloop_grammar_cache_bytes{worker="%s"} %d\n', w, get(w, "grammar_cache_bytes")) end)
    series("tinyloop_grammar_cache_evictions_total", "counter",
        "Grammars each worker dropped from its cache (the least recently used, past 64 grammars or grammar_cache_mb).",
        function(w) add('tinyloop_grammar_cache_evictions_total{worker="%s"} %d\n', w, get(w, "grammar_cache_evictions")) end)
    -- A series with one engine counter per worker.
    local function counter(name, help, field)
        series(name, "counter", help, function(w) add('%s{worker="%s"} %d\n', name, w, get(w, field)) end)
    end
    counter("tinyloop_engine_steps_after_cancel_total",
        "Steps sessions made after their cancel: the step in flight, at most one each.", "steps_after_cancel")
    counter("tinyloop_engine_batch_rows_total",
        "Session-steps carried by batched steps (divide by iterations for the mean batch).", "rows")
    counter("tinyloop_engine_iterations_total", "Batched steps of each worker's engine.", "iterations")
    counter("tinyloop_engine_partial_prefills_total",
        "Session-steps that forwarded one chunk of a long prompt (step_rows) and emitted nothing.",
        "partial_prefills")
    counter("tinyloop_engine_waiter_wakeups_total",
        "Wake-ups of handlers waiting in the thread pool (about one per token read; not one per waiter per step).",
        "waiter_wakeups")
    -- the stored responses' dict (shared by the workers): its size and its bytes not yet used
    -- (the least recently used responses go once it is full)
    if responses_store and responses_store.capacity then
        add("# HELP tinyloop_responses_store_bytes The stored responses' shared memory: capacity, and free (not yet used).\n")
        add("# TYPE tinyloop_responses_store_bytes gauge\n")
        add('tinyloop_responses_store_bytes{kind="capacity"} %d\n', responses_store:capacity())
        add('tinyloop_responses_store_bytes{kind="free"} %d\n', responses_store:free_space())
    end
    return concat(out)
end

return _M

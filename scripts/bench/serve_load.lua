-- serve_load.lua: wrk script of serve_bench.sh. Two uses:
--   wrk -s serve_load.lua URL -- stream VOCAB MAX_TOKENS SEED_BASE CONNECTIONS [PROMPT_LEN]
--       streaming POST /v1/completions back to back on every connection: token-id prompts
--       of PROMPT_LEN (16) ids, temperature 0.8, ignore_eos, a distinct seed (and prompt) per request;
--       the first request of connection i (of CONNECTIONS) asks for i/CONNECTIONS of
--       MAX_TOKENS, every later one for MAX_TOKENS. Why: started together with equal
--       lengths, the connections would stay in lockstep, all finishing in one step and all
--       prefilling together in the next; staggered, requests end and join one at a time,
--       as independent clients do, and TTFT is that of a request joining a running batch.
--   wrk -s serve_load.lua URL -- probe INTERVAL_MS
--       GET /health, one request per INTERVAL_MS on each connection.
--   wrk -s serve_load.lua URL -- embed VOCAB INPUTS INPUT_LEN
--       POST /v1/embeddings back to back: INPUTS token-id inputs of INPUT_LEN ids each, distinct
--       per request (embed_bench.sh); tokens counts the usage's prompt_tokens.
-- Why wrk and not curl in a shell loop: a loop spawns curl, grep and awk between requests,
-- and on a 2-core machine those processes take the cores the engine needs and leave gaps
-- in the batch; wrk sends the next request from its event loop as soon as one ends.
-- done() prints one line "serve_load <key>=<value> ..." that serve_bench.sh parses.
local threads = {}

function setup(thread)
    thread:set("thread_no", #threads)
    threads[#threads + 1] = thread
end

-- Per thread (each wrk thread has its own Lua state).
function init(args)
    mode = args[1]
    if mode == "stream" then
        vocab, max_tokens, seed_base = tonumber(args[2]), tonumber(args[3]), tonumber(args[4])
        connections = tonumber(args[5]) or 1
        prompt_len = tonumber(args[6]) or 16
    elseif mode == "probe" then
        interval_ms = tonumber(args[2])
    elseif mode == "embed" then
        vocab, inputs, input_len = tonumber(args[2]), tonumber(args[3]), tonumber(args[4])
    else
        error("serve_load.lua: mode 'stream', 'probe' or 'embed', got " .. tostring(mode))
    end
    sent, ok, fivexx, other, broken, tokens = 0, 0, 0, 0, 0, 0
end

-- The request for /health is always the same one: wrk.format once.
local health_req

function request()
    sent = sent + 1
    if mode == "probe" then
        health_req = health_req or wrk.format("GET", "/health")
        return health_req
    end
    if mode == "embed" then
        local list = {}
        for i = 1, inputs do
            local ids = {}
            for k = 1, input_len do ids[k] = ((thread_no * 1000003 + sent * 7919 + i * 104729 + k * 31) % vocab) end
            list[i] = "[" .. table.concat(ids, ",") .. "]"
        end
        return wrk.format("POST", "/v1/embeddings", { ["Content-Type"] = "application/json" },
                          '{"input":[' .. table.concat(list, ",") .. '],"encoding_format":"base64"}')
    end
    -- Distinct per request and per thread: 1e6 requests per thread before seeds repeat.
    local seed = seed_base + thread_no * 1000000 + sent
    local ids = {}
    for k = 1, prompt_len do ids[k] = (seed * 7919 + k * 104729) % vocab end
    -- wrk asks for each connection's first request in turn at its start (one thread here)
    local n = sent <= connections and math.max(1, math.floor(max_tokens * sent / connections)) or max_tokens
    local body = '{"prompt":[' .. table.concat(ids, ",") .. '],"max_tokens":' .. n ..
        ',"ignore_eos":true,"stream":true,"temperature":0.8,"seed":' .. seed .. '}'
    return wrk.format("POST", "/v1/completions", { ["Content-Type"] = "application/json" }, body)
end

function delay()
    return mode == "probe" and interval_ms or 0
end

-- Defining response() makes wrk keep the (chunked, SSE) body. The final event carries the
-- request's usage: its completion_tokens are the tokens the client received.
function response(status, headers, body)
    if status == 200 then
        ok = ok + 1
        if mode == "embed" then
            tokens = tokens + (tonumber(body:match('"prompt_tokens":(%d+)')) or 0)
        elseif mode == "stream" then
            local n = body:match('"completion_tokens":(%d+)')
            tokens = tokens + (tonumber(n) or 0)
            -- a 200 stream without its final event and [DONE] (an error event mid-stream)
            if not n or not body:find("data: [DONE]", 1, true) then broken = broken + 1 end
        end
    elseif status >= 500 then
        fivexx = fivexx + 1
    else
        other = other + 1
    end
end

function done(summary, latency, requests)
    local t = { ok = 0, fivexx = 0, other = 0, broken = 0, tokens = 0 }
    for _, th in ipairs(threads) do
        for k in pairs(t) do t[k] = t[k] + (th:get(k) or 0) end
    end
    local e = summary.errors
    io.write(string.format(
        "serve_load mode=%s secs=%.3f completed=%d ok=%d fivexx=%d other=%d broken=%d tokens=%d " ..
        "sock_errors=%d timeouts=%d lat_p50_ms=%.2f lat_p99_ms=%.2f lat_max_ms=%.2f\n",
        threads[1]:get("mode"), summary.duration / 1e6, summary.requests, t.ok, t.fivexx, t.other, t.broken, t.tokens,
        e.connect + e.read + e.write, e.timeout,
        latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency.max / 1000))
end

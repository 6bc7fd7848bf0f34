#!/usr/bin/env luajit
-- api_views.lua: what serving OpenAI's Responses API, Anthropic's Messages API and Ollama's
-- over the chat path costs the nginx event loop. Each of their streamed tokens is a chat chunk
-- read back (decoded) and written again as the other API's events (tinyloop.server.responses',
-- anthropic's and ollama's feed). This times that per chunk, on the chunks of a real reply
-- (the shipped model's tokens, in the chat stream's shape), next to the model's own time per
-- token (wall time) in the same run, and prints both (median of --repeat runs).
--   luajit scripts/bench/api_views.lua [--model DIR] [--tokens 200] [--repeat 5]
local root = (arg[0]:match("^(.*)/scripts/bench/[^/]*$")) or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local cjson = require "cjson.safe"
local tinyloop = require "tinyloop"
local responses = require "tinyloop.server.responses"
local anthropic = require "tinyloop.server.anthropic"
local ollama = require "tinyloop.server.ollama"

local options = require "tinyloop.script_options"
local opt = options.parse(arg, {
    path = "scripts/bench/api_views.lua",
    summary = "What serving the Responses, Anthropic and Ollama APIs over the chat path costs the event loop,\n"
        .. "a chunk, next to the model's own time a token.",
    { "model", root .. "/models/tinyloop-austen", "checkpoint directory", metavar = "DIR" },
    { "tokens", 200, "tokens of the reply (the first comes from the prefill: at least 2)" },
    { "repeat", 5, "runs (the median is printed)" },
})
local die = options.die("api_views.lua")
options.counts(opt, { "repeat" }, die)
options.counts(opt, { "tokens" }, die, 2)
local model = options.load_model(tinyloop, opt, die)
local n_tokens, repeats = opt.tokens, opt["repeat"]
local prompt = model:encode("It is a truth universally acknowledged, that a single man in possession")
local median = options.median

-- The model's wall time per token (its decode_ms), and the reply's chunks as the chat stream
-- writes them.
local function decode()
    local session = model:session(prompt, { max_tokens = n_tokens, ignore_eos = true })
    local ids, texts = {}, {}
    while true do
        local id, text = session:step()
        if not id then break end
        ids[#ids + 1], texts[#texts + 1] = id, text
        if #ids == n_tokens then break end
    end
    local stats = session:stats()
    return stats.decode_ms / 1000 / math.max(1, #ids - 1), ids, texts
end
local per_token, ids, texts = decode()
local chunks = {}
for i = 1, #ids do
    local last = i == #ids
    chunks[i] = '{"id":"chatcmpl-1-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":' ..
        (i == 1 and '{"role":"assistant","content":' or '{"content":') .. cjson.encode(texts[i]) .. '},"logprobs":null,' ..
        '"finish_reason":' .. (last and '"length"' or "null") .. ',"stop_reason":null,"token_ids":[' .. ids[i] .. "]}]" ..
        (last and (',"usage":{"prompt_tokens":' .. #prompt .. ',"completion_tokens":' .. #ids .. ',"total_tokens":' ..
                   (#prompt + #ids) .. ',"prompt_tokens_details":{"cached_tokens":0}},"tinyloop":{"loops_used":8}') or "") .. "}"
end

local function per_chunk(to_chat, body)
    local started = os.clock()
    local _, view = to_chat(body)
    view:start_stream("x_1_1", 1, "m", #prompt)
    local events = 0
    for _, chunk in ipairs(chunks) do events = events + #view:feed(chunk) end
    return (os.clock() - started) / #chunks, events
end

local model_t, resp_t, anth_t, oll_t = {}, {}, {}, {}
local resp_events, anth_events, oll_events
for r = 1, repeats do
    model_t[r] = r == 1 and per_token or decode()
    resp_t[r], resp_events = per_chunk(responses.to_chat, '{"input": "x", "stream": true}')
    anth_t[r], anth_events = per_chunk(anthropic.to_chat, '{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stream": true}')
    oll_t[r], oll_events = per_chunk(function(body) return ollama.chat_to_chat(body, "m") end,
                                     '{"messages": [{"role": "user", "content": "x"}]}')
end
local m, rv, av, ov = median(model_t), median(resp_t), median(anth_t), median(oll_t)
print(("model %s, %d tokens, median of %d runs"):format(opt.model:match("[^/]+$"), #ids, repeats))
print(("  decode (wall)          %8.1f us a token"):format(m * 1e6))
print(("  Responses view (CPU)   %8.1f us a chunk (%.1f%% of a token; %d events)"):format(rv * 1e6, 100 * rv / m, resp_events))
print(("  Messages view (CPU)    %8.1f us a chunk (%.1f%% of a token; %d events)"):format(av * 1e6, 100 * av / m, anth_events))
print(("  Ollama view (CPU)      %8.1f us a chunk (%.1f%% of a token; %d objects)"):format(ov * 1e6, 100 * ov / m, oll_events))

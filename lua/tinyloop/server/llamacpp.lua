-- tinyloop.server.llamacpp: llama.cpp's server API (POST /completion, GET /props) as a view of
-- the completions path, as tinyloop.server.ollama is of chat, and its /embedding's request.
-- Pure Lua (no ngx).
--
-- The tools written against llama.cpp's own server (SillyTavern's and KoboldAI-style front
-- ends, llama.cpp's legacy web UI, scripts that post to /completion) send a prompt with
-- llama.cpp's sampling fields: a request is the /v1/completions request it means, with
-- llama.cpp's defaults where a field is left out (temperature 0.8, top_k 40, top_p 0.95, min_p
-- 0.05, a random seed, the rest of the context for n_predict), and the completion comes back
-- in llama.cpp's shape ({"content", "stop", "stop_type", "tokens_predicted", "timings", ...}),
-- streamed as server-sent `data:` events without a [DONE]. As llama.cpp does, fields it does
-- not know are ignored (front ends send many), an empty grammar is none, and samplers this
-- engine lacks are taken wherever their values turn them off. Errors are llama.cpp's
-- {"error": {"code", "message", "type"}}.
--
--   local llamacpp = require "tinyloop.server.llamacpp"
--   local body, view = llamacpp.to_completions(body_text, tokenize, vocab) -- nil, err: the field named
--   answer = view:response(completions_json)                -- a blocking answer
--   view:start_stream(id, created); events = view:feed(chunk_json)
--   req = llamacpp.embedding_request(body_text)             -- POST /embedding
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local cjson = require "cjson.safe"
local shapes = require "tinyloop.server.shapes"
local json_text = require "tinyloop.json_text"
local point = require("tinyloop.pause").point -- (long lists pause: tinyloop.pause)

local type, pairs, ipairs, tostring, next = type, pairs, ipairs, tostring, next
local concat = table.concat
local json_null = cjson.null
local encode, bad, is_array, object, KIND_OK = shapes.encode, shapes.bad, shapes.is_array, shapes.object, shapes.KIND_OK
local request = require "tinyloop.server.request"
local decode_object = request.decode_object

local _M = {}

-- llama.cpp's defaults (its server's), where a request leaves the field out: /props says them.
_M.DEFAULTS = { temperature = 0.8, top_k = 40, top_p = 0.95, min_p = 0.05 }

-- Fields taken as they are, renamed where llama.cpp's name differs: {llama.cpp name, kind, the
-- completions request's name}.
local PASSED = {
    { "temperature", "number" }, { "top_k", "integer" }, { "top_p", "number" }, { "min_p", "number" },
    { "presence_penalty", "number" }, { "frequency_penalty", "number" }, { "repeat_penalty", "number", "repetition_penalty" },
    { "ignore_eos", "boolean" }, { "grammar", "string" }, { "stream", "boolean" },
}
local OFF = shapes.LLAMACPP_OFF -- (samplers this engine does not have: where they are off)
local UNSET_SEED = { [-1] = true, [4294967295] = true } -- (llama.cpp's "random", either way it is spelled)
-- The chat request's fields (shapes.PASSED) that are not llama.cpp's: TinyLoop's own (loops,
-- speculative, early_exit_*, beam_size, cache_window, ...) and vLLM's, which ride at the top
-- level as on the other endpoints (they were ignored as unknown: loops 999 answered 200). Left
-- out: those llama.cpp names itself (read above, some under its own names), and chat's. (The
-- penalties' TinyLoop names, repetition_penalty, penalty_window and penalties_count_prompt,
-- pass too, with their own rules, where llama.cpp's repeat_penalty and repeat_last_n are not
-- sent: TINYLOOP_NAMES below; they were dropped, their bad values answered 200.)
local NOT_PASSED = { model = true, temperature = true, top_p = true, stream = true, seed = true, presence_penalty = true,
                     temperature_last = true, -- (samplers, or TinyLoop's field, says it: below)
                     frequency_penalty = true, logit_bias = true, top_k = true, min_p = true,
                     ignore_eos = true, grammar = true,
                     chat_template_kwargs = true, include_reasoning = true, thinking_budget = true }
-- TinyLoop's names of llama.cpp's penalty fields: {TinyLoop's, llama.cpp's}; one of a pair.
-- (penalties_count_prompt has no llama.cpp name: its sampler always counts the prompt, the
-- default here)
local TINYLOOP_NAMES = { { "repetition_penalty", "repeat_penalty" }, { "penalty_window", "repeat_last_n" } }
_M.MAX_PROBS = tonumber(require("tinyloop").C.TL_MAX_TOP_LOGPROBS) -- the most alternatives n_probs gives

-- The ids of a prompt given as ids and texts mixed (`list`; `at` names it in messages, `field`
-- is the request's field, default "prompt"): each text tokenized on its own, in place; nil, err
-- where an id is out of range (vocab: the vocabulary's size) or a text cannot be tokenized
-- (tokenize nil: the model has no tokenizer).
local function mixed_ids(list, at, tokenize, vocab, field)
    field = field or "prompt"
    local all = {}
    for i, v in ipairs(list) do
        point()
        if type(v) == "number" then
            if not KIND_OK.integer(v) or v < 0 or (vocab and v >= vocab) then
                return bad(("%s[%d] = %s is not a token id%s"):format(at, i - 1, tostring(v),
                           vocab and (": ids are in [0, %d)"):format(vocab) or ""), field)
            end
            all[#all + 1] = v
        elseif type(v) ~= "string" then
            return bad(("%s[%d]: a prompt's pieces are token ids and texts"):format(at, i - 1), field)
        elseif v ~= "" then
            if not tokenize then return bad(at .. ": texts need the model's tokenizer: give token ids", field) end
            local piece, err = tokenize(v)
            if not piece then return bad(("%s[%d]: %s"):format(at, i - 1, tostring(err)), field) end
            for _, id in ipairs(piece) do all[#all + 1] = id end
        end
    end
    return all
end

-- llama.cpp's generation_settings of a request (its final object's: the settings the
-- completion ran with, by llama.cpp's names), from the completions body's members: {name,
-- JSON text}s. n_predict: as sent (-1 where left out: the rest of the context). reported:
-- llama.cpp's repeat_last_n as it reports it (left out 64, -1 the context's n_ctx, else as
-- sent: not the engine's penalty_window, whose 0 is the whole sequence), and where 0 turned
-- the penalties off (none in the members), or samplers left a sampler out of the chain, their
-- values as received, llama.cpp keeping them (read before the members).
local SETTING_NAMES = { temperature = "temperature", top_k = "top_k", top_p = "top_p", min_p = "min_p", seed = "seed",
                        repetition_penalty = "repeat_penalty", presence_penalty = "presence_penalty",
                        frequency_penalty = "frequency_penalty", logprobs = "n_probs",
                        ignore_eos = "ignore_eos", stop = "stop", stream = "stream" }
local function generation_settings(members, n_predict, reported)
    local settings = { { "n_predict", shapes.integer(n_predict or -1) } }
    local seen = {}
    for _, p in ipairs(reported) do -- (first: a sampler left out of the chain is reported as received)
        if not seen[p[1]] then settings[#settings + 1], seen[p[1]] = p, true end
    end
    for _, m in ipairs(members) do
        local name = SETTING_NAMES[m[1]]
        if name and not seen[name] then settings[#settings + 1], seen[name] = { name, m[2] }, true end
    end
    if not seen.stop then settings[#settings + 1] = { "stop", "[]" } end
    return settings
end

-- to_completions(body[, tokenize, vocab, n_ctx]) -> the /v1/completions body that means the same, and its
-- view; or nil, err (the field named). tokenize(text, plain) -> ids | nil, err: the model's
-- tokenizer, for what llama.cpp tokenizes itself (a prompt mixing texts and ids, each text's
-- special tokens parsed; a logit_bias given by text, plain: its special tokens' texts read as
-- text, as llama.cpp's common_tokenize does there); without it those are refused. vocab: the vocabulary's size, to name a mixed prompt's bad id
-- where it was sent (the completions path names the expanded prompt's places). n_ctx: the
-- context's tokens, which an answer's `truncated` reads.
function _M.to_completions(body, tokenize, vocab, n_ctx)
    local t, err = decode_object(body)
    if not t then return nil, err end
    local raw = shapes.raw_fields(body)
    for k, v in pairs(t) do
        if v == json_null then t[k] = nil end
    end
    local members = {}
    local prompt = t.prompt
    if prompt == nil then return bad("prompt is required", "prompt") end
    local batch -- (a batch of prompts: each one's token count, for its tokens_evaluated)
    if type(prompt) == "table" then
        if not is_array(prompt) or #prompt == 0 then return bad("prompt must be a text or an array of token ids", "prompt") end
        -- llama.cpp's forms (its tokenize_input_prompts): ids, or ids and texts mixed, are one
        -- prompt (each text tokenized on its own, in place); texts alone, or arrays, a batch of
        -- prompts, each a text or such an array, each answered as its own completion
        local texts, ids, arrays = 0, 0, 0
        for i, v in ipairs(prompt) do
            point()
            local kind = type(v)
            if kind == "string" then
                texts = texts + 1
            elseif kind == "number" then
                ids = ids + 1
            elseif kind == "table" and is_array(v) then
                arrays = arrays + 1
            else
                return bad(("prompt[%d]: a prompt is a text, token ids, or token ids and texts mixed"):format(i - 1), "prompt")
            end
        end
        if arrays == 0 and texts == 0 then
            members[#members + 1] = { "prompt", raw.prompt }
        elseif arrays == 0 and ids > 0 then
            local all, err = mixed_ids(prompt, "prompt", tokenize, vocab)
            if not all then return nil, err end
            members[#members + 1] = { "prompt", "[" .. concat(all, ",") .. "]" }
        else
            if ids > 0 then
                return bad("prompt: a batch of prompts holds texts and arrays of token ids, not bare token ids", "prompt")
            end
            -- (how many a request may hold: the completions path's limit on choices, which names prompt)
            local lists = {}
            batch = {}
            for i, v in ipairs(prompt) do
                local at = ("prompt[%d]"):format(i - 1)
                local list, err = mixed_ids(type(v) == "string" and { v } or v, at, tokenize, vocab)
                if not list then return nil, err end
                if #list == 0 then return bad(at .. " must not be empty", "prompt") end
                lists[i], batch[i] = "[" .. concat(list, ",") .. "]", #list
            end
            members[#members + 1] = { "prompt", "[" .. concat(lists, ",") .. "]" }
        end
    elseif type(prompt) ~= "string" then
        return bad("prompt must be a text or an array of token ids", "prompt")
    else
        members[#members + 1] = { "prompt", raw.prompt }
    end
    if t.grammar == "" then t.grammar = nil end -- (front ends send "": no grammar, as llama.cpp reads it)
    if t.grammar ~= nil then t.json_schema = nil end -- (llama.cpp: a grammar, where given, is the constraint)
    -- (llama.cpp's lazy grammar, free text until one of grammar_triggers, is not kept here: taken
    -- silently, the grammar would hold from the first token, another output than asked for)
    if t.grammar_lazy ~= nil and t.grammar_lazy ~= false and (t.grammar ~= nil or t.json_schema ~= nil) then
        return bad("grammar_lazy is not supported here: a grammar holds from the first token (send false, or leave " ..
                   "it out)", "grammar_lazy")
    end
    -- response_fields: the final object's members to answer, a nested one by its path ("a/b",
    -- named so in the answer), as llama.cpp picks them; those it does not have are left out
    local response_fields
    if t.response_fields ~= nil then
        if type(t.response_fields) ~= "table" or (next(t.response_fields) ~= nil and not is_array(t.response_fields)) then
            return bad('response_fields must be an array of member names (a nested one as "a/b")', "response_fields")
        end
        response_fields = {}
        for i, name in ipairs(t.response_fields) do
            if type(name) ~= "string" then return bad(("response_fields[%d] must be a text"):format(i - 1), "response_fields") end
            response_fields[i] = name
        end
        if #response_fields == 0 then response_fields = nil end -- (none: the whole object, as llama.cpp reads [])
    end
    for _, pair in ipairs(TINYLOOP_NAMES) do
        if t[pair[1]] ~= nil and t[pair[2]] ~= nil then
            return bad(("give %s (llama.cpp's) or %s (TinyLoop's), not both"):format(pair[2], pair[1]), pair[1])
        end
    end
    local ok_window, window = shapes.penalty_window(t.repeat_last_n, "repeat_last_n", "repeat_last_n")
    if not ok_window then return nil, window end
    local ok_chain, listed, temperature_last = request.sampler_chain(t.samplers, t.temperature_last)
    if not ok_chain then return nil, listed end
    if t.temperature_last ~= nil then -- (TinyLoop's own field, where samplers is not sent: as sent)
        if type(t.temperature_last) ~= "boolean" then return bad("temperature_last must be true or false", "temperature_last") end
        temperature_last = t.temperature_last
    end
    members[#members + 1] = { "temperature_last", temperature_last and "true" or "false" }
    -- (a sampler the chain leaves out runs nowhere: its value, or default, is not applied; the
    -- penalties' are reported as sent, as under repeat_last_n 0)
    local function off_chain(name) return listed ~= nil and request.CHAIN_SAMPLERS[name] and not listed[name] end
    local penalties_off = window == "off" or off_chain("penalties")
    if off_chain("top_k") then members[#members + 1] = { "top_k", "0" } end -- (every token: the parser's default is 50)
    if window ~= "off" then -- (TinyLoop's names, where sent, pass as sent: below)
        if t.penalty_window == nil then members[#members + 1] = { "penalty_window", window } end
        if t.penalties_count_prompt == nil then -- (llama.cpp's sampler is fed the prompt)
            members[#members + 1] = { "penalties_count_prompt", "true" }
        end
    end
    local reported = { { "repeat_last_n", t.repeat_last_n == nil and tostring(shapes.REPEAT_LAST_N_DEFAULT)
                                           or t.repeat_last_n == -1 and n_ctx and shapes.integer(n_ctx) or raw.repeat_last_n } }
    for _, f in ipairs(PASSED) do
        local name, kind, as = f[1], f[2], f[3] or f[1]
        local v = t[name]
        if v ~= nil then
            if not KIND_OK[kind](v) then return bad(("%s must be %s"):format(name, shapes.KIND_WORDS[kind]), name) end
            -- (a penalty turned off, or top_k, top_p or min_p left out of the chain: reported as
            -- received, not applied)
            if (penalties_off and shapes.PENALTIES[as]) or off_chain(name) then
                reported[#reported + 1] = { name, raw[name] }
            else
                -- (a temperature below 0 samples greedily in llama.cpp, its probabilities still
                -- given; top_k below 0 is every token, top_p and min_p past [0, 1] the bound)
                local text = shapes.native_sampler_text(name, v, raw[name])
                if name == "repeat_penalty" then text = shapes.repeat_penalty_text(v, text) end
                members[#members + 1] = { as, text }
            end
        elseif off_chain(name) then
            reported[#reported + 1] = { name, tostring(_M.DEFAULTS[name]) }
        elseif _M.DEFAULTS[name] then
            members[#members + 1] = { as, tostring(_M.DEFAULTS[name]) }
        end
    end
    for name, off in ordered_pairs(OFF) do
        local v = t[name]
        if v ~= nil and (type(v) ~= "number" or not off[1](v)) then
            return bad(("%s is not supported here (only values that turn it off: %s)"):format(name, off[2]), name)
        end
    end
    -- n_probs: each generated token's log-probability and the n_probs likeliest tokens there
    -- (completion_probabilities), the model's own before sampling: llama.cpp's default
    -- post_sampling_probs false (its true, the sampler's truncated distribution, is not kept)
    -- (llama.cpp takes any count: past MAX_PROBS, the MAX_PROBS likeliest are given)
    if t.n_probs ~= nil then
        if not KIND_OK.integer(t.n_probs) or t.n_probs < 0 then return bad("n_probs must be an integer >= 0", "n_probs") end
        if t.n_probs > 0 then members[#members + 1] = { "logprobs", shapes.integer(math.min(t.n_probs, _M.MAX_PROBS)) } end
    end
    if t.post_sampling_probs ~= nil and t.post_sampling_probs ~= false and (t.n_probs or 0) > 0 then
        return bad("post_sampling_probs: only false is taken here with n_probs (the probabilities given are the model's, " ..
                   "before sampling)", "post_sampling_probs")
    end
    local n_predict = t.n_predict
    if n_predict == nil then n_predict = t.max_tokens end -- (llama.cpp reads either)
    if n_predict ~= nil then
        if not KIND_OK.integer(n_predict) then return bad("n_predict must be an integer", "n_predict") end
        -- (-1: no limit, -2: fill the context: the rest of the context either way)
        if n_predict >= 0 then members[#members + 1] = { "max_tokens", shapes.integer(n_predict) } end
    end
    -- (a min_tokens past n_predict or the rest of the context is that cap: request.parse, room)
    for _, name in ipairs(shapes.PASSED) do
        if not NOT_PASSED[name] and t[name] ~= nil then members[#members + 1] = { name, raw[name] } end
    end
    local seed = t.seed
    -- (llama.cpp's default is a random seed: left out, -1 or 2^32 - 1, one drawn for the request;
    -- any other integer is read as the completions API reads it: 2^53 and past were refused)
    if seed == nil or UNSET_SEED[seed] then
        seed = shapes.random_seed()
    else
        seed = request.request_seed(seed)
        if not seed then return bad("seed must be an integer", "seed") end
    end
    members[#members + 1] = { "seed", shapes.integer(seed) }
    if t.stop ~= nil then
        if not KIND_OK.array(t.stop) and not (type(t.stop) == "table" and next(t.stop) == nil) then
            return bad("stop must be an array of texts", "stop")
        end
        local stops = {}
        for i, w in ipairs(t.stop) do
            if type(w) ~= "string" then return bad(("stop[%d] must be a text"):format(i - 1), "stop") end
            if w ~= "" then stops[#stops + 1] = w end -- (an empty one stops nothing: llama.cpp skips it)
        end
        if #stops > 0 then members[#members + 1] = { "stop", encode(stops) } end
    end
    if t.json_schema ~= nil then
        if not KIND_OK.object(t.json_schema) then return bad("json_schema must be a JSON Schema object", "json_schema") end
        members[#members + 1] = { "json_schema", raw.json_schema }
    end
    if t.logit_bias ~= nil then
        -- llama.cpp's forms: [[id, bias], ...] or {"id": bias}; false is -100 (OpenAI's floor:
        -- all but never); an id given twice adds up, as llama.cpp adds them
        local sums, order = {}, {}
        -- (a text, as llama.cpp reads one: the bias goes to each of its tokens)
        local function add(id, v, where)
            -- (finite: +inf and -inf on one token would add up to NaN; 1e400 is JSON for inf)
            if (type(v) ~= "number" or v ~= v or v == math.huge or v == -math.huge) and v ~= false then
                return bad(where .. ": a bias is a finite number, or false", "logit_bias")
            end
            local ids = { id }
            if type(id) == "string" then
                if not tokenize then return bad(where .. ": a text needs the model's tokenizer: give token ids", "logit_bias") end
                local err
                ids, err = tokenize(id, true)
                if not ids then return bad(("%s: %s"):format(where, tostring(err)), "logit_bias") end
            elseif not KIND_OK.integer(id) then
                return bad(where .. ": a token id, or a text", "logit_bias")
            end
            for _, one in ipairs(ids) do
                if sums[one] == nil then order[#order + 1] = one end
                sums[one] = (sums[one] or 0) + (v == false and -100 or v)
            end
            return true
        end
        local lb = t.logit_bias
        if type(lb) ~= "table" then return bad('logit_bias must be [[id, bias], ...] or {"id": bias}', "logit_bias") end
        if is_array(lb) then
            for i, pair in ipairs(lb) do
                if type(pair) ~= "table" then return bad(("logit_bias[%d] must be [token id, bias]"):format(i - 1), "logit_bias") end
                local ok, e = add(pair[1], pair[2], ("logit_bias[%d]"):format(i - 1))
                if not ok then return nil, e end
            end
        else
            for key, v in pairs(lb) do -- ("15", " 15", "+15": an id, as llama.cpp's strtol reads one; any other key, a text)
                local digits = key:match("^%s*([+-]?%d+)$")
                local id = digits and tonumber(digits) or key
                local ok, e = add(id, v, ("logit_bias[%s]"):format(encode(key)))
                if not ok then return nil, e end
            end
        end
        local inner = {}
        for i, id in ipairs(order) do inner[i] = encode(shapes.integer(id)) .. ":" .. encode(math.max(-100, math.min(100, sums[id]))) end
        members[#members + 1] = { "logit_bias", "{" .. concat(inner, ",") .. "}" }
    end
    local view = setmetatable({ stream = t.stream == true, return_tokens = t.return_tokens == true,
                                response_fields = response_fields,
                                n_predict = n_predict, batch = batch and #batch > 1 and batch or nil, n_ctx = n_ctx,
                                settings = generation_settings(members, n_predict, reported),
                                prompt_text = type(prompt) == "string" and prompt or nil,
                                own_penalty = t.repetition_penalty ~= nil }, _M.View)
    return object(members), view
end

-- ------------------------------------------------------------------ the answer

-- (LOGPROB_ENTRIES: the completions path writes its logprobs as the chat API's entries, with
-- token ids, which completion_probabilities is made of)
local View = { ID_PREFIX = "llamacpp", FRAME = "data", PARSE_OPTIONS = { room = true, max_stops = shapes.MAX_STOPS, beyond_openai_ranges = true },
               LOGPROB_ENTRIES = true }
View.__index = View
_M.View = View

-- The completions request's names -> llama.cpp's, in an error's message; the error body.
-- (a request that sent TinyLoop's repetition_penalty is told of it by that name: OWN_PENALTY's)
local OWN_PENALTY_RENAMES = { { "max_tokens", "n_predict" }, { "logprobs", "n_probs" } }
local RENAMES = { OWN_PENALTY_RENAMES[1], OWN_PENALTY_RENAMES[2], { "repetition_penalty", "repeat_penalty" } }
-- (a prompt over the context: llama.cpp's own error, its type and fields, which its clients
-- look for to shorten the prompt and retry)
function View:error(err)
    if err.code == "context_length_exceeded" and err.n_prompt_tokens then
        local message = ("request (%d tokens) exceeds the available context size (%d tokens), try increasing it")
            :format(err.n_prompt_tokens, err.n_ctx)
        return { status = 400, message = message, type = "exceed_context_size_error",
                 body = _M.error_body(400, message, "exceed_context_size_error",
                                      { { "n_prompt_tokens", tostring(err.n_prompt_tokens) }, { "n_ctx", tostring(err.n_ctx) } }) }
    end
    local message = shapes.rename_fields(err.message or "", self.own_penalty and OWN_PENALTY_RENAMES or RENAMES)
    return { status = err.status, message = message, type = err.type, body = _M.error_body(err.status, message, err.type) }
end

-- (llama.cpp's types: 503 is "unavailable_error", whatever made it: a model loading, no place;
-- extra: more members of the error, as {name, JSON text})
function _M.error_body(status, message, etype, extra)
    etype = status == 503 and "unavailable_error" or etype or (status >= 500 and "server_error" or "invalid_request_error")
    local members = { { "code", tostring(status) }, { "message", encode(message) }, { "type", encode(etype) } }
    for _, member in ipairs(extra or {}) do members[#members + 1] = member end
    return object({ { "error", object(members) } })
end

-- llama.cpp's stop_type and stopping_word of a finish: "limit" (n_predict or the context), "word"
-- (a stop text, or a stop token id), "eos".
local function stop_of(finish)
    if finish.finish_reason == "length" then return "limit", "" end
    local word = finish.stop_reason
    if type(word) == "string" then return "word", word end
    if word ~= nil then return "word", "" end
    return "eos", ""
end

-- (prompt_n: the prompt's tokens the prefill computed; cache_n: those the prefix pool gave)
local function timings(stats, usage)
    local details = type(usage.prompt_tokens_details) == "table" and usage.prompt_tokens_details or {}
    local cache_n = tonumber(details.cached_tokens) or 0
    -- (prompt_n: the prompt tokens the prefill computed, the engine's prefill_tokens where the
    -- answer has it: beam search's and speculative decoding's last is their first step's)
    local prompt_n = tonumber(stats.prefill_tokens) or (tonumber(usage.prompt_tokens) or 0) - cache_n
    local predicted_n = tonumber(usage.completion_tokens) or 0
    local prompt_ms, predicted_ms = tonumber(stats.prefill_ms) or 0, tonumber(stats.decode_ms) or 0
    local function per(ms, n) return n > 0 and ("%.6g"):format(ms / n) or "0" end
    local function rate(ms, n) return ms > 0 and ("%.6g"):format(n * 1000 / ms) or "0" end
    return object({ { "cache_n", tostring(cache_n) }, { "prompt_n", tostring(prompt_n) }, { "prompt_ms", ("%.6g"):format(prompt_ms) },
                    { "prompt_per_token_ms", per(prompt_ms, prompt_n) }, { "prompt_per_second", rate(prompt_ms, prompt_n) },
                    { "predicted_n", tostring(predicted_n) }, { "predicted_ms", ("%.6g"):format(predicted_ms) },
                    { "predicted_per_token_ms", per(predicted_ms, predicted_n) },
                    { "predicted_per_second", rate(predicted_ms, predicted_n) } })
end

-- llama.cpp's completion_probabilities of a choice's logprobs (the chat API's entries with
-- ids: {"content": [...]}), its field order: [{"id", "token", "bytes", "logprob",
-- "top_logprobs": [{"id", "token", "bytes", "logprob"}]}]; nil where the choice has none.
-- (a token of probability 0: llama.cpp's logprob is the lowest float, not -infinity, which the
-- completions path writes as null)
-- finish: the choice's (shapes' finish); where a stop word ended it, the tokens that wrote
-- none of the text, only the word, are left out, as llama.cpp leaves them out (they were kept).
local LOWEST_FLOAT = "-3.4028234663852886e+38"
local function probabilities(logprobs, text, finish)
    if type(logprobs) ~= "table" or type(logprobs.content) ~= "table" or #logprobs.content == 0 then return nil end
    local content = logprobs.content
    if finish and stop_of(finish) == "word" and type(text) == "string" then
        local kept, at = {}, 0 -- (at: the bytes the entries before this one wrote)
        for i, e in ipairs(content) do
            if at >= #text then break end
            kept[i] = e
            at = at + (type(e.bytes) == "table" and #e.bytes or #tostring(e.token or ""))
        end
        if #kept == 0 then return nil end
        content = kept
    end
    local function entry(e)
        return '{"id":' .. shapes.integer(e.id) .. ',"token":' .. encode(e.token) .. ',"bytes":[' .. concat(e.bytes, ",") ..
            '],"logprob":' .. (type(e.logprob) == "number" and encode(e.logprob) or LOWEST_FLOAT)
    end
    local entries = {}
    for i, e in ipairs(content) do
        local top = {}
        for j, alt in ipairs(e.top_logprobs or {}) do top[j] = entry(alt) .. "}" end
        entries[i] = entry(e) .. ',"top_logprobs":[' .. concat(top, ",") .. "]}"
    end
    return "[" .. concat(entries, ",") .. "]"
end

-- The members of a final object (its JSON text) that response_fields names, each by its
-- path's text ("generation_settings/n_predict"), as llama.cpp's json_get_nested_values.
local function picked(whole, fields)
    local members, seen = {}, {}
    for _, path in ipairs(fields) do
        if seen[path] then goto next_path end -- (a path given twice: one member, as llama.cpp's map has)
        seen[path] = true
        local steps = {}
        for step in (path .. "/"):gmatch("(.-)/") do steps[#steps + 1] = step end
        local value = json_text.member(whole, steps)
        if value then members[#members + 1] = { path, value } end
        ::next_path::
    end
    return object(members)
end

-- One object of the answer: content (the whole text, or a stream's piece), its tokens, its
-- tokens' completion_probabilities (JSON, or nil), and with the finish (`finish`: shapes'
-- finish) llama.cpp's closing fields. part: the prompt's own (its index in a batch, from 0;
-- new_line, whether a stream's text so far has a line break; predicted and evaluated, a
-- stream's counts so far).
function View:object(content, tokens, finish, model, probs, part)
    local members = { { "index", tostring(part.index) }, { "content", encode(content) },
                      { "tokens", (self.return_tokens or self.stream) and ("[" .. concat(tokens or {}, ",") .. "]") or "[]" },
                      { "id_slot", "0" }, { "stop", finish and "true" or "false" } }
    if probs then members[#members + 1] = { "completion_probabilities", probs } end
    if not finish and self.stream then -- (each chunk of llama.cpp's stream carries the counts so far)
        members[#members + 1] = { "tokens_predicted", tostring(part.predicted or 0) }
        members[#members + 1] = { "tokens_evaluated", tostring(part.evaluated or 0) }
    end
    if finish then
        local usage = finish.usage or {}
        local stats = finish.tinyloop and cjson.decode(finish.tinyloop) or {}
        local stop_type, word = stop_of(finish)
        members[#members + 1] = { "model", encode(model or "") }
        members[#members + 1] = { "tokens_predicted", tostring(usage.completion_tokens or 0) }
        members[#members + 1] = { "tokens_evaluated", tostring(usage.prompt_tokens or 0) }
        local new_line = part.new_line -- (a stream's: whether any of its pieces had one)
        if new_line == nil then new_line = content:find("\n", 1, true) ~= nil end
        members[#members + 1] = { "has_new_line", tostring(new_line) }
        -- (llama.cpp's: the context ran out, prompt and completion filling it, before the end)
        local filled = self.n_ctx and (usage.prompt_tokens or 0) + (usage.completion_tokens or 0) >= self.n_ctx
        members[#members + 1] = { "truncated", tostring(stop_type == "limit" and filled == true) }
        members[#members + 1] = { "stop_type", encode(stop_type) }
        members[#members + 1] = { "stopping_word", encode(word) }
        members[#members + 1] = { "tokens_cached", tostring((usage.prompt_tokens or 0) + (usage.completion_tokens or 0)) }
        members[#members + 1] = { "timings", timings(stats, usage) }
        -- (llama.cpp's final object: the settings it ran with, and the prompt where it was a text)
        if self.settings then members[#members + 1] = { "generation_settings", object(self.settings) } end
        if self.prompt_text and not self.batch then members[#members + 1] = { "prompt", encode(self.prompt_text) } end
        members[#members + 1] = { "tinyloop", finish.tinyloop }
        if self.response_fields then return picked(object(members), self.response_fields) end
    end
    return object(members)
end

-- The usage of one prompt of a batch, from its choice's counts and stats (the cached tokens
-- are the prefix pool's, its stats' prompt_tokens_reused).
local function prompt_usage(prompt_tokens, completion_tokens, stats)
    return { prompt_tokens = prompt_tokens, completion_tokens = completion_tokens,
             prompt_tokens_details = { cached_tokens = tonumber(stats.prompt_tokens_reused) or 0 } }
end

-- A batch's finish of one choice (a completions choice with its own stats, as a request of
-- several prompts writes them): shapes' finish, with the usage of that prompt alone.
local function choice_finish(choice, prompt_tokens)
    local stats = type(choice.tinyloop) == "table" and choice.tinyloop or {}
    local stop = choice.stop_reason
    return { finish_reason = choice.finish_reason, stop_reason = stop ~= json_null and stop or nil,
             tinyloop = json_text.encode_sorted(stats),
             usage = prompt_usage(prompt_tokens, type(choice.token_ids) == "table" and #choice.token_ids or 0, stats) }
end

-- response(completions_json) -> the blocking answer: llama.cpp's object, or for a batch of
-- prompts an array of them in the prompts' order (llama.cpp's "multiple results").
function View:response(answer_json, _)
    if self.batch then
        local answer = cjson.decode(answer_json)
        local objects = {}
        for i, choice in ipairs(answer.choices) do
            local text = type(choice.text) == "string" and choice.text or ""
            local finish = choice_finish(choice, self.batch[choice.index + 1])
            objects[i] = self:object(text, type(choice.token_ids) == "table" and choice.token_ids or {}, finish, answer.model,
                                     probabilities(choice.logprobs, text, finish), { index = choice.index, text = text })
        end
        return "[" .. concat(objects, ",") .. "]"
    end
    local answer = shapes.answer(answer_json)
    local choice = (cjson.decode(answer_json).choices or {})[1] or {}
    return self:object(answer.text, type(choice.token_ids) == "table" and choice.token_ids or {}, answer.finish, answer.model,
                       probabilities(choice.logprobs, answer.text, answer.finish), { index = 0, text = answer.text })
end

-- ------------------------------------------------------------------ the stream

-- (each prompt of a batch is a part of its own: whether its text so far has a line break (not
-- the text: a stream's pieces joined each time copied it all, quadratic in its length), its
-- counts, its finish)
function View:start_stream(_, created, model, prompt_tokens)
    self.created, self.model, self.finished, self.parts = created, model, false, {}
    for i = 1, self.batch and #self.batch or 1 do
        self.parts[i] = { index = i - 1, new_line = false, predicted = 0,
                          evaluated = self.batch and self.batch[i] or prompt_tokens or 0 }
    end
end

-- llama.cpp streams one token an event, with its completion_probabilities (a client reads
-- [1] of each); a read of several tokens (the engine ran ahead of the event loop) is split
-- back into them by their probabilities' bytes: each token's piece of the text is its bytes
-- where the text has them, "" where it has none of them (a special token's text is left
-- out), and a token that ends inside a character is joined to the next, as llama.cpp holds
-- an incomplete character back. Tokens whose bytes the text does not show yet (a character's
-- start, a stop string's start held back) go with the read's last event, their bytes owed
-- by the next read's text (part.owed). -> {text, tokens, logprobs} each; nil where the text
-- is not what the bytes spell (one event then).
local function per_token(part, text, tokens, logprobs)
    local owed = part.owed or ""
    part.owed = ""
    local entries = type(logprobs) == "table" and logprobs.content
    if type(entries) ~= "table" or #entries < 1 or #entries ~= #tokens then return nil end
    -- (what was owed and does not come was never text: a special token at the read's end, or
    -- a stop string's start that the stop then cut)
    if text:sub(1, #owed) ~= owed then owed = "" end
    local pieces, first, from, at, unshown = {}, 1, 1, #owed, nil
    local function close(last)
        local piece = { text = text:sub(from, at), tokens = {}, logprobs = { content = {} } }
        for k = first, last do
            piece.tokens[#piece.tokens + 1] = tokens[k]
            piece.logprobs.content[#piece.logprobs.content + 1] = entries[k]
        end
        pieces[#pieces + 1] = piece
        first, from = last + 1, at + 1
    end
    for i, e in ipairs(entries) do
        if type(e.bytes) ~= "table" then return nil end
        local spelled = string.char(unpack(e.bytes))
        if unshown then -- (after the text's end: owed)
            unshown = unshown .. spelled
        elseif text:sub(at + 1, at + #spelled) == spelled then
            at = at + #spelled
        elseif #text - at < #spelled and text:sub(at + 1) == spelled:sub(1, #text - at) then
            unshown, at = spelled:sub(#text - at + 1), #text -- (its start shown, the rest owed)
        end -- (else none of it is in the text: a special token's)
        local after = text:byte(at + 1)
        if not unshown and (not after or after < 0x80 or after >= 0xC0) then close(i) end -- (at + 1 starts a character)
    end
    if at ~= #text then return nil end
    if first <= #entries then close(#entries) end
    part.owed = unshown or ""
    return pieces
end

-- feed(payload) -> the events {nil, json} a completions stream's event makes: one per chunk with
-- text or tokens, and each prompt's finish (stop: true, with the counts), which is its last. A
-- single prompt's finishing chunk carries the usage (no include_usage is asked for); a batch's
-- prompt is counted from its own tokens and stats, and its end sent when its choice finishes.
function View:feed(payload)
    local out = {}
    if self.finished or payload == "[DONE]" then return out end
    local chunk = cjson.decode(payload)
    if type(chunk) ~= "table" then return out end
    if type(chunk.error) == "table" then
        self.finished = true
        out[1] = { nil, _M.error_body(500, tostring(chunk.error.message), "server_error") }
        return out
    end
    local choice = type(chunk.choices) == "table" and chunk.choices[1] or nil
    local part = choice and self.parts[(tonumber(choice.index) or 0) + 1]
    if part then
        local text = type(choice.text) == "string" and choice.text or ""
        local tokens = type(choice.token_ids) == "table" and choice.token_ids or {}
        part.new_line = part.new_line or text:find("\n", 1, true) ~= nil
        local pieces = per_token(part, text, tokens, choice.logprobs)
        if pieces then
            for _, piece in ipairs(pieces) do
                part.predicted = part.predicted + #piece.tokens
                out[#out + 1] = { nil, self:object(piece.text, piece.tokens, nil, nil, probabilities(piece.logprobs), part) }
            end
        else
            part.predicted = part.predicted + #tokens
            if text ~= "" or #tokens > 0 then
                out[#out + 1] = { nil, self:object(text, tokens, nil, nil, probabilities(choice.logprobs), part) }
            end
        end
        if choice.finish_reason and choice.finish_reason ~= json_null then
            part.finish = { finish_reason = choice.finish_reason, stop_reason = choice.stop_reason ~= json_null and choice.stop_reason or nil,
                            tinyloop = chunk.tinyloop and json_text.encode_sorted(chunk.tinyloop) or nil }
            if self.batch then
                part.finish.usage = prompt_usage(part.evaluated, part.predicted,
                                                 type(chunk.tinyloop) == "table" and chunk.tinyloop or {})
                out[#out + 1] = { nil, self:object("", {}, part.finish, self.model, nil, part) }
            end
        end
    end
    local single = not self.batch and self.parts[1]
    if single and single.finish and type(chunk.usage) == "table" then -- (the usage chunk: the end)
        single.finish.usage = chunk.usage
        self.finished = true
        out[#out + 1] = { nil, self:object("", {}, single.finish, self.model, nil, single) }
    end
    return out
end

-- ------------------------------------------------------------------ /embedding

-- embedding_request(body[, tokenize, vocab]) -> { input (llama.cpp's content: a text, ids, or
-- an array of either; ids with texts mixed in, as its prompts, are read as ids, each text
-- tokenized in place: tokenize and vocab as to_completions'), norm (embd_normalize: -1 none, 0
-- the largest to 32760, 1 taxicab, 2 euclidean, p > 2 the p-norm) } | nil, err: POST /embedding
-- (or /embeddings), llama.cpp's own shape, whose answer is [{"index", "embedding": [[...]]}]
-- (the server's mean-pooled vector, one row: llama.cpp nests the rows of a sequence). As
-- llama.cpp does, it reads input where given, else content, and ignores the fields it does not know.
function _M.embedding_request(body, tokenize, vocab)
    local t, err = decode_object(body)
    if not t then return nil, err end
    local field = t.input ~= nil and t.input ~= json_null and "input" or "content"
    local input = t[field]
    if input == nil or input == json_null then return bad("content is required", "content") end
    local norm = t.embd_normalize
    if norm == nil or norm == json_null then norm = 2 end
    if not KIND_OK.integer(norm) or norm < -1 then return bad("embd_normalize must be an integer >= -1", "embd_normalize") end
    -- (an array holding both ids and texts is one input; within a list of inputs, each such array)
    local function has_mixed(list)
        local texts, ids = false, false
        for _, v in ipairs(list) do
            if type(v) == "string" then texts = true elseif type(v) == "number" then ids = true end
        end
        return texts and ids
    end
    if type(input) == "table" and is_array(input) then
        if has_mixed(input) then
            input, err = mixed_ids(input, field, tokenize, vocab, field)
            if not input then return nil, err end
        else
            for i, v in ipairs(input) do
                if type(v) == "table" and is_array(v) and has_mixed(v) then
                    input[i], err = mixed_ids(v, ("%s[%d]"):format(field, i - 1), tokenize, vocab, field)
                    if not input[i] then return nil, err end
                end
            end
        end
    end
    return { input = input, field = field, norm = norm }
end

-- ------------------------------------------------------------------ /props

-- props(info) -> GET /props: info = { model_path, n_ctx, total_slots, chat_template, version }.
function _M.props(info)
    local params = {}
    for _, k in ipairs({ "temperature", "top_k", "top_p", "min_p" }) do params[#params + 1] = { k, tostring(_M.DEFAULTS[k]) } end
    params[#params + 1] = { "repeat_last_n", tostring(shapes.REPEAT_LAST_N_DEFAULT) }
    -- (llama.cpp's default chain: the temperature last, request.sampler_chain)
    params[#params + 1] = { "samplers", '["penalties","dry","top_n_sigma","top_k","typ_p","top_p","min_p","xtc","temperature"]' }
    params[#params + 1] = { "n_predict", "-1" }
    params[#params + 1] = { "seed", "-1" }
    return object({
        { "default_generation_settings", object({ { "id", "0" }, { "id_task", "-1" }, { "n_ctx", tostring(info.n_ctx) },
                                                  { "speculative", "false" }, { "is_processing", "false" },
                                                  { "params", object(params) } }) },
        { "total_slots", tostring(info.total_slots) },
        { "model_path", encode(info.model_path) },
        { "chat_template", encode(info.chat_template or "") },
        { "modalities", '{"vision":false,"audio":false}' },
        { "build_info", encode("TinyLoop " .. tostring(info.version)) },
    })
end

return _M

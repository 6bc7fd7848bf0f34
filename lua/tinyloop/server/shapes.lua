-- tinyloop.server.shapes: what the other APIs served over the chat completions path (OpenAI's
-- Responses, Anthropic's Messages, Ollama's) share. Pure Lua (no ngx).
--
-- Their requests are read into the chat request they mean; their answers are the chat answer
-- read back: `answer` reads a blocking chat answer, `deltas` one chunk of a chat stream, into
-- the same few parts (reasoning, text, calls, the finish), which each API then writes in its
-- own shape. JSON is written by hand (`object`), in the order each API documents, with
-- values kept as the chat path wrote them (an empty list stays [], a schema keeps its order).
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local first_unknown = require("tinyloop.ordered").first_unknown
local cjson = require "cjson.safe"
local json_text = require "tinyloop.json_text"
-- (long translations pause: tinyloop.pause)
local point = require("tinyloop.pause").point

local type, pairs, ipairs, tostring, next = type, pairs, ipairs, tostring, next
local concat, sub, gsub = table.concat, string.sub, string.gsub
local raw_member = json_text.member
local json_null = cjson.null

local _M = {}

function _M.encode(v) return (cjson.encode(v)) end
local encode = _M.encode

-- An error answer's parts: HTTP status, message, param (the request field, or nil): the chat
-- parser's, whose errors the views rename.
_M.bad = require("tinyloop.server.request").bad

_M.is_array = require("tinyloop.chat").is_array
local is_array = _M.is_array

-- A value as a message shows it: JSON ("user", null, 5; an empty table as {}).
function _M.shown(v)
    if type(v) == "table" and next(v) == nil then return "{}" end
    return encode(v) or tostring(v)
end

-- An object's JSON text from { {key, json text or nil (left out)}, ... }, in that order.
function _M.object(members)
    local out = {}
    for _, m in ipairs(members) do
        if m[2] ~= nil then out[#out + 1] = encode(m[1]) .. ":" .. m[2] end
    end
    return "{" .. concat(out, ",") .. "}"
end

-- Every key of `item` is one of `keys` -> true | nil, err naming the first that is not.
function _M.check_keys(item, keys, where)
    point() -- (once an item: the APIs' translations check each message, block and item so)
    local unknown = first_unknown(item, keys) -- (the same in every process)
    if unknown ~= nil then return nil, ("unknown field '%s' in %s"):format(tostring(unknown), where) end
    return true
end

-- The raw JSON text of each element of the array, or each member of the object, whose text is
-- `text` (nil or another kind: none): a list, or a map key -> text. One pass over the text:
-- reading a request's nested members with these, level by level, costs its length once
-- (json_text.member rescans from the top at every call).
function _M.raw_list(text)
    local out = {}
    if text and sub(text, 1, 1) == "[" then
        for i, e in ipairs(json_text.entries(text, 1)) do out[i] = sub(text, e.from, e.to) end
    end
    return out
end
function _M.raw_fields(text)
    local out = {}
    local at = text and json_text.skip_ws(text, 1)
    if at and sub(text, at, at) == "{" then
        for _, e in ipairs(json_text.entries(text, at)) do out[e.key] = sub(text, e.from, e.to) end
    end
    return out
end

local function plain(s) return (s:gsub("[%^%$%(%)%%%.%[%]%*%+%-%?]", "%%%0")) end

-- rename_fields(message, renames) -> an error's message with the chat request's field names
-- ({ {chat name, the API's name}, ... }, in order) written as the other API's, whole words only.
function _M.rename_fields(message, renames)
    for _, r in ipairs(renames) do message = gsub(message, "%f[%w_]" .. plain(r[1]) .. "%f[^%w_]", r[2]) end
    return message
end

-- add_tool_choice(members, choice_json, tools): the chat body's tool_choice, unless it is
-- "auto" without tools, which changes nothing (OpenAI's clients send it with an empty list).
function _M.add_tool_choice(members, choice_json, tools)
    if choice_json == '"auto"' and not (tools and #tools > 0) then return end
    members[#members + 1] = { "tool_choice", choice_json }
end

-- An integer's JSON text (tostring writes 2^47 as 1.4073748835533e+14).
function _M.integer(n) return ("%d"):format(n) end

-- n random bytes from the kernel (/dev/urandom, opened once per process and kept); nil when it
-- cannot be read.
local urandom
function _M.random_bytes(n)
    urandom = urandom or io.open("/dev/urandom", "rb")
    local bytes = urandom and urandom:read(n)
    return bytes and #bytes == n and bytes or nil
end

-- n random bytes as hex (2n digits), or nil.
function _M.random_hex(n)
    local bytes = _M.random_bytes(n)
    return bytes and (bytes:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) or nil
end

-- A seed from the kernel's entropy, for a request's "random" seed (Ollama's and llama.cpp's -1:
-- the engine's default seed is fixed, the same tokens every time).
function _M.random_seed()
    local bytes = _M.random_bytes(4)
    if not bytes then return math.floor(os.time() * 1000 + os.clock() * 1e6) % 2147483648 end
    local a, b, c, d = bytes:byte(1, 4)
    return ((a * 256 + b) * 256 + c) * 128 + d % 128
end

-- The most stop strings a request may give (request.lua's, which every front end takes).
_M.MAX_STOPS = require("tinyloop.server.request").MAX_STOPS
-- OpenAI's reasoning efforts (the Responses API's reasoning.effort, the chat's reasoning_effort).
_M.REASONING_EFFORTS = require("tinyloop.server.request").REASONING_EFFORTS

-- A final assistant message (no calls) is a prefill: the reply continues it (Anthropic's rule,
-- and Ollama's templates leave it open) -> the chat body's member saying so, added. One
-- with no text to continue (empty, or blanks only) is left out of `messages` and the reply
-- is an ordinary one: Anthropic allows an empty final assistant message, and Ollama's
-- template leaves the empty turn open, where the reply then starts. (Before `messages` is
-- encoded.)
function _M.continue_prefill(members, messages)
    local last = messages[#messages]
    -- (a message that is no object is check_messages' to refuse: /apply-template comes here first)
    if not (type(last) == "table" and last.role == "assistant" and not last.tool_calls) then return end
    if type(last.content) == "string" and require("tinyloop.chat").blank(last.content) then
        messages[#messages] = nil
        return
    end
    members[#members + 1] = { "continue_final_message", "true" }
end

-- JSON kinds of a request's top-level fields, checked before anything reads them.
_M.KIND_WORDS = { string = "a string", integer = "an integer", boolean = "a boolean", object = "an object", array = "an array",
                  number = "a number" }
_M.KIND_OK = {
    string = function(v) return type(v) == "string" end,
    number = function(v) return type(v) == "number" and v == v end,
    integer = function(v) return type(v) == "number" and v % 1 == 0 and v > -2 ^ 53 and v < 2 ^ 53 end,
    boolean = function(v) return type(v) == "boolean" end,
    object = function(v) return type(v) == "table" and (next(v) == nil or not is_array(v)) end,
    array = function(v) return type(v) == "table" and is_array(v) end,
    any = function() return true end,
}

-- The chat fields another API's request passes on as sent (same name, same meaning), checked
-- by the chat parser: TinyLoop's and vLLM's extensions and the sampling fields all share.
_M.PASSED = {
    "model", "temperature", "top_p", "stream", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "loops", "top_k",
    "min_p", "min_tokens", "repetition_penalty", "penalty_window", "penalties_count_prompt", "temperature_last", "ignore_eos", "cache_window", "speculative", "draft_loops", "draft_ahead",
    "K_branches", "max_nodes", "beam_size", "length_penalty", "early_exit_patience", "early_exit_min_L", "early_exit_peek_every",
    "early_exit_logit_margin", "early_exit_threshold", "early_exit_criterion", "early_exit_kl_threshold",
    "early_exit_entropy_threshold", "early_exit_gate_threshold", "grammar", "structured_outputs", "guided_json", "guided_choice",
    "guided_grammar", "guided_regex", "stop_token_ids", "include_stop_str_in_output", "chat_template_kwargs", "include_reasoning",
    "thinking_budget", "skip_special_tokens", "guided_decoding_backend",
}

-- read_fields(body, own, pass, refused[, lenient]) -> the request body's table (null fields left out),
-- the chat body's members so far (the `pass` fields, as sent) and each top-level member's text
-- (read in one pass: a body of many fields is not rescanned for each), or nil, err: not a JSON object,
-- an unknown field (unless lenient: skipped, as a Go server's JSON decoding skips it, and a
-- name that matches a known one in another case read as it, as Go's matches it), a
-- `refused` one (its value: why), an `own` one (its value: its kind) of another kind.
function _M.read_fields(body, own, pass, refused, lenient)
    local t, err = require("tinyloop.server.request").decode_object(body) -- (every body's rule)
    if not t then return nil, err end
    local members, raw = {}, _M.raw_fields(body)
    if lenient then
        -- (Go's decoding matches a field's name in any case, "Stream" too, each key in the
        -- body's order writing the field: the last one that is not null wins)
        local folded
        for k in pairs(t) do
            if type(k) == "string" and not own[k] and not pass[k] and not refused[k] then folded = {} break end
        end
        if folded then
            for _, names in ipairs({ own, pass, refused }) do
                for name in pairs(names) do folded[name:lower()] = name end
            end
            local winner = {}
            for _, e in ipairs(json_text.entries(body, (body:find("{", 1, true)))) do
                local name = folded[e.key:lower()]
                if name and body:sub(e.from, e.to) ~= "null" then winner[name] = e.key end
            end
            for name, key in pairs(winner) do
                if key ~= name then t[name], raw[name] = t[key], raw[key] end
            end
            for k in pairs(t) do -- (every other spelling of a known field: read once, above)
                local name = type(k) == "string" and folded[k:lower()]
                if name and k ~= name then t[k] = nil end
            end
        end
    end
    for k, v in ordered_pairs(t) do
        if v == json_null then
            t[k] = nil
        elseif refused[k] then
            return _M.bad(refused[k], k)
        elseif own[k] then
            -- (an empty object and an empty array decode alike: their text tells them apart)
            local opens = own[k] == "array" and "[" or own[k] == "object" and "{"
            if not _M.KIND_OK[own[k]](v) or (opens and raw[k]:match("^%s*(.)") ~= opens) then
                return _M.bad(("%s must be %s"):format(k, _M.KIND_WORDS[own[k]]), k)
            end
        elseif pass[k] then
            members[#members + 1] = { k, raw[k] }
        elseif not lenient then
            return _M.bad(("unknown field '%s'"):format(tostring(k)), tostring(k))
        end
    end
    return t, members, raw
end

-- add_template_variable(members, t, name, json): the chat body's chat_template_kwargs get
-- `name` (its value's JSON text), first, unless the request's own (t's) set it.
function _M.add_template_variable(members, t, name, json)
    for _, m in ipairs(members) do
        if m[1] == "chat_template_kwargs" then
            local own = t.chat_template_kwargs -- (nil: the member is this function's)
            if own ~= nil and (type(own) ~= "table" or own[name] ~= nil) then return end
            local inner = m[2]:match("^%s*{%s*(.-)%s*}%s*$")
            if inner then m[2] = "{" .. encode(name) .. ":" .. json .. (inner ~= "" and ("," .. inner) or "") .. "}" end
            return
        end
    end
    members[#members + 1] = { "chat_template_kwargs", "{" .. encode(name) .. ":" .. json .. "}" }
end

-- ------------------------------------------------------------------ chat answers read back

-- A chat answer's or chunk's logprobs entries (its choice's logprobs.content), each entry's
-- JSON text as the chat path wrote it (decoded and encoded again, an empty top_logprobs would
-- become {}).
function _M.logprob_entries(chat_json)
    return _M.raw_list(raw_member(chat_json, { "choices", 1, "logprobs", "content" }))
end

local function string_or_nil(v) return type(v) == "string" and v or nil end

-- The call the token limit cut, {id, name}, that a choice's stats name (tinyloop.cut_call),
-- or nil.
local function cut_call_of(chat)
    local stats = type(chat.tinyloop) == "table" and chat.tinyloop or {}
    local cut = type(stats.cut_call) == "table" and stats.cut_call or nil
    return cut and type(cut.id) == "string" and type(cut.name) == "string" and cut or nil
end

-- The finish of a choice: {finish_reason, stop_reason (vLLM's: the stop string or token id
-- that ended it), usage (the chat usage table), tinyloop (the stats' JSON text), cut_call
-- (cut_call_of's)}.
local function finish_of(choice, chat, chat_json)
    local stats = chat.tinyloop and raw_member(chat_json, { "tinyloop" }) or nil
    local stop = choice.stop_reason
    return { finish_reason = choice.finish_reason, stop_reason = stop ~= json_null and stop or nil,
             usage = type(chat.usage) == "table" and chat.usage or nil, tinyloop = stats, cut_call = cut_call_of(chat) }
end

-- answer(chat_json) -> a blocking chat (or completions) answer's one choice: { reasoning (text, or nil for none
-- or an empty block), text (the
-- content, "" for none), calls ({id, name, arguments (JSON text)}, ...), cut_call ({id, name}
-- of the call the token limit cut, left out of calls: tinyloop.cut_call; or nil), logprobs
-- (entries' JSON texts), finish = finish_of's, created, model }.
function _M.answer(chat_json)
    local chat = cjson.decode(chat_json)
    local choice = chat.choices[1]
    -- (a completions answer's choice has its text: a message of that content)
    local message = type(choice.message) == "table" and choice.message or { content = choice.text }
    local calls = {}
    for k, call in ipairs(type(message.tool_calls) == "table" and message.tool_calls or {}) do
        calls[k] = { id = call.id, name = call["function"].name, arguments = call["function"].arguments }
    end
    -- (an empty block is no reasoning: a stream shows none)
    local thought = string_or_nil(message.reasoning_content)
    return { reasoning = thought ~= "" and thought or nil, text = string_or_nil(message.content) or "", calls = calls,
             cut_call = cut_call_of(chat),
             logprobs = type(choice.logprobs) == "table" and _M.logprob_entries(chat_json) or {},
             finish = finish_of(choice, chat, chat_json),
             created = chat.created, model = chat.model }
end

-- deltas(payload) -> what one event of a chat stream (a chunk's JSON text, an error's, or
-- "[DONE]") says, in order: { {kind = "reasoning", text}, {kind = "text", text},
-- {kind = "call", id, name} (a call begins), {kind = "arguments", text} (of the call begun
-- last), {kind = "finish", ...finish_of's}, {kind = "error", message, type, param} }, and the
-- chunk's logprobs entries (JSON texts). A chunk's reasoning comes before its text, and its
-- text before its calls (the chat stream's order).
function _M.deltas(payload)
    local out = {}
    if payload == "[DONE]" then return out, {} end
    local chunk = cjson.decode(payload)
    if type(chunk) ~= "table" then return out, {} end
    if type(chunk.error) == "table" then
        local e = chunk.error
        out[1] = { kind = "error", message = tostring(e.message), type = string_or_nil(e.type), param = string_or_nil(e.param) }
        return out, {}
    end
    local choice = type(chunk.choices) == "table" and chunk.choices[1]
    if type(choice) ~= "table" then return out, {} end
    -- (a completions chunk's choice has its text: a delta of that content)
    local delta = type(choice.delta) == "table" and choice.delta or { content = choice.text }
    local thought, text = string_or_nil(delta.reasoning_content), string_or_nil(delta.content)
    if thought and thought ~= "" then out[#out + 1] = { kind = "reasoning", text = thought } end
    if text and text ~= "" then out[#out + 1] = { kind = "text", text = text } end
    for _, entry in ipairs(type(delta.tool_calls) == "table" and delta.tool_calls or {}) do
        local fn = type(entry["function"]) == "table" and entry["function"] or {}
        if string_or_nil(entry.id) then out[#out + 1] = { kind = "call", id = entry.id, name = string_or_nil(fn.name) or "" } end
        local arguments = string_or_nil(fn.arguments)
        if arguments and arguments ~= "" then out[#out + 1] = { kind = "arguments", text = arguments } end
    end
    if choice.finish_reason and choice.finish_reason ~= json_null then
        local finish = finish_of(choice, chunk, payload)
        finish.kind = "finish"
        out[#out + 1] = finish
    end
    -- (the entries' texts only where there are some: reading them scans the chunk's text)
    return out, type(choice.logprobs) == "table" and _M.logprob_entries(payload) or {}
end

-- llama.cpp's and Ollama's repeat_last_n (value, its name for messages, the field to name):
-- the last N tokens its three penalties read, the engine's penalty_window. -> true, the
-- window's text for the chat request: left out, both servers' default of 64; -1, the whole
-- context ("0"); N > 0, N. 0 turns the penalties off (-> true, "off": the request's
-- repetition, presence and frequency penalties are then left out, PENALTIES naming them).
-- nil, err for what is no window. (Within the window, presence and frequency count the
-- prompt's tokens as well in both, llama.cpp's sampler being fed the prompt: callers ask
-- for penalties_count_prompt.)
_M.PENALTIES = { repetition_penalty = true, presence_penalty = true, frequency_penalty = true }
_M.REPEAT_LAST_N_DEFAULT = 64
function _M.penalty_window(v, name, param)
    if v == nil then return true, tostring(_M.REPEAT_LAST_N_DEFAULT) end
    if not _M.KIND_OK.integer(v) or v < -1 then return _M.bad(name .. " must be an integer >= -1", param) end
    if v == 0 then return true, "off" end
    -- (-1, or a window longer than any sequence: the whole sequence, the engine's 0)
    return true, (v == -1 or v > 2147483647) and "0" or _M.integer(v)
end

-- repeat_penalty's text as Ollama and llama.cpp take it (request.repeat_penalty: 0 is none),
-- from the raw JSON text `raw` of the number v; anything but a number stays as sent (the
-- parser names what is wrong with it: Ollama's "1.1" was a 500, comparing a string).
function _M.repeat_penalty_text(v, raw)
    if type(v) ~= "number" then return raw end
    local penalty = require("tinyloop.server.request").repeat_penalty(v)
    return penalty == v and raw or _M.encode(penalty)
end

-- A sampler's value as llama.cpp's and Ollama's servers take it where OpenAI's ranges, which
-- the request parser keeps, refuse it: Ollama's sampler clamps a temperature below 0 to 0 and
-- top_p and min_p into [0, 1] (its NewSampler), and samples every token at top_k <= 0;
-- llama.cpp's samplers skip top_k <= 0 and top_p >= 1, keep the likeliest token alone at
-- top_p <= 0 and min_p >= 1, skip min_p <= 0, and sample greedily below temperature 0. Both
-- read as these clamps. raw: the JSON text of v; anything but a number stays as sent (the
-- parser names what is wrong with it). -> the text the request parser is given.
function _M.native_sampler_text(name, v, raw)
    if type(v) ~= "number" then return raw end
    local taken = v
    if name == "temperature" then
        taken = math.max(v, 0)
    elseif name == "top_k" then
        taken = (_M.KIND_OK.integer(v) and v < 0) and 0 or v
    elseif name == "top_p" or name == "min_p" then
        taken = math.min(math.max(v, 0), 1)
    end
    return taken == v and raw or _M.encode(taken)
end

-- (llama.cpp's samplers this engine lacks, and its fields that change nothing here: request's)
_M.LLAMACPP_OFF = require("tinyloop.server.request").LLAMACPP_OFF

return _M

-- tinyloop.server.ollama: Ollama's API (POST /api/chat, /api/generate, /api/show, /api/embed,
-- /api/embeddings; GET /api/tags, /api/ps, /api/version) as a view of the chat and completions paths, as
-- tinyloop.server.responses is of OpenAI's Responses. Pure Lua (no ngx).
--
-- The tools built on Ollama (its Python and JS clients, LangChain's ChatOllama, editors' and
-- web UIs' Ollama backends) send /api/chat and /api/generate: a request is the chat request it
-- means (/api/generate with raw: true the completions request), Ollama's `options` as the
-- sampling fields, `format` as a JSON grammar, `think` as the template's enable_thinking.
-- Answers stream by default (Ollama's rule), as newline-delimited JSON objects, the last with
-- done: true, done_reason and the counts and durations (nanoseconds) Ollama reports. Errors
-- are {"error": "message"}.
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local cjson = require "cjson.safe"
local json_text = require "tinyloop.json_text"
local shapes = require "tinyloop.server.shapes"

local type, pairs, ipairs, tostring = type, pairs, ipairs, tostring
local concat, floor = table.concat, math.floor
local raw_member = json_text.member
local json_null = cjson.null
local encode, bad, is_array, shown, object = shapes.encode, shapes.bad, shapes.is_array, shapes.shown, shapes.object

local _M = {}

-- ------------------------------------------------------------------ the request

-- Ollama's options -> the chat request's field (true: taken, changes nothing here: the
-- machine's and the context's settings, which the server's own configuration fixes).
local OPTIONS = {
    temperature = "temperature", top_p = "top_p", top_k = "top_k", min_p = "min_p", seed = "seed",
    repeat_penalty = "repetition_penalty", presence_penalty = "presence_penalty", frequency_penalty = "frequency_penalty",
    num_predict = true, stop = true, -- (read below)
    num_ctx = true, num_keep = true, num_batch = true, num_gpu = true, main_gpu = true, num_thread = true, numa = true,
    use_mmap = true, use_mlock = true, low_vram = true, vocab_only = true, f16_kv = true, logits_all = true,
    repeat_last_n = true, penalize_newline = true, mirostat_eta = true, mirostat_tau = true,
}
local INTEGER_OPTIONS = { top_k = true, seed = true, num_predict = true, repeat_last_n = true, num_keep = true }
-- Ollama's defaults of the samplers for what a request leaves out (its api.DefaultOptions, as
-- its Modelfile reference lists them), Open WebUI and other clients sending only a
-- temperature: top_k 40, top_p 0.9, repeat_penalty 1.1 (over repeat_last_n's 64 tokens,
-- shapes.penalty_window). Its temperature, 0.8, is not taken: left out, a request is greedy
-- here, as on every endpoint but llama.cpp's (README).
_M.DEFAULTS = { { "top_k", 40 }, { "top_p", 0.9 }, { "repeat_penalty", 1.1 } }
-- Options taken only at the value that changes nothing (samplers this engine does not have).
-- Any other option is ignored, as Ollama ignores one it does not know (clients put what they
-- do not map there: Open WebUI's reasoning_effort, old Modelfiles' rope_frequency_base).
local NO_OP_OPTIONS = { typical_p = 1, tfs_z = 1, mirostat = 0 }
-- The Ollama version the API here follows (clients check it: some want 0.6 or later).
_M.API_VERSION = "0.12.6"

-- The request's top-level fields: their JSON kinds (PASSED: the chat request's, as sent).
-- Another field is skipped, as Ollama's Go decoding skips it (apps that post OpenAI-shaped
-- bodies to Ollama send some); a message's or a tool's unknown keys too.
-- (truncate: /api/chat's conversation over the context loses its oldest messages, and
-- /api/generate's prompt its middle, unless it is false, as Ollama's; shift: Ollama's context
-- shift, which this engine does not do;
-- /api/chat's system: Open WebUI sends one, which Ollama's chat ignores, as here)
local CHAT_OWN = { model = "string", messages = "array", tools = "array", format = "any", options = "object", stream = "boolean",
                   think = "any", keep_alive = "any", truncate = "boolean", shift = "boolean", system = "any",
                   logprobs = "boolean", top_logprobs = "integer" }
local GENERATE_OWN = { model = "string", prompt = "string", suffix = "string", system = "string", raw = "boolean", format = "any",
                       options = "object", stream = "boolean", think = "any", keep_alive = "any", images = "array",
                       context = "array", template = "string", truncate = "boolean", shift = "boolean",
                       logprobs = "boolean", top_logprobs = "integer" }
local PASS = {}
for _, k in ipairs(shapes.PASSED) do PASS[k] = k ~= "model" and k ~= "stream" or nil end
local REFUSED = {}

-- A model name as Ollama's clients send it ("name" or "name:tag") is the served model's when
-- its name is, with the tag "latest" or none.
function _M.names_model(name, model_id)
    name = type(name) == "string" and name:lower() or nil
    return name == model_id:lower() or name == model_id:lower() .. ":latest"
end

-- keep_alive's seconds, as Ollama reads it: a number of seconds, or a Go duration text
-- (time.ParseDuration's: "5m", "1h30m", "0.5s", "-1m", "0"); nil where the text is none.
local MAX_DURATION_SECONDS = 9223372036.854775807
local DURATION_UNITS = { ns = 1e-9, us = 1e-6, ["\194\181s"] = 1e-6, ["\206\188s"] = 1e-6, ms = 1e-3, s = 1, m = 60, h = 3600 }
local function keep_alive_seconds(v)
    if type(v) == "number" then return v end
    if type(v) ~= "string" then return nil end
    local sign, rest = v:match("^([-+]?)(.*)$")
    if rest == "0" then return 0 end
    if rest == "" then return nil end
    local total = 0
    while rest ~= "" do
        local whole, dot, fraction, unit, after = rest:match("^(%d*)(%.?)(%d*)([^%d%.]+)(.*)$")
        if not whole or (whole == "" and fraction == "") or not DURATION_UNITS[unit] then return nil end
        total = total + tonumber(whole .. dot .. fraction .. (fraction == "" and dot ~= "" and "0" or "")) * DURATION_UNITS[unit]
        rest = after
    end
    if total > MAX_DURATION_SECONDS then return nil end -- (past Go's int64 nanoseconds: its "invalid duration")
    return sign == "-" and -total or total
end

-- Whether keep_alive asks the model to go now (Ollama's 0: a duration of 0, a fraction of a
-- nanosecond truncated to 0 as Go's Duration is; a number's whole seconds, which its
-- UnmarshalJSON takes, 0.5 being 0; a negative one is "forever").
local function unloads(keep_alive)
    if type(keep_alive) == "number" then return keep_alive >= 0 and keep_alive < 1 end
    local seconds = keep_alive_seconds(keep_alive)
    return seconds ~= nil and math.abs(seconds) < 1e-9
end

local function check_model(t, model_id)
    if t.model ~= nil and not _M.names_model(t.model, model_id) then
        return bad(("model %s not found (this server runs %s)"):format(shown(t.model), model_id .. ":latest"), "model", 404)
    end
    return true
end

-- options, format, think, stream -> members of the chat body (appended), or nil, err.
-- `thinks`: the model's template has a thinking block; model_id names it.
local function common(t, raw, members, thinks, model_id)
    -- Ollama streams unless told not to
    members[#members + 1] = { "stream", t.stream == false and "false" or "true" }
    -- logprobs (Ollama's, as the chat request's: each token's, with top_logprobs alternatives)
    -- (Ollama checks the range alone: without logprobs, top_logprobs changes nothing)
    if t.top_logprobs ~= nil and not (t.top_logprobs >= 0 and t.top_logprobs <= 20) then
        return bad("top_logprobs must be between 0 and 20", "top_logprobs")
    end
    -- (a keep_alive Ollama cannot read is its 400; the model stays loaded whatever it says)
    if t.keep_alive ~= nil and keep_alive_seconds(t.keep_alive) == nil then
        return bad(("keep_alive must be a number of seconds or a duration such as \"5m\", got %s"):format(shown(t.keep_alive)),
                   "keep_alive")
    end
    if t.logprobs then
        members[#members + 1] = { "logprobs", "true" }
        members[#members + 1] = { "top_logprobs", shapes.integer(t.top_logprobs or 0) }
    end
    local options = t.options or {}
    local raw_options = shapes.raw_fields(raw.options)
    -- (an integer option given a fraction is truncated, as Ollama's FromMap sets an int from
    -- JSON's float64: top_k 2.7 is 2)
    for k in pairs(INTEGER_OPTIONS) do
        local v = options[k]
        if type(v) == "number" and v == v and math.abs(v) < 2 ^ 53 and v ~= math.floor(v) then
            local whole = v < 0 and math.ceil(v) or math.floor(v)
            options[k], raw_options[k] = whole, shapes.integer(whole)
        end
    end
    local repeat_last_n = options.repeat_last_n ~= json_null and options.repeat_last_n or nil
    local ok_window, e_window = shapes.penalty_window(repeat_last_n, "options.repeat_last_n", "options")
    if not ok_window then return nil, e_window end
    -- TinyLoop's own penalty_window, sent at the top level, is the client's word over the default
    if repeat_last_n ~= nil and t.penalty_window ~= nil then
        return bad("give options.repeat_last_n or penalty_window, not both", "options")
    end
    if e_window ~= "off" and t.penalty_window == nil then members[#members + 1] = { "penalty_window", e_window } end
    if e_window ~= "off" and t.penalties_count_prompt == nil then -- (its llama.cpp runner feeds the prompt to the sampler)
        members[#members + 1] = { "penalties_count_prompt", "true" }
    end
    for k, v in ordered_pairs(options) do
        if v ~= json_null and not (e_window == "off" and shapes.PENALTIES[OPTIONS[k]]) then
            if NO_OP_OPTIONS[k] ~= nil then
                if v ~= NO_OP_OPTIONS[k] then
                    return bad(("options.%s is not supported (only %s, which changes nothing)"):format(k, tostring(NO_OP_OPTIONS[k])), "options")
                end
            elseif k == "seed" and v == -1 then -- (Ollama's "random": a seed drawn for this request)
                members[#members + 1] = { "seed", shapes.integer(shapes.random_seed()) }
            elseif k == "repeat_penalty" then
                members[#members + 1] = { OPTIONS[k], shapes.repeat_penalty_text(v, raw_options[k]) }
            elseif type(OPTIONS[k]) == "string" then -- (a value past OpenAI's range as Ollama's sampler takes it)
                members[#members + 1] = { OPTIONS[k], shapes.native_sampler_text(k, v, raw_options[k]) }
            end
        end
    end
    for _, default in ipairs(_M.DEFAULTS) do
        local k, v = default[1], default[2]
        local field = OPTIONS[k]
        -- (the client's word: the option, or TinyLoop's field at the top level; no penalty
        -- where repeat_last_n 0 turned them off)
        if (options[k] == nil or options[k] == json_null) and t[field] == nil
            and not (e_window == "off" and shapes.PENALTIES[field]) then
            members[#members + 1] = { field, encode(v) }
        end
    end
    local predict = options.num_predict
    if predict ~= nil and predict ~= json_null then
        if not shapes.KIND_OK.integer(predict) then return bad("options.num_predict must be an integer", "options") end
        -- (0 and -1: no limit, -2: fill the context: all the rest of the context here; Ollama's
        -- runner stops at num_predict only where it is above 0)
        if predict > 0 then members[#members + 1] = { "max_tokens", shapes.integer(predict) } end
    end
    if options.stop ~= nil and options.stop ~= json_null then members[#members + 1] = { "stop", raw_options.stop } end
    local format = t.format
    if format ~= nil and format ~= "" then
        if format == "json" then
            members[#members + 1] = { "response_format", '{"type":"json_object"}' }
        elseif type(format) == "table" and raw.format:sub(1, 1) == "{" then -- (`{}` too: any JSON)
            members[#members + 1] = { "response_format", '{"type":"json_schema","json_schema":{"name":"format","schema":' ..
                                                         raw.format .. "}}" }
        else
            return bad('format must be "json" or a JSON Schema object', "format")
        end
    end
    local think = t.think
    if think ~= nil then
        if think ~= true and think ~= false and think ~= "low" and think ~= "medium" and think ~= "high" then
            return bad('think must be true, false, "low", "medium" or "high"', "think")
        end
        -- (Ollama's answer to asking a model without a thinking block to think; it went unheard)
        if think ~= false and not thinks then return bad(("%s does not support thinking"):format(encode(t.model or model_id)), "think") end
        shapes.add_template_variable(members, t, "enable_thinking", tostring(think ~= false))
        if type(think) == "string" then shapes.add_template_variable(members, t, "reasoning_effort", encode(think)) end
    end
    return true
end

-- An assistant's tool_calls (Ollama's: {"function": {"name", "arguments": an object}}, its
-- arguments read as sent, other keys skipped) -> chat's, each with an id (Ollama's calls have none; its tool
-- messages name the function they answer).
local function chat_calls(calls, raw_calls, where, message_index)
    if not is_array(calls) then return nil, where .. " must be an array" end
    local out = {}
    for k, call in ipairs(calls) do
        local at = ("%s[%d]"):format(where, k - 1)
        local fn = type(call) == "table" and call["function"]
        if type(fn) ~= "table" then return nil, at .. ' must be {"function": {"name", "arguments"}}' end
        if type(fn.name) ~= "string" then return nil, at .. ".function.name must be a string" end
        local arguments = shapes.raw_fields(shapes.raw_fields(raw_calls[k])["function"]).arguments
        if not arguments or arguments:sub(1, 1) ~= "{" then return nil, at .. ".function.arguments must be an object" end
        out[k] = { id = type(call.id) == "string" and call.id or ("call_%d_%d"):format(message_index, k), type = "function",
                   ["function"] = { name = fn.name, arguments = arguments } }
    end
    return out
end

local ROLES = { system = true, user = true, assistant = true, tool = true }

-- messages (Ollama's) -> chat's, or nil, err. A tool message answers the earliest call not yet
-- answered of the function it names (tool_name), or else the earliest not yet answered. (The
-- open calls are queues, by name and all together: each answer costs its own, whatever their
-- number.)
local function chat_messages(messages, raw)
    local out = {}
    local all, by_name, answered = { first = 1 }, {}, {} -- queues of open calls; answered ids
    local function next_open(queue)
        while queue and queue[queue.first] and answered[queue[queue.first].id] do queue.first = queue.first + 1 end
        return queue and queue[queue.first]
    end
    local raw_messages = shapes.raw_list(raw)
    local err
    for i, m in ipairs(messages) do
        local where = ("messages[%d]"):format(i - 1)
        if type(m) ~= "table" or is_array(m) then return nil, where .. ' must be an object {"role", "content"}' end
        local role = type(m.role) == "string" and m.role:lower() or m.role -- (Ollama reads roles in any case)
        if not ROLES[role] then return nil, ('%s.role must be "system", "user", "assistant" or "tool", got %s'):format(where, shown(m.role)) end
        local content = m.content
        if content == json_null then content = nil end
        if content ~= nil and type(content) ~= "string" then return nil, where .. ".content must be a string" end
        if m.images ~= nil and m.images ~= json_null and not (is_array(m.images) and #m.images == 0) then
            return nil, where .. ".images: this model reads text only"
        end
        local message = { role = role, content = content or "" }
        if role == "assistant" then
            if type(m.thinking) == "string" and m.thinking ~= "" then message.reasoning_content = m.thinking end
            if m.tool_calls ~= nil and m.tool_calls ~= json_null then
                local calls
                calls, err = chat_calls(m.tool_calls, shapes.raw_list(shapes.raw_fields(raw_messages[i]).tool_calls),
                                        where .. ".tool_calls", i - 1)
                if not calls then return nil, err end
                if #calls > 0 then
                    message.tool_calls = calls
                    if message.content == "" then message.content = json_null end
                    for _, call in ipairs(calls) do
                        local name = call["function"].name
                        by_name[name] = by_name[name] or { first = 1 }
                        by_name[name][#by_name[name] + 1] = call
                        all[#all + 1] = call
                    end
                end
            end
        elseif role == "tool" then
            if type(m.tool_call_id) == "string" then
                message.tool_call_id = m.tool_call_id
            else
                local call = (type(m.tool_name) == "string" and next_open(by_name[m.tool_name])) or next_open(all)
                message.tool_call_id = call and call.id or ("call_" .. (i - 1))
            end
            answered[message.tool_call_id] = true
        end
        out[#out + 1] = message
    end
    if #out == 0 then return nil, "messages must be a non-empty array of messages" end
    return out
end

-- (PARSE_OPTIONS: Ollama's rules where the chat request's differ: num_predict is a cap, the
-- rest of the context at most; stop strings are not limited to OpenAI's 4)
local View = { ID_PREFIX = "ollama", CONTENT_TYPE = "application/x-ndjson", FRAME = "ndjson",
               PARSE_OPTIONS = { room = true, max_stops = shapes.MAX_STOPS, beyond_openai_ranges = true } }
View.__index = View
-- (/api/chat's, with truncate left true: a conversation over the context loses its oldest
-- messages, Ollama's chatPrompt)
local TRUNCATING = setmetatable({ drop_oldest = true }, { __index = View.PARSE_OPTIONS })
-- (/api/generate's, with truncate left true: a prompt over the context loses its middle, its
-- first num_keep tokens kept (options.num_keep; Ollama's default, 4; a negative one keeps all
-- it can), as Ollama's runner cuts it)
local function cutting(num_keep)
    return setmetatable({ cut_middle = num_keep < 0 and math.huge or num_keep }, { __index = View.PARSE_OPTIONS })
end
local CUTTING = cutting(4)

-- chat_to_chat(body, model_id, thinks) -> an /api/chat request's chat body, and its view; or
-- nil, err. thinks: the model's template has a thinking block.
-- The tools as the chat request takes them: their text as sent, less "required": null and
-- "properties": null in a function's parameters, which Go clients built on Ollama's own api
-- package write for a nil slice or map (Ollama reads null as absent; a JSON Schema has no
-- null there). The members are cut out of the text, the rest kept as written.
local function tools_text(tools, raw_tools)
    local text = raw_tools
    for i = #tools, 1, -1 do -- (from the last: a cut moves nothing before it)
        -- (a tool without "type" is a function, as Ollama reads it: its template never asks)
        local tool = tools[i]
        if type(tool) == "table" and not is_array(tool) and tool.type == nil and tool["function"] ~= nil then
            local from = json_text.span(text, { i })
            text = text:sub(1, from) .. '"type":"function",' .. text:sub(from + 1)
        end
        local p = type(tools[i]) == "table" and type(tools[i]["function"]) == "table" and tools[i]["function"].parameters
        if type(p) == "table" and (p.required == json_null or p.properties == json_null) then
            local from, to = json_text.span(text, { i, "function", "parameters" })
            local kept = {}
            for _, e in ipairs(json_text.entries(text, from)) do
                local value = text:sub(e.from, e.to)
                if not ((e.key == "required" or e.key == "properties") and value == "null") then
                    kept[#kept + 1] = encode(e.key) .. ":" .. value
                end
            end
            text = text:sub(1, from - 1) .. "{" .. concat(kept, ",") .. "}" .. text:sub(to + 1)
        end
    end
    return text
end

function _M.chat_to_chat(body, model_id, thinks)
    local t, members, raw = shapes.read_fields(body, CHAT_OWN, PASS, REFUSED, true)
    if not t then return nil, members end
    local ok, err = check_model(t, model_id)
    if not ok then return nil, err end
    local view = setmetatable({ kind = "chat", stream = t.stream ~= false, model_name = t.model or model_id, logprobs = t.logprobs,
                                top_logprobs = t.top_logprobs, options = t.options }, View)
    if t.truncate ~= false then view.PARSE_OPTIONS = TRUNCATING end
    if t.messages == nil or #t.messages == 0 then -- (Ollama's way to load a model: it is loaded)
        view.load, view.unload = true, unloads(t.keep_alive)
        return "", view, true
    end
    local messages
    messages, err = chat_messages(t.messages, raw.messages)
    if not messages then return bad(err, "messages") end
    shapes.continue_prefill(members, messages)
    members[#members + 1] = { "messages", encode(messages) }
    if t.tools and #t.tools > 0 then members[#members + 1] = { "tools", tools_text(t.tools, raw.tools) } end
    ok, err = common(t, raw, members, thinks, model_id)
    if not ok then return nil, err end
    return object(members), view
end

-- generate_to_chat(body, model_id, thinks) -> an /api/generate request's body for the chat path (or,
-- with raw: true, the completions path: `chat` false), its view and `chat`; or nil, err.
-- An empty prompt loads the model in Ollama: here it is answered at once (view.load).
function _M.generate_to_chat(body, model_id, thinks)
    local t, members, raw = shapes.read_fields(body, GENERATE_OWN, PASS, REFUSED, true)
    if not t then return nil, members end
    local ok, err = check_model(t, model_id)
    if not ok then return nil, err end
    -- (Ollama's Go clients send "" for each of these: none)
    for _, k in ipairs({ "template", "system", "suffix" }) do
        if t[k] == "" then t[k] = nil end
    end
    if t.template ~= nil then return bad("template is not taken: the chat template is the server's (--chat-template)", "template") end
    if t.suffix ~= nil then return bad("suffix (fill in the middle) is not supported", "suffix") end
    if t.images ~= nil and #t.images > 0 then return bad("images: this model reads text only", "images") end
    if t.context ~= nil and #t.context > 0 then
        return bad("context (a past reply's tokens) is not kept: send the conversation to /api/chat", "context")
    end
    local view = setmetatable({ kind = "generate", stream = t.stream ~= false, model_name = t.model or model_id, logprobs = t.logprobs,
                                top_logprobs = t.top_logprobs, options = t.options }, View)
    ok, err = common(t, raw, members, thinks, model_id)
    if not ok then return nil, err end
    local num_keep = type(t.options) == "table" and t.options.num_keep
    if num_keep == json_null then num_keep = nil end
    if num_keep and not shapes.KIND_OK.integer(num_keep) then return bad("options.num_keep must be an integer", "options") end
    if t.truncate ~= false then view.PARSE_OPTIONS = (num_keep and num_keep ~= 4) and cutting(num_keep) or CUTTING end
    -- (raw: the prompt as it is; a system is refused, as Ollama refuses it ("raw mode does not
    -- support template, system, or context"), before it reads an empty prompt as a load; think
    -- only where it asks for thinking)
    if t.raw and t.system ~= nil then return bad("system goes through the chat template, which raw leaves out", "system") end
    if t.prompt == nil or t.prompt == "" then
        view.load, view.unload = true, unloads(t.keep_alive) -- (Ollama's way to load a model: it is loaded)
        return "", view, true
    end
    if t.raw then
        if t.logprobs then return bad("logprobs go through the chat path, which raw leaves out", "logprobs") end
        if t.think ~= nil and t.think ~= false then return bad("think goes through the chat template, which raw leaves out", "think") end
        members[#members + 1] = { "prompt", encode(t.prompt) }
        return object(members), view, false
    end
    local messages = {}
    if t.system then messages[1] = { role = "system", content = t.system } end
    messages[#messages + 1] = { role = "user", content = t.prompt }
    members[#members + 1] = { "messages", encode(messages) }
    return object(members), view, true
end

-- ------------------------------------------------------------------ embeddings

-- POST /api/embed {model, input: a string or strings, truncate (default true: an input over
-- the context keeps its first tokens), dimensions, options, keep_alive} and the older
-- /api/embeddings {model, prompt}. -> { inputs (strings), truncate, normalize (Ollama's
-- /api/embed gives unit vectors, /api/embeddings the model's own), dimensions, model_name }
-- | nil, err. No input at all (or an empty one) is Ollama's way to load the model: inputs {}.
local EMBED_OWN = { model = "string", input = "any", truncate = "boolean", dimensions = "integer", options = "object",
                    keep_alive = "any" }
local EMBEDDINGS_OWN = { model = "string", prompt = "string", options = "object", keep_alive = "any" }
function _M.embed_request(body, model_id, older)
    local t, err = shapes.read_fields(body, older and EMBEDDINGS_OWN or EMBED_OWN, {}, REFUSED, true)
    if not t then return nil, err end
    local ok
    ok, err = check_model(t, model_id)
    if not ok then return nil, err end
    local input = t.input
    if older then input = t.prompt end -- (/api/embeddings reads prompt alone: input is skipped there, as Ollama skips it)
    local inputs
    if input == nil or input == "" then
        inputs = {}
    elseif type(input) == "string" then
        inputs = { input }
    elseif type(input) == "table" and is_array(input) then
        inputs = input
        for i, item in ipairs(input) do
            if type(item) ~= "string" or item == "" then
                return bad(("input[%d] must be a non-empty string"):format(i - 1), "input")
            end
        end
    else
        return bad("input must be a string or an array of strings", "input")
    end
    return { inputs = inputs, single = type(input) == "string", truncate = older or t.truncate ~= false, normalize = not older,
             dimensions = not older and t.dimensions or nil, model_name = t.model or model_id, older = older }
end

-- The chat request's names -> Ollama's, in an error's message; the body {"error": message}.
local RENAMES = { { "max_completion_tokens", "options.num_predict" }, { "max_tokens", "options.num_predict" },
                  { "response_format.json_schema.schema", "format" }, { "response_format", "format" } }
function View:error(err)
    local message = shapes.rename_fields(err.message or "", RENAMES)
    if err.param == "stop" then message = message:gsub("^stop", "options.stop") end
    -- (a sampling option's fault names the option sent, options.top_k or options.repeat_penalty,
    -- not the chat request's field it became; the same field at the top level, TinyLoop's, keeps
    -- its name: repetition_penalty = 0 was named options.repeat_penalty, whose 0 is taken)
    local options = self and type(self.options) == "table" and self.options
    for k, field in pairs(options and err.param and OPTIONS or {}) do
        if field == err.param and options[k] ~= nil and options[k] ~= json_null then
            message = shapes.rename_fields(message, { { field, "options." .. k } })
        end
    end
    -- (logprobs asks for top_logprobs 0 in the chat request: a client that sent no top_logprobs
    -- is told of its logprobs)
    if self and self.logprobs and self.top_logprobs == nil then message = shapes.rename_fields(message, { { "top_logprobs", "logprobs" } }) end
    -- (/api/generate's prompt goes through the chat request as its messages)
    if self and self.kind == "generate" then message = message:gsub("%f[%w_]messages%f[^%w_]", "prompt") end
    return { status = err.status, message = message, type = err.type, body = _M.error_body(message) }
end

function _M.error_body(message)
    return '{"error":' .. encode(message) .. "}"
end

-- ------------------------------------------------------------------ the answer

local function iso_time(seconds)
    return os.date("!%Y-%m-%dT%H:%M:%S", floor(seconds)) .. ("%.6fZ"):format(seconds % 1):sub(2)
end
_M.iso_time = iso_time

local function ns(ms) return ("%d"):format(floor((tonumber(ms) or 0) * 1e6 + 0.5)) end

-- The fields of a final object: done, done_reason and the counts and durations Ollama reports
-- (TinyLoop's stats, its own fields kept under "tinyloop").
local function final_fields(members, finish)
    local stats = finish.tinyloop and cjson.decode(finish.tinyloop) or {}
    local usage = finish.usage or {}
    members[#members + 1] = { "done_reason", finish.finish_reason == "length" and '"length"' or '"stop"' }
    members[#members + 1] = { "done", "true" }
    members[#members + 1] = { "total_duration", ns((stats.prefill_ms or 0) + (stats.decode_ms or 0)) }
    members[#members + 1] = { "load_duration", "0" }
    members[#members + 1] = { "prompt_eval_count", tostring(usage.prompt_tokens or 0) }
    members[#members + 1] = { "prompt_eval_duration", ns(stats.prefill_ms) }
    members[#members + 1] = { "eval_count", tostring(usage.completion_tokens or 0) }
    members[#members + 1] = { "eval_duration", ns(stats.decode_ms) }
    members[#members + 1] = { "tinyloop", finish.tinyloop }
end

local function calls_json(calls, from, to)
    local out = {}
    for k = from or 1, to or #calls do
        local call = calls[k]
        out[#out + 1] = object({ { "id", encode(call.id) }, { "function", object({ { "index", tostring(k - 1) },
            { "name", encode(call.name) }, { "arguments", call.arguments } }) } })
    end
    return "[" .. concat(out, ",") .. "]"
end

-- One object of the answer: the message (chat) or response (generate) so far.
-- (lp: logprobs entries' JSON texts, with logprobs asked for: this object's tokens')
function View:object(text, thought, calls, final, from, to, lp)
    local members = { { "model", encode(self.model_name) }, { "created_at", encode(iso_time(self.created or os.time())) } }
    if self.kind == "chat" then
        members[#members + 1] = { "message", object({ { "role", '"assistant"' }, { "content", encode(text) },
            { "thinking", thought and encode(thought) or nil }, { "tool_calls", calls and #calls > 0 and calls_json(calls, from, to) or nil } }) }
    else
        members[#members + 1] = { "response", encode(text) }
        members[#members + 1] = { "thinking", thought and encode(thought) or nil }
    end
    if self.logprobs then members[#members + 1] = { "logprobs", "[" .. concat(lp or {}, ",") .. "]" } end
    if final then final_fields(members, final) else members[#members + 1] = { "done", "false" } end
    return object(members)
end

-- The answer to an empty /api/generate prompt (Ollama's model load), or with keep_alive 0 its
-- unload (what `ollama stop` sends): done_reason says which, as Ollama's; the model stays,
-- this server holding its one model for its life.
function View:load_answer(created)
    self.created = created
    local reply = self.kind == "chat" and { "message", '{"role":"assistant","content":""}' } or { "response", '""' }
    return object({ { "model", encode(self.model_name) }, { "created_at", encode(iso_time(created)) }, reply,
                    { "done_reason", self.unload and '"unload"' or '"load"' }, { "done", "true" } })
end

-- response(json, id) -> a blocking answer (one object) of a chat or completions answer.
function View:response(answer_json, _)
    local answer = shapes.answer(answer_json)
    self.created = answer.created
    return self:object(answer.text, answer.reasoning, answer.calls, answer.finish, nil, nil, answer.logprobs)
end

-- ------------------------------------------------------------------ the stream

function View:start_stream(_, created)
    self.created, self.calls, self.finished = created, {}, false
end

-- feed(payload) -> the objects {nil, json} a chat stream's event makes: one per chunk with
-- text or reasoning; a call goes out whole (Ollama's way), once the next begins or at the
-- finish, whose object is the last (done: true).
function View:feed(payload)
    local out = {}
    if self.finished then return out end
    local deltas, entries = shapes.deltas(payload)
    local text, thought = {}, {}
    -- the logprobs of the tokens read since the last object went out go with the next one
    self.pending = self.pending or {}
    for _, e in ipairs(entries) do self.pending[#self.pending + 1] = e end
    local function take()
        local lp = self.pending
        self.pending = {}
        return lp
    end
    local function flush_calls(all)
        local calls = self.calls
        local upto = all and #calls or #calls - 1
        if upto >= (self.sent_calls or 0) + 1 then
            for k = (self.sent_calls or 0) + 1, upto do calls[k].arguments = concat(calls[k].pieces) end
            out[#out + 1] = { nil, self:object("", nil, calls, nil, (self.sent_calls or 0) + 1, upto, take()) }
            self.sent_calls = upto
        end
    end
    for _, d in ipairs(deltas) do
        if d.kind == "error" then
            self.finished = true
            out[#out + 1] = { nil, _M.error_body(d.message) }
            return out
        elseif d.kind == "reasoning" then
            thought[#thought + 1] = d.text
        elseif d.kind == "text" then
            text[#text + 1] = d.text
        elseif d.kind == "call" then
            self.calls[#self.calls + 1] = { id = d.id, name = d.name, pieces = {} }
            flush_calls(false)
        elseif d.kind == "arguments" and #self.calls > 0 then
            local pieces = self.calls[#self.calls].pieces
            pieces[#pieces + 1] = d.text
        elseif d.kind == "finish" then
            if #text > 0 or #thought > 0 then
                out[#out + 1] = { nil, self:object(concat(text), #thought > 0 and concat(thought) or nil, nil, nil, nil, nil, take()) }
                text, thought = {}, {}
            end
            -- (a call the token limit cut is no call: its arguments are not an object)
            local last = self.calls[#self.calls]
            if last and not json_text.decode(concat(last.pieces)) then self.calls[#self.calls] = nil end
            flush_calls(true)
            self.finished = true
            out[#out + 1] = { nil, self:object("", nil, nil, d, nil, nil, take()) }
            return out
        end
    end
    if #text > 0 or #thought > 0 then
        out[#out + 1] = { nil, self:object(concat(text), #thought > 0 and concat(thought) or nil, nil, nil, nil, nil, take()) }
    end
    return out
end

-- ------------------------------------------------------------------ the model

-- The served model as /api/tags, /api/ps and /api/show describe it: info = { id, size (bytes
-- of its weights), created (seconds), weight_dtype, parameters (count), context, template (the
-- chat template's text, or nil), thinking (its template has a reasoning block), tools }.
local function details(info)
    local billions = info.parameters / 1e9
    return object({ { "parent_model", '""' }, { "format", '"safetensors"' }, { "family", '"tinyloop"' },
                    { "families", '["tinyloop"]' },
                    { "parameter_size", encode(billions >= 1 and ("%.1fB"):format(billions) or ("%.0fM"):format(info.parameters / 1e6)) },
                    { "quantization_level", encode(info.weight_dtype:upper()) } })
end

function _M.model_entry(info, running)
    local name = info.id .. ":latest"
    local members = { { "name", encode(name) }, { "model", encode(name) },
                      { "modified_at", encode(iso_time(info.created)) }, { "size", ("%d"):format(info.size) },
                      { "digest", '""' }, { "details", details(info) } }
    if running then
        members[#members + 1] = { "expires_at", '"9999-12-31T23:59:59Z"' } -- (the model stays loaded)
        members[#members + 1] = { "size_vram", "0" }
        members[#members + 1] = { "context_length", tostring(info.context) }
    end
    return object(members)
end

function _M.show(info)
    local capabilities = { '"completion"' }
    if info.tools then capabilities[#capabilities + 1] = '"tools"' end
    if info.thinking then capabilities[#capabilities + 1] = '"thinking"' end
    return object({ { "modelfile", '""' }, { "parameters", '""' }, { "template", encode(info.template or "") },
                    { "details", details(info) },
                    { "model_info", object({ { "general.architecture", '"tinyloop"' },
                                             { "general.parameter_count", ("%d"):format(info.parameters) },
                                             { "tinyloop.context_length", tostring(info.context) } }) },
                    { "capabilities", "[" .. concat(capabilities, ",") .. "]" },
                    { "modified_at", encode(iso_time(info.created)) } })
end

-- An embeddings answer (embed_request's request): {"model", "embeddings": [...], durations,
-- "prompt_eval_count"} (/api/embed), or {"embedding": [...]} (/api/embeddings). vectors: their
-- JSON texts joined by commas ("" for none); ms: the time taken.
function _M.embed_answer(req, vectors, tokens, ms)
    if req.older then return '{"embedding":' .. (vectors ~= "" and vectors or "[]") .. "}" end
    return '{"model":' .. encode(req.model_name) .. ',"embeddings":[' .. vectors .. '],"total_duration":' .. ns(ms) ..
        ',"load_duration":0,"prompt_eval_count":' .. tokens .. "}"
end

return _M

-- tinyloop.server.request: a POST body (/v1/completions, /v1/chat/completions, /tokenize,
-- /detokenize, /v1/embeddings) -> a validated request, or an error naming the field. Pure Lua (no ngx): the
-- busted suite can test it without nginx.
--
-- Only what the engine cannot see is checked here (JSON types, unknown fields, the prompt,
-- the context length); ranges of the decoding fields stay the engine's rule, and its error
-- message is mapped back to the request field it names (see param_of).
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local cjson = require "cjson.safe"
local grammar = require("tinyloop").grammar
local json_text = require "tinyloop.json_text"
local point = require("tinyloop.pause").point -- (long checks pause: tinyloop.pause)
local tools = require "tinyloop.tools"
local raised_message = require("tinyloop.raise").message
local reasoning = require "tinyloop.reasoning"
local add_stop_ids, decode_ordered = require("tinyloop.chat").add_stop_ids, require("tinyloop.chat").decode_ordered

local type, pairs, ipairs, tostring, next, floor = type, pairs, ipairs, tostring, next, math.floor
local json_null = cjson.null

local _M = {}

-- Every accepted field: its JSON kind, and the name of the tinyloop cfg field it sets
-- (false: used by the server itself). One table, so a new field is one line.
local FIELDS = {
    -- OpenAI completions
    model = { "string", false },
    prompt = { "prompt", false },
    max_tokens = { "integer", "max_tokens" },
    temperature = { "number", "temperature" },
    top_p = { "number", "top_p" },
    stop = { "stop", "stop_strings" },
    seed = { "integer", "sample_seed" },
    stream = { "boolean", false },
    stream_options = { "object", false }, -- {"include_usage": bool}, with stream only
    echo = { "boolean", false },
    logprobs = { "integer", false }, -- 0..20: each token's log-probability and this many alternatives
    n = { "integer", false },
    best_of = { "integer", false }, -- >= n: candidates a prompt, the n best returned (not streamed)
    user = { "string", false },
    response_format = { "object", false }, -- {"type": "text" | "json_object" | "json_schema", ...}
    presence_penalty = { "number", "presence_penalty" },   -- OpenAI's range, [-2, 2]
    frequency_penalty = { "number", "frequency_penalty" }, -- OpenAI's range, [-2, 2]
    logit_bias = { "object", false }, -- {"token id": bias in [-100, 100]}; converted below
    -- TinyLoop extensions
    loops = { "integer", "loops" },
    top_k = { "integer", "top_k" },          -- 0 or -1: every token (vLLM's convention)
    min_p = { "number", "min_p" },           -- vLLM's and llama.cpp's, in [0, 1]
    min_tokens = { "integer", "min_tokens" }, -- vLLM's, in [0, max_tokens]
    repetition_penalty = { "number", "repetition_penalty" },
    penalty_window = { "integer", "penalty_window" }, -- the last N tokens the penalties read; 0: all
    penalties_count_prompt = { "boolean", "penalties_count_prompt" }, -- presence/frequency: the prompt's too
    temperature_last = { "boolean", "temperature_last" }, -- llama.cpp's order: top_p and min_p cut at temperature 1
    ignore_eos = { "boolean", "ignore_eos" },
    cache_window = { "integer", "cache_window" },
    speculative = { "string", "speculative" },
    draft_loops = { "integer", "draft_loops" },
    draft_ahead = { "integer", "draft_ahead" },
    K_branches = { "integer", "K_branches" },
    max_nodes = { "integer", "max_nodes" },
    beam_size = { "integer", "beam_size" },
    length_penalty = { "number", "length_penalty" },
    early_exit_patience = { "integer", "early_exit_patience" },
    early_exit_min_L = { "integer", "early_exit_min_L" },
    early_exit_peek_every = { "integer", "early_exit_peek_every" },
    early_exit_logit_margin = { "number", "early_exit_logit_margin" },
    early_exit_threshold = { "number", "early_exit_threshold" },
    -- "hidden_state", "latent_diff", "kl", "entropy_diff", "argmax" or "gate" (checked by
    -- tinyloop's config builder) and the thresholds of the criteria that have their own
    early_exit_criterion = { "string", "early_exit_criterion" },
    early_exit_kl_threshold = { "number", "early_exit_kl_threshold" },
    early_exit_entropy_threshold = { "number", "early_exit_entropy_threshold" },
    early_exit_gate_threshold = { "number", "early_exit_gate_threshold" },
    grammar = { "string", false }, -- GBNF text; compiled below into cfg.grammar
    -- vLLM's structured outputs: {"json": schema, "choice": [...], "grammar": GBNF, "json_object":
    -- true}, and its older fields of the same (guided_json, guided_choice, guided_grammar)
    structured_outputs = { "object", false },
    guided_json = { "schema", false },
    guided_choice = { "array", false },
    guided_grammar = { "string", false },
    guided_regex = { "string", false },
    json_schema = { "object", false }, -- llama.cpp's: a JSON Schema the output follows (its own field)
    stop_token_ids = { "array", false }, -- vLLM's: token ids that end the generation (kept in it)
    include_stop_str_in_output = { "boolean", false }, -- vLLM's: the stop string stays in the text
    skip_special_tokens = { "boolean", false }, -- vLLM's: false puts special tokens' text in the output
}
_M.FIELDS = FIELDS

-- POST /v1/chat/completions: the same fields, except that `messages` replaces `prompt`, and
-- echo and best_of (completions only) are not OpenAI's chat fields; logprobs is a boolean,
-- with top_logprobs alternatives; max_completion_tokens is OpenAI's newer max_tokens.
local CHAT_FIELDS = {}
for k, v in pairs(FIELDS) do CHAT_FIELDS[k] = v end
CHAT_FIELDS.prompt, CHAT_FIELDS.echo, CHAT_FIELDS.best_of = nil, nil, nil
CHAT_FIELDS.messages = { "messages", false }
CHAT_FIELDS.logprobs = { "boolean", false }
CHAT_FIELDS.top_logprobs = { "integer", false } -- 0..20 alternatives, with logprobs: true
CHAT_FIELDS.max_completion_tokens = { "integer", false }
CHAT_FIELDS.tools = { "array", false }               -- function tools (tinyloop.tools)
CHAT_FIELDS.tool_choice = { "tool_choice", false }   -- "none" | "auto" | "required" | {"type": "function", ...}
CHAT_FIELDS.parallel_tool_calls = { "boolean", false }
CHAT_FIELDS.add_generation_prompt = { "boolean", false }  -- vLLM's: the assistant's turn opened (default true)
CHAT_FIELDS.continue_final_message = { "boolean", false } -- vLLM's: the reply continues the final message
CHAT_FIELDS.chat_template_kwargs = { "object", false }    -- vLLM's: more variables for the template
CHAT_FIELDS.include_reasoning = { "boolean", false }      -- vLLM's: false leaves a thinking model's reasoning out
CHAT_FIELDS.reasoning_effort = { "string", false }        -- OpenAI's: a template variable (gpt-oss's templates read it)
CHAT_FIELDS.thinking_budget = { "integer", false }        -- TinyLoop's: a thinking model's reasoning block holds at
                                                          -- most this many tokens (then </think> is written for it)
_M.CHAT_FIELDS = CHAT_FIELDS

local DEFAULT_MAX_TOKENS = 16 -- OpenAI's default for completions
local MAX_LOGPROBS = tonumber(require("tinyloop").C.TL_MAX_TOP_LOGPROBS) -- the engine's most alternatives
-- Stop strings a request may give: OpenAI's limit is 4, but vLLM and llama.cpp set none, and
-- clients (Continue's autocompletion) send more; Anthropic and Ollama set none either. One
-- limit for every front end (shapes.MAX_STOPS).
local MAX_STOPS = 64
_M.MAX_STOPS = MAX_STOPS

-- An error answer: HTTP status, message, param (the request field, or nil), code (OpenAI's
-- machine-readable one, or nil).
local function bad(message, param, status, code)
    return nil, { status = status or 400, message = message, param = param, type = "invalid_request_error", code = code }
end
-- A request that does not fit the context: OpenAI's code and the opening of its message, which
-- clients (LiteLLM's context-window fallbacks) look for; with the prompt's tokens and the
-- context's (n_prompt_tokens, n_ctx: llama.cpp's fields, which its view writes).
local function too_long(max_seq_len, detail, param, prompt_tokens)
    local _, err = bad(("This model's maximum context length is %d tokens. However, %s"):format(max_seq_len, detail), param, 400,
                       "context_length_exceeded")
    err.n_prompt_tokens, err.n_ctx = prompt_tokens, max_seq_len
    return nil, err
end
_M.bad = bad

-- An integer seed in the engine's range, [0, 2^53): read modulo 2^53 (-1 is 2^53 - 1), the
-- one rule for a request's seed and its choices' seed + 1, seed + 2, ... (plus: added
-- without passing 2^53, where two integers are one double: (2^53 - 1) + 2 was 2^53 + 1,
-- rounded to 2^53, and so 0, choice 1's seed as well).
function _M.seed_in_range(v, plus)
    v = v % 2 ^ 53
    plus = plus or 0
    return v >= 2 ^ 53 - plus and v - 2 ^ 53 + plus or v + plus
end

-- A request's seed, which OpenAI's and vLLM's APIs take as any 64-bit integer, in the engine's
-- range (seed_in_range); nil where v is no such integer. One past 2^53 arrives as the nearest
-- double, the same one each time: 2^64 - 1 as 2^64.
function _M.request_seed(v)
    if type(v) == "number" and v == floor(v) and v >= -2 ^ 63 and v <= 2 ^ 64 then return _M.seed_in_range(v) end
    return nil
end

local function is_integer(v)
    return type(v) == "number" and v == floor(v) and v > -2 ^ 53 and v < 2 ^ 53
end
_M.is_integer = is_integer

local KIND_CHECK = {
    string = function(v) return type(v) == "string" end,
    number = function(v) return type(v) == "number" and v == v end,
    integer = is_integer,
    boolean = function(v) return type(v) == "boolean" end,
    object = function(v) return type(v) == "table" end, -- an array is refused where it is read
    array = function(v) return type(v) == "table" end,  -- an object likewise
    tool_choice = function(v) return type(v) == "string" or type(v) == "table" end, -- tinyloop.tools checks it
    schema = function(v) return type(v) == "string" or type(v) == "table" end,      -- a JSON Schema or its JSON text
}
local KIND_WORDS = { string = "a string", number = "a number", integer = "an integer", boolean = "a boolean", object = "an object",
                     array = "an array", tool_choice = 'a string or an object {"type": "function", ...}',
                     schema = "a JSON Schema (an object, or its JSON text)", stop = "a string or an array of strings" }
-- How the text of an empty value of a kind opens (KIND_CHECK takes {} and [] alike).
local EMPTY_OPENS = { object = "{", array = "[", stop = "[" }

-- A number as a C float holds it: at most half a float's smallest magnitude (1.4e-45) from 0
-- is 0 (rounding to even), as llama.cpp and Ollama read their float32s and the engine's config
-- would (the Lua binding refuses such a value, which would change silently): a top_p of 1e-46
-- is 0, the likeliest token. Every reading of a request's number goes through it.
local FLOAT_ZERO = 2 ^ -150
local function as_float(v) return (v >= -FLOAT_ZERO and v <= FLOAT_ZERO) and 0 or v end

-- llama.cpp's samplers this engine does not have, taken where their values turn them off (its
-- ranges: front ends send their neutral values), with what "off" is, for the message.
local LLAMACPP_OFF = {
    typical_p = { function(v) return v >= 1 end, ">= 1" }, tfs_z = { function(v) return v >= 1 end, ">= 1" },
    mirostat = { function(v) return v == 0 end, "0" }, dry_multiplier = { function(v) return as_float(v) <= 0 end, "<= 0" },
    xtc_probability = { function(v) return as_float(v) <= 0 end, "<= 0" },
    top_n_sigma = { function(v) return as_float(v) <= 0 end, "<= 0" },
    dynatemp_range = { function(v) return as_float(v) <= 0 end, "<= 0" },
}
-- llama.cpp's fields that change nothing here, whatever their value: its prompt cache (the
-- prefix pool's work), slots, timings and progress reports, the samplers' order, the context
-- shift's kept tokens, and the settings of samplers that are off (LLAMACPP_OFF).
local LLAMACPP_NO_OPS = { "cache_prompt", "id_slot", "timings_per_token", "return_progress", "samplers", "n_keep",
                       "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
                       "xtc_threshold", "dynatemp_exponent", "mirostat_tau", "mirostat_eta", "min_keep" }
_M.LLAMACPP_OFF = LLAMACPP_OFF
-- repeat_penalty as Ollama and llama.cpp take it: they pass it on unchecked, and 0 comes from
-- clients, LiteLLM sending OpenAI's frequency_penalty = 0 ("none") as Ollama's
-- repeat_penalty. Read as no penalty, 1: the engine refuses 0, and llama.cpp's sampler divided
-- a repeated token's logit by it.
function _M.repeat_penalty(v) return as_float(v) == 0 and 1 or v end
-- llama.cpp's names of fields its own /v1/completions and /v1/chat/completions take besides
-- OpenAI's (its web UI sends repeat_penalty and repeat_last_n there, scripts n_predict), read
-- as /completion reads them (decode_fields): {its name, the field it is here}.
local LLAMACPP_NAMES = { { "n_predict", "max_tokens" }, { "repeat_penalty", "repetition_penalty" },
                         { "repeat_last_n", "penalty_window" } }

-- Fields that TinyLoop does not implement, which clients send at their defaults (the SDKs
-- null): OpenAI's completions' and vLLM's; the value that changes nothing is accepted, any
-- other refused, naming the field. (suffix is for insertion models.)
local OPENAI_NO_OPS = {
    suffix = { function(v) return v == "" end, '""' },
    -- vLLM's older guided_* fields' companion: this server has one backend, whatever its name
    guided_decoding_backend = { function(v) return type(v) == "string" end, "a backend's name" },
}
-- The chat API's, likewise: storing the output at OpenAI, its service tier.
local CHAT_NO_OPS = {
    -- (nothing is stored here: true is taken as clients' SDK defaults send it, and changes nothing)
    store = { function(v) return type(v) == "boolean" end, "true or false" },
    -- OpenAI's cache routing key, abuse-tracking id and GPT-5's answer length: nothing to route,
    -- track or shorten here
    prompt_cache_key = { function(v) return type(v) == "string" end, "a string" },
    safety_identifier = { function(v) return type(v) == "string" end, "a string" },
    verbosity = { function(v) return v == "low" or v == "medium" or v == "high" end, '"low", "medium" or "high"' },
    metadata = { function(v) return type(v) == "table" end, "an object (kept only where stored)" },
    service_tier = { function(v) return v == "auto" or v == "default" end, '"auto" or "default"' },
    guided_decoding_backend = OPENAI_NO_OPS.guided_decoding_backend,
    -- how long OpenAI keeps a prompt's cache, and its caching mode: the prefix pool here keeps
    -- what its budget holds, whatever they say
    -- ("in-memory": the spelling of the Agents SDK's types and of openai-python's before its fix)
    prompt_cache_retention = { function(v) return v == "in_memory" or v == "in-memory" or v == "24h" end,
                               '"in_memory" or "24h"' },
    prompt_cache_options = { function(v) return type(v) == "table" end, "an object" },
    -- OpenAI's Predicted Outputs: a guess of the reply that only makes OpenAI's answer faster;
    -- the output is the model's either way
    prediction = { function(v) return type(v) == "table" end, 'an object {"type": "content", "content"}' },
}
-- (llama.cpp's, which its own OpenAI endpoints take: its clients send them there too)
for _, no_ops in ipairs({ OPENAI_NO_OPS, CHAT_NO_OPS }) do
    for _, name in ipairs(LLAMACPP_NO_OPS) do no_ops[name] = { function() return true end, "any value" } end
    for name, off in pairs(LLAMACPP_OFF) do
        no_ops[name] = { function(v) return type(v) == "number" and off[1](v) end, off[2] .. ", which turns it off" }
    end
end

-- OpenAI's documented ranges of its sampling adjustments (the engine takes any finite value).
local MAX_PENALTY, MAX_BIAS, MAX_TEMPERATURE = 2, 100, 2

-- The request field an engine error message is about: the longest field or cfg name in it.
local function param_of(message)
    local best, best_len, best_at = nil, 0, math.huge
    for field, spec in pairs(FIELDS) do
        for _, name in ipairs({ field, spec[2] or field }) do
            -- as a whole word: "n" must not match inside "something"; of two as long, the
            -- first in the message ("loops = 0 ... the model's default", not "model")
            local at = message:find("%f[%w_]" .. name .. "%f[^%w_]")
            if at and (#name > best_len or (#name == best_len and at < best_at)) then
                best, best_len, best_at = field, #name, at
            end
        end
    end
    if not best and message:find("verify_loops", 1, true) then best = "loops" end
    return best
end
_M.param_of = param_of

-- The engine's refusal of a request's config in the request's words -> message, param: the
-- config fields a request names otherwise (the engine's reasoning_budget is the chat
-- request's thinking_budget, which another API's view renames again: Anthropic's
-- thinking.budget_tokens), else the message as it is and the field param_of finds.
local ENGINE_WORDS = { { "reasoning_budget", "thinking_budget" } }
function _M.engine_message(message)
    for _, w in ipairs(ENGINE_WORDS) do
        if message:find(w[1], 1, true) then return (message:gsub(w[1], w[2])), w[2] end
    end
    return message, param_of(message)
end

-- Text as valid UTF-8 (tinyloop.utf8.repair: every answer passes it)
local valid_utf8 = require("tinyloop.utf8").repair
_M.valid_utf8 = valid_utf8

-- How a prompt's text becomes token ids: model:encode here by default; the server sets an
-- encoder that runs long texts in nginx's thread pool (set_encoder). encoder(model, text[,
-- opts]) -> ids | nil, err (opts: model:encode's, parse_special). _M.encode_text: the one in
-- use, for the server's other texts to encode (llama.cpp's mixed prompts and biases).
local function encode_here(model, text, opts) return model:encode(text, opts) end
local encode_text = encode_here
function _M.set_encoder(encoder) encode_text = encoder or encode_here end
-- The checkpoint's ends of generation besides its eos (chat:turn_end_ids: generation_config.json's
-- eos_token_id list, tokenizer_config.json's eos_token), where vLLM and llama.cpp stop a
-- completion too (the server sets them once the model is loaded; ignore_eos ignores them).
local end_ids
function _M.set_end_ids(ids) end_ids = ids end
function _M.encode_text(model, text, opts) return encode_text(model, text, opts) end

-- Token ids of one prompt: a string (encoded with the model's tokenizer) or an array of ids;
-- `at` names it in messages ("prompt", or "prompt[1]" in a batch), `field` (default
-- "prompt") is the request field it is.
local function prompt_ids(model, prompt, at, field)
    field = field or "prompt"
    if type(prompt) == "string" then
        if prompt == "" then return bad(at .. " must not be empty", field) end
        if not model.has_tokenizer then
            return bad(("this model has no tokenizer: send %s as an array of token ids"):format(field), field)
        end
        local ids, err = encode_text(model, prompt)
        if not ids then return nil, { status = 500, message = "encoding the prompt failed: " .. tostring(err), type = "server_error" } end
        return ids
    end
    if type(prompt) ~= "table" then return bad(at .. " must be a string or an array of token ids", field) end
    local n = #prompt
    for k in pairs(prompt) do -- (an object is no array, before it reads as an empty one)
        point()
        if not is_integer(k) or k < 1 or k > n then
            return bad(at .. " must be a string or an array of token ids", field)
        end
    end
    -- ({} decodes as [] does: the words fit either)
    if n == 0 then return bad(at .. " must not be empty (a string or an array of token ids)", field) end
    local vocab = model.vocab_size
    for i = 1, n do
        point()
        local id = prompt[i]
        if not is_integer(id) then
            return bad(("%s[%d] must be an integer token id"):format(at, i - 1), field)
        end
        if id < 0 or id >= vocab then
            return bad(("%s[%d] = %d is not a token id: ids are in [0, %d)"):format(at, i - 1, id, vocab), field)
        end
    end
    return prompt
end

-- The answer where the chat template did not load (the server's fault: 500).
function _M.template_unloaded(chat_error)
    return { status = 500, message = "the chat template failed to load: " .. tostring(chat_error), type = "server_error" }
end

-- The text of token ids for a client (model:decode); an id the tokenizer has no text for (a
-- vocabulary padded past the tokenizer's) is the request's error, naming `field`.
local function decode_ids(model, ids, field)
    local ok, text, err = pcall(model.decode, model, ids)
    if not ok then return bad(raised_message(text), field) end
    if not text then return nil, { status = 500, message = "decoding failed: " .. tostring(err), type = "server_error" } end
    return text
end

-- Whether a request's prompt is OpenAI's batch: an array of strings or of id arrays, mixed as
-- well (else one prompt: a string or one id array).
local function is_batch(prompt)
    return type(prompt) == "table" and (type(prompt[1]) == "string" or type(prompt[1]) == "table")
end

-- The prompts of a request, as id lists: one prompt, or a batch (is_batch), each prompt of a
-- batch its own choices. `field`: the request field (default "prompt"; /v1/embeddings' "input").
local function prompt_list(model, prompt, field)
    field = field or "prompt"
    if not is_batch(prompt) then
        local ids, e = prompt_ids(model, prompt, field, field)
        if not ids then return nil, e end
        return { ids }
    end
    local n = #prompt
    for k in pairs(prompt) do
        if not is_integer(k) or k < 1 or k > n then return bad(field .. " must be a string or an array of token ids", field) end
    end
    local list = {}
    for i = 1, n do
        point()
        local item = prompt[i]
        if type(item) ~= "string" and type(item) ~= "table" then
            return bad(("%s[%d] must be a string or an array of token ids (in a batch)"):format(field, i - 1), field)
        end
        local ids, e = prompt_ids(model, item, ("%s[%d]"):format(field, i - 1), field)
        if not ids then return nil, e end
        list[i] = ids
    end
    return list
end

-- A field's [id, ...] (stop_token_ids, /detokenize's tokens) -> true when every one is a
-- token id, or an error naming the field.
local function check_token_ids(ids, vocab, P)
    if #ids == 0 and next(ids) ~= nil then return bad(P .. " must be an array of token ids", P) end
    for k in pairs(ids) do
        point()
        if not is_integer(k) or k < 1 or k > #ids then return bad(P .. " must be an array of token ids", P) end
    end
    for i, id in ipairs(ids) do
        point()
        if not is_integer(id) or id < 0 or id >= vocab then
            return bad(("%s[%d] = %s is not a token id: ids are in [0, %d)"):format(P, i - 1, cjson.encode(id) or tostring(id), vocab), P)
        end
    end
    return true
end

local function stop_strings(stop, max_stops)
    max_stops = max_stops or MAX_STOPS
    if type(stop) == "string" then stop = { stop } end
    if type(stop) ~= "table" then return bad("stop must be " .. KIND_WORDS.stop, "stop") end
    if #stop > max_stops then return bad(("stop has %d strings: at most %d"):format(#stop, max_stops), "stop") end
    for k, s in pairs(stop) do
        if not is_integer(k) or k < 1 or k > #stop or type(s) ~= "string" then
            return bad("stop must be " .. KIND_WORDS.stop, "stop")
        end
        if s == "" then return bad('stop must not hold an empty string ("")', "stop") end
        -- (the engine's stop strings are C strings: said here in the request's words, where
        -- the Lua config named its own field, 1-based)
        if s:find("%z") then return bad("stop must not hold a NUL character (\\u0000)", "stop") end
    end
    return stop
end

-- ------------------------------------------------------------------ grammars

-- The raw JSON text of a member, by key path (tinyloop.json_text: why raw text).
local raw_member = json_text.member
_M.raw_member = raw_member

-- logit_bias {"id": bias} -> the config's { [id] = bias }, or an error naming the field. The
-- ids' range is the engine's rule (its message names logit_bias).
local function logit_bias_of(v, body)
    local P = "logit_bias"
    if raw_member(body, { P }):sub(1, 1) ~= "{" then return bad("logit_bias must be an object of token id: bias", P) end
    local out = {}
    for k, b in pairs(v) do
        -- as written by a number's decimal digits: "05" would be a second key for token 5
        if type(k) ~= "string" or not k:match("^%d+$") or (#k > 1 and k:sub(1, 1) == "0") or #k > 10
            or tonumber(k) > 2147483647 then
            return bad(("logit_bias key '%s' must be a token id (a decimal integer, no leading zeros)"):format(tostring(k)), P)
        end
        if type(b) ~= "number" or not (b >= -MAX_BIAS and b <= MAX_BIAS) then
            return bad(("logit_bias['%s'] must be a number in [-%d, %d]"):format(k, MAX_BIAS, MAX_BIAS), P)
        end
        out[tonumber(k)] = b
    end
    return out
end

-- Compiled grammars by source, so that the clients that send the same grammar or schema
-- again (the usual case) do not pay its compilation on the event loop each time. Grammars
-- are immutable and shared safely by any number of sessions.
-- Bounded twice: at most CACHE_MAX grammars, and at most grammar_cache_bytes of memory held by
-- them. A grammar's tables and cached masks grow with the documents it meets (up to about
-- 200 MB each: tinyloop.h's tl_grammar_memory), so 64 busy grammars could hold gigabytes. The
-- least recently used go first, never the one in hand; a grammar that goes is trimmed (its
-- tables and masks freed at once: sessions still using it keep their own generation), since
-- the Lua collector does not see that memory and may keep the object for long.
local CACHE_MAX = 64
local cache_budget = 256 * 1048576
local cache, cached = {}, 0 -- source key -> { grammar, used = the lookup count when last used }
local lookups, evictions, cache_bytes = 0, 0, 0
local after_cache = setmetatable({}, { __mode = "k" }) -- (after_reasoning's, below: held with their grammar)

-- What g and its variants around a reasoning block hold (not the vocabulary tries, which every
-- grammar on the model shares).
local function held_bytes(g)
    local usage = g:memory()
    local bytes = usage and usage.own_bytes or 0
    for _, wrapped in pairs(after_cache[g] or {}) do
        if not rawequal(wrapped, g) then -- (a grammar that writes the block itself is its own variant)
            usage = wrapped:memory()
            bytes = bytes + (usage and usage.own_bytes or 0)
        end
    end
    return bytes
end

local function evict(key)
    local g = cache[key].grammar
    cache[key], cached, evictions = nil, cached - 1, evictions + 1
    g:trim()
    for _, wrapped in pairs(after_cache[g] or {}) do
        if not rawequal(wrapped, g) then wrapped:trim() end
    end
    after_cache[g] = nil
end

-- Evicts the least recently used grammars until the cache is within both bounds (keep stays).
local function bound(keep)
    local entries, total = {}, 0
    for key, entry in pairs(cache) do
        entry.bytes = held_bytes(entry.grammar)
        total = total + entry.bytes
        if key ~= keep then entries[#entries + 1] = key end
    end
    if cached > CACHE_MAX or total > cache_budget then
        table.sort(entries, function(a, b) return cache[a].used < cache[b].used end)
        for _, key in ipairs(entries) do
            if cached <= CACHE_MAX and total <= cache_budget then break end
            total = total - cache[key].bytes
            evict(key)
        end
    end
    cache_bytes = total
end

local function compiled(key, compile)
    lookups = lookups + 1
    local entry = cache[key]
    if not entry then
        local g, err = compile()
        if not g then return nil, err end
        entry = cache[key] -- (another request's, compiled while this one waited in the thread pool)
        if not entry then
            entry = { grammar = g }
            cache[key], cached = entry, cached + 1
        end
    end
    entry.used = lookups
    bound(key)
    return entry.grammar
end

-- The server's configure{ grammar_cache_mb }.
function _M.set_grammar_cache_budget(bytes) cache_budget = bytes end
-- For /metrics: the cached grammars, the bytes they held at the last lookup, and how many were
-- evicted so far.
function _M.grammar_cache_stats() return cached, cache_bytes, evictions end

-- How the text of a grammar, a regular expression or a JSON Schema becomes a grammar: here by
-- default (grammar.from_text); the server sets a compiler that runs in nginx's thread pool (a
-- schema of a few thousand properties took 100 ms, a stall of every connection of the worker
-- on the event loop). compiler(kind, text, free_whitespace, loose) -> grammar | nil, err.
local compile_text = grammar.from_text
function _M.set_text_compiler(compiler) compile_text = compiler or grammar.from_text end

local SCHEMA_KEYS = { schema = "object", name = "string", description = "string", strict = "boolean" }

-- The ways to constrain the output, of which a request takes one: this server's, OpenAI's,
-- vLLM's and vLLM's older ones.
local CONSTRAINTS = { "grammar", "response_format", "structured_outputs", "guided_json", "guided_choice", "guided_grammar",
                      "guided_regex", "json_schema" }
local MAX_CHOICES = 4096

-- P: the param an error names; `what`: the field in its message (a member of P, say).
local function gbnf_grammar(text, P, what)
    what = what or P
    if text == "" then return bad(what .. " must not be empty", P) end
    local g, err = compiled("gbnf:" .. text, function() return compile_text("gbnf", text) end)
    if not g then return bad(what .. " does not compile: " .. tostring(err), P) end
    return g, P
end

-- A thinking model's grammar around g (tinyloop.reasoning.grammar: opened, own), cached per
-- grammar object (after_cache, above: counted with g and trimmed with it).
function _M.after_reasoning(g, opened, own)
    local variants = after_cache[g]
    if not variants then
        variants = {}
        after_cache[g] = variants
    end
    local which = (opened and "opened" or "block") .. (own and ":own" or "")
    if variants[which] then return variants[which] end
    local wrapped, err = reasoning.grammar(g, opened, own)
    if not wrapped then return nil, err end
    variants[which] = wrapped
    return wrapped
end

-- The whole output matches a regular expression (vLLM's regex).
local function regex_grammar(pattern, P, what)
    what = what or P
    local g, err = compiled("regex:" .. pattern, function() return compile_text("regex", pattern) end)
    if not g then return bad(what .. " does not compile: " .. tostring(err), P) end
    return g, P
end

-- A JSON Schema given as an object (its text read from the body at `path`) or as JSON text;
-- free: blanks allowed between its tokens (vLLM's default, asked for here with
-- disable_any_whitespace false), else none (this server's default); loose: the keywords the
-- converter cannot enforce left out (OpenAI's strict: false), else refused.
local function schema_grammar(value, body, path, P, what, free, loose)
    what = what or P
    local text = type(value) == "string" and value or raw_member(body, path)
    if not text:match("^%s*{") then return bad(what .. " must be a JSON Schema object", P) end
    local whitespace = free and "free" or "compact"
    local g, err = compiled("schema:" .. whitespace .. (loose and ":loose:" or ":") .. text, function()
        return compile_text("json_schema", text, free, loose)
    end)
    if not g then return bad(what .. " does not compile: " .. tostring(err), P) end
    return g, P
end

-- The output is one of the strings (vLLM's choice).
local function choice_grammar(choices, body, path, P, what)
    what = what or P
    local raw = raw_member(body, path)
    if #choices == 0 or raw:sub(1, 1) ~= "[" then return bad(what .. " must be a non-empty array of strings", P) end
    for k, v in pairs(choices) do
        if type(k) ~= "number" or type(v) ~= "string" then return bad(what .. " must be a non-empty array of strings", P) end
    end
    if #choices > MAX_CHOICES then return bad(("%s has %d choices: at most %d"):format(what, #choices, MAX_CHOICES), P) end
    local g, err = compiled("choice:" .. raw, function()
        local literals = {}
        for i, s in ipairs(choices) do literals[i] = grammar.lit(s).text end
        return compile_text("gbnf", "root ::= " .. table.concat(literals, " | ") .. "\n")
    end)
    if not g then return bad(what .. " does not compile: " .. tostring(err), P) end
    return g, P
end

-- OpenAI's JSON mode and vLLM's json_object: a JSON object (the shipped JSON grammar, its
-- top level an object).
local function json_object(P)
    local g, err = compiled("shipped:json_object", grammar.json_object)
    if not g then return nil, { status = 500, message = "the shipped JSON grammar: " .. tostring(err), type = "server_error" } end
    return g, P
end

-- vLLM's structural_tag (xgrammar's triggered tags, its first form): {"type": "structural_tag",
-- "structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text until a trigger,
-- then a structure whose begin starts with it (its schema's JSON between begin and end), then
-- free text again. text: its JSON (the schemas' key order is the order they write keys in).
local MAX_STRUCTURES = 256
-- grammar.tags' message about its lists (Lua's indexes, from 1) with the request's names and
-- JSON's indexes (from 0).
local function json_indexes(err, tags_name, triggers_name)
    return (tostring(err):gsub("^tl_grammar_compile_tags: ", ""):gsub("^tinyloop.grammar.tags: ", "")
        :gsub("^(%a+)%[(%d+)%]", function(list, i) -- (the place named first: a quoted begin may hold "[5]")
            return (list == "tags" and tags_name or list == "triggers" and triggers_name or list) .. "[" .. (tonumber(i) - 1) .. "]"
        end))
end

-- The message for a structural tag's triggers (an array already) that are not all non-empty
-- strings without NUL (C reads them up to a NUL; a body's strings are valid UTF-8:
-- decode_object), or nil. at: the field's name.
local function trigger_error(triggers, at)
    for i, trigger in pairs(triggers) do
        if type(i) ~= "number" or type(trigger) ~= "string" or trigger == "" or trigger:find("\0", 1, true) then
            return ("%s.triggers[%s] must be a non-empty string (without NUL)"):format(at, tostring(type(i) == "number" and i - 1 or i))
        end
    end
end

-- xgrammar's newer form, {"type": "structural_tag", "format": {...}}: a format of one of the
-- kinds below (a whole output), or triggered_tags, whose tags hold one of them. -> grammar |
-- false (any_text: none) | nil, message (relative to `what`).
local CONTENT_KINDS = "json_schema, regex, grammar, const_string or any_text"
local function content_grammar(c, text, path, at, compact, tag_end)
    if type(c) ~= "table" then return nil, at .. " must be an object with a \"type\"" end
    local function only(...)
        local allowed = { type = true }
        for _, k in ipairs({ ... }) do allowed[k] = true end
        for k in ordered_pairs(c) do
            if not allowed[k] then return ("unknown field '%s' in %s"):format(tostring(k), at) end
        end
    end
    local kind, err = c.type
    if kind == "json_schema" then
        err = only("json_schema")
        local at_schema = { unpack(path) }
        at_schema[#at_schema + 1] = "json_schema"
        local schema = not err and json_text.member(text, at_schema)
        if err or not schema or not schema:match("^%s*{") then return nil, err or at .. ".json_schema must be a JSON Schema object" end
        local g, serr = compile_text("json_schema", schema, not compact)
        if not g then return nil, at .. ".json_schema does not compile: " .. tostring(serr) end
        return g
    elseif kind == "regex" then
        err = only("pattern")
        if err or type(c.pattern) ~= "string" then return nil, err or at .. ".pattern must be a string" end
        local g, rerr = compile_text("regex", c.pattern)
        if not g then return nil, at .. ".pattern does not compile: " .. tostring(rerr) end
        return g
    elseif kind == "grammar" then
        err = only("grammar")
        if err or type(c.grammar) ~= "string" or c.grammar == "" then return nil, err or at .. ".grammar must be GBNF text" end
        local g, gerr = compile_text("gbnf", c.grammar)
        if not g then return nil, at .. ".grammar does not compile: " .. tostring(gerr) end
        return g
    elseif kind == "const_string" then
        err = only("value")
        if err or type(c.value) ~= "string" or c.value == "" or c.value:find("\0", 1, true) then
            return nil, err or at .. ".value must be a non-empty string"
        end
        return compile_text("gbnf", "root ::= " .. grammar.lit(c.value).text .. "\n")
    elseif kind == "any_text" then
        err = only()
        if err then return nil, err end
        if tag_end == nil then return false end -- (the whole output: no constraint)
        -- inside a tag: any text up to its end (it may not hold the end)
        if tag_end == "" then return nil, at .. ": any_text needs the tag's end (it runs up to it)" end
        -- up to the first place the end appears, the end included (true: the tag's end is read
        -- here): text free of the end, then the end, let through "eee" for an end "ee" (a
        -- text ending in part of the end, the end after it)
        local empty = assert(compile_text("gbnf", 'root ::= ""\n'))
        return grammar.tags({ { begin = tag_end, content = empty, ends_text = true } }, { tag_end }, { at_least_one = true }),
            nil, true
    end
    return nil, ("%s.type %s is not supported here (%s, or triggered_tags at the top)"):format(at, cjson.encode(kind) or "?", CONTENT_KINDS)
end

local function format_grammar(f, text, compact)
    local at = "format"
    if type(f) ~= "table" then return nil, at .. " must be an object with a \"type\"" end
    if f.type ~= "triggered_tags" then return content_grammar(f, text, { "format" }, at, compact, nil) end
    for k in ordered_pairs(f) do
        if k ~= "type" and k ~= "triggers" and k ~= "tags" and k ~= "at_least_one" and k ~= "stop_after_first" then
            return nil, ("unknown field '%s' in %s"):format(tostring(k), at)
        end
    end
    for _, k in ipairs({ "at_least_one", "stop_after_first" }) do
        if f[k] ~= nil and type(f[k]) ~= "boolean" then return nil, ("%s.%s must be a boolean"):format(at, k) end
    end
    local triggers, tags = f.triggers, f.tags
    if type(triggers) ~= "table" or #triggers == 0 or json_text.member(text, { "format", "triggers" }):sub(1, 1) ~= "[" then
        return nil, at .. ".triggers must be a non-empty array of strings"
    end
    local terr = trigger_error(triggers, at)
    if terr then return nil, terr end
    if type(tags) ~= "table" or #tags == 0 or #tags > MAX_STRUCTURES or json_text.member(text, { "format", "tags" }):sub(1, 1) ~= "[" then
        return nil, ("%s.tags must be an array of 1 to %d tags"):format(at, MAX_STRUCTURES)
    end
    local out = {}
    for i, tag in ipairs(tags) do
        local tag_at = ("%s.tags[%d]"):format(at, i - 1)
        if type(tag) ~= "table" or (tag.type ~= nil and tag.type ~= "tag") or type(tag.begin) ~= "string" or
            type(tag["end"]) ~= "string" then
            return nil, tag_at .. ' must be {"type": "tag", "begin": string, "content": {...}, "end": string}'
        end
        for k in ordered_pairs(tag) do
            if k ~= "type" and k ~= "begin" and k ~= "content" and k ~= "end" then
                return nil, ("unknown field '%s' in %s"):format(tostring(k), tag_at)
            end
        end
        if tag.begin == "" or (tag.begin .. tag["end"]):find("\0", 1, true) then
            return nil, tag_at .. ": begin must be a non-empty string, begin and end valid UTF-8 without NUL"
        end
        local content, err, reads_end = content_grammar(tag.content, text, { "format", "tags", i, "content" },
                                                        tag_at .. ".content", compact, tag["end"])
        if not content then return nil, err or tag_at .. ".content: any_text needs an end" end
        out[i] = { begin = tag.begin, content = content, ["end"] = reads_end and "" or tag["end"],
                   ends_text = f.stop_after_first == true }
    end
    -- (xgrammar's at_least_one: the output begins with a tag, no text before it; the text
    -- before it was let through)
    local tagged, terr = grammar.tags(out, triggers, { tag_first = f.at_least_one == true })
    if not tagged then return nil, json_indexes(terr, "format.tags", "format.triggers") end
    return tagged
end

local function structural_tag_grammar(v, text, P, what, compact)
    if type(v) ~= "table" or not text:match("^%s*{") then return bad(what .. " must be an object", P) end
    if v.format ~= nil then
        for k in ordered_pairs(v) do
            if k ~= "type" and k ~= "format" then return bad(("unknown field '%s' in %s"):format(tostring(k), what), P) end
        end
        if v.type ~= "structural_tag" then return bad(what .. '.type must be "structural_tag"', P) end
        local g, err = compiled("structural_tag_format:" .. (compact and "compact:" or "free:") .. text, function()
            local g, err = format_grammar(v.format, text, compact)
            if g == false then return nil, "(none)" end -- (any_text: cached as no grammar below)
            return g, err
        end)
        if not g and err == "(none)" then return false, P end
        if not g then return bad(what .. ": " .. tostring(err), P) end
        return g, P
    end
    for k in ordered_pairs(v) do
        if k ~= "type" and k ~= "structures" and k ~= "triggers" then
            return bad(("unknown field '%s' in %s"):format(tostring(k), what), P)
        end
    end
    if v.type ~= "structural_tag" then return bad(what .. '.type must be "structural_tag"', P) end
    local structures, triggers = v.structures, v.triggers
    if type(structures) ~= "table" or #structures == 0 or json_text.member(text, { "structures" }):sub(1, 1) ~= "[" then
        return bad(what .. ".structures must be a non-empty array of {begin, schema, end}", P)
    end
    if #structures > MAX_STRUCTURES then return bad(("%s.structures has %d entries: at most %d"):format(what, #structures, MAX_STRUCTURES), P) end
    if type(triggers) ~= "table" or #triggers == 0 or json_text.member(text, { "triggers" }):sub(1, 1) ~= "[" then
        return bad(what .. ".triggers must be a non-empty array of strings", P)
    end
    local terr = trigger_error(triggers, what)
    if terr then return bad(terr, P) end
    local whitespace = compact and "compact" or "free"
    local g, err = compiled("structural_tag:" .. whitespace .. ":" .. text, function()
        local tags = {}
        for i, st in ipairs(structures) do
            local at = ("structures[%d]"):format(i - 1)
            if type(st) ~= "table" or type(st.begin) ~= "string" or type(st["end"]) ~= "string" or type(st.schema) ~= "table" then
                return nil, at .. " must be {begin: string, schema: object, end: string}"
            end
            for k in ordered_pairs(st) do
                if k ~= "begin" and k ~= "schema" and k ~= "end" then return nil, ("unknown field '%s' in %s"):format(tostring(k), at) end
            end
            if st.begin == "" then
                return nil, at .. ": begin must be a non-empty string and both valid UTF-8"
            end
            if (st.begin .. st["end"]):find("\0", 1, true) then return nil, at .. ": begin and end must not hold a NUL character" end
            local schema = json_text.member(text, { "structures", i, "schema" })
            if not schema or schema:sub(1, 1) ~= "{" then return nil, at .. ".schema must be a JSON Schema object" end
            local content, serr = compile_text("json_schema", schema, whitespace == "free")
            if not content then return nil, at .. ".schema does not compile: " .. tostring(serr) end
            tags[i] = { begin = st.begin, content = content, ["end"] = st["end"] }
        end
        local tagged, terr = grammar.tags(tags, triggers)
        if not tagged then return nil, json_indexes(terr, "structures", "triggers") end
        return tagged
    end)
    if not g then return bad(what .. ": " .. tostring(err), P) end
    return g, P
end

-- vLLM's structured_outputs object: one of json, regex, choice, grammar, json_object; its options
-- where they say what this server does (disable_any_whitespace: the json's blanks,
-- disable_fallback: there is no other backend to fall back on), others at their defaults.
local STRUCTURED_KEYS = { "json", "regex", "choice", "grammar", "json_object", "structural_tag" }
local STRUCTURED_KNOWN = {}
for _, k in ipairs(STRUCTURED_KEYS) do STRUCTURED_KNOWN[k] = true end
local STRUCTURED_OPTIONS = {
    disable_any_whitespace = function(v) return type(v) == "boolean" end,
    disable_fallback = function(v) return type(v) == "boolean" end,
    disable_additional_properties = function(v) return v == false end, -- (vLLM's default; a schema says its own)
    whitespace_pattern = function() return false end,
}
local function structured_grammar(so, body)
    local P = "structured_outputs"
    if raw_member(body, { P }):sub(1, 1) ~= "{" then return bad(P .. " must be an object", P) end
    for k, v in ordered_pairs(so) do
        local option = STRUCTURED_OPTIONS[k]
        if option then
            if v ~= json_null and not option(v) then
                return bad(("structured_outputs.%s = %s is not supported here"):format(k, cjson.encode(v) or "?"), P)
            end
        elseif not STRUCTURED_KNOWN[k] then
            return bad(("unknown field '%s' in structured_outputs (json, regex, choice, grammar, json_object or structural_tag)"):format(tostring(k)), P)
        end
    end
    local which
    for _, k in ipairs(STRUCTURED_KEYS) do
        if so[k] ~= nil and so[k] ~= json_null then
            if which then return bad(("structured_outputs takes one of json, regex, choice, grammar, json_object and structural_tag, not %s and %s")
                :format(which, k), P) end
            which = k
        end
    end
    local v, what = which and so[which], "structured_outputs." .. tostring(which)
    if which == "regex" then
        if type(v) ~= "string" then return bad(what .. " must be a string (a regular expression)", P) end
        return regex_grammar(v, P, what)
    end
    if which == "json" then
        if type(v) ~= "string" and type(v) ~= "table" then return bad(what .. " must be a JSON Schema", P) end
        return schema_grammar(v, body, { P, "json" }, P, what, so.disable_any_whitespace == false)
    end
    if which == "choice" then
        if type(v) ~= "table" then return bad(what .. " must be a non-empty array of strings", P) end
        return choice_grammar(v, body, { P, "choice" }, P, what)
    end
    if which == "grammar" then
        if type(v) ~= "string" then return bad(what .. " must be a string (GBNF)", P) end
        return gbnf_grammar(v, P, what)
    end
    if which == "json_object" then
        if v ~= true then return bad(what .. " must be true", P) end
        return json_object(P)
    end
    if which == "structural_tag" then -- (vLLM's is the JSON text of the object; an object is taken too)
        local text = type(v) == "string" and v or raw_member(body, { P, "structural_tag" })
        local decoded = type(v) == "string" and json_text.decode(v) or v -- (strict, as a body is read)
        -- (blanks between the schemas' tokens unless disable_any_whitespace, vLLM's default)
        return structural_tag_grammar(decoded, text, P, what, so.disable_any_whitespace == true)
    end
    return bad("structured_outputs needs one of json, regex, choice, grammar, json_object or structural_tag", P)
end

-- OpenAI's response_format -> grammar | false ({"type": "text"}: none), "response_format";
-- or nil, err.
local function response_format_grammar(rf, body)
    local P = "response_format"
    if raw_member(body, { P }):sub(1, 1) ~= "{" then return bad("response_format must be an object", P) end
    -- vLLM's structural_tag: its own fields, checked there
    if rf.type == "structural_tag" then return structural_tag_grammar(rf, raw_member(body, { P }), P, P) end
    for k in ordered_pairs(rf) do
        if k ~= "type" and k ~= "json_schema" and k ~= "schema" then
            return bad(("unknown field '%s' in response_format"):format(tostring(k)), P)
        end
    end
    local kind = rf.type
    if rf.schema ~= nil and kind ~= "json_object" then
        return bad('response_format.schema goes with type "json_object" (llama.cpp\'s form); type "json_schema" takes ' ..
                   '{"json_schema": {"name", "schema"}}', P)
    end
    if kind == "text" or kind == "json_object" then
        if rf.json_schema ~= nil then return bad("response_format.json_schema goes with type \"json_schema\"", P) end
        if kind == "text" then return false end
        -- (llama.cpp's JSON mode with a schema: {"type": "json_object", "schema": {...}}, read as
        -- its json_schema field, the keywords that cannot be enforced left out)
        if rf.schema ~= nil and rf.schema ~= json_null then
            return schema_grammar(rf.schema, body, { P, "schema" }, P, "response_format.schema", false, true)
        end
        return json_object(P)
    end
    if kind ~= "json_schema" then
        return bad('response_format.type must be "text", "json_object", "json_schema" or "structural_tag"', P)
    end
    local js = rf.json_schema
    if type(js) ~= "table" or raw_member(body, { P, "json_schema" }):sub(1, 1) ~= "{" then
        return bad('response_format.json_schema must be an object: {"name", "schema", "strict"}', P)
    end
    for k, v in ordered_pairs(js) do
        local want = SCHEMA_KEYS[k]
        if not want then return bad(("unknown field '%s' in response_format.json_schema"):format(tostring(k)), P) end
        if v ~= json_null and not KIND_CHECK[want](v) then
            return bad(("response_format.json_schema.%s must be %s"):format(k, KIND_WORDS[want]), P)
        end
    end
    local text = js.schema ~= nil and js.schema ~= json_null and raw_member(body, { P, "json_schema", "schema" })
    if not text or text:sub(1, 1) ~= "{" then
        return bad("response_format.json_schema.schema must be a JSON Schema object", P)
    end
    -- (OpenAI's rule, and vLLM's: a name is required, its characters those of an identifier)
    local name = js.name
    if type(name) ~= "string" or not name:match("^[%w_%-]+$") or #name > 64 then
        return bad("response_format.json_schema.name must be the schema's name: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'", P)
    end
    -- (OpenAI's strict defaults to false: what cannot be enforced is then left out, not refused)
    return schema_grammar(text, body, nil, P, "response_format.json_schema.schema", false, js.strict ~= true)
end

-- The grammar a request asks for (one of CONSTRAINTS): grammar | false (none), the field it
-- came from; or nil, err. response_format {"type": "text"} asks for none, and so goes with
-- any other.
local function constraint(t, body)
    local rf_grammar
    if t.response_format ~= nil then
        local err
        rf_grammar, err = response_format_grammar(t.response_format, body)
        if rf_grammar == nil then return nil, err end
    end
    local given
    for _, k in ipairs(CONSTRAINTS) do
        if t[k] ~= nil and not (k == "response_format" and rf_grammar == false) then
            if given then return bad(("%s and %s cannot be used together: send one of them"):format(given, k), k) end
            given = k
        end
    end
    if given == "response_format" then return rf_grammar, given end
    if given == "grammar" or given == "guided_grammar" then return gbnf_grammar(t[given], given) end
    if given == "guided_json" then return schema_grammar(t.guided_json, body, { given }, given) end
    if given == "guided_choice" then return choice_grammar(t.guided_choice, body, { given }, given) end
    if given == "guided_regex" then return regex_grammar(t.guided_regex, given) end
    -- (llama.cpp's own field: as its converter reads a schema, the keywords it cannot enforce left out)
    if given == "json_schema" then return schema_grammar(t.json_schema, body, { given }, given, nil, false, true) end
    if given == "structured_outputs" then return structured_grammar(t.structured_outputs, body) end
    return false
end

local DEFAULT_MAX_CHOICES = 16

-- The body as a table, its fields checked against `fields` (kinds; unknown ones refused,
-- `no_ops` accepted at their no-op values only, null meaning the default) -> t, cfg (the
-- tinyloop config fields set directly) | nil, err.
-- A request body that must be one JSON object -> the table | nil, err (every endpoint's rule).
local first_invalid = require("tinyloop.utf8").first_invalid
function _M.decode_object(body)
    if type(body) ~= "string" or body == "" then return bad("the request body must be a JSON object", nil) end
    -- (JSON is UTF-8 text, RFC 8259: stray bytes were tokenized as they came and echoed as
    -- U+FFFD, where an escaped lone surrogate was refused; llama.cpp and vLLM refuse both)
    local invalid = first_invalid(body)
    if invalid then
        return bad(("the request body is not valid UTF-8 (byte %d): JSON text is UTF-8"):format(invalid - 1), nil)
    end
    -- (strict JSON: cjson's default takes NaN, Infinity and hex numbers, which an answer that
    -- echoes a field would then write back as no JSON at all)
    local t, err = json_text.decode(body)
    if err then return bad("the request body is not valid JSON: " .. err, nil) end
    if type(t) ~= "table" or body:match("^%s*%[") then return bad("the request body must be a JSON object", nil) end
    return t
end

-- llama.cpp's sampler chain, its `samplers` (names, with its aliases, or a string of letters),
-- as far as this engine follows it: which of top_k, top_p, min_p and the penalties run (one not
-- listed does not: llama.cpp builds the chain from the list; a name it does not know is skipped,
-- as there), and whether the temperature comes after top_p and min_p (llama.cpp's default
-- chain, penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature: the engine's
-- temperature_last) or before them (before either: the engine cuts with both at one place). A
-- chain without the temperature keeps it, last (llama.cpp's would sample at 1 whatever the
-- request's). TinyLoop's temperature_last, where sent, says what samplers would: only one of them
-- is taken. -> true, listed ({name = true}, or nil: every one), last; or nil, err.
local SAMPLER_NAMES = { top_k = "top_k", ["top-k"] = "top_k", topk = "top_k", top_p = "top_p", ["top-p"] = "top_p",
                        topp = "top_p", nucleus = "top_p", min_p = "min_p", ["min-p"] = "min_p", minp = "min_p",
                        temperature = "temperature", temp = "temperature", penalties = "penalties" }
local SAMPLER_LETTERS = { k = "top_k", p = "top_p", m = "min_p", t = "temperature", e = "penalties" }
_M.CHAIN_SAMPLERS = { top_k = true, top_p = true, min_p = true, penalties = true } -- (those a chain may leave out)
function _M.sampler_chain(samplers, temperature_last)
    if samplers == nil or samplers == json_null then return true, nil, true end
    if temperature_last ~= nil and temperature_last ~= json_null then
        return bad("samplers orders the temperature as temperature_last does: send one of them", "samplers")
    end
    local order = {}
    if type(samplers) == "string" then
        for i = 1, #samplers do order[#order + 1] = SAMPLER_LETTERS[samplers:sub(i, i)] or false end
    elseif type(samplers) == "table" and require("tinyloop.chat").is_array(samplers) then
        for _, name in ipairs(samplers) do
            if type(name) ~= "string" then break end
            order[#order + 1] = SAMPLER_NAMES[name:lower()] or false -- (llama.cpp lowers them too)
        end
    end
    if #order == 0 or (type(samplers) == "table" and #order ~= #samplers) then
        return bad("samplers must be an array of sampler names or a string of their letters", "samplers")
    end
    local at = {}
    for i, name in ipairs(order) do
        if name and not at[name] then at[name] = i end
    end
    local last = true
    for _, cut in ipairs({ "top_p", "min_p" }) do
        if at.temperature and at[cut] and at[cut] > at.temperature then last = false end
    end
    local listed = {}
    for name in pairs(at) do listed[name] = true end
    return true, listed, last
end

-- llama.cpp's names in a request t of an OpenAI endpoint (LLAMACPP_NAMES), made the fields
-- they are, as llama.cpp's /completion reads them (tinyloop.server.llamacpp): n_predict is a
-- cap, the rest of the context at most, below 0 the rest of the context; repeat_penalty 0 is
-- none (_M.repeat_penalty); repeat_last_n is the window of the penalties, which then count the
-- prompt (llama.cpp's sampler is fed it), -1 the whole context, 0 turns them off, and left out
-- beside repeat_penalty it is llama.cpp's default, 64. -> true, whether max_tokens is a cap
-- (n_predict was sent) | nil, err: a field sent under both names, a bad value.
local function llamacpp_names(t, fields)
    local cap, penalty_sent, window_sent = false, false, t.penalty_window ~= nil and t.penalty_window ~= json_null
    for _, names in ipairs(LLAMACPP_NAMES) do
        local theirs, ours = names[1], names[2]
        local v = t[theirs]
        if v == json_null then t[theirs], v = nil, nil end
        if v ~= nil then
            if t[ours] ~= nil and t[ours] ~= json_null then
                return bad(("%s is llama.cpp's name of %s: send one of them"):format(theirs, ours), theirs)
            end
            t[theirs] = nil
            if theirs == "n_predict" then
                if not is_integer(v) then return bad("n_predict must be an integer", "n_predict") end
                if fields.max_completion_tokens and t.max_completion_tokens ~= nil and t.max_completion_tokens ~= json_null then
                    return bad("n_predict is llama.cpp's name of max_tokens, one setting with max_completion_tokens: " ..
                               "send one of them", "n_predict")
                end
                cap = true
                if v >= 0 then t.max_tokens = v end
            elseif theirs == "repeat_penalty" then
                if type(v) ~= "number" then return bad("repeat_penalty must be a number", "repeat_penalty") end
                t.repetition_penalty, penalty_sent = _M.repeat_penalty(v), true
            else
                local ok, window = require("tinyloop.server.shapes").penalty_window(v, "repeat_last_n", "repeat_last_n")
                if not ok then return nil, window end
                window_sent = true
                if window == "off" then
                    t.repetition_penalty, t.presence_penalty, t.frequency_penalty = nil, nil, nil
                else
                    t.penalty_window = tonumber(window)
                    if t.penalties_count_prompt == nil then t.penalties_count_prompt = true end
                end
            end
        end
    end
    if penalty_sent and not window_sent then
        t.penalty_window = require("tinyloop.server.shapes").REPEAT_LAST_N_DEFAULT
        if t.penalties_count_prompt == nil then t.penalties_count_prompt = true end
    end
    -- llama.cpp's samplers, as its own OpenAI endpoints read them (its web UI sends them there):
    -- the temperature's place, and the samplers it leaves out, off
    if t.samplers ~= nil and t.samplers ~= json_null then
        local ok, listed, last = _M.sampler_chain(t.samplers, t.temperature_last)
        if not ok then return nil, listed end
        t.temperature_last = last
        for name in pairs(_M.CHAIN_SAMPLERS) do
            if not listed[name] then
                if name == "penalties" then
                    t.repetition_penalty, t.presence_penalty, t.frequency_penalty = nil, nil, nil
                elseif name == "top_k" then
                    t.top_k = 0 -- (every token: left out, it is 50)
                else
                    t[name] = nil
                end
            end
        end
    end
    return true, cap
end

local function decode_fields(body, fields, no_ops)
    local t, err = _M.decode_object(body)
    if not t then return nil, err end
    local cap = false -- (llama.cpp's n_predict: max_tokens is a cap)
    if fields.repetition_penalty then -- (the generating endpoints': llama.cpp's names, as its own read them)
        local named, cap_or_err = llamacpp_names(t, fields)
        if not named then return nil, cap_or_err end
        cap = cap_or_err
    end
    local cfg = {}
    for k, v in ordered_pairs(t) do
        local spec = fields[k]
        local no_op = not spec and no_ops[k]
        if no_op then -- OpenAI's fields that TinyLoop lacks: their no-op value only
            if v ~= json_null and not no_op[1](v) then
                return bad(("%s is not supported (only %s, or null)"):format(k, no_op[2]), k)
            end
            spec, v = {}, json_null
        end
        if not spec then return bad(("unknown field '%s'"):format(tostring(k)), tostring(k)) end
        if v == json_null then
            t[k] = nil -- null means "the default", as in OpenAI's API
        else
            local kind, cfg_name = spec[1], spec[2]
            -- (a seed is read modulo 2^53, the engine's range: -1 is 2^53 - 1, the same run each time)
            if cfg_name == "sample_seed" then v = _M.request_seed(v) or v end
            local check = KIND_CHECK[kind]
            if check and not check(v) then return bad(("%s must be %s"):format(k, KIND_WORDS[kind]), k) end
            if kind == "number" and as_float(v) ~= v then v, t[k] = 0, 0 end
            -- (an empty object and an empty array decode alike: the text tells them apart;
            -- "stop": {} was taken as no stop strings)
            local opens = EMPTY_OPENS[kind]
            if opens and type(v) == "table" and next(v) == nil and raw_member(body, { k }):sub(1, 1) ~= opens then
                return bad(("%s must be %s"):format(k, KIND_WORDS[kind]), k)
            end
            if cfg_name then cfg[cfg_name] = v end
        end
    end
    return t, cfg, cap
end

-- The body's model, if it names one, is the one served here -> true | nil, err.
local function check_model(t, model_id)
    if t.model ~= nil and t.model ~= model_id then -- (OpenAI's code, which clients read)
        return bad(("model '%s' is not served here (GET /v1/models lists '%s')"):format(t.model, model_id), "model", 404,
                   "model_not_found")
    end
    return true
end

-- A body of one of the smaller endpoints (/tokenize, /detokenize, /v1/embeddings): its fields
-- checked (decode_fields, no no-ops but `no_ops`) and its model the one served -> t | nil, err.
local function endpoint_body(body, fields, model_id, no_ops)
    local t, e = decode_fields(body, fields, no_ops or {})
    if not t then return nil, e end
    local ok
    ok, e = check_model(t, model_id)
    if not ok then return nil, e end
    return t
end

-- The stop strings an answer's text is cut at (the config's, at its end: a chat's tool calls
-- may add one), none with include_stop_str_in_output.
local function answer_stops(t, cfg)
    return not t.include_stop_str_in_output and cfg.stop_strings or nil
end

-- What both APIs share, into cfg: model, n, the sampling adjustments, stream_options, the
-- grammar, stop strings. -> { n, include_usage, grammar_field } | nil, err.
local function shared_fields(t, body, model, model_id, cfg, opts)
    local ok, e = check_model(t, model_id)
    if not ok then return nil, e end
    if t.n ~= nil and t.n < 1 then return bad(("n = %d must be >= 1"):format(t.n), "n") end
    -- No seed: a random one when the request samples, as OpenAI and vLLM sample (the engine's
    -- default seed is fixed: every "regenerate" would give the same reply, and n choices the
    -- same n). A greedy request keeps the fixed seed: its tokens are the same either way. A
    -- looped model that starts from a seeded random state (Huginn) draws it as seed 0 does
    -- for every request without a seed (fixed_state_seed), so that they share the prefix pool.
    if cfg.sample_seed == nil and (cfg.temperature or 0) > 0.01 then
        cfg.sample_seed = require("tinyloop.server.shapes").random_seed()
        cfg.fixed_state_seed = true
    end
    -- OpenAI's temperature is in [0, 2] (its 400 for 3: "Expected a value <= 2"); past 2 the
    -- distribution nears uniform over the whole vocabulary, noise a client sent by mistake
    if t.temperature ~= nil and not opts.beyond_openai_ranges and t.temperature > MAX_TEMPERATURE then
        return bad(("temperature = %s must be in [0, %d]"):format(tostring(t.temperature), MAX_TEMPERATURE), "temperature")
    end
    for _, k in ipairs({ "presence_penalty", "frequency_penalty" }) do
        if t[k] ~= nil and not opts.beyond_openai_ranges and not (t[k] >= -MAX_PENALTY and t[k] <= MAX_PENALTY) then
            return bad(("%s = %s must be in [-%d, %d]"):format(k, tostring(t[k]), MAX_PENALTY, MAX_PENALTY), k)
        end
    end
    if t.logit_bias ~= nil then
        local bias, e = logit_bias_of(t.logit_bias, body)
        if not bias then return nil, e end
        cfg.logit_bias = bias
    end
    -- vLLM's convention (its clients send it): top_k 0 or -1 considers every token
    if t.top_k == 0 or t.top_k == -1 then cfg.top_k = model.vocab_size end
    if t.top_k and t.top_k < -1 then
        return bad(("top_k = %d must be at least 1, or 0 or -1 (every token)"):format(t.top_k), "top_k")
    end
    -- OpenAI's top_p is in [0, 1]; the engine's nucleus, in (0, 1] (SPEC), keeps the likeliest
    -- token alone as top_p nears 0: so does top_k 1, which 0 is here
    if t.top_p ~= nil and not (t.top_p >= 0 and t.top_p <= 1) then
        return bad(("top_p = %s must be in [0, 1]"):format(tostring(t.top_p)), "top_p")
    end
    if t.top_p == 0 then cfg.top_p, cfg.top_k = 1, 1 end
    local include_usage, continuous_usage = false, false
    if t.stream_options ~= nil then
        for k, v in ordered_pairs(t.stream_options) do
            -- (include_obfuscation, OpenAI's padding of each chunk against length side channels:
            -- none is added here, so either value is taken, as the Responses endpoint takes it;
            -- continuous_usage_stats, vLLM's: with include_usage, every chunk has its choice's
            -- usage so far, not null)
            if k ~= "include_usage" and k ~= "include_obfuscation" and k ~= "continuous_usage_stats" then
                return bad(("unknown field '%s' in stream_options"):format(tostring(k)), "stream_options")
            end
            if type(v) ~= "boolean" and v ~= json_null then
                return bad(("stream_options.%s must be a boolean"):format(tostring(k)), "stream_options")
            end
        end
        include_usage = t.stream_options.include_usage == true
        continuous_usage = include_usage and t.stream_options.continuous_usage_stats == true
        -- (its no-op value goes with any request: clients send it by default)
        if include_usage and t.stream ~= true then
            return bad("stream_options.include_usage is only allowed with stream: true", "stream_options")
        end
    end
    local g, grammar_field = constraint(t, body)
    if g == nil then return nil, grammar_field end
    if g then cfg.grammar = g end
    if t.stop ~= nil then
        local stops, e = stop_strings(t.stop, opts.max_stops)
        if not stops then return nil, e end
        if not model.has_tokenizer then return bad("stop strings need a tokenizer, which this model lacks", "stop") end
        cfg.stop_strings = stops
    end
    -- (sets: vLLM's stop_reason names the one that ended a choice; the client's own only, not
    -- the stop a tool choice adds later)
    local stop_names
    for _, stop in ipairs(cfg.stop_strings or {}) do
        stop_names = stop_names or {}
        stop_names[stop] = true
    end
    -- (vLLM's default, true, is the engine's: special tokens are control, not text; the token
    -- that ends generation keeps no text either way)
    if t.skip_special_tokens == false then cfg.keep_special_text = true end
    -- vLLM's clients send length_penalty with any request (it ranks beams only): taken, and
    -- dropped without a beam, where the Lua config refuses it (it would do nothing)
    if (cfg.beam_size or 0) < 2 then cfg.length_penalty = nil end
    local stop_ids
    if t.stop_token_ids ~= nil then
        local ok, e = check_token_ids(t.stop_token_ids, model.vocab_size, "stop_token_ids")
        if not ok then return nil, e end
        add_stop_ids(cfg, t.stop_token_ids)
        stop_ids = {}
        for _, id in ipairs(t.stop_token_ids) do stop_ids[id] = true end
    end
    return { n = t.n or 1, include_usage = include_usage, continuous_usage = continuous_usage, grammar_field = cfg.grammar and grammar_field or nil, stop_ids = stop_ids,
             stop_names = stop_names, include_stop = t.include_stop_str_in_output == true }
end

-- Choices of a request, at most max_choices (default 16): #prompts x best_of sessions.
local function check_choices(n_prompts, n, best, max_choices)
    max_choices = max_choices or DEFAULT_MAX_CHOICES
    if n_prompts * best <= max_choices then return true end
    local what = best > n and ("best_of = %d"):format(best) or ("n = %d"):format(n)
    local choices = n_prompts > 1 and ("%d prompts x %s is %d choices"):format(n_prompts, what, n_prompts * best) or what
    return bad(("%s: at most %d choices a request here"):format(choices, max_choices),
               n_prompts > 1 and "prompt" or best > n and "best_of" or "n")
end

-- min_tokens against the tokens a request may make (after the context's cap): with `room`
-- (llama.cpp's and Ollama's, where the limit is a cap), a min_tokens past it is the cap, as
-- front ends send it to every backend; elsewhere past a max_tokens the client left out (the
-- rest of the context), an error saying so (the engine's would name a max_tokens never sent).
local function fit_min_tokens(cfg, max_tokens, sent, opts, field)
    local least = cfg.min_tokens
    if type(least) ~= "number" or least <= max_tokens then return true end
    if opts.room then
        cfg.min_tokens = max_tokens
        return true
    end
    if sent then return true end -- (the engine's check names both, as sent)
    return bad(("min_tokens = %d is more than the %d tokens the context leaves after the prompt (%s left out)")
        :format(least, max_tokens, field), "min_tokens")
end

local function check_logprobs(k, field, cfg)
    if k < 0 or k > MAX_LOGPROBS then
        return bad(("%s = %d must be in [0, %d]"):format(field, k, MAX_LOGPROBS), field)
    end
    if (cfg.beam_size or 0) >= 2 then
        return bad(field .. " is not kept by beam search: not with beam_size", field)
    end
    return true
end

-- The room a truncated prompt leaves the reply: `wanted` (max_tokens, Ollama's num_predict),
-- else a quarter of the context; half at most. (Ollama shifts its context as the reply grows,
-- which this engine does not: a prompt cut only to fit left the reply a token.)
local function reply_room(wanted, context)
    return math.max(1, math.min(wanted and wanted > 0 and wanted or floor(context / 4), floor(context / 2)))
end

-- Ollama's runner's cut of a prompt over its room (truncate left true): its first `keep` tokens
-- (Ollama's num_keep, 4 unless options.num_keep says; a BOS token the model put first is one
-- more, as Ollama counts it; all but one where keep is past that), then its last, `limit` in
-- all. -> ids.
local function cut_middle(ids, keep, limit, model)
    local bos = model:info().bos_token_id
    if bos and bos >= 0 and ids[1] == bos then keep = keep + 1 end
    keep = math.max(0, math.min(keep, limit - 1)) -- (Ollama's min(numKeep, numCtx - 1): the last token stays)
    local out = {}
    for i = 1, keep do out[i] = ids[i] end
    for i = #ids - (limit - keep) + 1, #ids do out[#out + 1] = ids[i] end
    return out
end

-- parse(body, model, model_id[, max_choices]) -> request | nil, err. model: a tinyloop model
-- (vocab_size, max_seq_len, has_tokenizer, encode, decode). request = { prompts (id lists),
-- ids (the first), n, best_of (candidates a prompt, >= n), cfg, stream, include_usage, echo (the prompts' texts, or nil),
-- logprobs (alternatives per token, or nil), stops,
-- prompt_tokens (all prompts'), grammar_field } (grammar_field: "grammar" or
-- "response_format" when cfg.grammar is set). A request has #prompts * best_of sessions, at
-- most max_choices (default 16), and answers #prompts * n choices.
-- opts (optional): another API's rules (Ollama's): max_stops (its limit on stop strings),
-- room (max_tokens, or its absence, is a cap: the rest of the context at most),
-- beyond_openai_ranges (a temperature past OpenAI's 2, presence and frequency penalties past
-- its [-2, 2]: llama.cpp and Ollama take any), cut_middle (parse_chat's).
local function parse_completions(body, model, model_id, max_choices, opts)
    opts = opts or {}
    local t, cfg, cap = decode_fields(body, FIELDS, OPENAI_NO_OPS)
    if not t then return nil, cfg end
    if cap then opts = setmetatable({ room = true }, { __index = opts }) end
    if t.prompt == nil then return bad("prompt is required", "prompt") end
    local shared, err = shared_fields(t, body, model, model_id, cfg, opts)
    if not shared then return nil, err end
    if end_ids and not cfg.ignore_eos then add_stop_ids(cfg, end_ids) end -- (stop_reason null, as the model's eos)
    local n = shared.n
    local best = t.best_of or n
    if best < n then return bad(("best_of = %d must be >= n = %d"):format(best, n), "best_of") end
    if best > n then -- the candidates are ranked by their tokens' log-probabilities, once all are done
        if t.stream then return bad("best_of cannot be used with stream: the best are known only at the end", "best_of") end
        if (cfg.beam_size or 0) >= 2 then
            return bad("best_of ranks by log-probabilities, which beam search does not keep: not with beam_size", "best_of")
        end
    end
    -- (the choices counted before the prompts are read: 20,000 prompts were each encoded, then
    -- refused as too many)
    local ok, e = check_choices(is_batch(t.prompt) and #t.prompt or 1, n, best, max_choices)
    if not ok then return nil, e end
    local prompts
    prompts, e = prompt_list(model, t.prompt)
    if not prompts then return nil, e end
    local max_tokens = cfg.max_tokens or (opts.room and math.huge) or DEFAULT_MAX_TOKENS
    if max_tokens < 0 then return bad(("max_tokens = %d must be >= 0"):format(max_tokens), "max_tokens") end
    if opts.cut_middle then -- (Ollama's raw /api/generate: its runner's cut, as parse_chat's)
        local room = reply_room(cfg.max_tokens, model.max_seq_len)
        for i, ids in ipairs(prompts) do
            if #ids + room > model.max_seq_len then prompts[i] = cut_middle(ids, opts.cut_middle, model.max_seq_len - room, model) end
        end
    end
    -- (a prompt over the context alone, or with room (max_tokens a cap) one that leaves none:
    -- its error names the prompt, which no max_tokens would fit)
    local function prompt_fills(i, ids)
        return too_long(model.max_seq_len, ("the %s (%d tokens) fills it"):format(
            #prompts > 1 and ("prompt[%d]"):format(i - 1) or "prompt", #ids), "prompt", #ids)
    end
    if opts.room then -- (the rest of the context, which each prompt must leave: a batch's, its longest's)
        local longest = 0
        for i, ids in ipairs(prompts) do
            if #ids >= model.max_seq_len then return prompt_fills(i, ids) end
            longest = math.max(longest, #ids)
        end
        max_tokens = math.min(max_tokens, model.max_seq_len - longest)
    end
    cfg.max_tokens = max_tokens
    ok, e = fit_min_tokens(cfg, max_tokens, true, opts, "max_tokens") -- (left out: 16, OpenAI's default, as sent)
    if not ok then return nil, e end
    local prompt_tokens, echo = 0, nil
    for i, ids in ipairs(prompts) do
        if #ids > model.max_seq_len then return prompt_fills(i, ids) end
        if #ids + max_tokens > model.max_seq_len then
            return too_long(model.max_seq_len, ("you requested %d tokens: the %s (%d tokens) plus max_tokens (%d)"):format(
                #ids + max_tokens, #prompts > 1 and ("prompt[%d]"):format(i - 1) or "prompt", #ids, max_tokens), "max_tokens", #ids)
        end
        prompt_tokens = prompt_tokens + #ids
    end
    if t.logprobs ~= nil then
        ok, e = check_logprobs(t.logprobs, "logprobs", cfg)
        if not ok then return nil, e end
    end
    if t.echo then -- each choice's text begins with its prompt's, as OpenAI's echo
        if not model.has_tokenizer then return bad("echo needs a tokenizer, which this model lacks", "echo") end
        echo = {}
        for i, ids in ipairs(prompts) do
            local batch = type(t.prompt) == "table" and type(t.prompt[1]) ~= "number"
            local source = batch and t.prompt[i] or t.prompt
            local text = type(source) == "string" and source or nil -- a string as sent; ids decoded
            if not text then
                local e
                text, e = decode_ids(model, ids, "prompt")
                if not text then return nil, e end
            end
            echo[i] = text
        end
    end
    return { prompts = prompts, ids = prompts[1], n = n, best_of = best, cfg = cfg, stream = t.stream == true,
             include_usage = shared.include_usage, continuous_usage = shared.continuous_usage, echo = echo, logprobs = t.logprobs, stops = answer_stops(t, cfg),
             stop_strings = cfg.stop_strings, stop_names = shared.stop_names, stop_ids = shared.stop_ids,
             include_stop = shared.include_stop,
             prompt_tokens = prompt_tokens, grammar_field = shared.grammar_field }
end

-- A chat request's tools (tinyloop.tools.prepare) -> spec (false when it has none, or
-- tool_choice is "none"), the tools as the template reads them (nil when there are none); or
-- nil, err. A choice that must call (tool_choice "required" or a named function) generates under
-- the grammar of the calls it may make; "auto" without parallel_tool_calls stops at the end
-- of the first call.
-- How a message names a forced tool_choice.
local function forced_choice(spec) return spec.choice == "function" and "naming a function" or '"required"' end

local function tools_fields(t, body, cfg, shared)
    local tools_json = t.tools ~= nil and raw_member(body, { "tools" }) or nil
    local spec, shown, param = tools.prepare(t.tools, t.tool_choice, t.parallel_tool_calls, tools_json)
    if spec == nil then return bad(shown, param) end
    if not spec then return false, shown end
    spec.json = tools_json -- (its grammar's cache key: tools_grammar)
    if spec.forced then
        local which = forced_choice(spec)
        if cfg.grammar then
            return bad(("tool_choice %s constrains the output to tool calls: not with %s"):format(which, shared.grammar_field),
                       shared.grammar_field)
        end
        -- Stop strings do not apply: the reply is tool calls only, whole by the grammar, which
        -- a stop string would cut (Anthropic takes stop_sequences beside a forced tool, as
        -- clients that send their stops with every request expect; they were refused).
        cfg.stop_strings = nil
    else -- "auto": free text, and a call the model opens is made whole and valid
        -- (a request's own grammar constrains the reply instead; else the lazy grammar: its
        -- calls, whole by the grammar, can be streamed as they come)
        spec.lazy = not cfg.grammar
        -- Without parallel_tool_calls the reply ends with its first call: the lazy grammar
        -- ends there (it holds one call); under a request's own grammar, at the first end
        -- tag's text. (That stop string under the lazy grammar as well ended a call whose
        -- string argument holds the tag's text, "s = \"</tool_call>\"", inside the string: the
        -- call lost, half of it sent as content.)
        if not spec.parallel and not spec.lazy then
            local stops = cfg.stop_strings or {}
            stops[#stops + 1] = tools.END
            cfg.stop_strings = stops
        end
    end
    return spec, shown
end

-- The grammar of tools_fields' spec, compiled, into cfg.grammar (shared.grammar_field
-- "tools"); true, or nil, err. Once the request is known to fit (a refused one built and
-- cached a large schema's grammar for nothing), never for a request only counted. The GBNF
-- text is built where the server says (set_tools_text: its thread pool; the schemas' GBNF
-- and the rules' renaming are seconds of work for a large one), and compiled there too.
local tools_text = nil -- (nil: tools.grammar_text here)
function _M.set_tools_text(builder) tools_text = builder end
local function tools_grammar(spec, cfg, shared)
    if not spec.forced and not spec.lazy then return true end
    local key = spec.forced and ("tools:%s:%s:%s"):format(spec.name or spec.choice, tostring(spec.parallel), spec.json)
        or ("tools-auto:%s:%s"):format(tostring(spec.parallel), spec.json)
    local build = spec.forced and tools.grammar or tools.lazy_grammar
    local g, gerr = compiled(key, function() return build(spec, compile_text, tools_text) end)
    if not g then return bad(gerr, "tools") end
    cfg.grammar, shared.grammar_field = g, "tools"
    return true
end

local REASONING_EFFORTS = { none = true, minimal = true, low = true, medium = true, high = true, xhigh = true, max = true }
_M.REASONING_EFFORTS = REASONING_EFFORTS

-- The prompt text of a body's messages (chat: tinyloop.chat; template_tools: the tools the
-- template shows), with vLLM's add_generation_prompt (default true), continue_final_message
-- (the reply continues the final message: a begun answer) and chat_template_kwargs (more
-- variables; objects inside them keep the body's key order) -> text | nil, err; with `model`,
-- -> ids, text (chat:prompt_ids: special tokens' texts in what the client sent are text).
local function render_messages(t, body, chat, template_tools, model)
    if t.continue_final_message and t.add_generation_prompt then
        return bad("continue_final_message continues the final message: it opens no new turn, so add_generation_prompt " ..
                   "must be false (or left out)", "add_generation_prompt")
    end
    local variables, raw
    local P = "chat_template_kwargs"
    if t.chat_template_kwargs ~= nil then
        raw = raw_member(body, { P })
        if raw:sub(1, 1) ~= "{" then return bad(P .. " must be an object of template variables", P) end
    end
    -- OpenAI's reasoning_effort is the template variable of that name (as the Responses API's
    -- reasoning.effort), unless chat_template_kwargs sets it
    if t.reasoning_effort ~= nil and not (raw and t.chat_template_kwargs.reasoning_effort ~= nil) then
        if not REASONING_EFFORTS[t.reasoning_effort] then
            return bad('reasoning_effort must be "none", "minimal", "low", "medium", "high", "xhigh" or "max"', "reasoning_effort")
        end
        local inner = raw and raw:match("^%s*{%s*(.-)%s*}%s*$") or ""
        raw = '{"reasoning_effort":' .. cjson.encode(t.reasoning_effort) .. (inner ~= "" and ("," .. inner) or "") .. "}"
    end
    if raw then
        local derr
        variables, derr = decode_ordered(raw)
        if not variables then return bad(P .. ": " .. tostring(derr), P) end
    end
    local add_generation_prompt = not t.continue_final_message and t.add_generation_prompt ~= false
    local ids, text, err, fault
    if model then
        ids, text, fault = chat:prompt_ids(model, t.messages, add_generation_prompt, template_tools, t.continue_final_message,
                                           variables, function(s, opts) return encode_text(model, s, opts) end)
        if ids then return ids, text end
        err = text
    else
        text, err, fault = chat:prompt(t.messages, add_generation_prompt, template_tools, t.continue_final_message, variables)
        if text then return text end
    end
    -- the server's template that cannot run is the server's fault, not the request's
    if fault == "template" then return nil, { status = 500, message = err, type = "server_error" } end
    if fault == "encode" then
        return nil, { status = 500, message = "encoding the prompt failed: " .. tostring(err), type = "server_error" }
    end
    return bad(err, fault == "variables" and "chat_template_kwargs" or "messages")
end

-- Ollama's truncation (its chatPrompt, with truncate left true): the oldest messages left out,
-- whole, until the rest fits within `limit` tokens; the system messages among them kept, first,
-- in their order; a tool's answer never without the assistant turn that called it; the last
-- message always kept. A start the template refuses (some raise "roles must alternate" for a
-- conversation that opens with the assistant's turn; Ollama's Go templates raise nothing) is
-- passed over for the next. Leaving out more never lengthens the prompt, so the first start
-- that fits is found by halving (log2 of the messages renders, where Ollama renders each start
-- in turn). render(messages) -> ids, text | nil, err.
-- -> ids, text of the messages kept; nil where no start fits (the caller's error says so).
local function drop_oldest_messages(messages, render, limit)
    local function block_start(i) -- (a tool's answer: from the assistant turn that called it)
        if messages[i].role ~= "tool" then return i end
        local first = i
        while first > 1 and messages[first - 1].role == "tool" do first = first - 1 end
        local caller = messages[first - 1]
        if caller and caller.role == "assistant" and type(caller.tool_calls) == "table" and #caller.tool_calls > 0 then
            return first - 1
        end
        return i
    end
    local function from(i) -- the first start from i the template takes: its ids and text, or nil
        for start = block_start(i), #messages do
            if block_start(start) == start then -- (a tool's answer is no start of its own)
                local kept = {}
                for j = 1, start - 1 do
                    if messages[j].role == "system" then kept[#kept + 1] = messages[j] end
                end
                for j = start, #messages do kept[#kept + 1] = messages[j] end
                local ids, text = render(kept)
                if ids then return ids, text end
            end
        end
        return nil
    end
    local low, high, fit_ids, fit_text = 2, #messages, nil, nil
    while low <= high do
        local middle = floor((low + high) / 2)
        local ids, text = from(middle)
        if not ids then
            high = middle - 1 -- (no start from there renders: none later does)
        elseif #ids <= limit then
            fit_ids, fit_text, high = ids, text, middle - 1
        else
            low = middle + 1
        end
    end
    return fit_ids, fit_text
end

-- An error of a request that sent llama.cpp's names (LLAMACPP_NAMES) names them as sent, not
-- the fields they became (its param and message).
local function as_sent(body, req, err)
    if req or type(err) ~= "table" then return req, err end
    for _, names in ipairs(LLAMACPP_NAMES) do
        local theirs, ours = names[1], names[2]
        local found, raw = pcall(raw_member, body, { theirs })
        local _, also = pcall(raw_member, body, { ours }) -- (both sent: the message names both)
        -- (only an error about the field itself: others quote the client's own names, a schema's
        -- property, a grammar's rule)
        if found and raw and raw ~= "null" and (also == nil or also == "null") and err.param == ours then
            err.param = theirs
            if type(err.message) == "string" then err.message = err.message:gsub("%f[%w_]" .. ours .. "%f[^%w_]", theirs) end
        end
    end
    return req, err
end
_M.as_sent = as_sent
function _M.parse(body, ...) return as_sent(body, parse_completions(body, ...)) end

-- parse_chat(body, model, model_id, max_choices, chat) -> request | nil, err: a POST
-- /v1/chat/completions body, its messages rendered by `chat` (tinyloop.chat: the model's
-- template) into the one prompt, generation stopping at chat.turn_ends (ids, if set) as well;
-- the request has parse's shape (best_of = n, no echo).
-- max_tokens (or max_completion_tokens) defaults to the rest of the context, OpenAI's rule
-- for chat.
-- opts (optional): max_stops (another API's limit on stop strings; default OpenAI's 4),
-- counting (the prompt is only counted: -> { prompt_tokens }, whatever room it leaves), room
-- (max_tokens is a cap: the rest of the context at most, Ollama's num_predict), drop_oldest
-- (a conversation that leaves the reply too little room loses its oldest messages, Ollama's
-- truncate), cut_middle (a prompt that does loses its middle but its first cut_middle tokens,
-- Ollama's /api/generate; parse takes it too).
local function parse_chat(body, model, model_id, max_choices, chat, opts)
    opts = opts or {}
    local t, cfg, cap = decode_fields(body, CHAT_FIELDS, CHAT_NO_OPS)
    if not t then return nil, cfg end
    if cap then opts = setmetatable({ room = true }, { __index = opts }) end
    if t.messages == nil then return bad("messages is required", "messages") end
    -- (clients that serve old and new models send both, at one value: lighteval through LiteLLM)
    if t.max_tokens ~= nil and t.max_completion_tokens ~= nil and t.max_tokens ~= t.max_completion_tokens then
        return bad("max_tokens and max_completion_tokens are one setting: send one of them, or both at one value",
                   "max_completion_tokens")
    end
    local shared, err = shared_fields(t, body, model, model_id, cfg, opts)
    if not shared then return nil, err end
    if not model.has_tokenizer then return bad("chat needs a tokenizer, which this model lacks: use /v1/completions with token ids", "messages") end
    -- (a thinking model's block around the calls' grammar: the server's, once the prompt is known)
    local tool_spec, template_tools = tools_fields(t, body, cfg, shared)
    if tool_spec == nil then return nil, template_tools end
    if tool_spec and tool_spec.forced and t.continue_final_message then
        return bad("tool_choice " .. forced_choice(tool_spec) ..
                   " writes tool calls from the reply's start: not with continue_final_message", "tool_choice")
    end
    local ids, text = render_messages(t, body, chat, template_tools, model)
    if not ids then return nil, text end
    local room = reply_room(t.max_completion_tokens or cfg.max_tokens, model.max_seq_len)
    if opts.drop_oldest and #ids + room > model.max_seq_len and #t.messages > 1 then
        local function kept_within(limit)
            return drop_oldest_messages(t.messages, function(kept)
                return render_messages(setmetatable({ messages = kept }, { __index = t }), body, chat, template_tools, model)
            end, limit)
        end
        local kept_ids, kept_text = kept_within(model.max_seq_len - room)
        -- (none leaves that room: what fits the context at all, over the context, as Ollama keeps)
        if not kept_ids and #ids >= model.max_seq_len then kept_ids, kept_text = kept_within(model.max_seq_len - 1) end
        if kept_ids then ids, text = kept_ids, kept_text end -- (else the whole conversation's error)
    end
    -- (Ollama's /api/generate: the prompt's middle, template and all, as its runner cuts it)
    if opts.cut_middle and #ids + room > model.max_seq_len then ids = cut_middle(ids, opts.cut_middle, model.max_seq_len - room, model) end
    if text == "" then return bad("the chat template rendered these messages as an empty prompt", "messages") end
    if opts.counting then return { prompt_tokens = #ids } end
    local ok, e
    ok, e = check_choices(1, shared.n, shared.n, max_choices)
    if not ok then return nil, e end
    local field = t.max_completion_tokens ~= nil and "max_completion_tokens" or "max_tokens"
    local max_tokens = t.max_completion_tokens or cfg.max_tokens
    if max_tokens and max_tokens < 0 then return bad(("%s = %d must be >= 0"):format(field, max_tokens), field) end
    -- ("the text made of the messages": read as well where another API's names replace
    -- "messages", Responses' input, Ollama's prompt)
    if #ids >= model.max_seq_len then
        return too_long(model.max_seq_len, ("the text made of the messages and the chat template (%d tokens) fills it"):format(#ids),
                        "messages", #ids)
    end
    local sent = max_tokens ~= nil
    max_tokens = max_tokens or model.max_seq_len - #ids
    if opts.room then max_tokens = math.min(max_tokens, model.max_seq_len - #ids) end
    if #ids + max_tokens > model.max_seq_len then
        return too_long(model.max_seq_len, ("you requested %d tokens: the text made of the messages and the chat template (%d tokens) plus %s (%d)")
            :format(#ids + max_tokens, #ids, field, max_tokens), field, #ids)
    end
    cfg.max_tokens = max_tokens
    ok, e = fit_min_tokens(cfg, max_tokens, sent, opts, field)
    if not ok then return nil, e end
    if tool_spec then
        ok, e = tools_grammar(tool_spec, cfg, shared)
        if not ok then return nil, e end
    end
    if t.thinking_budget ~= nil and (t.thinking_budget < 1 or t.thinking_budget > 2147483647) then
        return bad(("thinking_budget = %.0f must be in [1, 2147483647] (leave it out for no budget)"):format(t.thinking_budget),
                   "thinking_budget")
    end
    -- the template's own turn ends (chat.turn_ends: tinyloop.chat's turn_end_ids) stop it too,
    -- unless ignore_eos (vLLM's: the checkpoint's other ends are ignored with its eos)
    if chat.turn_ends and not cfg.ignore_eos then add_stop_ids(cfg, chat.turn_ends) end
    local logprobs
    if t.top_logprobs ~= nil and not t.logprobs then
        return bad("top_logprobs needs logprobs: true", "top_logprobs")
    end
    if t.logprobs then
        logprobs = t.top_logprobs or 0
        ok, e = check_logprobs(logprobs, t.top_logprobs and "top_logprobs" or "logprobs", cfg)
        if not ok then return nil, e end
    end
    return { prompts = { ids }, ids = ids, n = shared.n, best_of = shared.n, cfg = cfg, stream = t.stream == true, max_tokens_field = field,
             include_usage = shared.include_usage, continuous_usage = shared.continuous_usage, logprobs = logprobs, prompt_tokens = #ids, stops = answer_stops(t, cfg),
             stop_strings = cfg.stop_strings, stop_names = shared.stop_names, stop_ids = shared.stop_ids,
             include_stop = shared.include_stop,
             grammar_field = shared.grammar_field, prompt_text = text, tools = tool_spec or nil,
             include_reasoning = t.include_reasoning ~= false, thinking_budget = t.thinking_budget }
end

-- ------------------------------------------------------------------ /tokenize, /detokenize

-- vLLM's endpoints, for clients that count a prompt's tokens against the context first.
local TOKENIZE_FIELDS = {
    model = { "string", false },
    prompt = { "string", false },           -- a text, encoded as /v1/completions encodes it
    -- or a conversation, rendered as /v1/chat/completions renders it, with these
    messages = CHAT_FIELDS.messages, add_generation_prompt = CHAT_FIELDS.add_generation_prompt,
    continue_final_message = CHAT_FIELDS.continue_final_message, chat_template_kwargs = CHAT_FIELDS.chat_template_kwargs,
    tools = CHAT_FIELDS.tools,
    return_token_strs = { "boolean", false }, -- each token's text as well
    -- llama.cpp's form: content (a text) -> {"tokens": ids}, or with_pieces [{"id", "piece"}]
    content = { "string", false }, with_pieces = { "boolean", false }, add_special = { "boolean", false },
    parse_special = { "boolean", false }, -- (true by default, as llama.cpp's: false reads a special token's text as text)
}
-- vLLM's add_special_tokens, which its clients send: TinyLoop adds no special tokens around a
-- text (no tokenizer post-processor), on /v1/completions as here, so either value is the truth.
local TOKENIZE_NO_OPS = { add_special_tokens = { function(v) return type(v) == "boolean" end, "true or false" } }
local DETOKENIZE_FIELDS = { model = { "string", false }, tokens = { "array", false } }

function _M.parse_chat(body, ...) return as_sent(body, parse_chat(body, ...)) end

-- A request's conversation (messages, with tools, add_generation_prompt, continue_final_message
-- and chat_template_kwargs) rendered as /v1/chat/completions renders it -> text | nil, err;
-- with `model`, its ids and text (render_messages).
local function conversation_text(t, body, chat, chat_error, model)
    if not chat then return nil, _M.template_unloaded(chat_error) end
    local shown, param
    if t.tools ~= nil then
        local spec
        spec, shown, param = tools.prepare(t.tools, nil, nil, raw_member(body, { "tools" }))
        if spec == nil then return bad(shown, param) end
    end
    return render_messages(t, body, chat, shown, model)
end

-- parse_apply_template(body, chat, chat_error) -> { prompt } | nil, err: POST
-- /apply-template (llama.cpp's), a chat request's conversation rendered, not run. As llama.cpp
-- reads it, the chat fields it does not use (model, sampling, stream, ...) are taken and change
-- nothing.
local APPLY_TEMPLATE_FIELDS = { "messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools" }
function _M.parse_apply_template(body, chat, chat_error)
    local t, err = _M.decode_object(body)
    if not t then return nil, err end
    local used = {}
    for _, k in ipairs(APPLY_TEMPLATE_FIELDS) do
        local v = t[k]
        if v ~= nil and v ~= json_null then
            local kind = TOKENIZE_FIELDS[k][1]
            if KIND_CHECK[kind] and not KIND_CHECK[kind](v) then return bad(("%s must be %s"):format(k, KIND_WORDS[kind]), k) end
            used[k] = v
        end
    end
    if used.messages == nil then return bad("messages is required", "messages") end
    -- (llama.cpp's prefill: a final assistant message is a begun reply, continued, unless the
    -- request says how to end the conversation; it was closed as a finished turn)
    if used.add_generation_prompt == nil and used.continue_final_message == nil and type(used.messages) == "table" then
        local prefill = {}
        require("tinyloop.server.shapes").continue_prefill(prefill, used.messages)
        if #prefill > 0 then used.continue_final_message, used.add_generation_prompt = true, false end
    end
    local text, e = conversation_text(used, body, chat, chat_error)
    if not text then return nil, e end
    return { prompt = text }
end

-- parse_tokenize(body, model, model_id, chat, chat_error) -> { ids, token_strs } | nil, err:
-- the ids a POST /tokenize body's prompt or messages become on the completions endpoints
-- (chat: as parse_chat's; nil when the chat template failed to load, chat_error saying why:
-- a 500 for messages only).
function _M.parse_tokenize(body, model, model_id, chat, chat_error)
    local t, e = endpoint_body(body, TOKENIZE_FIELDS, model_id, TOKENIZE_NO_OPS)
    if not t then return nil, e end
    if t.content ~= nil then -- (llama.cpp's /tokenize: no special token is added, either way add_special says)
        for _, k in ipairs({ "prompt", "messages", "return_token_strs" }) do
            if t[k] ~= nil then return bad(k .. " is vLLM's form, content llama.cpp's: send one of them", k) end
        end
        if not model.has_tokenizer then return bad("this model has no tokenizer: it reads token ids only", "content") end
        local ids, err = encode_text(model, t.content, t.parse_special == false and { parse_special = false } or nil)
        if not ids then return nil, { status = 500, message = "encoding failed: " .. tostring(err), type = "server_error" } end
        return { ids = ids, llama = true, with_pieces = t.with_pieces == true }
    end
    for _, k in ipairs({ "with_pieces", "add_special", "parse_special" }) do
        if t[k] ~= nil then return bad(k .. " goes with content (llama.cpp's form)", k) end
    end
    if (t.prompt == nil) == (t.messages == nil) then
        return bad("send prompt (a text) or messages (a conversation): one of them", t.prompt and "messages" or "prompt")
    end
    local field = t.prompt and "prompt" or "messages"
    if not model.has_tokenizer then return bad("this model has no tokenizer: it reads token ids only", field) end
    if t.messages ~= nil then -- (as parse_chat encodes them; false too, which check_messages refuses)
        local ids, err = conversation_text(t, body, chat, chat_error, model)
        if not ids then return nil, err end
        return { ids = ids, token_strs = t.return_token_strs == true }
    end
    for _, k in ipairs({ "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools" }) do
        if t[k] ~= nil then return bad(k .. " goes with messages, not with prompt", k) end
    end
    local ids, err = encode_text(model, t.prompt)
    if not ids then return nil, { status = 500, message = "encoding failed: " .. tostring(err), type = "server_error" } end
    return { ids = ids, token_strs = t.return_token_strs == true }
end

-- parse_detokenize(body, model, model_id) -> { text } | nil, err: a POST /detokenize body,
-- its ids' text.
function _M.parse_detokenize(body, model, model_id)
    local t, e = endpoint_body(body, DETOKENIZE_FIELDS, model_id)
    if not t then return nil, e end
    local ok
    if t.tokens == nil then return bad("tokens is required", "tokens") end
    if raw_member(body, { "tokens" }):sub(1, 1) ~= "[" then return bad("tokens must be an array of token ids", "tokens") end
    if not model.has_tokenizer then return bad("this model has no tokenizer: it has no text for its ids", "tokens") end
    ok, e = check_token_ids(t.tokens, model.vocab_size, "tokens")
    if not ok then return nil, e end
    local text
    text, e = decode_ids(model, t.tokens, "tokens")
    if not text then return nil, e end
    return { text = text }
end

-- ------------------------------------------------------------------ embeddings

local EMBEDDINGS_FIELDS = {
    model = { "string", false },
    input = { "input", false },             -- a string, an array of ids, or an array of either
    encoding_format = { "string", false },  -- "float" (default) or "base64"
    dimensions = { "integer", false },      -- the model's d_model only (no shortening here)
    user = { "string", false },
    -- vLLM's: keep the last k tokens of a longer input (-1: the context's length)
    truncate_prompt_tokens = { "integer", false },
    -- TinyLoop extensions
    loops = { "integer", false },
    pooling = { "string", false },          -- "mean" (default) or "last"
    normalize = { "boolean", false },       -- true (default): unit length
}
-- The most inputs a request may embed: OpenAI's 2,048, fewer where the vectors are long (their
-- numbers, written as text, at most about 4 million: 50 MB).
function _M.max_embedding_inputs(d)
    return math.max(1, math.min(2048, floor(4194304 / d)))
end

local function slice(ids, from, to) -- (unpack would overflow the C stack on a long input)
    local part = {}
    for i = from, to do part[#part + 1] = ids[i] end
    return part
end

-- The inputs' id lists, each fitted to the context: over it, an error naming the input, or,
-- with keep_last k (vLLM's truncate_prompt_tokens) its last k tokens, with keep_first (Ollama's
-- truncate: true) its first max_seq_len, (Cohere's max_tokens_per_doc: k) its first k or as
-- many as the context holds; listed: the inputs came as an array of them, each named field[i]
-- in an error, even one alone. -> list | nil, err.
function _M.fit_inputs(list, model, field, keep_last, keep_first, listed)
    local limit = model.max_seq_len
    for i, ids in ipairs(list) do
        local n = #ids
        if keep_last and n > keep_last then
            list[i] = slice(ids, n - keep_last + 1, n)
        elseif keep_first and n > (keep_first == true and limit or math.min(keep_first, limit)) then
            list[i] = slice(ids, 1, keep_first == true and limit or math.min(keep_first, limit))
        elseif n > limit then
            local at = listed and ("%s[%d]"):format(field, i - 1) or field
            return bad(("%s has %d tokens, over this model's context of %d"):format(at, n, limit), field)
        end
    end
    return list
end

-- The embedding fields every embeddings-based request shares: vLLM's truncate_prompt_tokens
-- (-1: the context) and TinyLoop's loops and pooling -> { keep (nil: none), loops (left out:
-- the model's default), pooling } | nil, err.
local function embedding_options(t, model)
    local keep = t.truncate_prompt_tokens
    if keep ~= nil then
        if keep == -1 then keep = model.max_seq_len end
        if keep < 1 or keep > model.max_seq_len then
            return bad(("truncate_prompt_tokens must be -1 or in [1, %d]"):format(model.max_seq_len), "truncate_prompt_tokens")
        end
    end
    local pooling = t.pooling or "mean"
    if pooling ~= "mean" and pooling ~= "last" then return bad('pooling must be "mean" or "last"', "pooling") end
    local loops = t.loops
    if loops ~= nil and (loops < 1 or loops > model.max_loops) then
        return bad(("loops must be in [1, %d]"):format(model.max_loops), "loops")
    end
    return { keep = keep, loops = loops or model.default_loops, pooling = pooling }
end

-- parse_embeddings(body, model, model_id) -> { inputs (id lists), tokens (their total),
-- encoding ("float" | "base64"), loops, pooling, normalize } | nil, err: a POST
-- /v1/embeddings body (OpenAI's, with vLLM's truncate_prompt_tokens).
function _M.parse_embeddings(body, model, model_id)
    local t, e = endpoint_body(body, EMBEDDINGS_FIELDS, model_id)
    if not t then return nil, e end
    if t.input == nil then return bad("input is required", "input") end
    if type(t.input) == "table" and next(t.input) == nil then return bad("input must not be empty", "input") end
    local encoding = t.encoding_format or "float"
    if encoding ~= "float" and encoding ~= "base64" then
        return bad('encoding_format must be "float" or "base64"', "encoding_format")
    end
    local ok
    ok, e = _M.check_dimensions(model, t.dimensions)
    if not ok then return nil, e end
    local o
    o, e = embedding_options(t, model)
    if not o then return nil, e end
    local inputs, tokens = _M.embedding_inputs(model, t.input, "input", o.keep)
    if not inputs then return nil, tokens end
    return { inputs = inputs, tokens = tokens, encoding = encoding, loops = o.loops, pooling = o.pooling,
             normalize = t.normalize ~= false }
end

-- ------------------------------------------------------------------ rerank and score

-- The similarity endpoints read the model as an embedding model does (vLLM's rule for one):
-- a pair's score is the cosine of their embeddings.
local RERANK_FIELDS = { -- POST /v1/rerank (vLLM's, Jina's and Cohere's shape)
    model = { "string", false },
    query = { "string", false },
    documents = { "array", false },        -- texts, or {"text": ...} objects (Cohere's)
    texts = { "array", false },            -- the same, by TEI's and llama.cpp's name
    top_n = { "integer", false },          -- the best n (default, or 0 as vLLM reads it: every document)
    return_documents = { "boolean", false }, -- each result's {"text"} (default true)
    max_tokens_per_doc = { "integer", false }, -- Cohere's: each document's first k tokens
    truncate_prompt_tokens = { "integer", false },
    loops = { "integer", false },
    pooling = { "string", false },
    -- TEI's (its answer's shape goes with `texts`, as llama.cpp reads it): each result's text,
    -- a score before its sigmoid (a cosine has none: the same either way), and truncation of
    -- what is past the context, at its end (Right) or its start (Left)
    return_text = { "boolean", false },
    raw_scores = { "boolean", false },
    truncate = { "boolean", false },
    truncation_direction = { "string", false },
}
-- Cohere's fields of the chunking this server does not do (its SDKs send null): any value that
-- asks for no more than whole documents
local RERANK_NO_OPS = {
    max_chunks_per_doc = { function(v) return is_integer(v) and v >= 1 end, "an integer >= 1: documents are not chunked" },
    rank_fields = { function(v) return type(v) == "table" and #v == 1 and v[1] == "text" end, '["text"]' },
}
local SCORE_FIELDS = { -- POST /v1/score (vLLM's): text_1 against text_2, 1:1, 1:N or N:N
    model = { "string", false },
    text_1 = { "any", false },
    text_2 = { "any", false },
    truncate_prompt_tokens = { "integer", false },
    loops = { "integer", false },
    pooling = { "string", false },
}

-- v is a non-empty JSON array (a table keyed 1 .. #v, nothing else).
local function is_list(v)
    if type(v) ~= "table" or #v == 0 then return false end
    for k in pairs(v) do
        if not is_integer(k) or k < 1 or k > #v then return false end
    end
    return true
end

-- A field's texts: a text, or an array of them -> the list, whether it was a single text |
-- nil, err.
local function texts_of(v, field)
    if type(v) == "string" then return { v }, true end
    if not is_list(v) then return bad(field .. " must be a text or a non-empty array of texts", field) end
    for i, item in ipairs(v) do
        if type(item) ~= "string" then return bad(("%s[%d] must be a text"):format(field, i - 1), field) end
    end
    return v, false
end

-- parse_rerank(body, model, model_id) -> { inputs (the query's ids, then each document's),
-- names (each input's field, as errors name it), pairs (the query with each document), tokens,
-- texts (the documents'), top_n, return_documents, loops, pooling, tei (texts was sent: TEI's
-- answer), return_text } | nil, err.
function _M.parse_rerank(body, model, model_id)
    local t, e = endpoint_body(body, RERANK_FIELDS, model_id, RERANK_NO_OPS)
    if not t then return nil, e end
    local tei = t.texts ~= nil -- (Hugging Face TEI's and llama.cpp's name of the documents, and TEI's answer)
    if tei then
        if t.documents ~= nil then return bad("documents and texts are two names of one field: send one", "texts") end
        t.documents = t.texts
    end
    for _, k in ipairs({ "return_text", "raw_scores", "truncate", "truncation_direction" }) do
        if t[k] ~= nil and not tei then return bad(k .. " is TEI's: it goes with texts (not documents)", k) end
    end
    if t.truncation_direction ~= nil and t.truncation_direction ~= "Right" and t.truncation_direction ~= "Left" then
        return bad('truncation_direction must be "Right" or "Left"', "truncation_direction")
    end
    local query_first -- (the query's first tokens kept: TEI's truncate, Right, as the documents')
    if t.truncate then -- (TEI: a text past the context is cut, not refused; Left keeps its end)
        if t.truncate_prompt_tokens ~= nil or t.max_tokens_per_doc ~= nil then
            return bad("truncate is TEI's truncation: not with truncate_prompt_tokens or max_tokens_per_doc", "truncate")
        end
        if t.truncation_direction == "Left" then t.truncate_prompt_tokens = -1
        else t.max_tokens_per_doc, query_first = model.max_seq_len, model.max_seq_len end
    end
    if t.query == nil then return bad("query is required", "query") end
    -- (the field as the client named it: TEI's texts, else documents)
    local docs_field = tei and "texts" or "documents"
    if t.documents == nil then return bad(docs_field .. " is required", docs_field) end
    if not is_list(t.documents) then return bad(docs_field .. " must be a non-empty array", docs_field) end
    if not model.has_tokenizer then return bad("this model has no tokenizer: rerank reads texts", "query") end
    local most = _M.max_embedding_inputs(model.d_model) - 1
    if #t.documents > most then
        return bad(("%s has %d items: at most %d a request"):format(docs_field, #t.documents, most), docs_field)
    end
    local texts = {}
    for i, doc in ipairs(t.documents) do
        if type(doc) == "table" and type(doc.text) == "string" then doc = doc.text end
        if type(doc) ~= "string" then
            return bad(('%s[%d] must be a text or {"text": ...}'):format(docs_field, i - 1), docs_field)
        end
        texts[i] = doc
    end
    if t.max_tokens_per_doc ~= nil and t.max_tokens_per_doc < 1 then
        return bad("max_tokens_per_doc must be >= 1", "max_tokens_per_doc")
    end
    if t.max_tokens_per_doc ~= nil and t.truncate_prompt_tokens ~= nil then
        return bad("max_tokens_per_doc keeps a document's first tokens, truncate_prompt_tokens its last: send one",
                   "max_tokens_per_doc")
    end
    local top_n = (t.top_n or 0) > 0 and math.min(t.top_n, #texts) or #texts
    local o
    o, e = embedding_options(t, model)
    if not o then return nil, e end
    local query, query_tokens = _M.embedding_inputs(model, t.query, "query", o.keep, query_first)
    if not query then return nil, query_tokens end
    local docs, doc_tokens = _M.embedding_inputs(model, texts, docs_field, o.keep, t.max_tokens_per_doc)
    if not docs then return nil, doc_tokens end
    local inputs, names, pairs_ = { query[1] }, { "query" }, {}
    for i, ids in ipairs(docs) do
        inputs[i + 1], names[i + 1], pairs_[i] = ids, ("%s[%d]"):format(docs_field, i - 1), { 1, i + 1 }
    end
    return { inputs = inputs, names = names, pairs = pairs_, tokens = query_tokens + doc_tokens, texts = texts, top_n = top_n,
             return_documents = t.return_documents ~= false, loops = o.loops, pooling = o.pooling,
             tei = tei, return_text = t.return_text == true }
end

-- parse_score(body, model, model_id) -> { inputs (text_1's ids, then text_2's), names (each
-- input's field: text_1 where it is one text, else text_1[i]), tokens, pairs ({i, j}: inputs
-- i and j, 1-based, one a score in order), loops, pooling } | nil, err.
function _M.parse_score(body, model, model_id)
    local t, e = endpoint_body(body, SCORE_FIELDS, model_id)
    if not t then return nil, e end
    for _, field in ipairs({ "text_1", "text_2" }) do
        if t[field] == nil then return bad(field .. " is required", field) end
    end
    if not model.has_tokenizer then return bad("this model has no tokenizer: score reads texts", "text_1") end
    local first, second
    first, e = texts_of(t.text_1, "text_1")
    if not first then return nil, e end
    second, e = texts_of(t.text_2, "text_2")
    if not second then return nil, e end
    if #first > 1 and #first ~= #second then
        return bad(("text_1 has %d texts and text_2 %d: want 1:1, 1:N or N:N"):format(#first, #second), "text_2")
    end
    local most = _M.max_embedding_inputs(model.d_model)
    if #first + #second > most then
        -- (text_2 is the longer list, or as long: text_1 has one text or as many)
        return bad(("text_1 and text_2 have %d texts in all: at most %d a request"):format(#first + #second, most), "text_2")
    end
    local o
    o, e = embedding_options(t, model)
    if not o then return nil, e end
    local a, a_tokens = _M.embedding_inputs(model, t.text_1, "text_1", o.keep) -- (a single text is named as sent)
    if not a then return nil, a_tokens end
    local b, b_tokens = _M.embedding_inputs(model, t.text_2, "text_2", o.keep)
    if not b then return nil, b_tokens end
    local inputs, names, pairs_ = {}, {}, {}
    local function name(field, i) return type(t[field]) == "string" and field or ("%s[%d]"):format(field, i - 1) end
    for i, ids in ipairs(a) do inputs[i], names[i] = ids, name("text_1", i) end
    for j, ids in ipairs(b) do
        inputs[#a + j], names[#a + j] = ids, name("text_2", j)
        pairs_[j] = { #a == 1 and 1 or j, #a + j }
    end
    return { inputs = inputs, names = names, tokens = a_tokens + b_tokens, pairs = pairs_, loops = o.loops, pooling = o.pooling }
end

-- An OpenAI request's dimensions -> true where it is the model's (or none):
-- these embeddings cannot be shortened. | nil, err
function _M.check_dimensions(model, dimensions)
    if dimensions ~= nil and dimensions ~= model.d_model then
        return bad(("dimensions must be this model's %d (its embeddings cannot be shortened)"):format(model.d_model), "dimensions")
    end
    return true
end

-- embedding_inputs(model, input, field, keep_last, keep_first) -> the id lists of an embeddings
-- request's input (a text, ids, or a list of either: prompt_list's), counted before any is
-- encoded (a body of a million one-letter texts is refused at once) and fitted to the context
-- (fit_inputs), and their tokens in all | nil, err.
function _M.embedding_inputs(model, input, field, keep_last, keep_first)
    local most = _M.max_embedding_inputs(model.d_model)
    local listed = type(input) == "table" and type(input[1]) ~= "number" -- (texts or id lists, not one id list)
    if listed and #input > most then
        return bad(("%s has %d items: at most %d a request"):format(field, #input, most), field)
    end
    local inputs, e = prompt_list(model, input, field)
    if not inputs then return nil, e end
    inputs, e = _M.fit_inputs(inputs, model, field, keep_last, keep_first, listed)
    if not inputs then return nil, e end
    local tokens = 0
    for _, ids in ipairs(inputs) do tokens = tokens + #ids end
    return inputs, tokens
end

return _M

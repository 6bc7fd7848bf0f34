-- tinyloop.server.request: a POST /v1/completions body -> a validated request, or an error
-- naming the field. Pure Lua (no ngx): the busted suite can test it without nginx.
--
-- Only what the engine cannot see is checked here (JSON types, unknown fields, the prompt,
-- the context length); ranges of the decoding fields stay the engine's rule, and its error
-- message is mapped back to the request field it names (see param_of).
local cjson = require "cjson.safe"

local type, pairs, ipairs, tostring, floor = type, pairs, ipairs, tostring, math.floor
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
    n = { "integer", false },
    user = { "string", false },
    -- TinyLoop extensions
    loops = { "integer", "loops" },
    top_k = { "integer", "top_k" },
    repetition_penalty = { "number", "repetition_penalty" },
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
}
_M.FIELDS = FIELDS

local DEFAULT_MAX_TOKENS = 16 -- OpenAI's default for completions
local MAX_STOPS = 4          -- OpenAI's limit

-- An error answer: HTTP status, message, param (the request field, or nil).
local function bad(message, param, status)
    return nil, { status = status or 400, message = message, param = param, type = "invalid_request_error" }
end

local function is_integer(v)
    return type(v) == "number" and v == floor(v) and v > -2 ^ 53 and v < 2 ^ 53
end

local KIND_CHECK = {
    string = function(v) return type(v) == "string" end,
    number = function(v) return type(v) == "number" and v == v end,
    integer = is_integer,
    boolean = function(v) return type(v) == "boolean" end,
}
local KIND_WORDS = { string = "a string", number = "a number", integer = "an integer", boolean = "a boolean" }

-- The request field an engine error message is about: the longest field or cfg name in it.
local function param_of(message)
    local best, best_len = nil, 0
    for field, spec in pairs(FIELDS) do
        for _, name in ipairs({ field, spec[2] or field }) do
            -- as a whole word: "n" must not match inside "something"
            if #name > best_len and message:find("%f[%w_]" .. name .. "%f[^%w_]") then best, best_len = field, #name end
        end
    end
    if not best and message:find("verify_loops", 1, true) then best = "loops" end
    return best
end
_M.param_of = param_of

-- Token ids of the prompt: a string (encoded with the model's tokenizer) or an array of ids.
local function prompt_ids(model, prompt)
    if type(prompt) == "string" then
        if prompt == "" then return bad("prompt must not be empty", "prompt") end
        if not model.has_tokenizer then
            return bad("this model has no tokenizer: send prompt as an array of token ids", "prompt")
        end
        local ids, err = model:encode(prompt)
        if not ids then return nil, { status = 500, message = "encoding the prompt failed: " .. tostring(err), type = "server_error" } end
        return ids
    end
    if type(prompt) ~= "table" then return bad("prompt must be a string or an array of token ids", "prompt") end
    local n = #prompt
    if n == 0 then return bad("prompt must not be empty", "prompt") end
    local vocab = model.vocab_size
    for k in pairs(prompt) do
        if not is_integer(k) or k < 1 or k > n then
            return bad("prompt must be a string or an array of token ids", "prompt")
        end
    end
    for i = 1, n do
        local id = prompt[i]
        if not is_integer(id) then
            return bad(("prompt[%d] must be an integer token id"):format(i - 1), "prompt")
        end
        if id < 0 or id >= vocab then
            return bad(("prompt[%d] = %d is not a token id: ids are in [0, %d)"):format(i - 1, id, vocab), "prompt")
        end
    end
    return prompt
end

local function stop_strings(stop)
    if type(stop) == "string" then stop = { stop } end
    if type(stop) ~= "table" then return bad("stop must be a string or an array of strings", "stop") end
    if #stop > MAX_STOPS then return bad(("stop has %d strings: at most %d"):format(#stop, MAX_STOPS), "stop") end
    for k, s in pairs(stop) do
        if not is_integer(k) or k < 1 or k > #stop or type(s) ~= "string" then
            return bad("stop must be a string or an array of strings", "stop")
        end
        if s == "" then return bad("stop strings must not be empty", "stop") end
    end
    return stop
end

-- parse(body, model, model_id) -> request | nil, err. model: a tinyloop model (vocab_size,
-- max_seq_len, has_tokenizer, encode). request = { ids, cfg, stream, stops, prompt_tokens }.
function _M.parse(body, model, model_id)
    if type(body) ~= "string" or body == "" then return bad("the request body must be a JSON object", nil) end
    local t, err = cjson.decode(body)
    if err then return bad("the request body is not valid JSON: " .. err, nil) end
    if type(t) ~= "table" or body:match("^%s*%[") then return bad("the request body must be a JSON object", nil) end
    local cfg = {}
    for k, v in pairs(t) do
        local spec = FIELDS[k]
        if not spec then return bad(("unknown field '%s'"):format(tostring(k)), tostring(k)) end
        if v == json_null then
            t[k] = nil -- null means "the default", as in OpenAI's API
        else
            local kind, cfg_name = spec[1], spec[2]
            local check = KIND_CHECK[kind]
            if check and not check(v) then return bad(("%s must be %s"):format(k, KIND_WORDS[kind]), k) end
            if cfg_name then cfg[cfg_name] = v end
        end
    end
    if t.prompt == nil then return bad("prompt is required", "prompt") end
    if t.model ~= nil and t.model ~= model_id then
        return bad(("model '%s' is not served here (GET /v1/models lists '%s')"):format(t.model, model_id), "model", 404)
    end
    if t.n ~= nil and t.n ~= 1 then return bad("n must be 1 (one choice per request)", "n") end
    if t.stop ~= nil then
        local stops, e = stop_strings(t.stop)
        if not stops then return nil, e end
        if not model.has_tokenizer then return bad("stop strings need a tokenizer, which this model lacks", "stop") end
        cfg.stop_strings = stops
    end
    local ids, e = prompt_ids(model, t.prompt)
    if not ids then return nil, e end
    local max_tokens = cfg.max_tokens or DEFAULT_MAX_TOKENS
    cfg.max_tokens = max_tokens
    if max_tokens < 0 then return bad(("max_tokens = %d must be >= 0"):format(max_tokens), "max_tokens") end
    if #ids + max_tokens > model.max_seq_len then
        return bad(("the prompt (%d tokens) plus max_tokens (%d) exceeds the model's context of %d tokens")
            :format(#ids, max_tokens, model.max_seq_len), "max_tokens")
    end
    return { ids = ids, cfg = cfg, stream = t.stream == true, stops = cfg.stop_strings, prompt_tokens = #ids }
end

return _M

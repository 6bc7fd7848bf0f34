-- request_spec: tinyloop.server.request without nginx (server_spec sends the same requests
-- through a real nginx): the config a request body becomes.
local H = require "helpers"
local cjson = require "cjson"
local request = require "tinyloop.server.request"

local model = assert(H.tinyloop.load(H.ROOT .. "/models/tinyloop-austen", { threads = 1 }))

describe("request.parse", function()
    local function cfg_of(t)
        local req, err = request.parse(cjson.encode(t), model, "tinyloop-austen", 8, {})
        assert(req, type(err) == "table" and err.message or tostring(err))
        return req.cfg
    end

    it("draws a random seed for a sampled request without one, with the random start state of seed 0", function()
        -- (a Huginn-like model's prompt pages are then shared by every request without a seed)
        local a, b = cfg_of({ prompt = "It is", temperature = 0.8 }), cfg_of({ prompt = "It is", temperature = 0.8 })
        assert.is_number(a.sample_seed)
        assert.are_not.equal(a.sample_seed, b.sample_seed)
        assert.is_true(a.fixed_state_seed and b.fixed_state_seed)
        -- a seed sent, or a greedy request: the seed's own state, as in the engine
        local seeded = cfg_of({ prompt = "It is", temperature = 0.8, seed = 7 })
        assert.same({ 7, nil }, { seeded.sample_seed, seeded.fixed_state_seed })
        local greedy = cfg_of({ prompt = "It is", temperature = 0 })
        assert.same({ nil, nil }, { greedy.sample_seed, greedy.fixed_state_seed })
    end)

    it("takes OpenAI's top_p range, [0, 1]: 0 the likeliest token alone", function()
        -- (the engine's nucleus is in (0, 1] and keeps at least one token: top_k 1 keeps that one)
        local c = cfg_of({ prompt = "It is", temperature = 1, top_p = 0 })
        assert.same({ 1, 1 }, { c.top_k, c.top_p })
        assert.same({ 0.5, nil }, { cfg_of({ prompt = "It is", top_p = 0.5 }).top_p, cfg_of({ prompt = "It is", top_p = 0.5 }).top_k })
        for _, v in ipairs({ -0.1, 1.5 }) do
            local req, err = request.parse(cjson.encode({ prompt = "It is", top_p = v }), model, "tinyloop-austen", 8, {})
            assert.is_nil(req)
            assert.same({ "top_p", ("top_p = %s must be in [0, 1]"):format(tostring(v)) }, { err.param, err.message })
        end
        -- a number a C float holds as 0 is 0, as llama.cpp and Ollama read theirs (the Lua
        -- binding refuses one, which would change silently)
        c = cfg_of({ prompt = "It is", temperature = 1, top_p = 1e-46 })
        assert.same({ 1, 1 }, { c.top_k, c.top_p })
        assert.equal(0, cfg_of({ prompt = "It is", temperature = 1e-46 }).temperature)
        assert.equal(0, cfg_of({ prompt = "It is", min_p = -1e-46 }).min_p)
        assert.equal(1e-40, cfg_of({ prompt = "It is", min_p = 1e-40 }).min_p) -- (a float holds it)
        -- and before llama.cpp's readings of 0: repeat_penalty 1e-46 is none, as 0 is; a sampler
        -- this engine lacks at 1e-46 is off
        local chat = assert(require("tinyloop.chat").load(H.ROOT .. "/models/tinyloop-austen"))
        local req, err = request.parse_chat(cjson.encode({ messages = { { role = "user", content = "Hi" } }, repeat_penalty = 1e-46,
                                                           xtc_probability = 1e-46 }), model, "tinyloop-austen", 8, chat, {})
        assert(req, err and err.message)
        assert.equal(1, req.cfg.repetition_penalty)
        -- OpenAI's range of the penalties stays here, [-2, 2]
        local req, err = request.parse(cjson.encode({ prompt = "It is", presence_penalty = 3 }), model, "tinyloop-austen", 8, {})
        assert.same({ nil, "presence_penalty" }, { req, err and err.param })
    end)

    it("takes OpenAI's temperature range, [0, 2], on its routes; llama.cpp's and Ollama's any", function()
        local chat = assert(require("tinyloop.chat").load(H.ROOT .. "/models/tinyloop-austen"))
        local messages = { { role = "user", content = "Hi" } }
        assert.equal(2, cfg_of({ prompt = "It is", temperature = 2 }).temperature)
        for _, v in ipairs({ 2.000001, 3, 1e300 }) do
            local req, err = request.parse(cjson.encode({ prompt = "It is", temperature = v }), model, "tinyloop-austen", 8, {})
            assert.is_nil(req)
            assert.same({ "temperature", ("temperature = %s must be in [0, 2]"):format(tostring(v)) }, { err.param, err.message })
            req, err = request.parse_chat(cjson.encode({ messages = messages, temperature = v }), model, "tinyloop-austen", 8, chat, {})
            assert.same({ nil, "temperature" }, { req, err and err.param })
            local responses = require("tinyloop.server.responses")
            local body = assert(responses.to_chat(cjson.encode({ input = "Hi", temperature = v })))
            req, err = request.parse_chat(body, model, "tinyloop-austen", 8, chat, {})
            assert.same({ nil, "temperature" }, { req, err and err.param })
        end
        -- llama.cpp's routes sample at any temperature (Ollama's: ollama_spec)
        local llamacpp = require("tinyloop.server.llamacpp")
        local req, err = request.parse(assert(llamacpp.to_completions('{"prompt": "It is", "temperature": 3}')), model, "m", 16,
                                       llamacpp.View.PARSE_OPTIONS)
        assert(req, err and err.message)
        assert.equal(3, req.cfg.temperature)
    end)

    it("takes llama.cpp's fields, as its own OpenAI endpoints do (its web UI sends them there)", function()
        local chat = assert(require("tinyloop.chat").load(H.ROOT .. "/models/tinyloop-austen"))
        local function chat_cfg(t)
            t.messages = { { role = "user", content = "Hi" } }
            local req, err = request.parse_chat(cjson.encode(t), model, "tinyloop-austen", 8, chat, {})
            assert(req, type(err) == "table" and err.message or tostring(err))
            return req.cfg
        end
        -- what the web UI sends with its defaults: taken, each as /completion reads it
        local webui = { stream = true, timings_per_token = true, cache_prompt = true, samplers = "edkypmxt",
                        dynatemp_range = 0, dynatemp_exponent = 1, xtc_probability = 0, xtc_threshold = 0.1, typical_p = 1,
                        repeat_last_n = 64, repeat_penalty = 1.1, dry_multiplier = 0, dry_base = 1.75, dry_allowed_length = 2,
                        dry_penalty_last_n = -1, id_slot = -1, n_predict = 7 }
        local c = chat_cfg(webui)
        assert.same({ 1.1, 64, true, 7 }, { c.repetition_penalty, c.penalty_window, c.penalties_count_prompt, c.max_tokens })
        webui.stream, webui.messages = nil, nil
        c = cfg_of((function() local t = { prompt = "It is" } for k, v in pairs(webui) do t[k] = v end return t end)())
        assert.same({ 1.1, 64, true, 7 }, { c.repetition_penalty, c.penalty_window, c.penalties_count_prompt, c.max_tokens })
        -- repeat_penalty 0 is none; repeat_last_n -1 the whole context, 0 the penalties off; n_predict -1 the rest
        c = chat_cfg({ repeat_penalty = 0, repeat_last_n = -1, n_predict = -1 })
        assert.same({ 1, 0 }, { c.repetition_penalty, c.penalty_window })
        assert.equal(model:info().max_seq_len - #model:encode(chat:prompt({ { role = "user", content = "Hi" } })), c.max_tokens)
        c = chat_cfg({ repeat_penalty = 1.3, presence_penalty = 0.5, repeat_last_n = 0 })
        assert.same({ nil, nil, nil }, { c.repetition_penalty, c.presence_penalty, c.penalty_window })
        -- refused: a field under both names, a sampler this engine lacks turned on, no limit on completions
        local function refused(body, param, words, parse)
            local req, err = (parse or request.parse)(body, model, "tinyloop-austen", 8, chat, {})
            assert.is_nil(req)
            assert.same(param, err.param)
            assert.truthy(err.message:find(words, 1, true), err.message)
        end
        local function chat_parse(b) return request.parse_chat(b, model, "tinyloop-austen", 8, chat, {}) end
        refused('{"messages": [{"role": "user", "content": "Hi"}], "repeat_penalty": 1.1, "repetition_penalty": 1.2}',
                "repeat_penalty", "repeat_penalty is llama.cpp's name of repetition_penalty: send one of them", chat_parse)
        refused('{"messages": [{"role": "user", "content": "Hi"}], "xtc_probability": 0.5}', "xtc_probability",
                "xtc_probability is not supported (only <= 0, which turns it off, or null)", chat_parse)
        refused('{"messages": [{"role": "user", "content": "Hi"}], "repeat_last_n": -2}', "repeat_last_n",
                "repeat_last_n must be an integer >= -1", chat_parse)
        -- samplers, as llama.cpp's own OpenAI endpoints read it: the temperature's place, and the
        -- samplers it leaves out, off
        c = chat_cfg({ samplers = "edkypmxt", top_p = 0.9 })
        assert.same({ true, 0.9 }, { c.temperature_last, c.top_p })
        c = chat_cfg({ samplers = { "top_k", "temperature", "top_p" }, top_p = 0.9, min_p = 0.1, repeat_penalty = 1.2 })
        assert.same({ false, 0.9, nil, nil }, { c.temperature_last, c.top_p, c.min_p, c.repetition_penalty })
        refused('{"messages": [{"role": "user", "content": "Hi"}], "samplers": "kt", "temperature_last": false}', "samplers",
                "samplers orders the temperature as temperature_last does: send one of them", chat_parse)
        refused('{"prompt": "It is", "samplers": [1]}', "samplers", "samplers must be an array of sampler names or a string of their letters")
        local req, err = request.parse('{"prompt": "It is", "t_max_predict_ms": 5}', model, "tinyloop-austen", 8, {})
        assert.same({ nil, "t_max_predict_ms" }, { req, err.param }) -- (a time limit: not a no-op)
        -- n_predict is a cap, as on /completion: past the context, or below 0, the rest of it
        local prompt_len = #model:encode("It is")
        for _, v in ipairs({ -1, 100000 }) do
            assert.equal(model:info().max_seq_len - prompt_len, cfg_of({ prompt = "It is", n_predict = v }).max_tokens)
        end
        -- repeat_penalty alone: llama.cpp's window of 64, the prompt counted (its OpenAI endpoints' too)
        c = cfg_of({ prompt = "It is", repeat_penalty = 1.2 })
        assert.same({ 1.2, 64, true }, { c.repetition_penalty, c.penalty_window, c.penalties_count_prompt })
        assert.equal(8, cfg_of({ prompt = "It is", repeat_penalty = 1.2, penalty_window = 8 }).penalty_window)
        -- errors name the fields as sent
        local _, named = request.as_sent('{"prompt": "It is", "repeat_penalty": -1}', nil,
                                         { message = "repetition_penalty = -1 must be > 0", param = "repetition_penalty" })
        assert.same({ message = "repeat_penalty = -1 must be > 0", param = "repeat_penalty" }, named) -- (the engine's words)
        -- (only errors about the field itself: a schema's property of that name stays as sent)
        refused('{"messages": [{"role": "user", "content": "Hi"}], "n_predict": 5, "response_format": {"type": "json_schema", ' ..
                '"json_schema": {"name": "x", "schema": {"type": "object", "properties": {"max_tokens": {"type": "bogus"}}}}}}',
                "response_format", "/properties/max_tokens", chat_parse)
        -- (completions has no max_completion_tokens: that is the error)
        refused('{"prompt": "It is", "n_predict": 5, "max_completion_tokens": 5}', "max_completion_tokens", "unknown field")
        refused('{"messages": [{"role": "user", "content": "Hi"}], "n_predict": 5, "max_completion_tokens": 10}',
                "n_predict", "n_predict is llama.cpp's name of max_tokens", chat_parse)
        assert.equal(2, cfg_of({ prompt = "It is", n_predict = 2, min_tokens = 5 }).min_tokens) -- (the cap, as there)
        -- both of OpenAI's names at one value (lighteval through LiteLLM sends both)
        assert.equal(3, chat_cfg({ max_tokens = 3, max_completion_tokens = 3 }).max_tokens)
    end)

    it("takes vLLM's length_penalty with any request, kept for a beam search only (the Lua config refuses it alone)", function()
        assert.is_nil(cfg_of({ prompt = "It is", length_penalty = 1.0 }).length_penalty)
        local beam = cfg_of({ prompt = "It is", length_penalty = 2.0, beam_size = 2 })
        assert.same({ 2.0, 2 }, { beam.length_penalty, beam.beam_size })
        assert.truthy(model:session("It is", cfg_of({ prompt = "It is", length_penalty = 1.0, max_tokens = 2 })))
    end)
end)

describe("request.parse's structured output", function()
    it("refuses a grammar that is no text, and more structural tags than the limit, naming the field", function()
        local req, err = request.parse('{"prompt": "hi", "max_tokens": 2, "structured_outputs": {"grammar": 5}}', model,
                                       "tinyloop-austen", 8, {})
        assert.is_nil(req)
        assert.same({ "structured_outputs.grammar must be a string (GBNF)", "structured_outputs" }, { err.message, err.param })
        local structures = {}
        for i = 1, 257 do structures[i] = { begin = "<a" .. i .. ">", ["end"] = "</a>", schema = { type = "string" } } end
        req, err = request.parse(cjson.encode({ prompt = "hi", max_tokens = 2, response_format = { type = "structural_tag",
                                 structures = structures, triggers = { "<a" } } }), model, "tinyloop-austen", 8, {})
        assert.is_nil(req)
        assert.same({ "response_format.structures has 257 entries: at most 256", "response_format" }, { err.message, err.param })
    end)
end)

describe("request.parse_chat's tools", function()
    it("ends a reply without parallel_tool_calls at its first call by the lazy grammar, not by the end tag's text", function()
        local tools = require "tinyloop.tools"
        local chat = assert(require("tinyloop.chat").load(H.ROOT .. "/models/tinyloop-austen"))
        local python = { type = "function", ["function"] = { name = "python", parameters = { type = "object",
                         properties = { code = { type = "string" } }, required = { "code" } } } }
        local function parsed(extra)
            local t = { messages = { { role = "user", content = "Hi" } }, tools = { python }, parallel_tool_calls = false }
            for k, v in pairs(extra) do t[k] = v end
            local req, err = request.parse_chat(cjson.encode(t), model, "tinyloop-austen", 8, chat, {})
            assert(req, type(err) == "table" and err.message or tostring(err))
            return req.cfg.stop_strings or {}
        end
        -- (a stop string "</tool_call>" ended a call whose argument holds that text inside its
        -- string, "s = \"</tool_call>\"": the call lost, its first half sent as content)
        assert.same({ "STOP" }, parsed({ stop = "STOP" }))
        local call = '<tool_call>\n{"name": "python", "arguments": {"code": "s = \\"</tool_call>\\""}}\n</tool_call>'
        local lazy = assert(tools.lazy_grammar(assert(tools.check({ python }, "auto", false, cjson.encode({ python })))))
        assert.same({ true, false }, { lazy:matches("Sure. " .. call), lazy:matches(call .. "\n" .. call) })
        -- under a request's own grammar, the end tag's text ends the reply: no grammar of ours holds one call
        assert.same({ "STOP", tools.END }, parsed({ stop = "STOP", grammar = 'root ::= "x"' }))
    end)
end)

describe("request.decode_object", function()
    it("takes strict JSON only, what clients' parsers take (lua-cjson took these, and answers echoed them)", function()
        for _, body in ipairs({ '{"a": 1.}', '{"a": -.5}', '{"a": 01}', '{"a": 1e}', '{"a": 1.5.2}', '{"a": NaN}',
                                '{"a": "x\ty"}', '{"a": "x\1y"}', '{"a": "x\ny"}', '{"a": 1}\0 not json {{{' }) do
            local t, err = request.decode_object(body)
            assert.is_nil(t, body)
            assert.truthy(err.message:find("the request body is not valid JSON: ", 1, true), err.message)
        end
        local t = assert(request.decode_object('{\t"a" :\n[1, -0, 0.5, 2E+3, "1.", "\\t\\u0001"]\r\n}'))
        assert.same({ 1, 0, 0.5, 2000, "1.", "\t\1" }, t.a)
        local _, err = request.decode_object('{"a": 12.}')
        assert.truthy(err.message:find("'12.' at character 7 is no JSON number", 1, true), err.message)
    end)
end)

describe("request.parse's stop", function()
    it("refuses a NUL in a stop string in the request's words (the Lua config's stop_strings[1] was named)", function()
        for _, stop in ipairs({ "a\0b", { "x", "\0" } }) do
            local req, err = request.parse(cjson.encode({ prompt = "It is", stop = stop }), model, "tinyloop-austen", 8, {})
            assert.is_nil(req)
            assert.same({ "stop must not hold a NUL character (\\u0000)", "stop" }, { err.message, err.param })
        end
    end)

    it("refuses a stop that is neither a string nor an array, {} too (it decoded as [] and was taken)", function()
        for _, body in ipairs({ '{"prompt": "It is", "stop": {}}', '{"prompt": "It is", "stop": 5}',
                                '{"prompt": "It is", "stop": true}', '{"prompt": "It is", "stop": {"a": "b"}}' }) do
            local req, err = request.parse(body, model, "tinyloop-austen", 8, {})
            assert.is_nil(req, body)
            assert.same({ "stop must be a string or an array of strings", "stop" }, { err.message, err.param }, body)
        end
        -- stop strings on a model without a tokenizer (token-id prompts only)
        local req, err = request.parse('{"prompt": [1], "max_tokens": 2, "stop": "x"}',
                                       { vocab_size = 10, max_seq_len = 16, has_tokenizer = false }, "m", 4)
        assert.is_nil(req)
        assert.same({ "stop strings need a tokenizer, which this model lacks", "stop" }, { err.message, err.param })
        -- [] is no stop string, as before; the same rule for an array field and an object field
        assert.truthy(request.parse('{"prompt": "It is", "stop": []}', model, "tinyloop-austen", 8, {}))
        for body, want in pairs({ ['{"prompt": "It is", "stop_token_ids": {}}'] = "stop_token_ids must be an array",
                                  ['{"prompt": "It is", "structured_outputs": []}'] = "structured_outputs must be an object" }) do
            local req, err = request.parse(body, model, "tinyloop-austen", 8, {})
            assert.is_nil(req, body)
            assert.equal(want, err.message, body)
        end
    end)
end)

describe("tinyloop.json_text at its edges", function()
    local json_text = require "tinyloop.json_text"
    it("refuses a raw control character in a string after an escaped quote (the escape skipped, not the string ended)", function()
        local v, err = json_text.decode('["\\"\n"]')
        assert.is_nil(v)
        assert.truthy(err:find("unescaped control character", 1, true), err)
        assert.same({ 'a"', 1 }, json_text.decode('["a\\"", 1]'))
    end)
    it("gives a member's raw text without the blank space after it, and reads 1E5 as a float as 1e5", function()
        assert.equal("1", json_text.member('{"a": 1 , "b": 2}', { "a" }))
        assert.equal("2", json_text.member('{"a": 1 , "b": 2\n}', { "b" }))
        local floats = json_text.decode_ordered("[1E5, 1e5, 1.5, 7]", function(t) return t end, 10, function(x) return { float = x } end)
        assert.same({ { float = 1e5 }, { float = 1e5 }, { float = 1.5 }, 7 }, floats)
    end)
end)

describe("request.parse_chat: a chat that fills the context", function()
    it("refuses a rendered prompt of the whole context (no room for a reply), takes one a token shorter", function()
        local chat = assert(require("tinyloop.chat").load(H.ROOT .. "/models/tinyloop-austen"))
        local n_ctx = model:info().max_seq_len
        local function messages(k) return { { role = "user", content = ("a "):rep(k) } } end
        local function tokens(k) return #model:encode(chat:prompt(messages(k))) end
        local k = 1
        while tokens(k) < n_ctx do k = k + 1 end
        assert.equal(n_ctx, tokens(k), "a chat of exactly the context's tokens") -- (each "a " one token)
        local req, err = request.parse_chat(cjson.encode({ messages = messages(k) }), model, "tinyloop-austen", 8, chat, {})
        assert.is_nil(req)
        assert.same({ "messages", "context_length_exceeded" }, { err.param, err.code })
        assert.truthy(err.message:find(("the chat template (%d tokens) fills it"):format(n_ctx), 1, true), err.message)
        req = assert(request.parse_chat(cjson.encode({ messages = messages(k - 1) }), model, "tinyloop-austen", 8, chat, {}))
        assert.equal(1, req.cfg.max_tokens) -- (max_tokens left out: the one token of room)
    end)
end)

describe("request.parse: a prompt that fills the context", function()
    local model = { vocab_size = 10, max_seq_len = 16, has_tokenizer = false }
    local function ids(n) local t = {} for i = 1, n do t[i] = 1 end return t end
    it("names the prompt, which no max_tokens would fit (it named max_tokens, even at 0)", function()
        for _, case in ipairs({ { 17, 0 }, { 17, 1 }, { 20, 4 } }) do
            local body = cjson.encode({ prompt = ids(case[1]), max_tokens = case[2] })
            local req, err = request.parse(body, model, "m", 4)
            assert.is_nil(req, body)
            assert.same({ ("the prompt (%d tokens) fills it"):format(case[1]), "prompt" },
                        { err.message:match("the prompt %(%d+ tokens%) fills it"), err.param }, body)
            assert.equal("context_length_exceeded", err.code, body)
        end
        -- a batch names its prompt
        local _, err = request.parse(cjson.encode({ prompt = { ids(3), ids(17) }, max_tokens = 0 }), model, "m", 4)
        assert.same({ "prompt", true }, { err.param, err.message:find("the prompt[1] (17 tokens) fills it", 1, true) ~= nil })
        -- what fits, or what max_tokens overfills (a prompt of the whole context: max_tokens 0
        -- fits), is as before
        assert.truthy(request.parse(cjson.encode({ prompt = ids(16), max_tokens = 0 }), model, "m", 4))
        local _, full = request.parse(cjson.encode({ prompt = ids(16), max_tokens = 1 }), model, "m", 4)
        assert.same({ "max_tokens", true }, { full.param, full.message:find("plus max_tokens (1)", 1, true) ~= nil })
        local _, over = request.parse(cjson.encode({ prompt = ids(10), max_tokens = 7 }), model, "m", 4)
        assert.same({ "max_tokens", true }, { over.param, over.message:find("plus max_tokens (7)", 1, true) ~= nil })
    end)
end)

describe("request.parse_chat with drop_oldest (Ollama's truncate)", function()
    local DIR = H.ROOT .. "/models/tinyloop-austen"
    local OPTS = { room = true, drop_oldest = true }
    local function words(n) return (("the "):rep(n):gsub(" $", "")) end
    local system, last = { role = "system", content = "Be brief." }, { role = "user", content = "Who is Emma?" }
    -- the prompt tokens of a conversation parsed whole (without drop_oldest)
    local function whole(chat, messages)
        local req, err = request.parse_chat(cjson.encode({ messages = messages, max_tokens = 1 }), model, "m", 8, chat, { room = true })
        assert(req, err and err.message)
        return req.prompt_tokens
    end
    local function kept(chat, messages, max_tokens)
        local req, err = request.parse_chat(cjson.encode({ messages = messages, max_tokens = max_tokens }), model, "m", 8, chat, OPTS)
        assert(req, err and err.message)
        return req.prompt_tokens, req.cfg.max_tokens
    end

    it("leaves the reply room: max_tokens', else a quarter of the context (a cut only to fit left it a token)", function()
        local chat = require("tinyloop.chat").load(DIR)
        local conv = { system, { role = "user", content = words(101) }, { role = "assistant", content = words(61) },
                       { role = "user", content = words(61) }, { role = "assistant", content = words(31) }, last }
        local from3 = whole(chat, { system, conv[3], conv[4], conv[5], last })
        local from4 = whole(chat, { system, conv[4], conv[5], last })
        local context = model:info().max_seq_len
        assert.is_true(from3 < context and from3 + context / 4 > context, from3) -- (fits, leaving less than a quarter)
        local tokens, room = kept(chat, conv, 10)
        assert.same({ from3, 10 }, { tokens, room })
        tokens, room = kept(chat, conv, nil)
        assert.same({ from4, context - from4 }, { tokens, room })
        -- a conversation that fits with its room keeps every message
        local short = { system, conv[4], conv[5], last }
        assert.equal(whole(chat, short), (kept(chat, short, 10)))
    end)

    it("never keeps a tool's answer without its call, when the template refuses the call's turn as a start", function()
        -- (a template that refuses a conversation whose first turn is the assistant's, and takes
        -- one that opens with a tool's answer: the start after a refused call is not its answer)
        local path = os.tmpname()
        local f = assert(io.open(path, "wb"))
        f:write("{% set ns = namespace(first=none) %}{% for m in messages %}{% if m.role != 'system' and ns.first is none %}" ..
                "{% set ns.first = m.role %}{% endif %}{% endfor %}{% if ns.first == 'assistant' %}" ..
                "{{ raise_exception('the first turn is the assistant turn') }}{% endif %}" ..
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
        f:close()
        local chat = assert(require("tinyloop.chat").load(DIR, path))
        os.remove(path)
        local call = { role = "assistant", content = words(100),
                       tool_calls = { { id = "c1", type = "function", ["function"] = { name = "look", arguments = "{}" } } } }
        local answer = { role = "tool", tool_call_id = "c1", content = "Emma is a young woman." }
        local conv = { system, { role = "user", content = words(150) }, call, answer, last }
        assert.is_true(whole(chat, { system, answer, last }) <= 251) -- (what fit, orphaned)
        assert.equal(whole(chat, { system, last }), (kept(chat, conv, 5)))
    end)

    it("passes over a start the template refuses (roles must alternate), as Ollama's templates refuse none", function()
        local chat = assert(require("tinyloop.chat").load(DIR, H.ROOT .. "/tests/data/chat_templates/gemma.jinja"))
        local conv = { system, { role = "user", content = words(200) }, { role = "assistant", content = words(20) },
                       { role = "user", content = words(20) }, { role = "assistant", content = words(5) }, last }
        -- (from the assistant's turn, the template raises: the start after it is taken)
        local _, refused = request.parse_chat(cjson.encode({ messages = { system, conv[3], conv[4], conv[5], last } }),
                                              model, "m", 8, chat, { room = true })
        assert.truthy(refused and refused.message:find("alternate", 1, true), refused and refused.message)
        assert.equal(whole(chat, { system, conv[4], conv[5], last }), (kept(chat, conv, 5)))
    end)
end)

describe("request's cut_middle (Ollama's /api/generate with truncate left true)", function()
    it("keeps the first 4 tokens and the last, leaving the reply its room, raw and through the template", function()
        local context = model:info().max_seq_len
        local ids = {}
        for i = 1, 300 do ids[i] = 100 + i end
        local function cut(room) -- the prompt Ollama's runner would keep, leaving `room`
            local out = { 101, 102, 103, 104 }
            for i = 300 - (context - room - 4) + 1, 300 do out[#out + 1] = 100 + i end
            return out
        end
        local opts = { room = true, cut_middle = 4 }
        local req = assert(request.parse(cjson.encode({ prompt = ids, max_tokens = 10 }), model, "m", 8, opts))
        assert.same(cut(10), req.prompts[1])
        req = assert(request.parse(cjson.encode({ prompt = ids }), model, "m", 8, opts)) -- (a quarter, left out)
        assert.same(cut(context / 4), req.prompts[1])
        assert.equal(context / 4, req.cfg.max_tokens)
        -- through the template: the whole rendered prompt's middle, its template's tokens too
        local chat = require("tinyloop.chat").load(H.ROOT .. "/models/tinyloop-austen")
        local text = ("the "):rep(300) .. "Who is Emma?"
        local messages = { { role = "user", content = text } }
        local whole = model:encode(chat:prompt(messages))
        assert.is_true(#whole > context)
        req = assert(request.parse_chat(cjson.encode({ messages = messages, max_tokens = 10 }), model, "m", 8, chat, opts))
        local want = { unpack(whole, 1, 4) }
        for i = #whole - (context - 10 - 4) + 1, #whole do want[#want + 1] = whole[i] end
        assert.same(want, req.ids)
        assert.equal(#want, req.prompt_tokens)
        -- without cut_middle (truncate false): refused, as before
        local _, err = request.parse(cjson.encode({ prompt = ids, max_tokens = 10 }), model, "m", 8, { room = true })
        assert.equal("prompt", err.param)
        -- options.num_keep's: its first tokens, or none; past the room all but the last token
        -- (Ollama's min(numKeep, numCtx - 1)): a negative one keeps all it can
        local function kept(keep)
            return assert(request.parse(cjson.encode({ prompt = ids, max_tokens = 10 }), model, "m", 8,
                                        { room = true, cut_middle = keep })).prompts[1]
        end
        local limit = context - 10
        for _, keep in ipairs({ 0, 10, limit - 1, limit, limit + 50, math.huge }) do
            local first = math.min(keep, limit - 1)
            local want = { unpack(ids, 1, first) }
            for i = 300 - (limit - first) + 1, 300 do want[#want + 1] = ids[i] end
            assert.same(want, kept(keep), tostring(keep))
        end
        -- a BOS token first is one more, as Ollama counts num_keep after it
        local bos = model:info().bos_token_id
        local with_bos = { bos, unpack(ids) }
        local cut = assert(request.parse(cjson.encode({ prompt = with_bos, max_tokens = 10 }), model, "m", 8,
                                         { room = true, cut_middle = 4 })).prompts[1]
        assert.same({ bos, 101, 102, 103, 104 }, { unpack(cut, 1, 5) })
        assert.same({ with_bos[#with_bos - (limit - 5) + 1], limit }, { cut[6], #cut })
    end)
end)

-- Refusals of the chat, completion and tokenize parsers that an audit found no test fed.
describe("request's parsers refuse, naming the field", function()
    local chat = require("tinyloop.chat").load(H.ROOT .. "/models/tinyloop-austen")
    local M = '"messages": [{"role": "user", "content": "hi"}], '
    local function ST(x) return '{"prompt": "hi", "structured_outputs": {"structural_tag": ' .. x .. '}}' end
    local CASES = {
      chat = {
        { '{' .. M .. '"max_tokens": 2, "max_completion_tokens": 3}', "max_completion_tokens", "max_tokens and max_completion_tokens are one setting" },
        { '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Wel"}], "continue_final_message": true, "add_generation_prompt": true}', "add_generation_prompt", "add_generation_prompt must be false" },
        { '{' .. M .. '"chat_template_kwargs": []}', "chat_template_kwargs", "chat_template_kwargs must be an object" },
        { '{' .. M .. '"stream_options": {"include_usage": true}}', "stream_options", "only allowed with stream: true" },
        { '{' .. M .. '"response_format": []}', "response_format", "response_format must be an object" },
        { '{' .. M .. '"response_format": {"type": "text", "json_schema": {}}}', "response_format", 'response_format.json_schema goes with type "json_schema"' },
        { '{' .. M .. '"response_format": {"type": "xml"}}', "response_format", "response_format.type must be" },
        -- llama.cpp's schema beside JSON mode's type only (its json_schema type reads the wrapper
        -- alone, and answers a flat schema unconstrained)
        { '{' .. M .. '"response_format": {"type": "json_schema", "schema": {}}}', "response_format", 'response_format.schema goes with type "json_object"' },
        { '{' .. M .. '"response_format": {"type": "json_object", "schema": []}}', "response_format", "response_format.schema must be a JSON Schema object" },
        { '{' .. M .. '"json_schema": {"type": "string"}, "grammar": "root ::= \\"a\\""}', "json_schema", "grammar and json_schema cannot be used together" },
        { '{' .. M .. '"json_schema": "x"}', "json_schema", "json_schema must be" },
        { '{' .. M .. '"response_format": {"type": "json_schema"}}', "response_format", "response_format.json_schema must be an object" },
        { '{' .. M .. '"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}', "response_format", "response_format.json_schema.schema must be a JSON Schema object" },
      },
      completion = {
        { '{"prompt": "hi", "structured_outputs": {"regex": 5}}', "structured_outputs", "must be a string (a regular expression)" },
        { '{"prompt": "hi", "structured_outputs": {}}', "structured_outputs", "structured_outputs needs one of" },
        { ST('{"type": "x", "structures": [], "triggers": []}'), "structured_outputs", '.type must be "structural_tag"' },
        { ST('{"type": "x", "format": {"type": "any_text"}}'), "structured_outputs", '.type must be "structural_tag"' },
        { ST('{"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a"]}'), "structured_outputs", "must be {begin: string, schema: object, end: string}" },
        { ST('{"type": "structural_tag", "structures": [{"begin": "", "schema": {}, "end": "</a>"}], "triggers": ["<a"]}'), "structured_outputs", "begin must be a non-empty string and both valid UTF-8" },
        { ST('{"type": "structural_tag", "structures": [{"begin": "<a>", "schema": [], "end": "</a>"}], "triggers": ["<a"]}'), "structured_outputs", "structures[0].schema must be a JSON Schema object" },
        { ST('{"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {"type": "frob"}, "end": "</a>"}], "triggers": ["<a"]}'), "structured_outputs", "structures[0].schema does not compile" },
        { ST('{"type": "structural_tag", "format": 5}'), "structured_outputs", 'format must be an object with a "type"' },
        { ST('{"type": "structural_tag", "format": {"type": "json_schema"}}'), "structured_outputs", "format.json_schema must be a JSON Schema object" },
        { ST('{"type": "structural_tag", "format": {"type": "regex", "pattern": 5}}'), "structured_outputs", "format.pattern must be a string" },
        { ST('{"type": "structural_tag", "format": {"type": "regex", "pattern": "(("}}'), "structured_outputs", "format.pattern does not compile" },
        { ST('{"type": "structural_tag", "format": {"type": "grammar", "grammar": ""}}'), "structured_outputs", "format.grammar must be GBNF text" },
        { ST('{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a"], "tags": []}}'), "structured_outputs", "format.tags must be an array of 1 to 256 tags" },
        { ST('{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a"], "tags": [{"begin": "<a>"}]}}'), "structured_outputs", 'must be {"type": "tag", "begin": string' },
        { ST('{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a"], "tags": [{"begin": "", "content": {"type": "any_text"}, "end": "</a>"}]}}'), "structured_outputs", "begin must be a non-empty string, begin and end valid UTF-8 without NUL" },
        { ST('{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a"], "tags": [{"begin": "<a>", "content": {"type": "any_text"}, "end": ""}]}}'), "structured_outputs", "any_text needs the tag's end" },
        { '{"prompt": {}}', "prompt", "prompt must not be empty (a string or an array of token ids)" },
      },
      tokenize = {
        { '{"content": "a", "prompt": "b"}', "prompt", "is vLLM's form, content llama.cpp's" },
        { '{"prompt": "a", "with_pieces": true}', "with_pieces", "goes with content (llama.cpp's form)" },
        { '{}', "prompt", "send prompt (a text) or messages (a conversation)" },
        { '{"prompt": "a", "messages": []}', "messages", "send prompt (a text) or messages" },
        { '{"prompt": "a", "add_generation_prompt": true}', "add_generation_prompt", "goes with messages, not with prompt" },
        { '{"messages": false}', "messages", "messages must be a non-empty array of messages" }, -- (it raised: a 500)
      },
    }

    it("in chat completions", function()
        H.refuses(function(b) return request.parse_chat(b, model, "tinyloop-austen", 8, chat, {}) end, CASES.chat)
    end)
    it("in completions' structured outputs", function()
        H.refuses(function(b) return request.parse(b, model, "tinyloop-austen", 8, {}) end, CASES.completion)
    end)
    it("in /apply-template (a message that is no object raised: a 500)", function()
        H.refuses(function(b) return request.parse_apply_template(b, chat) end, {
            { '{"messages": [1]}', "messages", "messages[0] must be an object" },
            { '{"messages": [{"role": "user", "content": "x"}, null]}', "messages", "messages[1] must be an object" },
        })
    end)
    it("in /tokenize", function()
        H.refuses(function(b) return request.parse_tokenize(b, model, "tinyloop-austen", chat) end, CASES.tokenize)
    end)
end)

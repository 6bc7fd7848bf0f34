-- ollama_spec: tinyloop.server.ollama without nginx: an Ollama request as the chat (or
-- completions) request it means (server_spec runs them through a real nginx and compares).
local cjson = require "cjson"
local ollama = require "tinyloop.server.ollama"
local json_text = require "tinyloop.json_text"

local ID = "tinyloop-austen"
-- (as a model whose template has a thinking block: think is taken)
local function chat_of(body, generate)
    local chat_body, view, chat = (generate and ollama.generate_to_chat or ollama.chat_to_chat)(body, ID, true)
    assert(chat_body, view and view.message)
    return chat_body ~= "" and cjson.decode(chat_body) or {}, chat_body, view, chat
end

describe("ollama.chat_to_chat", function()
    it("maps options, format and think onto the chat request, and streams by default", function()
        local chat, text = chat_of([[{"model": "tinyloop-austen:latest", "messages": [{"role": "user", "content": "Hi"}],
            "options": {"temperature": 0.5, "top_k": 7, "seed": 3, "num_predict": 9, "repeat_penalty": 1.1, "stop": ["\n"],
                        "num_ctx": 4096, "num_thread": 2, "typical_p": 1, "mirostat": 0},
            "format": {"type": "object", "properties": {"b": {}, "a": {}}}, "think": "high", "keep_alive": "5m"}]])
        assert.same({ 0.5, 7, 3, 9, 1.1, { "\n" }, true }, { chat.temperature, chat.top_k, chat.seed, chat.max_tokens,
                                                             chat.repetition_penalty, chat.stop, chat.stream })
        assert.equal('{"type": "object", "properties": {"b": {}, "a": {}}}', json_text.member(text, { "response_format", "json_schema", "schema" }))
        assert.same({ enable_thinking = true, reasoning_effort = "high" }, chat.chat_template_kwargs)
        assert.is_nil(chat.num_ctx)
        chat = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "stream": false, "format": "json", ' ..
                       '"options": {"num_predict": -1}}')
        assert.same({ false, { type = "json_object" } }, { chat.stream, chat.response_format })
        assert.is_nil(chat.max_tokens) -- (-1: no limit: the rest of the context)
        -- an error about the top_logprobs that logprobs asked for names logprobs, which was sent
        local _, _, lp_view = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "logprobs": true}')
        assert.equal("logprobs is not kept by beam search: not with beam_size",
                     lp_view:error({ status = 400, message = "top_logprobs is not kept by beam search: not with beam_size" }).message)
        -- /api/generate's prompt is the chat request's messages: its errors name the prompt
        local _, _, gen_view = chat_of('{"prompt": "Hi"}', true)
        assert.equal("the text made of the prompt and the chat template (9 tokens) fills it",
                     gen_view:error({ status = 400, message = "the text made of the messages and the chat template (9 tokens) fills it" }).message)
        assert.equal("messages[0] is bad", lp_view:error({ status = 400, message = "messages[0] is bad" }).message)
        -- 0 too, as Ollama's runner, which stops at num_predict only where it is above 0
        assert.is_nil(chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 0}}').max_tokens)
        -- format {} is the empty JSON Schema (any JSON), as Ollama compiles it, not an array
        local _, format_text = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "format": {}}')
        assert.equal("{}", json_text.member(format_text, { "response_format", "json_schema", "schema" }))
        -- repeat_last_n 0 turns the penalties off, as Ollama's; a window is taken
        chat = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": {"repeat_penalty": 1.3, ' ..
                       '"frequency_penalty": 0.2, "repeat_last_n": 0}}')
        assert.same({ nil, nil }, { chat.repetition_penalty, chat.frequency_penalty })
        chat = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": {"repeat_penalty": 1.3, "repeat_last_n": 16}}')
        assert.same({ 1.3, 16, true }, { chat.repetition_penalty, chat.penalty_window, chat.penalties_count_prompt })
        -- (-1: the whole context, the engine's 0; left out: Ollama's default of 64)
        chat = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": {"repeat_last_n": -1}}')
        assert.equal(0, chat.penalty_window)
        assert.equal(64, chat_of('{"messages": [{"role": "user", "content": "Hi"}]}').penalty_window)
        -- TinyLoop's own field at the top level stands (not the default after it); both refused;
        -- a window past any sequence is the whole sequence
        assert.equal(8, chat_of('{"messages": [{"role": "user", "content": "Hi"}], "penalty_window": 8}').penalty_window)
        assert.equal(0, chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": {"repeat_last_n": 1099511627776}}')
                            .penalty_window)
    end)

    it("takes Ollama's defaults for the samplers a request leaves out, not the temperature", function()
        -- (Open WebUI sends a temperature alone: it sampled with top_k 50, top_p 1, no penalty)
        local chat = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": {"temperature": 0.9}}')
        assert.same({ 0.9, 40, 0.9, 1.1, 64, true }, { chat.temperature, chat.top_k, chat.top_p, chat.repetition_penalty,
                                                       chat.penalty_window, chat.penalties_count_prompt })
        chat = chat_of('{"messages": [{"role": "user", "content": "Hi"}]}')
        assert.same({ nil, 40, 0.9, 1.1 }, { chat.temperature, chat.top_k, chat.top_p, chat.repetition_penalty })
        -- the client's options stand, and TinyLoop's fields at the top level
        chat = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": {"top_k": 7, "top_p": 1, "repeat_penalty": 1}}')
        assert.same({ 7, 1, 1 }, { chat.top_k, chat.top_p, chat.repetition_penalty })
        -- repeat_penalty 0 (LiteLLM's frequency_penalty = 0; Ollama takes it unchecked) is none, 1
        chat = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": {"repeat_penalty": 0}}')
        assert.equal(1, chat.repetition_penalty)
        chat = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "top_k": 3, "repetition_penalty": 1.3}')
        assert.same({ 3, 0.9, 1.3 }, { chat.top_k, chat.top_p, chat.repetition_penalty })
        -- a null option is left out; repeat_last_n 0 turns the penalty off, the default's too
        chat = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": {"top_k": null, "repeat_last_n": 0}}')
        assert.same({ 40, nil }, { chat.top_k, chat.repetition_penalty })
        -- /api/generate alike, raw too
        chat = chat_of('{"prompt": "Hi", "raw": true}', true)
        assert.same({ 40, 0.9, 1.1 }, { chat.top_k, chat.top_p, chat.repetition_penalty })
    end)

    it("takes the sampler values Ollama's sampler clamps, and any penalty", function()
        local request = require "tinyloop.server.request"
        local H = require "helpers"
        local model = H.model()
        local chat_prompts = assert(require("tinyloop.chat").load(H.ROOT .. "/models/tinyloop-austen"))
        local function cfg_of(options)
            local _, body, view = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": ' .. options .. '}')
            local req, err = request.parse_chat(body, model, ID, 8, chat_prompts, view.PARSE_OPTIONS)
            assert(req, err and err.message)
            return req.cfg
        end
        -- a temperature below 0 is 0 (greedy), top_p and min_p clamped into [0, 1], top_k <= 0
        -- every token, penalties past [-2, 2] as sent
        local c = cfg_of('{"temperature": -1, "top_p": 1.5, "min_p": 1.5, "top_k": -5, "frequency_penalty": 3, "presence_penalty": -3}')
        assert.same({ 0, 1, 1, model.vocab_size, 3, -3 }, { c.temperature, c.top_p, c.min_p, c.top_k, c.frequency_penalty,
                                                            c.presence_penalty })
        assert.equal(3, cfg_of('{"temperature": 3}').temperature) -- (OpenAI's routes: at most 2)
        c = cfg_of('{"top_p": -1, "min_p": -1}')
        assert.same({ 1, 1, 0 }, { c.top_k, c.top_p, c.min_p }) -- (top_p 0: the likeliest token alone)
        -- not numbers: refused, by name, the option's (the chat request's field it became was named)
        for _, case in ipairs({ { '{"top_p": "high"}', "options.top_p must be a number" }, { '{"seed": "7"}', "options.seed must be an integer" },
                                { '{"repeat_penalty": "1.1"}', "options.repeat_penalty must be a number" }, -- (a 500 before: compared a string)
                                { '{"repeat_penalty": []}', "options.repeat_penalty must be a number" },
                                { '{"top_k": 3000000000}', "'options.top_k' = 3000000000" } }) do
            local _, body, view = chat_of('{"messages": [{"role": "user", "content": "Hi"}], "options": ' .. case[1] .. '}')
            local req, err = request.parse_chat(body, model, ID, 8, chat_prompts, view.PARSE_OPTIONS)
            if req then -- (an engine's refusal: when the request runs)
                err = { status = 400, param = "top_k", message = "config field 'top_k' = 3000000000 must be an integer in [-2147483648, 2147483647]" }
            end
            local message = view:error(err).message
            assert.truthy(message:find(case[2], 1, true), message)
        end
    end)

    it("gives Ollama's tool calls ids, and each tool message the call it answers", function()
        local chat = chat_of([[{"messages": [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "thinking": "Both.", "tool_calls": [
                {"function": {"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}},
                {"function": {"name": "time", "arguments": {}}}]},
            {"role": "tool", "tool_name": "time", "content": "noon"},
            {"role": "tool", "content": "sun"}],
            "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]}]])
        local m = chat.messages
        assert.same({ "assistant", cjson.null, "Both." }, { m[2].role, m[2].content, m[2].reasoning_content })
        local calls = m[2].tool_calls
        assert.equal('{"city": "Paris", "unit": "c"}', calls[1]["function"].arguments) -- (as sent)
        assert.same({ calls[2].id, "noon" }, { m[3].tool_call_id, m[3].content })
        assert.same({ calls[1].id, "sun" }, { m[4].tool_call_id, m[4].content })
        assert.equal("weather", chat.tools[1]["function"].name)
        -- "required": null and "properties": null (Go's nil slice and map, as clients built on
        -- Ollama's api package send them) are absent, as Ollama reads them; the rest as sent
        local _, text = chat_of([[{"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function":
            {"name": "a", "parameters": {"type": "object", "required": null, "properties": {"z": {}, "b": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "b", "parameters": {"type": "object", "properties": null}}}]}]])
        assert.equal('{"type":"object","properties":{"z": {}, "b": {"type": "string"}}}',
                     json_text.member(text, { "tools", 1, "function", "parameters" }))
        assert.equal('{"type":"object"}', json_text.member(text, { "tools", 2, "function", "parameters" }))
    end)

    it("refuses bad input, naming the field", function()
        local cases = {
            { "{", nil, "not valid JSON" },
            { '{"model": "llama3"}', "model", "not found" },
            { '{"messages": [{"role": "bot", "content": "x"}]}', "messages", "messages[0].role" },
            { '{"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}', "messages", "text only" },
            { '{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]}', "messages",
              "arguments must be an object" },
            { '{"messages": [{"role": "user", "content": "x"}], "options": {"mirostat": 2}}', "options", "options.mirostat" },
            { '{"messages": [{"role": "user", "content": "x"}], "options": {"num_predict": "5"}}', "options", "num_predict" },
            { '{"messages": [{"role": "user", "content": "x"}], "format": "xml"}', "format", "format must be" },
            { '{"messages": [{"role": "user", "content": "x"}], "think": "max"}', "think", "think must be" },
            { '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}', "top_logprobs", "between 0 and 20" },
            { '{"messages": [{"role": "user", "content": "x"}], "keep_alive": "bogus"}', "keep_alive", "a duration" },
            { '{"messages": [{"role": "user", "content": "x"}], "keep_alive": "5"}', "keep_alive", "a duration" },
            { '{"messages": [{"role": "user", "content": "x"}], "keep_alive": "1x"}', "keep_alive", "a duration" },
            { '{"messages": [{"role": "user", "content": "x"}], "keep_alive": true}', "keep_alive", "a duration" },
            { '{"messages": [{"role": "user", "content": "x"}], "keep_alive": "99999999999h"}', "keep_alive", "a duration" },
            -- an empty object is no empty array, and the reverse (they decode alike: it loaded the model)
            { '{"messages": {}}', "messages", "messages must be an array" },
            { '{"messages": [{"role": "user", "content": "x"}], "options": []}', "options", "options must be an object" },
            { '{"messages": [{"role": "user", "content": "x"}], "penalty_window": 4, "options": {"repeat_last_n": 0}}', "options",
              "give options.repeat_last_n or penalty_window, not both" },
        }
        require("helpers").refuses(function(body) return ollama.chat_to_chat(body, ID, true) end, cases)
        -- what Ollama's Go decoding skips is skipped: unknown fields, a message's, a call's and a
        -- tool's unknown keys (apps post OpenAI-shaped bodies), and a tool without "type" is a
        -- function; top_logprobs without logprobs changes nothing (Ollama checks its range alone)
        local body = '{"messages": [{"role": "user", "content": "x", "name": "bob"}, {"role": "assistant", "content": "", ' ..
                     '"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": {}, "extra": 1}, "extra": 2}]}, ' ..
                     '{"role": "tool", "content": "1", "tool_name": "f"}], "n": 2, "user": "u", "top_logprobs": 2, ' ..
                     '"tools": [{"function": {"name": "f", "parameters": {"type": "object"}}}]}'
        local chat = chat_of(body)
        assert.same({ "x", "f", "c1", "function" }, { chat.messages[1].content, chat.messages[2].tool_calls[1]["function"].name,
                                                     chat.messages[3].tool_call_id, chat.tools[1].type })
        assert.is_nil(chat.messages[1].name)
        -- a field's name in another case is that field, as Go's decoding matches it, each key
        -- in the body's order writing it: the last one not null wins
        chat = chat_of('{"Messages": [{"role": "user", "content": "x"}], "Stream": false, "OPTIONS": {"num_predict": 3}}')
        assert.same({ "x", false, 3 }, { chat.messages[1].content, chat.stream, chat.max_tokens })
        local M = '"messages": [{"role": "user", "content": "x"}], '
        for body, streams in pairs({ ['{' .. M .. '"Stream": true, "stream": false}'] = false,
                                     ['{' .. M .. '"stream": false, "Stream": true}'] = true,
                                     ['{' .. M .. '"STREAM": true, "Stream": false}'] = false,
                                     ['{' .. M .. '"Stream": false, "STREAM": true}'] = true,
                                     ['{' .. M .. '"Stream": false, "stream": null}'] = false }) do
            assert.equal(streams, chat_of(body).stream, body)
        end
        assert.is_nil(chat.n)
        assert.is_nil(chat.top_logprobs)
        -- an integer option's fraction is truncated, as Ollama's FromMap reads a float64 into an int
        chat = chat_of('{"messages": [{"role": "user", "content": "x"}], "options": {"top_k": 2.7, "seed": 7.5, ' ..
                       '"num_predict": 3.9, "repeat_last_n": 8.2}}')
        assert.same({ 2, 7, 3, 8 }, { chat.top_k, chat.seed, chat.max_tokens, chat.penalty_window })
        -- keep_alive as Ollama reads it (a Go duration, or seconds): a zero one unloads
        for _, zero in ipairs({ '0', '"0"', '"0s"', '"0ms"', '"0m0s"', '"0.0h"', '"-0s"', '1e-12', '0.5', '"0.1ns"' }) do
            local _, _, view = chat_of('{"messages": [], "keep_alive": ' .. zero .. '}')
            assert.is_true(view.unload, zero)
        end
        for _, kept in ipairs({ '300', '1.5', '-1', '-0.5', '"5m"', '"1h30m"', '"1.5h"', '".5s"', '"-1m"', '"10\\u00b5s"' }) do
            local _, _, view = chat_of('{"messages": [], "keep_alive": ' .. kept .. '}')
            assert.is_false(view.unload, kept)
        end
        -- a schema in format that does not compile names format
        local _, _, format_view = chat_of('{"messages": [{"role": "user", "content": "x"}], "format": {"type": "object"}}')
        assert.equal("format does not compile: x",
                     format_view:error({ status = 400, message = "response_format.json_schema.schema does not compile: x" }).message)
        -- a model without a thinking block is asked to think: Ollama's 400 (it went unheard)
        local without = {
            { '{"messages": [{"role": "user", "content": "x"}], "think": true}', "think", '"tinyloop-austen" does not support thinking' },
            { '{"model": "TinyLoop-Austen", "messages": [{"role": "user", "content": "x"}], "think": "low"}', "think",
              '"TinyLoop-Austen" does not support thinking' },
        }
        require("helpers").refuses(function(body) return ollama.chat_to_chat(body, ID, false) end, without)
        assert.truthy(ollama.chat_to_chat('{"messages": [{"role": "user", "content": "x"}], "think": false}', ID, false))
        assert.truthy(ollama.generate_to_chat('{"prompt": "x", "think": false}', ID, false))
        assert.is_nil(ollama.generate_to_chat('{"prompt": "x", "think": true}', ID, false))
        -- raw leaves the template out, and thinking goes through it
        -- a tool call's name must be a text; no messages at all is a load of the model (Ollama's)
        local _, call_err = ollama.chat_to_chat('{"model": "tinyloop-austen", "messages": [{"role": "assistant", "content": "", ' ..
                                                '"tool_calls": [{"function": {"name": 5, "arguments": {}}}]}]}', ID, true)
        assert.same({ 400, "messages", "messages[0].tool_calls[0].function.name must be a string" },
                    { call_err.status, call_err.param, call_err.message })
        assert.is_true(select(2, ollama.chat_to_chat('{"model": "tinyloop-austen", "messages": []}', ID, true)).load)
        local _, err = ollama.generate_to_chat('{"prompt": "x", "raw": true, "think": true}', ID, true)
        assert.same({ 400, "think", "think goes through the chat template, which raw leaves out" }, { err.status, err.param, err.message })
    end)
end)

describe("ollama: what Ollama's clients send", function()
    it("takes Go clients' empty fields, Open WebUI's call index and null content, any role case, unknown options", function()
        local chat, _, _, is_chat = chat_of('{"model": "TinyLoop-Austen:latest", "prompt": "Hi", "suffix": "", "system": "", ' ..
                                            '"template": "", "options": null}', true)
        assert.same({ true, { { role = "user", content = "Hi" } } }, { is_chat, chat.messages })
        chat = chat_of([[{"messages": [{"role": "User", "content": "q"}, {"role": "assistant", "content": null,
            "tool_calls": [{"index": 0, "id": "c9", "function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "content": "r"}], "options": {"reasoning_effort": "low", "seed": -1, "rope_frequency_base": 1e4},
            "system": "ignored, as Ollama's chat ignores it", "truncate": true}]])
        assert.same({ "user", cjson.null, "c9", "c9" }, { chat.messages[1].role, chat.messages[2].content,
                    chat.messages[2].tool_calls[1].id, chat.messages[3].tool_call_id })
        -- (-1: Ollama's "random": a seed drawn for the request, not the engine's fixed default)
        local seeds = {}
        for _ = 1, 8 do
            local c = chat_of('{"messages": [{"role": "user", "content": "q"}], "options": {"seed": -1}}')
            assert.equal("number", type(c.seed))
            seeds[c.seed] = true
        end
        local distinct = 0
        for _ in pairs(seeds) do distinct = distinct + 1 end
        assert.truthy(distinct >= 7, distinct) -- (31 bits each: two alike in 8 is a 1-in-10^8 chance)
        assert.is_nil(chat.reasoning_effort)
    end)

    it("loads on an empty chat, and continues a final assistant message (a prefill)", function()
        local _, body, view = chat_of('{"model": "tinyloop-austen", "messages": []}')
        assert.same({ "", true }, { body, view.load })
        local answer = cjson.decode(view:load_answer(0))
        assert.same({ "load", "", true }, { answer.done_reason, answer.message.content, answer.done })
        -- keep_alive 0 (ollama stop's) is the unload, as Ollama answers it
        for _, keep in ipairs({ "0", '"0"', '"0s"' }) do
            local _, _, stop_view = chat_of('{"model": "tinyloop-austen", "messages": [], "keep_alive": ' .. keep .. '}')
            assert.equal("unload", cjson.decode(stop_view:load_answer(0)).done_reason, keep)
        end
        local _, _, five = chat_of('{"model": "tinyloop-austen", "messages": [], "keep_alive": "5m"}')
        assert.equal("load", cjson.decode(five:load_answer(0)).done_reason)
        local chat = chat_of('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "She is"}]}')
        assert.is_true(chat.continue_final_message)
        -- one with no text (empty or blanks) is no prefill, as Ollama's open empty turn is none:
        -- it is left out, and the reply is an ordinary one
        for _, blank in ipairs({ '""', '" \\n"', '"\\u001c"' }) do -- (Python's blanks, as chat's rule)
            chat = chat_of('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ' .. blank .. '}]}')
            assert.same({ { { role = "user", content = "q" } }, nil }, { chat.messages, chat.continue_final_message })
        end
    end)

    it("answers each tool message in work linear in the conversation", function()
        -- The work, counted as the VM instructions the conversion runs (the JIT off: a count
        -- hook sees only interpreted code), for n and 4n calls answered: about 4x, not 16x.
        local function work(n)
            local messages = {}
            for _ = 1, n do
                messages[#messages + 1] = { role = "assistant", content = "", tool_calls = { { ["function"] = { name = "z", arguments = {} } } } }
            end
            for _ = 1, n do messages[#messages + 1] = { role = "tool", tool_name = "z", content = "r" } end
            local body = cjson.encode({ messages = messages })
            local count = 0
            jit.off()
            debug.sethook(function() count = count + 1 end, "", 100)
            local ok, chat = pcall(chat_of, body)
            debug.sethook()
            jit.on()
            assert(ok, chat)
            -- each answers its own call, in order (the earliest open one of its name)
            for k = 1, n do assert.equal(chat.messages[k].tool_calls[1].id, chat.messages[n + k].tool_call_id) end
            return count
        end
        local small, large = work(500), work(2000)
        assert.truthy(large < 6 * small, ("%d hook counts for 2000 calls, %d for 500"):format(large, small))
    end)

end)

describe("ollama.generate_to_chat", function()
    it("is a chat turn (system and prompt), or with raw the completions request, or a load", function()
        local chat, _, _, is_chat = chat_of('{"prompt": "Hi", "system": "Be brief.", "options": {"num_predict": 3}}', true)
        assert.is_true(is_chat)
        assert.same({ { role = "system", content = "Be brief." }, { role = "user", content = "Hi" } }, chat.messages)
        chat, _, _, is_chat = chat_of('{"prompt": "It is", "raw": true, "stream": false}', true)
        assert.is_false(is_chat)
        assert.same({ "It is", false }, { chat.prompt, chat.stream })
        -- raw: the prompt as it is, as Ollama takes it: think false changes nothing, an empty
        -- system is none (a system is refused: below)
        local raw_chat = chat_of('{"prompt": "It is", "raw": true, "system": "", "think": false}', true)
        assert.same({ "It is", nil }, { raw_chat.prompt, raw_chat.messages })
        local _, _, view = chat_of('{"model": "tinyloop-austen"}', true)
        assert.is_true(view.load)
        assert.same({ done = true, done_reason = "load", response = "", model = "tinyloop-austen" },
                    (function(t) t.created_at = nil return t end)(cjson.decode(view:load_answer(0))))
        for body, words in pairs({ ['{"prompt": "x", "images": ["aGk="]}'] = "text only", ['{"prompt": "x", "context": [1, 2]}'] = "not kept",
                                   ['{"prompt": "x", "raw": true, "system": "s"}'] = "raw leaves out",
                                   ['{"raw": true, "system": "s"}'] = "raw leaves out", -- (before a load, as Ollama checks)
                                   ['{"prompt": "x", "template": "{{ .Prompt }}"}'] = "the server's",
                                   ['{"prompt": "x", "suffix": "y"}'] = "fill in the middle",
                                   ['{"prompt": "x", "raw": true, "logprobs": true}'] = "the chat path" }) do
            local b, err = ollama.generate_to_chat(body, ID)
            assert.is_nil(b)
            assert.truthy(err.message:find(words, 1, true), err.message)
        end
    end)

    it("cuts a prompt over the context keeping options.num_keep's first tokens (4 left out; a fraction truncated)", function()
        local function keep(options, extra)
            local _, view = assert(ollama.generate_to_chat('{"prompt": "x", "options": ' .. options .. (extra or "") .. '}', ID))
            return view.PARSE_OPTIONS.cut_middle
        end
        assert.same({ 4, 4, 10, 2, 0, math.huge }, { keep('{}'), keep('{"num_keep": null}'), keep('{"num_keep": 10}'),
                                                      keep('{"num_keep": 2.9}'), keep('{"num_keep": 0}'), keep('{"num_keep": -1}') })
        assert.is_nil(keep('{"num_keep": 10}', ', "truncate": false')) -- (no cut: over the context is a 400)
        for _, bad in ipairs({ '"10"', "true", "[1]" }) do
            local b, err = ollama.generate_to_chat('{"prompt": "x", "options": {"num_keep": ' .. bad .. '}}', ID)
            assert.is_nil(b, bad)
            assert.same({ "options", "options.num_keep must be an integer" }, { err.param, err.message })
        end
    end)
end)

describe("ollama view of a chat stream", function()
    it("sends a call whole, once its arguments are, and a cut one not at all", function()
        local _, _, view = chat_of('{"messages": [{"role": "user", "content": "x"}]}')
        view:start_stream("ollama_1_1", 100)
        local function feed(json) return view:feed(json) end
        assert.same({}, feed('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function",' ..
                             '"function":{"name":"f","arguments":""}}]},"finish_reason":null}]}'))
        assert.same({}, feed('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"a\\": 1}"}}]},' ..
                             '"finish_reason":null}]}'))
        local out = feed('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_2","type":"function",' ..
                         '"function":{"name":"g","arguments":"{\\"b\\": 2}"}}]},"finish_reason":null}]}')
        assert.equal(1, #out)
        local first = cjson.decode(out[1][2]).message.tool_calls
        assert.same({ { id = "call_1", ["function"] = { index = 0, name = "f", arguments = { a = 1 } } } }, first)
        out = feed('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":2,"id":"call_3","type":"function",' ..
                   '"function":{"name":"h","arguments":"{}"}}]},"finish_reason":null}]}')
        assert.same({ id = "call_2", ["function"] = { index = 1, name = "g", arguments = { b = 2 } } },
                    cjson.decode(out[1][2]).message.tool_calls[1]) -- (its index: the call's place in the reply)
        out = feed('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":3,"id":"call_4","type":"function",' ..
                   '"function":{"name":"k","arguments":"{\\"c"}}]},"finish_reason":null}]}')
        assert.equal(2, cjson.decode(out[1][2]).message.tool_calls[1]["function"].index) -- (call_3, whole once call_4 began)
        out = feed('{"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":9}}')
        assert.equal(1, #out) -- (the final object: the cut call_4 is no call)
        local final = cjson.decode(out[1][2])
        assert.same({ true, "length", 3, 9 }, { final.done, final.done_reason, final.prompt_eval_count, final.eval_count })
    end)
end)

describe("ollama requests at random", function()
    it("answers each (a valid one with one place changed) with a chat body or a 4xx, never raising", function()
        local H = require "helpers"
        local BASES = {
            { model = ID, messages = { { role = "user", content = "q" },
                                       { role = "assistant", content = "", thinking = "t",
                                         tool_calls = { { ["function"] = { name = "f", arguments = { k = 1 } } } } },
                                       { role = "tool", tool_name = "f", content = "r" } },
              tools = { { type = "function", ["function"] = { name = "f", parameters = { type = "object" } } } },
              options = { temperature = 0.5, num_predict = 5, stop = { "x" }, top_k = 3 }, format = "json", think = true },
            { model = ID, prompt = "p", system = "s", raw = false, options = { seed = 1 }, format = { type = "object" } },
        }
        local words = { "model", "messages", "role", "content", "user", "assistant", "tool", "tool_calls", "function", "name",
                        "arguments", "options", "num_predict", "temperature", "stop", "format", "json", "think", "prompt",
                        "system", "raw", "images", "tool_name", "thinking", "stream" }
        for seed = 1, 3000 do
            local base = BASES[seed % #BASES + 1]
            local body = H.mutated(base, seed, words)
            local convert = base.prompt and ollama.generate_to_chat or ollama.chat_to_chat
            local ok, chat_body, view = pcall(convert, body, ID, seed % 2 == 0)
            assert(ok, body .. " raised " .. tostring(chat_body))
            if chat_body then
                if chat_body ~= "" then assert(cjson.decode(chat_body), body) end
                assert(cjson.decode(view:error({ status = 400, message = "max_tokens must be", param = "max_tokens" }).body))
            else
                assert.truthy(view.status == 400 or view.status == 404, body)
                assert.equal("string", type(view.message), body)
            end
        end
    end)
end)

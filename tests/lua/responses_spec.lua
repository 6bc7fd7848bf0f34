-- responses_spec: tinyloop.server.responses without nginx: a Responses request as the chat
-- request it means (server_spec runs both through a real nginx and compares their answers).
local cjson = require "cjson"
local responses = require "tinyloop.server.responses"
local json_text = require "tinyloop.json_text"

-- The chat body of a Responses body (its JSON text) -> the chat body decoded, its text, the view.
local function chat_of(body)
    local chat_body, view = responses.to_chat(body)
    assert(chat_body, view and view.message)
    return cjson.decode(chat_body), chat_body, view
end

describe("responses.to_chat", function()
    it("makes input a conversation: instructions first, a string the user's message", function()
        local chat = chat_of('{"instructions": "Be brief.", "input": "Hi", "max_output_tokens": 7, "seed": 3, "loops": 2}')
        assert.same({ { role = "system", content = "Be brief." }, { role = "user", content = "Hi" } }, chat.messages)
        assert.same({ 7, 3, 2 }, { chat.max_completion_tokens, chat.seed, chat.loops })
        assert.is_nil(chat.max_output_tokens)
    end)

    it("joins an assistant's function calls, and the reasoning before them, into its one turn", function()
        local chat = chat_of(cjson.encode({ input = {
            { role = "user", content = { { type = "input_text", text = "a" }, { type = "input_text", text = "b" } } },
            { type = "reasoning", summary = { { type = "summary_text", text = "why" } } },
            { type = "message", role = "assistant", content = { { type = "output_text", text = "Let me see.", annotations = {} } } },
            { type = "function_call", call_id = "c1", name = "f", arguments = "{}" },
            { type = "function_call", call_id = "c2", name = "g", arguments = '{"x": 1}' },
            { type = "function_call_output", call_id = "c1", output = "one" },
            { type = "function_call_output", call_id = "c2", output = "two" },
            { type = "reasoning", content = { { type = "reasoning_text", text = "so" } } },
            { type = "function_call", call_id = "c3", name = "f", arguments = "{}" },
        } }))
        local m = chat.messages
        assert.equal(5, #m)
        assert.same({ { type = "text", text = "a" }, { type = "text", text = "b" } }, m[1].content)
        assert.same({ "assistant", "why" }, { m[2].role, m[2].reasoning_content })
        assert.same({ { type = "text", text = "Let me see." } }, m[2].content)
        assert.same({ "c1", "c2" }, { m[2].tool_calls[1].id, m[2].tool_calls[2].id })
        assert.same({ name = "g", arguments = '{"x": 1}' }, m[2].tool_calls[2]["function"])
        assert.same({ role = "tool", tool_call_id = "c1", content = "one" }, m[3])
        assert.same({ role = "tool", tool_call_id = "c2", content = "two" }, m[4])
        -- a call after the tools' answers opens a new turn, with its own reasoning and no content
        assert.same({ "assistant", cjson.null, "so", "c3" }, { m[5].role, m[5].content, m[5].reasoning_content, m[5].tool_calls[1].id })
    end)

    it("passes flat tools and text.format on in chat's shapes, each schema's text as sent", function()
        local schema = '{"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}'
        local _, text = chat_of('{"input": "x", "tools": [{"type": "function", "name": "f", "description": "d", "strict": true, ' ..
            '"parameters": ' .. schema .. '}], "tool_choice": {"type": "function", "name": "f"}, ' ..
            '"text": {"format": {"type": "json_schema", "name": "out", "schema": ' .. schema .. '}}}')
        assert.equal(schema, json_text.member(text, { "tools", 1, "function", "parameters" }))
        assert.equal('"f"', json_text.member(text, { "tools", 1, "function", "name" }))
        assert.equal('"function"', json_text.member(text, { "tools", 1, "type" }))
        assert.equal('{"type":"function","function":{"name":"f"}}', json_text.member(text, { "tool_choice" }))
        assert.equal(schema, json_text.member(text, { "response_format", "json_schema", "schema" }))
        assert.equal('"out"', json_text.member(text, { "response_format", "json_schema", "name" }))
        -- json_object and text
        assert.same({ type = "json_object" }, (chat_of('{"input": "x", "text": {"format": {"type": "json_object"}}}')).response_format)
        assert.same({ type = "text" }, (chat_of('{"input": "x", "text": {"format": {"type": "text"}}}')).response_format)
    end)

    it("asks for logprobs with include or top_logprobs, and gives reasoning.effort to the template", function()
        local chat = chat_of('{"input": "x", "include": ["message.output_text.logprobs"]}')
        assert.same({ true, 0 }, { chat.logprobs, chat.top_logprobs })
        chat = chat_of('{"input": "x", "top_logprobs": 3, "include": ["message.output_text.logprobs"]}')
        assert.same({ true, 3 }, { chat.logprobs, chat.top_logprobs })
        -- (OpenAI's rule: include asks for them, top_logprobs says how many alternatives)
        assert.is_nil((chat_of('{"input": "x", "top_logprobs": 3}')).logprobs)
        assert.is_nil((chat_of('{"input": "x", "include": ["reasoning.encrypted_content"]}')).logprobs)
        chat = chat_of('{"input": "x", "reasoning": {"effort": "high"}}')
        assert.same({ reasoning_effort = "high" }, chat.chat_template_kwargs)
        local _, text = chat_of('{"input": "x", "reasoning": {"effort": "low"}, "chat_template_kwargs": {"b": 1, "a": 2}}')
        assert.equal('{"reasoning_effort":"low","b": 1, "a": 2}', json_text.member(text, { "chat_template_kwargs" }))
        -- the request's own variable wins
        _, text = chat_of('{"input": "x", "reasoning": {"effort": "low"}, "chat_template_kwargs": {"reasoning_effort": "high"}}')
        assert.equal('{"reasoning_effort": "high"}', json_text.member(text, { "chat_template_kwargs" }))
    end)

    it("names the input item, or instructions, that a chat message's fault came from", function()
        local _, _, view = chat_of('{"instructions": "x", "input": [{"role": "user", "content": "a"}, ' ..
            '{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}')
        local e = view:error({ status = 400, message = "messages[2].tool_calls[0].function.arguments must be ...", param = "messages" })
        assert.same({ 400, "input[1].arguments must be ...", "input" }, { e.status, e.message, e.param })
        e = view:error({ status = 400, message = "messages[0].content must be a string", param = "messages" })
        assert.same({ "instructions.content must be a string", "instructions" }, { e.message, e.param })
        e = view:error({ status = 400, message = "the messages (9 tokens) plus max_completion_tokens (5) exceed", param = "max_completion_tokens" })
        assert.same({ "the input (9 tokens) plus max_output_tokens (5) exceed", "max_output_tokens" }, { e.message, e.param })
        -- (the engine's word for the limit, max_tokens, is the Responses field too)
        e = view:error({ status = 400, message = "min_tokens = 5 must be in [0, max_tokens = 3]", param = "min_tokens" })
        assert.equal("min_tokens = 5 must be in [0, max_output_tokens = 3]", e.message)
        e = view:error({ status = 400, message = "response_format.json_schema.schema: bad", param = "response_format" })
        assert.same({ "text.format.schema: bad", "text" }, { e.message, e.param })
    end)

    it("refuses bad input, naming the field", function()
        local cases = {
            { "", nil, "JSON object" }, { "[1]", nil, "JSON object" }, { "{", nil, "not valid JSON" },
            { '{"input": 5}', "input", "input must be a string or a non-empty array" },
            { '{"input": "x", "instructions": 5}', "instructions", "instructions must be a string" },
            { '{"input": "x", "tools": {"a": 1}}', "tools", "tools must be an array" },
            { '{"input": "x", "tools": [{"type": "function", "name": "f", "extra": 1}]}', "tools", "unknown field 'extra' in tools[0]" },
            { '{"input": [{"role": "user", "content": "a", "x": 1}]}', "input", "unknown field 'x' in input[0]" },
            { '{"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}', "input", "input[0].arguments must be a string" },
            { '{"input": [{"type": "function_call_output", "output": "o"}]}', "input", "input[0].call_id must be a string" },
            { '{"input": [{"type": "reasoning", "content": [5]}]}', "input", "input[0].content[0]" },
            { '{"input": [{"role": "user", "content": []}]}', "input", "input[0].content must be" },
            { '{"input": "x", "text": {"format": {"type": "json_object", "name": "n"}}}', "text", "no other fields" },
            { '{"input": "x", "text": {"verbosity": "loud"}}', "text", "text.verbosity" },
            { '{"input": "x", "text": {"size": 1}}', "text", "unknown field 'size' in text" },
            { '{"input": "x", "tool_choice": {"type": "function"}}', "tool_choice", '"name"' },
            -- (a word it does not know: this API's shapes named, not chat's {"function": {...}})
            { '{"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], ' ..
              '"tool_choice": "sometimes"}', "tool_choice",
              'tool_choice must be "none", "auto", "required", {"type": "function", "name": ...} or {"type": "allowed_tools"' },
            { '{"input": "x", "text": {"format": "json"}}', "text", 'text.format must be an object {"type": ...}' },
            { '{"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools", ' ..
              '"mode": "any", "tools": [{"type": "function", "name": "f"}]}}', "tool_choice", 'tool_choice.mode must be "auto" or "required"' },
            { '{"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools", ' ..
              '"mode": "auto", "tools": []}}', "tool_choice", "tool_choice.tools must be a non-empty array of tools" },
            { '{"input": "x", "top_logprobs": -1}', "top_logprobs", "top_logprobs = -1" },
            { '{"input": "x", "top_logprobs": 21}', "top_logprobs", "top_logprobs = 21 must be in [0, 20]" }, -- (without include too)
            { '{"input": "x", "reasoning": {"depth": 1}}', "reasoning", "unknown field 'depth' in reasoning" },
            { '{"input": "x", "service_tier": "flex"}', "service_tier", "service_tier" },
            { '{"input": "x", "stream_options": {"include_usage": true}}', "stream_options", "include_obfuscation" },
            { '{"input": [{"type": "reasoning", "summary": []}]}', "input", "holds no message" },
            { '{"input": [{"role": "user", "content": "a", "phase": "final_answer"}]}', "input", "input[0].phase" },
            { '{"input": "x", "truncation": "middle"}', "truncation", "truncation" },
            { '{"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools", ' ..
              '"mode": "auto", "tools": [{"type": "function", "name": "g"}]}}', "tool_choice", "not among tools" },
            { '{"input": "x", "prompt": {"id": "p"}}', "prompt", "prompt templates" },
            { '{"input": "x", "n": 2}', "n", "unknown field 'n'" },
            { '{"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": 5}]}]}', "input",
              "input[0].content[0].refusal must be a string" },
            { '{"input": [{"type": "item_reference", "id": "msg_1"}]}', "input", 'input[0]: item "msg_1" is not found' },
            { '{"input": [{"type": "item_reference", "id": 5}]}', "input", "input[0].id must be a string" },
            { '{"input": [{"type": "item_reference", "id": "msg_1", "x": 1}]}', "input", "unknown field 'x' in input[0]" },
            { '{"input": "x", "background": true}', "background", "background responses are not supported" },
        }
        require("helpers").refuses(responses.to_chat, cases)
    end)
end)

describe("responses.to_chat: what OpenAI's clients send back", function()
    it("takes an assistant message's phase, a refusal part, and the fields that change nothing here", function()
        local chat = chat_of(cjson.encode({ input = {
            { role = "user", content = "q" },
            { type = "message", role = "assistant", phase = "final_answer", status = "completed", id = "msg_1",
              content = { { type = "output_text", text = "a", annotations = {}, logprobs = {} }, { type = "refusal", refusal = "no" } } },
            { role = "user", content = "q2" } },
            truncation = "auto", max_tool_calls = 3, prompt_cache_retention = "24h", text = { verbosity = "low" },
            stream_options = { include_obfuscation = cjson.null }, prompt_cache_options = { mode = "implicit" },
            context_management = { { type = "compaction", compact_threshold = 200 } }, reasoning = { effort = "max" },
            client_metadata = { ["x-codex-installation-id"] = "i" } }))
        assert.same({ { type = "text", text = "a" }, { type = "text", text = "no" } }, chat.messages[2].content)
        assert.is_nil(chat.messages[2].phase)
        -- and the answer echoes them as sent (they were left out, or said null for the sent value)
        local _, _, view = chat_of(cjson.encode({ input = "q", max_tool_calls = 3, prompt_cache_key = "k", safety_identifier = "u1",
                                                 text = { verbosity = "low" }, reasoning = { summary = "auto" }, truncation = "auto" }))
        local answer = { created = 1, model = "m", choices = { { index = 0, finish_reason = "stop",
                         message = { role = "assistant", content = "a" } } },
                         usage = { prompt_tokens = 1, completion_tokens = 1, total_tokens = 2 } }
        local r = cjson.decode(view:response(cjson.encode(answer), "resp_1_1"))
        assert.same({ 3, "k", "u1", "low", "auto", "auto" }, { r.max_tool_calls, r.prompt_cache_key, r.safety_identifier,
                                                              r.text.verbosity, r.reasoning.summary, r.truncation })
        _, _, view = chat_of('{"input": "q"}') -- (OpenAI's defaults)
        r = cjson.decode(view:response(cjson.encode(answer), "resp_1_2"))
        assert.same({ "medium", cjson.null, cjson.null, "disabled" }, { r.text.verbosity, r.prompt_cache_key, r.max_tool_calls,
                                                                        r.truncation })
    end)

    it("gives reasoning to its own assistant turn only", function()
        local function reasoning(t) return { type = "reasoning", summary = { { type = "summary_text", text = t } } } end
        local chat = chat_of(cjson.encode({ input = {
            { role = "user", content = "q" }, reasoning("R1"), { role = "assistant", content = "Let me check" }, reasoning("R2"),
            { type = "function_call", call_id = "c", name = "f", arguments = "{}" },
            { type = "function_call_output", call_id = "c", output = "o" },
            reasoning("OLD"), { role = "user", content = "q2" }, { role = "assistant", content = "a2" } } }))
        local m = chat.messages
        assert.same({ "R1\nR2", "c" }, { m[2].reasoning_content, m[2].tool_calls[1].id })
        assert.same({ "assistant", "a2" }, { m[5].role, m[5].content })
        assert.is_nil(m[5].reasoning_content) -- (OLD was nobody's: a user's turn came between)
    end)

    it("cuts the tools to those an allowed_tools choice names", function()
        local chat = chat_of(cjson.encode({ input = "x",
            tools = { { type = "function", name = "f" }, { type = "function", name = "g" }, { type = "function", name = "h" } },
            tool_choice = { type = "allowed_tools", mode = "required", tools = { { type = "function", name = "h" },
                                                                               { type = "function", name = "f" } } } }))
        assert.same({ "f", "h" }, { chat.tools[1]["function"].name, chat.tools[2]["function"].name })
        assert.equal(2, #chat.tools)
        assert.equal("required", chat.tool_choice)
    end)

    it("names the call item a chat error about a merged turn's call came from, and a tool's own fields", function()
        local _, _, view = chat_of(cjson.encode({ input = {
            { role = "user", content = "q" }, { type = "function_call", call_id = "a", name = "f", arguments = "{}" },
            { type = "function_call", call_id = "b", name = "f", arguments = "[]" } } }))
        local e = view:error({ status = 400, message = "messages[1].tool_calls[1].function.arguments must be the JSON text of an object",
                               param = "messages" })
        assert.equal("input[2].arguments must be the JSON text of an object", e.message)
        e = view:error({ status = 400, message = "tools[0].function.parameters must be an object", param = "tools" })
        assert.equal("tools[0].parameters must be an object", e.message)
    end)
end)

describe("responses.to_chat: item references", function()
    it("reads an item_reference as the stored output item it names (the AI SDK sends replies back so)", function()
        local reply = { role = "assistant", content = "She is.", reasoning_content = "hm",
                        tool_calls = { { id = "call_1", type = "function", ["function"] = { name = "f", arguments = '{"a":1}' } } } }
        local key = "0123456789abcdef"
        local function lookup_item(id) return responses.reply_item(reply, id) end
        assert.same({ type = "message", role = "assistant", content = "She is." }, lookup_item("msg_" .. key))
        assert.same({ type = "reasoning", summary = { { type = "summary_text", text = "hm" } } }, lookup_item("rs_" .. key))
        assert.same({ type = "function_call", call_id = "call_1", name = "f", arguments = '{"a":1}' }, lookup_item("fc_" .. key .. "_1"))
        assert.same({ nil, nil, nil }, { lookup_item("fc_" .. key .. "_2"), lookup_item("msg_" .. key .. "_in1"), lookup_item("msg_12") })
        local body = cjson.encode({ input = { { role = "user", content = "Who?" }, { type = "item_reference", id = "rs_" .. key },
                                              { type = "item_reference", id = "msg_" .. key }, { role = "user", content = "And?" } } })
        local chat_body = assert(responses.to_chat(body, nil, lookup_item))
        local messages = cjson.decode(chat_body).messages
        assert.same({ role = "assistant", content = "She is.", reasoning_content = "hm" }, messages[2])
        assert.same({ "user", "assistant", "user" }, { messages[1].role, messages[2].role, messages[3].role })
        -- the store's key of a response id: its public part, none for one not stored
        assert.same({ key, nil }, { responses.stored_key("resp_" .. key .. ("0"):rep(32)), responses.stored_key("resp_7_12") })
    end)
end)

describe("responses.to_chat: a large request", function()
    it("reads many tools in one pass over the body", function()
        -- (json_text.member per tool's field rescanned the whole body). The work, counted as the
        -- text each scan of a container is given, stays a few times the body's.
        local tools = {}
        for k = 1, 2000 do tools[k] = ('{"type": "function", "name": "f%d", "parameters": {"type": "object"}}'):format(k) end
        local body = '{"input": "x", "tools": [' .. table.concat(tools, ",") .. ']}'
        local scanned, chat = require("helpers").text_scanned(chat_of, body)
        assert.equal("f2000", chat.tools[2000]["function"].name)
        assert.truthy(scanned < 10 * #body, ("%d bytes scanned for a body of %d"):format(scanned, #body))
    end)
end)

describe("responses view of a chat stream", function()
    it("says an error mid-stream as an error event, and nothing after it", function()
        local _, _, view = chat_of('{"input": "x", "stream": true}')
        view:start_stream("resp_1_2", 100, "m")
        local events = view:feed('{"error":{"message":"engine failed","type":"server_error","param":null}}')
        assert.equal(1, #events)
        assert.same({ type = "error", sequence_number = 0, code = "server_error", message = "engine failed", param = cjson.null },
                    cjson.decode(events[1][2]))
        assert.same({}, view:feed('{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}'))
        assert.same({}, view:feed("[DONE]"))
        -- after output: the error, then the response's end, failed, with what it had
        _, _, view = chat_of('{"input": "x", "stream": true}')
        view:start_stream("resp_1_3", 100, "m")
        view:feed('{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}')
        events = view:feed('{"error":{"message":"engine failed","type":"server_error","param":null}}')
        local kinds = {}
        for i, e in ipairs(events) do kinds[i] = e[1] end
        assert.same({ "error", "response.output_text.done", "response.content_part.done", "response.output_item.done",
                      "response.failed" }, kinds)
        local failed = cjson.decode(events[#events][2]).response
        assert.same({ "failed", "server_error", "Hel", "incomplete" }, { failed.status, failed.error.code,
                    failed.output[1].content[1].text, failed.output[1].status })
    end)

    it("gives the message the logprobs of its own tokens, streamed as blocking, where a read also ends the reasoning", function()
        local function entry(token)
            local bytes = {}
            for i = 1, #token do bytes[i] = token:byte(i) end
            return { token = token, logprob = -1, bytes = bytes, top_logprobs = cjson.empty_array or {} }
        end
        local entries = { entry("Hm"), entry("</think>"), entry("Hi"), entry(",") }
        local logprobs = { content = entries }
        local _, _, view = chat_of('{"input": "x", "stream": true, "include": ["message.output_text.logprobs"]}')
        view:start_stream("resp_1_5", 100, "m")
        local chunk = { choices = { { index = 0, delta = { reasoning_content = "Hm", content = "Hi," }, logprobs = logprobs,
                                      finish_reason = "stop" } },
                        usage = { prompt_tokens = 3, completion_tokens = 4, total_tokens = 7 } }
        local events = view:feed(cjson.encode(chunk))
        local streamed = cjson.decode(events[#events][2]).response.output[2].content[1].logprobs
        assert.same({ "Hi", "," }, { streamed[1].token, streamed[2].token })
        assert.equal(2, #streamed)
        -- the blocking answer of the same reply
        _, _, view = chat_of('{"input": "x", "include": ["message.output_text.logprobs"]}')
        local answer = { created = 1, model = "m", choices = { { index = 0, finish_reason = "stop", logprobs = logprobs,
                         message = { role = "assistant", content = "Hi,", reasoning_content = "Hm" } } },
                         usage = chunk.usage }
        local blocking = cjson.decode(view:response(cjson.encode(answer), "resp_1_6")).output[2].content[1].logprobs
        assert.same(streamed, blocking)
        -- the same reply read in pieces: the reasoning, the tag's tokens in chunks with neither
        -- text nor reasoning, then the text (the tag's tokens were given to the text)
        local parts = { { { reasoning_content = "Hm" }, { entry("Hm"), entry("<") } },
                        { {}, { entry("/th") } }, { {}, { entry("ink>") } },
                        { { content = "Hi" }, { entry("Hi") } }, { { content = "," }, { entry(",") } } }
        -- A reply streamed in parts ({delta, logprobs entries} each, the last finishing) -> the
        -- message's logprobs in the final response event.
        local function streamed_logprobs(parts, id)
            local _, _, stream_view = chat_of('{"input": "x", "stream": true, "include": ["message.output_text.logprobs"]}')
            stream_view:start_stream(id, 100, "m")
            local fed
            for i, part in ipairs(parts) do
                local piece = { choices = { { index = 0, delta = part[1], logprobs = { content = part[2] },
                                              finish_reason = i == #parts and "stop" or nil } } }
                if i == #parts then piece.usage = chunk.usage end
                fed = stream_view:feed(cjson.encode(piece))
            end
            return cjson.decode(fed[#fed][2]).response.output[2].content[1].logprobs
        end
        streamed = streamed_logprobs(parts, "resp_1_7")
        assert.same({ "Hi", "," }, { streamed[1].token, streamed[2] and streamed[2].token })
        assert.equal(2, #streamed)
        -- a text the tag also writes (">"): found after </think>, blocking and streamed (the
        -- tag's ">" was given to it, and its own last token left out); the tokens held at the end
        -- with no text after them (an end of text) are not the message's
        local function lp_entry(token, logprob) local e = entry(token) e.logprob = logprob return e end
        local gt = { lp_entry("Hm", -1), lp_entry("<", -2), lp_entry("/th", -3), lp_entry("ink>", -4), lp_entry(">", -5),
                     lp_entry(">", -6), lp_entry("<|endoftext|>", -7) }
        _, _, view = chat_of('{"input": "x", "include": ["message.output_text.logprobs"]}')
        answer = { created = 1, model = "m", choices = { { index = 0, finish_reason = "stop", logprobs = { content = gt },
                   message = { role = "assistant", content = ">>", reasoning_content = "Hm" } } }, usage = chunk.usage }
        blocking = cjson.decode(view:response(cjson.encode(answer), "resp_1_8")).output[2].content[1].logprobs
        assert.same({ -5, -6 }, { blocking[1].logprob, blocking[2] and blocking[2].logprob })
        assert.equal(2, #blocking)
        parts = { { { reasoning_content = "Hm" }, { gt[1], gt[2] } }, { {}, { gt[3], gt[4] } },
                  { { content = ">" }, { gt[5] } }, { { content = ">" }, { gt[6] } }, { {}, { gt[7] } } }
        streamed = streamed_logprobs(parts, "resp_1_9")
        assert.same(blocking, streamed)
        -- the deltas carry every logprob the message has: an end of text's too, in a delta of
        -- no text (the deltas had one fewer than the final message)
        _, _, view = chat_of('{"input": "x", "stream": true, "include": ["message.output_text.logprobs"]}')
        view:start_stream("resp_1_12", 100, "m")
        local gathered, done = {}, nil
        local function gather(fed)
            for _, e in ipairs(fed) do
                local event = cjson.decode(e[2])
                if e[1] == "response.output_text.delta" then
                    for _, lp in ipairs(event.logprobs) do gathered[#gathered + 1] = lp.logprob end
                elseif e[1] == "response.output_text.done" then
                    done = event.logprobs
                end
            end
        end
        gather(view:feed(cjson.encode({ choices = { { index = 0, delta = { content = "Hi" },
                                                      logprobs = { content = { lp_entry("Hi", -1) } } } } })))
        gather(view:feed(cjson.encode({ choices = { { index = 0, delta = {}, finish_reason = "stop",
                                                      logprobs = { content = { lp_entry("<|endoftext|>", -2) } } } },
                                        usage = chunk.usage })))
        assert.same({ -1, -2 }, gathered)
        assert.same({ -1, -2 }, { done[1].logprob, done[2] and done[2].logprob })
        -- no reasoning (a template not read for it): a "</think>" in the text is text, not a
        -- place to search from (every token, the call's too, was given to the message)
        local plain = { lp_entry("<think>", -1), lp_entry("x", -2), lp_entry("</think>", -3), lp_entry("Hi", -4),
                        lp_entry("<tool_call>", -5), lp_entry('{"name": "f", "arguments": {}}', -6), lp_entry("</tool_call>", -7) }
        _, _, view = chat_of('{"input": "x", "include": ["message.output_text.logprobs"]}')
        answer = { created = 1, model = "m", choices = { { index = 0, finish_reason = "tool_calls", logprobs = { content = plain },
                   message = { role = "assistant", content = "<think>x</think>Hi",
                               tool_calls = { { id = "call_1", type = "function", ["function"] = { name = "f", arguments = "{}" } } } } } },
                   usage = chunk.usage }
        blocking = cjson.decode(view:response(cjson.encode(answer), "resp_1_10")).output[1].content[1].logprobs
        assert.same({ -1, -2, -3, -4 }, { blocking[1].logprob, blocking[2].logprob, blocking[3].logprob, blocking[4].logprob })
        assert.equal(4, #blocking)
        -- streamed text after a call's pieces: the call's tokens are not held for it
        _, _, view = chat_of('{"input": "x", "stream": true, "include": ["message.output_text.logprobs"]}')
        view:start_stream("resp_1_11", 100, "m")
        view:feed(cjson.encode({ choices = { { index = 0, delta = { tool_calls = { { index = 0, id = "call_1", type = "function",
            ["function"] = { name = "f", arguments = "{}" } } } }, logprobs = { content = { lp_entry('"arguments": {}}', -3) } } } } }))
        events = view:feed(cjson.encode({ choices = { { index = 0, delta = { content = "a" }, finish_reason = "stop",
                                                         logprobs = { content = { lp_entry("a", -5) } } } }, usage = chunk.usage }))
        local final, messages = cjson.decode(events[#events][2]).response, 0
        for _, item in ipairs(final.output) do
            if item.type == "message" then
                messages = messages + 1
                assert.same({ -5 }, { item.content[1].logprobs[1].logprob })
            end
        end
        assert.equal(1, messages)
    end)

    it("ends a reasoning the token limit cut as the incomplete item, with no message after it, streamed or not", function()
        -- (OpenAI's answer: it was "completed", and an empty message after it "incomplete")
        local _, _, view = chat_of('{"input": "x", "stream": true}')
        view:start_stream("resp_1_20", 100, "m")
        view:feed('{"choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"Let me"},"finish_reason":null}]}')
        local events = view:feed('{"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":' ..
                                 '{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}')
        local streamed = cjson.decode(events[#events][2]).response
        assert.same({ "incomplete", 1, "reasoning", "incomplete" },
                    { streamed.status, #streamed.output, streamed.output[1].type, streamed.output[1].status })
        _, _, view = chat_of('{"input": "x"}')
        local answer = { created = 1, model = "m", choices = { { index = 0, finish_reason = "length",
                         message = { role = "assistant", content = "", reasoning_content = "Let me" } } },
                         usage = { prompt_tokens = 3, completion_tokens = 2, total_tokens = 5 } }
        local blocking = cjson.decode(view:response(cjson.encode(answer), "resp_1_21"))
        assert.same({ "incomplete", 1, "reasoning", "incomplete" },
                    { blocking.status, #blocking.output, blocking.output[1].type, blocking.output[1].status })
        -- reasoning, then text the limit cut: the message is the incomplete one, as before
        answer.choices[1].message.content = "Hi"
        blocking = cjson.decode(view:response(cjson.encode(answer), "resp_1_22"))
        assert.same({ 2, "completed", "incomplete" }, { #blocking.output, blocking.output[1].status, blocking.output[2].status })
    end)

    it("flattens namespace tools' functions (Codex's multi_agent_v1), and answers their calls with the namespace", function()
        local params = '{"type": "object", "properties": {"prompt": {"type": "string"}}}'
        local body = '{"input": "x", "tools": [{"type": "function", "name": "shell", "parameters": {}}, ' ..
            '{"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [' ..
            '{"type": "function", "name": "spawn_agent", "description": "Spawn one.", "defer_loading": true, "parameters": ' .. params .. '},' ..
            '{"type": "function", "name": "wait", "strict": false}]}]}'
        local chat, text = chat_of(body)
        assert.same({ "shell", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait" },
                    { chat.tools[1]["function"].name, chat.tools[2]["function"].name, chat.tools[3]["function"].name })
        assert.equal(params, json_text.member(text, { "tools", 2, "function", "parameters" })) -- (as sent)
        assert.same({ "multi_agent_v1: Sub-agents.\nSpawn one.", "multi_agent_v1: Sub-agents." },
                    { chat.tools[2]["function"].description, chat.tools[3]["function"].description })
        -- the answer's call items: the function's own name and its namespace, blocking and streamed
        local _, _, view = chat_of(body)
        local answer = cjson.decode(view:response(cjson.encode({ created = 1, model = "m", choices = { { index = 0,
            message = { role = "assistant", content = cjson.null, tool_calls = {
                { id = "call_1", type = "function", ["function"] = { name = "multi_agent_v1__spawn_agent", arguments = '{"prompt":"a"}' } },
                { id = "call_2", type = "function", ["function"] = { name = "shell", arguments = "{}" } } } },
            finish_reason = "tool_calls" } }, usage = { prompt_tokens = 1, completion_tokens = 2, total_tokens = 3 } }), "resp_1_9"))
        assert.same({ "spawn_agent", "multi_agent_v1", "shell", nil },
                    { answer.output[1].name, answer.output[1].namespace, answer.output[2].name, answer.output[2].namespace })
        _, _, view = chat_of(body:gsub('^{', '{"stream": true, '))
        view:start_stream("resp_1_4", 100, "m")
        local added = view:feed('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function",' ..
                                '"function":{"name":"multi_agent_v1__wait","arguments":"{}"}}]},"finish_reason":null}]}')
        local events = view:feed('{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}],"usage":' ..
                                 '{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}}')
        local item
        for _, e in ipairs(added) do
            if e[1] == "response.output_item.added" then item = cjson.decode(e[2]).item end
        end
        assert.same({ "wait", "multi_agent_v1" }, { item.name, item.namespace })
        local final = cjson.decode(events[#events][2]).response
        assert.same({ "wait", "multi_agent_v1" }, { final.output[1].name, final.output[1].namespace })
        -- a function_call input item with its namespace: the declared function, as chat names it
        chat = chat_of('{"input": [{"role": "user", "content": "Go."}, {"type": "function_call", "call_id": "c1", ' ..
                       '"namespace": "multi_agent_v1", "name": "wait", "arguments": "{}"}, ' ..
                       '{"type": "function_call_output", "call_id": "c1", "output": "done"}]}')
        assert.equal("multi_agent_v1__wait", chat.messages[2].tool_calls[1]["function"].name)
        -- allowed_tools naming the namespace allows its functions (they were all dropped)
        chat = chat_of(body:gsub('}$', ', "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": ' ..
                                        '[{"type": "function", "name": "multi_agent_v1"}]}}'))
        assert.same({ 2, "multi_agent_v1__spawn_agent", "required" }, { #chat.tools, chat.tools[1]["function"].name, chat.tool_choice })
        -- refused, naming the place in the request: other tool types in a namespace, a bad name,
        -- an empty namespace, a name too long as the model sees it, a function twice, bad
        -- parameters, a hosted tool
        for _, case in ipairs({
            { '{"type": "namespace", "name": "' .. ("n"):rep(40) .. '", "tools": [{"type": "function", "name": "' .. ("f"):rep(30) .. '"}]}',
              "tools[0].tools[0].name: " .. ("n"):rep(40) .. "__" .. ("f"):rep(30) .. ", the name the model sees, is 72 characters: at most 64" },
            { '{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}',
              "tools[0].tools[1].name: ns__f is declared twice" },
            { '{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}',
              "tools[0].tools[0].parameters must be a JSON Schema object" },
            { '{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f b"}]}', "tools[0].tools[0].name must be letters" },
            { '{"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "c"}]}', 'tools[0].tools[0].type = "custom"' },
            { '{"type": "namespace", "name": "a b", "tools": [{"type": "function", "name": "f"}]}', "tools[0].name must be letters" },
            { '{"type": "namespace", "name": "ns", "tools": []}', "tools[0].tools must be a non-empty array" },
            { '{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f", "x": 1}]}', "tools[0].tools[0]" },
            { '{"type": "web_search"}', 'tools[0].type = "web_search": only "function" tools are served here (and "namespace"' } }) do
            local refused, err = responses.to_chat('{"input": "x", "tools": [' .. case[1] .. ']}')
            assert.is_nil(refused)
            assert.truthy(err.message:find(case[2], 1, true), err.message)
        end
    end)

    it("ends a call whose arguments are whole as completed, one the token limit cut as incomplete", function()
        for _, case in ipairs({ { '{\\"a\\": 1}', "completed" }, { '{\\"a', "incomplete" } }) do
            local _, _, view = chat_of('{"input": "x", "stream": true}')
            view:start_stream("resp_1_4", 100, "m")
            view:feed('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function",' ..
                      '"function":{"name":"f","arguments":""}}]},"finish_reason":null}]}')
            view:feed('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"' .. case[1] ..
                      '"}}]},"finish_reason":null}]}')
            local events = view:feed('{"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":' ..
                                     '{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}}')
            local final = cjson.decode(events[#events][2]).response
            assert.same({ "incomplete", case[2], 1 }, { final.status, final.output[1].status, #final.output })
        end
    end)
end)

describe("responses: stored responses (previous_response_id)", function()
    local earlier = { { role = "user", content = "My name is Emma." }, { role = "assistant", content = "Hello, Emma." } }
    local store = { resp_1_1 = earlier }
    local function lookup(id) return store[id] and cjson.decode(cjson.encode(store[id])) or nil end

    it("continues the stored conversation: instructions first, then it, then the input", function()
        local chat_body, view = responses.to_chat('{"instructions": "Be brief.", "input": "Who am I?", ' ..
                                                  '"previous_response_id": "resp_1_1"}', lookup)
        assert(chat_body, view and view.message)
        local messages = cjson.decode(chat_body).messages
        assert.same({ { role = "system", content = "Be brief." }, earlier[1], earlier[2], { role = "user", content = "Who am I?" } },
                    messages)
        assert.is_true(view.store)
        -- the answer echoes both; the conversation kept has no instructions (OpenAI's rule)
        local answer = { created = 1, model = "m", choices = { { index = 0, finish_reason = "stop",
                         message = { role = "assistant", content = "Emma." } } },
                         usage = { prompt_tokens = 9, completion_tokens = 2, total_tokens = 11 } }
        local final = view:response(cjson.encode(answer), "resp_1_2")
        local r = cjson.decode(final)
        assert.same({ "resp_1_1", true }, { r.previous_response_id, r.store })
        -- kept: its own messages (the earlier ones are their response's), and which it continued
        local messages, kept, previous = view:record()
        assert.equal(final, kept)
        assert.equal("resp_1_1", previous)
        assert.same({ { role = "user", content = "Who am I?" }, { role = "assistant", content = "Emma." } },
                    cjson.decode(messages))
    end)

    it("keeps a reply's calls and reasoning, streamed as blocking", function()
        local answer = { created = 1, model = "m", choices = { { index = 0, finish_reason = "tool_calls",
                         message = { role = "assistant", content = cjson.null, reasoning_content = "Look it up.", tool_calls = {
                             { id = "call_9", type = "function", ["function"] = { name = "f", arguments = '{"a": 1}' } } } } } },
                         usage = { prompt_tokens = 3, completion_tokens = 5, total_tokens = 8 } }
        local _, view = responses.to_chat('{"input": "x"}', lookup)
        view:response(cjson.encode(answer), "resp_1_3")
        local blocking = cjson.decode((view:record()))
        assert.is_nil(select(3, view:record())) -- (it continued none)
        assert.same({ role = "assistant", content = cjson.null, reasoning_content = "Look it up.",
                      tool_calls = { { id = "call_9", type = "function", ["function"] = { name = "f", arguments = '{"a": 1}' } } } },
                    blocking[2])
        _, view = responses.to_chat('{"input": "x", "stream": true}', lookup)
        view:start_stream("resp_1_4", 1, "m")
        assert.is_nil(view:record()) -- (nothing until it ends)
        view:feed('{"choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"Look it up."},"finish_reason":null}]}')
        view:feed('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_9","type":"function",' ..
                  '"function":{"name":"f","arguments":"{\\"a\\": 1}"}}]},"finish_reason":null}]}')
        view:feed('{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}],"usage":' ..
                  '{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}')
        assert.same(blocking, cjson.decode((view:record())))
        -- a call the token limit cut is left out of what is kept, as a blocking answer leaves it out
        _, view = responses.to_chat('{"input": "x", "stream": true}', lookup)
        view:start_stream("resp_1_7", 1, "m")
        view:feed('{"choices":[{"index":0,"delta":{"content":"Let me see."},"finish_reason":null}]}')
        view:feed('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_8","type":"function",' ..
                  '"function":{"name":"f","arguments":"{\\"a\\": "}}]},"finish_reason":null}]}')
        view:feed('{"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":' ..
                  '{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}')
        assert.same({ role = "assistant", content = "Let me see." }, cjson.decode((view:record()))[2])
        -- a stream that failed is not kept
        _, view = responses.to_chat('{"input": "x", "stream": true}', lookup)
        view:start_stream("resp_1_5", 1, "m")
        view:feed('{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}')
        view:feed('{"error":{"message":"engine failed","type":"server_error","param":null}}')
        assert.is_nil(view:record())
    end)

    it("keeps nothing with store: false or without a store, and says so", function()
        local answer = cjson.encode({ created = 1, model = "m", choices = { { index = 0, finish_reason = "stop",
                                      message = { role = "assistant", content = "a" } } } })
        for _, case in ipairs({ { '{"input": "x", "store": false}', lookup }, { '{"input": "x"}', nil } }) do
            local _, view = responses.to_chat(case[1], case[2])
            assert.is_false(cjson.decode(view:response(answer, "resp_1_6")).store)
            assert.is_nil(view:record())
        end
        local body, err = responses.to_chat('{"input": "x", "previous_response_id": "resp_1_1"}')
        assert.is_nil(body)
        assert.same({ 400, "previous_response_id", "previous_response_not_found" }, { err.status, err.param, err.code })
        assert.truthy(err.message:find("not stored by this server", 1, true), err.message)
        body, err = responses.to_chat('{"input": "x", "previous_response_id": "resp_9_9"}', lookup)
        assert.is_nil(body)
        -- (OpenAI's status and code, which clients read to send the whole conversation instead)
        assert.same({ 400, "previous_response_id", "previous_response_not_found" }, { err.status, err.param, err.code })
        assert.truthy(err.message:find('Previous response with id "resp_9_9" not found', 1, true), err.message)
        body, err = responses.to_chat('{"input": "x", "previous_response_id": 7}', lookup)
        assert.same({ 400, "previous_response_id" }, { err.status, err.param })
        body, err = responses.to_chat('{"input": "x", "conversation": "conv_1"}', lookup)
        assert.truthy(err.message:find("conversation objects are not kept here", 1, true), err.message)
    end)

    it("makes an input's function call a turn of its own after an earlier reply", function()
        local chat_body = responses.to_chat(cjson.encode({ previous_response_id = "resp_1_1", input = {
            { type = "function_call", call_id = "c1", name = "f", arguments = "{}" },
            { type = "function_call_output", call_id = "c1", output = "done" } } }), lookup)
        local m = cjson.decode(chat_body).messages
        assert.equal(4, #m)
        assert.same({ role = "assistant", content = "Hello, Emma." }, m[2])
        assert.same({ "assistant", "c1", "tool" }, { m[3].role, m[3].tool_calls[1].id, m[4].role })
    end)

    it("lists a stored response's input as items, OpenAI's list and paging", function()
        local messages = cjson.encode({
            { role = "developer", content = "Be brief." }, { role = "user", content = { { type = "text", text = "Hi" } } },
            { role = "assistant", content = cjson.null, reasoning_content = "Look.", tool_calls = {
                { id = "c1", type = "function", ["function"] = { name = "f", arguments = "{}" } } } },
            { role = "tool", tool_call_id = "c1", content = "done" },
            { role = "assistant", content = "the reply: not input" } })
        local list = cjson.decode((assert(responses.input_items(messages, "resp_ab", "asc", 20))))
        local kinds = {}
        for i, item in ipairs(list.data) do kinds[i] = item.type .. ":" .. (item.role or item.call_id or "") end
        assert.same({ "message:developer", "message:user", "reasoning:", "function_call:c1", "function_call_output:c1" }, kinds)
        assert.same({ { type = "input_text", text = "Hi" } }, list.data[2].content)
        assert.same({ "f", "{}" }, { list.data[4].name, list.data[4].arguments })
        assert.equal("done", list.data[5].output)
        assert.same({ list.data[1].id, list.data[5].id, false }, { list.first_id, list.last_id, list.has_more })
        -- desc (OpenAI's default), a page of 2, then the next after it; the ids are the same at every call
        local page = cjson.decode((assert(responses.input_items(messages, "resp_ab", "desc", 2))))
        assert.same({ list.data[5].id, list.data[4].id, true }, { page.data[1].id, page.data[2].id, page.has_more })
        local next_page = cjson.decode((assert(responses.input_items(messages, "resp_ab", "desc", 2, page.last_id))))
        assert.same({ list.data[3].id, list.data[2].id }, { next_page.data[1].id, next_page.data[2].id })
        local _, err, param = responses.input_items(messages, "resp_ab", "up", 2)
        assert.same({ "order" }, { param })
        _, err, param = responses.input_items(messages, "resp_ab", "asc", 101)
        assert.equal("limit", param)
        _, err, param = responses.input_items(messages, "resp_ab", "asc", 5, "msg_zz")
        assert.same({ "after", true }, { param, err:find("no item of this response", 1, true) ~= nil })
        -- a namespace's function: its own name and the namespace, as the response's tools name it
        -- (the stored chat message keeps the joined name)
        local namespaced = cjson.encode({
            { role = "user", content = "Go." },
            { role = "assistant", content = cjson.null, tool_calls = {
                { id = "c1", type = "function", ["function"] = { name = "multi_agent_v1__wait", arguments = "{}" } },
                { id = "c2", type = "function", ["function"] = { name = "f", arguments = "{}" } } } },
            { role = "assistant", content = "the reply" } })
        local response = cjson.encode({ id = "resp_ab", tools = { { type = "function", name = "f" },
            { type = "namespace", name = "multi_agent_v1", tools = { { type = "function", name = "wait" } } } } })
        list = cjson.decode((assert(responses.input_items(namespaced, "resp_ab", "asc", 20, nil, response))))
        assert.same({ "wait", "multi_agent_v1", "f", nil }, { list.data[2].name, list.data[2].namespace, list.data[3].name,
                                                            list.data[3].namespace })
    end)

    it("names the earlier conversation in errors about its messages", function()
        local _, view = responses.to_chat('{"input": "x", "previous_response_id": "resp_1_1"}', lookup)
        local e = view:error({ status = 400, message = "messages[1].content is too long", param = "messages" })
        assert.same({ "previous_response_id's conversation[1].content is too long", "previous_response_id" }, { e.message, e.param })
        e = view:error({ status = 400, message = "messages[2].content is bad", param = "messages" })
        assert.same({ "input[0].content is bad", "input" }, { e.message, e.param })
    end)
end)

describe("responses.to_chat on random requests", function()
    local BASES = {
        { input = { { role = "user", content = { { type = "input_text", text = "q" } } },
                    { type = "reasoning", summary = { { type = "summary_text", text = "r" } } },
                    { type = "function_call", call_id = "c", name = "f", arguments = "{}" },
                    { type = "function_call_output", call_id = "c", output = "o" },
                    { type = "message", role = "assistant", phase = "final_answer", content = { { type = "output_text", text = "a" } } } },
          instructions = "i", max_output_tokens = 5, top_logprobs = 2, include = { "message.output_text.logprobs" },
          tools = { { type = "function", name = "f", parameters = { type = "object" }, strict = true } },
          tool_choice = { type = "allowed_tools", mode = "auto", tools = { { type = "function", name = "f" } } },
          reasoning = { effort = "low" }, text = { format = { type = "json_schema", name = "n", schema = { type = "object" } } } },
        { input = "q", tool_choice = { type = "function", name = "f" }, tools = { { type = "function", name = "f" } },
          text = { format = { type = "json_object" }, verbosity = "low" }, stream = true, metadata = { k = "v" } },
    }
    it("answers each (a valid one with one place changed) with a chat body or a 400, never raising", function()
        local H = require "helpers"
        local words = { "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "include", "top_logprobs",
                        "reasoning", "metadata", "store", "stream", "role", "content", "type", "message", "function_call",
                        "function_call_output", "reasoning", "call_id", "name", "arguments", "output", "input_text",
                        "output_text", "refusal", "summary", "phase", "format", "json_schema", "schema", "strict", "function",
                        "allowed_tools", "mode", "user", "assistant", "developer", "effort", "verbosity", "parameters" }
        for seed = 1, 3000 do
            local body = H.mutated(BASES[seed % #BASES + 1], seed, words)
            local ok, chat_body, view = pcall(responses.to_chat, body)
            assert(ok, body .. " raised " .. tostring(chat_body))
            if chat_body then
                assert(cjson.decode(chat_body), body)
                local e = view:error({ status = 400, message = "messages[0].content and messages[1].tool_calls[0]", param = "messages" })
                assert.equal("string", type(e.message))
            else
                assert.equal(400, view.status, body)
                assert.equal("string", type(view.message), body)
            end
        end
    end)
end)

describe("responses.input_items of a stored response it cannot read", function()
    it("says so (a store shared with another version, a damaged entry)", function()
        assert.same({ nil, "the stored response cannot be read" }, { responses.input_items("not json", "resp_1", "asc", 10) })
    end)
end)

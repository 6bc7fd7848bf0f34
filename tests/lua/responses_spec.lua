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
        chat = chat_of('{"input": "x", "top_logprobs": 3}')
        assert.same({ true, 3 }, { chat.logprobs, chat.top_logprobs })
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
        assert.same({ 400, "input[1].tool_calls[0].function.arguments must be ...", "input" }, { e.status, e.message, e.param })
        e = view:error({ status = 400, message = "messages[0].content must be a string", param = "messages" })
        assert.same({ "instructions.content must be a string", "instructions" }, { e.message, e.param })
        e = view:error({ status = 400, message = "the messages (9 tokens) plus max_completion_tokens (5) exceed", param = "max_completion_tokens" })
        assert.same({ "the input (9 tokens) plus max_output_tokens (5) exceed", "max_output_tokens" }, { e.message, e.param })
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
            { '{"input": "x", "text": {"verbosity": "low"}}', "text", "text.verbosity" },
            { '{"input": "x", "text": {"size": 1}}', "text", "unknown field 'size' in text" },
            { '{"input": "x", "tool_choice": {"type": "function"}}', "tool_choice", '"name"' },
            { '{"input": "x", "top_logprobs": -1}', "top_logprobs", "top_logprobs = -1" },
            { '{"input": "x", "reasoning": {"depth": 1}}', "reasoning", "unknown field 'depth' in reasoning" },
            { '{"input": "x", "service_tier": "flex"}', "service_tier", "service_tier" },
            { '{"input": "x", "stream_options": {"include_usage": true}}', "stream_options", "include_obfuscation" },
            { '{"input": "x", "max_tool_calls": 2}', "max_tool_calls", "max_tool_calls" },
            { '{"input": "x", "prompt": {"id": "p"}}', "prompt", "prompt templates" },
            { '{"input": "x", "n": 2}', "n", "unknown field 'n'" },
        }
        for _, case in ipairs(cases) do
            local body, err = responses.to_chat(case[1])
            assert.is_nil(body, case[1])
            assert.equal(400, err.status)
            assert.equal(case[2], err.param, case[1])
            assert.truthy(err.message:find(case[3], 1, true), case[1] .. " -> " .. err.message)
        end
    end)
end)

describe("responses view of a chat stream", function()
    it("says an error mid-stream as an error event, and nothing after it", function()
        local _, _, view = chat_of('{"input": "x", "stream": true}')
        view:start_stream("resp_1_2", 100, "m")
        local events = view:feed('{"error":{"message":"engine failed","type":"server_error","param":null}}')
        assert.equal(1, #events)
        assert.same({ type = "error", sequence_number = 0, code = cjson.null, message = "engine failed", param = cjson.null },
                    cjson.decode(events[1][2]))
        assert.same({}, view:feed('{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}'))
        assert.same({}, view:feed("[DONE]"))
    end)
end)

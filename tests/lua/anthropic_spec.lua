-- anthropic_spec: tinyloop.server.anthropic without nginx: a Messages request as the chat
-- request it means (server_spec runs both through a real nginx and compares their answers).
local cjson = require "cjson"
local anthropic = require "tinyloop.server.anthropic"
local json_text = require "tinyloop.json_text"

local function chat_of(body, counting)
    local chat_body, view = anthropic.to_chat(body, counting)
    assert(chat_body, view and view.message)
    return cjson.decode(chat_body), chat_body, view
end

describe("anthropic.to_chat", function()
    it("makes system the first message, and content blocks chat's messages", function()
        local chat, text = chat_of([[{"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be"}, {"type": "text",
            "text": "brief."}], "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "w", "input": {"zeta": 1, "alpha": 2}}]},
            {"role": "user", "content": [{"type": "text", "text": "before"}, {"type": "tool_result", "tool_use_id": "t1",
                "content": [{"type": "text", "text": "Sun."}], "is_error": false}, {"type": "text", "text": "Thanks."}]}],
            "stop_sequences": ["\n\n", "END"], "top_k": 5, "metadata": {"user_id": "u1"}}]])
        local m = chat.messages
        assert.equal(6, #m)
        assert.same({ role = "system", content = "Be\nbrief." }, m[1])
        assert.same({ role = "user", content = "Weather?" }, m[2])
        assert.same({ "assistant", "Checking.", "Look.", "t1", "w" }, { m[3].role, m[3].content, m[3].reasoning_content,
                    m[3].tool_calls[1].id, m[3].tool_calls[1]["function"].name })
        -- the arguments as sent (their key order is the model's)
        assert.equal('{"zeta": 1, "alpha": 2}', m[3].tool_calls[1]["function"].arguments)
        assert.same({ role = "user", content = "before" }, m[4])
        assert.same({ role = "tool", tool_call_id = "t1", content = "Sun." }, m[5])
        assert.same({ role = "user", content = "Thanks." }, m[6])
        assert.same({ 9, { "\n\n", "END" }, 5, "u1" }, { chat.max_tokens, chat.stop, chat.top_k, chat.user })
        assert.is_nil(json_text.member(text, { "stop_sequences" }))
    end)

    it("passes tools, tool_choice, thinking and output_format on in chat's shapes", function()
        local schema = '{"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}'
        local _, text = chat_of('{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "w", ' ..
            '"description": "d", "input_schema": ' .. schema .. ', "cache_control": {"type": "ephemeral"}}], ' ..
            '"tool_choice": {"type": "tool", "name": "w", "disable_parallel_tool_use": true}, ' ..
            '"thinking": {"type": "enabled", "budget_tokens": 2048}, "output_format": {"type": "json_schema", "schema": ' .. schema .. '}}')
        assert.equal(schema, json_text.member(text, { "tools", 1, "function", "parameters" }))
        assert.equal('"d"', json_text.member(text, { "tools", 1, "function", "description" }))
        assert.equal('{"type":"function","function":{"name":"w"}}', json_text.member(text, { "tool_choice" }))
        assert.equal("false", json_text.member(text, { "parallel_tool_calls" }))
        assert.equal('{"enable_thinking":true}', json_text.member(text, { "chat_template_kwargs" }))
        assert.equal("2048", json_text.member(text, { "thinking_budget" })) -- (the chat request's budget)
        assert.equal(schema, json_text.member(text, { "response_format", "json_schema", "schema" }))
        local choices = { auto = "auto", any = "required", none = "none" }
        for kind, want in pairs(choices) do
            local chat = chat_of('{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "w", ' ..
                '"input_schema": {}}], "tool_choice": {"type": "' .. kind .. '"}}')
            assert.equal(want, chat.tool_choice)
        end
        -- disabled thinking, and the request's own template variables kept
        _, text = chat_of('{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"}, ' ..
            '"chat_template_kwargs": {"a": 1}}')
        assert.equal('{"enable_thinking":false,"a": 1}', json_text.member(text, { "chat_template_kwargs" }))
    end)

    it("counts without max_tokens, and generates with it only", function()
        local chat = chat_of('{"messages": [{"role": "user", "content": "x"}]}', true)
        assert.equal(0, chat.max_tokens)
        local body, err = anthropic.to_chat('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}', true)
        assert.is_nil(body)
        assert.truthy(err.message:find("count_tokens generates nothing", 1, true))
    end)

    it("answers errors in Anthropic's shape, naming its own fields", function()
        local _, _, view = chat_of('{"system": "s", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}')
        view.request_id = "req_7" -- (the server's, as it sets the header)
        local e = view:error({ status = 400, message = "messages[1].content: bad; max_completion_tokens too", param = "messages" })
        assert.same({ type = "error", error = { type = "invalid_request_error", message = "messages[0].content: bad; max_tokens too" },
                      request_id = "req_7" }, cjson.decode(e.body))
        e = view:error({ status = 503, message = "every session place is taken" })
        -- (every place taken: Anthropic's 529, its SDKs' OverloadedError; 503 was their ServiceUnavailableError)
        assert.same({ 529, "overloaded_error" }, { e.status, cjson.decode(e.body).error.type })
        -- a message thread (the SDKs' tool runner asks for one): refused with the error_code on
        -- which the SDK sends the whole conversation without it ("unknown field" failed it)
        local body, err = anthropic.to_chat('{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thread": {"type": "create"}}')
        assert.is_nil(body)
        assert.same({ 400, "thread", '{"error_code":"thread_unsupported_request"}' }, { err.status, err.param, err.details })
        assert.same({ type = "error", error = { type = "invalid_request_error", details = { error_code = "thread_unsupported_request" },
                                                message = err.message }, request_id = cjson.null },
                    cjson.decode(anthropic.error_body(err.status, err.message, err.details)))
        -- the answer's request id, as Anthropic's bodies repeat their header's
        assert.equal("req_1", cjson.decode(anthropic.error_body(err.status, err.message, err.details, "req_1")).request_id)
        assert.truthy(anthropic.to_chat('{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thread": null}'))
        e = view:error({ status = 400, message = "stop has 65 strings: at most 64", param = "stop" })
        assert.equal("stop_sequences has 65 strings: at most 64", cjson.decode(e.body).error.message)
    end)

    it("refuses bad input, naming the field", function()
        local ok = '"max_tokens": 5, '
        local cases = {
            { "{", nil, "not valid JSON" },
            { '{"max_tokens": 5}', "messages", "messages is required" },
            { '{"messages": [{"role": "user", "content": "x"}]}', "max_tokens", "max_tokens is required" },
            { '{' .. ok .. '"messages": []}', "messages", "non-empty" },
            { '{' .. ok .. '"messages": [{"role": "system", "content": "x"}]}', "messages", "messages[0].role" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": []}]}', "messages", "messages[0].content" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}', "messages",
              'messages[0].content[0].type = "image"' },
            { '{' .. ok .. '"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}',
              "messages", "only an assistant message" },
            { '{' .. ok .. '"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": [1]}]}]}',
              "messages", "input must be an object" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "r"}]}]}', "messages",
              "tool_use_id" },
            { '{' .. ok .. '"system": [{"type": "image"}], "messages": [{"role": "user", "content": "x"}]}', "system", "system[0].type" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "s"}]}',
              "tools", "server tools" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]}', "tools", "input_schema is required" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}}', "tool_choice", "tool_choice.type" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on"}}', "thinking", "thinking.type" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "output_format": {"type": "xml"}}', "output_format", "json_schema" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "mcp_servers": []}', "mcp_servers", "MCP" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "n": 2}', "n", "unknown field 'n'" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "metadata": {"tag": 1}}', "metadata", "unknown field 'tag'" },
            -- Anthropic's own refusals, which were taken (a JSON null schema, a stray name, an
            -- empty text but the final assistant's, a prefill the template cut the blanks of)
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": null}]}',
              "tools", "tools[0].input_schema is required" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": []}]}',
              "tools", "tools[0].input_schema must be a JSON Schema object" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "auto", "name": "f"}}',
              "tool_choice", 'tool_choice.name goes with {"type": "tool"} only' },
            { '{' .. ok .. '"messages": [{"role": "user", "content": ""}]}', "messages",
              "messages[0].content must not be empty" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}', "messages",
              "messages[0].content[0].text must not be empty" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}, ' ..
              '{"role": "user", "content": "y"}]}', "messages", "messages[1].content must not be empty" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure "}]}',
              "messages", "final assistant content cannot end with trailing whitespace" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": ' ..
              '{"type": "object"}}], "tool_choice": {"type": "tool"}}', "tool_choice", 'tool_choice {"type": "tool"} needs the tool\'s "name"' },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": ' ..
              '{"type": "object"}}], "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}}', "tool_choice",
              "tool_choice.disable_parallel_tool_use must be a boolean" },
        }
        -- (rules an audit found no test fed)
        local U = '"messages": [{"role": "user", "content": "x"}], '
        for _, case in ipairs({
            { '{' .. ok .. '"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": 1}]}]}',
              "messages", "messages[0].content[0].is_error must be a boolean" },
            { '{' .. ok .. U .. '"service_tier": "priority"}', "service_tier", 'service_tier must be "auto" or "standard_only"' },
            { '{' .. ok .. U .. '"output_format": {"type": "json_schema", "schema": {}}, "output_config": {"format": ' ..
              '{"type": "json_schema", "schema": {}}}}', "output_format", "output_format and output_config.format are one setting" },
            { '{' .. ok .. U .. '"output_config": {"format": "json"}}', "output_config",
              'output_config.format must be an object {"type": "json_schema", "schema"}' },
            { '{' .. ok .. U .. '"thinking": {"type": "enabled", "budget_tokens": "x"}}', "thinking", "thinking.budget_tokens must be an integer" },
            { '{' .. ok .. U .. '"thinking": {"type": "enabled"}}', "thinking", 'thinking.budget_tokens is required with thinking.type "enabled"' },
            { '{' .. ok .. U .. '"metadata": {"user_id": 5}}', "metadata", "metadata.user_id must be a string" },
            { '{' .. ok .. U .. '"temperature": 1.5}', "temperature", "temperature must be between 0 and 1" },
            { '{"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}', "max_tokens", "max_tokens must be at least 1" },
            { '{' .. ok .. U .. '"system": 5}', "system", "system must be a string or an array of text blocks" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "thinking", ' ..
              '"thinking": 5, "signature": "s"}]}]}', "messages", "messages[1].content[0].thinking must be a string" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "tool_use", ' ..
              '"name": "f", "input": {}}]}]}', "messages", "needs its id and name (strings)" },
            { '{' .. ok .. '"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "tool_result", ' ..
              '"tool_use_id": "t"}]}]}', "messages", "only a user message answers tool calls" },
            { '{' .. ok .. U .. '"tools": [5]}', "tools", 'tools[0] must be an object {"name", "input_schema", ...}' },
        }) do cases[#cases + 1] = case end
        require("helpers").refuses(anthropic.to_chat, cases)
    end)
end)

describe("anthropic.to_chat: what Anthropic's clients send", function()
    it("joins consecutive turns of one role, and continues a final assistant message (a prefill)", function()
        local chat = chat_of([[{"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content":
            [{"type": "text", "text": "again"}]}, {"role": "assistant", "content": "Hel"}, {"role": "assistant", "content": "lo"}]}]])
        assert.same({ { role = "user", content = "Hi\nagain" }, { role = "assistant", content = "Hel\nlo" } }, chat.messages)
        assert.is_true(chat.continue_final_message)
        -- a final call is no prefill: its result is awaited
        chat = chat_of([[{"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content":
            [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}]])
        assert.is_nil(chat.continue_final_message)
        -- an empty final assistant message (Anthropic allows it) is no prefill: it is left out
        chat = chat_of([[{"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}]])
        assert.same({ { role = "user", content = "Hi" } }, chat.messages)
        assert.is_nil(chat.continue_final_message)
        -- a joined turn's text: a turn of calls alone, or an empty first text, is replaced by the
        -- next; thinking blocks joined alike, an empty one too
        chat = chat_of([[{"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content":
            [{"type": "thinking", "thinking": "a", "signature": "s"}, {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "s"},
            {"type": "thinking", "thinking": "b", "signature": "s"}, {"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
            {"role": "user", "content": "ok"}]}]])
        assert.same({ "x\ny", "a\n\nb", "t" }, { chat.messages[2].content, chat.messages[2].reasoning_content,
                                                chat.messages[2].tool_calls[1].id })
        chat = chat_of([[{"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content":
            [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}, {"role": "assistant", "content": [{"type": "text", "text": ""},
            {"type": "text", "text": "z"}]}]}]])
        assert.equal("z", chat.messages[2].content)
        -- a turn of 20,000 text blocks: their texts joined in order
        local blocks = {}
        for i = 1, 20000 do blocks[i] = { type = "text", text = "b" .. i } end
        chat = chat_of(cjson.encode({ max_tokens = 5, messages = { { role = "user", content = blocks } } }))
        local content = chat.messages[1].content
        assert.same({ 20000, "b1\nb2\nb3", "b19999\nb20000" },
                    { select(2, content:gsub("\n", "")) + 1, content:sub(1, 8), content:sub(-13) })
    end)

    it("leaves Claude Code's billing line out of the system prompt, and an empty one out", function()
        local chat = chat_of([[{"max_tokens": 5, "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=9f;"},
            {"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Hi"}]}]])
        assert.same({ role = "system", content = "You are helpful." }, chat.messages[1])
        chat = chat_of('{"max_tokens": 5, "system": "", "messages": [{"role": "user", "content": "Hi"}]}')
        assert.equal("user", chat.messages[1].role)
    end)

    it("gives output_config.effort to the template as reasoning_effort, beside an output_format", function()
        local chat = chat_of('{"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "output_config": {"effort": "low"}, ' ..
                             '"output_format": {"type": "json_schema", "schema": {"type": "object"}}}')
        assert.same({ enable_thinking = false, reasoning_effort = "low" }, chat.chat_template_kwargs)
        assert.equal("json_schema", chat.response_format.type)
        local body, err = anthropic.to_chat('{"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], ' ..
                                            '"output_config": {"effort": "extreme"}}')
        assert.is_nil(body)
        assert.truthy(err.message:find("output_config.effort", 1, true))
    end)

    it("switches thinking off unless asked for (Anthropic's default)", function()
        local chat = chat_of('{"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}')
        assert.same({ enable_thinking = false }, chat.chat_template_kwargs)
        chat = chat_of('{"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": true}}')
        assert.same({ enable_thinking = true }, chat.chat_template_kwargs)
    end)

    it("takes a system message among the turns, at its place (Claude Code's mid-conversation instructions)", function()
        local chat = chat_of('{"max_tokens": 5, "system": "s", "messages": [{"role": "user", "content": "hi"}, ' ..
                             '{"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]}, ' ..
                             '{"role": "user", "content": "x"}]}')
        assert.same({ { role = "system", content = "s" }, { role = "user", content = "hi" },
                      { role = "system", content = "Be\nbrief." }, { role = "user", content = "x" } }, chat.messages)
        local _, err = anthropic.to_chat('{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}, ' ..
                                         '{"role": "system", "content": [{"type": "image"}]}]}')
        assert.truthy(err.message:find("messages[1].content[0].type", 1, true), err.message)
        _, err = anthropic.to_chat('{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": []}]}')
        assert.truthy(err.message:find("messages[1].content must not be empty", 1, true), err.message)
    end)

    it("takes the fields that change nothing here", function()
        local chat = chat_of([[{"max_tokens": 5, "inference_geo": "us", "context_management": {"edits": []},
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"},
            {"type": "tool_use", "id": "t", "name": "f", "input": {}, "caller": {"type": "direct"}}]}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}, "defer_loading": false, "eager_input_streaming": true}]}]])
        assert.equal("t", chat.messages[2].tool_calls[1].id)
        -- what the AI SDK sends: automatic caching's top-level mark, a tool's input examples, the
        -- efforts past high (each was a 400)
        chat = chat_of([[{"max_tokens": 5, "cache_control": {"type": "ephemeral"}, "output_config": {"effort": "max"},
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}, "input_examples": [{"a": 1}]}]}]])
        assert.same({ "max", "f" }, { chat.chat_template_kwargs.reasoning_effort, chat.tools[1]["function"].name })
        assert.equal("xhigh", chat_of([[{"max_tokens": 5, "output_config": {"effort": "xhigh"},
            "messages": [{"role": "user", "content": "Hi"}]}]]).chat_template_kwargs.reasoning_effort)
    end)

    it("reads a long conversation's tool calls and tools in one pass over the body", function()
        -- (json_text.member per block rescanned the whole body: 4,000 calls took 86 s). The work,
        -- counted as the text each scan of a container is given, stays a few times the body's.
        local blocks, tools = {}, {}
        for k = 1, 4000 do blocks[k] = ('{"type": "tool_use", "id": "t%d", "name": "f", "input": {"k": %d}}'):format(k, k) end
        for k = 1, 500 do tools[k] = ('{"name": "f%d", "input_schema": {"type": "object"}}'):format(k) end
        local body = '{"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [' ..
            table.concat(blocks, ",") .. ']}], "tools": [' .. table.concat(tools, ",") .. ']}'
        local scanned, chat = require("helpers").text_scanned(chat_of, body)
        assert.equal('{"k": 4000}', chat.messages[2].tool_calls[4000]["function"].arguments)
        assert.equal("f500", chat.tools[500]["function"].name)
        assert.truthy(scanned < 10 * #body, ("%d bytes scanned for a body of %d"):format(scanned, #body))
    end)
end)

describe("anthropic.to_chat on random requests", function()
    local BASES = {
        { max_tokens = 5, system = { { type = "text", text = "s" } }, stop_sequences = { "x" },
          messages = { { role = "user", content = "q" },
                       { role = "assistant", content = { { type = "thinking", thinking = "t", signature = "" },
                                                         { type = "text", text = "a" },
                                                         { type = "tool_use", id = "u", name = "f", input = { k = 1 } } } },
                       { role = "user", content = { { type = "tool_result", tool_use_id = "u", content = { { type = "text", text = "r" } } },
                                                    { type = "text", text = "more" } } } },
          tools = { { name = "f", input_schema = { type = "object" }, description = "d" } },
          tool_choice = { type = "tool", name = "f", disable_parallel_tool_use = true },
          thinking = { type = "enabled", budget_tokens = 1024 }, metadata = { user_id = "u" } },
        { max_tokens = 5, messages = { { role = "user", content = { { type = "text", text = "q" } } }, { role = "assistant", content = "pre" } },
          output_config = { format = { type = "json_schema", schema = { type = "object" } } }, chat_template_kwargs = { a = 1 } },
    }
    it("answers each (a valid one with one place changed) with a chat body or a 400, never raising", function()
        local H = require "helpers"
        local words = { "messages", "max_tokens", "system", "stop_sequences", "tools", "tool_choice", "thinking", "metadata",
                        "output_format", "output_config", "role", "content", "type", "text", "user", "assistant", "tool_use",
                        "tool_result", "thinking", "redacted_thinking", "id", "name", "input", "tool_use_id", "is_error",
                        "input_schema", "auto", "any", "tool", "none", "enabled", "disabled", "budget_tokens", "schema",
                        "json_schema", "format", "user_id", "cache_control", "disable_parallel_tool_use", "signature" }
        for seed = 1, 3000 do
            local body = H.mutated(BASES[seed % #BASES + 1], seed, words)
            for _, counting in ipairs({ false, true }) do
                local ok, chat_body, view = pcall(anthropic.to_chat, body, counting)
                assert(ok, body .. " raised " .. tostring(chat_body))
                if chat_body then
                    assert(cjson.decode(chat_body), body)
                    local e = view:error({ status = 400, message = "messages[0].content", param = "messages" })
                    assert(cjson.decode(e.body), body)
                else
                    assert.equal(400, view.status, body)
                    assert.equal("string", type(view.message), body)
                end
            end
        end
    end)
end)

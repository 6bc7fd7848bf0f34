-- tinyloop.server.anthropic: Anthropic's Messages API (POST /v1/messages, and
-- /v1/messages/count_tokens) as a view of the chat completions path, as
-- tinyloop.server.responses is of OpenAI's Responses. Pure Lua (no ngx).
--
-- A Messages request is the chat request it means: `system` the first system message, content
-- blocks as chat's messages (text; tool_use as an assistant's tool_calls; tool_result as tool
-- messages; thinking as the assistant's reasoning_content), `tools` with their input_schema as
-- parameters, tool_choice auto/any/tool/none, `thinking` as the template's enable_thinking,
-- `output_format` as a JSON Schema response_format. The answer is content blocks (thinking,
-- text, tool_use) with Anthropic's stop_reason, usage and, streamed, its events
-- (message_start, content_block_start/delta/stop, message_delta, message_stop). Errors have
-- Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
--
--   local anthropic = require "tinyloop.server.anthropic"
--   local chat_body, view = anthropic.to_chat(body)  -- nil, err; view:error(err).body: the answer
--   body = view:response(chat_json, id)              -- a blocking answer
--   view:start_stream(id, created, model, prompt_tokens, cached_tokens); local events = view:feed(chunk_json)
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local cjson = require "cjson.safe"
local json_text = require "tinyloop.json_text"
local shapes = require "tinyloop.server.shapes"

local type, pairs, ipairs, tostring = type, pairs, ipairs, tostring
local concat, gsub = table.concat, string.gsub
local raw_member = json_text.member
local json_null = cjson.null
local encode, bad, is_array, shown, object, check_keys = shapes.encode, shapes.bad, shapes.is_array, shapes.shown, shapes.object,
                                                         shapes.check_keys
local KIND_OK = shapes.KIND_OK

local _M = {}

-- ------------------------------------------------------------------ the request

local OWN = {
    messages = "array", max_tokens = "integer", system = "any", stop_sequences = "array", tools = "array",
    tool_choice = "object", thinking = "object", metadata = "object", service_tier = "string", output_format = "object",
    output_config = "object", inference_geo = "string", context_management = "object", thread = "any",
    -- (automatic prompt caching's mark, at the top level: the prefix pool needs no marks)
    cache_control = "object",
}
local PASS = {}
for _, k in ipairs(shapes.PASSED) do PASS[k] = true end
PASS.thinking_budget = nil -- (thinking.budget_tokens says it here)
local REFUSED = {
    container = "containers (code execution) are not run here",
    mcp_servers = "MCP servers are not connected from here: run the tools in the client and send their results back",
}

-- Content blocks' fields (cache_control: a hint for Anthropic's prompt cache, which the prefix
-- pool here does without; citations: none are made; caller: who made a call, Anthropic's
-- programmatic tool calling).
local TEXT_KEYS = { type = true, text = true, cache_control = true, citations = true }
local TOOL_USE_KEYS = { type = true, id = true, name = true, input = true, cache_control = true, caller = true }
local TOOL_RESULT_KEYS = { type = true, tool_use_id = true, content = true, is_error = true, cache_control = true }
local THINKING_KEYS = { type = true, thinking = true, signature = true }
local REDACTED_KEYS = { type = true, data = true }

-- Claude Code's first system block, a billing line that changes with every request: at the
-- prompt's start it would leave the prefix pool nothing to share (vLLM drops it too).
local BILLING = "x-anthropic-billing-header"

-- Text blocks (or a string) -> the text, joined with "\n", or nil, err. (skip_billing: the
-- system prompt's billing line is left out.)
local function text_of(content, where, skip_billing)
    if type(content) == "string" then return content end
    if not is_array(content) then return nil, where .. " must be a string or an array of text blocks" end
    local texts = {}
    for i, block in ipairs(content) do
        local at = ("%s[%d]"):format(where, i - 1)
        if type(block) ~= "table" or block.type ~= "text" then
            return nil, ('%s.type = %s: only "text" blocks are read here (this model reads text)')
                :format(at, shown(type(block) == "table" and block.type or block))
        end
        local ok, err = check_keys(block, TEXT_KEYS, at)
        if not ok then return nil, err end
        if type(block.text) ~= "string" then return nil, at .. ".text must be a string" end
        if not (skip_billing and block.text:sub(1, #BILLING) == BILLING) then texts[#texts + 1] = block.text end
    end
    return concat(texts, "\n")
end

-- messages (Anthropic's; `raw`: their JSON text, each tool_use's input read from it as sent)
-- -> chat's messages, and for each the index of the message it came from (false: the system
-- prompt); or nil, err. A user message's tool_result blocks become tool messages, in their
-- order among its text; an assistant's blocks one assistant message (its text, its tool_use
-- blocks as tool_calls, its thinking as reasoning_content). Consecutive turns of one role are
-- one turn (Anthropic's rule; templates that want turns to alternate refuse two).
local function messages_of(messages, system, raw)
    local out, from = {}, {}
    if system ~= nil then
        local text, err = text_of(system, "system", true)
        if not text then return nil, err end
        if text ~= "" then out[1], from[1] = { role = "system", content = text }, false end
    end
    if #messages == 0 then return nil, "messages must be a non-empty array of {\"role\", \"content\"}" end
    -- a turn of `role` from message i, joined to the last one where that is the same role's
    local function turn(role, i)
        local last = out[#out]
        if last and last.role == role and from[#out] ~= false then return last end
        out[#out + 1], from[#out + 1] = { role = role }, i
        return out[#out]
    end
    -- A turn's texts and thinking, joined with "\n" once all are read (a join per block copied
    -- the turn's text so far each time: 24,000 blocks held the event loop 5 s). A text joins a
    -- turn's non-empty text (an empty one, or the null of a turn of calls alone, it replaces).
    local texts, thoughts = {}, {}
    local function add_text(m, text)
        local list = texts[m]
        if not list then
            list = { (type(m.content) == "string" and m.content ~= "") and m.content or nil }
            texts[m] = list
        end
        if #list > 0 or text ~= "" then list[#list + 1] = text end
    end
    local function add_thinking(m, text)
        local list = thoughts[m]
        if not list then
            list = { m.reasoning_content }
            thoughts[m] = list
        end
        list[#list + 1] = text
    end
    local raw_messages = shapes.raw_list(raw)
    for i, m in ipairs(messages) do
        local where = ("messages[%d]"):format(i - 1)
        if type(m) ~= "table" or is_array(m) then return nil, where .. ' must be an object {"role", "content"}' end
        local ok, err = check_keys(m, { role = true, content = true }, where)
        if not ok then return nil, err end
        if m.role ~= "user" and m.role ~= "assistant" and m.role ~= "system" then
            return nil, ('%s.role must be "user", "assistant" or "system", got %s'):format(where, shown(m.role))
        end
        if m.role == "system" then
            -- a system message among the turns (Anthropic's SystemMessageParam: instructions
            -- added mid-conversation, as Claude Code sends them): one at its place, its text
            -- blocks joined (a template that wants the system prompt first alone refuses it)
            if i == 1 then
                return nil, where .. '.role = "system": a system message follows a turn (the system prompt before them is ' ..
                    "the top-level system)"
            end
            local text
            text, err = text_of(m.content, where .. ".content")
            if not text then return nil, err end
            if text == "" then return nil, where .. ".content must not be empty (a system message says something)" end
            out[#out + 1], from[#out + 1] = { role = "system", content = text }, i - 1
            goto next_message
        end
        local blocks = m.content
        if type(blocks) == "string" then blocks = { { type = "text", text = blocks } } end
        if not is_array(blocks) or #blocks == 0 then
            return nil, where .. ".content must be a string or a non-empty array of content blocks"
        end
        local raw_blocks = shapes.raw_list(shapes.raw_fields(raw_messages[i]).content)
        local message = m.role == "assistant" and turn("assistant", i - 1) or nil
        for j, block in ipairs(blocks) do
            local at = ("%s.content[%d]"):format(where, j - 1)
            local kind = type(block) == "table" and block.type
            if kind == "text" then
                ok, err = check_keys(block, TEXT_KEYS, at)
                if not ok then return nil, err end
                if type(block.text) ~= "string" then return nil, at .. ".text must be a string" end
                -- (Anthropic's rule: only the final assistant message, a prefill, may be empty)
                if block.text == "" and not (message and i == #messages) then
                    -- (a string content is named as sent, not as the block it is read into)
                    return nil, (type(m.content) == "string" and where .. ".content" or at .. ".text") ..
                        " must not be empty (text content blocks must be non-empty)"
                end
                add_text(message or turn("user", i - 1), block.text)
            elseif kind == "tool_use" and message then
                ok, err = check_keys(block, TOOL_USE_KEYS, at)
                if not ok then return nil, err end
                if type(block.id) ~= "string" or type(block.name) ~= "string" then
                    return nil, at .. " needs its id and name (strings)"
                end
                local input = shapes.raw_fields(raw_blocks[j]).input
                if not input or input:sub(1, 1) ~= "{" then return nil, at .. ".input must be an object (the tool's arguments)" end
                message.tool_calls = message.tool_calls or {}
                message.tool_calls[#message.tool_calls + 1] = { id = block.id, type = "function",
                                                                ["function"] = { name = block.name, arguments = input } }
            elseif kind == "tool_result" and not message then
                ok, err = check_keys(block, TOOL_RESULT_KEYS, at)
                if not ok then return nil, err end
                if type(block.tool_use_id) ~= "string" then return nil, at .. ".tool_use_id must be a string" end
                if block.is_error ~= nil and type(block.is_error) ~= "boolean" then return nil, at .. ".is_error must be a boolean" end
                local content = ""
                if block.content ~= nil and block.content ~= json_null then
                    content, err = text_of(block.content, at .. ".content")
                    if not content then return nil, err end
                end
                out[#out + 1], from[#out + 1] = { role = "tool", tool_call_id = block.tool_use_id, content = content }, i - 1
            elseif kind == "thinking" and message then
                ok, err = check_keys(block, THINKING_KEYS, at)
                if not ok then return nil, err end
                if type(block.thinking) ~= "string" then return nil, at .. ".thinking must be a string" end
                add_thinking(message, block.thinking)
            elseif kind == "redacted_thinking" and message then
                -- (its reasoning is Anthropic's encryption: nothing to read back)
                ok, err = check_keys(block, REDACTED_KEYS, at)
                if not ok then return nil, err end
            else
                local words = (kind == "tool_use" or kind == "thinking" or kind == "redacted_thinking") and
                    "only an assistant message has these" or kind == "tool_result" and "only a user message answers tool calls" or
                    '"text", "tool_use", "tool_result" and "thinking" blocks are read here (this model reads text)'
                return nil, ("%s.type = %s: %s"):format(at, shown(kind or block), words)
            end
        end
        if message then
            if message.content == nil and not texts[message] then message.content = message.tool_calls and json_null or "" end
        end
        ::next_message::
    end
    for m, list in pairs(texts) do m.content = concat(list, "\n") end
    for m, list in pairs(thoughts) do m.reasoning_content = concat(list, "\n") end
    return out, from
end

-- tools -> chat's, each input_schema's text as sent (its key order is the model's).
-- (defer_loading, eager_input_streaming: Anthropic's tool search and streaming hints, which
-- change nothing here; input_examples: examples of a tool's input, which the chat template does
-- not show)
local TOOL_KEYS = { type = true, name = true, description = true, input_schema = true, cache_control = true, strict = true,
                    defer_loading = true, eager_input_streaming = true, input_examples = true }
local function chat_tools(tools, raw)
    local out, raw_tools = {}, shapes.raw_list(raw)
    for i, tool in ipairs(tools) do
        local where = ("tools[%d]"):format(i - 1)
        if type(tool) ~= "table" or is_array(tool) then return nil, where .. ' must be an object {"name", "input_schema", ...}' end
        if tool.type ~= nil and tool.type ~= "custom" then
            return nil, ("%s.type = %s: Anthropic's server tools are not run here (custom tools only)"):format(where, shown(tool.type))
        end
        local ok, err = check_keys(tool, TOOL_KEYS, where)
        if not ok then return nil, err end
        if tool.input_schema == nil or tool.input_schema == json_null then
            return nil, where .. ".input_schema is required (the tool's JSON Schema)"
        end
        local fields = shapes.raw_fields(raw_tools[i])
        if fields.input_schema:sub(1, 1) ~= "{" then return nil, where .. ".input_schema must be a JSON Schema object" end
        out[i] = '{"type":"function","function":' .. object({
            { "name", fields.name }, { "description", tool.description ~= nil and fields.description or nil },
            { "parameters", fields.input_schema }, { "strict", tool.strict ~= nil and fields.strict or nil },
        }) .. "}"
    end
    return "[" .. concat(out, ",") .. "]"
end

-- tool_choice -> chat's tool_choice text and parallel_tool_calls (nil: the default), or nil, err.
local function chat_tool_choice(choice)
    local ok, err = check_keys(choice, { type = true, name = true, disable_parallel_tool_use = true }, "tool_choice")
    if not ok then return nil, err end
    local parallel = nil
    if choice.disable_parallel_tool_use ~= nil then
        if type(choice.disable_parallel_tool_use) ~= "boolean" then return nil, "tool_choice.disable_parallel_tool_use must be a boolean" end
        parallel = not choice.disable_parallel_tool_use
    end
    if choice.name ~= nil and choice.type ~= "tool" then
        return nil, 'tool_choice.name goes with {"type": "tool"} only'
    end
    if choice.type == "auto" then return '"auto"', parallel end
    if choice.type == "any" then return '"required"', parallel end
    if choice.type == "none" then return '"none"', parallel end
    if choice.type == "tool" then
        if type(choice.name) ~= "string" then return nil, 'tool_choice {"type": "tool"} needs the tool\'s "name"' end
        return '{"type":"function","function":{"name":' .. encode(choice.name) .. "}}", parallel
    end
    return nil, 'tool_choice.type must be "auto", "any", "tool" or "none"'
end

-- output_format (or output_config.format): {"type": "json_schema", "schema"} -> chat's
-- response_format text, or nil, err.
local function chat_format(path, f, body)
    local where = concat(path, ".")
    local ok, err = check_keys(f, { type = true, schema = true }, where)
    if not ok then return nil, err end
    if f.type ~= "json_schema" then return nil, where .. '.type must be "json_schema"' end
    local schema_path = { unpack(path) }
    schema_path[#schema_path + 1] = "schema"
    local schema = raw_member(body, schema_path)
    if not schema or schema:sub(1, 1) ~= "{" then return nil, where .. ".schema must be a JSON Schema object" end
    return '{"type":"json_schema","json_schema":{"name":"output","schema":' .. schema .. "}}"
end

-- (Anthropic sets no limit on stop_sequences: OpenAI's 4 is the chat endpoint's)
-- (DROPS_BUDGET_WITHOUT_REASONING: Anthropic's clients send budget_tokens with every thinking
-- request; where the server reads no reasoning the budget is dropped, not refused as the chat
-- field is)
local View = { ID_PREFIX = "msg", PARSE_OPTIONS = { max_stops = shapes.MAX_STOPS }, DROPS_BUDGET_WITHOUT_REASONING = true }
View.__index = View

-- to_chat(body, counting) -> the chat completions body that means the same, and its view; or
-- nil, err. counting: count_tokens' body (no max_tokens: nothing is generated).
function _M.to_chat(body, counting)
    local t, members, raw = shapes.read_fields(body, OWN, PASS, REFUSED)
    if not t then return nil, members end
    if t.thread ~= nil then
        -- (Anthropic's message threads, which its SDKs' tool runner asks for by default: no
        -- threads here, said as Anthropic says it, the one answer on which the SDK sends the
        -- whole conversation without one; "unknown field" left its tool runner failing)
        local _, e = bad("thread is not supported here: send the whole conversation without thread", "thread")
        e.details = '{"error_code":"thread_unsupported_request"}'
        return nil, e
    end
    if t.messages == nil then return bad("messages is required", "messages") end
    if counting and t.max_tokens ~= nil then
        return bad("unknown field 'max_tokens' (count_tokens generates nothing)", "max_tokens")
    end
    if t.max_tokens == nil and not counting then return bad("max_tokens is required", "max_tokens") end
    -- (Anthropic's ranges, narrower than the chat completions': at least one token; temperature 0 to 1)
    if not counting and t.max_tokens < 1 then return bad("max_tokens must be at least 1", "max_tokens") end
    if type(t.temperature) == "number" and not (t.temperature >= 0 and t.temperature <= 1) then
        return bad("temperature must be between 0 and 1", "temperature")
    end
    local messages, from = messages_of(t.messages, t.system, raw.messages)
    if not messages then return bad(from, from:match("^system") and "system" or "messages") end
    -- (Anthropic's rule: the template's cut would drop the blanks silently, and the reply
    -- continue another text than the one sent)
    local last = messages[#messages]
    if last and last.role == "assistant" and type(last.content) == "string" and last.content:find("%s$") then
        return bad("messages: final assistant content cannot end with trailing whitespace", "messages")
    end
    shapes.continue_prefill(members, messages)
    members[#members + 1] = { "messages", encode(messages) }
    members[#members + 1] = { "max_tokens", shapes.integer(t.max_tokens or 0) }
    if t.stop_sequences then members[#members + 1] = { "stop", raw.stop_sequences } end
    if t.service_tier ~= nil and t.service_tier ~= "auto" and t.service_tier ~= "standard_only" then
        return bad('service_tier must be "auto" or "standard_only"', "service_tier")
    end
    if t.metadata then
        for k, v in ordered_pairs(t.metadata) do
            if k ~= "user_id" then return bad(("unknown field '%s' in metadata"):format(tostring(k)), "metadata") end
            if v ~= json_null and type(v) ~= "string" then return bad("metadata.user_id must be a string", "metadata") end
            if type(v) == "string" then members[#members + 1] = { "user", encode(v) } end
        end
    end
    if t.tools and #t.tools > 0 then
        local text, err = chat_tools(t.tools, raw.tools)
        if not text then return bad(err, "tools") end
        members[#members + 1] = { "tools", text }
    end
    if t.tool_choice then
        local text, parallel = chat_tool_choice(t.tool_choice)
        if not text then return bad(parallel, "tool_choice") end
        shapes.add_tool_choice(members, text, t.tools)
        if parallel ~= nil and t.tools and #t.tools > 0 then members[#members + 1] = { "parallel_tool_calls", tostring(parallel) } end
    end
    local format_text
    if t.output_config then
        local ok, err = check_keys(t.output_config, { format = true, effort = true }, "output_config")
        if not ok then return bad(err, "output_config") end
        local f = t.output_config.format
        if f ~= nil and f ~= json_null then
            if t.output_format then
                return bad("output_format and output_config.format are one setting: send one of them", "output_format")
            end
            if type(f) ~= "table" then return bad('output_config.format must be an object {"type": "json_schema", "schema"}', "output_config") end
            format_text, err = chat_format({ "output_config", "format" }, f, body)
            if not format_text then return bad(err, "output_config") end
        end
        -- effort: a template variable, as Responses' reasoning.effort (gpt-oss's templates read it)
        local effort = t.output_config.effort
        if effort ~= nil and effort ~= json_null then
            if effort ~= "low" and effort ~= "medium" and effort ~= "high" and effort ~= "xhigh" and effort ~= "max" then
                return bad('output_config.effort must be "low", "medium", "high", "xhigh" or "max"', "output_config")
            end
            shapes.add_template_variable(members, t, "reasoning_effort", encode(effort))
        end
    end
    if t.output_format then
        local err
        format_text, err = chat_format({ "output_format" }, t.output_format, body)
        if not format_text then return bad(err, "output_format") end
    end
    if format_text then members[#members + 1] = { "response_format", format_text } end
    if t.thinking then
        -- the template's switch (Qwen3's enable_thinking), unless the request sets it itself;
        -- budget_tokens, the chat request's thinking_budget (the block holds that many tokens
        -- at most: then </think> is written for it)
        local kind = t.thinking.type
        local ok, err = check_keys(t.thinking, { type = true, budget_tokens = true, display = true }, "thinking")
        if not ok then return bad(err, "thinking") end
        if kind ~= "enabled" and kind ~= "disabled" and kind ~= "adaptive" then
            return bad('thinking.type must be "enabled", "disabled" or "adaptive"', "thinking")
        end
        local budget = t.thinking.budget_tokens
        -- (Anthropic's rule: a budget with "enabled"; its floor of 1,024 is not held, small
        -- models' blocks being short)
        if kind == "enabled" and (budget == nil or budget == json_null) then
            return bad('thinking.budget_tokens is required with thinking.type "enabled"', "thinking")
        end
        if budget ~= nil and budget ~= json_null then -- (its range: the chat parser's rule, its name renamed)
            if not KIND_OK.integer(budget) then return bad("thinking.budget_tokens must be an integer", "thinking") end
            if kind == "enabled" then members[#members + 1] = { "thinking_budget", shapes.integer(budget) } end
        end
        shapes.add_template_variable(members, t, "enable_thinking", tostring(kind ~= "disabled"))
    else -- (no thinking asked for: none, Anthropic's default, where the template has the switch)
        shapes.add_template_variable(members, t, "enable_thinking", "false")
    end
    return object(members), setmetatable({ from = from }, View)
end

-- The chat request's names -> Anthropic's, in an error's message; the answer's body in
-- Anthropic's error shape (which has no param: the message names the field).
local RENAMES = {
    { "max_completion_tokens", "max_tokens" }, { "response_format.json_schema.schema", "output_format.schema" },
    { "response_format", "output_format" }, { "thinking_budget", "thinking.budget_tokens" },
}
local ERROR_TYPES = { [400] = "invalid_request_error", [401] = "authentication_error", [403] = "permission_error",
                      [404] = "not_found_error", [405] = "invalid_request_error", [413] = "request_too_large",
                      [429] = "rate_limit_error", [503] = "overloaded_error", [529] = "overloaded_error" }
function View:error(err)
    local message = shapes.rename_fields(err.message or "", RENAMES)
    message = gsub(message, 'tool_choice "required"', 'tool_choice {"type": "any"}')
    message = gsub(message, "(tools%[%d+%])%.function%.parameters", "%1.input_schema")
    message = gsub(message, "(tools%[%d+%])%.function%.", "%1.")
    message = gsub(message, "(tool_calls%[%d+%])%.function%.", "%1.")
    message = gsub(message, "messages%[(%d+)%]", function(k)
        local from = self and self.from and self.from[tonumber(k) + 1]
        if from == false then return "system" end
        return from and ("messages[" .. from .. "]") or nil
    end)
    message = gsub(message, "tool_calls%[", "tool_use[")
    if err.param == "stop" then
        message = gsub(gsub(message, "^stop strings", "stop_sequences"), "^stop([%s:=])", "stop_sequences%1")
        message = gsub(message, "a string or an array of strings", "an array of strings") -- (Anthropic's takes no string)
    end
    -- (a final assistant message is Anthropic's prefill: chat's continue_final_message, which
    -- its clients never send)
    message = gsub(message, "not with continue_final_message", "not after a prefill (messages ending in an assistant's)")
    -- (every session place taken: Anthropic's 529, overloaded, which its SDKs raise as
    -- OverloadedError and retry; 503 was their ServiceUnavailableError)
    local status = err.status == 503 and 529 or err.status
    return { status = status, message = message, type = err.type, body = _M.error_body(status, message, nil, self.request_id) }
end

-- (a message may quote the client's bytes: the server writes every answer as valid UTF-8;
-- details: the JSON text of the error's details, Anthropic's error_code, or nil; request_id:
-- the answer's request-id header, which Anthropic's error bodies repeat (its SDKs' ErrorResponse
-- has the member, null where unknown)
function _M.error_body(status, message, details, request_id)
    return object({ { "type", '"error"' }, { "error", object({
        { "type", encode(ERROR_TYPES[status] or (status >= 500 and "api_error" or "invalid_request_error")) },
        { "message", encode(message) }, { "details", details } }) },
        { "request_id", request_id and encode(request_id) or "null" } })
end

-- ------------------------------------------------------------------ the answer

-- A chat finish -> Anthropic's stop_reason and stop_sequence (JSON texts).
local function stop_of(finish)
    if finish.finish_reason == "tool_calls" then return '"tool_use"', "null" end
    if finish.finish_reason == "length" then return '"max_tokens"', "null" end
    if type(finish.stop_reason) == "string" then return '"stop_sequence"', encode(finish.stop_reason) end
    return '"end_turn"', "null"
end

-- usage: Anthropic's input_tokens are those not read from a cache (the prefix pool's).
local function usage_of(u)
    u = u or {}
    local details = type(u.prompt_tokens_details) == "table" and u.prompt_tokens_details or {}
    local cached = details.cached_tokens or 0
    return object({ { "input_tokens", tostring((u.prompt_tokens or 0) - cached) }, { "cache_creation_input_tokens", "0" },
                    { "cache_read_input_tokens", tostring(cached) }, { "output_tokens", tostring(u.completion_tokens or 0) } })
end

local function thinking_block(text) return object({ { "type", '"thinking"' }, { "thinking", encode(text) }, { "signature", '""' } }) end
local function text_block(text) return object({ { "type", '"text"' }, { "text", encode(text) } }) end
local function tool_block(id, name, input)
    return object({ { "type", '"tool_use"' }, { "id", encode(id) }, { "name", encode(name) }, { "input", input } })
end

local function message_json(id, model, blocks, stop_reason, stop_sequence, usage, stats)
    return object({ { "id", encode(id) }, { "type", '"message"' }, { "role", '"assistant"' }, { "model", encode(model) },
                    { "content", "[" .. concat(blocks, ",") .. "]" }, { "stop_reason", stop_reason },
                    { "stop_sequence", stop_sequence }, { "usage", usage }, { "tinyloop", stats } })
end

-- response(chat_json, id) -> the Messages answer's JSON text of a blocking chat answer.
function View:response(chat_json, id)
    local answer = shapes.answer(chat_json)
    local blocks = {}
    if answer.reasoning then blocks[#blocks + 1] = thinking_block(answer.reasoning) end
    if answer.text ~= "" then blocks[#blocks + 1] = text_block(answer.text) end
    for _, call in ipairs(answer.calls) do blocks[#blocks + 1] = tool_block(call.id, call.name, call.arguments) end
    -- (a call max_tokens cut: its tool_use block, input {}, as the stream showed it begun:
    -- Anthropic's documented check reads the last block of a max_tokens answer for a tool_use
    -- to retry with more tokens, and an empty content failed it)
    local cut = answer.cut_call
    if cut then blocks[#blocks + 1] = tool_block(cut.id, cut.name, "{}") end
    local stop_reason, stop_sequence = stop_of(answer.finish)
    return message_json(id, answer.model, blocks, stop_reason, stop_sequence, usage_of(answer.finish.usage), answer.finish.tinyloop)
end

-- ------------------------------------------------------------------ the stream

-- cached_tokens: of prompt_tokens, those the prefix pool serves (known once the session is made)
function View:start_stream(id, _, model, prompt_tokens, cached_tokens)
    self.id, self.model, self.prompt_tokens, self.cached_tokens = id, model, prompt_tokens, cached_tokens or 0
    self.started, self.finished, self.open, self.blocks, self.calls_begun = false, false, nil, 0, {}
end

local function add(out, kind, members)
    local all = { { "type", encode(kind) } }
    for _, m in ipairs(members) do all[#all + 1] = m end
    out[#out + 1] = { kind, object(all) }
end

-- Closes the open block (content_block_stop), and opens one of `kind` (content_block_start).
function View:open_block(out, kind, block)
    if self.open then add(out, "content_block_stop", { { "index", tostring(self.blocks - 1) } }) end
    self.open = kind
    if kind then
        add(out, "content_block_start", { { "index", tostring(self.blocks) }, { "content_block", block } })
        self.blocks = self.blocks + 1
    end
end

local function delta(out, index, kind, field, text)
    add(out, "content_block_delta", { { "index", tostring(index) }, { "delta", object({ { "type", encode(kind) }, { field, encode(text) } }) } })
end

-- The stream's message_start, once (the prompt is read: its usage is known before any token).
function View:start(out)
    if self.started then return end
    self.started = true
    add(out, "message_start", { { "message", message_json(self.id, self.model, {}, "null", "null", object({
        { "input_tokens", tostring(self.prompt_tokens - self.cached_tokens) }, { "cache_creation_input_tokens", "0" },
        { "cache_read_input_tokens", tostring(self.cached_tokens) }, { "output_tokens", "0" } }), nil) } })
end

-- alive() -> the events of a stream that has had nothing to send a while (a long prompt's
-- prefill): message_start, then Anthropic's ping events (its SDKs skip them; Claude Code
-- gives up on a stream silent for 300 s).
function View:alive()
    local out = {}
    if self.finished then return out end
    self:start(out)
    add(out, "ping", {})
    return out
end

-- feed(payload) -> the events {type, json} one chat stream event makes: message_start first;
-- a block per kind of delta (thinking, text, each tool call), started and stopped around its
-- deltas; at the finish message_delta (stop_reason, usage) and message_stop.
function View:feed(payload)
    local out = {}
    if self.finished then return out end
    local deltas = shapes.deltas(payload)
    if deltas[1] and deltas[1].kind == "error" then
        self.finished = true
        -- (the request's own fault found while generating, a grammar too costly to follow: 400's type)
        local kind = deltas[1].type
        local status = kind == "overloaded_error" and 503 or kind == "invalid_request_error" and 400 or 500
        out[1] = { "error", _M.error_body(status, deltas[1].message, nil, self.request_id) }
        return out
    end
    if #deltas == 0 then return out end
    self:start(out)
    for _, d in ipairs(deltas) do
        if d.kind == "reasoning" then
            if self.open ~= "thinking" then self:open_block(out, "thinking", thinking_block("")) end
            delta(out, self.blocks - 1, "thinking_delta", "thinking", d.text)
        elseif d.kind == "text" then
            if self.open ~= "text" then self:open_block(out, "text", text_block("")) end
            delta(out, self.blocks - 1, "text_delta", "text", d.text)
        elseif d.kind == "call" then
            self.calls_begun[d.id] = true
            self:open_block(out, "tool_use", tool_block(d.id, d.name, "{}"))
        elseif d.kind == "arguments" and self.open == "tool_use" then
            delta(out, self.blocks - 1, "input_json_delta", "partial_json", d.text)
        elseif d.kind == "finish" then
            -- (a call max_tokens cut that the stream has not begun: the calls of a request's
            -- own grammar are read whole at the end, and the blocking answer has its block)
            local cut = d.cut_call
            if cut and not self.calls_begun[cut.id] then self:open_block(out, "tool_use", tool_block(cut.id, cut.name, "{}")) end
            self:open_block(out, nil)
            self.finished = true
            local stop_reason, stop_sequence = stop_of(d)
            add(out, "message_delta", { { "delta", object({ { "stop_reason", stop_reason }, { "stop_sequence", stop_sequence } }) },
                                        { "usage", usage_of(d.usage) }, { "tinyloop", d.tinyloop } })
            add(out, "message_stop", {})
        end
    end
    return out
end

return _M

-- tinyloop.server.responses: OpenAI's Responses API (POST /v1/responses) as a view of the chat
-- completions path. Pure Lua (no ngx): the busted suite tests it without nginx.
--
-- A Responses request is the chat request it means (the input items as messages, instructions
-- as the first system message, its flat tools and text.format in chat's nested shapes), so
-- one parser checks both and one engine path runs both; the chat answer, or each chunk of its
-- stream, is then read back as Responses output items and semantic events. A response is
-- stored (store, true by default, as OpenAI's): the server keeps its own part of the
-- conversation (its input's messages and its reply, as chat messages), the id of the response
-- it continued, and its response object, so that a later request's previous_response_id
-- continues the whole chain and GET /v1/responses/{id} returns the object. Where they are kept
-- is the server's (a lookup function here: this module stays pure). conversation objects,
-- background runs and the other stored objects are refused, saying so.
--
--   local responses = require "tinyloop.server.responses"
--   local chat_body, view = responses.to_chat(body, lookup, lookup_item) -- nil, err: the field named
--                                    -- lookup(id) -> messages | nil; lookup_item(id) -> an input item | nil
--   local req, err = request.parse_chat(chat_body, ...)  -- err: view:error(err) renames its fields
--   body = view:response(chat_json, id)                  -- a blocking answer
--   view:start_stream(id, created, model)                -- or a stream:
--   local events = view:feed(chunk_json)                 --   {type, json} per event
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local cjson = require "cjson.safe"
local json_text = require "tinyloop.json_text"
local shapes = require "tinyloop.server.shapes"
local chat_content_text = require("tinyloop.chat").content_text
local REASONING_END = require("tinyloop.reasoning").END
local MAX_LOGPROBS = tonumber(require("tinyloop").C.TL_MAX_TOP_LOGPROBS) -- the engine's most alternatives

local type, pairs, ipairs, tostring, next = type, pairs, ipairs, tostring, next
local concat, gsub = table.concat, string.gsub
local raw_member = json_text.member
local json_null = cjson.null
local encode, bad, is_array, shown, object, check_keys = shapes.encode, shapes.bad, shapes.is_array, shapes.shown, shapes.object,
                                                         shapes.check_keys

local _M = {}

-- ------------------------------------------------------------------ the request

-- A field the answer echoes: its value as sent (a string), else the default's JSON text.
local function echoed(v, default) return type(v) == "string" and encode(v) or default end

-- The Responses fields read here, by JSON kind. Chat's fields of the same meaning and name
-- (temperature, top_p, user, seed, stop and TinyLoop's and vLLM's extensions: PASSED) go
-- to the chat request as sent, checked there.
local OWN = {
    input = "any", instructions = "string", max_output_tokens = "integer", tools = "array",
    tool_choice = "any", text = "object", include = "array", top_logprobs = "integer", reasoning = "object",
    metadata = "object", store = "boolean", truncation = "string", background = "boolean",
    service_tier = "string", safety_identifier = "string", prompt_cache_key = "string", stream_options = "object",
    prompt_cache_retention = "string", max_tool_calls = "integer", previous_response_id = "string",
    -- (OpenAI's prompt caching mode and compaction of long chains: the prefix pool keeps what its
    -- budget holds, and a chain that outgrows the context is refused, not compacted)
    prompt_cache_options = "object", context_management = "any",
    -- (Codex's own metadata, on every request it sends: nothing here reads it)
    client_metadata = "object",
}
local PASS = { user = true, parallel_tool_calls = true, stop = true }
for _, k in ipairs(shapes.PASSED) do PASS[k] = true end
-- Fields this server cannot honour (no conversation objects or prompt templates are kept):
-- refused unless null, with why. (max_tool_calls caps OpenAI's built-in tools' calls: with
-- function tools only, it changes nothing.)
local REFUSED = {
    conversation = "conversation objects are not kept here: continue a response with previous_response_id, or send the " ..
        "whole conversation in input",
    prompt = "stored prompt templates are not kept here: send the text in input and instructions",
}
-- include's values: the logprobs of the output text, and the others OpenAI lists, which name
-- outputs this server never makes (hosted tools' results, an encrypted reasoning: the reasoning
-- is returned as text), so they change nothing.
local INCLUDE = {
    ["message.output_text.logprobs"] = true, ["reasoning.encrypted_content"] = true,
    ["file_search_call.results"] = true, ["web_search_call.results"] = true, ["web_search_call.action.sources"] = true,
    ["message.input_image.image_url"] = true, ["computer_call_output.output.image_url"] = true,
    ["code_interpreter_call.outputs"] = true,
}
local EFFORTS = shapes.REASONING_EFFORTS

-- A content part of an input message -> chat's text part, or nil, err.
local TEXT_PARTS = { input_text = true, output_text = true, text = true }
local PART_KEYS = { type = true, text = true, annotations = true, logprobs = true }
local function text_part(part, where)
    if type(part) ~= "table" or is_array(part) then return nil, where .. ' must be an object {"type": "input_text", "text": ...}' end
    -- a refusal an answer held, sent back: its words are the assistant's text
    if part.type == "refusal" then
        local ok, err = check_keys(part, { type = true, refusal = true }, where)
        if not ok then return nil, err end
        if type(part.refusal) ~= "string" then return nil, where .. ".refusal must be a string" end
        return { type = "text", text = part.refusal }
    end
    if not TEXT_PARTS[part.type] then
        return nil, ('%s.type = %s: only "input_text" and "output_text" parts are supported (this model reads text)')
            :format(where, shown(part.type))
    end
    local ok, err = shapes.check_keys(part, PART_KEYS, where)
    if not ok then return nil, err end
    if type(part.text) ~= "string" then return nil, where .. ".text must be a string" end
    return { type = "text", text = part.text }
end

-- A message's or an output's content: a string, or an array of text parts -> chat's content.
local function content_of(content, where)
    if type(content) == "string" then return content end
    if not is_array(content) or #content == 0 then
        return nil, where .. " must be a string or a non-empty array of input_text parts"
    end
    local parts = {}
    for i, part in ipairs(content) do
        local p, err = text_part(part, ("%s[%d]"):format(where, i - 1))
        if not p then return nil, err end
        parts[i] = p
    end
    return parts
end

local MESSAGE_KEYS = { type = true, role = true, content = true, id = true, status = true, phase = true }
-- an assistant message's phase (OpenAI's, sent back as it came): a label for the client
local PHASES = { commentary = true, final_answer = true }
-- A namespace's function as chat's function: "NAMESPACE__NAME" (chat's names are letters,
-- digits, _ and -: another separator would be refused there), which output items split back.
local NAMESPACE_JOIN = "__"
local function namespaced_name(namespace, name) return namespace .. NAMESPACE_JOIN .. name end
local CALL_KEYS = { type = true, call_id = true, name = true, arguments = true, id = true, status = true, namespace = true }
local OUTPUT_KEYS = { type = true, call_id = true, output = true, id = true, status = true }
local REASONING_KEYS = { type = true, id = true, summary = true, content = true, encrypted_content = true, status = true }
local ITEM_REFERENCE_KEYS = { type = true, id = true }
local ROLES = { user = true, system = true, developer = true, assistant = true }

-- A reasoning item's text: its reasoning_text content, else its summary's text.
local function reasoning_text(item, where)
    for _, field in ipairs({ "content", "summary" }) do
        local list = item[field]
        if list ~= nil and list ~= json_null then
            if not is_array(list) then return nil, ("%s.%s must be an array"):format(where, field) end
            local texts = {}
            for i, part in ipairs(list) do
                if type(part) ~= "table" or type(part.text) ~= "string" then
                    return nil, ("%s.%s[%d] must be an object {\"type\", \"text\"}"):format(where, field, i - 1)
                end
                texts[i] = part.text
            end
            if #texts > 0 then return concat(texts, "\n") end
        end
    end
    return nil
end

-- input (a string, or an array of items) -> chat's messages, and where each came from:
-- from[k], the index of the input item message k came from (false: the instructions), and
-- calls_from[k][j], that of its j-th tool call's item; or nil, err. Items: messages (type
-- "message" or left out), function_call (an assistant's call: joined to the assistant message
-- just before it, as chat's tool_calls), function_call_output (a tool message) and reasoning
-- (the reasoning_content of the assistant turn it is part of: the assistant message or call
-- that follows it, or the one it follows and whose calls follow it).
local function messages_of(input, instructions, earlier, lookup_item)
    local messages, from, calls_from = {}, {}, {}
    if instructions then messages[1], from[1] = { role = "system", content = instructions }, false end
    -- a previous response's conversation (its instructions are not carried over: OpenAI's rule)
    for _, m in ipairs(earlier or {}) do messages[#messages + 1], from[#messages + 1] = m, "previous" end
    local before_input = #messages
    if type(input) == "string" then
        messages[#messages + 1], from[#messages + 1] = { role = "user", content = input }, 0
        return messages, from, calls_from
    end
    if not is_array(input) or #input == 0 then
        return nil, "input must be a string or a non-empty array of items (messages, function calls and their outputs)"
    end
    local reasoning -- reasoning items' text, for the assistant turn they are part of
    local function add(m, i)
        messages[#messages + 1], from[#messages + 1] = m, i
        if m.role ~= "assistant" then reasoning = nil end -- (another turn: it was nobody's)
        return m
    end
    local function take_reasoning(m)
        if reasoning then
            m.reasoning_content = m.reasoning_content and (m.reasoning_content .. "\n" .. reasoning) or reasoning
            reasoning = nil
        end
    end
    for i, item in ipairs(input) do
        local where = ("input[%d]"):format(i - 1)
        if type(item) ~= "table" or is_array(item) then
            return nil, where .. ' must be an object: a message {"role", "content"} or an item {"type", ...}'
        end
        local kind = item.type
        if kind == "item_reference" then
            -- an output item of a stored response, by the id it gave it (the AI SDK sends its
            -- replies back so while store is on): the item itself, from the store
            local ok, err = check_keys(item, ITEM_REFERENCE_KEYS, where)
            if not ok then return nil, err end
            if type(item.id) ~= "string" then return nil, where .. ".id must be a string" end
            local found = lookup_item and lookup_item(item.id)
            if not found then
                return nil, ("%s: item %s is not found (its response made with store: false, deleted, or dropped to make " ..
                             "room: send the item itself)"):format(where, shown(item.id))
            end
            item, kind = found, found.type
        end
        if kind == nil or kind == "message" then
            local ok, err = check_keys(item, MESSAGE_KEYS, where)
            if not ok then return nil, err end
            if not ROLES[item.role] then
                return nil, ('%s.role must be "user", "system", "developer" or "assistant", got %s'):format(where, shown(item.role))
            end
            if item.phase ~= nil and item.phase ~= json_null and not (item.role == "assistant" and PHASES[item.phase]) then
                return nil, where .. '.phase must be "commentary" or "final_answer" (an assistant message\'s), or null'
            end
            local content
            content, err = content_of(item.content, where .. ".content")
            if content == nil then return nil, err end
            take_reasoning(add({ role = item.role, content = content }, i - 1))
        elseif kind == "function_call" then
            local ok, err = check_keys(item, CALL_KEYS, where)
            if not ok then return nil, err end
            for _, k in ipairs({ "call_id", "name", "arguments" }) do
                if type(item[k]) ~= "string" then return nil, ("%s.%s must be a string"):format(where, k) end
            end
            local m = messages[#messages]
            -- (an earlier response's reply is a turn of its own: a call in the input is a new one)
            if not (m and m.role == "assistant" and from[#messages] ~= false and from[#messages] ~= "previous") then
                m = add({ role = "assistant", content = json_null }, i - 1)
            end
            take_reasoning(m)
            m.tool_calls = m.tool_calls or {}
            if item.namespace ~= nil and item.namespace ~= json_null and type(item.namespace) ~= "string" then
                return nil, where .. ".namespace must be a string"
            end
            -- (a namespace's function: chat's NAMESPACE__NAME, as its tool was declared)
            local name = type(item.namespace) == "string" and namespaced_name(item.namespace, item.name) or item.name
            m.tool_calls[#m.tool_calls + 1] = { id = item.call_id, type = "function",
                                                ["function"] = { name = name, arguments = item.arguments } }
            calls_from[#messages] = calls_from[#messages] or {}
            calls_from[#messages][#m.tool_calls] = i - 1
        elseif kind == "function_call_output" then
            local ok, err = check_keys(item, OUTPUT_KEYS, where)
            if not ok then return nil, err end
            if type(item.call_id) ~= "string" then return nil, where .. ".call_id must be a string" end
            local content
            content, err = content_of(item.output, where .. ".output")
            if content == nil then return nil, err end
            add({ role = "tool", tool_call_id = item.call_id, content = content }, i - 1)
        elseif kind == "reasoning" then
            local ok, err = check_keys(item, REASONING_KEYS, where)
            if not ok then return nil, err end
            local text
            text, err = reasoning_text(item, where)
            if err then return nil, err end
            if text then reasoning = reasoning and (reasoning .. "\n" .. text) or text end
        else
            return nil, ('%s.type = %s: only "message", "function_call", "function_call_output" and "reasoning" items are ' ..
                         "supported (this server runs function tools only)"):format(where, shown(kind))
        end
    end
    if #messages == before_input then
        return nil, "input holds no message, function call or output (reasoning items alone are no conversation)"
    end
    return messages, from, calls_from
end

local TOOL_KEYS = { type = true, name = true, description = true, parameters = true, strict = true }
-- (defer_loading: OpenAI's tool search discovers such a function later; here every one is shown)
local NAMESPACED_KEYS = { type = true, name = true, description = true, parameters = true, strict = true, defer_loading = true }
local NAMESPACE_KEYS = { type = true, name = true, description = true, tools = true }

-- A function tool (where: its place in the request) as chat's, or nil, err. namespace: the
-- namespace tool it is in ({name, description}), or nil.
local function chat_function(tool, raw_tool, where, namespace)
    if type(tool) ~= "table" or is_array(tool) then return nil, where .. ' must be an object {"type": "function", "name", ...}' end
    if tool.type ~= "function" then
        return nil, ('%s.type = %s: only "function" tools are served here%s'):format(where, shown(tool.type),
                                                                                 namespace and "" or ' (and "namespace" tools of them)')
    end
    local ok, err = check_keys(tool, namespace and NAMESPACED_KEYS or TOOL_KEYS, where)
    if not ok then return nil, err end
    local members, fields = {}, shapes.raw_fields(raw_tool)
    for _, k in ipairs({ "name", "description", "parameters", "strict" }) do
        if tool[k] ~= nil then members[#members + 1] = { k, fields[k] } end
    end
    if namespace then
        -- (checked here, at their place in the request: chat's checks would name the flat list's)
        if type(tool.name) ~= "string" or tool.name == "" or tool.name:find("[^%w_%-]") then
            return nil, where .. ".name must be letters, digits, underscores or dashes"
        end
        local flat = namespaced_name(namespace.name, tool.name)
        if #flat > 64 then
            return nil, ("%s.name: %s, the name the model sees, is %d characters: at most 64"):format(where, flat, #flat)
        end
        if tool.parameters ~= nil and (type(tool.parameters) ~= "table" or is_array(tool.parameters)) then
            return nil, where .. ".parameters must be a JSON Schema object"
        end
        members[1] = { "name", encode(flat) }
        -- (the namespace's description goes with each of its functions: the model sees them flat)
        local said = type(tool.description) == "string" and tool.description or nil
        local about = namespace.description ~= "" and (namespace.name .. ": " .. namespace.description) or nil
        local description = about and said and (about .. "\n" .. said) or about or said
        if description then
            local found = false
            for _, m in ipairs(members) do
                if m[1] == "description" then m[2], found = encode(description), true end
            end
            if not found then table.insert(members, 2, { "description", encode(description) }) end
        end
    end
    return '{"type":"function","function":' .. object(members) .. "}"
end

-- tools: Responses' flat function tools -> chat's nested ones, each member's text as sent
-- (a schema's key order is the order the model writes its keys in), and the functions of
-- namespace tools ({"type": "namespace", "name", "description", "tools"}: Codex's default
-- request has one) flat, named NAMESPACE__NAME -> the tools' JSON text, and the namespaced
-- names ({ [chat name] = {namespace, name} }); or nil, err.
local function chat_tools(tools, raw, allowed)
    local out, raw_tools, namespaced = {}, shapes.raw_list(raw), {}
    for i, tool in ipairs(tools) do
        local where = ("tools[%d]"):format(i - 1)
        if type(tool) == "table" and tool.type == "namespace" then
            local ok, err = check_keys(tool, NAMESPACE_KEYS, where)
            if not ok then return nil, err end
            if type(tool.name) ~= "string" or tool.name == "" or tool.name:find("[^%w_%-]") then
                return nil, where .. ".name must be letters, digits, underscores or dashes"
            end
            if tool.description ~= nil and tool.description ~= json_null and type(tool.description) ~= "string" then
                return nil, where .. ".description must be a string"
            end
            if not is_array(tool.tools) or #tool.tools == 0 then return nil, where .. ".tools must be a non-empty array of function tools" end
            local raw_inner = shapes.raw_list(shapes.raw_fields(raw_tools[i]).tools)
            local namespace = { name = tool.name, description = type(tool.description) == "string" and tool.description or "" }
            for j, inner in ipairs(tool.tools) do
                local at = ("%s.tools[%d]"):format(where, j - 1)
                local text, err = chat_function(inner, raw_inner[j], at, namespace)
                if not text then return nil, err end
                local flat = namespaced_name(tool.name, inner.name)
                if namespaced[flat] then return nil, ("%s.name: %s is declared twice"):format(at, flat) end
                namespaced[flat] = { namespace = tool.name, name = inner.name }
                -- (allowed_tools naming the namespace allows its functions)
                if not allowed or allowed[tool.name] or allowed[flat] then out[#out + 1] = text end
            end
        else
            local text, err = chat_function(tool, raw_tools[i], where)
            if not text then return nil, err end
            if not allowed or allowed[tool.name] then out[#out + 1] = text end
        end
    end
    return "[" .. concat(out, ",") .. "]", namespaced
end

-- tool_choice -> chat's tool_choice text, and the names of the tools it allows (allowed_tools:
-- the tools sent are cut to those; nil: all), or nil, err.
local function chat_tool_choice(choice, tools)
    -- (an unknown word is refused here, in this API's shape: chat's check named its own,
    -- {"type": "function", "function": {...}}, which this API refuses)
    if choice == "none" or choice == "auto" or choice == "required" then return encode(choice) end
    if type(choice) == "table" and choice.type == "allowed_tools" then
        local ok, err = check_keys(choice, { type = true, mode = true, tools = true }, "tool_choice")
        if not ok then return nil, err end
        if choice.mode ~= "auto" and choice.mode ~= "required" then return nil, 'tool_choice.mode must be "auto" or "required"' end
        if not is_array(choice.tools) or #choice.tools == 0 then return nil, "tool_choice.tools must be a non-empty array of tools" end
        local declared, allowed = {}, {}
        for _, tool in ipairs(tools or {}) do
            if type(tool) == "table" then declared[tool.name or false] = true end
        end
        for j, tool in ipairs(choice.tools) do
            if type(tool) ~= "table" or tool.type ~= "function" or type(tool.name) ~= "string" then
                return nil, ('tool_choice.tools[%d] must be {"type": "function", "name": ...} (function tools only)'):format(j - 1)
            end
            if not declared[tool.name] then
                return nil, ("tool_choice.tools[%d] names %s, which is not among tools"):format(j - 1, shown(tool.name))
            end
            allowed[tool.name] = true
        end
        return encode(choice.mode), allowed
    end
    if type(choice) == "table" and choice.type == "function" then
        for k in ordered_pairs(choice) do
            if k ~= "type" and k ~= "name" then return nil, ("unknown field '%s' in tool_choice"):format(tostring(k)) end
        end
        if type(choice.name) ~= "string" then return nil, 'tool_choice {"type": "function"} needs the function\'s "name"' end
        return '{"type":"function","function":{"name":' .. encode(choice.name) .. "}}"
    end
    return nil, 'tool_choice must be "none", "auto", "required", {"type": "function", "name": ...} or {"type": ' ..
        '"allowed_tools", ...} (function tools only)'
end

-- text: {format: {type: "text" | "json_object" | "json_schema", ...}, verbosity} -> chat's
-- response_format's JSON text (nil: none), or nil, err.
local FORMAT_KEYS = { type = true, name = true, schema = true, strict = true, description = true }
local function chat_format(text, body)
    for k in ordered_pairs(text) do
        if k ~= "format" and k ~= "verbosity" then return nil, ("unknown field '%s' in text"):format(tostring(k)) end
    end
    -- (a hint, OpenAI's models' own: taken, it changes nothing here)
    if text.verbosity ~= nil and text.verbosity ~= json_null and text.verbosity ~= "low" and text.verbosity ~= "medium" and
        text.verbosity ~= "high" then
        return nil, 'text.verbosity must be "low", "medium" or "high"'
    end
    local f = text.format
    if f == nil or f == json_null then return false end
    if type(f) ~= "table" or is_array(f) then return nil, 'text.format must be an object {"type": ...}' end
    local ok, err = check_keys(f, FORMAT_KEYS, "text.format")
    if not ok then return nil, err end
    if f.type == "text" or f.type == "json_object" then
        if next(f, nil) ~= "type" or next(f, "type") ~= nil then
            return nil, ('text.format {"type": "%s"} has no other fields'):format(f.type)
        end
        return '{"type":"' .. f.type .. '"}'
    end
    if f.type ~= "json_schema" then return nil, 'text.format.type must be "text", "json_object" or "json_schema"' end
    -- (the name's rule is chat's, response_format.json_schema.name's)
    local members = {}
    for _, k in ipairs({ "name", "description", "schema", "strict" }) do
        if f[k] ~= nil then members[#members + 1] = { k, raw_member(body, { "text", "format", k }) } end
    end
    return '{"type":"json_schema","json_schema":' .. object(members) .. "}"
end

-- A view: what the answer echoes of the request, and the map from the chat request's
-- messages back to the input items.
local View = { ID_PREFIX = "resp" }
View.__index = View

-- to_chat(body, lookup) -> the chat completions body that means the same, and its view; or
-- nil, err (the Responses field named). lookup(id) -> the stored conversation of response id
-- (chat messages) or nil; lookup nil: nothing is stored (the server has no store).
function _M.to_chat(body, lookup, lookup_item)
    local t, members, raw = shapes.read_fields(body, OWN, PASS, REFUSED)
    if not t then return nil, members end
    if t.input == nil then return bad("input is required", "input") end
    local earlier
    if t.previous_response_id ~= nil then
        if not lookup then -- (the code too: clients that read it send the whole conversation instead)
            local _, e = bad("responses are not stored by this server (no store configured): send the whole conversation in input",
                             "previous_response_id")
            e.code = "previous_response_not_found"
            return nil, e
        end
        earlier = lookup(t.previous_response_id)
        if not earlier then -- (OpenAI's answer and code, which clients read to send the whole conversation instead)
            local _, e = bad(("Previous response with id %s not found (made with store: false, deleted, dropped to make " ..
                              "room, or part of a chain one of whose responses is gone)"):format(shown(t.previous_response_id)),
                             "previous_response_id")
            e.code = "previous_response_not_found"
            return nil, e
        end
    end
    if t.background then return bad("background responses are not supported: each is answered whole, or streamed", "background") end
    -- ("auto" drops input that does not fit: here an input that does not fit is refused, and
    -- one that fits is what "auto" would keep)
    if t.truncation ~= nil and t.truncation ~= "disabled" and t.truncation ~= "auto" then
        return bad('truncation must be "disabled" or "auto"', "truncation")
    end
    if t.service_tier ~= nil and t.service_tier ~= "auto" and t.service_tier ~= "default" then
        return bad('service_tier is not supported (only "auto" or "default", or null)', "service_tier")
    end
    if t.stream_options ~= nil then
        for k, v in ordered_pairs(t.stream_options) do
            if k ~= "include_obfuscation" or (type(v) ~= "boolean" and v ~= json_null) then
                return bad("stream_options takes include_obfuscation (a boolean; no obfuscation is added here)", "stream_options")
            end
        end
    end
    local messages, from, calls_from = messages_of(t.input, t.instructions, earlier, lookup_item)
    if not messages then return bad(from, "input") end
    -- what a stored response keeps: its own messages (neither the instructions nor the earlier
    -- responses', which their entries keep; the reply joins them), and the response it continued
    local own = {}
    for k, m in ipairs(messages) do
        if from[k] ~= false and from[k] ~= "previous" then own[#own + 1] = m end
    end
    local store = t.store ~= false and lookup ~= nil
    members[#members + 1] = { "messages", encode(messages) }
    if t.max_output_tokens ~= nil then members[#members + 1] = { "max_completion_tokens", shapes.integer(t.max_output_tokens) } end
    local tool_choice_text, allowed
    if t.tool_choice ~= nil then
        tool_choice_text, allowed = chat_tool_choice(t.tool_choice, t.tools)
        if not tool_choice_text then return bad(allowed, "tool_choice") end
    end
    local namespaced -- (the namespaces' functions by chat's name, which the answer's calls split back)
    if t.tools then
        local tools_text, names_or_err = chat_tools(t.tools, raw.tools, allowed)
        if not tools_text then return bad(names_or_err, "tools") end
        members[#members + 1] = { "tools", tools_text }
        namespaced = names_or_err
    end
    if tool_choice_text then shapes.add_tool_choice(members, tool_choice_text, t.tools) end
    local format_text
    if t.text then
        local err
        format_text, err = chat_format(t.text, body)
        if format_text == nil then return bad(err, "text") end
        if format_text then members[#members + 1] = { "response_format", format_text } end
    end
    local logprobs = false
    for i, v in ipairs(t.include or {}) do
        if not INCLUDE[v] then
            return bad(("include[%d] = %s is not one of OpenAI's include values"):format(i - 1, shown(v)), "include")
        end
        if v == "message.output_text.logprobs" then logprobs = true end
    end
    -- (top_logprobs says how many alternatives; include asks for the logprobs: OpenAI's rule)
    -- (checked whether or not include asks: it is echoed back either way; the chat request checks
    -- the same range, the engine's)
    if t.top_logprobs ~= nil and (t.top_logprobs < 0 or t.top_logprobs > MAX_LOGPROBS) then
        return bad(("top_logprobs = %d must be in [0, %d]"):format(t.top_logprobs, MAX_LOGPROBS), "top_logprobs")
    end
    if logprobs then
        members[#members + 1] = { "logprobs", "true" }
        members[#members + 1] = { "top_logprobs", shapes.integer(t.top_logprobs or 0) }
    end
    local effort, summary
    if t.reasoning then
        for k, v in ordered_pairs(t.reasoning) do
            if k == "effort" then
                if v ~= json_null and not EFFORTS[v] then
                    return bad('reasoning.effort must be "none", "minimal", "low", "medium", "high", "xhigh" or "max"', "reasoning")
                end
                effort = v ~= json_null and v or nil
            elseif k == "summary" or k == "generate_summary" then -- (both: summary's, the later in key order)
                if v ~= json_null and type(v) ~= "string" then return bad(("reasoning.%s must be a string"):format(k), "reasoning") end
                summary = v ~= json_null and v or summary
            else
                return bad(("unknown field '%s' in reasoning"):format(tostring(k)), "reasoning")
            end
        end
    end
    -- a template variable (gpt-oss's templates read it), unless the request sets it
    if effort then shapes.add_template_variable(members, t, "reasoning_effort", encode(effort)) end
    local view = setmetatable({
        from = from, calls_from = calls_from, logprobs = logprobs, stream = t.stream == true, namespaced = namespaced,
        store = store, own = store and own or nil, previous = t.previous_response_id,
        -- what the answer echoes (OpenAI's defaults where the request left a field out)
        echo = {
            { "instructions", t.instructions and encode(t.instructions) or "null" },
            { "max_output_tokens", t.max_output_tokens and shapes.integer(t.max_output_tokens) or "null" },
            { "parallel_tool_calls", t.parallel_tool_calls == false and "false" or "true" },
            { "previous_response_id", t.previous_response_id and encode(t.previous_response_id) or "null" },
            { "reasoning", object({ { "effort", effort and encode(effort) or "null" }, { "summary", echoed(summary, "null") } }) },
            { "store", store and "true" or "false" },
            -- (the value decoded with: left out, the engine's 0, greedy; OpenAI's 1 samples, and
            -- echoing it described a decoding the request did not get)
            { "temperature", t.temperature and raw.temperature or "0" },
            { "text", object({ { "format", format_text and raw_member(body, { "text", "format" }) or '{"type":"text"}' },
                               { "verbosity", echoed(t.text and t.text.verbosity, '"medium"') } }) },
            { "tool_choice", t.tool_choice and raw.tool_choice or '"auto"' },
            { "tools", t.tools and raw.tools or "[]" },
            { "top_logprobs", shapes.integer(t.top_logprobs or 0) },
            { "top_p", t.top_p and raw.top_p or "1" },
            { "truncation", t.truncation == "auto" and '"auto"' or '"disabled"' }, -- (as sent: a client reads back its own)
            { "user", t.user and encode(t.user) or "null" },
            { "metadata", t.metadata and raw.metadata or "{}" },
            -- (the fields that change nothing here, as sent: a client reads back its own)
            { "max_tool_calls", t.max_tool_calls and shapes.integer(t.max_tool_calls) or "null" },
            { "prompt_cache_key", echoed(t.prompt_cache_key, "null") },
            { "safety_identifier", echoed(t.safety_identifier, "null") },
        },
    }, View)
    return object(members), view
end

-- The chat request's names -> the Responses request's, in an error's message and param.
local RENAMES = {
    { "response_format.json_schema", "text.format" }, { "response_format", "text.format" },
    { "max_completion_tokens", "max_output_tokens" }, { "max_tokens", "max_output_tokens" }, -- (the engine's word too)
}
-- (a tool's fields sit in the tool itself here: tools[i].function.parameters is tools[i].parameters)
function View:error(err)
    local message = err.message or ""
    message = gsub(shapes.rename_fields(message, RENAMES), "(tools%[%d+%])%.function%.", "%1.")
    -- a call of messages[k] is the input item it came from; messages[k] too (the instructions:
    -- message 0 before them)
    message = gsub(message, "messages%[(%d+)%]%.tool_calls%[(%d+)%]", function(k, j)
        local calls = self.calls_from[tonumber(k) + 1]
        local from = calls and calls[tonumber(j) + 1]
        return from and ("input[" .. from .. "]") or nil
    end)
    message = gsub(message, "(input%[%d+%])%.function%.", "%1.")
    message = gsub(message, "messages%[(%d+)%]", function(k)
        local from = self.from[tonumber(k) + 1]
        if from == false then return "instructions" end
        if from == "previous" then return "previous_response_id's conversation[" .. k .. "]" end
        return from and ("input[" .. from .. "]") or nil
    end)
    message = gsub(message, "%f[%w_]messages%f[^%w_]", "input")
    local param = err.param
    if param == "messages" then
        param = message:find("^instructions") and "instructions" or message:find("^previous_response_id") and
            "previous_response_id" or "input"
    elseif param == "response_format" then
        param = "text"
    elseif param == "max_completion_tokens" or param == "max_tokens" then
        param = "max_output_tokens"
    elseif param == "logprobs" then
        param = "top_logprobs"
    end
    return { status = err.status, message = message, param = param, type = err.type }
end

-- ------------------------------------------------------------------ the answer

-- A chat answer's usage -> Responses'. reasoning_tokens: the reasoning's text as the
-- tokenizer encodes it (view.count_tokens, the server's; the chat answer does not say which of
-- its tokens were reasoning).
local function usage_of(u, reasoning_tokens)
    if type(u) ~= "table" then return "null" end
    local details = type(u.prompt_tokens_details) == "table" and u.prompt_tokens_details or {}
    return object({
        { "input_tokens", tostring(u.prompt_tokens or 0) },
        { "input_tokens_details", object({ { "cached_tokens", tostring(details.cached_tokens or 0) } }) },
        { "output_tokens", tostring(u.completion_tokens or 0) },
        { "output_tokens_details", object({ { "reasoning_tokens", tostring(reasoning_tokens or 0) } }) },
        { "total_tokens", tostring(u.total_tokens or 0) },
    })
end

local function logprob_list(entries) return "[" .. concat(entries, ",") .. "]" end

local function reasoning_item(id, text, status)
    return object({ { "id", encode(id) }, { "type", '"reasoning"' }, { "summary", "[]" },
                    { "content", "[" .. object({ { "type", '"reasoning_text"' }, { "text", encode(text) } }) .. "]" },
                    { "encrypted_content", "null" }, { "status", encode(status) } })
end

local function text_part_json(text, logprobs)
    return object({ { "type", '"output_text"' }, { "text", encode(text) }, { "annotations", "[]" }, { "logprobs", logprobs or "[]" } })
end

local function message_item(id, parts, status)
    return object({ { "id", encode(id) }, { "type", '"message"' }, { "status", encode(status) }, { "role", '"assistant"' },
                    { "content", "[" .. parts .. "]" } })
end

-- (namespace: the namespace tool the function is in, whose name the item has beside the
-- function's own, as OpenAI's function_call items have it)
local function call_item(id, call_id, name, arguments, status, namespace)
    local members = { { "id", encode(id) }, { "type", '"function_call"' }, { "status", encode(status) },
                      { "call_id", encode(call_id) } }
    if namespace then members[#members + 1] = { "namespace", encode(namespace) } end
    members[#members + 1] = { "name", encode(name) }
    members[#members + 1] = { "arguments", encode(arguments) }
    return object(members)
end

-- A call's function as the request named it: its name and namespace (nil for a plain function)
-- from chat's NAMESPACE__NAME.
function View:function_of(chat_name)
    local named = self.namespaced and self.namespaced[chat_name]
    if named then return named.name, named.namespace end
    return chat_name, nil
end

-- The response object: status "in_progress" | "completed" | "incomplete" (a token limit
-- cut it), its output items' JSON texts, usage's JSON text, TinyLoop's stats (JSON text).
function View:response_object(id, created, model, status, items, usage, stats, error_json)
    local members = {
        { "id", encode(id) }, { "object", '"response"' }, { "created_at", tostring(created) }, { "status", encode(status) },
        { "background", "false" }, { "error", error_json or "null" },
        { "incomplete_details", status == "incomplete" and '{"reason":"max_output_tokens"}' or "null" },
        { "model", encode(model) }, { "output", "[" .. concat(items, ",") .. "]" },
    }
    for _, m in ipairs(self.echo) do members[#members + 1] = m end
    members[#members + 1] = { "service_tier", '"default"' }
    members[#members + 1] = { "usage", usage or "null" }
    members[#members + 1] = { "tinyloop", stats }
    return object(members)
end

-- An item's id: its kind's prefix and the response's key: a stored response's first 16 hex
-- digits, public ("resp_" .. 16 + 32 digits -> "msg_" .. the 16: the 32 after them are the
-- id's secret part), else the response's own ("resp_7_12" -> "msg_7_12").
local STORED_ID = "^resp_(" .. ("%x"):rep(16) .. ")" .. ("%x"):rep(32) .. "$"
local function item_key(id)
    return id:match(STORED_ID) or (id:gsub("^resp_", ""))
end

local function status_of(finish_reason) return finish_reason == "length" and "incomplete" or "completed" end

-- The key of a stored response's id ("resp_" .. 16 + 32 hex digits -> the 16), under which the
-- server finds it from an output item's id, or nil (a response not stored).
function _M.stored_key(id) return id:match(STORED_ID) end
-- An output item's id: its kind ("msg", "rs", "fc"), its response's key, the rest ("_k" of a call).
local ITEM_ID = "^(%a+)_(" .. ("%x"):rep(16) .. ")(.*)$"
-- The key of the stored response whose output item `item_id` is, or nil.
function _M.item_response_key(item_id)
    return type(item_id) == "string" and select(2, item_id:match(ITEM_ID)) or nil
end

-- reply_item(reply, item_id) -> the input item that output item `item_id` of a stored
-- response (its reply: the chat message kept) is, as a client would send it back (an
-- item_reference's item), or nil: its message (msg_KEY), reasoning (rs_KEY) or call k (fc_KEY_k).
function _M.reply_item(reply, item_id)
    if type(reply) ~= "table" or type(item_id) ~= "string" then return nil end
    local kind, _, rest = item_id:match(ITEM_ID)
    if kind == "msg" and rest == "" and type(reply.content) == "string" and reply.content ~= "" then
        return { type = "message", role = "assistant", content = reply.content }
    elseif kind == "rs" and rest == "" and type(reply.reasoning_content) == "string" then
        return { type = "reasoning", summary = { { type = "summary_text", text = reply.reasoning_content } } }
    elseif kind == "fc" then
        local k = tonumber(rest:match("^_(%d+)$") or "")
        local call = k and type(reply.tool_calls) == "table" and reply.tool_calls[k]
        if type(call) == "table" and type(call["function"]) == "table" then
            return { type = "function_call", call_id = call.id, name = call["function"].name, arguments = call["function"].arguments }
        end
    end
    return nil
end

-- The tokens of a reasoning text (0 without the server's counter).
function View:reasoning_tokens(text)
    return text and self.count_tokens and self.count_tokens(text) or 0
end

-- The logprobs entries of the tokens that wrote `text` (a message's content), of a reply that
-- also holds reasoning (`after` bytes of it come first) or calls: the tokens whose bytes meet
-- the content's place in the reply's bytes, searched for, where the reply `reasoned`, after
-- the reasoning's </think> when the bytes hold it (the text may be written in the reasoning or
-- the tag too: ">" was found in "</think>"). (All of them where it cannot be found.)
local function text_entries(entries, text, after, reasoned)
    local pieces, starts, at = {}, {}, 0
    for i, e in ipairs(entries) do
        local bytes = json_text.member(e, { "bytes" })
        local list = bytes and json_text.decode(bytes)
        local piece = {}
        for j, b in ipairs(type(list) == "table" and list or {}) do piece[j] = string.char(b) end
        pieces[i], starts[i] = concat(piece), at
        at = at + #pieces[i]
    end
    local joined = concat(pieces)
    local _, tag_end
    if reasoned then _, tag_end = joined:find(REASONING_END, 1, true) end
    if tag_end and tag_end > after then after = tag_end end
    local from = joined:find(text, after + 1, true)
    if not from or text == "" then return text == "" and {} or entries end
    local out, last = {}, from - 1 + #text
    for i, e in ipairs(entries) do
        if starts[i] < last and starts[i] + #pieces[i] > from - 1 then out[#out + 1] = e end
    end
    return out
end

-- response(chat_json, id) -> the Responses answer's JSON text of a blocking chat answer (one
-- choice): a reasoning item (a thinking model's), a message (unless the reply is calls only,
-- or reasoning the token limit cut), a function_call item per call. A token limit's cut
-- leaves the last item incomplete.
function View:response(chat_json, id)
    local answer = shapes.answer(chat_json)
    local status = status_of(answer.finish.finish_reason)
    local items = {} -- { make(status) } in order
    local thought = answer.reasoning
    if thought then items[#items + 1] = function(s) return reasoning_item("rs_" .. item_key(id), thought, s) end end
    -- (a reasoning the limit cut is the last item, incomplete, as OpenAI answers it: an empty
    -- message after it was the incomplete one)
    local cut_in_reasoning = thought and status == "incomplete" and answer.text == ""
    if answer.text ~= "" or (#answer.calls == 0 and not cut_in_reasoning) then
        local entries = answer.logprobs
        if thought or #answer.calls > 0 then entries = text_entries(entries, answer.text, thought and #thought or 0, thought ~= nil) end
        local lp = self.logprobs and logprob_list(entries) or nil
        items[#items + 1] = function(s) return message_item("msg_" .. item_key(id), text_part_json(answer.text, lp), s) end
    end
    for k, call in ipairs(answer.calls) do
        -- (a call read back is whole: a token limit that cut the reply cut what came after it)
        items[#items + 1] = function()
            local name, namespace = self:function_of(call.name)
            return call_item(("fc_%s_%d"):format(item_key(id), k), call.id, name, call.arguments, "completed", namespace)
        end
    end
    for i, make in ipairs(items) do items[i] = make(i == #items and status or "completed") end
    local final = self:response_object(id, answer.created, answer.model, status, items,
                                       usage_of(answer.finish.usage, self:reasoning_tokens(thought)), answer.finish.tinyloop)
    if self.store then self:keep(final, answer.text, thought, answer.calls) end
    return final
end

-- The answer to keep (a stored response): its object's JSON text and its reply as the chat
-- message it is in the conversation (text nil or "": no content; calls {id, name, arguments}).
function View:keep(final, text, thought, calls)
    local reply = { role = "assistant", content = (text and text ~= "") and text or (#calls == 0 and "" or json_null) }
    if thought and thought ~= "" then reply.reasoning_content = thought end
    if #calls > 0 then
        reply.tool_calls = {}
        for k, call in ipairs(calls) do
            reply.tool_calls[k] = { id = call.id, type = "function", ["function"] = { name = call.name, arguments = call.arguments } }
        end
    end
    self.final, self.reply = final, reply
end

-- record() -> what a stored response keeps: its own messages with the reply (chat messages,
-- JSON text), its response object (JSON text) and the id of the response it continued (nil:
-- none); nil when it is not stored (store: false, no store) or did not end (failed).
function View:record()
    if not (self.store and self.final) then return nil end
    local messages = {}
    for i, m in ipairs(self.own) do messages[i] = m end
    messages[#messages + 1] = self.reply
    return encode(messages), self.final, self.previous
end

-- ------------------------------------------------------------------ a stored response's input

-- The text of a stored chat message's content (a string, or text parts: the chat path's rule,
-- tinyloop.chat's; the message was checked when it came in).
local function content_text(content)
    return chat_content_text(content, "input") or ""
end

-- input_items(messages_json, id, order, limit, after) -> GET /v1/responses/{id}/input_items:
-- the input of stored response `id` (its own messages but the reply, as record() kept them)
-- as Responses items, OpenAI's list ({"object": "list", "data", "first_id", "last_id",
-- "has_more"}): `order` "desc" (OpenAI's default: the last first) or "asc", at most `limit`,
-- after the item of id `after`. Each item's id is the response's key and its place, the same
-- at every call. -> the list's JSON text | nil, err (the query parameter named).
-- (response_json: the stored response, whose echoed tools name the namespaces its calls' chat
-- names join: their items show the function's own name and the namespace, as they were sent)
function _M.input_items(messages_json, id, order, limit, after, response_json)
    local messages = cjson.decode(messages_json)
    if type(messages) ~= "table" then return nil, "the stored response cannot be read" end
    local namespaced = {}
    local response = response_json and cjson.decode(response_json)
    for _, tool in ipairs(type(response) == "table" and type(response.tools) == "table" and response.tools or {}) do
        if type(tool) == "table" and tool.type == "namespace" and type(tool.name) == "string" and type(tool.tools) == "table" then
            for _, inner in ipairs(tool.tools) do
                if type(inner) == "table" and type(inner.name) == "string" then
                    namespaced[namespaced_name(tool.name, inner.name)] = { namespace = tool.name, name = inner.name }
                end
            end
        end
    end
    local key, items = item_key(id), {}
    for i = 1, #messages - 1 do -- (the last is the reply)
        local m = messages[i]
        local at = ("%s_in%d"):format(key, i)
        if m.role == "tool" then
            items[#items + 1] = object({ { "id", encode("fco_" .. at) }, { "type", '"function_call_output"' },
                                         { "call_id", encode(tostring(m.tool_call_id)) },
                                         { "output", encode(content_text(m.content)) }, { "status", '"completed"' } })
        elseif m.role == "assistant" then
            if type(m.reasoning_content) == "string" and m.reasoning_content ~= "" then
                items[#items + 1] = reasoning_item("rs_" .. at, m.reasoning_content, "completed")
            end
            if m.content ~= nil and m.content ~= json_null and content_text(m.content) ~= "" then
                items[#items + 1] = message_item("msg_" .. at, text_part_json(content_text(m.content)), "completed")
            end
            for k, call in ipairs(type(m.tool_calls) == "table" and m.tool_calls or {}) do
                local fn = type(call["function"]) == "table" and call["function"] or {}
                local named = namespaced[fn.name]
                items[#items + 1] = call_item(("fc_%s_%d"):format(at, k), tostring(call.id), named and named.name or tostring(fn.name),
                                              tostring(fn.arguments), "completed", named and named.namespace)
            end
        else
            local parts = {}
            if type(m.content) == "string" then
                parts[1] = object({ { "type", '"input_text"' }, { "text", encode(m.content) } })
            else
                for _, part in ipairs(type(m.content) == "table" and m.content or {}) do
                    parts[#parts + 1] = object({ { "type", '"input_text"' }, { "text", encode(type(part) == "table" and part.text or "") } })
                end
            end
            items[#items + 1] = object({ { "id", encode("msg_" .. at) }, { "type", '"message"' }, { "role", encode(tostring(m.role)) },
                                         { "status", '"completed"' }, { "content", "[" .. concat(parts, ",") .. "]" } })
        end
    end
    if order ~= "asc" and order ~= "desc" then return nil, 'order must be "asc" or "desc"', "order" end
    if limit < 1 or limit > 100 then return nil, "limit must be in [1, 100]", "limit" end
    if order == "desc" then
        local reversed = {}
        for i = #items, 1, -1 do reversed[#reversed + 1] = items[i] end
        items = reversed
    end
    local from = 1
    if after then
        from = nil
        for i, item in ipairs(items) do
            if cjson.decode(item).id == after then from = i + 1 break end
        end
        if not from then return nil, ("after = %s is no item of this response's input"):format(shown(after)), "after" end
    end
    local page = {}
    for i = from, math.min(#items, from + limit - 1) do page[#page + 1] = items[i] end
    local function id_of(item) return item and encode(cjson.decode(item).id) or "null" end
    return object({ { "object", '"list"' }, { "data", "[" .. concat(page, ",") .. "]" }, { "first_id", id_of(page[1]) },
                    { "last_id", id_of(page[#page]) }, { "has_more", tostring(from + limit - 1 < #items) } })
end

-- ------------------------------------------------------------------ the stream

-- start_stream(id, created, model): the view reads a chat stream's chunks from now on.
function View:start_stream(id, created, model, _)
    self.id, self.created, self.model = id, created, model
    self.sequence, self.items, self.open, self.pending_logprobs = 0, {}, nil, {}
    self.calls = 0
    self.reply_text, self.reply_calls = {}, {} -- (what a stored response's reply was)
end

-- Adds an event {type, json} to out: the event's fields after its type and sequence number.
function View:event(out, kind, members)
    local all = { { "type", encode(kind) }, { "sequence_number", tostring(self.sequence) } }
    for _, m in ipairs(members) do all[#all + 1] = m end
    self.sequence = self.sequence + 1
    out[#out + 1] = { kind, object(all) }
end

local function where(item) return { "item_id", encode(item.id) }, { "output_index", tostring(item.index) } end

-- The stream's response.created and response.in_progress, once.
-- (then response.in_progress alone: Codex's sign of life, alive)
function View:open_response(out)
    local initial = self:response_object(self.id, self.created, self.model, "in_progress", {}, "null", nil)
    if self.sequence == 0 then self:event(out, "response.created", { { "response", initial } }) end
    self:event(out, "response.in_progress", { { "response", initial } })
end

-- alive() -> the events of a stream that has had nothing to send a while (a long prompt's
-- prefill): its opening events, then response.in_progress again (Codex gives up on a stream
-- without an event for 300 s: its parser hands it events only, a comment restarts nothing;
-- OpenAI's SDKs take a repeated in_progress).
function View:alive()
    local out = {}
    if not self.finished then self:open_response(out) end
    return out
end

-- The open item closed: its .done events, its final JSON kept for the response.
function View:close(out, status)
    local item = self.open
    if not item then return end
    self.open = nil
    local id_m, index_m = where(item)
    local text = concat(item.text)
    local json
    if item.kind == "reasoning" then
        self.thought = (self.thought or "") .. text
        self:event(out, "response.reasoning_text.done", { id_m, index_m, { "content_index", "0" }, { "text", encode(text) } })
        json = reasoning_item(item.id, text, status)
    elseif item.kind == "message" then
        self.reply_text[#self.reply_text + 1] = text
        local lp = logprob_list(item.logprobs)
        self:event(out, "response.output_text.done", { id_m, index_m, { "content_index", "0" }, { "text", encode(text) }, { "logprobs", lp } })
        local part = text_part_json(text, lp)
        self:event(out, "response.content_part.done", { id_m, index_m, { "content_index", "0" }, { "part", part } })
        json = message_item(item.id, part, status)
    else
        -- (a call the token limit cut is left out of the conversation kept, as a blocking
        -- answer leaves it out: its arguments are no JSON object, which a next turn refuses)
        local arguments = json_text.decode(text)
        if type(arguments) == "table" and text:find("^%s*{") then
            self.reply_calls[#self.reply_calls + 1] = { id = item.call_id, name = item.name, arguments = text }
        end
        local name, namespace = self:function_of(item.name)
        self:event(out, "response.function_call_arguments.done", { id_m, index_m, { "name", encode(name) }, { "arguments", encode(text) } })
        json = call_item(item.id, item.call_id, name, text, status, namespace)
    end
    self:event(out, "response.output_item.done", { { "output_index", tostring(item.index) }, { "item", json } })
    self.items[item.index + 1] = json
end

-- Opens an item of `kind` (closing the one open): its .added events.
function View:open_item(out, kind, id, call_id, name)
    self:close(out, "completed")
    local item = { kind = kind, id = id, index = #self.items, text = {}, logprobs = {}, call_id = call_id, name = name }
    self.items[item.index + 1] = false -- (its place; its JSON at the close)
    self.open = item
    if kind == "message" then self.message_seen = true end
    local json
    if kind == "reasoning" then -- (its one content part is there from the start: clients append the deltas to it)
        json = reasoning_item(id, "", "in_progress")
    elseif kind == "message" then
        json = message_item(id, "", "in_progress")
    else
        local own_name, namespace = self:function_of(name)
        json = call_item(id, call_id, own_name, "", "in_progress", namespace)
    end
    self:event(out, "response.output_item.added", { { "output_index", tostring(item.index) }, { "item", json } })
    if kind == "message" then
        local id_m, index_m = where(item)
        self:event(out, "response.content_part.added", { id_m, index_m, { "content_index", "0" }, { "part", text_part_json("") } })
    end
    return item
end

-- A text delta of the message item: its text (maybe none) and the held tokens' logprobs,
-- given to the item as they go out.
function View:text_delta(out, item, text)
    item.text[#item.text + 1] = text
    local lp = self.pending_logprobs
    for _, e in ipairs(lp) do item.logprobs[#item.logprobs + 1] = e end
    self.pending_logprobs = {}
    local id_m, index_m = where(item)
    self:event(out, "response.output_text.delta", { id_m, index_m, { "content_index", "0" }, { "delta", encode(text) },
                                                    { "logprobs", logprob_list(lp) } })
end

-- feed(payload) -> the events {type, json} that a chat stream's event (a chunk's JSON text, an
-- error's, or "[DONE]") makes. The first makes response.created and response.in_progress; the
-- chunk with the finish closes every item and makes response.completed (or .incomplete, with
-- the usage and stats the chat stream's last chunk carries).
function View:feed(payload)
    local out = {}
    if self.finished then return out end
    local deltas, entries = shapes.deltas(payload)
    if deltas[1] and deltas[1].kind == "error" then
        -- the error, then the response's end (clients wait for one): failed, with what it had
        -- (in this API's names, as a whole answer's error: param response_format is text; code
        -- the error's type, where the request's own fault was found while generating)
        local e = self:error(deltas[1])
        local code = encode(e.type == "invalid_request_error" and e.type or "server_error")
        self.finished = true
        self:event(out, "error", { { "code", code }, { "message", encode(e.message) },
                                   { "param", e.param and encode(e.param) or "null" } })
        if self.sequence > 1 then
            self:close(out, "incomplete")
            local failed = self:response_object(self.id, self.created, self.model, "failed", self.items, "null", nil,
                                                object({ { "code", code }, { "message", encode(e.message) } }))
            self:event(out, "response.failed", { { "response", failed } })
        end
        return out
    end
    if #deltas == 0 and #entries == 0 then return out end
    if self.sequence == 0 then self:open_response(out) end
    -- the logprobs of the message's tokens: a chunk's that carries reasoning or a call's pieces
    -- too keeps only its text's tokens (found by their bytes, as a blocking answer's are); the
    -- tokens of a chunk with no text are held for the next, and once the reply has had
    -- reasoning or calls, only those of the held and new tokens that the text's bytes meet go
    -- to it (a </think> read in chunks of its own was given to the text)
    if self.logprobs then
        local other, text, thought = false, {}, {}
        for _, d in ipairs(deltas) do
            if d.kind == "reasoning" or d.kind == "call" or d.kind == "arguments" then other = true end
            if d.kind == "text" then text[#text + 1] = d.text end
            if d.kind == "reasoning" then thought[#thought + 1] = d.text end
        end
        if other then
            self.had_other = true
            -- (reasoning without text: its tokens are held too, as the last may begin </think>,
            -- which the search for the text must see whole; they were dropped, and ">" then found
            -- in "think>". A call's are not: text after it is no content of the message.)
            if #thought > 0 then self.reasoned = true end
            self.pending_logprobs = #text > 0 and text_entries(entries, concat(text), #concat(thought), self.reasoned) or
                                    (#thought > 0 and entries or {})
        else
            for _, e in ipairs(entries) do self.pending_logprobs[#self.pending_logprobs + 1] = e end
            if self.had_other and #text > 0 then
                self.pending_logprobs = text_entries(self.pending_logprobs, concat(text), 0, self.reasoned)
            end
        end
    end
    for _, d in ipairs(deltas) do
        local item = self.open
        if d.kind == "reasoning" then
            if not item or item.kind ~= "reasoning" then item = self:open_item(out, "reasoning", "rs_" .. item_key(self.id)) end
            item.text[#item.text + 1] = d.text
            local id_m, index_m = where(item)
            self:event(out, "response.reasoning_text.delta", { id_m, index_m, { "content_index", "0" }, { "delta", encode(d.text) } })
        elseif d.kind == "text" then
            if not item or item.kind ~= "message" then item = self:open_item(out, "message", "msg_" .. item_key(self.id)) end
            self:text_delta(out, item, d.text)
        elseif d.kind == "call" then
            self.calls = self.calls + 1
            self:open_item(out, "function_call", ("fc_%s_%d"):format(item_key(self.id), self.calls), d.id, d.name)
        elseif d.kind == "arguments" and item and item.kind == "function_call" then
            item.text[#item.text + 1] = d.text
            local id_m, index_m = where(item)
            self:event(out, "response.function_call_arguments.delta", { id_m, index_m, { "delta", encode(d.text) } })
        elseif d.kind == "finish" then
            local status = status_of(d.finish_reason)
            -- a reply with no text and no call still has its (empty) message, as a blocking answer
            -- does, but for a reasoning the token limit cut (itself the incomplete item)
            local cut_in_reasoning = status == "incomplete" and self.open and self.open.kind == "reasoning"
            if self.calls == 0 and not self.message_seen and not cut_in_reasoning then
                self:open_item(out, "message", "msg_" .. item_key(self.id))
            end
            -- the held tokens no text came after (an end of text): the message's where the reply
            -- is the message alone, as a blocking answer's; after reasoning or calls they write
            -- none of its text (a </think> held to the end was given to it)
            -- (and a delta of no text carries them: a client that gathers the deltas' logprobs
            -- had one short, an end of text's or a token whose text a stop string cut)
            if self.open and self.open.kind == "message" and not self.had_other and #self.pending_logprobs > 0 then
                self:text_delta(out, self.open, "")
            end
            -- a call whose arguments are whole is complete, whatever came after it; one the
            -- token limit cut stays incomplete (its pieces went out; a blocking answer leaves it out)
            local open = self.open
            if open and open.kind == "function_call" and json_text.decode(concat(open.text)) then status = "completed" end
            self:close(out, status)
            status = status_of(d.finish_reason)
            self.finished = true
            local final = self:response_object(self.id, self.created, self.model, status, self.items,
                                               usage_of(d.usage, self:reasoning_tokens(self.thought)), d.tinyloop)
            if self.store then self:keep(final, concat(self.reply_text), self.thought, self.reply_calls) end
            self:event(out, status == "completed" and "response.completed" or "response.incomplete", { { "response", final } })
        end
    end
    return out
end

return _M

-- tinyloop.tools: OpenAI's function tools for chat. A request's `tools`, `tool_choice` and
-- `parallel_tool_calls` are checked here; the calls a model writes are read back from its text;
-- and a choice that must call (tool_choice "required" or a named function) gets a grammar that
-- lets the model write nothing else. Pure Lua (no ngx): the server and scripts use it alike.
--
-- The calls are written in the Hermes format, which Qwen2.5/Qwen3, Hermes 2/3 and many other
-- checkpoints' chat templates teach (and tinyloop.chat's built-in plain template too):
--
--   <tool_call>
--   {"name": "get_weather", "arguments": {"city": "Paris"}}
--   </tool_call>
--
--   local tools = require "tinyloop.tools"
--   local spec, shown = tools.prepare(request.tools, request.tool_choice, request.parallel_tool_calls, tools_json)
--   -- spec: nil, err, param (refused) | false (no calls: no tools, or tool_choice "none") | the spec
--   ids = chat:prompt_ids(model, messages, true, shown)   -- the tools as the template reads them
--   if spec and spec.forced then cfg.grammar = assert(tools.grammar(spec)) end -- only calls
--   local content, calls = tools.parse(generated, spec, function(k) return "call_" .. k end)
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local first_unknown = require("tinyloop.ordered").first_unknown
local cjson = require "cjson.safe"
local json_text = require "tinyloop.json_text"
local chat_template = require "tinyloop.chat_template"
local tags = require "tinyloop.tags"

local type, pairs, ipairs, tostring, next = type, pairs, ipairs, tostring, next
local find, sub, byte, match, concat = string.find, string.sub, string.byte, string.match, table.concat
local json_null = cjson.null

local _M = {}

_M.FORMAT = "hermes" -- how calls are written and read (GET /v1/models says it)
_M.START, _M.END = "<tool_call>", "</tool_call>"
local START, END = _M.START, _M.END
_M.MAX_TOOLS = 128 -- OpenAI's limit

local function encode(v) return (json_text.encode(v)) end

-- The JSON text of tools given without it: cjson's encoding (an empty table as an array).
local function tools_text(tools)
    return type(tools) == "table" and next(tools) == nil and "[]" or encode(tools)
end

-- ------------------------------------------------------------------ the request's fields

local TOOL_KEYS = { type = true, ["function"] = true }
local FUNCTION_KEYS = { name = "string", description = "string", parameters = "object", strict = "boolean" }

-- OpenAI's rule for a function name: a-z, A-Z, 0-9, underscores and dashes, 64 at most.
local function valid_name(name)
    return type(name) == "string" and #name >= 1 and #name <= 64 and not find(name, "[^%w_%-]")
end
_M.valid_name = valid_name

-- The members of the object whose text is `text`, by key: their raw text (the last of
-- duplicate keys, as cjson keeps).
local function members_of(text)
    local out = {}
    for _, m in ipairs(json_text.entries(text, 1)) do out[m.key] = sub(text, m.from, m.to) end
    return out
end

-- check(tools, tool_choice, parallel_tool_calls, tools_json) -> spec, or nil, err, param (the
-- field at fault). tools: the decoded array (nil or empty: none); tools_json: its JSON text as
-- sent (the parameters' schemas are read from it, in their own key order; without it, tools
-- encoded by cjson, whose objects have no order). tool_choice: nil
-- (default "auto" with tools, else "none"), "none", "auto", "required" or
-- {"type": "function", "function": {"name": ...}}. parallel_tool_calls: nil (true) or a boolean.
-- spec = { functions = { {name, parameters_json}, ... }, declared = {[name] = true},
--          choice = "none" | "auto" | "required" | "function", name (the named function),
--          forced (required or named), parallel }, or nil when there are no tools and
--          tool_choice is "none" or absent.
function _M.check(tools, tool_choice, parallel, tools_json)
    local P = "tools"
    if parallel ~= nil and type(parallel) ~= "boolean" then
        return nil, "parallel_tool_calls must be a boolean", "parallel_tool_calls"
    end
    if tools ~= nil and tools_json == nil then tools_json = tools_text(tools) end
    if tools ~= nil and (type(tools) ~= "table" or not tools_json or byte(tools_json, 1) ~= 91) then
        return nil, "tools must be an array of {\"type\": \"function\", \"function\": {...}}", P
    end
    local n = tools and #tools or 0
    if n == 0 then
        if tool_choice == nil or tool_choice == "none" then return nil end
        return nil, "tool_choice needs tools: send tools, or tool_choice \"none\"", "tool_choice"
    end
    if n > _M.MAX_TOOLS then return nil, ("tools: %d tools, at most %d"):format(n, _M.MAX_TOOLS), P end
    -- Each tool's text is cut out of the array once, and each function's out of its tool: a
    -- look-up by path from the top would scan the whole array again for every field.
    local tool_texts = json_text.entries(tools_json, 1)
    local functions, declared = {}, {}
    for i, tool in ipairs(tools) do
        local at = ("tools[%d]"):format(i - 1)
        local tool_text = sub(tools_json, tool_texts[i].from, tool_texts[i].to)
        if type(tool) ~= "table" or byte(tool_text, 1) ~= 123 then
            return nil, at .. " must be an object {\"type\": \"function\", \"function\": {...}}", P
        end
        local unknown = first_unknown(tool, TOOL_KEYS)
        if unknown ~= nil then return nil, ("unknown field '%s' in %s"):format(tostring(unknown), at), P end
        if tool.type ~= "function" then return nil, at .. ".type must be \"function\"", P end
        local fn, fn_text = tool["function"], members_of(tool_text)["function"]
        if type(fn) ~= "table" or byte(fn_text, 1) ~= 123 then
            return nil, at .. ".function must be an object {\"name\", \"description\", \"parameters\"}", P
        end
        local fields = members_of(fn_text)
        for k, v in ordered_pairs(fn) do
            local want = FUNCTION_KEYS[k]
            if not want then return nil, ("unknown field '%s' in %s.function"):format(tostring(k), at), P end
            local ok = (want == "string" and type(v) == "string") or (want == "boolean" and type(v) == "boolean")
                or (want == "object" and byte(fields[k], 1) == 123)
            if not ok and v ~= json_null then
                return nil, ("%s.function.%s must be %s"):format(at, k, want == "object" and "a JSON Schema object" or "a " .. want), P
            end
        end
        if not valid_name(fn.name) then
            return nil, at .. ".function.name must be 1 to 64 letters, digits, underscores or dashes", P
        end
        if declared[fn.name] then return nil, ("%s.function.name '%s' is declared twice"):format(at, fn.name), P end
        declared[fn.name] = true
        -- The arguments are an object (OpenAI's rule; the calls are read back so): a schema of
        -- anything else is refused, and {} (any value) means no parameters.
        local parameters = fn.parameters ~= nil and fn.parameters ~= json_null and fields.parameters or nil
        if parameters and next(fn.parameters) == nil then parameters = nil end
        if parameters and fn.parameters.type ~= "object" then
            return nil, at .. '.function.parameters must be the JSON Schema of an object: {"type": "object", ...}', P
        end
        functions[i] = { name = fn.name, parameters_json = parameters, strict = fn.strict == true }
    end
    local spec = { functions = functions, declared = declared, parallel = parallel ~= false }
    if tool_choice == nil then tool_choice = "auto" end
    if tool_choice == "none" or tool_choice == "auto" or tool_choice == "required" then
        spec.choice = tool_choice
    elseif type(tool_choice) == "table" and tool_choice.type == "function" and type(tool_choice["function"]) == "table" then
        local name = tool_choice["function"].name
        if not declared[name] then
            return nil, ("tool_choice names the function %s, which tools does not declare"):format(encode(name) or "?"), "tool_choice"
        end
        for k in ordered_pairs(tool_choice) do
            if k ~= "type" and k ~= "function" then return nil, ("unknown field '%s' in tool_choice"):format(tostring(k)), "tool_choice" end
        end
        for k in ordered_pairs(tool_choice["function"]) do
            if k ~= "name" then return nil, ("unknown field '%s' in tool_choice.function"):format(tostring(k)), "tool_choice" end
        end
        spec.choice, spec.name = "function", name
    else
        return nil, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}', "tool_choice"
    end
    spec.forced = spec.choice == "required" or spec.choice == "function"
    return spec
end

-- prepare(tools, tool_choice, parallel_tool_calls, tools_json) -> spec, shown: check's spec
-- (false when no call is to be made or read: no tools, or tool_choice "none") and the tools
-- as a chat template reads them (chat_template.decode_json: the client's key order; nil when
-- there are none); or nil, err, param. With "none" the tools are shown all the same (OpenAI's
-- way: a conversation that turns to "none" for its answer keeps its prompt and its prefix).
function _M.prepare(tools, tool_choice, parallel, tools_json)
    if tools ~= nil and tools_json == nil then tools_json = tools_text(tools) end
    local spec, err, param = _M.check(tools, tool_choice, parallel, tools_json)
    if err then return nil, err, param end
    if not spec then return false end
    local shown, derr = chat_template.decode_json(tools_json)
    if not shown then return nil, "tools: " .. tostring(derr), "tools" end
    return spec.choice ~= "none" and spec, shown
end

-- ------------------------------------------------------------------ the grammar of a forced call

-- The rule names of GBNF text, each given `prefix` (definitions and references alike), so that
-- several generated grammars live in one text; a name of `shared` becomes the name it maps to
-- (a rule the text no longer defines), or nothing where it maps to false. Literals, character
-- classes and repetition counts are copied as they are; every other word of GBNF is a rule
-- name.
local function prefix_rules(text, prefix, shared)
    local out, i, n = {}, 1, #text
    while i <= n do
        local c = byte(text, i)
        local j
        if c == 34 or c == 91 then -- "literal" or [class]: up to the unescaped closing character
            local close = c == 34 and '["\\]' or "[%]\\]"
            j = i + 1
            while true do
                local q = find(text, close, j)
                if byte(text, q) ~= 92 then j = q + 1 break end
                j = q + 2
            end
        elseif c == 123 then -- {m,n}
            j = find(text, "}", i, true) + 1
        elseif find(text, "^[%w_%-]", i) then
            j = find(text, "[^%w_%-]", i) or n + 1
            local name = sub(text, i, j - 1)
            local to = shared[name]
            if to == nil then out[#out + 1] = prefix .. name elseif to then out[#out + 1] = to end
            i = j
        else
            j = i + 1
        end
        if i < j then out[#out + 1] = sub(text, i, j - 1) end
        i = j
    end
    return concat(out)
end

_M.MAX_CALLS = 16 -- calls a forced choice may make in one reply (parallel_tool_calls)

-- A function without parameters takes {} (OpenAI's rule).
local NO_PARAMETERS = '{"type":"object","properties":{},"additionalProperties":false}'

local function parameters_error(fn, err)
    return ("the parameters of function '%s' do not compile as a JSON Schema: %s"):format(fn.name, tostring(err))
end

-- grammar_text(spec) -> GBNF text that accepts the calls a forced choice may make, in the
-- Hermes format: one call of the named function, or of any declared function (required); with
-- parallel_tool_calls, up to MAX_CALLS of them, one a line (a model that loops on calls then
-- ends). Or nil, err (a schema that does not compile, naming its function).
-- Each function's parameters compile on their own (so "$ref": "#/$defs/..." and "#" mean
-- what they mean in the schema as sent), and the call's JSON around them is written here:
-- {"name": "<name>", "arguments": <parameters>}. after_open: the text from after the first
-- call's opening tag (lazy_grammar's). to_gbnf(schema_json, opts) -> GBNF text | nil, err:
-- how a schema becomes GBNF (tinyloop.grammar.json_schema_gbnf by default; a server's
-- thread pool passes its own, the library's function by address).
function _M.grammar_text(spec, after_open, to_gbnf)
    to_gbnf = to_gbnf or require("tinyloop").grammar.json_schema_gbnf -- (here: check and parse need no engine)
    local alternatives, rules = {}, {}
    for k, fn in ipairs(spec.functions) do
        if spec.choice ~= "function" or fn.name == spec.name then
            -- (without strict: true, keywords the converter cannot enforce are left out, as
            -- OpenAI's non-strict tools take any schema; strict ones must hold exactly)
            -- (the GBNF text only: the grammar around the calls compiles it, once)
            local parameters, err = to_gbnf(fn.parameters_json or NO_PARAMETERS, { whitespace = "free", loose = not fn.strict })
            if not parameters then
                return nil, parameters_error(fn, err)
            end
            local prefix = "f" .. k .. "-"
            alternatives[#alternatives + 1] = prefix .. "call"
            -- The call is written as Python's json.dumps writes it (", " and ": ", no other
            -- blank), which is how the chat templates' tojson shows calls to the model, in its
            -- training and in a conversation's history: a call the model makes is then the very
            -- text the next turn renders (the prefix pool serves it), and it cannot pad a call
            -- with blanks up to max_tokens. The generated grammar puts its blanks after "," and
            -- ":" and between tokens (rule ws): those become ", ", ": " and nothing.
            local text = parameters:gsub('"," ws', '", "'):gsub('":" ws', '": "')
            text = text:gsub("\nws ::= [^\n]*", "", 1):gsub("^ws ::= [^\n]*\n", "", 1)
            rules[#rules + 1] = prefix_rules(text, prefix, { ws = false }) ..
                ('%scall ::= "{\\"name\\": \\"%s\\", \\"arguments\\": " %sroot "}"\n'):format(prefix, fn.name, prefix)
        end
    end
    local body = '(' .. concat(alternatives, " | ") .. ') "\\n' .. END .. '"'
    local more = spec.parallel and (' ("\\n" call){0,%d}'):format(_M.MAX_CALLS - 1) or ""
    -- after_open: the first call from after its opening tag (what grammar.after leaves to
    -- the grammar once the model has written the tag)
    return (after_open and 'root ::= "\\n" ' .. body .. more .. "\n" or "root ::= call" .. more .. "\n") ..
        'call ::= "' .. START .. '\\n" ' .. body .. "\n" .. concat(rules, "\n")
end

-- The grammar around the calls compiled (compile: as grammar's, below); where it does not, the message
-- names the function whose parameters failed (a $ref cycle, say, shows only once the GBNF of
-- the schema compiles: its rules are prefixed "f<k>-"), as that schema compiled alone says.
local function compile_calls(spec, text, compile)
    compile = compile or require("tinyloop").grammar.from_text
    local g, err = compile("gbnf", text)
    if g then return g end
    local fn = spec.functions[tonumber(tostring(err):match("'f(%d+)%-") or "")]
    if fn then
        local _, serr = compile("json_schema", fn.parameters_json or NO_PARAMETERS, true, not fn.strict)
        if serr then
            return nil, parameters_error(fn, serr)
        end
    end
    return nil, err
end

-- grammar(spec[, compile, text_of]) -> the compiled grammar_text, or nil, err. compile(kind,
-- text, free_whitespace, loose): how GBNF text ("gbnf") or a JSON Schema ("json_schema")
-- becomes a grammar (a server's runs in its thread pool); tinyloop.grammar.from_text by
-- default. text_of(spec, after_open) -> grammar_text's answer, built elsewhere (a server's
-- thread pool); grammar_text here by default.
function _M.grammar(spec, compile, text_of)
    local text, err = (text_of or _M.grammar_text)(spec)
    if not text then return nil, err end
    return compile_calls(spec, text, compile)
end

-- lazy_grammar(spec[, compile]) -> a grammar for tool_choice "auto" (llama.cpp's lazy grammar):
-- the reply is free text until the model opens a call, and the calls from there on are whole
-- and valid (each function's parameters), then the reply ends; or nil, err. (A thinking
-- model's block around it: tinyloop.reasoning.grammar.)
function _M.lazy_grammar(spec, compile, text_of)
    local text, err = (text_of or _M.grammar_text)(spec, true)
    if not text then return nil, err end
    local calls, gerr = compile_calls(spec, text, compile)
    if not calls then return nil, gerr end
    return require("tinyloop").grammar.after(START, calls, 0) -- (the call's shape to the byte: "<tool_call>\n{")
end

-- ------------------------------------------------------------------ reading calls back

-- The index where the white space that ends s[1..upto] begins (upto + 1 when none): a step
-- back per byte (an anchored pattern would retry from every position of a long run).
local function blank_tail(s, upto)
    local i = upto
    while i >= 1 do
        local c = byte(s, i)
        if c ~= 32 and c ~= 9 and c ~= 10 and c ~= 13 then break end
        i = i - 1
    end
    return i + 1
end
_M.blank_tail = blank_tail

-- The call of the block whose body starts at text[from]: { name, arguments (their JSON text as
-- written) } and the index after the block (past its </tool_call>, or the text's end when the
-- block has none), or nil when it holds no call of a declared function. The JSON's end is found
-- by scanning it once (an end tag inside a string argument is the argument's); only white
-- space may stand between it and </tool_call>.
local function block_call(text, from, spec, cut)
    local open = find(text, "[^ \t\r\n]", from)
    if not open or byte(text, open) ~= 123 then return nil end
    local after_json = json_text.skip_value(text, open)
    if not after_json then return nil end
    local json = sub(text, open, after_json - 1)
    local after = find(text, "[^ \t\r\n]", after_json) or #text + 1
    if after <= #text then
        local tag = sub(text, after, after + #END - 1)
        -- (where the token limit cut the text, the end tag may be cut too: the call is whole)
        if tag == END then
            after = after + #END
        elseif cut and after + #tag > #text and tag == sub(END, 1, #tag) then
            after = #text + 1
        else
            return nil
        end
    end
    local call = json_text.decode(json) -- (strict: what a client's JSON parser takes)
    if type(call) ~= "table" or type(call.name) ~= "string" or not spec.declared[call.name] then return nil end
    for k in pairs(call) do
        if k ~= "name" and k ~= "arguments" then return nil end
    end
    local arguments = json_text.member(json, { "arguments" })
    if not arguments or byte(arguments, 1) ~= 123 then return nil end
    return { name = call.name, arguments = arguments }, after
end

-- parse(text, spec, id_of[, cut]) -> content, calls: the text a choice generated, split into
-- its content (the text before the first call, trailing white space dropped; nil when none is
-- left) and its calls ({ {id = id_of(k), name, arguments}, ... } in order, k from 1; nil when
-- none). Each <tool_call> block must hold one call of a declared function whose arguments are
-- an object, then its </tool_call>, which the last block may lack (a stop string or the end of
-- the generation cut it). Text between and after the blocks is not content (as vLLM's Hermes
-- parser has it). A block that is not a call makes the whole text content and no call at all,
-- except that when the generation was cut (cut true: the token limit, or a stop string the
-- request gave, ended it) and calls came before it, or it is the call the cut took the end of,
-- it and what follows are dropped (the content is then the text before the first block, as a
-- stream shows it); and a forced choice (spec.forced) never has content, only the calls that
-- are whole. A third value names the call the cut took the end of, where its name is whole
-- and declared: { id = id_of(k), name } (k its place after the whole ones), else nil
-- (Anthropic's answer shows it, cut, as its stream does).
function _M.parse(text, spec, id_of, cut)
    local first = find(text, START, 1, true)
    local calls, at, cut_call = {}, first, nil
    while at do
        local call, after = block_call(text, at + #START, spec, cut)
        if not call then
            -- (the block the cut took the end of: its JSON, or the text after its tag, runs out)
            local open = find(text, "[^ \t\r\n]", at + #START)
            local cut_here = cut and (not open or (byte(text, open) == 123 and not json_text.skip_value(text, open)))
            if not (cut and #calls > 0) and not cut_here and not spec.forced then return text, nil end
            -- (named once its closing quote is read, as the stream opens the call then)
            local name = cut_here and open and match(text, '^{%s*"name"%s*:%s*"([^"\\]*)"', open)
            if name and spec.declared[name] then cut_call = { id = id_of(#calls + 1), name = name } end
            break
        end
        call.id = id_of(#calls + 1)
        calls[#calls + 1] = call
        at = find(text, START, after, true)
    end
    if #calls == 0 then calls = nil end
    if spec.forced then return nil, calls, cut_call end
    if not first then return text, nil end
    local content = sub(text, 1, blank_tail(text, first - 1) - 1)
    return content ~= "" and content or nil, calls, cut_call
end

-- held(text) -> how many bytes at the end of text may begin a <tool_call> (a stream holds
-- them back until the next text tells).
function _M.held(text) return tags.held(text, START) end

-- ------------------------------------------------------------------ calls, as they come

-- call_stream() -> a reader of calls as they are generated under a grammar that fixes their
-- shape (grammar_text: a forced choice's, or auto's lazy grammar from the tag on), after blank
-- space: <tool_call>\n{"name": "<name>", "arguments": <JSON object>}\n</tool_call>, the calls one
-- a line. reader:feed(text) -> the events the text completes:
-- {call = k, name = ...} when call k's name is whole, then {call = k, arguments = piece} for
-- each piece of its arguments' text, as it comes (a stream sends them as OpenAI streams a
-- call). Each text is read once; text off the shape (none, under the grammar) ends the events
-- (reader.state is then "off", and reader.call counts the calls whose names went out: the
-- shape goes off only in its fixed parts, never inside a name).
local CallStream = {}
CallStream.__index = CallStream
local HEAD, MID, TAIL = START .. '\n{"name": "', ', "arguments": ', '}\n' .. END

function _M.call_stream()
    return setmetatable({ state = "blanks", want = HEAD, got = 0, after = "name", call = 0 }, CallStream)
end

function CallStream:feed(text)
    local events, i, n = {}, 1, #text
    while i <= n and self.state ~= "off" do
        local state = self.state
        if state == "blanks" then -- before the first call (after a reasoning block: "</think>\n\n")
            i = find(text, "[^ \t\n\r]", i) or n + 1
            if i <= n then self.state = "literal" end
        elseif state == "literal" then -- a fixed part of the shape, byte by byte
            local want = self.want
            local take = math.min(#want - self.got, n - i + 1)
            if sub(text, i, i + take - 1) ~= sub(want, self.got + 1, self.got + take) then
                self.state = "off"
                break
            end
            self.got, i = self.got + take, i + take
            if self.got == #want then
                self.state, self.got = self.after, 0
                if self.state == "name" then self.call, self.name = self.call + 1, {} end
            end
        elseif state == "name" then -- (a declared name: no quote or escape in it)
            local quote = find(text, '"', i, true)
            self.name[#self.name + 1] = sub(text, i, (quote or n + 1) - 1)
            if not quote then break end
            events[#events + 1] = { call = self.call, name = concat(self.name) }
            self.state, self.want, self.after, i = "literal", MID, "arguments", quote + 1
            self.depth, self.in_string, self.escaped = 0, false, false
        else -- the arguments: up to the brace that closes them
            local from, done = i, false
            while i <= n do
                local c = byte(text, i)
                if self.in_string then
                    if self.escaped then self.escaped = false
                    elseif c == 92 then self.escaped = true
                    elseif c == 34 then self.in_string = false end
                elseif c == 34 then self.in_string = true
                elseif c == 123 or c == 91 then self.depth = self.depth + 1
                elseif c == 125 or c == 93 then
                    self.depth = self.depth - 1
                    if self.depth == 0 then done = true end
                end
                i = i + 1
                if done then break end
            end
            events[#events + 1] = { call = self.call, arguments = sub(text, from, i - 1) }
            if done then self.state, self.want, self.after = "literal", TAIL, "next" end
        end
        if self.state == "next" then -- another call, one a line
            self.state, self.want, self.after = "literal", "\n" .. HEAD, "name"
        end
    end
    return events
end

return _M

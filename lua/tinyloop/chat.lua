-- tinyloop.chat: OpenAI-style chat messages -> the prompt text a checkpoint was trained to
-- continue, through the checkpoint's own chat template (Hugging Face's: `chat_template.jinja`
-- or `tokenizer_config.json`'s "chat_template", rendered by tinyloop.chat_template), or a
-- plain built-in one for checkpoints that carry none (the shipped model). Pure Lua (no ngx):
-- the server and scripts use it alike.
--
--   local chat = require("tinyloop.chat").load(dir)          -- or load(dir, "my.jinja")
--   local ids, text = chat:prompt_ids(model, { { role = "user", content = "Hello" } })
--   local text = chat:prompt({ { role = "user", content = "Hello" } })   -- the text alone
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local first_unknown = require("tinyloop.ordered").first_unknown
local cjson = require "cjson.safe"
local json_text = require "tinyloop.json_text"
local first_invalid_utf8 = require("tinyloop.utf8").first_invalid
local chat_template = require "tinyloop.chat_template"
local point = require("tinyloop.pause").point -- (a long conversation's checks pause: tinyloop.pause)
local valid_name = require("tinyloop.tools").valid_name
local raise = require("tinyloop.raise").from(debug.getinfo(1, "S").source)

local type, pairs, ipairs, next, tostring, concat, byte = type, pairs, ipairs, next, tostring, table.concat, string.byte
local json_null = cjson.null

local _M = {}

-- For checkpoints without a template: each message on a "Role: content" paragraph (a system
-- message as it is), then "Assistant:" to continue. Plain text, which a base model trained
-- on prose continues as a reply. An assistant message that begins with white space (as a
-- reply generated after "Assistant:" does: a blank, a newline, a tab, a return) follows the colon as
-- it is (a tab got a blank before it, and the reply's tokens changed), so the next turn's
-- prompt holds the reply's own tokens, which the prefix pool then serves. Tools (a request's
-- `tools`) come first, one JSON line each, with the Hermes call format (tinyloop.tools), in
-- which an assistant's calls are written back (after its content, one a line, as a forced
-- choice's grammar writes them) and tool results follow as "Tool:" paragraphs.
_M.PLAIN = "{% if tools %}{{ 'Tools (to call one, write <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>):\\n' }}"
    .. "{% for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}{{ '\\n' }}{% endif %}"
    .. "{% for message in messages %}{% if message.role == 'system' %}{{ message.content + '\\n\\n' }}"
    .. "{% elif message.role == 'assistant' %}{{ 'Assistant:' }}{% if message.content %}"
    .. "{{ message.content if message.content[:1] in [' ', '\\n', '\\t', '\\r'] else ' ' + message.content }}{% endif %}"
    .. "{% for call in message.tool_calls or [] %}{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
    .. "{{ '<tool_call>\\n{\"name\": \"' + call.function.name"
    .. " + '\", \"arguments\": ' + call.function.arguments | tojson + '}\\n</tool_call>' }}{% endfor %}{{ '\\n\\n' }}"
    .. "{% else %}{{ message.role | capitalize + ': ' + message.content + '\\n\\n' }}{% endif %}{% endfor %}"
    .. "{% if add_generation_prompt %}Assistant:{% endif %}"

local Chat = {}
Chat.__index = Chat

local function read_file(path)
    local f = io.open(path, "rb")
    if not f then return nil end
    local text = f:read("*a")
    f:close()
    return text
end

-- A special-token entry of tokenizer_config.json: "text" or {"content": "text", ...}.
local function token_text(v)
    if type(v) == "string" then return v end
    if type(v) == "table" and type(v.content) == "string" then return v.content end
    return nil
end

-- tokenizer_config.json's "chat_template": a string, or Hugging Face's list of named
-- templates ({"name", "template"}), of which "default" is the chat one and "tool_use" the one
-- transformers renders a request with tools by -> the text, the tool_use text (or nil) | nil
-- when there is none | nil, nil, err for a list without "default" (transformers refuses it).
local function config_template(cfg)
    local t = cfg.chat_template
    if type(t) == "string" then return t end
    if type(t) == "table" then
        local named = {}
        for _, entry in ipairs(t) do
            if type(entry) == "table" and type(entry.name) == "string" and type(entry.template) == "string" then
                named[entry.name] = entry.template
            end
        end
        if not named.default then
            return nil, nil, "tokenizer_config.json's chat_template is a list of named templates without a 'default' one"
        end
        return named.default, named.tool_use
    end
    return nil
end

-- A JSON object file of the checkpoint: the table, {} when the file is absent, or nil, err.
-- Strict, as config.json and tokenizer.json are read (lua-cjson took a NUL and text after
-- the object, raw control characters, ill-formed UTF-8).
local function read_json(path)
    local text = read_file(path)
    if not text then return {} end
    local decoded, err = json_text.decode_file(text)
    if type(decoded) ~= "table" or not text:match("^%s*{") then
        return nil, path .. " is not a JSON object" .. (err and (": " .. err) or "")
    end
    return decoded
end

-- A template file's text, or nil, err: UTF-8, as jinja2 and transformers read one (UTF-16, or
-- a stray byte, was rendered as it was: a prompt without the messages in it).
local function template_text(source, origin)
    local bad = source and first_invalid_utf8(source)
    if bad then return nil, ("the chat template %s is not valid UTF-8 (byte %d)"):format(origin, bad - 1) end
    return source
end

-- load(dir[, template_path]) -> chat | nil, err. The template is, in this order: the file
-- template_path; dir/chat_template.jinja (transformers >= 4.43 writes it there);
-- dir/tokenizer_config.json's chat_template; the built-in PLAIN. chat.source says which,
-- chat.template_text is its text.
-- bos_token and eos_token (templates print them) come from tokenizer_config.json, and the
-- ids that end a turn (turn_end_ids) from it and generation_config.json.
function _M.load(dir, template_path)
    local source, origin
    if template_path ~= nil then
        if type(template_path) ~= "string" then return nil, "chat template path must be a string" end
        source = read_file(template_path)
        if not source then return nil, "cannot read the chat template " .. template_path end
        origin = template_path
    end
    local cfg, generation, err = {}, {}, nil
    if type(dir) == "string" then
        cfg, err = read_json(dir .. "/tokenizer_config.json")
        if not cfg then return nil, err end
        generation, err = read_json(dir .. "/generation_config.json")
        if not generation then return nil, err end
        if not source then
            source = read_file(dir .. "/chat_template.jinja")
            if source then origin = dir .. "/chat_template.jinja" end
        end
    end
    if source then -- (a file's text: the path given, or chat_template.jinja)
        source, err = template_text(source, origin)
        if not source then return nil, err end
    end
    local tool_source
    if not source then
        source, tool_source, err = config_template(cfg)
        if err then return nil, err end
        if source then origin = dir .. "/tokenizer_config.json" end
    end
    if not source then source, origin = _M.PLAIN, "built-in plain" end
    local template, tool_template
    template, err = chat_template.compile(source)
    if not template then return nil, ("the chat template (%s) does not compile: %s"):format(origin, tostring(err)) end
    if tool_source then
        tool_template, err = chat_template.compile(tool_source)
        if not tool_template then
            return nil, ("the chat template 'tool_use' (%s) does not compile: %s"):format(origin, tostring(err))
        end
    end
    -- generation_config.json's eos_token_id: one id or a list of them (transformers' generate
    -- stops at any)
    local eos_ids = generation.eos_token_id
    if type(eos_ids) ~= "table" then eos_ids = { eos_ids } end
    return setmetatable({ template = template, tool_template = tool_template, source = origin, template_text = source,
                          bos_token = token_text(cfg.bos_token) or "",
                          eos_token = token_text(cfg.eos_token) or "", generation_eos_ids = eos_ids }, Chat)
end

-- chat:turn_end_ids(model) -> the token ids that end the assistant's turn besides the model's
-- own eos_token_id (which ends every generation): tokenizer_config.json's eos_token where it
-- is one token, and generation_config.json's eos_token_id. A chat template's turns often end
-- in a token of their own (ChatML's "<|im_end|>"), which the checkpoint lists there.
-- Second: a line naming generation_config.json's entries that are no token id of this model
-- (left out: a checkpoint paired with another model's files), or nil, for a warning.
function Chat:turn_end_ids(model)
    local info = model:info()
    local seen, ids, bad = { [info.eos_token_id] = true }, {}, {}
    local function add(id, from_generation)
        if type(id) == "number" and id % 1 == 0 and id >= 0 and id < info.vocab_size then
            if not seen[id] then
                seen[id] = true
                ids[#ids + 1] = id
            end
        elseif from_generation and type(id) ~= "userdata" then -- (JSON null: as absent)
            bad[#bad + 1] = type(id) == "string" and ("%q"):format(id) or tostring(id)
        end
    end
    if self.eos_token ~= "" and info.has_tokenizer then
        local tokens = model:encode(self.eos_token)
        if tokens and #tokens == 1 then add(tokens[1]) end
    end
    for _, id in ipairs(self.generation_eos_ids) do add(id, true) end
    local warning = #bad > 0 and ("generation_config.json's eos_token_id %s %s no token id of this model (0 to %d): left out")
        :format(concat(bad, ", "), #bad > 1 and "are" or "is", info.vocab_size - 1) or nil
    return ids, warning
end

-- add_stop_ids(cfg, ids): a one-token stop sequence for each id (turn ends, a request's
-- stop_token_ids) added to cfg.stop_sequences, made when there is none yet.
function _M.add_stop_ids(cfg, ids)
    if #ids == 0 then return end
    local seqs = cfg.stop_sequences or {}
    for _, id in ipairs(ids) do seqs[#seqs + 1] = { id } end
    cfg.stop_sequences = seqs
end

-- ------------------------------------------------------------------ messages

-- OpenAI's roles that a template sees; "developer" (OpenAI's newer name for the system
-- message) is passed on as "system", which is what templates test for.
local ROLES = { system = "system", developer = "system", user = "user", assistant = "assistant", tool = "tool" }
local MESSAGE_FIELDS = { role = true, content = true, name = true, tool_calls = true, tool_call_id = true,
                         reasoning_content = true, reasoning = true }
-- Fields of OpenAI's answers that a client sending a reply back as it came (the Python SDK's
-- message.model_dump()) includes: accepted when null (what this server answers), or, for
-- annotations, empty (what OpenAI's own answers hold).
local NULL_FIELDS = { refusal = true, function_call = true, audio = true, annotations = true, type = true }
-- (and a message's "type": "text", which lm-evaluation-harness's chat models put on each
-- message, as on a content part; vLLM ignores it)
local function no_op(k, v)
    return v == json_null or (k == "annotations" and type(v) == "table" and next(v) == nil) or (k == "type" and v == "text")
end

-- A value as a message shows it: JSON ("user", null, ["user"]; an empty table as []).
local function shown(v)
    if type(v) == "table" and next(v) == nil then return "[]" end
    local text = json_text.encode(v)
    return text or tostring(v)
end

local function is_array(v)
    if type(v) ~= "table" then return false end
    local n = #v
    for k in pairs(v) do
        if type(k) ~= "number" or k < 1 or k > n or k % 1 ~= 0 then return false end
    end
    return true
end
_M.is_array = is_array

-- decode_ordered(text): chat_template.decode_json (objects in the text's key order, for a
-- template to print as Python would), bounded at MAX_NESTING levels.
_M.decode_ordered = chat_template.decode_json
_M.MAX_NESTING = chat_template.MAX_NESTING

-- A text part's keys, and a refusal part's (cache_control: Anthropic-style clients mark parts
-- to cache; the prefix pool needs no marks).
local PART_KEYS = { text = { type = true, text = true, cache_control = true },
                    refusal = { type = true, refusal = true, cache_control = true } }

-- A message's content: a string, or OpenAI's array of content parts, of which only text
-- parts ({"type": "text", "text": ...}, and an assistant's {"type": "refusal", "refusal": ...})
-- are readable here; they are joined with "\n" (as vLLM does for a template that reads
-- content as a string), and the texts are the second result (nil for a string).
local function content_text(content, at)
    if type(content) == "string" then return content end
    if not is_array(content) or #content == 0 then
        return nil, at .. ".content must be a string or a non-empty array of text parts"
    end
    local texts = {}
    for i, part in ipairs(content) do
        local where = ("%s.content[%d]"):format(at, i - 1)
        if type(part) ~= "table" then return nil, where .. " must be an object {\"type\": \"text\", \"text\": ...}" end
        -- (an assistant's refusal part, as OpenAI's SDKs send a reply back, is its text)
        local field = part.type == "refusal" and "refusal" or "text"
        if part.type ~= "text" and part.type ~= "refusal" then
            return nil, ("%s.type = %s: only \"text\" parts are supported (this model reads text)"):format(where, shown(part.type))
        end
        if type(part[field]) ~= "string" then return nil, ("%s.%s must be a string"):format(where, field) end
        local unknown = first_unknown(part, PART_KEYS[field])
        if unknown ~= nil then return nil, ("unknown field '%s' in %s"):format(tostring(unknown), where) end
        texts[i] = part[field]
    end
    return concat(texts, "\n"), texts
end
_M.content_text = content_text

-- The text parts a checked message's content was sent as (content_text's texts), false for
-- a content that was null (a reply of calls alone); none for a string.
local sent_parts = setmetatable({}, { __mode = "k" })

-- The messages as a template that reads content as a list of parts sees them (its
-- content_format() "openai": it loops over message['content']): each content a list of
-- {"type": "text", "text": ...}, a string one part, a null content none; vLLM's rule, which
-- hands such a template the parts as sent (Kimi K2's, GLM 4.6's join them with nothing between,
-- StepFun's with a blank: the "\n" of the joined text was in none of them).
local function with_parts(messages)
    local out = {}
    for i, message in ipairs(messages) do
        point()
        local copy = {}
        for k, v in pairs(message) do copy[k] = v end
        local texts, parts = sent_parts[message], {}
        if texts == nil then texts = { message.content } end
        for j, text in ipairs(texts or {}) do parts[j] = chat_template.dict({ type = "text", text = text }, { "type", "text" }) end
        copy.content = parts
        out[i] = copy
    end
    return out
end

-- An assistant message's tool_calls (OpenAI's: {"id", "type": "function", "function":
-- {"name", "arguments": JSON text of an object}}) as templates read them (transformers'
-- convention, which vLLM follows): the arguments an object (a dict in the text's key order).
local CALL_KEYS, CALL_FUNCTION_KEYS = { id = true, type = true, ["function"] = true }, { name = true, arguments = true }
local function message_tool_calls(calls, at)
    if not is_array(calls) or #calls == 0 then return nil, at .. ".tool_calls must be a non-empty array of tool calls" end
    local out = {}
    for j, call in ipairs(calls) do
        local where = ("%s.tool_calls[%d]"):format(at, j - 1)
        local fn = type(call) == "table" and call["function"]
        if type(call) ~= "table" or is_array(call) or type(fn) ~= "table" or is_array(fn) then
            return nil, where .. " must be an object {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}"
        end
        local unknown = first_unknown(call, CALL_KEYS)
        if unknown ~= nil then return nil, ("unknown field '%s' in %s"):format(tostring(unknown), where) end
        unknown = first_unknown(fn, CALL_FUNCTION_KEYS)
        if unknown ~= nil then return nil, ("unknown field '%s' in %s.function"):format(tostring(unknown), where) end
        if call.type ~= nil and call.type ~= "function" then return nil, where .. ".type must be \"function\"" end
        if call.id ~= nil and type(call.id) ~= "string" then return nil, where .. ".id must be a string" end
        if not valid_name(fn.name) then
            return nil, where .. ".function.name must be a function's name: 1 to 64 letters, digits, underscores or dashes"
        end
        if type(fn.arguments) ~= "string" then return nil, where .. ".function.arguments must be a string (the arguments' JSON)" end
        local arguments, derr = _M.decode_ordered(fn.arguments)
        if type(arguments) ~= "table" or not fn.arguments:match("^%s*{") then
            return nil, where .. ".function.arguments must be the JSON text of an object" .. (derr and (": " .. derr) or "")
        end
        local id = type(call.id) == "string" and call.id or nil
        out[j] = chat_template.dict({ id = id, type = "function",
                                      ["function"] = chat_template.dict({ name = fn.name, arguments = arguments }, { "name", "arguments" }) },
                                    id and { "id", "type", "function" } or { "type", "function" })
    end
    return out
end

-- check_messages(messages) -> the messages as a template reads them ({role, content[, name]}
-- with plain strings; an assistant's tool_calls (then its content may be null: None to the
-- template) and reasoning_content (from either name a client sends it under; then a null
-- content is ""); a tool message's tool_call_id), or nil, err (naming the message:
-- "messages[2].role ...").
function _M.check_messages(messages)
    if not is_array(messages) or #messages == 0 then return nil, "messages must be a non-empty array of messages" end
    local out = {}
    -- (a message's first field in key order that is refused, the same in every process; the
    -- keys sorted only where one is: a sort for each of 17,000 messages was half their checks)
    local function refused_field(m, at)
        for k, v in ordered_pairs(m) do
            if NULL_FIELDS[k] then
                if not no_op(k, v) then
                    return ("%s.%s is not supported (only null%s)"):format(at, k,
                                                                         k == "annotations" and " or []" or k == "type" and ' or "text"' or "")
                end
            elseif not MESSAGE_FIELDS[k] then
                return ("unknown field '%s' in %s"):format(tostring(k), at)
            end
        end
    end
    for i, m in ipairs(messages) do
        point()
        local at = ("messages[%d]"):format(i - 1)
        if type(m) ~= "table" or is_array(m) then return nil, at .. " must be an object {\"role\", \"content\"}" end
        for k, v in pairs(m) do
            if (NULL_FIELDS[k] and not no_op(k, v)) or not (NULL_FIELDS[k] or MESSAGE_FIELDS[k]) then
                return nil, refused_field(m, at)
            end
        end
        local role = ROLES[m.role]
        if not role then
            return nil, ("%s.role must be \"system\", \"developer\", \"user\", \"assistant\" or \"tool\", got %s"):format(at, shown(m.role))
        end
        local message = { role = role }
        if m.tool_calls ~= nil and m.tool_calls ~= json_null then
            if role ~= "assistant" then return nil, at .. ".tool_calls: only an assistant message calls tools" end
            local calls, err = message_tool_calls(m.tool_calls, at)
            if not calls then return nil, err end
            message.tool_calls = calls
        end
        if m.tool_call_id ~= nil and m.tool_call_id ~= json_null then
            if role ~= "tool" then return nil, at .. ".tool_call_id: only a tool message answers a call" end
            if type(m.tool_call_id) ~= "string" then return nil, at .. ".tool_call_id must be a string" end
            message.tool_call_id = m.tool_call_id
        elseif role == "tool" then
            return nil, at .. ".tool_call_id is required in a tool message (the id of the call it answers)"
        end
        -- a thinking model's reasoning, which a client sends back with the reply it came with
        -- (the server answers both names): the template reads it as reasoning_content
        -- (Qwen3's), where it reads it at all
        for _, k in ipairs({ "reasoning_content", "reasoning" }) do
            local v = m[k]
            if v ~= nil and v ~= json_null then
                if role ~= "assistant" then return nil, ("%s.%s: only an assistant message has reasoning"):format(at, k) end
                if type(v) ~= "string" then return nil, ("%s.%s must be a string"):format(at, k) end
                if message.reasoning_content and message.reasoning_content ~= v then
                    return nil, at .. ".reasoning_content and .reasoning are one text under two names: they differ"
                end
                message.reasoning_content = v
            end
        end
        if m.content == nil or m.content == json_null then
            sent_parts[message] = false
            if message.reasoning_content then -- (a reply that was all reasoning: cut inside its block)
                message.content = ""
            elseif not message.tool_calls then
                return nil, at .. ".content is required"
            else
                -- (a reply of calls alone, as this server answers one: "" as vLLM passes it,
                -- not None, which templates such as Qwen3's test with `in` and fail on)
                message.content = ""
            end
        else
            local text, texts_or_err = content_text(m.content, at) -- (the parts' texts, where sent so)
            if not text then return nil, texts_or_err end
            message.content, sent_parts[message] = text, texts_or_err
        end
        if m.name ~= nil and m.name ~= json_null and type(m.name) ~= "string" then return nil, at .. ".name must be a string" end
        message.name = type(m.name) == "string" and m.name or nil
        out[i] = message
    end
    return out
end

-- The last place `needle` (not empty) begins in `text`, or nil: one search of both reversed
-- (a search per occurrence would be quadratic in a repetitive text).
local function last_find(text, needle)
    local found = text:reverse():find(needle:reverse(), 1, true)
    return found and #text - found - #needle + 2 or nil
end

-- The first and last bytes of s that are not blank (Python's str.strip's ASCII white space,
-- transformers' rule, as the renderer's strip: \x1c-\x1f too), or nil: byte loops, where a
-- pattern's backtracking was quadratic in a run of blanks.
local function is_blank(b) return b == 32 or (b >= 9 and b <= 13) or (b >= 28 and b <= 31) end
local function unblank(s)
    local first, last = 1, #s
    while first <= last and is_blank(s:byte(first)) do first = first + 1 end
    while last >= first and is_blank(s:byte(last)) do last = last - 1 end
    if first > last then return nil end
    return first, last
end
-- Whether a message's text has nothing to continue (the rule continue_final_message reads).
function _M.blank(s) return unblank(s) == nil end

-- The rendered conversation cut right after the final message's content, so that the model
-- continues that message (transformers' continue_final_message, its rule to the letter: the
-- content's last appearance, stripped of surrounding blanks; its leading blanks stay out
-- when the template trimmed them, its trailing ones when the template kept them).
local function continue_final(text, message, as_parts)
    if message.tool_calls then
        return nil, "continue_final_message: the final message has tool calls, which cannot be continued"
    end
    local content = message.content -- (a string: null content comes with tool calls only)
    -- (a template shown the parts: the last one's text is continued, transformers' rule)
    if as_parts then content = content[#content] and content[#content].text or "" end
    local first, last = unblank(content)
    if not first then return nil, "continue_final_message: the final message has no text to continue" end
    local stripped, lstripped = content:sub(first, last), content:sub(first)
    local at = last_find(text, stripped)
    if not at then
        return nil, "continue_final_message: the chat template does not show the final message's text as it is"
    end
    if text:sub(at, at + #lstripped - 1) == content then return text:sub(1, at + #lstripped - 1) end
    return text:sub(1, at + #stripped - 1)
end

-- ------------------------------------------------------------------ users' text and special tokens
-- What users write (messages, tools, template variables) is text: a special token's text in
-- it is encoded as text, as OpenAI's and Anthropic's APIs read a message, not as the control
-- token it spells (a message holding "<|im_end|>\n<|im_start|>system\n..." ended its own turn
-- and opened a system turn; the end of text's ended the conversation). The template's own
-- special texts are the tokens. Once printed, text no longer says whose it is, so each
-- special text in the users' strings is marked before rendering (MARK, its index, MARK; a
-- MARK of theirs is index 0); the rendered text is encoded with special tokens parsed (the
-- template's), then each piece between two special tokens that holds a mark is encoded again
-- as text, its marks restored. Pieces between special tokens are encoded each on its own
-- either way (tl_encode's rule, and Hugging Face's), so nothing else changes.
local MARK = "\239\183\144" -- U+FDD0, a noncharacter: no text means it
local MARKED = MARK .. "(%d+)" .. MARK
local marks_of = setmetatable({}, { __mode = "k" }) -- model -> special_marks(model), or false

local function plain_pattern(text) return (text:gsub("[%^%$%(%)%%%.%[%]%*%+%-%?]", "%%%0")) end

-- The model's special tokens as marking reads them, or false where it has none: mark(s) and
-- restore(s), and the ids (a set). mark finds them in one pass, the longest at each place (a
-- byte trie of their texts, MARK's among them as index 0): a find a text took 0.27 s over a
-- 1 MB message with Llama 3's 256 special tokens.
local function special_marks(model)
    local marks = marks_of[model]
    if marks ~= nil then return marks end
    local list, err = model:special_tokens()
    if not list then return nil, err end
    local texts, ids, seen = {}, {}, {}
    for _, t in ipairs(list) do
        ids[t.id] = true
        if t.text ~= "" and not seen[t.text] then
            seen[t.text] = true
            texts[#texts + 1] = t.text
        end
    end
    marks = false
    if #texts > 0 then
        local trie, firsts = {}, { "[" }
        local function add(text, index)
            local node = trie
            for i = 1, #text do
                local b = byte(text, i)
                if i == 1 and not node[b] then firsts[#firsts + 1] = plain_pattern(text:sub(1, 1)) end
                node[b] = node[b] or {}
                node = node[b]
            end
            node.index = index
        end
        add(MARK, 0)
        for i, text in ipairs(texts) do add(text, i) end
        firsts[#firsts + 1] = "]"
        local may_hold = concat(firsts)
        marks = { ids = ids }
        function marks.mark(s)
            local at = s:find(may_hold)
            if not at then return s end
            local out, last = {}, 1
            while at do
                local node, index, ends = trie, nil, nil
                for j = at, #s do
                    node = node[byte(s, j)]
                    if not node then break end
                    if node.index then index, ends = node.index, j end
                end
                if index then
                    out[#out + 1] = s:sub(last, at - 1)
                    out[#out + 1] = MARK .. index .. MARK
                    last = ends + 1
                end
                at = s:find(may_hold, index and ends + 1 or at + 1)
            end
            out[#out + 1] = s:sub(last)
            return concat(out)
        end
        function marks.restore(s)
            return (s:gsub(MARKED, function(i)
                i = tonumber(i)
                return i == 0 and MARK or texts[i]
            end))
        end
    end
    marks_of[model] = marks
    return marks
end

-- The variables a template gets from chat:prompt itself, which `variables` may not set.
local OWN_VARIABLES = { messages = true, tools = true, add_generation_prompt = true, bos_token = true, eos_token = true }

-- chat:prompt(messages[, add_generation_prompt = true[, tools[, continue_final_message[,
-- variables]]]]) -> text | nil, err, fault: the messages checked (check_messages) and
-- rendered, with `tools` (a list the template reads, OpenAI's {"type": "function",
-- "function": {...}} objects: decode_ordered of the request's tools) when given.
-- continue_final_message (vLLM's and transformers'): the text ends inside the final message,
-- which the model then continues (a reply begun for it, say); it opens no new turn, so
-- add_generation_prompt must not be true (nil counts as false then). variables: more names
-- the template reads (vLLM's chat_template_kwargs, e.g. enable_thinking), values as
-- decode_ordered gives them. fault says whose the failure is: "messages" (check_messages'
-- rules, the template's raise_exception, e.g. roles that must alternate, or more text than
-- the renderer's bounds), "variables" (one of them names what chat:prompt sets itself) or
-- "template" (it cannot run here: a Jinja feature tinyloop.chat_template lacks, say).
-- (render: chat:prompt's work, each string of the messages, tools and variables mark(s)
-- where mark is given)
local function render(self, mark, method, messages, add_generation_prompt, tools, continue_final_message, variables)
    if continue_final_message and add_generation_prompt then
        raise("chat:" .. method .. ": continue_final_message continues the final message: it opens no new turn (add_generation_prompt)")
    end
    if variables ~= nil and type(variables) ~= "table" then raise("chat:" .. method .. ": variables must be a table of template variables") end
    local checked, err = _M.check_messages(messages)
    if not checked then return nil, err, "messages" end
    -- (a request with tools renders with the tool_use template where the checkpoint names one)
    local template = tools ~= nil and self.tool_template or self.template
    local as_parts = template:content_format() == "openai"
    local shown = as_parts and with_parts(checked) or checked
    if mark then
        shown = chat_template.map_strings(shown, mark)
        if tools ~= nil then tools = chat_template.map_strings(tools, mark) end
    end
    local context = {}
    for name, value in pairs(variables or {}) do
        if OWN_VARIABLES[name] then
            return nil, ("the template variable '%s' is the request's own: it cannot be set as a variable"):format(name),
                "variables"
        end
        if chat_template.is_global(name) then
            return nil, ("the template variable '%s' is the renderer's own (a function templates call): it cannot be " ..
                         "set as a variable"):format(name), "variables"
        end
        context[name] = mark and chat_template.map_strings(value, mark) or value
    end
    -- (tools and documents are None where there are none, as transformers' apply_chat_template
    -- passes them: "tools is not none" is then false, and "tools|tojson" writes null)
    context.messages, context.tools = shown, tools == nil and cjson.null or tools
    if context.documents == nil then context.documents = cjson.null end
    context.add_generation_prompt = not continue_final_message and add_generation_prompt ~= false
    context.bos_token, context.eos_token = self.bos_token, self.eos_token
    local text, kind
    text, err, kind = template:render(context)
    if text and continue_final_message then
        -- (the message as the template saw it: its special texts marked as in the text)
        text, err = continue_final(text, shown[#shown], as_parts)
        if not text then return nil, err, "messages" end
    end
    if text then return text end
    -- (its file name only: the message may reach a client)
    if kind == "template" then
        return nil, ("the chat template (%s) cannot render: %s"):format(self.source:match("[^/]+$"), tostring(err)), "template"
    end
    return nil, "the chat template refused the messages: " .. tostring(err), "messages"
end

function Chat:prompt(messages, add_generation_prompt, tools, continue_final_message, variables)
    return render(self, nil, "prompt", messages, add_generation_prompt, tools, continue_final_message, variables)
end

-- chat:prompt_ids(model, messages[, add_generation_prompt[, tools[, continue_final_message[,
-- variables[, encode]]]]]) -> ids, text | nil, err, fault: chat:prompt's text and its token
-- ids for `model`, the special tokens' texts that users wrote (in messages, tools and
-- variables) encoded as text, the template's as the tokens (see MARK above). encode(text[,
-- opts]) -> ids | nil, err: model:encode's work (the server's runs long texts in its thread
-- pool; opts {parse_special = false}); fault "encode" where it failed.
local AS_TEXT = { parse_special = false }
function Chat:prompt_ids(model, messages, add_generation_prompt, tools, continue_final_message, variables, encode)
    encode = encode or function(text, opts) return model:encode(text, opts) end
    local marks, err = special_marks(model)
    if marks == nil then return nil, err, "encode" end
    local text, fault
    text, err, fault = render(self, marks and marks.mark, "prompt_ids", messages, add_generation_prompt, tools,
                              continue_final_message, variables)
    if not text then return nil, err, fault end
    local ids
    ids, err = encode(text)
    if not ids then return nil, err, "encode" end
    if not marks or not text:find(MARK, 1, true) then return ids, text end
    local out, run = {}, {}
    local function flush() -- (the run of ids since the last special token)
        if #run == 0 then return true end
        local piece, derr = model:decode(run) -- (byte-level tokens: the piece as it was written)
        if not piece then return nil, derr end
        local again = run
        if piece:find(MARK, 1, true) then
            again, derr = encode(marks.restore(piece), AS_TEXT)
            if not again then return nil, derr end
        end
        for _, id in ipairs(again) do out[#out + 1] = id end
        run = {}
        return true
    end
    for _, id in ipairs(ids) do
        if marks.ids[id] then
            local ok, ferr = flush()
            if not ok then return nil, ferr, "encode" end
            out[#out + 1] = id
        else
            run[#run + 1] = id
        end
    end
    local ok, ferr = flush()
    if not ok then return nil, ferr, "encode" end
    return out, marks.restore(text)
end

return _M

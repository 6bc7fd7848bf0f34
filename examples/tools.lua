#!/usr/bin/env luajit
-- tools.lua: a tool call and its answer, as an agent loop runs them. The model is shown a
-- function (tinyloop.chat renders the tools through the checkpoint's template, or the plain
-- built-in one); its first reply must be a call (tinyloop.tools: a grammar made of the
-- function's parameter schema, so the call parses and its arguments fit); the script runs the
-- function and hands the result back as a tool message; the model then answers in words.
--   luajit examples/tools.lua [MODEL_DIR]   (the shipped model by default: tools take tokens,
--                                           and its context is 256)
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local cjson = require "cjson"
local model = ex.model
local chats = require "tinyloop.chat"
local tools = require "tinyloop.tools"
local chat = assert(chats.load(ex.dir))

-- The functions, as a request's JSON: the key order is the one the model sees and writes.
local TOOLS = '[{"type": "function", "function": {"name": "lookup", "description": "Facts about a character", ' ..
    '"parameters": {"type": "object", "properties": {"who": {"enum": ["Emma", "Harriet"]}}, "required": ["who"]}}}]'
local FACTS = { Emma = "Emma Woodhouse, handsome, clever, and rich.", Harriet = "Harriet Smith, a parlour-boarder." }
local function lookup(arguments) return FACTS[arguments.who] end

-- A call is required: the grammar lets the model write nothing else. (shown: the tools as the
-- template prints them, in the key order above)
local spec, shown = assert(tools.prepare(cjson.decode(TOOLS), "required", false, TOOLS))
local messages = { { role = "user", content = "Who is Emma?" } }

-- Generates a reply to the messages under cfg: its text (the stream's pieces, joined).
local function reply(cfg)
    local prompt = assert(chat:prompt_ids(model, messages, true, shown))
    local room = model.max_seq_len - #prompt
    if room < 1 then -- (a model of a small context: the tools alone may fill it)
        print(("[the prompt's %d tokens fill the model's context of %d]"):format(#prompt, model.max_seq_len))
        os.exit(0)
    end
    cfg.max_tokens = math.min(cfg.max_tokens, room)
    chats.add_stop_ids(cfg, chat:turn_end_ids(model))
    local text = {}
    local iterate, session = model:stream(prompt, cfg)
    for _, piece in iterate, session do text[#text + 1] = piece end
    assert(not session.error, session.error)
    return table.concat(text), #prompt
end

-- 1. The call.
local text, prompt_tokens = reply({ max_tokens = 120, grammar = assert(tools.grammar(spec)) })
local _, calls = tools.parse(text, spec, function(k) return "call_" .. k end)
assert(calls, "the reply is not a call: " .. text)
print(("[%d prompt tokens]"):format(prompt_tokens))
for _, call in ipairs(calls) do print(("call: %s %s"):format(call.name, call.arguments)) end

-- 2. The script runs the calls; each result goes back as a tool message, after the call.
messages[#messages + 1] = { role = "assistant", content = cjson.null, tool_calls = {} }
for k, call in ipairs(calls) do
    messages[2].tool_calls[k] = { id = call.id, type = "function", ["function"] = { name = call.name, arguments = call.arguments } }
    local result = lookup(cjson.decode(call.arguments))
    print(("tool: %s"):format(result))
    messages[#messages + 1] = { role = "tool", tool_call_id = call.id, content = result }
end

-- 3. The answer in words (tool_choice "auto" would let it call again: it is the model's turn).
text, prompt_tokens = reply({ max_tokens = 24, temperature = 0.7, top_k = 40, sample_seed = 1 })
print(("[%d prompt tokens]"):format(prompt_tokens))
print(("assistant:%s"):format(text))

#!/usr/bin/env luajit
-- structured.lua: compiled grammars a decode policy can put on any decoder, built from a
-- regular expression and from free text with the grammars it opens (triggered tags, as for
-- tool calls or a thinking model's answer). Each output is checked against its grammar.
--   luajit examples/structured.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local model, G = ex.model, ex.tinyloop.grammar

local function show(name, grammar, prompt, cfg)
    cfg.grammar = grammar
    local ids, stats = model:generate(prompt, cfg)
    local prompt_len = #model:encode(prompt)
    local text = model:decode({ unpack(ids, prompt_len + 1) }):gsub("<|endoftext|>$", "")
    -- a finished text is a sentence of its grammar; one max_tokens cut is a text it allowed
    local ok
    if stats.stop_reason == "EOS" then ok = grammar:matches(text)
    else ok = stats.stop_reason == "MAX_TOKENS" and grammar:matches_prefix(text) end
    print(("%-8s %-10s %q  in the grammar: %s"):format(name, stats.stop_reason, text, tostring(ok)))
end

-- a regular expression the whole output matches
show("regex", assert(G.regex("[A-Z][a-z]+ (is|was) (very )?(good|kind|clever)\\.")), "Of all her friends,",
     { max_tokens = 30, temperature = 1, sample_seed = 7 })

-- free text until " the"; then a {"n": digit} object and "."; then free text again
local object = assert(G.json_schema({ type = "object", properties = { n = { type = "integer", minimum = 0, maximum = 9 } },
                                      required = { "n" } }))
show("tags", assert(G.tags({ { begin = " the", content = object, ["end"] = "." } }, { " the" })), "It is a truth",
     { max_tokens = 40, temperature = 0.9, sample_seed = 8 })

-- a reasoning block that runs free, then the answer: yes or no
local answer = assert(G.gbnf('root ::= "yes" | "no"'))
show("after", assert(G.after_block("<think>", "</think>", answer)), "Is Emma clever?",
     { max_tokens = 12, temperature = 1, sample_seed = 2 })

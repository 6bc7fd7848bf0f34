#!/usr/bin/env luajit
-- grammar.lua: a custom grammar written in Lua. The model may only answer with one of a
-- few words, each followed by a full stop; the grammar walks a trie of the allowed token
-- sequences and ends generation when the answer is complete (GRAMMAR_DEAD_END).
--   luajit examples/grammar.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local model = ex.model

local answers = { " yes.", " no.", " perhaps." }
local trie = {}
for _, answer in ipairs(answers) do
    local node = trie
    for _, id in ipairs(model:encode(answer)) do
        node[id] = node[id] or {}
        node = node[id]
    end
end

local Grammar = {}
Grammar.__index = Grammar
function Grammar:allowed(mask, vocab)
    local n = 0
    for id in pairs(self.node) do
        if id < vocab then mask[id] = 1 n = n + 1 end
    end
    return n -- 0 once an answer is complete: generation ends with GRAMMAR_DEAD_END
end
function Grammar:advance(token) self.node = self.node[token] end

local ids, stats = model:generate("Mr. Bennet, will you dance?", {
    max_tokens = 10, grammar = setmetatable({ node = trie }, Grammar),
})
print(model:decode(ids))
print("stop reason:", stats.stop_reason)

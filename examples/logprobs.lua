#!/usr/bin/env luajit
-- logprobs.lua: the model's own probabilities. The perplexity of a text at two loop depths
-- (model:score_logprobs: each token given the ones before it), then a sampled continuation
-- with, for each token, its probability and the model's likeliest alternatives
-- (session:logprobs after each step).
--   luajit examples/logprobs.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local model = ex.model

local text = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife."
local ids = assert(model:encode(text))
for _, loops in ipairs({ 1, model.default_loops }) do
    local logprobs = assert(model:score_logprobs(ids, loops))
    local sum = 0
    for _, lp in ipairs(logprobs) do sum = sum + lp end
    print(("loops %2d: perplexity %.2f over %d tokens"):format(loops, math.exp(-sum / #logprobs), #logprobs))
end

-- A token's text, quoted on one line.
local function show(id) return (("%q"):format(model:decode({ id })):gsub("\\\n", "\\n")) end

local session = model:session(model:encode("Elizabeth said"), { max_tokens = 8, temperature = 0.8, sample_seed = 5 })
while true do
    local id, _, reason = session:step()
    if id < 0 then break end
    local lp, alternatives = session:logprobs(3)
    local others = {}
    for _, alt in ipairs(alternatives) do others[#others + 1] = ("%s %.2f"):format(show(alt.id), math.exp(alt.logprob)) end
    print(("%-12s p = %.3f   likeliest: %s"):format(show(id), math.exp(lp), table.concat(others, ", ")))
    if reason then break end
end

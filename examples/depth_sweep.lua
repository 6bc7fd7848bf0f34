#!/usr/bin/env luajit
-- depth_sweep.lua: perplexity of a text at every loop depth, with model:score.
--   luajit examples/depth_sweep.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local model = ex.model
local info = model:info()
local text = "It is a truth universally acknowledged, that a single man in possession of a good " ..
             "fortune, must be in want of a wife. However little known the feelings or views of " ..
             "such a man may be on his first entering a neighbourhood, this truth is so well fixed."
local ids = model:encode(text)
if #ids > info.max_seq_len then
    local cut = {}
    for i = 1, info.max_seq_len do cut[i] = ids[i] end
    ids = cut
end
print(("%d tokens; default depth %d"):format(#ids, info.default_loops))
print("| depth | perplexity | nll/token | argmax accuracy |")
print("|---:|---:|---:|---:|")
for loops = 1, info.max_loops do
    local scores = model:score(ids, loops)
    local nll, hits = 0, 0
    for i = 1, #ids - 1 do
        local row_max = -math.huge
        for t = 0, info.vocab_size - 1 do
            local l = scores:logit(i, t)
            if l > row_max then row_max = l end
        end
        local sum = 0
        for t = 0, info.vocab_size - 1 do sum = sum + math.exp(scores:logit(i, t) - row_max) end
        nll = nll - (scores:logit(i, ids[i + 1]) - row_max - math.log(sum))
        if scores:argmax(i) == ids[i + 1] then hits = hits + 1 end
    end
    local n = #ids - 1
    print(("| %d | %.2f | %.4f | %.1f%% |"):format(loops, math.exp(nll / n), nll / n, 100 * hits / n))
end

#!/usr/bin/env luajit
-- embeddings.lua: texts as vectors (model:embed: the rows the head reads, mean-pooled, unit
-- length; model:embed_batch for a list, short texts sharing forward passes), then which text
-- each query is nearest to by cosine similarity (a dot product of unit vectors), at the
-- model's depth and at one loop: what the server's /v1/rerank does with a query's documents.
--   luajit examples/embeddings.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local model = ex.model

local texts = {
    "Mr. Darcy danced with Elizabeth at the ball.",
    "The officers of the regiment dined with the family.",
    "A fortune of ten thousand a year.",
    "Never trust a computer you cannot throw out of a window.",
}
local queries = { "She danced all evening.", "His income is very large.", "The program crashed again." }

local function dot(a, b)
    local s = 0
    for i = 1, #a do s = s + a[i] * b[i] end
    return s
end

for _, loops in ipairs({ model.default_loops, 1 }) do
    print(("loops %d (d_model %d):"):format(loops, model.d_model))
    local vectors = assert(model:embed_batch(texts, { loops = loops }))
    for _, query in ipairs(queries) do
        local q = assert(model:embed(query, { loops = loops }))
        local best, best_score = 1, -math.huge
        for i, v in ipairs(vectors) do
            local score = dot(q, v)
            if score > best_score then best, best_score = i, score end
        end
        print(("  %-28s nearest %.3f  %s"):format(query, best_score, texts[best]))
    end
end

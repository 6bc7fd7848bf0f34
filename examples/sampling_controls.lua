#!/usr/bin/env luajit
-- sampling_controls.lua: OpenAI's sampling adjustments on a looped model. The same greedy
-- continuation plain, with presence and frequency penalties (fewer repeated tokens), and with
-- a logit_bias that bans the plain run's most frequent token; then a speculative session,
-- whose tokens carry the log-probabilities plain decoding gives them.
--   luajit examples/sampling_controls.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local model = ex.model

local prompt = model:encode("It is a truth universally acknowledged, that")
local n = math.min(48, model:info().max_seq_len - #prompt)

-- The continuation's tokens, how many are repeats of an earlier one, and its most frequent token.
local function continuation(cfg)
    cfg.max_tokens, cfg.ignore_eos = n, true
    local out = model:generate(prompt, cfg)
    local counts, repeats, top, top_count = {}, 0, nil, 0
    for i = #prompt + 1, #out do
        local id = out[i]
        counts[id] = (counts[id] or 0) + 1
        if counts[id] > 1 then repeats = repeats + 1 end
        if counts[id] > top_count then top, top_count = id, counts[id] end
    end
    return out, repeats, top, counts
end

local function show(out) return (model:decode({ unpack(out, #prompt + 1) }):gsub("\n", " ")) end

local plain, plain_repeats, top, plain_counts = continuation({})
print(("plain:                       %2d repeated tokens of %d | %s"):format(plain_repeats, n, show(plain)))
local penalised, penalised_repeats = continuation({ presence_penalty = 1.0, frequency_penalty = 0.5 })
print(("presence 1.0, frequency 0.5: %2d repeated tokens of %d | %s"):format(penalised_repeats, n, show(penalised)))
local banned, _, _, banned_counts = continuation({ logit_bias = { [top] = -100 } })
print(("logit_bias {[%d] = -100}:    token %d appears %d times (plain: %d) | %s"):format(top, top,
    banned_counts[top] or 0, plain_counts[top], show(banned)))

-- Speculative decoding: each token's figures are its verification row's, plain decoding's.
local cfg = { max_tokens = 12, ignore_eos = true }
local plain_session = model:session(prompt, cfg)
cfg.speculative, cfg.draft_loops, cfg.draft_ahead = "chain", 1, 3
local speculative = model:session(prompt, cfg)
local identical = true
for _ = 1, 12 do
    local a, b = plain_session:step(), speculative:step()
    local lp_a, alt_a = plain_session:logprobs(2)
    local lp_b, alt_b = speculative:logprobs(2)
    identical = identical and a == b and lp_a == lp_b and alt_a[1].id == alt_b[1].id and alt_a[2].logprob == alt_b[2].logprob
end
print(("speculative chain, 12 tokens: tokens and log-probabilities identical to plain decoding: %s"):format(tostring(identical)))

#!/usr/bin/env luajit
-- exit_rules.lua: two early-exit rules written in Lua as depth policies, swept over their
-- thresholds: loops used per token and agreement with full-depth greedy decoding.
--   luajit examples/exit_rules.lua [MODEL_DIR]
-- cfg.depth_policy(loop, signals) runs after every loop of each decoded token; returning
-- true exits there. Probes (coda + head: entropy, KL, argmax) run on the early_exit_min_L /
-- early_exit_peek_every schedule, here every loop from the second.
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local model = ex.model
local info = model:info()
local prompts = { "It is a truth universally acknowledged", "Mr. Darcy walked", "She could not help" }
local TOKENS = 24

-- Two rules over the loop's signals: the latent state barely moved, or the next-token
-- distribution barely moved since the previous probe (KL).
local rules = {
    { name = "state change <", thresholds = { 0.02, 0.05, 0.1 },
      make = function(t) return function(loop, s) return loop >= 2 and s.state_change < t end end },
    { name = "probe KL <", thresholds = { 1e-3, 1e-2, 1e-1 },
      make = function(t) return function(_, s) return s.kl ~= nil and s.kl < t end end },
}

local function run(prompt, policy)
    local ids, stats = model:generate(prompt, { max_tokens = TOKENS, ignore_eos = true, early_exit_min_L = 2,
                                                depth_policy = policy })
    return ids, stats
end

local reference = {}
for i, p in ipairs(prompts) do reference[i] = run(p, nil) end

print(("%d prompts x %d tokens; full depth %d loops"):format(#prompts, TOKENS, info.default_loops))
print("| rule | threshold | loops used | agreement with full depth |")
print("|---|---:|---:|---:|")
for _, rule in ipairs(rules) do
    for _, t in ipairs(rule.thresholds) do
        local loops, same, total = 0, 0, 0
        for i, p in ipairs(prompts) do
            local ids, stats = run(p, rule.make(t))
            loops = loops + stats.loops_used
            local ref = reference[i]
            for k = #ref - TOKENS + 1, #ref do
                total = total + 1
                if ids[k] == ref[k] then same = same + 1 end
            end
        end
        print(("| %s | %g | %.2f | %.1f%% |"):format(rule.name, t, loops / #prompts, 100 * same / total))
    end
end

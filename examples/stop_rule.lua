#!/usr/bin/env luajit
-- stop_rule.lua: a custom stop rule in Lua: stop where the text, once at least 20 characters
-- long, ends a sentence (., ! or ?), or after half a second, whichever comes first.
--   luajit examples/stop_rule.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local policy = ex.policy
local ids, stats = ex.model:generate("Elizabeth said", {
    max_tokens = 100, temperature = 0.7, sample_seed = 3,
    stop_when = policy.any(
        function(_, text) return #text >= 20 and text:find("[%.!?]%s*$") ~= nil end,
        policy.max_wall_time(0.5)),
})
print(ex.model:decode(ids))
print("stop reason:", stats.stop_reason, "tokens:", stats.tokens_emitted)

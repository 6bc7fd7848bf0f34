#!/usr/bin/env luajit
-- stream.lua: print text as it is generated, then the stats.
--   luajit examples/stream.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local iterate, session = ex.model:stream("It is a truth universally acknowledged", {
    max_tokens = 48, temperature = 0.8, top_k = 40, sample_seed = 7,
})
for _, text in iterate, session do
    io.write(text)
    io.flush()
end
local s = session.final_stats
print(string.format("\n[%d tokens, %.1f tok/s, stop %s]", s.tokens_emitted, s.decode_tokens_per_s, s.stop_reason))

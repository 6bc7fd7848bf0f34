#!/usr/bin/env luajit
-- save_resume.lua: a generation saved to a file and continued later, by another load of the
-- same checkpoint (as another process would): the continuation is exactly the one the
-- uninterrupted session produces. Then a branch of the same saved state with a logits
-- processor of its own (hooks are not saved: a resume takes new ones).
--   luajit examples/save_resume.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local model = ex.model
local prompt = "It is a truth universally acknowledged"
local cfg = { max_tokens = 40, temperature = 0.8, sample_seed = 42, ignore_eos = true }

local function finish(session)
    repeat local _, _, reason = session:step() until reason
    return session:tokens()
end

-- The reference: one session from start to end.
local whole = finish(assert(model:session(prompt, cfg)))

-- Generate 15 tokens, save the state to a file, and let the session go.
local session = assert(model:session(prompt, cfg))
for _ = 1, 15 do session:step() end
local path = os.tmpname()
assert(assert(session:save()):write(path))
session:close()
local f = assert(io.open(path, "rb"))
local size = f:seek("end")
f:close()
print(("saved after 15 tokens: %s (%d bytes: tokens, sampler, stats, KV cache)"):format(path, size))

-- Later: load the checkpoint again and continue from the file.
local later = assert(ex.tinyloop.load(ex.dir))
local state = assert(later:read_state(path))
local resumed = finish(assert(later:resume(state)))
local same = #resumed == #whole
for i = 1, #whole do same = same and resumed[i] == whole[i] end
print("resumed:  " .. later:decode(resumed))
print("identical to the uninterrupted session: " .. tostring(same))

-- A branch of the saved state, with its own logits processor.
local ids = state:tokens()
local next_id = resumed[#ids + 1]
local branch = finish(assert(later:resume(state, {
    logits_processor = function(logits) logits[next_id] = -math.huge end, -- another first token
})))
print("branched: " .. later:decode(branch))
os.remove(path)
if not same then os.exit(1) end

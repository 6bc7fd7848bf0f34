#!/usr/bin/env luajit
-- lua_sweep.lua: a Lua parameter sweep, stepped one session at a time against all together.
-- N sessions of one prompt, each its own config (temperatures 0.5.. and seeds, every other
-- session with a Lua logits_processor that edits nothing), decode T tokens each:
--   one by one   session:step() for each session in turn (each step reads every weight)
--   step_batch   model:step_batch(live) (one batched forward a step for all of them)
-- and prints the aggregate decode tokens/s of each (median of --repeat runs, alternated) and
-- their ratio. The tokens of both are checked equal.
--   luajit scripts/bench/lua_sweep.lua [--model DIR] [--sessions 8] [--tokens 32] [--repeat 3] [--threads 2]
local root = (arg[0]:match("^(.*)/scripts/bench/[^/]*$")) or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local ffi = require "ffi"
local tinyloop = require "tinyloop"
ffi.cdef [[
struct lua_sweep_timespec { long tv_sec; long tv_nsec; };
int clock_gettime(int clock, struct lua_sweep_timespec *ts);
]]
local ts = ffi.new("struct lua_sweep_timespec")
local function now() -- CLOCK_MONOTONIC (1 on Linux), ms: wall time, where os.clock counts CPU
    ffi.C.clock_gettime(1, ts)
    return tonumber(ts.tv_sec) * 1e3 + tonumber(ts.tv_nsec) * 1e-6
end

local options = require "tinyloop.script_options"
local opt = options.parse(arg, {
    path = "scripts/bench/lua_sweep.lua",
    summary = "A Lua parameter sweep, stepped one session at a time against all together (model:step_batch):\n"
        .. "aggregate decode tokens/s of each and their ratio.",
    { "model", root .. "/models/tinyloop-austen", "checkpoint directory", metavar = "DIR" },
    { "sessions", 8, "sessions, each its own temperature and seed" },
    { "tokens", 32, "tokens each (the first comes from the prefill, off the clock: at least 2)" },
    { "repeat", 3, "runs of each way, alternated (the median is printed)" },
    { "threads", 2, "CPU threads" },
})
local die = options.die("lua_sweep.lua")
options.counts(opt, { "sessions", "repeat", "threads" }, die)
options.counts(opt, { "tokens" }, die, 2)
local model = options.load_model(tinyloop, opt, die)
if 16 + opt.tokens > model:info().max_seq_len then -- (the prompt below: 16 ids)
    die(("16 prompt tokens and --tokens %d exceed the model's context of %d"):format(opt.tokens, model:info().max_seq_len))
end
local info = model:info()
local prompt = {}
for i = 1, 16 do prompt[i] = (i * 7919) % (info.vocab_size - 1) end

local function sessions()
    local list = {}
    for i = 1, opt.sessions do
        local cfg = { max_tokens = opt.tokens, ignore_eos = true, temperature = 0.5 + 0.1 * i, sample_seed = i }
        if i % 2 == 0 then cfg.logits_processor = function() end end
        list[i] = model:session(prompt, cfg)
    end
    -- the prompts first, off the clock: the sweep's decode is what is measured
    for _, r in ipairs(model:step_batch(list)) do assert(r.id >= 0) end
    return list
end

-- Decodes the sweep's tokens with advance(list) (one step of every session; returns the
-- tokens it made) -> tokens/s, each session's sequence.
local function run(advance)
    local list = sessions()
    local t0, n = now(), 0
    for _ = 2, opt.tokens do n = n + advance(list) end
    local ms = now() - t0
    local out = {}
    for i, s in ipairs(list) do out[i] = table.concat(s:tokens(), ",") s:close() end
    return n * 1000 / ms, out
end

local function one_by_one()
    return run(function(list)
        for _, s in ipairs(list) do s:step() end
        return #list
    end)
end

local function together()
    return run(function(list) return #model:step_batch(list) end)
end

local median = options.median
local alone, batched = {}, {}
for r = 1, opt["repeat"] do
    local a, out_a = one_by_one()
    local b, out_b = together()
    for i = 1, #out_a do assert(out_a[i] == out_b[i], "session " .. i .. ": the tokens differ") end
    alone[r], batched[r] = a, b
end
local a, b = median(alone), median(batched)
print(("model %s (%s, %.1f MB of weights), %d threads; %d sessions of %d tokens, each its own temperature and seed"):format(
    opt.model, info.weight_dtype, (info.weight_bytes or 0) / 1e6, opt.threads, opt.sessions, opt.tokens))
print(("one by one (session:step)   %8.1f tok/s"):format(a))
print(("together (model:step_batch) %8.1f tok/s   x%.2f   (the same tokens)"):format(b, b / a))

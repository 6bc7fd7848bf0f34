#!/usr/bin/env luajit
-- lua_overhead.lua: what the Lua path costs. Compares, on the same model, prompt and
-- config (greedy, ignore_eos):
--   C loop      tl_generate called once through the FFI (the engine's own decode loop)
--   Lua stream  model:stream, the iterator the CLI uses (one FFI step + text per token)
--   + hook      model:generate with a no-op on_token, stop_when and logits_processor
-- and prints decode tokens/s (median of --repeat runs) and the per-token cost of the hooks.
--   luajit scripts/bench/lua_overhead.lua [--model DIR] [--tokens 200] [--repeat 5]
local root = (arg[0]:match("^(.*)/scripts/bench/[^/]*$")) or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local ffi = require "ffi"
local tinyloop = require "tinyloop"
local C = tinyloop.C

local options = require "tinyloop.script_options"
local opt = options.parse(arg, {
    path = "scripts/bench/lua_overhead.lua",
    summary = "What the Lua path costs: decode tokens/s of tl_generate, model:stream and model:generate with\n"
        .. "three no-op hooks, on one model, prompt and config.",
    { "model", root .. "/models/tinyloop-austen", "checkpoint directory", metavar = "DIR" },
    { "tokens", 200, "greedy tokens a run (the first comes from the prefill: at least 2)" },
    { "repeat", 5, "runs of each path (the median is printed)" },
})
local die = options.die("lua_overhead.lua")
options.counts(opt, { "repeat" }, die)
options.counts(opt, { "tokens" }, die, 2)
local model = options.load_model(tinyloop, opt, die)
local n_tokens, repeats = opt.tokens, opt["repeat"]
local prompt = model:encode("It is a truth universally acknowledged, that a single man in possession")
local median = options.median

local function c_loop()
    local cfg = ffi.new("tl_generate_config")
    C.tl_generate_config_init(cfg)
    cfg.max_tokens, cfg.ignore_eos = n_tokens, 1
    local arr = ffi.new("int32_t[?]", #prompt)
    for i = 1, #prompt do arr[i - 1] = prompt[i] end
    local out = ffi.new("int32_t[?]", #prompt + n_tokens)
    local len, st = ffi.new("int[1]"), ffi.new("tl_generate_stats")
    assert(C.tl_generate(model.ptr, arr, #prompt, cfg, out, #prompt + n_tokens, len, st) == 0, ffi.string(C.tl_last_error()))
    return C.tl_stats_decode_tokens_per_s(st) -- (the engine's rule: the prefill's token is not decoded)
end

local function lua_stream()
    local iterate, session = model:stream(prompt, { max_tokens = n_tokens, ignore_eos = true })
    for _ in iterate, session do end
    return session.final_stats.decode_tokens_per_s
end

local hook_calls = 0
local function with_hooks()
    local _, st = model:generate(prompt, {
        max_tokens = n_tokens, ignore_eos = true,
        on_token = function() hook_calls = hook_calls + 1 end,
        stop_when = function() return false end,
        logits_processor = function() end,
    })
    return st.decode_tokens_per_s
end

local results = {}
for _, case in ipairs({ { "C loop (tl_generate)", c_loop }, { "Lua stream (the CLI's loop)", lua_stream },
                        { "Lua + 3 no-op hooks", with_hooks } }) do
    case[2]() -- warm-up
    local t = {}
    for r = 1, repeats do t[r] = case[2]() end
    results[#results + 1] = { case[1], median(t) }
end
print(("%s, %d prompt tokens, %d greedy tokens, median of %d"):format(opt.model, #prompt, n_tokens, repeats))
print("| path | decode tok/s | vs C loop | per-token cost vs C |")
print("|---|---:|---:|---:|")
local c = results[1][2]
for _, r in ipairs(results) do
    print(("| %s | %.1f | %+.2f%% | %+.1f us |"):format(r[1], r[2], 100 * (r[2] / c - 1), 1e6 / r[2] - 1e6 / c))
end

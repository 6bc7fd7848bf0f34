#!/usr/bin/env luajit
-- early_exit_eval.lua: adaptive-depth early exit on held-out text, greedy. For a grid of
-- criteria reports mean loops used per token, decode tokens/s, and the token-level agreement
-- with full-depth greedy generation over the generated tokens.
--   luajit scripts/early_exit_eval.lua [options]        (--help lists them with their defaults)
-- The repository from this script's real path (run from scripts/, or through a link, too:
-- "luajit sweep.lua" in scripts/ found no module), as scripts/tinyloop finds it.
local ffi = require "ffi"
pcall(ffi.cdef, "char *realpath(const char *path, char *resolved);")
local resolved = ffi.new("char[4096]")
local script = ffi.C.realpath(arg[0], resolved) ~= nil and ffi.string(resolved) or arg[0]
local root = (script:match("^(.*)/scripts/[^/]*$")) or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local tinyloop = require "tinyloop"
local options = require "tinyloop.script_options"
local now = require("tinyloop.policy").now

local opt = options.parse(arg, {
    name = "early_exit_eval.lua",
    summary = "Adaptive-depth early exit on held-out text, greedy: mean loops, tokens/s and agreement\n"
        .. "with full-depth generation for a grid of exit criteria.",
    { "model", root .. "/models/tinyloop-austen", "checkpoint directory", metavar = "DIR" },
    { "text", root .. "/build/corpus/val.txt", "held-out text the prompts are cut from (scripts/train/corpus.py)",
      metavar = "FILE" },
    { "prompts", 20, "prompts, spread evenly over the text" },
    { "prompt-tokens", 32, "tokens per prompt" },
    { "tokens", 64, "greedy tokens generated per prompt" },
    { "threads", nil, "CPU threads", number = true, default_text = "all cores" },
    { "repeat", 3, "timed runs of each row, alternating with full-depth runs: the speedup is the median over\n"
        .. "the median of the full-depth runs around it (machines drift over minutes)" },
})
local die = options.die("early_exit_eval.lua")
options.counts(opt, { "prompts", "prompt_tokens", "repeat" }, die)
options.counts(opt, { "tokens" }, die, 2) -- (the first comes from the prefill: one token decodes none, and rated 0)
local model = options.load_model(tinyloop, opt, die)
if not model.has_tokenizer then die(opt.model .. " has no tokenizer: the held-out text cannot be encoded") end
local info = model:info()
if opt.prompt_tokens + opt.tokens > info.max_seq_len then
    die(("--prompt-tokens %d + --tokens %d exceed the context (%d)"):format(opt.prompt_tokens, opt.tokens, info.max_seq_len))
end
local L = info.default_loops
local n_prompts, plen, n_tokens = opt.prompts, opt.prompt_tokens, opt.tokens

local f = io.open(opt.text, "rb")
local text = f and f:read("*a")
if f then f:close() end
if type(text) ~= "string" then die("no held-out text at " .. opt.text .. " (scripts/train/corpus.py makes it)") end
local ids = model:encode(text)
local prompts = {}
-- (a stride of 0, a text shorter than prompts + prompt tokens, made every prompt the same
-- one, and the figures counted it --prompts times)
local stride = math.floor((#ids - plen) / n_prompts)
if stride < 1 then
    die(("%s has %d tokens: %d prompts of %d need at least %d (fewer --prompts or --prompt-tokens, or a longer text)")
        :format(opt.text, #ids, n_prompts, plen, n_prompts + plen))
end
for k = 1, n_prompts do
    local p = {}
    for j = 1, plen do p[j] = ids[(k - 1) * stride + j] end
    prompts[k] = p
end

local function run(extra)
    local outs, loops, tokens, ms, probes, decoded = {}, 0, 0, 0, 0, 0
    for k, p in ipairs(prompts) do
        local cfg = { max_tokens = n_tokens, loops = L, ignore_eos = true }
        for key, v in pairs(extra) do cfg[key] = v end
        local out, st = model:generate(p, cfg)
        outs[k] = out
        loops = loops + st.loops_used * st.tokens_emitted
        tokens = tokens + st.tokens_emitted
        ms = ms + st.decode_ms
        -- (decode_ms times the tokens after the first, which the prefill gave: the engine's
        -- decode rate counts those, and so does this one; all of them read 64/63 too fast)
        decoded = decoded + st.tokens_emitted - 1
        probes = probes + st.probes
    end
    return outs, loops / tokens, decoded / (ms / 1000), probes / tokens
end

local grid = {}
-- Huginn's latent difference: the state change alone, so no probe (coda + head) runs
-- before the exit.
for _, t in ipairs({ 0.003, 0.01, 0.03, 0.1 }) do
    for _, p in ipairs({ 1, 2 }) do
        grid[#grid + 1] = { ("latent diff < %g"):format(t), p, { early_exit_threshold = t, early_exit_criterion = "latent_diff" } }
    end
end
for _, t in ipairs({ 0.003, 0.01, 0.03, 0.1, 0.3 }) do
    for _, p in ipairs({ 1, 2 }) do grid[#grid + 1] = { ("state change < %g"):format(t), p, { early_exit_threshold = t } } end
end
for _, mrg in ipairs({ 0.5, 1, 2, 4 }) do
    for _, p in ipairs({ 1, 2 }) do grid[#grid + 1] = { ("logit margin >= %g"):format(mrg), p, { early_exit_logit_margin = mrg } } end
end
local progress = options.progress(#grid + 1, now)

local median = options.median

-- (a pass to warm up first: the first, cold, ran at about half the rate of the full-depth
-- runs alternated with the rows below, and was the headline's figure)
run({})
local full, full_loops, full_tps = run({})
progress("full depth")
local function agreement(outs)
    local same, total = 0, 0
    for k, out in ipairs(outs) do
        for j = plen + 1, plen + n_tokens do
            total = total + 1
            if out[j] == full[k][j] then same = same + 1 end
        end
    end
    return same / total
end

print(("%d held-out prompts of %d tokens, %d greedy tokens each, default depth %d; full depth: %.1f tok/s"):format(
    n_prompts, plen, n_tokens, L, full_tps))
print("| criterion | patience | mean loops | loops saved | tok/s | speedup | probes/token | agreement |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for _, g in ipairs(grid) do
    local cfg = { early_exit_patience = g[2], early_exit_min_L = 1, early_exit_peek_every = 1 }
    for k, v in pairs(g[3]) do cfg[k] = v end
    local outs, loops, probes
    local rates, full_rates = {}, {}
    for r = 1, opt["repeat"] do
        local tps
        outs, loops, tps, probes = run(cfg)
        rates[r] = tps
        full_rates[r] = select(3, run({}))
    end
    local tps, base = median(rates), median(full_rates)
    progress(("%s, patience %d"):format(g[1], g[2]))
    print(("| %s | %d | %.2f | %.0f%% | %.1f | %.2fx | %.2f | %.1f%% |"):format(g[1], g[2], loops,
        100 * (1 - loops / full_loops), tps, tps / base, probes, 100 * agreement(outs)))
end
options.finish(die)

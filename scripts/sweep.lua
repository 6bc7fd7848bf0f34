#!/usr/bin/env luajit
-- sweep.lua: speculative-decoding parameter sweep. In one process, times plain greedy
-- generate at verify_loops and the chain and tree speculative decoders over a grid of
-- draft_loops x draft_ahead (x K_branches) on a prompt set; writes a CSV and a PNG chart
-- (gnuplot) and prints the best settings. Speedup = median wall time of plain generate /
-- median wall time of the setting, both measured in this run over the same prompts.
--
--   luajit scripts/sweep.lua [options]        (--help lists them with their defaults)
-- The repository from this script's real path (run from scripts/, or through a link, too:
-- "luajit sweep.lua" in scripts/ found no module), as scripts/tinyloop finds it.
local ffi = require "ffi"
pcall(ffi.cdef, "char *realpath(const char *path, char *resolved);")
local resolved = ffi.new("char[4096]")
local script = ffi.C.realpath(arg[0], resolved) ~= nil and ffi.string(resolved) or arg[0]
local root = (script:match("^(.*)/scripts/[^/]*$")) or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local tinyloop = require "tinyloop"
local now = require("tinyloop.policy").now
local options = require "tinyloop.script_options"

local die = options.die("sweep.lua")

-- Ctrl-C ends the run at once, 130 as a shell's commands end: the table is written only at
-- the end (beside its place, then renamed there), so an interrupted run leaves an earlier one
-- as it was. (LuaJIT's own handler raised "interrupted!" wherever Lua next ran, often not
-- before the pass under way had ended, and the script said 2, bad usage.)
pcall(ffi.cdef, "typedef void (*tl_sweep_sighandler)(int); tl_sweep_sighandler signal(int signum, tl_sweep_sighandler handler);")
ffi.C.signal(2, nil) -- (SIGINT, SIG_DFL)

local function list(s, name)
    local t = {}
    for x in tostring(s):gmatch("[^,]+") do
        local v = tonumber(x)
        if not v or v < 1 or v ~= math.floor(v) then die(("--%s: '%s' is not a list of whole numbers >= 1"):format(name, s)) end
        t[#t + 1] = v
    end
    if #t == 0 then die(("--%s: '%s' is not a list of whole numbers >= 1"):format(name, s)) end
    return t
end

-- A path as one shell word.
local function quoted(path) return "'" .. path:gsub("'", "'\\''") .. "'" end
-- A path as a gnuplot string (single-quoted: a quote is two).
local function gnuplot_string(path) return "'" .. path:gsub("'", "''") .. "'" end

local opt = options.parse(arg, {
    name = "sweep.lua",
    summary = "Times plain greedy generate against chain and tree self-speculative decoding over a\n"
        .. "grid of draft_loops x draft_ahead (x K); writes a CSV and a chart, prints the best.",
    { "model", root .. "/models/tinyloop-austen", "checkpoint directory", metavar = "DIR" },
    { "prompts", nil, "file with one prompt per line", metavar = "FILE", default_text = "8 built-in prompts" },
    { "n-prompts", 0, "use only the first N prompts (0: all)" },
    { "max-tokens", 64, "new tokens per prompt" },
    { "repeats", 3, "timed passes per setting (the median is reported)" },
    { "draft-loops", "1,2,3", "draft depths to try (those below verify-loops)", metavar = "LIST" },
    { "draft-ahead", "2,4,6,8", "tokens (chain) or tree levels drafted per verify", metavar = "LIST" },
    { "K", "1,2,3,4", "tree branches per node", metavar = "LIST" },
    { "verify-loops", nil, "verification depth", number = true, default_text = "the model's default_loops" },
    { "max-nodes", 32, "tree node budget" },
    { "threads", nil, "CPU threads", number = true, default_text = "all cores" },
    { "out", root .. "/build/sweep", "output directory (sweep.csv, sweep.dat, sweep.gp, sweep.png)", metavar = "DIR" },
})

options.counts(opt, { "repeats", "max_tokens", "max_nodes" }, die)
options.counts(opt, { "n_prompts" }, die, 0)
if opt.verify_loops then options.counts(opt, { "verify_loops" }, die) end
local model = options.load_model(tinyloop, opt, die)
if not model.has_tokenizer then die(opt.model .. " has no tokenizer: the prompts cannot be encoded") end
local info = model:info()
local verify = opt.verify_loops or info.default_loops
local max_tokens = opt.max_tokens
local repeats = opt.repeats

local prompts = {}
if opt.prompts then
    local f, err = io.open(opt.prompts, "rb")
    if not f then die(err) end
    local _, read_err = f:read(0) -- (a directory opens, then fails to read)
    f:close()
    if read_err then die(opt.prompts .. ": " .. read_err) end
    for line in io.lines(opt.prompts) do
        if line:match("%S") then prompts[#prompts + 1] = line end
    end
else
    prompts = {
        "It is a truth universally acknowledged, that",
        "Mr. Darcy walked towards the window and",
        "\"My dear Mr. Bennet,\" said his lady to him one day,",
        "Emma Woodhouse, handsome, clever, and rich,",
        "The weather was fine, and the whole party",
        "She had never seen him so",
        "A man who has never gone to school may steal from a freight car;",
        "You will be fortunate in the",
    }
end
if opt.n_prompts > 0 then
    for k = #prompts, opt.n_prompts + 1, -1 do prompts[k] = nil end
end
if #prompts == 0 then die("no prompts") end
local encoded = {}
for k, p in ipairs(prompts) do encoded[k] = model:encode(p) end

-- What a call raised: a value the engine refuses (a depth, a length).
local function refused(raised) die(require("tinyloop.raise").message(raised)) end

-- One timed pass over every prompt; returns seconds and the outputs.
local function pass(fn, cfg)
    local outs, stats = {}, {}
    local t0 = now()
    for k, ids in ipairs(encoded) do
        local ok, out, st = pcall(fn, model, ids, cfg)
        if not ok then refused(out) end
        if not out then die(st, 1) end
        outs[k], stats[k] = out, st
    end
    return now() - t0, outs, stats
end

local median = options.median

local settings = { { mode = "plain" } }
for _, d in ipairs(list(opt.draft_loops, "draft-loops")) do
    if d < verify then
        for _, a in ipairs(list(opt.draft_ahead, "draft-ahead")) do
            settings[#settings + 1] = { mode = "chain", draft_loops = d, draft_ahead = a, K = 1 }
            for _, K in ipairs(list(opt.K, "K")) do
                settings[#settings + 1] = { mode = "tree", draft_loops = d, draft_ahead = a, K = K }
            end
        end
    end
end
if #settings == 1 then die(("no --draft-loops below --verify-loops %d: nothing to compare"):format(verify)) end

-- Every setting as the engine reads it, before the timings (a session made for the longest
-- prompt, not stepped): a value only the engine knows out of range (K above 8, a draft past
-- its limit, verify-loops past max_loops, a prompt and max-tokens past the context) was
-- refused part-way through the grid.
local longest = encoded[1]
for _, ids in ipairs(encoded) do if #ids > #longest then longest = ids end end
for _, s in ipairs(settings) do
    local cfg = { max_tokens = max_tokens, loops = verify }
    if s.mode ~= "plain" then
        cfg = { max_tokens = max_tokens, verify_loops = verify, speculative = s.mode, draft_loops = s.draft_loops,
                draft_ahead = s.draft_ahead }
        if s.mode == "tree" then cfg.K_branches, cfg.max_nodes = s.K, opt.max_nodes end
    end
    local ok, session, err = pcall(model.session, model, longest, cfg)
    if not ok then refused(session) end
    if not session then die(err) end
    session:close()
end

-- The output directory once every value is checked, before the timings: a run that cannot
-- write its table fails first, and a refused one leaves an earlier table as it was.
-- (os.execute: 0 in Lua 5.1's manner, true where LuaJIT takes 5.2's)
local made = os.execute("mkdir -p -- " .. quoted(opt.out))
if made ~= 0 and made ~= true then die("cannot create the output directory " .. opt.out, 1) end
-- The output directory's files: one that cannot be opened refused in one line (not a
-- traceback), and each close checked (a full disk shows only there: the table was left empty,
-- and the run said where it was).
local function open_out(name)
    local f, err = io.open(opt.out .. "/" .. name, "w")
    if not f then die(err, 1) end
    return f
end
local function close_out(f, name)
    local ok, err = f:close()
    if not ok then die(opt.out .. "/" .. name .. ": " .. tostring(err), 1) end
end
-- The table: its lines kept until the timings are done, then written beside sweep.csv and
-- renamed over it (a refused or interrupted run emptied an earlier table: it was opened here).
-- Whether it can be written is tried now.
local PARTIAL = "sweep.csv.partial"
close_out(open_out(PARTIAL), PARTIAL)
os.remove(opt.out .. "/" .. PARTIAL)
local csv_lines = {}

-- Interleave the repeats (plain, then every setting, repeats times) so that slow drifts of
-- the machine hit every setting alike.
local times, plain_outs = {}, nil
for _, s in ipairs(settings) do times[s] = {} end
local progress = options.progress(#settings * repeats, now)
for r = 1, repeats do
    for _, s in ipairs(settings) do
        local fn, cfg
        if s.mode == "plain" then
            fn, cfg = model.generate, { max_tokens = max_tokens, loops = verify }
        else
            cfg = { max_tokens = max_tokens, verify_loops = verify, draft_loops = s.draft_loops,
                    draft_ahead = s.draft_ahead }
            if s.mode == "tree" then
                fn = model.generate_tree_speculative
                cfg.K_branches, cfg.max_nodes = s.K, opt.max_nodes
            else
                fn = model.generate_speculative
            end
        end
        local t, outs, stats = pass(fn, cfg)
        times[s][#times[s] + 1] = t
        if s.mode == "plain" then
            plain_outs = plain_outs or outs
        elseif r == 1 then
            local drafted, accepted, steps, exact = 0, 0, 0, true
            for k, st in ipairs(stats) do
                drafted, accepted, steps = drafted + st.drafted, accepted + st.accepted, steps + st.verify_steps
                if table.concat(outs[k], ",") ~= table.concat(plain_outs[k], ",") then exact = false end
            end
            s.acceptance = drafted > 0 and accepted / drafted or 0
            s.mean_accepted = steps > 0 and accepted / steps or 0
            s.exact = exact
        end
        progress(("repeat %d: %s %.2f s"):format(r, s.mode .. (s.draft_loops and
            (" d" .. s.draft_loops .. " a" .. s.draft_ahead .. " K" .. s.K) or ""), t))
    end
end

local base = median(times[settings[1]])
csv_lines[1] = "mode,draft_loops,draft_ahead,K,median_s,speedup,acceptance,mean_accepted,exact\n"
csv_lines[2] = ("plain,,,,%.4f,1.000,,,true\n"):format(base)
local best = {}
print(("%d prompts x %d new tokens, verify_loops %d, median of %d; plain generate %.3f s"):format(
    #prompts, max_tokens, verify, repeats, base))
print("| mode | draft_loops | draft_ahead | K | median s | speedup | acceptance | accepted/verify | exact |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
for k = 2, #settings do
    local s = settings[k]
    s.median = median(times[s])
    s.speedup = base / s.median
    csv_lines[#csv_lines + 1] = ("%s,%d,%d,%d,%.4f,%.3f,%.4f,%.3f,%s\n"):format(s.mode, s.draft_loops, s.draft_ahead,
        s.K, s.median, s.speedup, s.acceptance, s.mean_accepted, tostring(s.exact))
    print(("| %s | %d | %d | %d | %.3f | %.2fx | %.1f%% | %.2f | %s |"):format(s.mode, s.draft_loops,
        s.draft_ahead, s.K, s.median, s.speedup, 100 * s.acceptance, s.mean_accepted, s.exact and "yes" or "NO"))
    if not best[s.mode] or s.speedup > best[s.mode].speedup then best[s.mode] = s end
end
local csv = open_out(PARTIAL)
csv:write(table.concat(csv_lines))
close_out(csv, PARTIAL)
local renamed, rename_err = os.rename(opt.out .. "/" .. PARTIAL, opt.out .. "/sweep.csv")
if not renamed then die(tostring(rename_err), 1) end
for _, mode in ipairs({ "chain", "tree" }) do
    local s = best[mode]
    if s then
        print(("best %s: draft_loops %d, draft_ahead %d, K %d: %.2fx speedup, %.1f%% acceptance, %.2f accepted per verify"):format(
            mode, s.draft_loops, s.draft_ahead, s.K, s.speedup, 100 * s.acceptance, s.mean_accepted))
    end
end

-- Chart: speedup and acceptance against draft_ahead, one line per (mode, draft_loops, K).
local dat = open_out("sweep.dat")
local series = {}
for k = 2, #settings do
    local s = settings[k]
    local key = s.mode == "chain" and ("chain d%d"):format(s.draft_loops) or ("tree d%d K%d"):format(s.draft_loops, s.K)
    if not series[key] then series[key] = {} series[#series + 1] = key end
    table.insert(series[key], s)
end
for _, key in ipairs(series) do
    dat:write("# ", key, "\n")
    for _, s in ipairs(series[key]) do
        dat:write(("%d %.4f %.4f\n"):format(s.draft_ahead, s.speedup, 100 * s.acceptance))
    end
    dat:write("\n\n")
end
close_out(dat, "sweep.dat")
local plot_chain, plot_tree = {}, {}
for idx, key in ipairs(series) do
    local item = ("%s index %d using 1:COL with linespoints title '%s'"):format(gnuplot_string(opt.out .. "/sweep.dat"), idx - 1, key)
    if key:match("^chain") then plot_chain[#plot_chain + 1] = item else plot_tree[#plot_tree + 1] = item end
end
local gp = open_out("sweep.gp")
gp:write(([[
set terminal pngcairo size 1400,900 font ",10" noenhanced
set output %s
set multiplot layout 2,2 title "TinyLoop self-speculative decoding, verify_loops %d, %d prompts x %d tokens (plain = 1.0)"
set key outside right
set grid
set xlabel "draft_ahead"
set ylabel "speedup vs plain generate"
set title "chain: speedup"
plot %s, 1 with lines dt 2 lc rgb "gray" notitle
set title "tree: speedup"
plot %s, 1 with lines dt 2 lc rgb "gray" notitle
set ylabel "acceptance %%"
set title "chain: acceptance"
plot %s
set title "tree: acceptance (accepted / drafted nodes)"
plot %s
unset multiplot
]]):format(gnuplot_string(opt.out .. "/sweep.png"), verify, #prompts, max_tokens,
    table.concat(plot_chain, ", "):gsub("COL", "2"), table.concat(plot_tree, ", "):gsub("COL", "2"),
    table.concat(plot_chain, ", "):gsub("COL", "3"), table.concat(plot_tree, ", "):gsub("COL", "3")))
close_out(gp, "sweep.gp")
-- gnuplot's own messages where it fails (a path it could not write, a script it refused);
-- "not available" only where there is none
local has_gnuplot = os.execute("command -v gnuplot > /dev/null 2>&1")
if has_gnuplot ~= 0 and has_gnuplot ~= true then
    print("gnuplot not available (apt-get install gnuplot-nox): table in " .. opt.out .. "/sweep.csv")
else
    local errors = os.tmpname()
    local plotted = os.execute("gnuplot " .. quoted(opt.out .. "/sweep.gp") .. " 2> " .. quoted(errors))
    local f = io.open(errors, "rb")
    local said = f and f:read("*a") or ""
    if f then f:close() end
    os.remove(errors)
    if plotted == 0 or plotted == true then
        print("chart: " .. opt.out .. "/sweep.png; table: " .. opt.out .. "/sweep.csv")
    else
        io.stderr:write("sweep.lua: gnuplot failed on ", opt.out, "/sweep.gp: ", said:gsub("%s+$", ""), "\n")
        print("no chart: table in " .. opt.out .. "/sweep.csv")
    end
end
options.finish(die)

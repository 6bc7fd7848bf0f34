-- conventions_spec.lua: the one error convention of the Lua API (init.lua's header): argument
-- errors raise at the caller's line, load and runtime failures return nil, err, and the
-- facts Lua takes from C (stop-reason names) rather than copying them.
local H = require "helpers"
local ffi = require "ffi"
local policy = require "tinyloop.policy"

local m = H.model()
local C = H.tinyloop.C

-- Calls f and returns its error message; fails unless it raised one with every needle.
local function raised(needles, f)
    local ok, err = pcall(f)
    assert.is_false(ok, "expected an error containing '" .. needles[1] .. "'")
    err = tostring(err)
    for _, needle in ipairs(needles) do
        assert.truthy(err:find(needle, 1, true), "error '" .. err .. "' lacks '" .. needle .. "'")
    end
    return err
end

describe("loops", function()
    it("= 0 is an error naming the field, in every decoder", function()
        local needles = { "loops = 0", "[1, max_loops = 4]" }
        raised(needles, function() m:generate({ 1, 2 }, { loops = 0 }) end)
        raised(needles, function() m:session({ 1, 2 }, { loops = 0 }) end)
        raised(needles, function() m:stream({ 1, 2 }, { loops = 0 }) end)
        raised(needles, function() m:generate_batch({ { 1, 2 } }, { loops = 0 }) end)
        raised(needles, function() m:generate({ 1, 2 }, { loops = 0, beam_size = 2 }) end)
        raised(needles, function() m:embed({ 1, 2 }, { loops = 0 }) end)
    end)

    it("left out means the model's default_loops", function()
        local _, st = m:generate({ 1, 2 }, { max_tokens = 2 })
        assert.equal(m:info().default_loops, st.loops_used)
    end)
end)

describe("config values that C cannot represent", function()
    it("integer fields must be integers of a C int", function()
        raised({ "'max_tokens' = 2.5 must be an integer" }, function() m:generate({ 1 }, { max_tokens = 2.5 }) end)
        raised({ "'loops' = 1.5 must be an integer" }, function() m:generate({ 1 }, { loops = 1.5 }) end)
        raised({ "'max_tokens' = 3000000000 must be an integer" }, function() m:generate({ 1 }, { max_tokens = 3e9 }) end)
        raised({ "'top_k' = inf" }, function() m:generate({ 1 }, { top_k = math.huge }) end)
        -- a float field past a C float's range is named with its value (the engine saw inf)
        raised({ "'top_p' = 1e+39 is past a C float's range" }, function() m:generate({ 1 }, { top_p = 1e39 }) end)
        -- and one too small for it is not read as 0 (the engine's message then named a 0 not given)
        raised({ "'top_p' = 1e-50 is below a C float's smallest magnitude" }, function() m:generate({ 1 }, { top_p = 1e-50 }) end)
        raised({ "'repetition_penalty' = -1e-46 is below a C float's smallest magnitude" },
               function() m:generate({ 1 }, { repetition_penalty = -1e-46 }) end)
        assert.truthy(m:generate({ 1 }, { top_p = 1.5e-45, max_tokens = 1 })) -- (a float's smallest: taken)
        raised({ "'draft_ahead' = 2.5" }, function() m:generate_speculative({ 1 }, { draft_ahead = 2.5 }) end)
        raised({ "'K_branches' = 0.5" }, function() m:generate_tree_speculative({ 1 }, { K_branches = 0.5 }) end)
    end)

    it("seeds must be integers in [0, 2^53]", function()
        raised({ "'sample_seed' = -1" }, function() m:generate({ 1 }, { sample_seed = -1 }) end)
        -- (2^53 itself is in the range: taken by every call that takes a seed)
        assert.truthy(m:generate({ 1 }, { sample_seed = 2 ^ 53, temperature = 1, max_tokens = 2 }))
        assert.truthy(m:generate_speculative({ 1 }, { seed = 2 ^ 53, temperature = 1, max_tokens = 2, draft_loops = 1, verify_loops = 2 }))
        raised({ "'sample_seed' = 9.007199254741e+15" }, function() m:generate({ 1 }, { sample_seed = 2 ^ 53 + 2 }) end)
        raised({ "'seed' = 0.5" }, function() m:generate_speculative({ 1 }, { seed = 0.5 }) end)
        -- two names of one seed: one was dropped for the other
        raised({ "'seed' and 'sample_seed' are one setting" },
               function() m:generate_speculative({ 1 }, { seed = 1, sample_seed = 2 }) end)
    end)

    it("a speculative call is its mode: a speculative field naming the other is refused (it ran the call's)", function()
        raised({ "'speculative' = tree: generate_speculative runs the chain" },
               function() m:generate_speculative({ 1 }, { speculative = "tree" }) end)
        raised({ "'speculative' = chain: generate_tree_speculative runs the tree" },
               function() m:generate_tree_speculative({ 1 }, { speculative = "chain" }) end)
        assert.truthy(m:generate_speculative({ 1 }, { speculative = "chain", max_tokens = 2, draft_loops = 1, verify_loops = 2 }))
    end)

    it("ignore_eos must be a boolean (0 would be true in Lua)", function()
        raised({ "'ignore_eos' must be a boolean" }, function() m:generate({ 1 }, { ignore_eos = 0 }) end)
    end)

    it("errors point at the caller's line", function()
        local err = raised({ "loops = 0" }, function() local ids = m:generate({ 1 }, { loops = 0 }) return ids end)
        assert.truthy(err:find("conventions_spec.lua:%d+:"), err)
    end)

    it("tinyloop.grammar's errors point at the caller's line too (they pointed into grammar.lua)", function()
        local G = H.tinyloop.grammar
        for _, case in ipairs({
            { "tinyloop.grammar.gbnf: text must be a string", function() local g = G.gbnf(5) return g end },
            { "tinyloop.grammar.rep", function() local e = G.rep("a", -1) return e end },
            { "tinyloop.grammar.lit", function() local e = G.lit(5) return e end },
            { "tinyloop.grammar.build", function() local g = G.build(5) return g end },
            -- (through tinyloop's own frames: a grammar option of generate)
            { "grammar", function() local ids = m:generate({ 1 }, { grammar = {} }) return ids end },
        }) do
            local err = raised({ case[1] }, case[2])
            assert.truthy(err:find("^[^\n]*conventions_spec.lua:%d+:"), err)
        end
    end)
end)

describe("runtime failures", function()
    -- A real checkpoint (the text model) whose config allows a 16M-token context: asking for
    -- 16M tokens runs the engine out of memory under a 300 MB address-space limit (the
    -- session's token and row arrays: KV pages are only allocated as they are written).
    it("return nil, err from every generating call #ulimit", function()
        local dir = os.tmpname()
        os.remove(dir)
        assert(os.execute("mkdir -p " .. dir .. " && cp " .. H.q(H.TEXTMODEL) .. "/* " .. dir) == 0)
        local f = assert(io.open(dir .. "/config.json"))
        local config = f:read("*a"):gsub('"max_seq_len": 128', '"max_seq_len": 16777216')
        f:close()
        f = assert(io.open(dir .. "/config.json", "w"))
        f:write(config)
        f:close()
        local ok, out = H.run_child(([[
            local H = require "helpers"
            local m = assert(H.tinyloop.load(%q, { threads = 1 }))
            local cfg = { max_tokens = 16000000 }
            local function show(name, ...) print(name, select("#", ...), tostring((select(1, ...))), tostring((select(2, ...)))) end
            show("generate", m:generate({ 1, 2, 3 }, cfg))
            show("session", m:session({ 1, 2, 3 }, cfg))
            show("stream", m:stream({ 1, 2, 3 }, cfg))
            show("batch", m:generate_batch({ { 1, 2 }, { 3 } }, cfg))
            show("speculative", m:generate_speculative({ 1, 2, 3 }, { max_tokens = 16000000, verify_loops = 4 }))
            -- the model still works
            print("after", #m:generate({ 1, 2, 3 }, { max_tokens = 4 }))
        ]]):format(dir), "ulimit -v 300000;")
        os.execute("rm -rf " .. dir)
        assert.is_true(ok, out)
        for _, name in ipairs({ "generate", "session", "stream", "batch", "speculative" }) do
            assert.truthy(out:find(name .. "\t2\tnil\t[^\n]*out of memory"), name .. " in:\n" .. out)
        end
        assert.truthy(out:find("after\t7"), out)
    end)

    it("tinyloop.load returns nil, err for a checkpoint it cannot load", function()
        local model, err = H.tinyloop.load(H.ROOT .. "/tests/data/no-such-model")
        assert.is_nil(model)
        assert.truthy(err:find("no-such-model", 1, true))
    end)
end)

describe("stop reasons", function()
    it("are the engine's names (tl_stop_reason_name), false while generating", function()
        local s = m:session({ 1, 2 }, { max_tokens = 2 })
        local _, _, reason = s:step()
        assert.is_false(reason)
        assert.is_nil(s:stats().stop_reason)
        _, _, reason = s:step()
        assert.equal(ffi.string(C.tl_stop_reason_name(C.TL_STOP_MAX_TOKENS)), reason)
        assert.equal(reason, s:stats().stop_reason)
    end)
end)

describe("tinyloop.policy constructors", function()
    local cases = {
        { "stop_strings", function() return policy.stop_strings({}) end },
        { "strings[2]", function() return policy.stop_strings({ "a", 5 }) end },
        { "pattern", function() return policy.pattern(5) end },
        { "max_wall_time", function() return policy.max_wall_time(-1) end },
        { "unknown option 'time'", function() return policy.repetition({ time = 3 }) end },
        { "times must be an integer >= 2", function() return policy.repetition({ times = 1 }) end },
        { "rule 2 is a number", function() return policy.any(function() end, 5) end },
        { "ids[2] = x", function() return policy.ban_tokens({ 1, "x" }) end },
        { "key a is not a token id", function() return policy.logit_bias({ a = 1 }) end },
        { "bias[3] must be a number", function() return policy.logit_bias({ [3] = "1" }) end },
        { "no_repeat_ngram", function() return policy.no_repeat_ngram(0) end },
        { "min_new", function() return policy.min_tokens(-1, 3) end },
        { "eos_id", function() return policy.min_tokens(1, nil) end },
        -- (-1 was taken, and logits[-1] written below the engine's buffer: a heap abort)
        { "min_tokens: eos_id must be a token id (an integer >= 0)", function() return policy.min_tokens(5, -1) end },
        { "processor 1 is a table", function() return policy.chain({}) end },
        { "vocab_size", function() return policy.mask(0) end },
        { "mask:ban", function() return policy.mask(4):ban({ 1.5 }) end },
        { "mask:allow_only", function() return policy.mask(4):allow_only(3) end },
        -- a malformed pattern at the constructor, not at a token; lists with holes (read as
        -- far as the first: 44 was not banned), a NaN bias (the config field refuses it)
        { "pattern: malformed pattern (missing ']')", function() return policy.pattern("[") end },
        -- (faults past a first character: a check against "" passed them, a token reached them)
        { "pattern: malformed pattern (ends with '%')", function() return policy.pattern("a%") end },
        { "pattern: malformed pattern (unfinished capture)", function() return policy.pattern("x(") end },
        { "pattern: malformed pattern (missing arguments to '%b')", function() return policy.pattern("x%b") end },
        { "pattern: malformed pattern (invalid capture index %1)", function() return policy.pattern("x(%1)") end },
        { "ban_tokens: ids must be a list (1..n, no holes)", function() return policy.ban_tokens({ 1, nil, 44 }) end },
        { "stop_strings: strings must be a list (1..n, no holes)", function() return policy.stop_strings({ "zz", nil, "," }) end },
        { "mask:allow_only: ids must be a list (1..n, no holes)", function() return policy.mask(64):allow_only({ 4, nil, 3 }) end },
        { "bias[3] must be a number (not NaN)", function() return policy.logit_bias({ [3] = 0 / 0 }) end },
    }
    for _, case in ipairs(cases) do
        it("raise at the caller's line for bad arguments (" .. case[1] .. ")", function()
            local err = raised({ "tinyloop.policy.", case[1] }, function() local r = case[2]() return r end)
            assert.truthy(err:find("conventions_spec.lua:%d+:"), err)
        end)
    end
end)

describe("modules", function()
    it("assign no global (a local declared below its first use becomes one: a handler then finds nil)", function()
        local files = H.sh("ls " .. H.q(H.ROOT) .. "/lua/tinyloop/*.lua " .. H.q(H.ROOT) .. "/lua/tinyloop/server/*.lua")
        local checked = 0
        for path in files:gmatch("[^\n]+") do
            local listing = H.sh("luajit -bl " .. path .. " 2>&1")
            assert.truthy(listing:find("KSHORT", 1, true) or listing:find("KSTR", 1, true), path .. ": no bytecode listing")
            local set = listing:match("GSET[^\n]*")
            assert.is_nil(set, path .. " assigns a global: " .. tostring(set))
            checked = checked + 1
        end
        assert.is_true(checked >= 20)
    end)
end)

describe("under a Lua without the FFI", function()
    -- PUC Lua (/usr/bin/lua, which /usr/bin/busted's shebang names) has no `ffi` module.
    local function puc_lua()
        for _, name in ipairs({ "lua", "lua5.4", "lua5.3", "lua5.2", "lua5.1" }) do
            local version = H.sh("command -v " .. name .. " >/dev/null 2>&1 && " .. name .. " -v 2>&1")
            if version:find("^Lua 5") then return name end
        end
    end

    it("each module a user requires first says it needs LuaJIT", function()
        local lua = puc_lua()
        if not lua then return pending("no PUC Lua interpreter on this machine") end
        for _, module in ipairs({ "tinyloop", "tinyloop.policy", "tinyloop.grammar", "tinyloop.chat",
                                  "tinyloop.tools", "tinyloop.server" }) do
            local code = "package.path = 'lua/?.lua;lua/?/init.lua;' .. package.path; " ..
                         "local ok, err = pcall(require, '" .. module .. "'); io.write(tostring(ok), ' ', tostring(err))"
            local out = H.sh("cd " .. H.q(H.ROOT) .. " && " .. lua .. " -e " .. H.q(code) .. " 2>&1")
            assert.truthy(out:find("^false tinyloop needs LuaJIT"), module .. " under " .. lua .. ": " .. out)
            assert.truthy(out:find("run it with luajit", 1, true), out)
        end
    end)
end)

describe("the helpers behind the convention (tinyloop.ordered, tinyloop.raise, tinyloop.script_options)", function()
    it("ordered.pairs walks numbers, then strings, then other kinds by type name, each in its own order", function()
        local ordered = require "tinyloop.ordered"
        local keys = {}
        for k in ordered.pairs({ 10, 20, a = 1, b = 2, [0.5] = 3 }) do keys[#keys + 1] = k end
        assert.same({ 0.5, 1, 2, "a", "b" }, keys)
        for _ = 1, 50 do -- (booleans, functions and tables: grouped by their type's name in every walk)
            local t = { [true] = 1, [false] = 2 }
            for j = 1, 3 do t[{}], t[function() end] = j, j end
            local kinds = {}
            for k in ordered.pairs(t) do kinds[#kinds + 1] = type(k):sub(1, 1) end
            assert.equal("bbfffttt", table.concat(kinds))
        end
    end)

    it("raise.list_length refuses a list with a hole that # passes over, a fractional key beside it", function()
        local raise = require "tinyloop.raise"
        local list = { "s1", "s2", "s3", "s4" }
        list[2], list[2.5] = nil, "b"
        assert.equal(4, #list) -- (# ends past the hole: four keys in all)
        assert.has_error(function() raise.list_length(list, "strings", error) end, "strings must be a list (1..n, no holes)")
        assert.equal(3, raise.list_length({ "a", "b", "c" }, "strings", error))
    end)

    it("script_options refuses an option given last without its value: usage, exit status 2", function()
        local script = "package.path = 'lua/?.lua;lua/?/init.lua;' .. package.path; " ..
            "local so = require 'tinyloop.script_options'; " ..
            "local opt = so.parse({ '--out' }, { name = 'x.lua', summary = 's', { 'out', 'build/x', 'output directory' } }); " ..
            "print('parsed', opt.out)"
        local out = H.sh("cd " .. H.q(H.ROOT) .. " && luajit -e " .. H.q(script) .. " 2>&1; echo status=$?")
        assert.truthy(out:find("option --out needs a value", 1, true), out)
        assert.truthy(out:find("status=2", 1, true), out)
        assert.falsy(out:find("parsed", 1, true), out)
    end)
end)

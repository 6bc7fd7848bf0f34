-- robustness_spec.lua: the Lua findings of the hostile-user probe (issue 11). Every number
-- is checked as an integer (or seed) in range with the field named, stop strings with a NUL
-- are refused, a model can be closed while its sessions live, and messages say what is wrong.
local H = require "helpers"
local tinyloop = H.tinyloop

local m = H.model()

local function raises(needle, f, ...)
    local ok, err = pcall(f, ...)
    assert.is_false(ok, "expected an error containing '" .. needle .. "'")
    assert.truthy(tostring(err):find(needle, 1, true), "error '" .. tostring(err) .. "' lacks '" .. needle .. "'")
end

local function gen(cfg, prompt)
    return function() return m:generate(prompt or { 1, 2, 3 }, cfg) end
end

describe("numbers are never converted silently (finding 10)", function()
    it("integer config fields refuse fractions and values beyond a C int, naming the field", function()
        raises("config field 'max_tokens' = 3.7 must be an integer", gen({ max_tokens = 3.7 }))
        raises("config field 'loops' = 1.9 must be an integer", gen({ loops = 1.9 }))
        raises("config field 'max_tokens' = 10000000000 must be an integer in [-2147483648, 2147483647]",
               gen({ max_tokens = 1e10 }))
        raises("config field 'top_k' = -10000000000", gen({ top_k = -1e10 }))
        raises("config field 'beam_size' = nan", gen({ beam_size = 0 / 0 }))
        raises("config field 'cache_window' = inf", gen({ cache_window = math.huge }))
        raises("config field 'draft_ahead' = 2.5", gen({ speculative = "chain", loops = 4, draft_loops = 1, draft_ahead = 2.5 }))
    end)

    it("sample_seed is an integer in [0, 2^53] or a uint64_t: -1, -2, NaN and 2^64 are errors, not one seed", function()
        for _, bad in ipairs({ -1, -2, 0 / 0, 2 ^ 64, 1.5 }) do
            raises("config field 'sample_seed' = " .. tostring(bad) .. " must be an integer in [0, 2^53]",
                   gen({ sample_seed = bad, temperature = 1 }))
        end
        raises("config field 'seed' = -1", function()
            return m:generate_speculative({ 1, 2 }, { seed = -1, verify_loops = 4, draft_loops = 1 })
        end)
        assert.is_table(gen({ sample_seed = 2 ^ 53, temperature = 1, max_tokens = 2 })())
        -- past 2^53: a 64-bit integer (cdata), the same seed as the number where both exist
        local function sampled(seed)
            return m:generate({ 1, 2 }, { sample_seed = seed, temperature = 1.5, max_tokens = 30, ignore_eos = true })
        end
        assert.same(sampled(5), sampled(5ULL))
        assert.same(sampled(2 ^ 53), sampled(2ULL ^ 53))
        assert.same(sampled(0xFFFFFFFFFFFFFFFFULL), sampled(0xFFFFFFFFFFFFFFFFULL))
        assert.are_not.same(sampled(0xFFFFFFFFFFFFFFFFULL), sampled(0xFFFFFFFFFFFFFFFEULL))
        raises("config field 'sample_seed' = -1LL must not be negative", gen({ sample_seed = -1LL, temperature = 1 }))
        raises("config field 'sample_seed' must be a number", gen({ sample_seed = require("ffi").new("int[1]"), temperature = 1 }))
    end)

    it("prompt and decode ids must be integers, named by index", function()
        raises("token id 1.5 at index 2 must be an integer", gen({}, { 1, 1.5 }))
        raises("token id 10000000000 at index 1 must be an integer", gen({}, { 1e10 }))
        raises("token id 1.5 at index 1", function() return m:decode({ 1.5 }) end)
        raises("token id 2.5 at index 3", function() return m:score({ 1, 2, 2.5 }) end)
        raises("token id 0.5 at index 1", function() return m:session({ 0.5 }) end)
        raises("token id 0.5 at index 1", function() return m:generate_batch({ { 1 }, { 0.5 } }) end)
    end)

    it("score's loops, stop sequence ids and load options are integers", function()
        raises("score: loops = 1.5 must be an integer", function() return m:score({ 1, 2 }, 1.5) end)
        raises("stop_sequences[1][2] = 1.5 must be an integer", gen({ stop_sequences = { { 1, 1.5 } } }))
        raises("load option 'threads' = 1.5 must be an integer", function() return tinyloop.load(H.TEXTMODEL, { threads = 1.5 }) end)
        local scores = assert(m:score({ 1, 2 }))
        raises("scores:logit: token id = 1.5 must be an integer", function() return scores:logit(1, 1.5) end)
    end)

    it("a grammar.allowed count that is not a count is an error saying what it was", function()
        for _, bad in ipairs({ 1e20, 2.5, 0 / 0 }) do
            raises(("grammar.allowed returned %s: must be the count of allowed tokens"):format(tostring(bad)),
                   gen({ grammar = { allowed = function(_, mask) mask[5] = 1 return bad end, advance = function() end } }))
        end
        -- the model stays usable
        assert.equal(6, #gen({ max_tokens = 3, ignore_eos = true })())
    end)
end)

describe("output buffers are sized after validation (finding 5)", function()
    it("beam, speculative and plain refuse a huge max_tokens by name, quickly", function()
        for _, n in ipairs({ 3e8, 2e9 }) do
            for _, cfg in ipairs({ { beam_size = 2 }, { speculative = "chain", loops = 4, draft_loops = 1 }, {} }) do
                cfg.max_tokens = n
                local t0 = os.clock()
                raises("max_seq_len", gen(cfg))
                assert.is_true(os.clock() - t0 < 0.1, "no huge allocation")
            end
            local t0 = os.clock()
            raises("max_tokens = " .. ("%d"):format(n), function()
                return m:generate_speculative({ 1 }, { max_tokens = n, verify_loops = 4, draft_loops = 1 })
            end)
            assert.is_true(os.clock() - t0 < 0.1, "no huge allocation")
        end
    end)
end)

describe("stop strings with a NUL byte (finding 11)", function()
    it("are refused naming the index and the byte, instead of stopping at the part before it", function()
        raises("stop_strings[2] contains a NUL byte (at byte 2)", gen({ stop_strings = { "zz", "e\0zzz" } }))
        raises("stop_strings[1] contains a NUL byte (at byte 1)", function() return m:session({ 1 }, { stop_strings = { "\0" } }) end)
    end)
end)

describe("Model:close (finding 12)", function()
    it("is idempotent, and every method raises afterwards naming it", function()
        local g = assert(tinyloop.load(H.TEXTMODEL, { threads = 1 }))
        g:close()
        g:close()
        for _, call in ipairs({
            { "generate", function() return g:generate({ 1 }) end },
            { "session", function() return g:session({ 1 }) end },
            { "stream", function() return g:stream({ 1 }) end },
            { "encode", function() return g:encode("a") end },
            { "decode", function() return g:decode({ 1 }) end },
            { "score", function() return g:score({ 1 }) end },
            { "info", function() return g:info() end },
            { "memory", function() return g:memory() end },
            { "generate_batch", function() return g:generate_batch({ { 1 } }) end },
            { "generate_speculative", function() return g:generate_speculative({ 1 }) end },
        }) do
            raises("model:" .. call[1] .. "(): the model is closed", call[2])
        end
    end)

    it("keeps the C model alive through a speculative call whose hook closes the Model", function()
        -- (the blocking speculative decoders run on the model with no session holding it: the
        -- close freed the weights under the call; ASan and valgrind saw it, and it crashed)
        for _, method in ipairs({ "generate_speculative", "generate_tree_speculative" }) do
            local g = assert(tinyloop.load(H.TEXTMODEL, { threads = 1 }))
            local cfg = { max_tokens = 8, draft_loops = 1, verify_loops = 2, ignore_eos = true }
            local want = assert(g[method](g, { 1, 2, 3 }, cfg))
            local closes = 0
            cfg.on_token = function()
                if closes == 0 then g:close() end
                closes = closes + 1
            end
            assert.same(want, assert(g[method](g, { 1, 2, 3 }, cfg)))
            assert.equal(8, closes)
            raises("model:" .. method .. "(): the model is closed", function() return g[method](g, { 1 }) end)
        end
    end)

    it("keeps the C model alive for sessions still open (no use after free)", function()
        local g = assert(tinyloop.load(H.TEXTMODEL, { threads = 1 }))
        local want = g:generate("It is", { max_tokens = 6, ignore_eos = true })
        local s = assert(g:session("It is", { max_tokens = 6, ignore_eos = true,
                                              on_token = function() end, stop_when = function() end }))
        local s2 = assert(g:session("It is", { max_tokens = 6, ignore_eos = true }))
        s:step()
        g:close()
        repeat local id, _, reason = s:step() assert.is_true(id >= 0) until reason
        assert.same(want, s:tokens())
        s:close()
        s2 = nil
        collectgarbage() collectgarbage() -- s2's finalizer frees the model now
    end)

    it("frees the model whatever order the collector finalizes it and its sessions in", function()
        local ok, out = H.run_child([[
            local H = require "helpers"
            for i = 1, 30 do
                local g = assert(H.tinyloop.load(H.TEXTMODEL, { threads = 1 }))
                local s = g:session("It is", { max_tokens = 4, on_token = function() end })
                s:step()
                if i % 2 == 0 then g:close() end
                g, s = nil, nil
                collectgarbage()
            end
            collectgarbage() collectgarbage()
            print("DONE")
        ]])
        assert.is_true(ok and out:find("DONE", 1, true) ~= nil, "child crashed:\n" .. out)
    end)

    it("keeps the C model alive for saved states (their KV pages are the model's)", function()
        local g = assert(tinyloop.load(H.TEXTMODEL, { threads = 1 }))
        local s = assert(g:session("It is", { max_tokens = 6, ignore_eos = true }))
        s:step()
        local state = assert(s:save())
        s:close()
        local refs = g.handle.refs
        local bytes = assert(state:bytes())
        g:close()
        assert.equal(refs - 1, g.handle.refs) -- the state's reference alone holds the C model
        assert.equal(bytes, state:bytes())
        state:close()
        state:close()
        assert.is_nil(g.handle.raw) -- the last reference gone: the model is freed
        raises("state:bytes(): the state is closed", function() return state:bytes() end)
        raises("state:write(): the state is closed", function() return state:write("/tmp/x") end)
        local other = H.model()
        raises("model:resume(): the state is closed", function() return other:resume(state) end)
    end)

    it("a detached session gives up its hold on the C model, and is refused on a closed one", function()
        local g = assert(tinyloop.load(H.TEXTMODEL, { threads = 1 }))
        local refs = g.handle.refs
        local s = assert(g:session("It is", { max_tokens = 4 }))
        assert.equal(refs + 1, g.handle.refs)
        local ptr = s:detach() -- C's now: no Lua object holds the model for it (it held it for good)
        assert.equal(refs, g.handle.refs)
        -- stepping it from Lua says why it cannot (it said "finished (nil)")
        raises("detached by session:detach()", function() return s:step() end)
        raises("sessions[1] has already finished (detached by session:detach()", function() return g:step_batch({ s }) end)
        tinyloop.C.tl_session_free(ptr)
        local kept = assert(g:session("It is", { max_tokens = 4 }))
        g:close() -- the session alone keeps the model alive: detaching it would leave it to C
        raises("session:detach(): the model is closed", function() return kept:detach() end)
        -- another object is refused (a saved state was "detached": leaked, the model's count taken)
        local h = assert(tinyloop.load(H.TEXTMODEL, { threads = 1 }))
        local live = assert(h:session("It is", { max_tokens = 4 }))
        live:step()
        local state = live:save()
        local held = h.handle.refs
        raises("session:detach() needs its own object", function() return getmetatable(live).detach(state) end)
        -- a model's method given another object says so (it said "attempt to call method 'session'")
        raises("model:generate() needs its own object", function() return getmetatable(h).generate(live, "It is") end)
        raises("model:info() needs its own object", function() return getmetatable(h).info({}) end)
        assert.equal(held, h.handle.refs)
        assert.is_table({ h:resume(state) })
        state:close()
        live:close()
        h:close()
        kept:close()
        assert.is_nil(g.handle.raw) -- the last reference gone: the model is freed
    end)

    it("frees the model whatever order the collector finalizes it and its saved states in", function()
        local ok, out = H.run_child([[
            local H = require "helpers"
            for i = 1, 30 do
                local g = assert(H.tinyloop.load(H.TEXTMODEL, { threads = 1 }))
                local s = g:session("It is", { max_tokens = 4 })
                s:step()
                local state = s:save()
                if i % 3 == 0 then state = g:state_from_bytes(state:bytes()) end
                if i % 2 == 0 then g:close() end
                g, s, state = nil, nil, nil
                collectgarbage()
            end
            collectgarbage() collectgarbage()
            print("DONE")
        ]])
        assert.is_true(ok and out:find("DONE", 1, true) ~= nil, "child crashed:\n" .. out)
    end)

    it("lets a program load and close 200 models without the memory growing #rss", function()
        local function rss_kb()
            local f = io.open("/proc/self/status")
            if not f then return 0 end
            local kb = tonumber(f:read("*a"):match("VmRSS:%s*(%d+)"))
            f:close()
            return kb
        end
        for _ = 1, 20 do assert(tinyloop.load(H.TEXTMODEL, { threads = 1 })):close() end
        local before = rss_kb()
        for _ = 1, 200 do assert(tinyloop.load(H.TEXTMODEL, { threads = 1 })):close() end
        assert.is_true(rss_kb() - before < 20000, ("RSS grew by %d kB"):format(rss_kb() - before))
    end)
end)

describe("messages (finding 13)", function()
    it("stepping a closed session says so", function()
        local s = assert(m:session({ 1, 2 }, { max_tokens = 3 }))
        s:close()
        raises("session:step(): the session is closed", function() return s:step() end)
    end)
end)

describe("config.json warnings (finding 14)", function()
    local function checkpoint_with(extra)
        local dir = os.tmpname()
        os.remove(dir)
        assert(os.execute("mkdir -p " .. dir .. " && cp " .. H.q(H.TEXTMODEL .. "/model.safetensors") .. " " .. H.q(H.TEXTMODEL .. "/tokenizer.json") .. " " .. dir))
        local f = assert(io.open(H.TEXTMODEL .. "/config.json"))
        local text = f:read("*a"):gsub("^%s*{", "{" .. extra .. ",", 1)
        f:close()
        f = assert(io.open(dir .. "/config.json", "w"))
        f:write(text)
        f:close()
        return dir
    end

    it("a misspelt field loads with a warning suggesting the field, which the CLI prints", function()
        local dir = checkpoint_with('"rope_theeta": 500000')
        local g = assert(tinyloop.load(dir, { threads = 1 }))
        assert.same({ 'config.json: unknown field "rope_theeta" ignored (did you mean "rope_theta"?)' }, g.warnings)
        g:close()
        local p = io.popen("cd " .. H.q(H.ROOT) .. " && luajit scripts/tinyloop -m " .. dir .. " -n 2 'It' 2>&1 >/dev/null")
        local err = p:read("*a")
        p:close()
        assert.truthy(err:find('tinyloop: warning: config.json: unknown field "rope_theeta"', 1, true), err)
        os.execute("rm -rf " .. dir)
        assert.same({}, m.warnings)
    end)

    it("a duplicate key is a load error", function()
        local dir = checkpoint_with('"d_model": 7')
        local g, err = tinyloop.load(dir)
        assert.is_nil(g)
        assert.truthy(err:find('duplicate key "d_model"', 1, true), err)
        os.execute("rm -rf " .. dir)
    end)
end)

-- modes_spec.lua: every decoder is a session mode (SPEC §8). The Lua stream of each mode
-- (plain, speculative chain and tree, beam) gives exactly the tokens of the engine's blocking
-- calls; greedy plain, chain and tree agree token for token and hook for hook; the streamed
-- text is the decoded output. And a hook may not close or step its own session.
local H = require "helpers"

-- Streams a prompt to its end: ids (prompt + continuation), concatenated text, stats, and the
-- tokens the on_token hook saw.
local function stream_all(m, prompt, cfg)
    local seen = {}
    local c = {}
    for k, v in pairs(cfg) do c[k] = v end
    c.on_token = function(id) seen[#seen + 1] = id end
    local iterate, session = m:stream(prompt, c)
    assert.is_function(iterate, session)
    local pieces = {}
    for _, text in iterate, session do pieces[#pieces + 1] = text end
    return session:tokens(), table.concat(pieces), session.final_stats, seen
end

-- The engine's blocking call for the same mode: tl_generate_batch (through generate_batch),
-- and for the speculative modes also tl_generate_speculative / _tree_speculative.
local function blocking(m, prompt, cfg)
    local outs, stats = assert(m:generate_batch({ prompt }, cfg))
    return outs[1], stats[1]
end

local function spec_blocking(m, prompt, cfg)
    local c = {}
    for k, v in pairs(cfg) do if k ~= "speculative" and k ~= "loops" then c[k] = v end end
    c.verify_loops = cfg.loops
    if cfg.speculative == "chain" then c.K_branches, c.max_nodes = nil, nil end
    local call = cfg.speculative == "chain" and m.generate_speculative or m.generate_tree_speculative
    return assert(call(m, prompt, c))
end

local MODES = {
    { name = "plain" },
    { name = "chain", speculative = "chain", draft_loops = 1, draft_ahead = 4 },
    { name = "tree", speculative = "tree", draft_loops = 2, draft_ahead = 3, K_branches = 3, max_nodes = 24 },
    { name = "beam", beam_size = 3 },
}

local function with_mode(base, mode)
    local c = {}
    for k, v in pairs(base) do c[k] = v end
    for k, v in pairs(mode) do if k ~= "name" then c[k] = v end end
    return c
end

describe("decoding modes as sessions", function()
    local texts = {
        "It is a truth universally acknowledged, that a single man",
        "Mr. Bennet was so odd a mixture of quick parts",
        "Emma Woodhouse, handsome, clever, and rich,",
    }

    it("stream every mode exactly as the blocking calls decode it", function()
        local m = H.model()
        for p, text in ipairs(texts) do
            local prompt = m:encode(text)
            local base = { max_tokens = 24, loops = 4, ignore_eos = p % 2 == 1 }
            local plain_ids, plain_text, _, plain_seen
            for _, mode in ipairs(MODES) do
                local cfg = with_mode(base, mode)
                local ids, streamed, stats, seen = stream_all(m, prompt, cfg)
                local want, want_stats = blocking(m, prompt, cfg)
                assert.same(want, ids, mode.name .. " prompt " .. p)
                assert.equal(want_stats.stop_reason, stats.stop_reason)
                assert.same(H.slice(ids, #prompt + 1), seen)
                assert.equal(m:decode(H.without(H.slice(ids, #prompt + 1), H.EOS)), streamed)
                if mode.speculative then
                    local spec_ids, spec_stats = spec_blocking(m, prompt, cfg)
                    assert.same(spec_ids, ids, mode.name .. " blocking speculative call")
                    assert.equal(spec_stats.accepted, stats.accepted)
                    assert.is_true(stats.verify_steps > 0 and stats.accepted <= stats.drafted)
                end
                if mode.name == "plain" then
                    plain_ids, plain_text, plain_seen = ids, streamed, seen
                elseif mode.name ~= "beam" then -- greedy chain and tree are plain decoding
                    assert.same(plain_ids, ids, mode.name .. " vs plain, prompt " .. p)
                    assert.equal(plain_text, streamed)
                    assert.same(plain_seen, seen)
                end
            end
        end
    end)

    it("stop strings and stop rules fire at the same token in plain, chain and tree", function()
        local m = H.model()
        local prompt = m:encode(texts[1])
        local plain = m:generate(prompt, { max_tokens = 40, loops = 4, ignore_eos = true })
        -- a stop string that first completes inside the continuation
        local continuation = m:decode(H.slice(plain, #prompt + 1, #prompt + 12))
        local stop = continuation:sub(-3)
        for _, mode in ipairs({ MODES[1], MODES[2], MODES[3] }) do
            local rule_calls = 0
            local cfg = with_mode({ max_tokens = 40, loops = 4, ignore_eos = true, stop_strings = { stop },
                                    stop_when = function() rule_calls = rule_calls + 1 return false end }, mode)
            local ids, _, stats = stream_all(m, prompt, cfg)
            assert.equal("STOP_SEQUENCE", stats.stop_reason, mode.name)
            assert.is_truthy(m:decode(H.slice(ids, #prompt + 1)):find(stop, 1, true))
            if mode.name == "plain" then
                plain = ids
            else
                assert.same(plain, ids, mode.name)
            end
            assert.equal(#ids - #prompt - 1, rule_calls) -- the stop rule ran on every earlier token
        end
    end)

    it("takes the speculative fields in the same table, and checks them", function()
        local m = H.model()
        H.error_contains(function() m:session("Hi", { speculative = "fast" }) end,
                         "config field 'speculative' must be \"chain\" or \"tree\"")
        H.error_contains(function() m:session("Hi", { draft_loops = 1 }) end,
                         "config field 'draft_loops' needs speculative = \"chain\" or \"tree\"")
        H.error_contains(function() m:session("Hi", { speculative = "chain", loops = 4, verify_loops = 3 }) end,
                         "config fields 'loops' and 'verify_loops' disagree")
        H.error_contains(function() m:session("Hi", { speculative = "chain", loops = 4, draft_loops = 4 }) end,
                         "draft_loops = 4 must be in [1, verify_loops = 4)")
        H.error_contains(function() m:session("Hi", { speculative = "tree", loops = 4, temperature = 0.5 }) end,
                         "tree speculative sampling is not implemented")
        H.error_contains(function() m:session("Hi", { beam_size = 2, stop_strings = { "x" } }) end,
                         "beam search (beam_size = 2) does not support stop strings yet")
        local s = assert(m:session("Hi", { speculative = "chain", verify_loops = 4, draft_loops = 1, max_tokens = 3 }))
        local n = 0
        repeat local _, _, reason = s:step() n = n + 1 until reason
        assert.equal(3, n)
        assert.equal(3, s:stats().tokens_emitted)
    end)
end)

describe("a hook and its own session", function()
    local m = H.model()

    it("cannot close it while it steps (no use after free), nor step it", function()
        for _, extra in ipairs({ {}, { speculative = "chain", loops = 4, draft_loops = 1 }, { beam_size = 2 } }) do
            for _, hook in ipairs({ "on_token", "logits_processor" }) do
                local s
                local cfg = { max_tokens = 5 }
                for k, v in pairs(extra) do cfg[k] = v end
                cfg[hook] = function() s:close() end
                s = assert(m:session("Hi", cfg))
                H.error_contains(function() s:step() end,
                                 "session:close() from inside one of its own hooks: close it after the step returns")
                assert.is_true(s.done)
                s:close() -- afterwards it can be closed
                cfg[hook] = function() s:step() end
                s = assert(m:session("Hi", cfg))
                H.error_contains(function() s:step() end, "the session is already stepping")
            end
        end
        -- the same through model:stream, and the next call works
        local s
        local iterate
        iterate, s = m:stream("Hi", { max_tokens = 5, on_token = function() s:close() end })
        H.error_contains(function() for _ in iterate, s do end end, "close it after the step returns")
        local ids = assert(m:generate("Hi", { max_tokens = 3 }))
        assert.equal(#m:encode("Hi") + 3, #ids)
    end)
end)

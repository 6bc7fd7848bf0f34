-- depth_policy_spec.lua: the per-loop depth hook and the exit criteria from Lua.
--   cfg.depth_policy(loop, signals) -> exit?  after each loop of a decode token but the last;
--   signals: loop, loops, position, state_change, gate / exit_probability (exit-gate models),
--   probed, argmax / entropy / kl / entropy_change (after a probe), criterion_exit.
--   cfg.early_exit_criterion = "hidden_state" | "latent_diff" | "kl" | "entropy_diff" | "argmax" | "gate"
local H = require "helpers"

local m = H.model("deep_residual")
local P = { 4, 8, 15, 16, 23 }
local L = 8

local function exit_at(k)
    return function(loop) return loop == k end
end

describe("depth_policy", function()
    it("decides each decode token's depth in generate, stream and session", function()
        local cfg = { loops = L, max_tokens = 6, ignore_eos = true, depth_policy = exit_at(3) }
        local out, stats = m:generate(P, cfg)
        assert.equal(5, stats.depth_histogram[3]) -- the first token comes from the prefill, at L
        assert.equal(1, stats.depth_histogram[L])
        local streamed = {}
        for id in m:stream(P, cfg) do streamed[#streamed + 1] = id end
        assert.same(H.slice(out, #P + 1, #out), streamed)
        local s = m:session(P, cfg)
        local stepped = {}
        while true do
            local id, _, stop = s:step()
            if id then stepped[#stepped + 1] = id end
            if stop then break end
        end
        assert.same(streamed, stepped)
    end)

    it("is called after loops 1 .. loops-1 with the loop's signals", function()
        local seen = {}
        local out, stats = m:generate(P, {
            loops = L, max_tokens = 3, ignore_eos = true, early_exit_min_L = 2, early_exit_peek_every = 2,
            depth_policy = function(loop, sig)
                seen[#seen + 1] = { loop = loop, probed = sig.probed, kl = sig.kl, entropy = sig.entropy,
                                    argmax = sig.argmax, change = sig.state_change, loops = sig.loops,
                                    gate = sig.gate, position = sig.position }
            end,
        })
        assert.equal(2 * (L - 1), #seen) -- two decoded tokens, loops 1..7 each
        assert.equal(3, stats.depth_histogram[L]) -- never exiting: every token at full depth
        for i, s in ipairs(seen) do
            assert.equal((i - 1) % (L - 1) + 1, s.loop)
            assert.equal(L, s.loops)
            assert.is_nil(s.gate) -- no exit gate in this model
            assert.is_true(s.change >= 0)
            local probe_loop = s.loop >= 2 and s.loop % 2 == 0
            assert.equal(probe_loop, s.probed)
            if probe_loop then
                assert.is_true(s.entropy >= 0 and s.argmax >= 0)
                assert.equal(s.loop > 2, s.kl ~= nil) -- KL from the second probe on
            else
                assert.is_nil(s.entropy)
                assert.is_nil(s.argmax)
            end
        end
        assert.equal(#P, seen[1].position)
        assert.same(m:generate(P, { loops = L, max_tokens = 3, ignore_eos = true }), out)
    end)

    it("sweeps: a rule of the caller's over the signals is deterministic", function()
        local rule = function(_, sig) return sig.probed and sig.kl ~= nil and sig.kl < 0.5 end
        local cfg = { loops = L, max_tokens = 8, ignore_eos = true, early_exit_min_L = 1, depth_policy = rule }
        local a, sa = m:generate(P, cfg)
        local b, sb = m:generate(P, cfg)
        assert.same(a, b)
        assert.same(sa.depth_histogram, sb.depth_histogram)
        assert.is_true(sa.loops_used < L)
    end)

    it("sees criterion_exit: following it decodes as the criterion alone", function()
        local base = { loops = L, max_tokens = 8, ignore_eos = true, early_exit_patience = 1,
                       early_exit_criterion = "argmax", early_exit_min_L = 1 }
        local plain, ps = m:generate(P, base)
        base.depth_policy = function(_, sig) return sig.criterion_exit end
        local hooked, hs = m:generate(P, base)
        assert.same(plain, hooked)
        assert.same(ps.depth_histogram, hs.depth_histogram)
        assert.is_true(ps.loops_used < L)
    end)

    it("a Lua error stops generation with the error; the next call works", function()
        local ok, err = pcall(m.generate, m, P, { loops = L, max_tokens = 4, depth_policy = function(loop)
            if loop == 2 then error("policy broke") end
        end })
        assert.is_false(ok)
        assert.matches("policy broke", err)
        local _, stats = m:generate(P, { loops = L, max_tokens = 4, depth_policy = exit_at(2) })
        assert.is_true(stats.loops_used < L)
    end)

    it("must be a function, and is refused with speculative decoding and beam search", function()
        assert.has_error(function() m:generate(P, { depth_policy = 3 }) end, "config field 'depth_policy' must be a function")
        local ok, err = pcall(m.generate, m, P, { loops = 4, max_tokens = 2, speculative = "chain", depth_policy = exit_at(2) })
        assert.is_false(ok)
        assert.matches("depth_policy", err)
        ok, err = pcall(m.generate, m, P, { max_tokens = 2, beam_size = 2, depth_policy = exit_at(2) })
        assert.is_false(ok)
        assert.matches("early exit", err)
    end)

    it("carries over to a fork, or is replaced there", function()
        local calls = 0
        local s = m:session(P, { loops = L, max_tokens = 6, ignore_eos = true,
                                 depth_policy = function() calls = calls + 1 end })
        s:step()
        s:step()
        local before = calls
        local child = assert(s:fork({ depth_policy = exit_at(2) }))
        child:step()
        assert.equal(before, calls) -- the child's own policy ran, not the parent's
        assert.equal(1, child:stats().depth_histogram[2])
    end)
end)

describe("early_exit_criterion", function()
    it("accepts each name and refuses others", function()
        for _, name in ipairs({ "hidden_state", "latent_diff", "kl", "entropy_diff", "argmax" }) do
            local _, stats = m:generate(P, { loops = L, max_tokens = 3, early_exit_patience = 1,
                                             early_exit_criterion = name, early_exit_threshold = 1e9,
                                             early_exit_kl_threshold = 1e9, early_exit_entropy_threshold = 1e9 })
            assert.is_true(stats.loops_used < L, name)
        end
        assert.has_error(function() m:generate(P, { early_exit_criterion = "entropy" }) end)
        assert.has_error(function() m:generate(P, { early_exit_criterion = 2 }) end)
        local ok, err = pcall(m.generate, m, P, { max_tokens = 2, early_exit_criterion = "gate" })
        assert.is_false(ok)
        assert.matches("exit gate", err)
        ok, err = pcall(m.generate, m, P, { max_tokens = 2, early_exit_kl_threshold = -1 })
        assert.is_false(ok)
        assert.matches("early_exit_kl_threshold = %-1", err)
    end)

    it("gate: Ouro's exit probabilities reach the hook and end the loop", function()
        local ouro = assert(H.tinyloop.load(H.ROOT .. "/tests/data/hf/ouro_bf16_tied", { threads = 1 }))
        local info = ouro:info()
        assert.is_true(info.exit_gate)
        assert.near(0.6, info.exit_gate_threshold, 1e-6) -- its config.json early_exit_threshold
        local gates = {}
        ouro:generate({ 3, 5, 7 }, { max_tokens = 2, ignore_eos = true, depth_policy = function(_, sig)
            gates[#gates + 1] = { sig.gate, sig.exit_probability }
        end })
        assert.equal(3, #gates) -- passes 1..3 of the one decoded token
        for _, g in ipairs(gates) do assert.is_true(g[1] > 0 and g[1] < 1 and g[2] >= g[1] - 1e-12) end
        local _, stats = ouro:generate({ 3, 5, 7 }, { max_tokens = 6, ignore_eos = true, early_exit_patience = 1,
                                                      early_exit_min_L = 1, early_exit_criterion = "gate",
                                                      early_exit_gate_threshold = 0.3 })
        assert.is_true(stats.loops_used < info.default_loops)
        ouro:close()
    end)
end)

describe("loops per session on the published families", function()
    it("caps or raises the trained depth up to max_loops = 4x, and refuses beyond", function()
        for _, name in ipairs({ "huginn_f32", "ouro_f32" }) do
            local model = assert(H.tinyloop.load(H.ROOT .. "/tests/data/hf/" .. name, { threads = 1 }))
            local info = model:info()
            assert.equal(4 * info.default_loops, info.max_loops)
            for _, loops in ipairs({ 1, 2 * info.default_loops, info.max_loops }) do
                local a, stats = model:generate({ 3, 5, 7 }, { loops = loops, max_tokens = 3, ignore_eos = true })
                assert.equal(loops, stats.loops_used)
                assert.same(a, model:generate({ 3, 5, 7 }, { loops = loops, max_tokens = 3, ignore_eos = true }))
            end
            local ok, err = pcall(model.generate, model, { 3 }, { loops = info.max_loops + 1, max_tokens = 1 })
            assert.is_false(ok)
            assert.matches(("loops = %d is out of range %%[1, max_loops = %d%%]"):format(info.max_loops + 1, info.max_loops), err)
            model:close()
        end
    end)
end)

describe("depth_policy in generate_batch", function()
    it("gives each prompt what generate gives it", function()
        local cfg = { loops = L, max_tokens = 4, ignore_eos = true, depth_policy = exit_at(3) }
        local outs, stats = m:generate_batch({ P, { 1, 2 } }, cfg)
        assert.same(m:generate(P, cfg), outs[1])
        assert.same(m:generate({ 1, 2 }, cfg), outs[2])
        assert.equal(3, stats[2].depth_histogram[3])
    end)
end)

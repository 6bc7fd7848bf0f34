-- decoders_spec.lua: speculative decoding, beam search and early exit from Lua.
local H = require "helpers"

describe("speculative decoding", function()
    local m = H.model("deep_residual")
    local prompt = { 3, 1, 4, 1, 5 }

    it("chain and tree reproduce greedy generate at verify_loops", function()
        local want = m:generate(prompt, { max_tokens = 20, loops = 8, ignore_eos = true })
        for _, d in ipairs({ 1, 3 }) do
            local got, st = m:generate_speculative(prompt, { max_tokens = 20, verify_loops = 8, draft_loops = d,
                                                             draft_ahead = 4, ignore_eos = true })
            assert.same(want, got)
            assert.is_true(st.drafted >= st.accepted and st.verify_steps > 0)
            assert.equal(20, st.tokens_emitted)
            local tree = m:generate_tree_speculative(prompt, { max_tokens = 20, verify_loops = 8, draft_loops = d,
                                                               draft_ahead = 3, K_branches = 3, ignore_eos = true })
            assert.same(want, tree)
        end
    end)

    it("stop rules and hooks behave as in plain generation", function()
        local seen = {}
        local cfg = { max_tokens = 12, verify_loops = 8, draft_loops = 2,
                      on_token = function(t) seen[#seen + 1] = t end,
                      stop_when = function(tokens) return #tokens >= #prompt + 5 end }
        local ids, st = m:generate_speculative(prompt, cfg)
        assert.equal(#prompt + 5, #ids)
        assert.equal("CALLBACK_ABORT", st.stop_reason)
        assert.equal(5, #seen)
    end)

    it("samples at temperature > 0 and validates its knobs", function()
        local a = m:generate_speculative(prompt, { max_tokens = 8, verify_loops = 8, temperature = 0.9, seed = 4 })
        local b = m:generate_speculative(prompt, { max_tokens = 8, verify_loops = 8, temperature = 0.9, seed = 4 })
        assert.same(a, b)
        assert.has_error(function() m:generate_speculative(prompt, { max_tokens = 8, draft_loops = 8, verify_loops = 8 }) end,
                         "draft_loops = 8 must be in [1, verify_loops = 8)")
        assert.has_error(function() m:generate_tree_speculative(prompt, { temperature = 0.5 }) end)
        assert.has_error(function() m:generate_speculative(prompt, { K_branches = 2 }) end,
                         "config field 'K_branches' is tree speculation's: use generate_tree_speculative")
    end)
end)

describe("beam search", function()
    local m = H.model("add_residual_statenorm_rms_gqa2")

    it("returns the best hypothesis and its score, deterministically", function()
        local cfg = { max_tokens = 10, beam_size = 3, length_penalty = 0.8 }
        local a, sa = m:generate({ 5, 6, 7 }, cfg)
        local b, sb = m:generate({ 5, 6, 7 }, cfg)
        assert.same(a, b)
        assert.equal(sa.beam_score, sb.beam_score)
        assert.is_true(sa.beam_score <= 0)
        assert.is_true(#a > 3)
    end)

    it("finds the better path a greedy decoder misses", function()
        local eos = m:info().eos_token_id
        -- step 0: 10 (0.6) or 20 (0.4); after 10 four 0.25 choices, after 20 one 0.9; then EOS
        local function script(logits, vocab, tokens)
            local step = #tokens - 3
            for i = 0, vocab - 1 do logits[i] = -math.huge end
            if step == 0 then logits[10], logits[20] = math.log(0.6), math.log(0.4)
            elseif step == 1 and tokens[#tokens] == 10 then for t = 30, 33 do logits[t] = math.log(0.25) end
            elseif step == 1 then logits[40], logits[41] = math.log(0.9), math.log(0.1)
            else logits[eos] = 0 end
        end
        local greedy = m:generate({ 1, 2, 3 }, { max_tokens = 5, logits_processor = script })
        assert.same({ 1, 2, 3, 10, 30, eos }, greedy)
        local beam, st = m:generate({ 1, 2, 3 }, { max_tokens = 5, beam_size = 2, logits_processor = script })
        assert.same({ 1, 2, 3, 20, 40, eos }, beam)
        assert.is_true(math.abs(st.beam_score - (math.log(0.4) + math.log(0.9)) / 3) < 1e-6)
    end)

    it("rejects what it does not support", function()
        assert.has_error(function() m:generate({ 1 }, { beam_size = 2, on_token = function() end }) end)
        assert.has_error(function() m:stream({ 1 }, { beam_size = 2 }) end)
    end)
end)

describe("early exit", function()
    local m = H.model("deep_residual")

    it("uses fewer loops with a loose criterion, full depth with an unreachable one", function()
        local base = { max_tokens = 12, loops = 8, ignore_eos = true }
        local _, full = m:generate({ 1, 2 }, base)
        assert.equal(8, full.loops_used)
        local loose = { max_tokens = 12, loops = 8, ignore_eos = true, early_exit_patience = 1,
                        early_exit_logit_margin = 1e-6 }
        local _, st = m:generate({ 1, 2 }, loose)
        assert.is_true(st.loops_used < 8)
        assert.is_true(st.probes > 0)
        assert.equal(11, st.depth_histogram[2])
        -- (only the depths used are keys: pairs() over it lists no depth of count 0)
        for depth, count in pairs(st.depth_histogram) do assert.is_true(count > 0, "depth " .. depth) end
        for depth, count in pairs(full.depth_histogram) do assert.same({ 8, 12 }, { depth, count }) end
        loose.early_exit_logit_margin, loose.early_exit_threshold = 0, 0
        local _, strict = m:generate({ 1, 2 }, loose)
        assert.equal(8, strict.loops_used)
    end)
end)

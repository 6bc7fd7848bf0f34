-- policy_spec.lua: the stateful rules of tinyloop.policy keep their state per sequence, so
-- that one rule serves every prompt of generate_batch and every beam of a search (they
-- treated "not longer than the last call" as a new generation, which every other call of a
-- batch or of a beam search is: min_tokens went on banning EOS, max_wall_time never fired).
local ffi = require "ffi"
local H = require "helpers"
local policy = require "tinyloop.policy"

pcall(ffi.cdef, "int usleep(unsigned int usec);")

local m = H.model()

-- EOS made certain, then min_tokens(k) holding it back: every sequence is k tokens, then EOS.
local function eos_after(k)
    local rule = policy.min_tokens(k, H.EOS)
    return policy.chain(function(logits) logits[H.EOS] = 1e9 end, rule)
end

describe("tinyloop.policy.min_tokens", function()
    it("holds EOS back for min_new tokens of each sequence, alone, batched and in a beam search", function()
        local prompts = { { 5, 6, 7 }, { 9, 8, 7, 6, 5 }, { 11 } }
        local cfg = { max_tokens = 12, logits_processor = eos_after(3) }
        for _, p in ipairs(prompts) do
            local ids = assert(m:generate(p, { max_tokens = 12, logits_processor = eos_after(3) }))
            assert.equal(#p + 4, #ids)
            assert.equal(H.EOS, ids[#ids])
        end
        local outs = assert(m:generate_batch(prompts, cfg)) -- one rule for the three prompts
        for i, p in ipairs(prompts) do
            assert.equal(#p + 4, #outs[i], "prompt " .. i)
            assert.equal(H.EOS, outs[i][#outs[i]])
        end
        local beam = assert(m:generate(prompts[2], { max_tokens = 12, beam_size = 3, logits_processor = eos_after(3) }))
        assert.equal(#prompts[2] + 4, #beam)
    end)

    it("goes on counting in a fork and a resumed state (a branch is the same sequence, not a new prompt)", function()
        local s = assert(m:session({ 5, 6, 7 }, { max_tokens = 12, logits_processor = eos_after(5) }))
        for _ = 1, 3 do s:step() end -- 3 of the 5 tokens before EOS may come
        local state = assert(s:save())
        for _, branch in ipairs({ assert(s:fork()), assert(m:resume(state)) }) do
            repeat local _, _, reason = branch:step() until reason
            local ids = branch:tokens()
            assert.equal(3 + 5 + 1, #ids) -- (it restarted at the branch: 3 + 3 + 5 + 1)
            assert.equal(H.EOS, ids[#ids])
        end
        -- a branch of a session without the rule, given it: the engine's prompt length counts
        -- (the branch's first call was taken for its prompt: 3 + 3 + 5 + 1)
        s = assert(m:session({ 5, 6, 7 }, { max_tokens = 12, logits_processor = function(logits) logits[H.EOS] = -math.huge end }))
        for _ = 1, 3 do s:step() end
        state = assert(s:save())
        for _, branch in ipairs({ assert(s:fork({ logits_processor = eos_after(5) })),
                                  assert(m:resume(state, { logits_processor = eos_after(5) })) }) do
            repeat local _, _, reason = branch:step() until reason
            local ids = branch:tokens()
            assert.equal(3 + 5 + 1, #ids)
            assert.equal(H.EOS, ids[#ids])
        end
    end)
end)

describe("tinyloop.policy.repetition", function()
    it("counts the output's tokens, not the prompt's (a repeated prompt stopped it at once)", function()
        local no = m:encode(" no")[1]
        local prompt = { no, no, no }
        local cfg = { max_tokens = 6, ignore_eos = true, logit_bias = { [no] = 100 }, stop_when = policy.repetition({ times = 3 }) }
        -- the output is the prompt's first token again and again: period 1, three times, at the third
        local out, stats = assert(m:generate(prompt, cfg))
        assert.same({ "CALLBACK_ABORT", 3 }, { stats.stop_reason, stats.tokens_emitted })
        assert.equal(#prompt + 3, #out)
        -- any() passes the prompt's length on
        cfg.stop_when = policy.any(function() return false end, policy.repetition({ times = 3 }))
        stats = select(2, assert(m:generate(prompt, cfg)))
        assert.same({ "CALLBACK_ABORT", 3 }, { stats.stop_reason, stats.tokens_emitted })
    end)
end)

describe("tinyloop.policy.max_wall_time", function()
    it("times each sequence from its own first token, batched too", function()
        -- 20 ms a call of each sequence: 0.1 s is a handful of steps, where the rule that
        -- restarted its clock on every other call of a batch ran to max_tokens
        local slow = function() ffi.C.usleep(20000) end
        local outs, stats = assert(m:generate_batch({ { 5, 6, 7 }, { 9, 8, 7, 6, 5 } }, {
            max_tokens = 60, ignore_eos = true, logits_processor = slow, stop_when = policy.max_wall_time(0.1),
        }))
        for i = 1, 2 do
            assert.equal("CALLBACK_ABORT", stats[i].stop_reason, "sequence " .. i)
            assert.is_true(stats[i].tokens_emitted >= 2 and stats[i].tokens_emitted < 60,
                           "sequence " .. i .. " emitted " .. stats[i].tokens_emitted)
        end
        assert.equal(2, #outs)
    end)
end)

describe("tinyloop.policy's other rules", function()
    it("repetition: no period longer than the output's share is tried (max_period 2^40 was a hang)", function()
        local rule = policy.repetition({ max_period = 2 ^ 40 })
        local tokens = {}
        for i = 1, 60 do tokens[i] = i % 4 end
        assert.is_true(rule(tokens, "", 0))
        tokens[60] = 99
        assert.is_false(rule(tokens, "", 0))
    end)

    it("mask: fill_allowed allows what apply leaves allowed, ids past the mask's size too", function()
        local mask = policy.mask(100):ban({ 44 })
        local allowed = ffi.new("int32_t[200]")
        ffi.fill(allowed, ffi.sizeof(allowed), 0)
        assert.equal(199, mask:fill_allowed(allowed, 200))
        assert.same({ 1, 0, 1, 1 }, { allowed[43], allowed[44], allowed[99], allowed[150] })
        local logits = ffi.new("float[200]")
        mask:apply(logits, 200)
        assert.same({ 0, -math.huge, 0 }, { logits[43], logits[44], logits[150] })
    end)

    it("pattern takes every well-formed Lua pattern (its check is no stricter than string.find)", function()
        -- (")" alone is plain text to LuaJIT, which searches a pattern without ^$*+?.([%- as such)
        for _, p in ipairs({ "[%.!?]%s*$", "%f[%w]x", "[]]", "[^]a]", "[%]]", "^(a(b)c)%2%1", "%bxy", "()a", "%%", ")", "a)",
                             "x)]" }) do
            local rule = policy.pattern(p)
            assert.equal(("x%]a(b)c bxy"):find(p) ~= nil, rule({}, "x%]a(b)c bxy"), p)
        end
    end)

    it("pattern reads a pattern up to a NUL, as the matcher does", function()
        assert.has_error(function() policy.pattern("(\0)") end, "tinyloop.policy.pattern: malformed pattern (unfinished capture)")
        assert.has_error(function() policy.pattern("[\0]") end, "tinyloop.policy.pattern: malformed pattern (missing ']')")
        assert.is_true(policy.pattern("\0(")({}, "abc")) -- (an empty pattern: "\0(" matches everywhere, never raises)
    end)

    it("stop_strings keeps the strings it checked (a later edit of the caller's table changes nothing)", function()
        local strings = { "zz" }
        local rule = policy.stop_strings(strings)
        strings[1] = "a"
        assert.is_false(rule({}, "a b c"))
        assert.is_true(rule({}, "a zz"))
    end)

    it("times with a clock of its own declaration (a script's clock_gettime of its own types clashed)", function()
        -- (in a child: the script declares clock_gettime before the module loads, as
        -- scripts/bench/lua_sweep.lua does; the module's then failed at its first call)
        local ok, out = H.run_child([[
            local ffi = require "ffi"
            ffi.cdef "typedef struct { long s; long ns; } script_ts; int clock_gettime(int, script_ts *);"
            local policy = require "tinyloop.policy"
            local t0 = policy.now()
            local ts = ffi.new("script_ts")
            assert(ffi.C.clock_gettime(1, ts) == 0 and t0 > 0 and policy.now() >= t0)
            print("clock ok")
        ]])
        assert.is_true(ok and out:find("clock ok", 1, true) ~= nil, out)
    end)
end)

describe("tinyloop.policy at its bounds and defaults", function()
    local V = m:info().vocab_size
    it("refuses ids that are no exact integers (2^53, inf, fractions)", function()
        for _, id in ipairs({ 2 ^ 53, math.huge, -math.huge, 0.5 }) do
            assert.has_error(function() policy.ban_tokens({ id }) end)
        end
        assert.truthy(policy.ban_tokens({ 0, V - 1 }))
    end)

    it("repetition: three repeats by default, and a period's first repeat is not a repeat", function()
        assert.is_false(policy.repetition()({ 1, 2, 2 }, "", 0))
        assert.is_true(policy.repetition()({ 1, 2, 2, 2 }, "", 0))
        assert.is_false(policy.repetition({ times = 2, period = 1 })({ 1, 2 }, "", 0))
        assert.is_true(policy.repetition({ times = 2, period = 1 })({ 1, 2, 2 }, "", 0))
    end)

    it("no_repeat_ngram bans the token that would repeat the last n-gram, from the first one on", function()
        local logits = ffi.new("float[8]")
        policy.no_repeat_ngram(2)(logits, 8, { 5, 5 }) -- (5 5 seen: after 5, a 5 repeats it)
        assert.equal(-math.huge, logits[5])
        assert.equal(0, logits[4])
    end)

    it("ids past the vocabulary are left alone: a ban of id vocab_size or a mask wider than it writes nothing out there", function()
        local _, st = m:generate({ 1, 2 }, { max_tokens = 3, logits_processor = policy.ban_tokens({ V }) })
        assert.equal("MAX_TOKENS", st.stop_reason)
        local wide = policy.mask(V + 8):ban({ V + 1 })
        _, st = m:generate({ 1, 2 }, { max_tokens = 3, logits_processor = function(logits, n) wide:apply(logits, n) end })
        assert.equal("MAX_TOKENS", st.stop_reason)
    end)

    it("no_repeat_ngram leaves ids past the vocabulary alone; min_tokens counts from a prompt length given", function()
        local logits = ffi.new("float[8]")
        policy.no_repeat_ngram(1)(logits, 4, { 6 }) -- (a direct call: id 6 of a vocabulary of 4)
        assert.equal(0, logits[6])
        -- (called first without the prompt's length, then with it: the length given wins over
        -- the one remembered, 4 tokens past a prompt of 0 are past min_new 3)
        local rule, eos_logits, tokens = policy.min_tokens(3, 0), ffi.new("float[4]"), { 1, 2 }
        rule(eos_logits, 4, tokens)
        eos_logits[0], tokens[3], tokens[4] = 0, 1, 2
        rule(eos_logits, 4, tokens, 0)
        assert.equal(0, eos_logits[0])
    end)

    it("pattern refuses more than 32 captures when made, not at its first call", function()
        assert.has_error(function() policy.pattern(("()"):rep(33)) end)
        assert.truthy(policy.pattern(("()"):rep(32)))
    end)

    it("max_wall_time: a fork goes on with its parent's clock (a branch is the same sequence)", function()
        local s = m:session({ 1, 2, 3 }, { max_tokens = 30, ignore_eos = true, stop_when = policy.max_wall_time(0.05) })
        s:step()
        ffi.C.usleep(100000)
        local fork = s:fork()
        local _, _, why = fork:step()
        assert.equal("CALLBACK_ABORT", why) -- (0.1 s past its start: the first step of the fork stops)
    end)
end)

describe("tinyloop.script_options.median (the measurement scripts' one median)", function()
    it("takes the middle, the mean of the two middle ones for an even count, and leaves the list as it was", function()
        local median = require("tinyloop.script_options").median
        local values = { 4, 1, 3, 2 }
        assert.equal(2.5, median(values)) -- (lua_sweep and two other scripts took the lower one, 2)
        assert.same({ 4, 1, 3, 2 }, values)
        assert.equal(3, median({ 5, 3, 1 }))
    end)
end)

-- step_batch_spec.lua: model:step_batch(sessions[, opts]), many sessions advanced one step
-- each in one batched forward (tl_session_step_batch_with). Every session's ids and text must
-- be what model:generate gives it alone: mixed configs, Lua hooks, sessions leaving as they
-- stop, prompts cut into chunks (prompt_rows); bad calls raise; a hook's error is raised once
-- every session's result is settled, and the others go on.
local H = require "helpers"

local m = H.model()
local vocab = m:info().vocab_size

-- A prompt of n ids, the same for the same seed.
local function prompt_of(n, seed)
    local p = {}
    for i = 1, n do p[i] = (i * 37 + seed * 101) % (vocab - 1) end
    return p
end

-- Steps the sessions together until each has stopped -> per session: its emitted ids, its
-- text, its stop reason, and the number of calls in which it emitted nothing.
local function run_together(sessions, opts)
    local live, index, out = {}, {}, {}
    for i, s in ipairs(sessions) do
        live[i], index[i] = s, i
        out[i] = { ids = {}, text = {}, waits = 0 }
    end
    local calls = 0
    while #live > 0 do
        calls = calls + 1
        assert(calls < 1000, "no end")
        local results = m:step_batch(live, opts)
        assert.equal(#live, #results)
        local next_live, next_index = {}, {}
        for k, r in ipairs(results) do
            local o = out[index[k]]
            assert.is_nil(r.error)
            if r.id >= 0 then o.ids[#o.ids + 1] = r.id else o.waits = o.waits + 1 end
            o.text[#o.text + 1] = r.text
            if r.reason then
                o.reason = r.reason
            else
                next_live[#next_live + 1], next_index[#next_index + 1] = live[k], index[k]
            end
        end
        live, index = next_live, next_index
    end
    for _, o in ipairs(out) do o.text = table.concat(o.text) end
    return out, calls
end

-- The configs of the mix: greedy and seeded sampling, depths, a stop string, a window, a
-- Lua logits processor, on_token, early exit.
local function mix()
    local cfgs = {
        { max_tokens = 20, ignore_eos = true },
        { max_tokens = 15, temperature = 0.9, sample_seed = 7, ignore_eos = true },
        { max_tokens = 25, loops = 1, ignore_eos = true, cache_window = 8 },
        { max_tokens = 30, temperature = 0.7, top_k = 20, sample_seed = 3 },
        { max_tokens = 12, ignore_eos = true, logits_processor = H.forcer({ 5, 6, 7 }, 9) },
        { max_tokens = 18, loops = 4, early_exit_patience = 1, early_exit_min_L = 1, ignore_eos = true },
    }
    local seen = {}
    cfgs[6].on_token = function(token) seen[#seen + 1] = token end
    return cfgs, seen
end

describe("model:step_batch", function()
    it("gives every session the ids and text of generate alone, as sessions leave", function()
        local cfgs, seen = mix()
        local lens = { 3, 9, 1, 14, 9, 6 }
        local sessions = {}
        for i, cfg in ipairs(cfgs) do sessions[i] = m:session(prompt_of(lens[i], i), cfg) end
        local out = run_together(sessions)
        for i, cfg in ipairs(cfgs) do
            local alone, stats = m:generate(prompt_of(lens[i], i), cfg)
            assert.same(H.slice(alone, lens[i] + 1), out[i].ids, "session " .. i)
            assert.equal(stats.stop_reason, out[i].reason)
            assert.equal(m:decode(out[i].ids), out[i].text)
            assert.equal(0, out[i].waits)
        end
        assert.equal(36, #seen) -- on_token saw both runs of session 6 (18 tokens each)
    end)

    it("cuts prompts into chunks of prompt_rows, shared in the list's order, with the same tokens", function()
        local lens = { 40, 2, 25, 60 }
        local cfgs = {
            { max_tokens = 10, ignore_eos = true },
            { max_tokens = 30, temperature = 0.8, sample_seed = 1, ignore_eos = true },
            { max_tokens = 10, loops = 4, early_exit_patience = 1, early_exit_min_L = 1, ignore_eos = true },
            { max_tokens = 10, temperature = 1.0, sample_seed = 9, ignore_eos = true },
        }
        local sessions = {}
        for i, cfg in ipairs(cfgs) do sessions[i] = m:session(prompt_of(lens[i], 10 + i), cfg) end
        local out, calls = run_together(sessions, { prompt_rows = 8 })
        -- The rule, counted: each call, 8 rows go to the prompts still pending in the list's
        -- order; a session emits once its prompt is all in, and leaves after max_tokens.
        local left, emitted, waits, live = {}, {}, {}, {}
        for i = 1, #lens do left[i], emitted[i], waits[i], live[i] = lens[i], 0, 0, i end
        local counted = 0
        while #live > 0 do
            counted = counted + 1
            local budget, still = 8, {}
            for _, i in ipairs(live) do
                local take = math.min(left[i], budget)
                budget, left[i] = budget - take, left[i] - take
                if left[i] == 0 then emitted[i] = emitted[i] + 1 else waits[i] = waits[i] + 1 end
                if emitted[i] < cfgs[i].max_tokens then still[#still + 1] = i end
            end
            live = still
        end
        assert.equal(counted, calls)
        for i = 1, #lens do assert.equal(waits[i], out[i].waits, "session " .. i) end
        assert.is_true(waits[4] >= 15) -- (127 prompt rows, 8 a call)
        for i, cfg in ipairs(cfgs) do
            local alone = m:generate(prompt_of(lens[i], 10 + i), cfg)
            assert.same(H.slice(alone, lens[i] + 1), out[i].ids, "session " .. i)
        end
    end)

    it("counts in a chunked prefill's stats the rows it forwarded: a state read mid-prompt, those after it", function()
        local s = m:session(prompt_of(40, 3), { max_tokens = 3 })
        m:step_batch({ s }, { prompt_rows = 30 }) -- (30 rows in, no token yet)
        local resumed = assert(m:resume(assert(m:state_from_bytes(assert(s:save():bytes())))))
        resumed:step()
        -- (it counted the 30 rows read from the bytes, in the time of the 10 forwarded)
        assert.equal(10, resumed:stats().prefill_tokens)
        s:step()
        assert.equal(40, s:stats().prefill_tokens)
        local forked = m:session(prompt_of(40, 3), { max_tokens = 3 })
        m:step_batch({ forked }, { prompt_rows = 30 })
        local child = forked:fork()
        child:step() -- (the parent's clock and rows: all 40)
        assert.equal(40, child:stats().prefill_tokens)
        -- resumed from memory as from bytes: the time spent saved is not the session's (it
        -- counted 40 rows over the 300 ms the state waited)
        local saved_mid = m:session(prompt_of(40, 3), { max_tokens = 3 })
        m:step_batch({ saved_mid }, { prompt_rows = 30 })
        local state = saved_mid:save()
        os.execute("sleep 0.3")
        local again = assert(m:resume(state))
        again:step()
        assert.equal(10, again:stats().prefill_tokens)
        assert.is_true(again:stats().prefill_ms < 250, again:stats().prefill_ms)
        local decoding = m:session(prompt_of(40, 3), { max_tokens = 3 })
        decoding:step()
        local decoding_state = decoding:save()
        os.execute("sleep 0.3")
        local later = assert(m:resume(decoding_state))
        later:step()
        assert.equal(40, later:stats().prefill_tokens)
        assert.is_true(later:stats().decode_ms < 250 and later:stats().first_token_ms < 250, later:stats().decode_ms)
    end)

    it("raises a hook's error once the call is settled; that session is closed, the others go on", function()
        local calls = 0
        local bad = m:session(prompt_of(4, 1), { max_tokens = 10, ignore_eos = true, logits_processor = function()
            calls = calls + 1
            if calls == 3 then error("boom at three") end
        end })
        local good_cfg = { max_tokens = 10, temperature = 0.9, sample_seed = 2, ignore_eos = true }
        local good = m:session(prompt_of(5, 2), good_cfg)
        local ids = {}
        for _ = 1, 2 do
            local r = m:step_batch({ bad, good })
            ids[#ids + 1] = r[2].id
        end
        H.error_contains(function() m:step_batch({ bad, good }) end, "boom at three")
        H.error_contains(function() bad:step() end, "a hook raised: ")
        -- good's third token was emitted in the call that raised: its next step returns it
        -- (with its text), stepping nothing (its id was lost, and its text came with the fourth);
        -- a second call that raises keeps it held (it was taken before the call, and lost)
        local again = m:session(prompt_of(3, 7), { max_tokens = 4, logits_processor = function() error("boom again") end })
        H.error_contains(function() m:step_batch({ again, good }) end, "boom again")
        assert.equal(5 + 3, #good:tokens())
        -- a branch made now would never give the held token (the C session counts it shown)
        for _, method in ipairs({ "fork", "save" }) do
            H.error_contains(function() return good[method](good) end, "holds the result of a model:step_batch call")
        end
        while true do
            local r = m:step_batch({ good })
            ids[#ids + 1] = r[1].id
            if #ids == 3 then
                assert.equal(5 + 3, #good:tokens())
                assert(good:save()):close() -- (taken, it branches again)
            end
            if r[1].reason then break end
        end
        assert.same(H.slice(m:generate(prompt_of(5, 2), good_cfg), 6), ids)
        -- one whose last step was in the call that raised: that step's result ends it
        calls = 0
        bad = m:session(prompt_of(4, 1), { max_tokens = 10, ignore_eos = true, logits_processor = function()
            calls = calls + 1
            if calls == 1 then error("boom at one") end
        end })
        local last = m:session(prompt_of(5, 2), { max_tokens = 1, ignore_eos = true })
        H.error_contains(function() m:step_batch({ bad, last }) end, "boom at one")
        local id, text, reason = last:step()
        assert.same({ last:tokens()[6], "MAX_TOKENS" }, { id, reason })
        assert.equal(m:decode({ id }), text)
        H.error_contains(function() last:step() end, "session has already finished")
    end)

    it("refuses what it cannot step, with a message naming the session", function()
        local a = m:session(prompt_of(3, 1), { max_tokens = 1 })
        local b = m:session(prompt_of(3, 2), { max_tokens = 5 })
        local other = H.model("llama_like")
        local foreign = other:session({ 1, 2 }, { max_tokens = 2 })
        H.error_contains(function() m:step_batch("a") end, "sessions must be a list of sessions")
        H.error_contains(function() m:step_batch({ a, nil, b }) end, "no holes")
        H.error_contains(function() m:step_batch({ a, b }, 5) end, "opts must be a table")
        H.error_contains(function() m:step_batch({ a, b }, { rows = 4 }) end, "unknown option 'rows'")
        H.error_contains(function() m:step_batch({ a, b }, { prompt_rows = -1 }) end, "prompt_rows = -1 must be >= 0")
        H.error_contains(function() m:step_batch({ a, b }, { prompt_rows = 1.5 }) end, "must be an integer")
        H.error_contains(function() m:step_batch({ a, {} }) end, "sessions[2] is not a session")
        H.error_contains(function() m:step_batch({ a, foreign }) end, "sessions[2] is another model's")
        H.error_contains(function() m:step_batch({ a, b, a }) end, "sessions[3] is sessions[1] again")
        assert.same({}, m:step_batch({}))
        local r = m:step_batch({ a, b })
        assert.equal("MAX_TOKENS", r[1].reason)
        assert.is_false(r[2].reason)
        H.error_contains(function() m:step_batch({ b, a }) end, "sessions[2] has already finished (MAX_TOKENS)")
        b:close()
        H.error_contains(function() m:step_batch({ b }) end, "sessions[1] is closed")
        foreign:close()
    end)

    it("refuses, from a hook, a step_batch of a session the outer call steps: no session closed mid-step", function()
        -- (the inner call set, then cleared, the outer call's marks: B could be closed while its
        -- step ran, and B's next hook raised inside the engine's C frames, A stuck for good)
        local b, inner, closed
        local a = m:session("It is", { max_tokens = 5, on_token = function()
            if b.ptr ~= nil and inner == nil then
                inner = { pcall(m.step_batch, m, { b }) }
                closed = { pcall(b.close, b) }
            end
        end })
        b = m:session("Once", { max_tokens = 5, on_token = function() end })
        local results = m:step_batch({ a, b })
        assert.is_false(inner[1])
        assert.truthy(tostring(inner[2]):find("sessions[1] is in a model:step_batch call already", 1, true), tostring(inner[2]))
        assert.is_false(closed[1])
        assert.truthy(tostring(closed[2]):find("in a model:step_batch call", 1, true), tostring(closed[2]))
        assert.same({ "number", "number" }, { type(results[1].id), type(results[2].id) })
        -- both go on
        local again = m:step_batch({ a, b })
        assert.equal(2, #again)
        a:close()
        b:close()
    end)

    it("refuses, from a hook, the figures of a session the call has not reached: its row is gone", function()
        -- (a's hook read b's last token under the batch's new row: a wrong figure, no error)
        local b, asked, armed
        local a = m:session("It is", { max_tokens = 5, on_token = function()
            if armed and asked == nil then asked = { pcall(b.logprobs, b) } end
        end })
        b = m:session("Once upon", { max_tokens = 5 })
        m:step_batch({ a, b })
        assert.is_number(b:logprobs())
        armed = true
        m:step_batch({ a, b })
        assert.is_false(asked[1], tostring(asked[2]))
        assert.truthy(tostring(asked[2]):find("tl_session_logprobs: the session is stepping and has not emitted this step's token yet", 1, true),
                      tostring(asked[2]))
        assert.is_number(b:logprobs()) -- after the call, its new token's
        a:close()
        b:close()
    end)
end)


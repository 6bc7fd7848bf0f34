-- jit_spec.lua: JIT safety of the hooks (LUA-NOTES "bad callback" panic). A C function
-- that calls back into Lua must never be called from a compiled trace; the panic shows up
-- only in hot loops where the C call sometimes does not call back while the trace is
-- recorded. The workload runs in a child luajit process, so that a panic (which pcall
-- cannot catch) fails the test instead of killing busted.
local H = require "helpers"

-- 5 000 generate calls (max_tokens 2..4) and 2 000 streams: the first ones without hooks (a
-- trace gets recorded around C calls that do not call back), then hooks on some iterations
-- only (a depth_policy among them), and a stop_when that returns true on one call in seven.
local WORKLOAD = [[
local H = require "helpers"
jit.on()
local m = H.model()
if os.getenv("TL_JIT_SPEC_UNSAFE") then -- control: compile the step wrapper too
    local s = m:session({ 1 }, { max_tokens = 1 })
    jit.on(getmetatable(s).__index.step, true)
    s:close()
end
local stop_calls, tokens_seen = 0, 0
local function stop_when(tokens, text)
    stop_calls = stop_calls + 1
    return stop_calls % 7 == 0
end
local function on_token(token, position) tokens_seen = tokens_seen + 1 return position % 5 ~= 0 end
local function logits_processor(logits, vocab, tokens) if #tokens % 3 == 0 then logits[7] = 1e9 end end
local plain = { max_tokens = 3 }
local cfgs = {
    { max_tokens = 3, stop_when = stop_when },
    { max_tokens = 2, on_token = on_token, depth_policy = function(loop) return loop == 2 end },
    { max_tokens = 4, stop_when = stop_when, logits_processor = logits_processor },
}
local prompt = { 72, 101 }
local n, aborts = 0, 0
for i = 1, 5000 do
    local cfg = plain
    if i > 1000 then
        local r = i % 7
        if r <= 2 then cfg = cfgs[r + 1] end
    end
    local out, stats = m:generate(prompt, cfg)
    n = n + #out
    if stats.stop_reason == "CALLBACK_ABORT" then aborts = aborts + 1 end
end
for i = 1, 2000 do
    local cfg = (i > 500 and i % 7 == 0) and cfgs[1] or plain
    for _ in m:stream(prompt, cfg) do n = n + 1 end
end
for i = 1, 2000 do -- the step API in a hot loop
    local s = m:session(prompt, (i > 500 and i % 5 == 0) and cfgs[2] or plain)
    repeat local _, _, reason = s:step() until reason
    s:close()
end
assert(stop_calls > 0 and tokens_seen > 0 and aborts > 0)
print("WORKLOAD-OK", n, stop_calls, tokens_seen, aborts)
]]

describe("hooks under the JIT", function()
    it("a hot loop of 5 000 generate calls with occasional hooks does not panic", function()
        local ok, out = H.run_child(WORKLOAD)
        assert.is_nil(out:find("bad callback", 1, true), out)
        assert.is_true(ok, "child failed:\n" .. out)
        assert.truthy(out:find("WORKLOAD-OK", 1, true), out)
    end)

    -- Control: with the JIT allowed on the wrapper that calls tl_session_step, the same
    -- workload does panic on LuaJIT 2.1, so the test above has teeth. (If a LuaJIT version
    -- stops reproducing the panic, this control fails: revisit the workload.)
    -- Whether a trace gets recorded around a C call that happens not to call back is up to
    -- the JIT's heuristics, so one run may miss the panic (about two runs in three did, measured
    -- when streams began closing their sessions): up to twelve runs, one must panic (all
    -- twelve missing it: under 1% at that rate).
    it("(control) the workload panics when the step wrapper is JIT-compiled", function()
        local ok, out
        for _ = 1, 12 do
            ok, out = H.run_child(WORKLOAD, "TL_JIT_SPEC_UNSAFE=1")
            if not ok then break end
        end
        assert.is_false(ok, "the unsafe control did not fail in twelve runs:\n" .. out)
        assert.truthy(out:find("bad callback", 1, true), out)
    end)
end)

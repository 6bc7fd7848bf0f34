-- errors_spec.lua: every error path of the Lua API. Bad arguments raise a Lua error that
-- names the field or value (the engine's message for engine-side validation); a Lua error in
-- a hook stops generation, is raised from the generating call with its traceback, and
-- leaves the model fully usable (SPEC §4.1, §5).
local H = require "helpers"

local m = H.model()

-- Asserts that f(...) raises an error whose message contains every one of `needles`.
local function raises(needles, f, ...)
    local ok, err = pcall(f, ...)
    assert.is_false(ok, "expected an error containing '" .. needles[1] .. "'")
    err = tostring(err)
    for _, needle in ipairs(needles) do
        assert.truthy(err:find(needle, 1, true), "error '" .. err .. "' lacks '" .. needle .. "'")
    end
    return err
end

local function gen(cfg, prompt)
    return function() return m:generate(prompt or { 1, 2, 3 }, cfg) end
end

describe("config errors", function()
    it("names an unknown field", function()
        raises({ "unknown config field", "top_K" }, gen({ top_K = 5 }))
        raises({ "max_token" }, gen({ max_token = 5 }))
    end)

    it("rejects a config that is not a table", function()
        raises({ "config must be a table" }, gen(5))
        raises({ "config must be a table" }, gen("max_tokens=5"))
    end)

    it("rejects fields of the wrong type", function()
        raises({ "'max_tokens' must be a number" }, gen({ max_tokens = "5" }))
        raises({ "'temperature' must be a number" }, gen({ temperature = true }))
        raises({ "'sample_seed' must be a number" }, gen({ sample_seed = {} }))
        raises({ "'stop_sequences'" }, gen({ stop_sequences = "ab" }))
        raises({ "stop_sequences[1]" }, gen({ stop_sequences = { 5 } }))
        raises({ "'stop_strings'" }, gen({ stop_strings = "ab" }))
        raises({ "stop_strings[2]" }, gen({ stop_strings = { "ab", 7 } }))
        raises({ "'on_token' must be a function" }, gen({ on_token = 1 }))
        raises({ "'stop_when' must be a function" }, gen({ stop_when = "yes" }))
        raises({ "'logits_processor' must be a function" }, gen({ logits_processor = {} }))
        raises({ "'grammar'" }, gen({ grammar = function() end }))
        raises({ "'grammar'" }, gen({ grammar = { allowed = function() end } }))
        raises({ "'grammar'" }, gen({ grammar = { advance = function() end } }))
    end)
end)

describe("engine validation", function()
    it("temperature < 0 (and NaN)", function()
        raises({ "temperature" }, gen({ temperature = -0.5 }))
        raises({ "temperature" }, gen({ temperature = 0 / 0 }))
    end)

    it("top_p outside (0, 1]", function()
        raises({ "top_p" }, gen({ top_p = 0 }))
        raises({ "top_p" }, gen({ top_p = 1.5 }))
    end)

    it("top_k < 1 when sampling", function()
        raises({ "top_k" }, gen({ top_k = 0, temperature = 0.8 }))
        assert.is_table(gen({ top_k = 0, temperature = 0, max_tokens = 2 })()) -- ignored when greedy
        assert.is_table(gen({ top_k = 0, temperature = 0.8, beam_size = 2, max_tokens = 2 })()) -- and by beam search
    end)

    it("loops out of range", function()
        raises({ "loops = 5", "max_loops = 4" }, gen({ loops = 5 }))
        -- fields another mode alone reads (they did nothing)
        raises({ "config field 'K_branches' needs speculative = \"tree\"" }, gen({ speculative = "chain", K_branches = 3 }))
        raises({ "config field 'max_nodes' needs speculative = \"tree\"" }, gen({ speculative = "chain", max_nodes = 8 }))
        raises({ "config field 'length_penalty' needs beam_size >= 2" }, gen({ length_penalty = 2 }))
        -- the original's GenerateConfig at its defaults (length_penalty 1.0, beam_size 0) is taken
        assert.is_table(gen({ length_penalty = 1.0, beam_size = 0, max_tokens = 2 })())
        -- (C's "(0 = default)" said as Lua spells the default: loops = 0 is refused here)
        raises({ "loops = 5 is out of range [1, max_loops = 4] (leave loops out for the model's default)" }, gen({ loops = 5 }))
        raises({ "loops = -1" }, gen({ loops = -1 }))
    end)

    it("other numeric fields out of range", function()
        raises({ "repetition_penalty" }, gen({ repetition_penalty = 0 }))
        raises({ "cache_window" }, gen({ cache_window = -1 }))
        raises({ "early_exit_min_L" }, gen({ early_exit_min_L = 0 }))
        raises({ "beam_size" }, gen({ beam_size = -1 }))
    end)

    it("logit_bias, presence_penalty and frequency_penalty", function()
        raises({ "logit_bias", "token id = bias" }, gen({ logit_bias = 5 }))
        raises({ 'logit_bias key "7" must be a number' }, gen({ logit_bias = { ["7"] = 1 } })) -- (a string, shown as one)
        raises({ "logit_bias key 1.5 = 1.5", "integer" }, gen({ logit_bias = { [1.5] = 1 } }))
        raises({ "logit_bias[7] must be a number" }, gen({ logit_bias = { [7] = "up" } }))
        raises({ "token id 320 is out of range" }, gen({ logit_bias = { [320] = 1 } }))
        raises({ "the bias of token id 3 = inf must be finite" }, gen({ logit_bias = { [3] = math.huge } }))
        raises({ "presence_penalty = ", "nan must be finite" }, gen({ presence_penalty = 0 / 0 }))
        raises({ "frequency_penalty", "must be a number" }, gen({ frequency_penalty = "high" }))
        raises({ "penalty_window = -1 must be >= 0 (0 = the whole sequence)" }, gen({ penalty_window = -1 }))
        -- (LuaJIT's # of this constructor is 4: a hole is an error, not token 0)
        raises({ "stop_sequences[1] must be a list (1..n, no holes)" }, gen({ stop_sequences = { { 7, nil, nil, 9 } } }))
        raises({ "penalty_window", "integer" }, gen({ penalty_window = 2.5 }))
        raises({ "config field 'penalties_count_prompt' must be a boolean" }, gen({ penalties_count_prompt = 1 }))
        raises({ "config field 'fixed_state_seed' must be a boolean" }, gen({ fixed_state_seed = "yes" }))
    end)

    it("min_p and min_tokens", function()
        raises({ "min_p = 1.5 must be in [0, 1]" }, gen({ min_p = 1.5 }))
        raises({ "min_p", "must be a number" }, gen({ min_p = "low" }))
        raises({ "min_tokens = 9 must be in [0, max_tokens = 8]" }, gen({ max_tokens = 8, min_tokens = 9 }))
        raises({ "min_tokens = -1" }, gen({ min_tokens = -1 }))
        raises({ "min_tokens", "integer" }, gen({ min_tokens = 2.5 }))
    end)

    it("a prompt too long for max_seq_len", function()
        local long = {}
        for i = 1, 100 do long[i] = i end
        raises({ "max_seq_len" }, gen({ max_tokens = 64 }, long))
        raises({ "max_seq_len" }, gen({ max_tokens = 200 }))
        assert.equal(128, #gen({ max_tokens = 28 }, long)()) -- exactly max_seq_len is fine
        local g = H.model("gpt2_like") -- max_seq_len 32
        raises({ "max_seq_len = 32" }, function() return g:generate({ 1, 2 }, { max_tokens = 31 }) end)
    end)

    it("a bad token id in the prompt", function()
        raises({ "400", "out of range" }, gen({}, { 1, 400 }))
        raises({ "-1", "out of range" }, gen({}, { -1 }))
        raises({ "320", "out of range" }, gen({}, { 320 }))
    end)

    it("a stop sequence with a bad id, or an empty one", function()
        -- (named as Lua counts: the engine's 0-based places are shown from 1)
        raises({ "stop_sequences[1]", "999" }, gen({ stop_sequences = { { 1, 999 } } }))
        raises({ "stop_sequences[2]", "-3" }, gen({ stop_sequences = { { 1 }, { -3 } } }))
        raises({ "stop_sequences[1] is empty" }, gen({ stop_sequences = { {} } }))
        -- a hole: the entries past it were left out ({ "zz", nil, "--" } lost "--")
        raises({ "config field 'stop_sequences' must be a list (1..n, no holes)" }, gen({ stop_sequences = { { 1 }, nil, { 2 } } }))
    end)

    it("an empty stop string, or stop strings without a tokenizer", function()
        raises({ "stop_strings[1] is empty" }, gen({ stop_strings = { "" } }))
        raises({ "stop_strings[2] is empty" }, gen({ stop_strings = { "a", "" } }))
        raises({ "config field 'stop_strings' must be a list (1..n, no holes)" }, gen({ stop_strings = { "zz", nil, "--" } }))
        local g = H.model("gpt2_like")
        raises({ "tokenizer" }, function() return g:generate({ 1, 2 }, { max_tokens = 4, stop_strings = { "ab" } }) end)
    end)

    it("early-exit knobs are validated", function()
        raises({ "early_exit_threshold = -1" }, gen({ early_exit_patience = 2, early_exit_threshold = -1 }))
        raises({ "early_exit_peek_every = 0" }, gen({ early_exit_patience = 2, early_exit_peek_every = 0 }))
    end)

    it("the same validation runs for sessions, streams and batches", function()
        raises({ "top_p" }, function() return m:session({ 1 }, { top_p = 0 }) end)
        raises({ "top_p" }, function() return m:stream({ 1 }, { top_p = 0 }) end)
        raises({ "top_p" }, function() return m:generate_batch({ { 1 } }, { top_p = 0 }) end)
        raises({ "unknown config field", "topp" }, function() return m:stream({ 1 }, { topp = 0.5 }) end)
    end)
end)

describe("prompt errors", function()
    it("rejects a prompt that is neither a string nor a table", function()
        for _, bad in ipairs({ 42, true, function() end }) do
            raises({ "prompt must be a string or a table of token ids" }, gen({}, bad))
        end
        raises({ "prompt must be" }, function() return m:generate(nil, {}) end)
        raises({ "prompt must be" }, function() return m:session(42) end)
        raises({ "prompt must be" }, function() return m:stream(42) end)
    end)

    it("rejects an empty prompt and non-numeric ids", function()
        raises({ "prompt_len" }, gen({}, {}))
        raises({ "prompt_len" }, gen({}, ""))
        raises({ "token ids must be numbers", "index 2" }, gen({}, { 1, "2" }))
        -- a list with a hole (# may end at it: { 1, nil, 3 } was generated from as { 1 })
        raises({ "token ids must be a list (1..n, no holes)" }, gen({}, { 1, nil, 3 }))
        raises({ "token ids must be a list (1..n, no holes)" }, function() return m:decode({ 1, nil, 3 }) end)
        raises({ "generate_batch: prompts must be a list (1..n, no holes)" },
               function() return m:generate_batch({ { 1 }, nil, { 2 } }, { max_tokens = 1 }) end)
        raises({ "config field 'reasoning_start' must be a list (1..n, no holes)" },
               function() return m:session({ 1, 2 }, { reasoning_budget = 5, reasoning_start = { 1, nil, 3 } }) end)
    end)

    it("refuses a file path C would read otherwise, and load options out of range", function()
        local tinyloop = require "tinyloop"
        local dir = H.ROOT .. "/models/tinyloop-austen"
        -- (C reads a path up to its first NUL: "a\0b" named the file "a", and the call succeeded)
        raises({ "tinyloop.load: model directory contains a NUL byte" }, function() return tinyloop.load(dir .. "\0x") end)
        raises({ "tinyloop.load: model directory must not be empty" }, function() return tinyloop.load("") end)
        raises({ "load option 'threads' = 1000000 must be an integer in [0, 1024]" }, function() return tinyloop.load(dir, { threads = 1e6 }) end)
        local s = m:session({ 1, 2 }, { max_tokens = 1 })
        local state = s:save()
        local path = os.tmpname()
        raises({ "state:write(path): path contains a NUL byte" }, function() return state:write(path .. "\0b") end)
        raises({ "state:write(path): path must not be empty" }, function() return state:write("") end)
        assert.is_true(state:write(path))
        raises({ "model:read_state(path): path contains a NUL byte" }, function() return m:read_state(path .. "\0junk") end)
        assert.truthy(m:read_state(path))
        os.remove(path)
    end)

    it("refuses a close called with another object, which it would have freed as its own", function()
        local s = m:session({ 1, 2 }, { max_tokens = 2 })
        local state = s:save()
        -- (State.close(session) removed the session's finalizer, then failed in C's types: a leak)
        raises({ "state:close() needs its own object" }, function() return state.close(s) end)
        raises({ "model:close() needs its own object" }, function() return m.close(s) end)
        raises({ "session:close() needs its own object" }, function() return s.close(state) end)
        raises({ "session:close() needs its own object" }, function() return s.close() end)
        assert.truthy(s:step()) -- (untouched)
        s:close()
        state:close()
    end)

    it("generate_batch rejects a non-table batch and bad items", function()
        raises({ "prompts must be a table" }, function() return m:generate_batch("hi") end)
        -- (each named by its place: a bad one said only "prompt must be ...")
        raises({ "generate_batch: prompt 2 must be a string or a table of token ids" }, function() return m:generate_batch({ { 1 }, 5 }) end)
        raises({ "generate_batch: prompt 2: token id 1.5 at index 2 must be an integer" },
               function() return m:generate_batch({ { 1 }, { 1, 1.5 } }, { max_tokens = 1 }) end)
    end)

    it("encode and decode check their arguments", function()
        raises({ "text must be a string" }, function() return m:encode(5) end)
        raises({ "ids must be a table" }, function() return m:decode("abc") end)
        -- a place in the caller's list counts from 1, as every other message does (it said 2)
        raises({ "cannot decode token id 99999 at position 3" }, function() return m:decode({ 1, 2, 99999 }) end)
    end)

    it("score checks its loops and ids", function()
        raises({ "loops = 9" }, function() return m:score({ 1, 2 }, 9) end)
        raises({ "loops = 0" }, function() return m:score({ 1, 2 }, 0) end)
        raises({ "out of range" }, function() return m:score({ 1, 999 }, 1) end)
        -- past the context: refused before the n x vocab_size floats are sized (300,000 ids
        -- failed inside ffi.new with "size of C type is unknown or too large")
        local many = {}
        for i = 1, math.floor(2 ^ 31 / (4 * m:info().vocab_size)) + 1 do many[i] = 1 end
        raises({ ("score: the sequence has %d tokens: want 1 .. max_seq_len = "):format(#many) }, function() return m:score(many) end)
    end)
end)

describe("models without a tokenizer", function()
    local g = H.model("gpt2_like")

    it("encode, decode and string prompts fail with a clear message", function()
        raises({ "no tokenizer" }, function() return g:encode("hello") end)
        raises({ "tokenizer" }, function() return g:decode({ 1, 2 }) end)
        raises({ "tokenizer" }, function() return g:generate("hello", { max_tokens = 2 }) end)
    end)

    it("token-id prompts still work", function()
        local out = g:generate({ 1, 2, 3 }, { max_tokens = 2, ignore_eos = true })
        assert.equal(5, #out)
    end)
end)

describe("a Lua error in a hook", function()
    local reference = m:generate("Hello", { max_tokens = 8 })

    local function boom(kind)
        return function() error("boom in " .. kind) end
    end

    local all_allowed = function(_, mask, n) for i = 0, n - 1 do mask[i] = 1 end return n end
    local cases = {
        { "on_token", { on_token = boom("on_token") } },
        { "stop_when", { stop_when = boom("stop_when") } },
        { "logits_processor", { logits_processor = boom("logits_processor") } },
        { "grammar allowed", { grammar = { allowed = boom("grammar allowed"), advance = function() end } } },
        { "grammar advance", { grammar = { allowed = all_allowed, advance = boom("grammar advance") } } },
    }

    for _, case in ipairs(cases) do
        local kind, cfg = case[1], case[2]
        it("(" .. kind .. ") is raised with its message and traceback, and the next call works", function()
            cfg.max_tokens = 8
            local err = raises({ "boom in " .. kind, "stack traceback" }, function() return m:generate("Hello", cfg) end)
            assert.truthy(err:find("errors_spec.lua", 1, true), "the traceback shows the hook's file")
            assert.same(reference, (m:generate("Hello", { max_tokens = 8 })))
            -- the same through a session and a stream
            local s = m:session("Hello", cfg)
            raises({ "boom in " .. kind, "stack traceback" }, function() return s:step() end)
            raises({ "finished" }, function() return s:step() end)
            raises({ "boom in " .. kind }, function() for _ in m:stream("Hello", cfg) do end end)
            assert.same(reference, (m:generate("Hello", { max_tokens = 8 })))
        end)
    end

    it("raised after some tokens leaves the model usable", function()
        local n = 0
        local cfg = { max_tokens = 8, on_token = function() n = n + 1 if n == 4 then error("late failure") end end }
        raises({ "late failure" }, function() return m:generate("Hello", cfg) end)
        assert.equal(4, n)
        assert.same(reference, (m:generate("Hello", { max_tokens = 8 })))
    end)

    it("passes a non-string error value through unchanged", function()
        local obj = { code = 42 }
        local ok, err = pcall(m.generate, m, "Hello", { max_tokens = 3, on_token = function() error(obj) end })
        assert.is_false(ok)
        assert.equal(obj, err)
    end)

    it("names an error whose value is nil or false (it read as none: the engine's 'returned error -1')", function()
        for _, raised in ipairs({ function() error() end, function() error(false) end }) do
            local ok, err = pcall(m.generate, m, "Hello", { max_tokens = 3, on_token = raised })
            assert.is_false(ok)
            assert.truthy(tostring(err):find("^a hook raised an error whose value is %a+\nstack traceback"), tostring(err))
        end
        local ok, err = pcall(m.generate, m, "Hello", { max_tokens = 3, stop_when = function() error(nil) end })
        assert.is_false(ok)
        assert.truthy(tostring(err):find("a hook raised an error whose value is nil", 1, true), tostring(err))
    end)

    it("does not leak into later generations with other hooks", function()
        for i = 1, 50 do
            pcall(m.generate, m, "Hello", { max_tokens = 3, stop_when = boom("x") })
            local seen = 0
            local out = m:generate("Hello", { max_tokens = 3, on_token = function() seen = seen + 1 end })
            assert.same(H.slice(reference, 1, #out), out)
            assert.equal(3, seen)
        end
    end)

    it("a Lua grammar is refused for a batch of several prompts (its state is one sequence's)", function()
        local g = { allowed = function() return 0 end, advance = function() end }
        assert.has_error(function() m:generate_batch({ "a", "b" }, { grammar = g }) end,
                         "generate_batch: a Lua grammar holds one sequence's state and cannot serve several prompts: "
                         .. "use a compiled grammar (tinyloop.grammar), or one generate per prompt")
    end)

    it("a grammar returning a negative count is an engine error naming the hook", function()
        local cfg = { max_tokens = 8, grammar = { allowed = function() return -1 end, advance = function() end } }
        raises({ "grammar allowed", "-1" }, gen(cfg))
        assert.same(reference, (m:generate("Hello", { max_tokens = 8 })))
        -- from a session's step: raised once the session is closed (it was left to the collector)
        local s = m:session("Hello", cfg)
        raises({ "grammar allowed", "-1" }, function() return s:step() end)
        assert.is_nil(s.ptr)
        -- and named in a batch, where the thread's last error holds no session's message
        raises({ "generate_batch: prompt 1: grammar allowed hook returned error -1" },
               function() return m:generate_batch({ "Hello" }, cfg) end)
    end)
end)

-- api_spec.lua: every function of the Lua API (SPEC §3, §6) on the small text checkpoint
-- (random weights, vocab 320, byte-level BPE tokenizer, eos 319, max_seq_len 128) and the
-- token-id-only golden checkpoints.
local H = require "helpers"
local ffi = require "ffi"
local tinyloop = H.tinyloop

describe("tinyloop.load", function()
    it("loads a checkpoint with options threads, mmap_weights and backend", function()
        local m, err = tinyloop.load(H.TEXTMODEL, { threads = 1, mmap_weights = true, backend = "cpu" })
        assert.is_nil(err)
        assert.is_table(m)
        local info = m:info()
        assert.equal(1, info.n_threads)
        assert.equal("cpu", info.backend)
        local m2 = assert(tinyloop.load(H.TEXTMODEL, { threads = 2, mmap_weights = false, backend = "auto" }))
        assert.equal(2, m2:info().n_threads)
        -- copied (packed panels) or mapped (row-major), the weights give the same logits up to
        -- the summation order of the two kernel families
        local a, b = m:score({ 1, 2, 3 }, 2), m2:score({ 1, 2, 3 }, 2)
        for t = 0, 319 do assert.is_true(math.abs(a:logit(3, t) - b:logit(3, t)) < 1e-4) end
        assert.is_table(assert(tinyloop.load(H.TEXTMODEL)))
    end)

    it("maps the weights with mmap_weights (no anonymous copy), copies them without #rss", function()
        local function anon_kb()
            local f = assert(io.open("/proc/self/status"))
            local kb = tonumber(f:read("*a"):match("RssAnon:%s*(%d+)"))
            f:close()
            return kb
        end
        local grew = {}
        for _, mapped in ipairs({ true, false }) do
            H.full_gc()
            local before = anon_kb()
            local m = assert(tinyloop.load(H.ROOT .. "/models/tinyloop-austen", { threads = 1, mmap_weights = mapped }))
            grew[mapped] = { anon_kb() - before, m:info().weight_bytes / 1024 }
            m:close()
        end
        assert.is_true(grew[true][1] < grew[true][2] / 4, ("mapped: %d KiB anonymous for %d KiB of weights"):format(grew[true][1], grew[true][2]))
        assert.is_true(grew[false][1] > grew[false][2] / 2, ("copied: %d KiB anonymous for %d KiB of weights"):format(grew[false][1], grew[false][2]))
    end)

    it("keeps an f16 KV cache with kv_type = \"f16\": same greedy text here, close logits, not f32's bits", function()
        local exact = assert(tinyloop.load(H.TEXTMODEL, { threads = 1, kv_type = "f32" }))
        local half = assert(tinyloop.load(H.TEXTMODEL, { threads = 1, kv_type = "f16" }))
        assert.equal("f32", exact:info().kv_type)
        assert.equal("f16", half:info().kv_type)
        local prompt = exact:encode("It is a truth universally acknowledged")
        local a = exact:generate(prompt, { max_tokens = 24 })
        local b = half:generate(prompt, { max_tokens = 24 })
        assert.same(a, b)
        local ids = {}
        for i = 1, 40 do ids[i] = (i * 37) % 300 + 1 end
        local sa, sb = exact:score(ids, 2), half:score(ids, 2)
        local worst, differ = 0, 0
        for pos = 1, 40 do
            for t = 0, 319 do
                local d = math.abs(sa:logit(pos, t) - sb:logit(pos, t))
                if d > worst then worst = d end
                if d ~= 0 then differ = differ + 1 end
            end
        end
        assert.is_true(worst < 0.05, "largest logit difference " .. worst)
        assert.is_true(differ > 0, "f16 KV gave f32's logits bit for bit")
        -- model:memory(): the sessions above are freed, their pages kept for reuse; the same
        -- work left half the bytes with f16 pages.
        local me, mh = exact:memory(), half:memory()
        assert.equal(0, me.kv_bytes)
        assert.equal(0, mh.kv_bytes)
        assert.is_true(mh.kv_spare_bytes > 0)
        assert.equal(me.kv_spare_bytes, 2 * mh.kv_spare_bytes)
        assert.equal(exact:info().weight_bytes, me.weight_bytes)
        local s = assert(half:session(prompt, { max_tokens = 4 }))
        s:step()
        assert.is_true(half:memory().kv_bytes > 0, "a live session holds pages")
        s:close()
        -- session:max_kv_bytes(): what its pages come to at most, here exactly (16 rows, a
        -- page per layer instance, every one written), and a beam search's every beam's rows
        local fresh = assert(tinyloop.load(H.ROOT .. "/tests/data/textmodel", { kv_type = "f16" }))
        local page = assert(fresh:session({ 5, 6, 7, 8 }, { max_tokens = 12, ignore_eos = true }))
        local share = page:max_kv_bytes()
        repeat until select(3, page:step())
        assert.equal(share, fresh:memory().kv_bytes)
        local beams = assert(fresh:session({ 5, 6, 7, 8 }, { max_tokens = 12, ignore_eos = true, beam_size = 4 }))
        assert.equal(4 * share, beams:max_kv_bytes()) -- (4 + 4 x 13 rows: 4 pages)
        page:close()
        assert.equal(0, page:max_kv_bytes())
    end)

    it("exposes a version string", function()
        assert.is_string(tinyloop._VERSION)
        assert.truthy(tinyloop._VERSION:match("^%d+%.%d+%.%d+"))
    end)

    it("returns nil, err for a missing directory", function()
        local m, err = tinyloop.load(H.ROOT .. "/tests/data/no-such-model")
        assert.is_nil(m)
        assert.is_string(err)
        assert.truthy(err:find("no-such-model", 1, true))
    end)

    it("returns nil, err for a path that is not a directory", function()
        local m, err = tinyloop.load(H.TEXTMODEL .. "/config.json")
        assert.is_nil(m)
        assert.truthy(err:find("not a directory", 1, true))
    end)

    -- The error convention: argument errors raise, load failures return nil, err.
    it("raises for bad arguments: directory and options of the wrong type, unknown options", function()
        local cases = {
            { { 42 }, "model directory must be a string" },
            { { H.TEXTMODEL, "threads=1" }, "options must be a table" },
            { { H.TEXTMODEL, { thread = 1 } }, "unknown load option 'thread'" },
            { { H.TEXTMODEL, { threads = "two" } }, "'threads' must be a number" },
            { { H.TEXTMODEL, { threads = 1.5 } }, "'threads' = 1.5 must be an integer in [0, 1024]" }, -- (not an int's range)
            { { H.TEXTMODEL, { threads = 2 ^ 31 } }, "'threads' = 2147483648 must be an integer in [0, 1024]" },
            { { H.TEXTMODEL, { threads = -1 } }, "'threads' = -1 must be an integer in [0, 1024]" },
            { { H.TEXTMODEL, { threads = 1025 } }, "'threads' = 1025 must be an integer in [0, 1024]" }, -- (it was nil, err)
            { { H.TEXTMODEL, { mmap_weights = 1 } }, "'mmap_weights' must be a boolean" },
            { { H.TEXTMODEL, { backend = "gpu" } }, "'backend' must be" },
            { { H.TEXTMODEL, { kv_type = "f8" } }, "'kv_type' must be \"f32\" or \"f16\"" },
            { { H.TEXTMODEL, { kv_type = 1 } }, "'kv_type' must be" },
        }
        for _, case in ipairs(cases) do
            local ok, err = pcall(function() local m = tinyloop.load(unpack(case[1])) return m end)
            assert.is_false(ok, case[2])
            assert.truthy(tostring(err):find(case[2], 1, true), tostring(err))
            assert.truthy(tostring(err):find("api_spec.lua", 1, true), "the error points at the caller: " .. tostring(err))
        end
        -- (1024 itself is in the range: a directory that is not there is then the load's nil, err)
        local m, err = tinyloop.load(H.TEXTMODEL .. "/no-such-dir", { threads = 1024 })
        assert.is_nil(m)
        assert.truthy(err:find("no-such-dir", 1, true), err)
    end)

    it("returns nil, err for backend 'cuda' in a build without CUDA", function()
        local m, err = tinyloop.load(H.TEXTMODEL, { backend = "cuda" })
        if m then -- a CUDA build on a machine with a GPU
            assert.equal("cuda", m:info().backend)
        else
            assert.truthy(err:lower():find("cuda", 1, true))
        end
    end)
end)

describe("model:info", function()
    it("describes the text checkpoint", function()
        local i = H.model():info()
        local expect = {
            vocab_size = 320, d_model = 32, n_heads = 4, n_kv_heads = 4, head_dim = 8, d_ff = 64,
            max_seq_len = 128, n_prelude = 1, n_block = 1, n_coda = 1, default_loops = 2, max_loops = 4,
            bos_token_id = 319, eos_token_id = 319, injection = "add", loop_update = "replace",
            norm = "rmsnorm", mlp = "swiglu", pos_encoding = "rope", weight_dtype = "f16",
            state_norm = true, tie_embeddings = true, has_tokenizer = true, bias = false, backend = "cpu",
            n_threads = 1, kv_type = "f32",
        }
        for k, v in pairs(expect) do assert.equal(v, i[k], "info." .. k) end
        for _, k in ipairs({ "beta", "norm_eps", "rope_theta", "n_params", "weight_bytes" }) do
            assert.is_number(i[k], "info." .. k)
        end
        assert.is_true(i.n_params > 0)
        assert.is_true(i.weight_bytes > 0)
        assert.equal(10000, i.rope_theta)
    end)

    it("describes a token-id-only checkpoint", function()
        local i = H.model("gpt2_like"):info()
        assert.equal(96, i.vocab_size)
        assert.equal(32, i.max_seq_len)
        assert.equal(95, i.eos_token_id)
        assert.is_false(i.has_tokenizer)
    end)
end)

describe("model:encode / model:decode", function()
    local m = H.model()

    it("round-trips ASCII text", function()
        local text = "Hello, world! It is a truth universally acknowledged."
        local ids = m:encode(text)
        assert.is_true(#ids > 0)
        for _, id in ipairs(ids) do assert.is_true(id >= 0 and id < 320) end
        assert.equal(text, m:decode(ids))
    end)

    it("round-trips non-ASCII text and arbitrary bytes", function()
        for _, text in ipairs({ "wörld", "日本語のテキスト", "emoji 🙂 and ñ", "\0\1\255\254 bytes", "  spaces\n\ttabs" }) do
            assert.equal(text, m:decode(m:encode(text)))
        end
    end)

    it("handles the empty string and the end-of-text special token", function()
        assert.same({}, m:encode(""))
        assert.equal("", m:decode({}))
        assert.same({ H.EOS }, m:encode("<|endoftext|>"))
        assert.equal("<|endoftext|>", m:decode({ H.EOS }))
    end)

    it("reads a special token's text as text with parse_special = false", function()
        local text = "a<|endoftext|>b"
        local plain = m:encode(text, { parse_special = false })
        for _, id in ipairs(plain) do assert.are_not.equal(H.EOS, id) end
        assert.equal(text, m:decode(plain))
        assert.same(m:encode(text), m:encode(text, { parse_special = true }))
        assert.has_error(function() m:encode(text, { parse_specials = false }) end, "encode: unknown option 'parse_specials' (parse_special)")
        assert.has_error(function() m:encode(text, { parse_special = 0 }) end, "encode: parse_special must be a boolean")
        assert.has_error(function() m:encode(text, false) end, "encode: options must be a table")
    end)
end)

describe("model:generate", function()
    local m = H.model()

    it("returns prompt + continuation and the stats", function()
        local prompt = m:encode("The cat")
        local out, stats = m:generate(prompt, { max_tokens = 10 })
        assert.equal(#prompt + 10, #out)
        assert.same(prompt, H.slice(out, 1, #prompt))
        assert.equal("MAX_TOKENS", stats.stop_reason)
        assert.equal(10, stats.tokens_emitted)
        assert.equal(#prompt, stats.prompt_tokens)
        assert.equal(2, stats.loops_used) -- default_loops
        for _, k in ipairs({ "prefill_ms", "first_token_ms", "decode_ms", "decode_tokens_per_s", "prefill_tokens_per_s" }) do
            assert.is_number(stats[k], k)
            assert.is_true(stats[k] >= 0, k)
        end
        assert.is_true(stats.first_token_ms >= stats.prefill_ms)
        -- the prompt tokens the prefill computed: all here; beam search's all but the last,
        -- which its first step takes
        assert.equal(#prompt, stats.prefill_tokens)
        assert.equal(#prompt - 1, select(2, m:generate(prompt, { max_tokens = 2, beam_size = 2 })).prefill_tokens)
        -- the prefill's clock starts at its first row: a session that waited before its first
        -- step (as one waits in an engine's queue) had the wait counted as its prefill
        local s = m:session(prompt, { max_tokens = 1 })
        os.execute("sleep 0.5")
        s:step()
        local waited = s:stats()
        assert.is_true(waited.first_token_ms >= 500, waited.first_token_ms)
        assert.is_true(waited.prefill_ms < 250, waited.prefill_ms) -- (a 2-token prompt: about a millisecond)
        -- a string prompt is encoded with the model's tokenizer
        assert.same(out, (m:generate("The cat", { max_tokens = 10 })))
    end)

    it("takes logit_bias, presence_penalty and frequency_penalty (OpenAI's)", function()
        local prompt = m:encode("The cat")
        local plain = m:generate(prompt, { max_tokens = 12 })
        local first = plain[#prompt + 1]
        -- a ban (-100) removes the greedy choice; every mode takes the same table
        local banned = m:generate(prompt, { max_tokens = 12, logit_bias = { [first] = -100 } })
        assert.is_true(#banned > #prompt + 1, "tokens generated under the ban: " .. (#banned - #prompt))
        assert.are_not.equal(first, banned[#prompt + 1])
        for i = #prompt + 1, #banned do assert.are_not.equal(first, banned[i]) end
        local beams = m:generate(prompt, { max_tokens = 6, beam_size = 2, logit_bias = { [first] = -100 } })
        assert.is_true(#beams > #prompt, "beam tokens: " .. (#beams - #prompt))
        for i = #prompt + 1, #beams do assert.are_not.equal(first, beams[i]) end
        -- +100 forces a token at every step
        local forced = m:generate(prompt, { max_tokens = 5, logit_bias = { [42] = 100 } })
        assert.equal(#prompt + 5, #forced)
        for i = #prompt + 1, #forced do assert.equal(42, forced[i]) end
        -- the penalties against the same hook-free row, recomputed here: the step after a
        -- forced token sees it penalised once (presence) plus once per time (frequency)
        local session = m:session(prompt, { max_tokens = 3, logit_bias = { [42] = 100 }, presence_penalty = 40,
                                            frequency_penalty = 30 })
        assert.equal(42, (session:step())) -- 100 - 0: forced
        local second = session:step()      -- 100 - 30 - 40 = 30 over the model's own logits
        local context = H.copy(prompt)
        context[#context + 1] = 42
        local scores = m:score(context)
        local best, best_id = -math.huge, nil
        for t = 0, 319 do
            local l = scores:logit(#prompt + 1, t) + (t == 42 and 30 or 0)
            if l > best then best, best_id = l, t end
        end
        assert.equal(best_id, second)
        -- chain speculation decodes what plain decoding does, adjustments included
        local cfg = { max_tokens = 16, loops = 4, presence_penalty = 0.8, frequency_penalty = 0.5,
                      logit_bias = { [first] = -3 } }
        local want = m:generate(prompt, cfg)
        cfg.speculative, cfg.draft_loops = "chain", 2
        assert.same(want, (m:generate(prompt, cfg)))
    end)

    it("takes penalty_window (llama.cpp's repeat_last_n): the penalty over the last N tokens only", function()
        local prompt = m:encode("The cat sat on the mat")
        -- the same rule written here as a logits processor: HF's penalty, once per distinct
        -- token among the last `window` of the whole sequence (the prompt's included)
        local function windowed_penalty(penalty, window)
            return function(logits, _, tokens)
                local seen = {}
                for i = math.max(1, #tokens - window + 1), #tokens do
                    local t = tokens[i]
                    if not seen[t] then
                        seen[t] = true
                        logits[t] = logits[t] < 0 and logits[t] * penalty or logits[t] / penalty
                    end
                end
            end
        end
        local whole = m:generate(prompt, { max_tokens = 24, repetition_penalty = 4 })
        local outs = {}
        for _, window in ipairs({ 1, 3, 8 }) do
            local out = m:generate(prompt, { max_tokens = 24, repetition_penalty = 4, penalty_window = window })
            assert.same(m:generate(prompt, { max_tokens = 24, logits_processor = windowed_penalty(4, window) }), out)
            outs[#outs + 1] = table.concat(out, ",")
        end
        assert.are_not.equal(outs[1], outs[3]) -- (the windows make a difference: the test's strength)
        assert.are_not.equal(table.concat(whole, ","), outs[2])
        -- a window as long as the sequence is the whole sequence (errors_spec: a negative one)
        assert.same(whole, (m:generate(prompt, { max_tokens = 24, repetition_penalty = 4, penalty_window = #prompt + 24 })))
    end)

    it("takes min_p and min_tokens (vLLM's)", function()
        local prompt = m:encode("The cat")
        local greedy = m:generate(prompt, { max_tokens = 12, ignore_eos = true })
        -- min_p = 1 keeps only the most likely token: any seed samples the greedy tokens
        local unlike = false
        for seed = 1, 3 do
            local cfg = { max_tokens = 12, ignore_eos = true, temperature = 1, top_k = 320, sample_seed = seed }
            local sampled = m:generate(prompt, cfg)
            for i = 1, #greedy do unlike = unlike or sampled[i] ~= greedy[i] end
            cfg.min_p = 1
            assert.same(greedy, (m:generate(prompt, cfg)))
        end
        assert.is_true(unlike) -- without min_p some seed does not (the test's strength)
        -- min_tokens: eos, every step's favourite here, waits for four tokens
        local eos = m:info().eos_token_id
        local out, stats = m:generate(prompt, { max_tokens = 12, logit_bias = { [eos] = 100 } })
        assert.equal(#prompt + 1, #out)
        out, stats = m:generate(prompt, { max_tokens = 12, min_tokens = 4, logit_bias = { [eos] = 100 } })
        assert.equal(#prompt + 5, #out)
        assert.equal(eos, out[#out])
        assert.equal("EOS", stats.stop_reason)
        -- a stop string the first new token completes waits for the fourth token at least
        local first_text = m:decode({ greedy[#prompt + 1] })
        assert.is_true(#first_text > 0)
        local cfg = { max_tokens = 12, ignore_eos = true, stop_strings = { first_text } }
        out = m:generate(prompt, cfg)
        assert.equal(#prompt + 1, #out)
        -- with min_tokens 4 (vLLM's rule): the first match that ends in the text of the fifth
        -- token or later (one ending in the fourth's stopped it)
        local function first_stop(min_tokens) -- (the token whose text ends the first match)
            for k = min_tokens + 1, 12 do
                local before = m:decode({ unpack(greedy, #prompt + 1, #prompt + k - 1) })
                local now = m:decode({ unpack(greedy, #prompt + 1, #prompt + k) })
                if now:find(first_text, math.max(1, #before - #first_text + 2), true) then return k end
            end
            return 12
        end
        cfg.min_tokens = 4
        out = m:generate(prompt, cfg)
        assert.equal(#prompt + first_stop(4), #out)
        assert.same({ unpack(greedy, 1, #out) }, out)
        -- the min_tokens-th token completing the stop string is no stop: min_tokens 1 and the
        -- first token's text (it stopped there), nor is that match seen a token late
        cfg.min_tokens = 1
        out = m:generate(prompt, cfg)
        assert.is_true(#out > #prompt + 1, "stopped on the min_tokens-th token")
        assert.equal(#prompt + first_stop(1), #out)
        -- a match that starts in the first min_tokens tokens' text and ends after it stops (vLLM
        -- searches back from the new text by the stop string's length)
        local second_text = m:decode({ greedy[#prompt + 2] })
        assert.is_true(#second_text > 0)
        cfg.stop_strings = { first_text:sub(-1) .. second_text:sub(1, 1) }
        out = m:generate(prompt, cfg)
        assert.equal(#prompt + 2, #out, "a stop string across the min_tokens-th token's end")
        -- a match the min_tokens rule hid is not seen a token later either: the first token's
        -- text, never again (forced texts "a", "b", "c", ...; a search that began one byte
        -- early stopped on the second)
        local forced = {}
        for k = 1, 6 do forced[k] = m:encode(string.char(96 + k))[1] end
        local step = 0
        out = m:generate(prompt, {
            max_tokens = 6, min_tokens = 1, stop_strings = { "a" },
            logits_processor = function(logits) step = step + 1 logits[forced[step]] = 1e9 end,
        })
        assert.equal("abcdef", m:decode({ unpack(out, #prompt + 1) }))
    end)

    it("reports the loop depth used", function()
        for loops = 1, 4 do
            local _, stats = m:generate("Hi", { max_tokens = 3, loops = loops })
            assert.equal(loops, stats.loops_used)
        end
    end)

    it("returns only the prompt for max_tokens = 0", function()
        local out, stats = m:generate({ 5, 6, 7 }, { max_tokens = 0 })
        assert.same({ 5, 6, 7 }, out)
        assert.equal(0, stats.tokens_emitted)
        assert.equal("MAX_TOKENS", stats.stop_reason)
    end)

    it("names every stop reason with its string", function()
        local p = m:encode("Hi")
        local a, b = m:encode("a")[1], m:encode("b")[1]
        local _, s = m:generate(p, { max_tokens = 4, logits_processor = H.forcer({ a, H.EOS, b }, #p) })
        assert.equal("EOS", s.stop_reason)
        assert.equal(2, s.tokens_emitted)
        _, s = m:generate(p, { max_tokens = 4, stop_sequences = { { b } }, logits_processor = H.forcer({ a, b, a }, #p) })
        assert.equal("STOP_SEQUENCE", s.stop_reason)
        _, s = m:generate(p, { max_tokens = 4 })
        assert.equal("MAX_TOKENS", s.stop_reason)
        _, s = m:generate(p, { max_tokens = 4, on_token = function() return false end })
        assert.equal("CALLBACK_ABORT", s.stop_reason)
        _, s = m:generate(p, { max_tokens = 4, grammar = { allowed = function() return 0 end, advance = function() end } })
        assert.equal("GRAMMAR_DEAD_END", s.stop_reason)
    end)

    it("keeps the eos token in the output, or goes past it with ignore_eos", function()
        local p = m:encode("Hi")
        local seq = { 7, H.EOS, 8 }
        local out, s = m:generate(p, { max_tokens = 3, logits_processor = H.forcer(seq, #p) })
        assert.same({ 7, H.EOS }, H.slice(out, #p + 1))
        assert.equal("EOS", s.stop_reason)
        out, s = m:generate(p, { max_tokens = 3, ignore_eos = true, logits_processor = H.forcer(seq, #p) })
        assert.same(seq, H.slice(out, #p + 1))
        assert.equal("MAX_TOKENS", s.stop_reason)
    end)

    it("greedy decoding follows the argmax chain of model:score at the same loops", function()
        -- golden checkpoints whose greedy chains do not collapse into a repeated token
        for _, case in ipairs({ { "deep_residual", { 1, 8, 32 } }, { "llama_like", { 1 } }, { "concat_residual_mqa", { 1, 5, 10 } } }) do
            local g = H.model(case[1])
            for _, loops in ipairs(case[2]) do
                local prompt = { 2, 3, 4 }
                local out = g:generate(prompt, { max_tokens = 20, loops = loops, ignore_eos = true })
                assert.equal(23, #out)
                local sc = g:score(out, loops)
                for i = #prompt, #out - 1 do
                    assert.equal(sc:argmax(i), out[i + 1], case[1] .. " loops " .. loops .. " position " .. i)
                end
            end
        end
        -- and one greedy token after every prefix of a sampled sequence of the text model
        local seq = m:generate("The cat", { max_tokens = 24, temperature = 1, sample_seed = 7 })
        for _, loops in ipairs({ 1, 2, 4 }) do
            local sc = m:score(seq, loops)
            for i = 1, #seq do
                local out = m:generate(H.slice(seq, 1, i), { max_tokens = 1, loops = loops })
                assert.equal(sc:argmax(i), out[i + 1], "loops " .. loops .. " prefix " .. i)
            end
        end
    end)

    it("samples deterministically: same seed same tokens, different seeds differ", function()
        local cfg = { max_tokens = 24, temperature = 1.0, sample_seed = 42 }
        local a = m:generate("Once upon", cfg)
        local b = m:generate("Once upon", cfg)
        assert.same(a, b)
        local c = m:generate("Once upon", { max_tokens = 24, temperature = 1.0, sample_seed = 43 })
        local d = m:generate("Once upon", { max_tokens = 24, temperature = 1.0, sample_seed = 44 })
        assert.are_not.same(a, c)
        assert.are_not.same(c, d)
        -- top_k = 1 is greedy whatever the temperature
        assert.same(m:generate("Once upon", { max_tokens = 8 }),
                    m:generate("Once upon", { max_tokens = 8, temperature = 1.5, top_k = 1, sample_seed = 9 }))
    end)
end)

describe("model:stream", function()
    local m = H.model()

    it("runs README's Lua example as it is written: the shipped model's text, then its stop reason and speed", function()
        -- (the first ```lua block of README, saved as example.lua and run from the repository's
        -- root with lua/ on package.path, as its first line says)
        local readme = assert(io.open(H.ROOT .. "/README.md")):read("*a")
        local example = assert(readme:match("```lua\n(.-)```"), "README's Lua example")
        assert.truthy(example:find("luajit example.lua", 1, true), example)
        local dir = H.sh("mktemp -d"):gsub("%s+$", "")
        local f = assert(io.open(dir .. "/example.lua", "wb")); f:write(example); f:close()
        local out = H.sh(("cd %s && LUA_PATH='lua/?.lua;lua/?/init.lua;;' luajit %s/example.lua 2>&1; echo \"rc=$?\"")
                         :format(H.q(H.ROOT), H.q(dir)))
        os.execute("rm -rf " .. H.q(dir))
        assert.truthy(out:find("\nrc=0\n?$"), out)
        local text, reason, speed = out:match("^(.-)\n%[([%u_]+), ([%d.]+) tok/s%]\nrc=0")
        assert.truthy(text, out)
        assert.truthy(#text > 20, out)
        -- (80 tokens, the model's end, or the blank line of stop_strings)
        assert.truthy(reason == "MAX_TOKENS" or reason == "EOS" or reason == "STOP_SEQUENCE", reason)
        assert.is_true(tonumber(speed) > 0, out)
    end)

    local function collect(it)
        local ids, pieces = {}, {}
        for id, text in it do
            ids[#ids + 1] = id
            pieces[#pieces + 1] = text
        end
        return ids, table.concat(pieces)
    end

    it("yields special tokens' text with keep_special_text, never the one that ends generation", function()
        -- (H.model(): the small test model, whose <|endoftext|> is 319, special)
        local cfg = { max_tokens = 3, logit_bias = { [319] = 100 }, ignore_eos = true }
        local ids, text = collect(m:stream("Hello", cfg))
        assert.same({ { 319, 319, 319 }, "" }, { ids, text })
        cfg.keep_special_text = true
        ids, text = collect(m:stream("Hello", cfg))
        assert.same({ { 319, 319, 319 }, ("<|endoftext|>"):rep(3) }, { ids, text })
        cfg.ignore_eos = false
        assert.same({ { 319 }, "" }, { collect(m:stream("Hello", cfg)) })
        H.error_contains(function() m:generate("Hello", { keep_special_text = 1 }) end,
                         "config field 'keep_special_text' must be a boolean")
    end)

    it("yields the continuation's tokens, whose text pieces concatenate to its decoding", function()
        for seed = 1, 4 do
            local cfg = { max_tokens = 30, temperature = 1.0, sample_seed = seed }
            local out = m:generate("Hello", cfg)
            local prompt_len = #m:encode("Hello")
            local it, session = m:stream("Hello", cfg)
            local ids, text = collect(it)
            local cont = H.slice(out, prompt_len + 1)
            assert.same(cont, ids)
            -- special tokens (end of text) contribute no text to the stream
            assert.equal(m:decode(H.without(cont, H.EOS)), text)
            assert.same(out, session:tokens())
        end
    end)

    it("holds back an unfinished UTF-8 sequence until it is complete", function()
        local p = m:encode("Hi")
        local o = m:encode("ö") -- two byte tokens, 0xC3 then 0xB6
        assert.equal(2, #o)
        local pieces = {}
        for id, text in m:stream(p, { max_tokens = 3, logits_processor = H.forcer({ o[1], o[2], 120 }, #p) }) do
            pieces[#pieces + 1] = text
        end
        assert.same({ "", "ö", "x" }, pieces)
    end)

    it("returns the session as its second value, with :stats()", function()
        local it, session = m:stream("Hello", { max_tokens = 5 })
        local n = 0
        for _ in it do n = n + 1 end
        assert.equal(5, n)
        local stats = session:stats()
        assert.equal("MAX_TOKENS", stats.stop_reason)
        assert.equal(5, stats.tokens_emitted)
    end)

    it("yields nothing for max_tokens = 0", function()
        local ids = collect((m:stream({ 1, 2 }, { max_tokens = 0 })))
        assert.same({}, ids)
    end)

    it("can be driven from coroutines that yield between tokens", function()
        local cfgs = {
            { max_tokens = 12, temperature = 1.0, sample_seed = 3 },
            { max_tokens = 9 },
            { max_tokens = 15, temperature = 0.7, sample_seed = 11, on_token = function() end },
        }
        local prompts = { "Hello", "The cat", "Once upon" }
        local cos, got, order = {}, {}, {}
        for i = 1, 3 do
            got[i] = {}
            cos[i] = coroutine.wrap(function()
                for id in m:stream(prompts[i], cfgs[i]) do
                    got[i][#got[i] + 1] = id
                    coroutine.yield(true)
                end
                return false
            end)
        end
        -- round-robin: the three streams interleave token by token
        local live = 3
        local alive = { true, true, true }
        while live > 0 do
            for i = 1, 3 do
                if alive[i] then
                    if cos[i]() then
                        order[#order + 1] = i
                    else
                        alive[i], live = false, live - 1
                    end
                end
            end
        end
        assert.same({ 1, 2, 3, 1, 2, 3 }, H.slice(order, 1, 6))
        for i = 1, 3 do
            local out = m:generate(prompts[i], cfgs[i])
            assert.same(H.slice(out, #m:encode(prompts[i]) + 1), got[i])
        end
    end)

    it("works on a model without tokenizer (empty text pieces)", function()
        local g = H.model("gpt2_like")
        local ids = {}
        for id, text in g:stream({ 1, 2, 3 }, { max_tokens = 4, ignore_eos = true }) do
            assert.equal("", text)
            ids[#ids + 1] = id
        end
        assert.same(H.slice(g:generate({ 1, 2, 3 }, { max_tokens = 4, ignore_eos = true }), 4), ids)
    end)
end)

describe("model:generate_batch", function()
    local m = H.model()

    it("gives each prompt the output of its own generate", function()
        local prompts = { "Hello", { 1, 2, 3 }, "The cat sat on the mat", { 200 } }
        for _, cfg in ipairs({ { max_tokens = 8 }, { max_tokens = 8, temperature = 0.9, sample_seed = 5 } }) do
            local outs, stats = m:generate_batch(prompts, cfg)
            assert.equal(#prompts, #outs)
            assert.equal(#prompts, #stats)
            for i, p in ipairs(prompts) do
                local out, st = m:generate(p, cfg)
                assert.same(out, outs[i])
                assert.equal(st.stop_reason, stats[i].stop_reason)
                assert.equal(st.tokens_emitted, stats[i].tokens_emitted)
            end
        end
    end)

    it("returns empty lists for an empty batch", function()
        local outs, stats = m:generate_batch({}, { max_tokens = 4 })
        assert.same({}, outs)
        assert.same({}, stats)
    end)

    it("is one engine call, which validates every prompt before decoding any", function()
        local calls = 0
        local ok, err = pcall(m.generate_batch, m, { { 1, 2 }, { 3 }, { 4, 400 } },
                              { max_tokens = 4, on_token = function() calls = calls + 1 end })
        assert.is_false(ok)
        -- (the third prompt, its second token: the engine's 0-based places shown as Lua counts)
        assert.truthy(tostring(err):find("generate_batch: prompt 3: prompt token id 400 at index 2", 1, true), tostring(err))
        assert.truthy(tostring(err):find("400", 1, true), tostring(err))
        assert.equal(0, calls)
    end)

    it("rejects a huge max_tokens by name before allocating the output", function()
        for _, n in ipairs({ 3e8, 2e9 }) do
            local t0 = os.clock()
            local ok, err = pcall(m.generate_batch, m, { { 1 }, { 2, 3 } }, { max_tokens = n })
            assert.is_false(ok)
            assert.truthy(tostring(err):find(("max_tokens = %d must be in [0, max_seq_len = 128]"):format(n), 1, true), tostring(err))
            assert.is_true(os.clock() - t0 < 0.1, "no huge allocation")
        end
        local ok, err = pcall(m.generate_batch, m, { { 1 } }, { max_tokens = -1 })
        assert.is_false(ok)
        assert.truthy(tostring(err):find("max_tokens = -1", 1, true), tostring(err))
    end)

    it("runs hooks on each prompt's own sequence: tokens and stop_when's text per prompt", function()
        local x = m:encode("x")[1]
        -- prompt 2 is exactly as long as prompt 1 plus its output: positions alone could not
        -- tell the sequences apart; the prompts decode together, so calls interleave
        local prompts = { { 1, 2, 3 }, { 4, 5, 6, 7, 8 }, { 9 } }
        local positions, texts, lengths = {}, {}, {}
        local outs, stats = m:generate_batch(prompts, {
            max_tokens = 2,
            logits_processor = function(logits) logits[x] = 1e9 end,
            on_token = function(_, position) positions[#positions + 1] = position end,
            stop_when = function(tokens, text)
                local first = tokens[1] -- which prompt: each starts with its own id
                texts[first] = (texts[first] or "") .. "|" .. text
                lengths[first] = (lengths[first] or "") .. "|" .. #tokens
            end,
        })
        table.sort(positions)
        assert.same({ 1, 2, 3, 4, 5, 6 }, positions)
        assert.same({ [1] = "|x|xx", [4] = "|x|xx", [9] = "|x|xx" }, texts)
        assert.same({ [1] = "|4|5", [4] = "|6|7", [9] = "|2|3" }, lengths)
        for i, p in ipairs(prompts) do
            assert.same(p, H.slice(outs[i], 1, #p))
            assert.same({ x, x }, H.slice(outs[i], #p + 1))
            assert.equal("MAX_TOKENS", stats[i].stop_reason)
            assert.equal(#p, stats[i].prompt_tokens)
        end
    end)

    it("a stop rule stops each prompt on its own", function()
        local outs, stats = m:generate_batch({ "Hello", "The cat", "Hi" }, {
            max_tokens = 10, stop_when = function(_, text) return #text >= 3 end,
        })
        for i = 1, 3 do
            assert.equal("CALLBACK_ABORT", stats[i].stop_reason)
            assert.is_true(#m:decode(H.slice(outs[i], stats[i].prompt_tokens + 1)) >= 3)
        end
    end)

    it("runs beam searches (beam_size >= 2)", function()
        local g = H.model("add_residual_statenorm_rms_gqa2")
        local cfg = { max_tokens = 6, beam_size = 3, length_penalty = 0.8 }
        local prompts = { { 5, 6, 7 }, { 1 }, { 2, 3 } }
        local outs, stats = g:generate_batch(prompts, cfg)
        for i, p in ipairs(prompts) do
            local out, st = g:generate(p, cfg)
            assert.same(out, outs[i])
            assert.equal(st.beam_score, stats[i].beam_score)
        end
    end)
end)

describe("session:logprobs", function()
    local m = H.model()

    it("gives the last token's log-probability and its top alternatives, as model:score's row says", function()
        local prompt = m:encode("The cat")
        local s = m:session(prompt, { max_tokens = 6, temperature = 1.2, sample_seed = 3, ignore_eos = true })
        local tokens, lps, tops = {}, {}, {}
        while true do
            local id, _, reason = s:step()
            tokens[#tokens + 1] = id
            local lp, alternatives = s:logprobs(3)
            lps[#lps + 1], tops[#tops + 1] = lp, alternatives
            assert.equal(3, #alternatives)
            if reason then break end
        end
        local seq = H.slice(prompt, 1, #prompt)
        for _, id in ipairs(tokens) do seq[#seq + 1] = id end
        local sc = m:score(seq)
        for k = 1, #tokens do
            local row = #prompt + k - 1
            local mx, sum = -math.huge, 0
            for t = 0, sc.vocab_size - 1 do mx = math.max(mx, sc:logit(row, t)) end
            for t = 0, sc.vocab_size - 1 do sum = sum + math.exp(sc:logit(row, t) - mx) end
            local log_z = mx + math.log(sum)
            assert.near(sc:logit(row, tokens[k]) - log_z, lps[k], 1e-5)
            assert.equal(sc:argmax(row), tops[k][1].id)
            for j, alt in ipairs(tops[k]) do
                assert.near(sc:logit(row, alt.id) - log_z, alt.logprob, 1e-5)
                if j > 1 then assert.is_true(alt.logprob <= tops[k][j - 1].logprob) end
            end
        end
        -- without top: the log-probability and an empty list
        local lp, none = s:logprobs()
        assert.equal(lps[#lps], lp)
        assert.same({}, none)
        -- model:score_logprobs gives the sequence the same figures (the same bits here)
        local scored, alternatives = m:score_logprobs(seq, nil, 3)
        assert.equal(#seq - 1, #scored)
        for k = 1, #tokens do
            assert.equal(lps[k], scored[#prompt + k - 1])
            assert.same(tops[k], alternatives[#prompt + k - 1])
        end
        local plain = m:score_logprobs(seq)
        assert.same(scored, plain)
        assert.has_error(function() m:score_logprobs(seq, nil, 21) end, "tl_score_logprobs: top = 21 must be in [0, 20]")
        -- (checked before the buffers are sized: a wild top is the same message, not an ffi error)
        assert.has_error(function() m:score_logprobs(seq, nil, 300000000) end, "tl_score_logprobs: top = 300000000 must be in [0, 20]")
        -- a sequence past the context, refused before the rows it would size (2e7 ids took 3.4 GB first)
        local long = {}
        for k = 1, m:info().max_seq_len + 1 do long[k] = 1 end
        assert.has_error(function() m:score_logprobs(long, nil, 20) end,
                         ("score_logprobs: the sequence has %d tokens: want 1 .. max_seq_len = %d"):format(#long, #long - 1))
        assert.has_error(function() m:score_logprobs(seq, 0) end)
    end)

    it("raises before a token, for a bad top, a closed session and a beam one", function()
        local s = m:session({ 1, 2, 3 }, { max_tokens = 2 })
        assert.has_error(function() s:logprobs() end, "tl_session_logprobs: the last step emitted no token")
        s:step()
        assert.has_error(function() s:logprobs(21) end, "tl_session_logprobs: top = 21 must be in [0, 20]")
        assert.has_error(function() s:logprobs(1.5) end)
        s:close()
        assert.has_error(function() s:logprobs() end, "session:logprobs(): the session is closed")
        local beam = m:session({ 1, 2, 3 }, { max_tokens = 2, beam_size = 2 })
        beam:step()
        assert.has_error(function() beam:logprobs() end,
            "tl_session_logprobs: a beam session chooses its tokens from rows it does not keep (plain or speculative decoding only)")
    end)

    it("gives a speculative session's tokens their verification rows' figures: plain decoding's", function()
        local cfg = { max_tokens = 10, loops = 3, ignore_eos = true }
        local plain = m:session({ 1, 2, 3 }, cfg)
        cfg.speculative, cfg.draft_loops, cfg.draft_ahead = "chain", 1, 3
        local spec = m:session({ 1, 2, 3 }, cfg)
        for _ = 1, 10 do
            assert.equal(plain:step(), spec:step())
            local a, alternatives = plain:logprobs(3)
            local b, spec_alternatives = spec:logprobs(3)
            assert.equal(a, b)
            assert.same(alternatives, spec_alternatives)
        end
    end)
end)

describe("model:score", function()
    local m = H.model()

    it("holds results past LuaJIT's FFI arrays (2^31 bytes) in malloc's memory: the same values", function()
        -- (the limit lowered for the test: a 152k vocabulary's scores passed it at ~3,500 ids,
        -- "size of C type is unknown or too large")
        local ids = m:encode("The cat sat on the mat")
        local small = assert(m:score(ids, 2))
        local emb = assert(m:embed(ids, { pooling = "none" }))
        local batch = assert(m:embed_batch({ ids, { 5, 6 } }, { pooling = "none" }))
        local limits = tinyloop._limits
        local saved = limits.ffi_array_bytes
        limits.ffi_array_bytes = 64
        local ok, err = pcall(function()
            local big = assert(m:score(ids, 2))
            assert.is_false(ffi.istype("float[?]", big.data)) -- (the other allocation)
            for i = 1, big.n do
                for t = 0, big.vocab_size - 1 do assert.equal(small:logit(i, t), big:logit(i, t)) end
                assert.equal(small:argmax(i), big:argmax(i))
            end
            assert.same(emb, assert(m:embed(ids, { pooling = "none" })))
            assert.same(batch, assert(m:embed_batch({ ids, { 5, 6 } }, { pooling = "none" })))
        end)
        limits.ffi_array_bytes = saved
        assert(ok, err)
    end)

    it("frees the malloc'd results a loop drops, though the collector sees a pointer's bytes #rss", function()
        local function resident_mb() return H.rss_kb() / 1024 end
        local ids = {}
        for i = 1, 128 do ids[i] = i end
        local limits = tinyloop._limits
        local saved = limits.ffi_array_bytes
        limits.ffi_array_bytes = 64
        collectgarbage()
        local before = resident_mb()
        local ok, err = pcall(function()
            for _ = 1, 3000 do assert(m:score(ids, 1)) end -- (160 KB of results each: 480 MB in all)
        end)
        limits.ffi_array_bytes = saved
        assert(ok, err)
        local grew = resident_mb() - before
        assert.truthy(grew < 40, ("%.1f MB more resident after 3000 dropped results"):format(grew))
    end)

    it("gives n x vocab_size logits with logit, argmax, n and vocab_size", function()
        local ids = m:encode("The cat sat")
        local sc = m:score(ids, 2)
        assert.equal(#ids, sc.n)
        assert.equal(320, sc.vocab_size)
        for i = 1, sc.n do
            local best, best_t = -math.huge, nil
            for t = 0, sc.vocab_size - 1 do
                local l = sc:logit(i, t)
                assert.is_number(l)
                if l > best then best, best_t = l, t end
            end
            assert.equal(best_t, sc:argmax(i))
        end
        -- a position that is no integer is named (a Lua error from inside the bindings; 1.5 was taken)
        H.error_contains(function() sc:argmax() end, "scores:argmax: position must be a number")
        H.error_contains(function() sc:argmax("2") end, "scores:argmax: position must be a number")
        H.error_contains(function() sc:argmax(1.5) end, "scores:argmax: position = 1.5 must be an integer")
        -- a string is encoded; the default depth is default_loops
        local s2 = m:score("The cat sat")
        for t = 0, 319, 17 do assert.equal(sc:logit(sc.n, t), s2:logit(sc.n, t)) end
        -- a row depends only on its prefix
        local s3 = m:score(H.slice(ids, 1, 2), 2)
        for t = 0, 319, 13 do assert.equal(sc:logit(2, t), s3:logit(2, t)) end
    end)

    it("says where the model's logits turn NaN or infinite (an overflow): argmax, score_logprobs and generation", function()
        -- deep_residual with token 0's head row +-3e38 in turn: inf - inf, a NaN at token 0 in
        -- some rows of finite logits (argmax took row[0]'s NaN for the best: token 0)
        local dir = os.tmpname()
        os.remove(dir)
        H.sh("cp -r " .. H.q(H.GOLDEN .. "/deep_residual") .. " " .. dir)
        local bytes = H.read(dir .. "/model.safetensors")
        local header_len = tonumber(ffi.cast("const uint64_t *", bytes)[0])
        local begin = tonumber(bytes:match('"lm_head.weight":{[^}]-"data_offsets":%[(%d+),'))
        local row = ffi.new("float[32]") -- (d_model 32, F32)
        for j = 0, 31 do row[j] = j % 2 == 1 and -3e38 or 3e38 end
        local at = 8 + header_len + begin
        local f = assert(io.open(dir .. "/model.safetensors", "wb"))
        f:write(bytes:sub(1, at), ffi.string(row, 128), bytes:sub(at + 129))
        f:close()
        local edited = assert(tinyloop.load(dir, { threads = 1 }))
        H.sh("rm -rf " .. dir)
        local ids = { 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 }
        local sc = assert(edited:score(ids, 8))
        -- (a row whose products had one sign overflowed to an infinity instead: refused too)
        local nan_rows, inf_rows, finite_rows, first_bad = 0, 0, 0, nil
        for i = 1, sc.n do
            local logit0 = sc:logit(i, 0)
            local best, err = sc:argmax(i)
            local kind = logit0 ~= logit0 and "NaN" or logit0 == math.huge and "inf" or logit0 == -math.huge and "-inf"
            if kind then
                first_bad = first_bad or { i, kind }
                if kind == "NaN" then nan_rows = nan_rows + 1 else inf_rows = inf_rows + 1 end
                assert.is_nil(best)
                assert.equal(("scores:argmax(%d): the model gave non-finite logits (%s) there: its activations overflow")
                    :format(i, kind), err)
                if kind == "NaN" and nan_rows == 1 then
                    local out, gen_err = edited:generate(H.slice(ids, 1, i), { max_tokens = 3 })
                    assert.is_nil(out)
                    assert.truthy(gen_err:find("non-finite logits (NaN) at token 1", 1, true), gen_err)
                end
            else
                finite_rows = finite_rows + 1
                assert.is_number(best)
            end
        end
        local logprobs, lp_err = edited:score_logprobs(ids, 8)
        assert.is_nil(logprobs)
        assert.truthy(lp_err:find(("non-finite logits (%s) at position %d:"):format(first_bad[2], first_bad[1]), 1, true),
                      lp_err) -- (from 1)
        assert.truthy(nan_rows > 0 and inf_rows > 0,
                      nan_rows .. " rows with a NaN, " .. inf_rows .. " with an infinity")
        edited:close()
    end)

    it("depends on the loop depth", function()
        local a, b = m:score({ 1, 2, 3 }, 1), m:score({ 1, 2, 3 }, 4)
        local differ = false
        for t = 0, 319 do if a:logit(3, t) ~= b:logit(3, t) then differ = true end end
        assert.is_true(differ)
    end)

    it("raises on out-of-range rows and token ids", function()
        local sc = m:score({ 1, 2, 3 }, 2)
        assert.has_error(function() sc:logit(0, 0) end, "scores:logit(0, 0) out of range")
        assert.has_error(function() sc:logit(4, 0) end, "scores:logit(4, 0) out of range")
        assert.has_error(function() sc:logit(1, -1) end, "scores:logit(1, -1) out of range")
        assert.has_error(function() sc:logit(1, 320) end, "scores:logit(1, 320) out of range")
        assert.has_error(function() sc:argmax(0) end, "scores:argmax(0) out of range")
        assert.has_error(function() sc:argmax(4) end, "scores:argmax(4) out of range")
    end)
end)

describe("model:session", function()
    local m = H.model()

    it("steps through the same tokens as generate", function()
        for _, cfg in ipairs({ { max_tokens = 10 }, { max_tokens = 10, temperature = 0.8, sample_seed = 21, loops = 3 } }) do
            local out, stats = m:generate("Hello", cfg)
            local s = m:session("Hello", cfg)
            local ids, reason = {}, nil
            repeat
                local id, text, r = s:step()
                assert.is_string(text)
                ids[#ids + 1] = id
                reason = r
            until reason
            assert.equal("MAX_TOKENS", reason)
            assert.same(out, s:tokens())
            assert.same(H.slice(out, #out - 9), ids)
            local st = s:stats()
            assert.equal(stats.tokens_emitted, st.tokens_emitted)
            assert.equal(stats.stop_reason, st.stop_reason)
            assert.equal(stats.loops_used, st.loops_used)
            s:close()
            s:close() -- closing twice is harmless
        end
    end)

    it("reports progress before the end and no stop reason yet", function()
        local s = m:session({ 1, 2 }, { max_tokens = 5 })
        local id, _, reason = s:step()
        assert.is_number(id)
        assert.is_falsy(reason)
        assert.same({ 1, 2, id }, s:tokens())
        local st = s:stats()
        assert.equal(1, st.tokens_emitted)
        assert.is_nil(st.stop_reason)
        s:close()
    end)

    it("refuses to step a finished session", function()
        local s = m:session({ 1, 2 }, { max_tokens = 1 })
        local _, _, reason = s:step()
        assert.equal("MAX_TOKENS", reason)
        assert.has_error(function() s:step() end)
        local ok, err = pcall(s.step, s)
        assert.is_false(ok)
        assert.truthy(tostring(err):find("finished", 1, true))
    end)

    it("reports id -1 when it ends without emitting", function()
        local s = m:session({ 1, 2 }, { max_tokens = 0 })
        local id, text, reason = s:step()
        assert.equal(-1, id)
        assert.equal("", text)
        assert.equal("MAX_TOKENS", reason)
    end)
end)

describe("stop_sequences and stop_strings", function()
    local m = H.model()
    local p = m:encode("Hi")
    local x, a, b, c = m:encode("x")[1], m:encode("a")[1], m:encode("b")[1], m:encode("c")[1]
    local forced = { x, a, b, c, x, a }

    it("stop_sequences stop on a token-id suffix, kept in the output", function()
        local out, s = m:generate(p, { max_tokens = 6, stop_sequences = { { c, c }, { a, b } }, logits_processor = H.forcer(forced, #p) })
        assert.same({ x, a, b }, H.slice(out, #p + 1))
        assert.equal("STOP_SEQUENCE", s.stop_reason)
        -- a sequence that never appears does not stop
        out, s = m:generate(p, { max_tokens = 6, stop_sequences = { { b, a } }, logits_processor = H.forcer(forced, #p) })
        assert.same(forced, H.slice(out, #p + 1))
        assert.equal("MAX_TOKENS", s.stop_reason)
    end)

    it("a stop string matches across token boundaries", function()
        local cfg = { max_tokens = 6, stop_strings = { "zz", "ab" }, logits_processor = H.forcer(forced, #p) }
        local out, s = m:generate(p, cfg)
        assert.same({ x, a, b }, H.slice(out, #p + 1))
        assert.equal("STOP_SEQUENCE", s.stop_reason)
        -- the stream holds back "a" (it may start "ab") and shows the whole match at the end
        local pieces = {}
        for _, text in m:stream(p, cfg) do pieces[#pieces + 1] = text end
        assert.same({ "x", "", "ab" }, pieces)
        -- a multi-token stop string ending inside a token
        out, s = m:generate(p, { max_tokens = 6, stop_strings = { "bcx" }, logits_processor = H.forcer(forced, #p) })
        assert.same({ x, a, b, c, x }, H.slice(out, #p + 1))
        assert.equal("STOP_SEQUENCE", s.stop_reason)
    end)

    it("a stop string absent from the text does not stop, and held-back text is released", function()
        local pieces = {}
        local cfg = { max_tokens = 6, stop_strings = { "ac" }, logits_processor = H.forcer(forced, #p) }
        for _, text in m:stream(p, cfg) do pieces[#pieces + 1] = text end
        assert.equal("xabcxa", table.concat(pieces))
        assert.equal("MAX_TOKENS", select(2, m:generate(p, cfg)).stop_reason)
    end)
end)

-- In plain LuaJIT subprocesses: busted's own wrapper of ffi.cdef skips a declaration made
-- twice, which hid the first case below.
describe("the module in a host program", function()
    local function luajit(code, env)
        local script = os.tmpname()
        local f = assert(io.open(script, "wb"))
        f:write("package.path = ", ("%q"):format(H.ROOT .. "/lua/?.lua;" .. H.ROOT .. "/lua/?/init.lua;"), " .. package.path\n", code)
        f:close()
        local out = H.sh((env or "") .. " luajit " .. H.q(script) .. " 2>&1; echo \"rc=$?\"")
        os.remove(script)
        return out
    end

    it("loads again where a host reloads it (package.loaded cleared, require 'tinyloop.init'): 'attempt to redefine'", function()
        local out = luajit(([[
            local first = require "tinyloop"
            local m1 = assert(first.load(%q))
            package.loaded.tinyloop = nil
            local again = require "tinyloop"
            assert(again ~= first, "a second copy")
            local m2 = assert(again.load(%q))
            local by_init = require "tinyloop.init"
            assert(by_init.load(%q))
            local prompt = m1:encode("It is")
            local a, b = m1:generate(prompt, { max_tokens = 4 }), m2:generate(prompt, { max_tokens = 4 })
            assert(#a == #b and a[#a] == b[#b], "the same tokens from each copy")
            print("ok")]]):format(H.TEXTMODEL, H.TEXTMODEL, H.TEXTMODEL))
        assert.equal("ok\nrc=0\n", out)
    end)

    it("fails where TINYLOOP_LIB names a library it cannot load (it quietly took the build tree's)", function()
        local out = luajit('require "tinyloop"', "TINYLOOP_LIB=/nonexistent/libtinyloop.so")
        assert.truthy(out:find("tinyloop: cannot load TINYLOOP_LIB=/nonexistent/libtinyloop.so: ", 1, true), out)
        assert.truthy(out:find("rc=1", 1, true), out)
    end)

    it("gives tinyloop.grammar required on its own ('declaration specifier expected near tl_grammar_memory')", function()
        local out = luajit([[
            local grammar = require "tinyloop.grammar"
            local g = assert(grammar.gbnf('root ::= "yes" | "no"'))
            print(g:matches("yes"), g:matches("maybe"))]])
        assert.equal("true\tfalse\nrc=0\n", out)
    end)
end)

-- Checkpoint files' rules that an audit found no test fed: a copy of a checkpoint with one
-- field changed loads as nil, err naming the file and the rule.
describe("tinyloop.load refuses a config or tokenizer field by field", function()
    local cjson = require "cjson"
    local work = os.tmpname()
    os.remove(work)
    -- a copy of `from` whose `file` (JSON) was changed by edit(t) -> nil, err from loading it
    local function load_edited(from, file, edit)
        H.sh("rm -rf " .. H.q(work) .. " && mkdir -p " .. H.q(work) .. " && cp " .. H.q(from) .. "/* " .. H.q(work) .. "/")
        local f = assert(io.open(work .. "/" .. file, "rb"))
        local t = cjson.decode(f:read("*a"))
        f:close()
        edit(t)
        f = assert(io.open(work .. "/" .. file, "wb"))
        f:write(cjson.encode(t))
        f:close()
        return tinyloop.load(work)
    end
    local function set(fields) return function(t) for k, v in pairs(fields) do t[k] = v end end end
    local OURO, HUGINN = H.ROOT .. "/tests/data/hf/ouro_f32", H.ROOT .. "/tests/data/hf/huginn_f32"
    local cases = {
        { OURO, "config.json", set({ hidden_size = "32" }), 'field "hidden_size" must be an integer, got "32"' },
        { OURO, "config.json", set({ hidden_size = 1e12 }), 'field "hidden_size" = 1000000000000 is out of range [1, 1048576]' },
        { OURO, "config.json", set({ rms_norm_eps = "x" }), 'field "rms_norm_eps" must be a number, got "x"' },
        { OURO, "config.json", set({ use_sliding_window = "no" }), 'field "use_sliding_window" must be true or false, got "no"' },
        { OURO, "config.json", set({ hidden_act = 5 }), 'field "hidden_act" must be a string, got 5' },
        { OURO, "config.json", set({ hidden_act = "gelu" }), 'hidden_act = "gelu" is not supported (only "silu")' },
        { OURO, "config.json", set({ attention_bias = true }), "attention_bias = true is not part of Ouro's architecture" },
        { HUGINN, "config.json", set({ norm_class_name = "LayerNorm" }), 'Huginn norm_class_name = "LayerNorm" is not supported' },
        { HUGINN, "config.json", set({ n_layers = 5 }),
          "n_layers = 5 is not n_layers_in_prelude + n_layers_in_recurrent_block + n_layers_in_coda = 4" },
        { HUGINN, "config.json", set({ injection_type = "add" }), 'Huginn injection_type = "add" is not supported (only "linear")' },
        { HUGINN, "config.json", set({ state_init = "normal" }), 'Huginn state_init = "normal" is not supported' },
        { H.TEXTMODEL, "config.json", set({ d_model = 12 }), "rope needs an even head_dim, got d_model/n_heads = 3" },
        { H.TEXTMODEL, "config.json", set({ state_norm = false, state_norm_weights = "final_norm" }),
          'state_norm_weights = "final_norm" needs state_norm = true' },
        { H.TEXTMODEL, "config.json", set({ injection = "none", initial_state = "truncated_normal" }),
          'initial_state applies to injection "add" or "concat"' },
        { H.TEXTMODEL, "tokenizer.json", function(t) t.model.ignore_merges = true end, "model.ignore_merges is not supported" },
        { H.TEXTMODEL, "tokenizer.json", function(t) t.model.fuse_unk = "x" end, "model.fuse_unk must be a boolean" },
        { H.TEXTMODEL, "tokenizer.json", function(t) t.added_tokens[1].special = "yes" end,
          "added_tokens: \"special\" of '<|endoftext|>' must be a boolean" },
        { H.TEXTMODEL, "tokenizer.json", function(t) t.added_tokens[1].lstrip = "no" end,
          "added_tokens: \"lstrip\", \"rstrip\" and \"single_word\" of '<|endoftext|>' must be booleans" },
        { H.TEXTMODEL, "tokenizer.json", function(t) t.added_tokens[1].normalized = 1 end,
          "added_tokens: \"normalized\" of '<|endoftext|>' must be a boolean" },
        { H.TEXTMODEL, "tokenizer.json", function(t) t.added_tokens = {} end, "added_tokens must be an array" },
        { H.TEXTMODEL, "tokenizer.json", function(t)
              t.added_tokens[2] = { id = 320, content = "<|x|>", special = true, single_word = false, lstrip = false,
                                    rstrip = false, normalized = false }
          end, "the tokenizer has 321 ids but config.json vocab_size is 320" },
    }
    for _, case in ipairs(cases) do
        it(case[4], function()
            local m, err = load_edited(case[1], case[2], case[3])
            assert.is_nil(m)
            assert.truthy(err:find(case[4], 1, true), err)
            assert.truthy(err:find(work, 1, true), err) -- (the file named)
        end)
    end
    teardown(function() H.sh("rm -rf " .. H.q(work)) end)
end)

-- Argument rules of the Lua API that an audit found no test fed: each raises in its words.
describe("the Lua API's argument rules", function()
    local policy = require "tinyloop.policy"
    local m = assert(tinyloop.load(H.TEXTMODEL))
    local P = { 1, 2, 3 }
    it("raise, naming the field", function()
        local closed = m:session(P, { max_tokens = 4 })
        closed:close()
        local live = m:session(P, { max_tokens = 4 })
        for _, case in ipairs({
            { "config field 'verify_loops' needs speculative = \"chain\" or \"tree\"", function() return m:session(P, { verify_loops = 3 }) end },
            { "verify_loops = 0 must be in [1, max_loops = 4]", function() return m:session(P, { speculative = "chain", verify_loops = 0 }) end },
            { "config field 'loops': use verify_loops for speculative decoding", function() return m:generate_speculative(P, { loops = 3 }) end },
            { "config field 'grammar' must be a tinyloop.grammar, or an object with allowed(self, mask, vocab_size)",
              function() return m:generate(P, { grammar = {} }) end },
            { "session:fork(): hooks must be a table", function() return live:fork(5) end },
            { "session:fork(): unknown hook field 'on_tok'", function() return live:fork({ on_tok = 1 }) end },
            { "session:save(): the session is closed", function() return closed:save() end },
            { "session:detach(): the session has finished or is closed", function() return closed:detach() end },
            { "tinyloop.policy.ban_tokens: ids must be a table of token ids", function() return policy.ban_tokens(5) end },
            { "tinyloop.policy.repetition: opts must be a table", function() return policy.repetition(5) end },
            { "tinyloop.policy.logit_bias: bias must be a table id -> bias", function() return policy.logit_bias(5) end },
        }) do
            local ok, err = pcall(case[2])
            assert.is_false(ok, case[1])
            assert.truthy(tostring(err):find(case[1], 1, true), tostring(err))
        end
        live:close()
    end)
end)

-- LuaJIT seeds its string hash per Lua VM: pairs() walks a table in another order in each
-- process. Where several fields are wrong, the one an error names must not depend on it.
describe("errors that name one of several wrong fields", function()
    local function in_processes(script)
        local said = {}
        for run = 1, 6 do
            local f = assert(io.popen("cd " .. H.ROOT .. " && luajit -e " .. ("%q"):format(
                'package.path = "lua/?.lua;lua/?/init.lua;" .. package.path ' .. script) .. " 2>&1"))
            said[run] = f:read("*a")
            f:close()
        end
        return said
    end
    it("name the first in key order, in every process (the Lua API's config, the server's request)", function()
        local generate = in_processes([[
            local tl = require "tinyloop"
            local m = assert(tl.load("models/tinyloop-austen", { threads = 1 }))
            local ok, err = pcall(m.generate, m, "Hi", { max_tokens = 2, zeta = 1, beta = 2, gamma = 3, delta = 4 })
            io.write(tostring(err):match("unknown config field '[^']*'") or tostring(err))]])
        for _, said in ipairs(generate) do assert.equal("unknown config field 'beta'", said) end
        local parsed = in_processes([[
            local request = require "tinyloop.server.request"
            local tl = require "tinyloop"
            local m = assert(tl.load("models/tinyloop-austen", { threads = 1 }))
            local _, err = request.parse('{"prompt": "x", "zeta": 1, "beta": 2, "gamma": 3, "delta": 4}', m, "m", 8, {})
            io.write(err.param or "nil")]])
        for _, said in ipairs(parsed) do assert.equal("beta", said) end
        local checked = in_processes([[
            local messages = require("cjson").decode('[{"role": "assistant", "content": "x", "tool_calls": [{"id": "c", ' ..
                '"type": "function", "function": {"name": "f", "arguments": "{}", "zeta": 1, "beta": 2, "gamma": 3}}]}]')
            io.write(tostring(select(2, require("tinyloop.chat").check_messages(messages))):match("'[^']*'") or "none")]])
        for _, said in ipairs(checked) do assert.equal("'beta'", said) end
    end)
end)

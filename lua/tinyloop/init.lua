-- tinyloop: LuaJIT FFI bindings of the TinyLoop engine (SPEC §6).
--
--   local tinyloop = require "tinyloop"
--   local model = assert(tinyloop.load("models/tinyloop-austen"))
--   for id, text in model:stream("It is a truth", { max_tokens = 40 }) do io.write(text) end
--
-- Errors, one convention for every public function of this module and of tinyloop.policy:
--   * argument errors raise a Lua error naming the field or value: wrong types, unknown
--     fields, out-of-range values, whether Lua or the engine finds them (the engine's
--     TL_ERR_INVALID_ARGUMENT, TL_ERR_UNSUPPORTED and a hook breaking its contract);
--   * load failures and runtime failures return nil, err: a checkpoint that is missing or
--     malformed, a backend this build or machine lacks, out of memory, an engine bug;
--   * a Lua error raised by a hook (on_token, stop_when, logits_processor, grammar) stops
--     generation, the C side cleans up, and the error (with its traceback) is re-raised
--     from the call that was generating.
-- Hooks run through a fixed set of long-lived FFI callbacks that dispatch through a
-- registry, inside xpcall.
local ffi = require "ffi"

ffi.cdef(require "tinyloop.cdef")

local C
do
    local here = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "."
    local candidates = { os.getenv("TINYLOOP_LIB"), here .. "/../../build/libtinyloop.so", "tinyloop" }
    local errors = {}
    for i = 1, 3 do
        local name = candidates[i]
        if name then
            local ok, lib = pcall(ffi.load, name)
            if ok then C = lib break end
            errors[#errors + 1] = tostring(lib)
        end
    end
    if not C then
        error("tinyloop: cannot load libtinyloop (build it, or set TINYLOOP_LIB): " .. table.concat(errors, "; "))
    end
end

local ffi_new, ffi_string, ffi_cast, ffi_gc = ffi.new, ffi.string, ffi.cast, ffi.gc
local tonumber, tostring, type, pairs, error, xpcall, traceback = tonumber, tostring, type, pairs, error, xpcall, debug.traceback
local concat, floor = table.concat, math.floor

local _M = { _VERSION = ffi_string(C.tl_version()) }

-- The engine's name of a stop reason ("EOS", ...), or false while generation goes on.
local STOP_NONE = tonumber(C.TL_STOP_NONE)
local function stop_name(reason)
    reason = tonumber(reason)
    if reason == STOP_NONE then return false end
    return ffi_string(C.tl_stop_reason_name(reason))
end

local function last_error()
    return ffi_string(C.tl_last_error())
end

local raise = require("tinyloop.raise").from(debug.getinfo(1, "S").source)

-- ---- grammars compiled by the engine: tinyloop.grammar (grammar.lua)
local grammar_mod = require("tinyloop.grammar").bind(C, raise)
_M.grammar = grammar_mod

-- Engine statuses that mean the caller asked for something wrong: raised (the error
-- convention at the top). Every other failure is returned as nil, err.
local ARGUMENT_ERRORS = {
    [tonumber(C.TL_ERR_INVALID_ARGUMENT)] = true,
    [tonumber(C.TL_ERR_UNSUPPORTED)] = true,
    [tonumber(C.TL_ERR_HOOK)] = true, -- a hook broke its contract (e.g. a negative count)
}

-- For a failed engine call: raises an argument error, or returns nil, err.
local function engine_failure(status)
    local msg = last_error()
    if ARGUMENT_ERRORS[tonumber(status)] then raise(msg) end
    return nil, msg
end

local INT_MIN, INT_MAX = -2 ^ 31, 2 ^ 31 - 1
local SEED_MAX = 2 ^ 53 -- every integer up to here is exact in a Lua number

-- Raises unless v is an integer of a C int.
local function check_int(what, v)
    if type(v) ~= "number" then raise(what .. " must be a number") end
    if v ~= floor(v) or v < INT_MIN or v > INT_MAX then
        raise(("%s = %s must be an integer in [%d, %d]"):format(what, tostring(v), INT_MIN, INT_MAX))
    end
    return v
end

-- ------------------------------------------------------------------ hook registry

-- One context per session with hooks, keyed by an integer passed to C as `void *user`.
local registry, next_key = {}, 0

local function context_of(user)
    return registry[tonumber(ffi_cast("intptr_t", user))]
end

-- Makes ctx.tokens (1-based) equal to the C array of n tokens. Usually that appends the
-- newest tokens, but beam search shows each hook several histories, so every entry is
-- checked (a few hundred comparisons per call: negligible next to a forward pass).
local function sync_tokens(ctx, ptr, n)
    local t = ctx.tokens
    for i = 1, n do
        local v = ptr[i - 1]
        if t[i] ~= v then t[i] = v end
    end
    for i = #t, n + 1, -1 do t[i] = nil end
    return t
end

local function token_text(ctx, id)
    if not ctx.has_tokenizer then return nil end
    local st = C.tl_token_text(ctx.model, id, ctx.bytes, ctx.len)
    if st ~= 0 then return "" end
    return ffi_string(ctx.bytes[0], ctx.len[0])
end

local function fail(ctx, err)
    ctx.err = err
    return C.TL_HOOK_ERROR
end

-- Points the mirrors (ctx.tokens, ctx.pieces) at a new sequence that starts with prompt ids.
local function begin_sequence(ctx, ids)
    local t, n = ctx.tokens, #ids
    for i = 1, n do t[i] = ids[i] end
    for i = #t, n + 1, -1 do t[i] = nil end
    ctx.prompt_len = n
    local pieces = ctx.pieces
    for i = #pieces, 1, -1 do pieces[i] = nil end
end

-- tl_generate_batch decodes its prompts one after another and writes out_lens[i] as soon
-- as prompt i is done: the prompt running now is the first one without a length (out_lens
-- starts at -1). Positions alone cannot tell: a prompt may be exactly as long as the
-- previous prompt plus its output.
local function follow_batch(ctx)
    local b = ctx.batch
    local i = b.running
    while i < b.n and b.lens[i - 1] >= 0 do i = i + 1 end
    if i ~= b.running then
        b.running = i
        begin_sequence(ctx, b.prompts[i])
    end
end

-- Runs a user hook under xpcall, marking its session as inside a hook meanwhile: the session
-- may then not be closed or stepped (the step that runs the hook still uses it).
local function call_hook(ctx, fn, ...)
    ctx.in_hook = true
    local ok, r = xpcall(fn, traceback, ...)
    ctx.in_hook = false
    return ok, r
end

local on_token_cb = ffi_cast("tl_on_token_hook", function(user, token, position)
    local ctx = context_of(user)
    if ctx.batch then follow_batch(ctx) end
    local t = ctx.tokens
    if #t == position then t[position + 1] = token end
    local text = token_text(ctx, token)
    if text and position >= ctx.prompt_len then ctx.pieces[#ctx.pieces + 1] = text end
    if not ctx.on_token then return C.TL_HOOK_CONTINUE end
    local ok, r = call_hook(ctx, ctx.on_token, token, position, text)
    if not ok then return fail(ctx, r) end
    return r == false and C.TL_HOOK_STOP or C.TL_HOOK_CONTINUE
end)

local stop_rule_cb = ffi_cast("tl_stop_rule_hook", function(user, tokens, n)
    local ctx = context_of(user)
    local t = sync_tokens(ctx, tokens, n)
    local ok, r = call_hook(ctx, ctx.stop_when, t, concat(ctx.pieces))
    if not ok then return fail(ctx, r) end
    return r and C.TL_HOOK_STOP or C.TL_HOOK_CONTINUE
end)

local logits_cb = ffi_cast("tl_logits_hook", function(user, logits, vocab, tokens, n)
    local ctx = context_of(user)
    local ok, r = call_hook(ctx, ctx.logits_processor, logits, vocab, sync_tokens(ctx, tokens, n))
    if not ok then return fail(ctx, r) end
    return C.TL_HOOK_CONTINUE
end)

local grammar_allowed_cb = ffi_cast("int (*)(void *, uint8_t *, int)", function(user, mask, vocab)
    local ctx = context_of(user)
    local g = ctx.grammar
    local ok, r = call_hook(ctx, g.allowed, g, mask, vocab)
    if not ok then return fail(ctx, r) end
    if type(r) ~= "number" then -- no count returned: count the mask
        r = 0
        for i = 0, vocab - 1 do r = r + (mask[i] ~= 0 and 1 or 0) end
    end
    return r
end)

local grammar_advance_cb = ffi_cast("int (*)(void *, int32_t)", function(user, token)
    local ctx = context_of(user)
    local g = ctx.grammar
    local ok, r = call_hook(ctx, g.advance, g, token)
    if not ok then return fail(ctx, r) end
    return 0
end)

-- ------------------------------------------------------------------ configs

-- Numeric fields of each C config and their C types: "int", "float" or "seed" (uint64).
-- Values are checked here only for what C cannot see (a Lua number that is not an
-- integer, or beyond the C type); the engine checks the ranges.
local NUMBER_FIELDS = {
    max_tokens = "int", loops = "int", temperature = "float", top_k = "int", top_p = "float",
    cache_window = "int", repetition_penalty = "float", beam_size = "int", length_penalty = "float",
    early_exit_patience = "int", early_exit_min_L = "int", early_exit_peek_every = "int",
    early_exit_logit_margin = "float", early_exit_threshold = "float", sample_seed = "seed",
}
local SPEC_FIELDS = { max_tokens = "int", draft_loops = "int", verify_loops = "int", draft_ahead = "int",
                      temperature = "float", seed = "seed" }
local TREE_FIELDS = { K_branches = "int", max_nodes = "int" }

local function set_number(c, field, v, kind)
    if type(v) ~= "number" then raise("config field '" .. field .. "' must be a number") end
    if kind == "int" then
        check_int("config field '" .. field .. "'", v)
    elseif kind == "seed" and (v ~= floor(v) or v < 0 or v > SEED_MAX) then
        raise(("config field '%s' = %s must be an integer in [0, 2^53]"):format(field, tostring(v)))
    end
    c[field] = v
end

local OTHER_FIELDS = {
    stop_sequences = true, stop_strings = true, ignore_eos = true,
    on_token = true, stop_when = true, logits_processor = true, grammar = true,
    speculative = true, verify_loops = true,
}
-- Decoding modes of a session (SPEC §8): cfg.speculative selects self-speculative decoding,
-- whose fields sit in the same table; verify_loops is its name for loops.
local SPECULATIVE_MODES = { chain = C.TL_SPECULATIVE_CHAIN, tree = C.TL_SPECULATIVE_TREE }
local SESSION_SPEC_FIELDS = { draft_loops = "int", draft_ahead = "int", K_branches = "int", max_nodes = "int" }
local SESSION_SPEC_NAMES = { "draft_loops", "draft_ahead", "K_branches", "max_nodes" }

-- Builds a tl_generate_config from a Lua table. Returns the cdata, the arrays it points to
-- (keep them alive until the session exists) and the hook context (or nil).
local function make_config(model, cfg)
    local c = ffi_new("tl_generate_config")
    C.tl_generate_config_init(c)
    local keep = {}
    if cfg == nil then return c, keep, nil end
    if type(cfg) ~= "table" then raise("config must be a table") end
    for k, v in pairs(cfg) do
        local kind = NUMBER_FIELDS[k] or SESSION_SPEC_FIELDS[k]
        if kind then
            set_number(c, k, v, kind)
        elseif not OTHER_FIELDS[k] then
            raise("unknown config field '" .. tostring(k) .. "'")
        end
    end
    local mode = cfg.speculative
    if mode ~= nil then
        if not SPECULATIVE_MODES[mode] then raise("config field 'speculative' must be \"chain\" or \"tree\"") end
        c.speculative = SPECULATIVE_MODES[mode]
    end
    if mode == nil then
        for i = 1, #SESSION_SPEC_NAMES do
            local k = SESSION_SPEC_NAMES[i]
            if cfg[k] ~= nil then raise("config field '" .. k .. "' needs speculative = \"chain\" or \"tree\"") end
        end
    end
    if cfg.verify_loops ~= nil then
        if mode == nil then raise("config field 'verify_loops' needs speculative = \"chain\" or \"tree\"") end
        if cfg.loops ~= nil and cfg.loops ~= cfg.verify_loops then
            raise("config fields 'loops' and 'verify_loops' disagree: give one (verify_loops is the verify depth)")
        end
        set_number(c, "loops", cfg.verify_loops, "int")
        if cfg.verify_loops == 0 then
            raise(("verify_loops = 0 must be in [1, max_loops = %d]"):format(model.max_loops))
        end
    end
    -- C reads loops = 0 as "the default"; in Lua the default is spelled by leaving loops out.
    if cfg.loops == 0 then
        raise(("loops = 0 must be in [1, max_loops = %d] (leave loops out for the model's default_loops = %d)")
            :format(model.max_loops, model.default_loops))
    end
    local ignore_eos = cfg.ignore_eos
    if ignore_eos ~= nil then
        if type(ignore_eos) ~= "boolean" then raise("config field 'ignore_eos' must be a boolean") end
        c.ignore_eos = ignore_eos and 1 or 0
    end
    local seqs = cfg.stop_sequences
    if seqs ~= nil then
        if type(seqs) ~= "table" then raise("config field 'stop_sequences' must be a table of id tables") end
        local arr = ffi_new("tl_token_seq[?]", #seqs + 1)
        for i, seq in ipairs(seqs) do
            if type(seq) ~= "table" then raise("stop_sequences[" .. i .. "] must be a table of token ids") end
            local ids = ffi_new("int32_t[?]", #seq + 1)
            for j, id in ipairs(seq) do ids[j - 1] = id end
            arr[i - 1].tokens, arr[i - 1].n = ids, #seq
            keep[#keep + 1] = ids
        end
        c.stop_sequences, c.n_stop_sequences = arr, #seqs
        keep[#keep + 1] = arr
    end
    local strs = cfg.stop_strings
    if strs ~= nil then
        if type(strs) ~= "table" then raise("config field 'stop_strings' must be a table of strings") end
        local arr = ffi_new("const char *[?]", #strs + 1)
        for i, s in ipairs(strs) do
            if type(s) ~= "string" then raise("stop_strings[" .. i .. "] must be a string") end
            arr[i - 1] = s
            keep[#keep + 1] = s
        end
        c.stop_strings, c.n_stop_strings = arr, #strs
        keep[#keep + 1] = arr
    end
    for _, hook in ipairs({ "on_token", "stop_when", "logits_processor" }) do
        if cfg[hook] ~= nil and type(cfg[hook]) ~= "function" then
            raise("config field '" .. hook .. "' must be a function")
        end
    end
    local g = cfg.grammar
    -- ---- a compiled grammar: every session runs its own matcher (no Lua callbacks)
    if grammar_mod.is_compiled(g) then
        local grammar = ffi_new("tl_grammar")
        C.tl_grammar_use(grammar, g.ptr)
        c.grammar = grammar
        keep[#keep + 1] = grammar
        keep[#keep + 1] = g
        g = nil
    elseif g ~= nil and (type(g) ~= "table" or type(g.allowed) ~= "function" or type(g.advance) ~= "function") then
        raise("config field 'grammar' must be a tinyloop.grammar, or an object with allowed(self, mask, vocab_size) and advance(self, token) methods")
    end
    local ctx
    if cfg.on_token or cfg.stop_when or cfg.logits_processor or g then
        next_key = next_key + 1
        ctx = {
            key = next_key, model = model.ptr, has_tokenizer = model.has_tokenizer,
            on_token = cfg.on_token, stop_when = cfg.stop_when, logits_processor = cfg.logits_processor,
            grammar = g, tokens = {}, pieces = {}, prompt_len = 0,
            bytes = ffi_new("const char *[1]"), len = ffi_new("size_t[1]"),
        }
        local user = ffi_cast("void *", ctx.key)
        -- on_token runs whenever a context exists: it keeps the token/text mirrors.
        c.on_token, c.on_token_user = on_token_cb, user
        if cfg.stop_when then c.stop_rule, c.stop_rule_user = stop_rule_cb, user end
        if cfg.logits_processor then c.logits_processor, c.logits_processor_user = logits_cb, user end
        if g then
            local grammar = ffi_new("tl_grammar")
            grammar.user, grammar.allowed, grammar.advance = user, grammar_allowed_cb, grammar_advance_cb
            c.grammar = grammar
            keep[#keep + 1] = grammar
        end
    end
    return c, keep, ctx
end

-- ------------------------------------------------------------------ prompts

-- ids of a prompt (a string is encoded), or nil, err when encoding fails at run time.
local function prompt_ids(model, prompt)
    if type(prompt) == "string" then return model:encode(prompt) end
    if type(prompt) ~= "table" then raise("prompt must be a string or a table of token ids") end
    return prompt
end

-- Tokens a blocking call may write: the prompts plus max_tokens per sequence. The engine
-- owns the real rule (prompt_len + max_tokens <= max_seq_len, per prompt); this bound, which
-- every valid request meets, only keeps a wild max_tokens from allocating gigabytes (or
-- overflowing the C int capacity) before the engine gets to say no.
local function output_capacity(model, prompt_tokens, sequences, max_tokens)
    max_tokens = tonumber(max_tokens)
    if max_tokens < 0 or max_tokens > model.max_seq_len then
        raise(("max_tokens = %d must be in [0, max_seq_len = %d]"):format(max_tokens, model.max_seq_len))
    end
    local capacity = prompt_tokens + sequences * max_tokens
    if capacity > INT_MAX then
        raise(("the output of %d sequences (%.0f tokens) exceeds one call's capacity (%d): split the batch")
            :format(sequences, capacity, INT_MAX))
    end
    return capacity
end

local function id_array(ids)
    local n = #ids
    local arr = ffi_new("int32_t[?]", n + 1)
    for i = 1, n do
        local id = ids[i]
        if type(id) ~= "number" then raise("token ids must be numbers (index " .. i .. ")") end
        arr[i - 1] = id
    end
    return arr, n
end

local HISTOGRAM_DEPTHS = ffi.sizeof(ffi_new("tl_generate_stats").depth_histogram) / ffi.sizeof("int")

local function stats_table(s)
    local histogram = {}
    for d = 1, HISTOGRAM_DEPTHS - 1 do
        if s.depth_histogram[d] > 0 then histogram[d] = s.depth_histogram[d] end
    end
    return {
        drafted = s.drafted, accepted = s.accepted, verify_steps = s.verify_steps,
        draft_forwards = s.draft_forwards, verify_forwards = s.verify_forwards,
        draft_ms = s.draft_ms, verify_ms = s.verify_ms, acceptance_rate = s.acceptance_rate,
        mean_accepted = s.mean_accepted,
        probes = s.probes, probe_ms = s.probe_ms, depth_histogram = histogram, beam_score = s.beam_score,
        prefill_ms = s.prefill_ms, first_token_ms = s.first_token_ms, decode_ms = s.decode_ms,
        prompt_tokens = s.prompt_tokens, tokens_emitted = s.tokens_emitted,
        stop_reason = stop_name(s.stop_reason) or nil, loops_used = s.loops_used,
        decode_tokens_per_s = C.tl_stats_decode_tokens_per_s(s),
        prefill_tokens_per_s = C.tl_stats_prefill_tokens_per_s(s),
    }
end

-- ------------------------------------------------------------------ sessions

local Session = {}
Session.__index = Session

local text_ptr = ffi_new("const char *[1]")
local text_len = ffi_new("size_t[1]")
local n_out = ffi_new("int[1]")

local function release(self)
    if self.ctx then registry[self.ctx.key] = nil end
end

-- session:step() -> id (or -1), the text that became safe to show ("" without a
-- tokenizer), and the stop reason once generation ends (false before); nil, err on a
-- runtime failure (the session is then finished).
-- Compiled traces must not call C functions that call back into Lua ("bad callback"
-- panic): this wrapper always runs in the interpreter.
function Session:step()
    if self.done then raise("session has already finished (" .. tostring(self.stop_reason or self.error) .. ")") end
    local step_token, step_stop = self.step_token, self.step_stop
    local st = C.tl_session_step(self.ptr, step_token, step_stop)
    if st ~= 0 then
        local ctx = self.ctx
        -- Stepped from one of its own hooks: the engine refused, and the outer step goes on.
        if ctx and ctx.in_hook then raise(last_error()) end
        self.done = true
        if st == C.TL_ERR_HOOK and ctx and ctx.err then
            local err = ctx.err
            ctx.err = nil
            self:close()
            error(err, 0)
        end
        local _, err = engine_failure(st) -- raises argument errors (after the close below)
        self:close()
        self.error = err
        return nil, err
    end
    local id, reason = step_token[0], stop_name(step_stop[0])
    local text = ""
    if self.has_tokenizer then
        C.tl_session_text(self.ptr, text_ptr, text_len)
        text = ffi_string(text_ptr[0], text_len[0])
    end
    if reason then
        self.done, self.stop_reason = true, reason
    end
    return id, text, reason
end
jit.off(Session.step)

-- Prompt + emitted tokens so far, as a table.
function Session:tokens()
    if self.ptr == nil then return self.final_tokens or {} end
    local ptr = C.tl_session_tokens(self.ptr, n_out)
    local t = {}
    for i = 1, n_out[0] do t[i] = ptr[i - 1] end
    return t
end

function Session:stats()
    if self.ptr == nil then return self.closed_stats end
    return stats_table(C.tl_session_stats(self.ptr))
end

-- Frees the C session now (the garbage collector would do it later). Refused from inside one
-- of the session's own hooks: the step that runs the hook still uses the session.
function Session:close()
    if self.ctx and self.ctx.in_hook then
        raise("session:close() from inside one of its own hooks: close it after the step returns")
    end
    if self.ptr ~= nil then
        self.final_tokens, self.closed_stats = self:tokens(), self:stats()
        ffi_gc(self.ptr, nil)
        C.tl_session_free(self.ptr)
        self.ptr = nil
        release(self)
    end
end

-- ------------------------------------------------------------------ blocking C calls

-- After a blocking C call made with the hook context registered: true on success; a
-- hook's Lua error is re-raised with its message and traceback, argument errors raise,
-- runtime failures return nil, err.
local function blocking_result(status, ctx)
    if ctx then registry[ctx.key] = nil end
    if status == 0 then return true end
    if status == C.TL_ERR_HOOK and ctx and ctx.err then error(ctx.err, 0) end
    return engine_failure(status)
end

-- Runs a blocking C decoder, cfunc(model, prompt, n, cfg, out, capacity, out_len, stats)
-- (tl_generate and the speculative decoders share that shape); returns prompt +
-- continuation as a table, or nil, err. Hooks run inside the C call, so this function is
-- kept out of compiled traces (jit.off below).
local blocking_len = ffi_new("int[1]")
local function call_blocking(ids, ctx, capacity, cfunc, model_ptr, arr, cfg, stats)
    local n = #ids
    if ctx then
        registry[ctx.key] = ctx
        begin_sequence(ctx, ids)
    end
    local out = ffi_new("int32_t[?]", capacity + 1)
    local ok, err = blocking_result(cfunc(model_ptr, arr, n, cfg, out, capacity, blocking_len, stats), ctx)
    if not ok then return nil, err end
    local t = {}
    for i = 1, blocking_len[0] do t[i] = out[i - 1] end
    return t
end
jit.off(call_blocking)

-- ------------------------------------------------------------------ models

local Model = {}
Model.__index = Model

local status_out = ffi_new("tl_model *[1]")
local BACKENDS = { auto = C.TL_BACKEND_AUTO, cpu = C.TL_BACKEND_CPU, cuda = C.TL_BACKEND_CUDA }

-- tinyloop.load(dir [, opts]) -> model | nil, err. opts: threads (0 = all cores),
-- mmap_weights (boolean), backend ("auto", "cpu" or "cuda"). Bad arguments raise; a
-- checkpoint that cannot be loaded, or a backend this machine lacks, gives nil, err.
function _M.load(dir, opts)
    if type(dir) ~= "string" then raise("tinyloop.load: model directory must be a string") end
    local o = ffi_new("tl_load_options")
    C.tl_load_options_init(o)
    if opts ~= nil then
        if type(opts) ~= "table" then raise("tinyloop.load: options must be a table") end
        for k, v in pairs(opts) do
            if k == "threads" then
                if check_int("load option 'threads'", v) < 0 then
                    raise("load option 'threads' = " .. v .. " must be >= 0 (0 = all cores)")
                end
                o.n_threads = v
            elseif k == "mmap_weights" then
                if type(v) ~= "boolean" then raise("load option 'mmap_weights' must be a boolean") end
                o.mmap_weights = v and 1 or 0
            elseif k == "backend" then
                local b = BACKENDS[v]
                if not b then raise("load option 'backend' must be \"auto\", \"cpu\" or \"cuda\"") end
                o.backend = b
            else
                raise("unknown load option '" .. tostring(k) .. "'")
            end
        end
    end
    if C.tl_model_load(dir, o, status_out) ~= 0 then return nil, last_error() end
    local ptr = ffi_gc(status_out[0], C.tl_model_free)
    local info = C.tl_model_info(ptr)
    return setmetatable({
        ptr = ptr,
        vocab_size = info.vocab_size,
        max_seq_len = info.max_seq_len,
        default_loops = info.default_loops,
        max_loops = info.max_loops,
        has_tokenizer = info.has_tokenizer ~= 0,
    }, Model)
end

function Model:info()
    local i = C.tl_model_info(self.ptr)
    local t = {}
    for _, k in ipairs({ "vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                         "max_seq_len", "n_prelude", "n_block", "n_coda", "default_loops", "max_loops",
                         "bos_token_id", "eos_token_id", "n_threads" }) do
        t[k] = tonumber(i[k])
    end
    for _, k in ipairs({ "beta", "norm_eps", "rope_theta" }) do t[k] = tonumber(i[k]) end
    for _, k in ipairs({ "injection", "loop_update", "norm", "mlp", "pos_encoding", "weight_dtype", "backend" }) do
        t[k] = ffi_string(i[k])
    end
    for _, k in ipairs({ "state_norm", "bias", "tie_embeddings", "has_tokenizer" }) do t[k] = i[k] ~= 0 end
    t.n_params, t.weight_bytes = tonumber(i.n_params), tonumber(i.weight_bytes)
    return t
end

local enc_ids = ffi_new("int32_t *[1]")
local enc_n = ffi_new("int[1]")
local dec_text = ffi_new("char *[1]")
local dec_len = ffi_new("size_t[1]")

-- model:encode(text) -> ids | nil, err
function Model:encode(text)
    if type(text) ~= "string" then raise("encode: text must be a string") end
    local st = C.tl_encode(self.ptr, text, #text, enc_ids, enc_n)
    if st ~= 0 then return engine_failure(st) end
    local ids, n, t = enc_ids[0], enc_n[0], {}
    for i = 1, n do t[i] = ids[i - 1] end
    C.tl_free(ids)
    return t
end

-- model:decode(ids) -> text | nil, err
function Model:decode(ids)
    if type(ids) ~= "table" then raise("decode: ids must be a table") end
    local arr, n = id_array(ids)
    local st = C.tl_decode(self.ptr, arr, n, dec_text, dec_len)
    if st ~= 0 then return engine_failure(st) end
    local s = ffi_string(dec_text[0], dec_len[0])
    C.tl_free(dec_text[0])
    return s
end

local session_out = ffi_new("tl_session *[1]")

-- model:session(prompt, cfg) -> a session stepped with session:step(), or nil, err.
function Model:session(prompt, cfg)
    local ids, err = prompt_ids(self, prompt)
    if not ids then return nil, err end
    local c, keep, ctx = make_config(self, cfg)
    local arr, n = id_array(ids)
    if ctx then
        registry[ctx.key] = ctx
        begin_sequence(ctx, ids)
    end
    local st = C.tl_session_new(self.ptr, arr, n, c, session_out)
    if st ~= 0 then
        if ctx then registry[ctx.key] = nil end
        return engine_failure(st)
    end
    local self_session = setmetatable({
        model = self, ctx = ctx, keep = keep, has_tokenizer = self.has_tokenizer, done = false,
        step_token = ffi_new("int32_t[1]"), step_stop = ffi_new("tl_stop_reason[1]"),
    }, Session)
    local key = ctx and ctx.key
    self_session.ptr = ffi_gc(session_out[0], function(p)
        C.tl_session_free(p)
        if key then registry[key] = nil end
    end)
    return self_session
end

-- model:generate(prompt, cfg) -> ids (prompt + continuation), stats | nil, err
-- Every mode (plain, speculative = "chain" | "tree", beam_size >= 2) runs on a session.
function Model:generate(prompt, cfg)
    local s, err = self:session(prompt, cfg)
    if not s then return nil, err end
    local step = s.step
    repeat
        local id, text_or_err, reason = step(s)
        if id == nil then return nil, text_or_err end
    until reason
    local ids, stats = s:tokens(), s:stats()
    s:close()
    return ids, stats
end

-- for id, text in model:stream(prompt, cfg) do ... end. Driven by the step API: no
-- callbacks unless the config has hooks, and a coroutine may yield between tokens.
-- The second value is the session (stats: select(2, ...):stats()). When generation ends
-- without a token (a grammar dead end) while text was still held back (half a UTF-8
-- character, a possible stop-string prefix), the last pair is (-1, that text). A runtime
-- failure ends the loop (a for loop drops the iterator's nil, err): session.error says why.
-- model:stream itself returns nil, err when the session cannot be created at run time.
function Model:stream(prompt, cfg)
    local s, err = self:session(prompt, cfg)
    if not s then return nil, err end
    local function iterate()
        if s.done then return nil end
        local id, text, reason = s:step()
        if id == nil then return nil, text end
        if reason then s.final_stats = s:stats() end
        if id < 0 and text == "" then return nil end
        return id, text
    end
    return iterate, s
end

-- Runs tl_generate_batch with the hook context registered (kept out of compiled traces:
-- hooks run inside the C call); returns true or nil, err.
local function call_batch(model, ctx, seqs, n_prompts, c, out, capacity, lens, out_len, stats)
    if ctx then
        registry[ctx.key] = ctx
        ctx.batch.running = 1
        begin_sequence(ctx, ctx.batch.prompts[1])
    end
    return blocking_result(C.tl_generate_batch(model.ptr, seqs, n_prompts, c, out, capacity, lens, out_len, stats), ctx)
end
jit.off(call_batch)

-- model:generate_batch({prompt, ...}, cfg) -> {ids_1, ...}, {stats_1, ...} | nil, err.
-- One tl_generate_batch call: each prompt decoded with a fresh cache, one after another.
-- Hooks see each prompt's sequence in turn (stop_when's text restarts with every prompt);
-- state kept inside a hook or a grammar object carries over from one prompt to the next.
function Model:generate_batch(prompts, cfg)
    if type(prompts) ~= "table" then raise("generate_batch: prompts must be a table") end
    local n_prompts, all_ids = #prompts, {}
    for i = 1, n_prompts do
        local ids, err = prompt_ids(self, prompts[i])
        if not ids then return nil, err end
        all_ids[i] = ids
    end
    local c, keep, ctx = make_config(self, cfg)
    if n_prompts == 0 then return {}, {} end -- the engine wants at least one prompt
    local seqs = ffi_new("tl_token_seq[?]", n_prompts)
    local prompt_tokens = 0
    for i = 1, n_prompts do
        local arr, n = id_array(all_ids[i])
        keep[#keep + 1] = arr
        seqs[i - 1].tokens, seqs[i - 1].n = arr, n
        prompt_tokens = prompt_tokens + n
    end
    local capacity = output_capacity(self, prompt_tokens, n_prompts, c.max_tokens)
    local out = ffi_new("int32_t[?]", capacity + 1)
    local lens = ffi_new("int[?]", n_prompts)
    for i = 0, n_prompts - 1 do lens[i] = -1 end
    local stats = ffi_new("tl_generate_stats[?]", n_prompts)
    if ctx then ctx.batch = { lens = lens, prompts = all_ids, n = n_prompts, running = 1 } end
    local ok, err = call_batch(self, ctx, seqs, n_prompts, c, out, capacity, lens, ffi_new("int[1]"), stats)
    if not ok then return nil, err end
    local outs, all_stats, at = {}, {}, 0
    for i = 1, n_prompts do
        local t, len = {}, lens[i - 1]
        for k = 1, len do t[k] = out[at + k - 1] end
        at = at + len
        outs[i], all_stats[i] = t, stats_table(stats[i - 1])
    end
    return outs, all_stats
end

-- ------------------------------------------------------------------ speculative decoding

local function spec_stats(st)
    local t = stats_table(st.gen)
    for _, k in ipairs({ "drafted", "accepted", "verify_steps", "acceptance_rate", "mean_accepted",
                         "draft_forwards", "verify_forwards", "draft_ms", "verify_ms" }) do
        t[k] = tonumber(st[k])
    end
    return t
end

-- Runs tl_generate_speculative / tl_generate_tree_speculative.
local function run_speculative(model, prompt, cfg, tree)
    if cfg ~= nil and type(cfg) ~= "table" then raise("config must be a table") end
    cfg = cfg or {}
    local base = {}
    for k, v in pairs(cfg) do
        if not SPEC_FIELDS[k] and not (tree and TREE_FIELDS[k]) then
            if k == "loops" then raise("config field 'loops': use verify_loops for speculative decoding") end
            base[k] = v
        end
    end
    if base.sample_seed ~= nil and cfg.seed == nil then cfg = setmetatable({ seed = base.sample_seed }, { __index = cfg }) end
    base.sample_seed = nil
    local c, keep, ctx = make_config(model, base)
    local sc = tree and ffi_new("tl_tree_speculative_config") or ffi_new("tl_speculative_config")
    local spec = tree and sc.spec or sc
    if tree then C.tl_tree_speculative_config_init(sc) else C.tl_speculative_config_init(sc) end
    for k, kind in pairs(SPEC_FIELDS) do
        if cfg[k] ~= nil then set_number(spec, k, cfg[k], kind) end
    end
    if tree then
        for k, kind in pairs(TREE_FIELDS) do
            if cfg[k] ~= nil then set_number(sc, k, cfg[k], kind) end
        end
    end
    spec.base = c
    local ids, err = prompt_ids(model, prompt)
    if not ids then return nil, err end
    local arr, n = id_array(ids)
    local capacity = output_capacity(model, n, 1, spec.max_tokens)
    local st = ffi_new("tl_speculative_stats")
    local cfunc = tree and C.tl_generate_tree_speculative or C.tl_generate_speculative
    local t
    t, err = call_blocking(ids, ctx, capacity, cfunc, model.ptr, arr, sc, st)
    local _ = keep
    if not t then return nil, err end
    return t, spec_stats(st)
end

-- model:generate_speculative(prompt, cfg) -> ids, stats | nil, err. cfg: max_tokens,
-- draft_loops, verify_loops, draft_ahead, temperature, seed, plus the generate fields
-- (top_k, top_p, repetition_penalty, stop_sequences, stop_strings, ignore_eos, cache_window,
-- hooks). stats adds drafted, accepted, acceptance_rate, mean_accepted, verify_steps,
-- draft_forwards, verify_forwards, draft_ms, verify_ms.
function Model:generate_speculative(prompt, cfg)
    return run_speculative(self, prompt, cfg, false)
end

-- model:generate_tree_speculative(prompt, cfg) -> ids, stats | nil, err; cfg adds
-- K_branches, max_nodes.
function Model:generate_tree_speculative(prompt, cfg)
    return run_speculative(self, prompt, cfg, true)
end

-- model:score(ids, loops) -> scores | nil, err, with scores:logit(i, t) (next-token logit
-- of id t after ids[1..i]), scores:argmax(i), scores.n, scores.vocab_size. loops defaults
-- to the model's default_loops.
local Scores = {}
Scores.__index = Scores

function Scores:logit(i, t)
    if i < 1 or i > self.n or t < 0 or t >= self.vocab_size then
        raise("scores:logit(" .. tostring(i) .. ", " .. tostring(t) .. ") out of range")
    end
    return self.data[(i - 1) * self.vocab_size + t]
end

function Scores:argmax(i)
    if i < 1 or i > self.n then raise("scores:argmax(" .. tostring(i) .. ") out of range") end
    local row, v = self.data + (i - 1) * self.vocab_size, self.vocab_size
    local best, best_value = 0, row[0]
    for t = 1, v - 1 do
        if row[t] > best_value then best, best_value = t, row[t] end
    end
    return best
end

function Model:score(ids, loops)
    local err
    ids, err = prompt_ids(self, ids)
    if not ids then return nil, err end
    loops = loops == nil and self.default_loops or check_int("score: loops", loops)
    local arr, n = id_array(ids)
    local data = ffi_new("float[?]", n * self.vocab_size + 1)
    local st = C.tl_score(self.ptr, arr, n, loops, data)
    if st ~= 0 then return engine_failure(st) end
    return setmetatable({ data = data, n = n, vocab_size = self.vocab_size }, Scores)
end

_M.C = C -- the raw library, for tools that need more than this module offers
return _M

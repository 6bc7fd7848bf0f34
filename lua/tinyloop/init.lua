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
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local ffi = require "tinyloop.ffi"
local C = require "tinyloop.lib" -- (the declarations and the library, once a VM)

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

-- LuaJIT's own limits on what it holds: an FFI array of 2^31 bytes or more is refused
-- ("size of C type is unknown or too large": a model of 152k tokens scored at most ~3,500),
-- and a string stops short of 2^31 bytes (a state's bytes()). _M._limits, for tests to lower.
local limits = { ffi_array_bytes = 2 ^ 31 - 1, string_bytes = 0x7fffff00 }
pcall(ffi.cdef, "void *malloc(size_t size); void free(void *ptr);") -- (declared elsewhere already: the same)
local libc = ffi.C

-- n floats: ffi.new's within its limit, else malloc's (freed when collected); nil, err where
-- there is no memory for them. The collector sees a malloc'd array as a pointer's few bytes:
-- while any is held, each new one first runs a full collection (a loop of scores dropped
-- them unfreed between collections, hundreds at a time, each past 2 GB).
local malloced_bytes = 0
local function float_array(n, what)
    local bytes = n * 4
    if bytes <= limits.ffi_array_bytes then return ffi_new("float[?]", n) end
    if malloced_bytes > 0 then collectgarbage() end
    local memory = libc.malloc(bytes)
    if memory == nil then return nil, ("%s: out of memory (%.0f bytes of results)"):format(what, bytes) end
    malloced_bytes = malloced_bytes + bytes
    return ffi_gc(ffi_cast("float *", memory), function(p)
        libc.free(p)
        malloced_bytes = malloced_bytes - bytes
    end)
end

local raise = require("tinyloop.raise").from(debug.getinfo(1, "S").source)

-- ---- grammars compiled by the engine: tinyloop.grammar (grammar.lua)
local grammar_mod = require("tinyloop.grammar").bind(C, debug.getinfo(1, "S").source)
_M.grammar = grammar_mod

-- Engine statuses that mean the caller asked for something wrong: raised (the error
-- convention at the top). Every other failure is returned as nil, err.
local ARGUMENT_ERRORS = {
    [tonumber(C.TL_ERR_INVALID_ARGUMENT)] = true,
    [tonumber(C.TL_ERR_UNSUPPORTED)] = true,
    [tonumber(C.TL_ERR_HOOK)] = true, -- a hook broke its contract (e.g. a negative count)
}

-- An engine message as a Lua caller reads it. The engine counts a list's places from 0 (C's
-- arrays); the lists a Lua caller gave count from 1: the places it names in them are shown as
-- Lua's (stop_strings[1] named the second string). And C's loops = 0 is the default, which in
-- Lua is spelt by leaving loops out (loops = 0 is refused: make_config).
local INDEXED = { "stop_sequences%[", "stop_strings%[", "sessions%[", "at index ", "at position ", "generate_batch: prompt ", "embed_batch: input " }
local function lua_wording(msg)
    for _, place in ipairs(INDEXED) do
        msg = msg:gsub("(" .. place .. ")(%d+)", function(before, i) return before .. (tonumber(i) + 1) end)
    end
    return (msg:gsub(" %(0 = default%)", " (leave loops out for the model's default)"))
end

-- For a failed engine call: raises an argument error, or returns nil, err.
local function engine_failure(status)
    local msg = lua_wording(last_error())
    if ARGUMENT_ERRORS[tonumber(status)] then raise(msg) end
    return nil, msg
end

local INT_MIN, INT_MAX = -2 ^ 31, 2 ^ 31 - 1
local SEED_MAX = 2 ^ 53 -- every integer up to here is exact in a Lua number
-- (a double rounds to a C float's largest value up to half an ulp past it: 3.4028235e38, as
-- it is often printed, is FLT_MAX; from here on it is inf)
local FLOAT_OVERFLOW = 3.4028235677973366e38

-- Raises unless v is an integer of a C int.
local function check_int(what, v)
    if type(v) ~= "number" then raise(what .. " must be a number") end
    if v ~= floor(v) or v < INT_MIN or v > INT_MAX then
        raise(("%s = %s must be an integer in [%d, %d]"):format(what, tostring(v), INT_MIN, INT_MAX))
    end
    return v
end

-- Raises unless path is a file path C can read whole: a string, not empty, without a NUL (C
-- reads it up to the first: "a\0b" named the file "a", and the call succeeded there).
local function check_path(path, what)
    if type(path) ~= "string" then raise(what .. " must be a string") end
    if path == "" then raise(what .. " must not be empty") end
    if path:find("\0", 1, true) then raise(what .. " contains a NUL byte") end
    return path
end

-- Raises unless obj is an object of class (a close called with another object, or with a
-- dot: State.close(session) removed the session's finalizer, then failed: a leak).
local function of_class(obj, class, what)
    if type(obj) ~= "table" or getmetatable(obj) ~= class then
        raise(what .. " needs its own object (obj:close(), with a colon), not " .. type(obj))
    end
end

-- #t of a list, raising where it has holes (tinyloop.raise.list_length's rule)
local list_length_of = require("tinyloop.raise").list_length
local function list_length(t, what) return list_length_of(t, what, raise) end

-- ------------------------------------------------------------------ hook registry

-- One context per session with hooks, keyed by an integer passed to C as `void *user`. Weak
-- values: a hook that refers to its own session (s:stats() in stop_when) makes a cycle
-- registry -> ctx -> hook -> session -> ctx, which a strong table would keep forever. While C
-- can call back, the session (stepping) or call_blocking's frame holds the ctx.
local registry, next_key = setmetatable({}, { __mode = "v" }), 0

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

-- A generated token's piece of the text stop_when sees (ctx.pieces), or nil: the engine's
-- rule for the session's text (tl_token_in_text under ctx.config: special tokens are control,
-- not text, unless keep_special_text keeps those that do not end generation).
local function text_piece(ctx, id, text)
    if text and C.tl_token_in_text(ctx.model, ctx.config, id) ~= 0 then return text end
    return nil
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

-- Runs a user hook under xpcall, marking its session as inside a hook meanwhile: the session
-- may then not be closed or stepped (the step that runs the hook still uses it).
-- A hook's error with its traceback; error() and error(false) raise a falsy value, which read
-- as no error at all: the engine's "hook returned error -1" was raised instead.
local function hook_traceback(e)
    if not e then e = ("a hook raised an error whose value is %s"):format(tostring(e)) end
    return traceback(e, 2)
end
local function call_hook(ctx, fn, ...)
    ctx.in_hook = true
    local ok, r = xpcall(fn, hook_traceback, ...)
    ctx.in_hook = false
    return ok, r
end

-- A C hook's Lua function, given its session's context: none (a session closed while a step
-- of a batch it was in still ran; refused since, but no Lua error may cross the engine's C
-- frames) ends the step with a hook error.
-- The wrapper's own code runs under pcall too: a hook may make it raise (a metatable set on the
-- tokens or signals table it is handed, a debug.sethook watchdog), and a Lua error unwinding
-- through the engine's C frames skipped its cleanup: the session stayed "already stepping",
-- its batch's peers marked as in a step_batch call, and its K/V was never freed.
local function with_context(fn)
    return function(user, ...)
        local ctx = context_of(user)
        if not ctx then return C.TL_HOOK_ERROR end
        -- (hook_traceback: a falsy error value is said, not lost to the engine's "hook returned error -1")
        local ok, r = xpcall(fn, hook_traceback, ctx, ...)
        if ok then return r end
        ctx.in_hook = false -- (raised between call_hook's marks)
        return fail(ctx, r)
    end
end

-- The text of a hook's error value for a message: tostring's, or what it is where its
-- __tostring raises or gives no string (the session's result, and its batch's peers', were
-- lost when building the message raised).
local function error_text(e)
    local ok, text = pcall(tostring, e)
    if ok and type(text) == "string" then return text end
    return ("a %s whose __tostring failed"):format(type(e))
end

local on_token_cb = ffi_cast("tl_on_token_hook", with_context(function(ctx, token, position)
    local t = ctx.tokens
    if #t == position then t[position + 1] = token end
    local text = token_text(ctx, token)
    if position >= ctx.prompt_len then ctx.pieces[#ctx.pieces + 1] = text_piece(ctx, token, text) end
    if not ctx.on_token then return C.TL_HOOK_CONTINUE end
    local ok, r = call_hook(ctx, ctx.on_token, token, position, text)
    if not ok then return fail(ctx, r) end
    return r == false and C.TL_HOOK_STOP or C.TL_HOOK_CONTINUE
end))

local stop_rule_cb = ffi_cast("tl_stop_rule_hook", with_context(function(ctx, tokens, n)
    local t = sync_tokens(ctx, tokens, n)
    local ok, r = call_hook(ctx, ctx.stop_when, t, concat(ctx.pieces), ctx.prompt_len)
    if not ok then return fail(ctx, r) end
    return r and C.TL_HOOK_STOP or C.TL_HOOK_CONTINUE
end))

-- logits_processor(logits, vocab, tokens, prompt_len): logits edited in place (a float*,
-- logits[0] to logits[vocab - 1], valid during the call only). prompt_len, as stop_when's:
-- a processor that counts new tokens (Hugging Face's min_new_tokens, a length penalty) reads
-- it, as the tokens it is given hold the prompt too. A table returned is Hugging Face's way
-- (processors return new scores): it would be dropped without a word here, so it is an error.
local logits_cb = ffi_cast("tl_logits_hook", with_context(function(ctx, logits, vocab, tokens, n)
    local ok, r = call_hook(ctx, ctx.logits_processor, logits, vocab, sync_tokens(ctx, tokens, n), ctx.prompt_len)
    if not ok then return fail(ctx, r) end
    if type(r) == "table" then
        return fail(ctx, "logits_processor returned a table: edit the logits in place (logits[id] = value); " ..
                         "what the hook returns is not read")
    end
    return C.TL_HOOK_CONTINUE
end))

-- A C double that is NaN ("no such signal here") reaches Lua as nil.
local function signal(x)
    if x ~= x then return nil end
    return x
end

-- depth_policy(loop, signals) -> exit?: signals is one table per session, refilled each call
-- (copy what you keep). gate / exit_probability exist with an exit gate (Ouro); argmax,
-- entropy, kl and entropy_change after a probe (kl and entropy_change from the second).
local depth_policy_cb = ffi_cast("tl_depth_policy_hook", with_context(function(ctx, sig)
    local t = ctx.signals
    t.loop, t.loops, t.position = sig.loop, sig.loops, sig.position
    t.state_change = sig.state_change
    t.gate, t.exit_probability = signal(sig.gate), signal(sig.exit_probability)
    t.probed = sig.probed ~= 0
    t.argmax = sig.probed ~= 0 and sig.argmax >= 0 and sig.argmax or nil
    t.entropy, t.kl, t.entropy_change = signal(sig.entropy), signal(sig.kl), signal(sig.entropy_change)
    t.criterion_exit = sig.criterion_exit ~= 0
    local ok, r = call_hook(ctx, ctx.depth_policy, sig.loop, t)
    if not ok then return fail(ctx, r) end
    return r and C.TL_HOOK_STOP or C.TL_HOOK_CONTINUE
end))

local grammar_allowed_cb = ffi_cast("int (*)(void *, uint8_t *, int)", with_context(function(ctx, mask, vocab)
    local g = ctx.grammar
    local ok, r = call_hook(ctx, g.allowed, g, mask, vocab)
    if not ok then return fail(ctx, r) end
    if type(r) ~= "number" then -- no count returned: count the mask
        r = 0
        for i = 0, vocab - 1 do r = r + (mask[i] ~= 0 and 1 or 0) end
    elseif r ~= floor(r) or r < INT_MIN or r > vocab then
        -- C would read 1e20 as INT_MIN ("hook returned error -2147483648"): say what it was.
        -- (A negative integer is the hook's error code, which the engine reports.)
        return fail(ctx, ("grammar.allowed returned %s: must be the count of allowed tokens, an integer in [0, %d]")
            :format(tostring(r), vocab))
    end
    return r
end))

local grammar_advance_cb = ffi_cast("int (*)(void *, int32_t)", with_context(function(ctx, token)
    local g = ctx.grammar
    local ok, r = call_hook(ctx, g.advance, g, token)
    if not ok then return fail(ctx, r) end
    return 0
end))

-- ------------------------------------------------------------------ configs

-- Numeric fields of each C config and their C types: "int", "float" or "seed" (uint64).
-- Values are checked here only for what C cannot see (a Lua number that is not an
-- integer, or beyond the C type); the engine checks the ranges.
local NUMBER_FIELDS = {
    max_tokens = "int", loops = "int", temperature = "float", top_k = "int", top_p = "float",
    cache_window = "int", repetition_penalty = "float", beam_size = "int", length_penalty = "float",
    early_exit_patience = "int", early_exit_min_L = "int", early_exit_peek_every = "int",
    early_exit_logit_margin = "float", early_exit_threshold = "float", sample_seed = "seed",
    early_exit_kl_threshold = "float", early_exit_entropy_threshold = "float", early_exit_gate_threshold = "float",
    presence_penalty = "float", frequency_penalty = "float", penalty_window = "int", min_p = "float",
    min_tokens = "int", reasoning_budget = "int",
}
local SPEC_FIELDS = { max_tokens = "int", draft_loops = "int", verify_loops = "int", draft_ahead = "int",
                      temperature = "float", seed = "seed" }
local TREE_FIELDS = { K_branches = "int", max_nodes = "int" }

local function set_number(c, field, v, kind)
    -- a seed past 2^53 (a Lua number's exact integers) as a 64-bit integer: 0xFFFFFFFFFFFFFFFFULL
    if kind == "seed" and type(v) == "cdata" and (ffi.istype("uint64_t", v) or ffi.istype("int64_t", v)) then
        if v < 0 then raise(("config field '%s' = %s must not be negative"):format(field, tostring(v))) end
        c[field] = v
        return
    end
    if type(v) ~= "number" then raise("config field '" .. field .. "' must be a number") end
    if kind == "int" then
        check_int("config field '" .. field .. "'", v)
    elseif kind == "seed" and (v ~= floor(v) or v < 0 or v > SEED_MAX) then
        raise(("config field '%s' = %s must be an integer in [0, 2^53] (past it: a uint64_t, 0x...ULL)"):format(field, tostring(v)))
    elseif kind == "float" and v ~= math.huge and v ~= -math.huge and (v >= FLOAT_OVERFLOW or v <= -FLOAT_OVERFLOW) then
        -- (a C float holds it as inf: the engine's message then named a value not given)
        raise(("config field '%s' = %s is past a C float's range"):format(field, tostring(v)))
    end
    c[field] = v
    if kind == "float" and v ~= 0 and c[field] == 0 then -- (and one below it reads as 0)
        raise(("config field '%s' = %s is below a C float's smallest magnitude (1.4e-45)"):format(field, tostring(v)))
    end
end

local BOOLEAN_FIELDS = { "ignore_eos", "penalties_count_prompt", "keep_special_text", "fixed_state_seed", "temperature_last" }
local OTHER_FIELDS = {
    stop_sequences = true, stop_strings = true, ignore_eos = true, penalties_count_prompt = true, keep_special_text = true,
    fixed_state_seed = true, temperature_last = true, logit_bias = true,
    on_token = true, stop_when = true, logits_processor = true, grammar = true,
    speculative = true, verify_loops = true, early_exit_criterion = true, depth_policy = true,
    reasoning_start = true, reasoning_end = true, reasoning_open = true,
}
-- The hooks a config may hold as Lua functions (each needs the session's hook context).
local LUA_HOOKS = { "on_token", "stop_when", "logits_processor", "depth_policy" }
local function has_lua_hooks(cfg)
    for i = 1, #LUA_HOOKS do
        if cfg[LUA_HOOKS[i]] ~= nil then return true end
    end
    return false
end
-- cfg.early_exit_criterion: the names of tl_exit_criterion (Huginn's spelled with "_").
local EXIT_CRITERIA = {
    hidden_state = C.TL_EXIT_HIDDEN_STATE, latent_diff = C.TL_EXIT_LATENT_DIFF, kl = C.TL_EXIT_KL,
    entropy_diff = C.TL_EXIT_ENTROPY_DIFF, argmax = C.TL_EXIT_ARGMAX, gate = C.TL_EXIT_GATE,
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
    for k, v in ordered_pairs(cfg) do
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
    -- fields a mode alone reads (given to another, they did nothing)
    if mode == "chain" then
        for k in ordered_pairs(TREE_FIELDS) do
            if cfg[k] ~= nil then raise("config field '" .. k .. "' needs speculative = \"tree\" (the chain has no branches)") end
        end
    end
    -- (1, the original's default, does nothing either way: its GenerateConfig at its defaults is taken)
    if cfg.length_penalty ~= nil and cfg.length_penalty ~= 1 and (tonumber(cfg.beam_size) or 1) < 2 then
        raise("config field 'length_penalty' needs beam_size >= 2 (it ranks the beams)")
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
    local criterion = cfg.early_exit_criterion
    if criterion ~= nil then
        if not EXIT_CRITERIA[criterion] then
            raise("config field 'early_exit_criterion' must be one of \"hidden_state\", \"latent_diff\", \"kl\", "
                .. "\"entropy_diff\", \"argmax\", \"gate\"")
        end
        c.early_exit_criterion = EXIT_CRITERIA[criterion]
    end
    for _, field in ipairs(BOOLEAN_FIELDS) do -- (C ints, 0 or 1)
        local v = cfg[field]
        if v ~= nil then
            if type(v) ~= "boolean" then raise(("config field '%s' must be a boolean"):format(field)) end
            c[field] = v and 1 or 0
        end
    end
    local seqs = cfg.stop_sequences
    if seqs ~= nil then
        if type(seqs) ~= "table" then raise("config field 'stop_sequences' must be a table of id tables") end
        local arr = ffi_new("tl_token_seq[?]", list_length(seqs, "config field 'stop_sequences'") + 1)
        for i, seq in ipairs(seqs) do
            if type(seq) ~= "table" then raise("stop_sequences[" .. i .. "] must be a table of token ids") end
            local ids = ffi_new("int32_t[?]", list_length(seq, "stop_sequences[" .. i .. "]") + 1)
            for j = 1, #seq do ids[j - 1] = check_int("stop_sequences[" .. i .. "][" .. j .. "]", seq[j]) end
            arr[i - 1].tokens, arr[i - 1].n = ids, #seq
            keep[#keep + 1] = ids
        end
        c.stop_sequences, c.n_stop_sequences = arr, #seqs
        keep[#keep + 1] = arr
    end
    -- the thinking budget's tags: a text (encoded: "<think>" and "</think>" where left out)
    -- or token ids; reasoning_open: the prompt opened the block
    if cfg.reasoning_budget ~= nil or cfg.reasoning_start ~= nil or cfg.reasoning_end ~= nil or cfg.reasoning_open ~= nil then
        -- (the tags are looked at, and texts encoded, only where there is a budget: a model
        -- without a tokenizer takes a config that says none)
        local budget = (cfg.reasoning_budget or 0) > 0
        for field, default in pairs({ reasoning_start = "<think>", reasoning_end = "</think>" }) do
            local tag = cfg[field]
            if tag == nil then tag = budget and default or {} end
            if type(tag) == "string" and not budget then
                tag = {}
            elseif type(tag) == "string" then
                if not model.has_tokenizer then
                    raise(("config field '%s' is a text (%s by default), which needs the model's tokenizer: give "
                           .. "token ids"):format(field, default))
                end
                local ids, err = model:encode(tag)
                if not ids then raise(("config field '%s': %s"):format(field, tostring(err))) end
                tag = ids
            elseif type(tag) ~= "table" then
                raise(("config field '%s' must be a text or a table of token ids"):format(field))
            end
            local n_tag = list_length(tag, "config field '" .. field .. "'")
            local ids = ffi_new("int32_t[?]", n_tag + 1)
            for j = 1, n_tag do ids[j - 1] = check_int(field .. "[" .. j .. "]", tag[j]) end
            c[field].tokens, c[field].n = ids, n_tag
            keep[#keep + 1] = ids
        end
        local open = cfg.reasoning_open
        if open ~= nil and type(open) ~= "boolean" then raise("config field 'reasoning_open' must be a boolean") end
        c.reasoning_open = open and 1 or 0
    end
    local bias = cfg.logit_bias
    if bias ~= nil then
        -- { [token id] = bias }: the engine checks the ids' range and the biases' finiteness
        if type(bias) ~= "table" then raise("config field 'logit_bias' must be a table of token id = bias") end
        local ids = {}
        for id, b in pairs(bias) do
            -- (a string key shown as one: ["5"] read as "key 5 must be a number")
            check_int(("logit_bias key %s"):format(type(id) == "string" and ("%q"):format(id) or tostring(id)), id)
            if type(b) ~= "number" then raise(("logit_bias[%d] must be a number"):format(id)) end
            ids[#ids + 1] = id
        end
        table.sort(ids) -- the entries in id order, whatever the table's
        local arr = ffi_new("tl_logit_bias[?]", #ids + 1)
        for i, id in ipairs(ids) do arr[i - 1].token, arr[i - 1].bias = id, bias[id] end
        c.logit_bias, c.n_logit_bias = arr, #ids
        keep[#keep + 1] = arr
    end
    local strs = cfg.stop_strings
    if strs ~= nil then
        if type(strs) ~= "table" then raise("config field 'stop_strings' must be a table of strings") end
        local arr = ffi_new("const char *[?]", list_length(strs, "config field 'stop_strings'") + 1)
        for i, s in ipairs(strs) do
            if type(s) ~= "string" then raise("stop_strings[" .. i .. "] must be a string") end
            -- The engine's stop strings are C strings: one would end at its first NUL.
            local nul = s:find("\0", 1, true)
            if nul then
                raise(("stop_strings[%d] contains a NUL byte (at byte %d): stop strings cannot contain NUL"):format(i, nul))
            end
            arr[i - 1] = s
            keep[#keep + 1] = s
        end
        c.stop_strings, c.n_stop_strings = arr, #strs
        keep[#keep + 1] = arr
    end
    for _, hook in ipairs(LUA_HOOKS) do
        if cfg[hook] ~= nil and type(cfg[hook]) ~= "function" then
            raise("config field '" .. hook .. "' must be a function")
        end
    end
    local g = cfg.grammar
    local compiled_grammar
    -- ---- a compiled grammar: every session runs its own matcher (no Lua callbacks)
    if grammar_mod.is_compiled(g) then
        compiled_grammar = g
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
    if has_lua_hooks(cfg) or g then
        next_key = next_key + 1
        ctx = {
            -- (the C model through the handle: model:close() leaves it alive for its sessions)
            key = next_key, model = model.handle.raw, has_tokenizer = model.has_tokenizer,
            on_token = cfg.on_token, stop_when = cfg.stop_when, logits_processor = cfg.logits_processor,
            depth_policy = cfg.depth_policy, signals = {},
            grammar = g, compiled_grammar = compiled_grammar, tokens = {}, pieces = {}, prompt_len = 0,
            bytes = ffi_new("const char *[1]"), len = ffi_new("size_t[1]"),
            config = c, -- (what text_piece reads; a branch's is its session's: adopt_branch)
        }
        local user = ffi_cast("void *", ctx.key)
        -- on_token runs whenever a context exists: it keeps the token/text mirrors.
        c.on_token, c.on_token_user = on_token_cb, user
        if cfg.stop_when then c.stop_rule, c.stop_rule_user = stop_rule_cb, user end
        if cfg.logits_processor then c.logits_processor, c.logits_processor_user = logits_cb, user end
        if cfg.depth_policy then c.depth_policy, c.depth_policy_user = depth_policy_cb, user end
        if g then
            local grammar = ffi_new("tl_grammar")
            grammar.user, grammar.allowed, grammar.advance = user, grammar_allowed_cb, grammar_advance_cb
            c.grammar = grammar
            keep[#keep + 1] = grammar
        end
    end
    return c, keep, ctx, compiled_grammar
end

-- ------------------------------------------------------------------ prompts

-- ids of a prompt (a string is encoded), or nil, err when encoding fails at run time.
-- (what: the prompt's name in a message, "prompt" by default; generate_batch names its place)
local function prompt_ids(model, prompt, what)
    if type(prompt) == "string" then return model:encode(prompt) end
    if type(prompt) ~= "table" then raise((what or "prompt") .. " must be a string or a table of token ids") end
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

-- Raises unless n tokens fit the model's context, 1 .. max_seq_len (the calls that read one
-- sequence whole and size their buffers by it: score, embed). where: the call and the input.
local function check_in_context(model, n, where)
    if n < 1 or n > model.max_seq_len then
        raise(("%shas %d tokens: want 1 .. max_seq_len = %d"):format(where, n, model.max_seq_len))
    end
end

-- Token ids as an int32 array; each must be an integer (the FFI would truncate 1.5 to 1 and
-- wrap 1e10), named by its 1-based index; the engine checks the vocabulary range. A list with
-- a hole is refused (# may end at it: {72, nil, 547} was read as {72}).
local function id_array(ids, where)
    where = where or "" -- (generate_batch's "prompt i: ", as the engine names a prompt)
    local n = list_length(ids, where .. "token ids")
    local arr = ffi_new("int32_t[?]", n + 1)
    for i = 1, n do
        local id = ids[i]
        if type(id) ~= "number" then raise(where .. "token ids must be numbers (index " .. i .. ")") end
        if id ~= floor(id) or id < INT_MIN or id > INT_MAX then
            raise(("%stoken id %s at index %d must be an integer"):format(where, tostring(id), i))
        end
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
        mean_accepted = s.mean_accepted, prompt_tokens_reused = s.prompt_tokens_reused, prefill_tokens = s.prefill_tokens,
        probes = s.probes, probe_ms = s.probe_ms, depth_histogram = histogram, beam_score = s.beam_score,
        prefill_ms = s.prefill_ms, first_token_ms = s.first_token_ms, decode_ms = s.decode_ms,
        prompt_tokens = s.prompt_tokens, tokens_emitted = s.tokens_emitted,
        stop_reason = stop_name(s.stop_reason) or nil, loops_used = s.loops_used,
        decode_tokens_per_s = C.tl_stats_decode_tokens_per_s(s),
        prefill_tokens_per_s = C.tl_stats_prefill_tokens_per_s(s),
    }
end

-- ------------------------------------------------------------------ sessions

-- A C model has several users: its Model (until closed or collected) and every session made
-- from it (each keeps the model alive: a session reads the weights on every step). The last
-- user to let go frees it, whatever order close() and the garbage collector's finalizers run
-- in (a model and its sessions often become garbage in the same cycle).
local function model_release(h)
    h.refs = h.refs - 1
    if h.refs == 0 then
        C.tl_model_free(h.raw)
        h.raw = nil
    end
end

local Session = {}
Session.__index = Session

local text_ptr = ffi_new("const char *[1]")
local text_len = ffi_new("size_t[1]")

-- The session's text that became safe to show since the last read (tl_session_text), "" for
-- a model without a tokenizer.
local function new_text(s)
    if s.has_tokenizer and C.tl_session_text(s.ptr, text_ptr, text_len) == 0 then
        return ffi_string(text_ptr[0], text_len[0])
    end
    return ""
end

-- A step's result that model:step_batch held for the session when another's hook raised
-- (its token was emitted, its text read): the session's next step returns it, and ends the
-- session where it was its last.
local function take_held(s)
    local held = s.held
    s.held = nil
    if held.reason then s.done, s.stop_reason = true, held.reason end
    return held
end

-- A fork or a save copies the C session, whose token and text shown already count a held
-- result: the branch would never give that result, so neither is made until step() takes it.
local function not_holding(s, method)
    if s.held then
        raise("session:" .. method .. "(): the session holds the result of a model:step_batch call that " ..
              "raised (another session's hook); take it with session:step() first")
    end
end

-- While model:step_batch steps a list in C, a hook of one session may not close, detach, step
-- or fork another of it (their pointers are in the call).
local function not_in_batch(s, method)
    if s.in_batch then
        raise("session:" .. method .. "(): the session is in a model:step_batch call (from a hook of another session of it)")
    end
end
local n_out = ffi_new("int[1]")

local function release(self)
    if self.ctx then registry[self.ctx.key] = nil end
end

-- Why a finished session is: its stop reason, its error, or its detaching (session:detach).
local function finished_why(s)
    if s.detached then return "detached by session:detach(): its C session is the caller's" end
    return tostring(s.stop_reason or s.error)
end

-- session:step() -> id (or -1), the text that became safe to show ("" without a
-- tokenizer), and the stop reason once generation ends (false before); nil, err on a
-- runtime failure (the session is then finished).
-- Compiled traces must not call C functions that call back into Lua ("bad callback"
-- panic): this wrapper always runs in the interpreter.
function Session:step()
    not_in_batch(self, "step")
    if self.ptr == nil and not self.done then raise("session:step(): the session is closed") end
    if self.done then raise("session has already finished (" .. finished_why(self) .. ")") end
    if self.held then
        local held = take_held(self)
        return held.id, held.text, held.reason
    end
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
            self.error = "a hook raised: " .. error_text(err) -- (what a later step names)
            error(err, 0)
        end
        local err = last_error() -- before the close, whose calls clear it
        self:close()
        self.error = err
        if ARGUMENT_ERRORS[tonumber(st)] then raise(err) end -- the convention: after the close
        return nil, err
    end
    local id, reason = step_token[0], stop_name(step_stop[0])
    local text = new_text(self)
    if reason then
        self.done, self.stop_reason = true, reason
    end
    return id, text, reason
end
jit.off(Session.step)

-- session:logprobs([top]) -> the log-probability of the token the last step emitted, under
-- the logits it was chosen from as the model gave them (before hooks, penalties, grammar and
-- temperature: tl_session_logprobs), and a list of the `top` (0..20, default 0) most likely
-- tokens, most likely first: { {id = ..., logprob = ...}, ... }. Raised: a closed session, a
-- step that emitted nothing, a beam session (its rows are not kept). A speculative session's
-- tokens have their verification rows' figures.
local MAX_TOP_LOGPROBS = tonumber(C.TL_MAX_TOP_LOGPROBS)

-- tinyloop.alternatives_of(ids, logprobs, from, top): one token's alternatives out of flat
-- arrays (C arrays or Lua tables, indexed from `from`), top entries at most, up to the first
-- id -1 (fewer tokens allowed than asked), as { {id = ..., logprob = ...}, ... }: the one
-- shape of session:logprobs, model:score_logprobs and the server's logprobs.
local function alternatives_of(ids, logprobs, from, top)
    local list = {}
    for j = from, from + top - 1 do
        if ids[j] < 0 then break end
        list[#list + 1] = { id = tonumber(ids[j]), logprob = tonumber(logprobs[j]) }
    end
    return list
end
_M.alternatives_of = alternatives_of

local lp_token = ffi_new("float[1]")
local lp_ids = ffi_new("int32_t[?]", MAX_TOP_LOGPROBS)
local lp_values = ffi_new("float[?]", MAX_TOP_LOGPROBS)
function Session:logprobs(top)
    if self.ptr == nil then raise("session:logprobs(): the session is closed") end
    top = check_int("top", top or 0)
    local st = C.tl_session_logprobs(self.ptr, top, lp_token, lp_ids, lp_values)
    if st ~= 0 then return engine_failure(st) end
    return lp_token[0], alternatives_of(lp_ids, lp_values, 0, top)
end

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

-- The most bytes of K/V pages the session can hold before it ends (tl_session_max_kv_bytes:
-- its prompt, max_tokens and its mode's rows at its loops): what an app that admits sessions
-- by memory counts; 0 once closed.
function Session:max_kv_bytes()
    if self.ptr == nil then return 0 end
    return tonumber(C.tl_session_max_kv_bytes(self.ptr))
end

-- Frees the C session now (the garbage collector would do it later). Refused from inside one
-- of the session's own hooks: the step that runs the hook still uses the session.
function Session:close()
    of_class(self, Session, "session:close()")
    not_in_batch(self, "close")
    if self.ctx and self.ctx.in_hook then
        raise("session:close() from inside one of its own hooks: close it after the step returns")
    end
    if self.ptr ~= nil then
        self.final_tokens, self.closed_stats = self:tokens(), self:stats()
        ffi_gc(self.ptr, nil)
        C.tl_session_free(self.ptr)
        self.ptr = nil
        release(self)
        model_release(self.model.handle)
    end
end

-- ---- server (lua/tinyloop/server): hand a session to the C serving engine
-- session:detach() -> the raw `tl_session *`, now the caller's to free (tl_session_free) or
-- to give to tl_engine_submit; this object is closed. Only for a live session without Lua
-- hooks: the engine steps it on its own thread, where Lua cannot run. The session gives up
-- its hold on the C model, as C code holds none: like an engine's, the model must stay open
-- until the detached session is freed (refused on a closed model, which it alone kept alive).
function Session:detach()
    of_class(self, Session, "session:detach()") -- (a state given it was detached: leaked, its model's count taken)
    not_in_batch(self, "detach")
    if self.ctx then raise("session:detach(): a session with Lua hooks cannot leave its Lua state") end
    if self.ptr == nil or self.done then raise("session:detach(): the session has finished or is closed") end
    if self.model.ptr == nil then raise("session:detach(): the model is closed; a detached session needs it open") end
    local p = self.ptr
    ffi_gc(p, nil)
    self.ptr, self.done, self.detached = nil, true, true
    model_release(self.model.handle)
    return p
end
-- ---- end server

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
-- kept out of compiled traces (jit.off below). The call holds the C model as a session does:
-- a hook may close the Model (its last other user) while the call still reads the weights.
local blocking_len = ffi_new("int[1]")
local function call_blocking(ids, ctx, capacity, cfunc, model, arr, cfg, stats)
    local n = #ids
    if ctx then
        registry[ctx.key] = ctx
        begin_sequence(ctx, ids)
    end
    local out = ffi_new("int32_t[?]", capacity + 1)
    local handle = model.handle
    handle.refs = handle.refs + 1
    local status = cfunc(model.ptr, arr, n, cfg, out, capacity, blocking_len, stats)
    model_release(handle)
    local ok, err = blocking_result(status, ctx)
    if not ok then return nil, err end
    local t = {}
    for i = 1, blocking_len[0] do t[i] = out[i - 1] end
    return t
end
jit.off(call_blocking)

-- ------------------------------------------------------------------ models

local Model = {}
Model.__index = Model

-- The model's C pointer, or a raised error naming the method once the model is closed.
local function model_ptr(model, method)
    of_class(model, Model, "model:" .. method .. "()") -- (a session said "attempt to call method 'session'")
    local ptr = model.ptr
    if ptr == nil then raise("model:" .. method .. "(): the model is closed") end
    return ptr
end

local status_out = ffi_new("tl_model *[1]")
local BACKENDS = { auto = C.TL_BACKEND_AUTO, cpu = C.TL_BACKEND_CPU, cuda = C.TL_BACKEND_CUDA }
local KV_TYPES = { f32 = C.TL_KV_F32, f16 = C.TL_KV_F16 }

-- tinyloop.load(dir [, opts]) -> model | nil, err. opts: threads (0 = one per core this
-- process may use), mmap_weights (boolean), backend ("auto", "cpu" or "cuda"), kv_type
-- ("f32" or "f16": half the KV memory, CPU only). Bad arguments raise; a checkpoint that
-- cannot be loaded, or a backend this machine lacks, gives nil, err.
function _M.load(dir, opts)
    check_path(dir, "tinyloop.load: model directory")
    local o = ffi_new("tl_load_options")
    C.tl_load_options_init(o)
    if opts ~= nil then
        if type(opts) ~= "table" then raise("tinyloop.load: options must be a table") end
        for k, v in ordered_pairs(opts) do
            if k == "threads" then
                if type(v) ~= "number" then raise("load option 'threads' must be a number") end
                -- (its own range in the message: a C int's, check_int's, read as if -5 were one)
                if v ~= floor(v) or v < 0 or v > C.TL_MAX_THREADS then
                    raise(("load option 'threads' = %s must be an integer in [0, %d] (0 = all cores)")
                        :format(tostring(v), C.TL_MAX_THREADS))
                end
                o.n_threads = v
            elseif k == "mmap_weights" then
                if type(v) ~= "boolean" then raise("load option 'mmap_weights' must be a boolean") end
                o.mmap_weights = v and 1 or 0
            elseif k == "backend" then
                local b = BACKENDS[v]
                if not b then raise("load option 'backend' must be \"auto\", \"cpu\" or \"cuda\"") end
                o.backend = b
            elseif k == "kv_type" then
                local t = KV_TYPES[v]
                if not t then raise("load option 'kv_type' must be \"f32\" or \"f16\"") end
                o.kv_type = t
            else
                raise("unknown load option '" .. tostring(k) .. "'")
            end
        end
    end
    if C.tl_model_load(dir, o, status_out) ~= 0 then return nil, last_error() end
    -- handle.raw is a separate cdata: the finalizer's closure must not reference the cdata
    -- it is attached to (that would keep it alive forever).
    local handle = { raw = ffi_cast("tl_model *", status_out[0]), refs = 1 }
    local ptr = ffi_gc(status_out[0], function() model_release(handle) end)
    local info = C.tl_model_info(ptr)
    local warnings = {}
    for line in ffi_string(C.tl_model_warnings(ptr)):gmatch("[^\n]+") do warnings[#warnings + 1] = line end
    return setmetatable({
        ptr = ptr,
        handle = handle,
        warnings = warnings, -- what the load accepted but a person should see (unknown config fields)
        vocab_size = info.vocab_size,
        d_model = info.d_model, -- (an embedding's length)
        max_seq_len = info.max_seq_len,
        default_loops = info.default_loops,
        max_loops = info.max_loops,
        has_tokenizer = info.has_tokenizer ~= 0,
    }, Model)
end

-- model:close() frees the model's C memory now; the garbage collector would do it later, but
-- it cannot see that memory (LuaJIT has no way to be told the size of C allocations), so a
-- program that loads many models should close them. Idempotent. Sessions still open keep the
-- C model alive until they are closed or collected; every other method raises afterwards.
function Model:close()
    of_class(self, Model, "model:close()")
    if self.ptr == nil then return end
    ffi_gc(self.ptr, nil)
    self.ptr = nil
    model_release(self.handle)
end

function Model:info()
    local i = C.tl_model_info(model_ptr(self, "info"))
    local t = {}
    for _, k in ipairs({ "vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                         "max_seq_len", "n_prelude", "n_block", "n_coda", "default_loops", "max_loops",
                         "bos_token_id", "eos_token_id", "n_threads" }) do
        t[k] = tonumber(i[k])
    end
    for _, k in ipairs({ "beta", "norm_eps", "rope_theta" }) do t[k] = tonumber(i[k]) end
    for _, k in ipairs({ "injection", "loop_update", "norm", "mlp", "pos_encoding", "weight_dtype", "backend", "kv_type" }) do
        t[k] = ffi_string(i[k])
    end
    for _, k in ipairs({ "state_norm", "bias", "tie_embeddings", "has_tokenizer", "exit_gate" }) do t[k] = i[k] ~= 0 end
    t.n_params, t.weight_bytes = tonumber(i.n_params), tonumber(i.weight_bytes)
    t.exit_gate_threshold = tonumber(i.exit_gate_threshold)
    return t
end

-- model:memory() -> { weight_bytes, kv_bytes, kv_spare_bytes }: what the model holds now
-- (kv_bytes: the K/V pages of its sessions, saved states and prefix pool; kv_spare_bytes:
-- freed pages kept for the next sessions).
local memory_out = ffi_new("tl_model_memory")
function Model:memory()
    C.tl_model_get_memory(model_ptr(self, "memory"), memory_out)
    return { weight_bytes = tonumber(memory_out.weight_bytes), kv_bytes = tonumber(memory_out.kv_bytes),
             kv_spare_bytes = tonumber(memory_out.kv_spare_bytes) }
end

local enc_ids = ffi_new("int32_t *[1]")
local enc_n = ffi_new("int[1]")
local dec_text = ffi_new("char *[1]")
local dec_len = ffi_new("size_t[1]")

-- model:encode(text[, opts]) -> ids | nil, err. opts.parse_special (default true): false reads
-- special tokens' texts ("<|endoftext|>") as ordinary text, for text that must not inject
-- control tokens (tl_encode_ex's TL_ENCODE_SPECIAL_AS_TEXT).
-- tinyloop.encode_flags(opts) -> tl_encode_ex's flags of model:encode's options (checked, raising
-- as model:encode does): what a thread pool's tl_encode_ex call is handed as well.
function _M.encode_flags(opts)
    if opts == nil then return 0 end
    if type(opts) ~= "table" then raise("encode: options must be a table") end
    for k, v in ordered_pairs(opts) do
        if k ~= "parse_special" then raise(("encode: unknown option '%s' (parse_special)"):format(tostring(k))) end
        if type(v) ~= "boolean" then raise("encode: parse_special must be a boolean") end
    end
    return opts.parse_special == false and tonumber(C.TL_ENCODE_SPECIAL_AS_TEXT) or 0
end

function Model:encode(text, opts)
    if type(text) ~= "string" then raise("encode: text must be a string") end
    local flags = _M.encode_flags(opts)
    local st = C.tl_encode_ex(model_ptr(self, "encode"), text, #text, flags, enc_ids, enc_n)
    if st ~= 0 then return engine_failure(st) end
    local ids, n, t = enc_ids[0], enc_n[0], {}
    for i = 1, n do t[i] = ids[i - 1] end
    C.tl_free(ids)
    return t
end

-- model:special_tokens() -> { {id = id, text = text}, ... } in id order: the tokenizer's special
-- tokens (tl_token_is_special: control, not text) with their texts; {} without a tokenizer.
-- (tinyloop.chat encodes what users wrote with these read as text.) Found once a model.
function Model:special_tokens()
    local ptr = model_ptr(self, "special_tokens")
    if not self.special_list then
        local list = {}
        if self.has_tokenizer then
            for id = 0, self.vocab_size - 1 do
                if C.tl_token_is_special(ptr, id) ~= 0 then
                    local text, err = self:decode({ id })
                    if not text then return nil, err end
                    list[#list + 1] = { id = id, text = text }
                end
            end
        end
        self.special_list = list
    end
    local copy = {}
    for i, t in ipairs(self.special_list) do copy[i] = { id = t.id, text = t.text } end
    return copy
end

-- model:decode(ids) -> text | nil, err
function Model:decode(ids)
    if type(ids) ~= "table" then raise("decode: ids must be a table") end
    local ptr = model_ptr(self, "decode")
    local arr, n = id_array(ids)
    local st = C.tl_decode(ptr, arr, n, dec_text, dec_len)
    if st ~= 0 then return engine_failure(st) end
    local s = ffi_string(dec_text[0], dec_len[0])
    C.tl_free(dec_text[0])
    return s
end

local session_out = ffi_new("tl_session *[1]")

-- model:session(prompt, cfg) -> a session stepped with session:step(), or nil, err.
-- A Session object owning the C session `ptr` (freed by close or the garbage collector).
-- compiled_grammar: the session's compiled grammar (a fork or resume that gives hooks of its
-- own continues it; the C session holds its own reference).
local function wrap_session(model, ptr, ctx, keep, compiled_grammar)
    local self_session = setmetatable({
        model = model, ctx = ctx, keep = keep, has_tokenizer = model.has_tokenizer, done = false,
        compiled_grammar = compiled_grammar,
        step_token = ffi_new("int32_t[1]"), step_stop = ffi_new("tl_stop_reason[1]"),
    }, Session)
    local key, handle = ctx and ctx.key, model.handle
    handle.refs = handle.refs + 1 -- the session keeps the C model alive (model_release)
    self_session.ptr = ffi_gc(ptr, function(p)
        C.tl_session_free(p)
        if key then registry[key] = nil end
        model_release(handle)
    end)
    return self_session
end

-- A session on prompt ids, or nil, the engine's status (the caller applies the error
-- convention: model:session raises argument errors, generate_batch names the prompt).
local function new_session(model, ids, cfg)
    local c, keep, ctx, compiled_grammar = make_config(model, cfg)
    local arr, n = id_array(ids)
    if ctx then
        registry[ctx.key] = ctx
        begin_sequence(ctx, ids)
    end
    local st = C.tl_session_new(model.ptr, arr, n, c, session_out)
    if st ~= 0 then
        if ctx then registry[ctx.key] = nil end
        return nil, st
    end
    return wrap_session(model, session_out[0], ctx, keep, compiled_grammar)
end

function Model:session(prompt, cfg)
    model_ptr(self, "session")
    local ids, err = prompt_ids(self, prompt)
    if not ids then return nil, err end
    local s, st = new_session(self, ids, cfg)
    if not s then return engine_failure(st) end
    return s
end

-- model:generate(prompt, cfg) -> ids (prompt + continuation), stats | nil, err
-- Every mode (plain, speculative = "chain" | "tree", beam_size >= 2) runs on a session.
function Model:generate(prompt, cfg)
    model_ptr(self, "generate")
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
    model_ptr(self, "stream")
    local s, err = self:session(prompt, cfg)
    if not s then return nil, err end
    -- The call after the last pair closes the session: its KV memory goes at once, not at a
    -- later collection (s:tokens() and s:stats() still answer).
    local function iterate()
        if s.done then
            s:close()
            return nil
        end
        local id, text, reason = s:step()
        if id == nil then return nil, text end
        if reason then s.final_stats = s:stats() end
        if id < 0 and text == "" then
            s:close()
            return nil
        end
        return id, text
    end
    return iterate, s
end

-- With hooks: one session (and hook context) per prompt, all advanced together by
-- tl_session_step_batch, so that each hook call sees its own prompt's sequence: the tokens
-- of stop_when and logits_processor, and stop_when's text, are that prompt's. Calls for
-- different prompts interleave. Returns outs, stats like generate_batch.
local function batch_with_hooks(model, all_ids, cfg)
    local n, sessions = #all_ids, {}
    local function close_all()
        for i = 1, #sessions do sessions[i]:close() end
    end
    for i = 1, n do -- every prompt is validated before any is decoded
        local s, st = new_session(model, all_ids[i], cfg)
        if not s then
            local msg = ("generate_batch: prompt %d: %s"):format(i, lua_wording(last_error()))
            close_all()
            if ARGUMENT_ERRORS[tonumber(st)] then raise(msg) end
            return nil, msg
        end
        sessions[i] = s
    end
    local ptrs, map = ffi_new("tl_session *[?]", n), {}
    local tokens, stops = ffi_new("int32_t[?]", n), ffi_new("tl_stop_reason[?]", n)
    local statuses = ffi_new("tl_status[?]", n)
    while true do
        local k = 0
        for i = 1, n do
            if not sessions[i].done then
                ptrs[k], map[k] = sessions[i].ptr, i
                k = k + 1
            end
        end
        if k == 0 then break end
        local st = C.tl_session_step_batch(ptrs, k, tokens, stops, statuses)
        if st ~= 0 then close_all() return engine_failure(st) end
        for j = 0, k - 1 do
            local s = sessions[map[j]]
            local status = statuses[j]
            if status ~= 0 then
                local ctx = s.ctx
                local err = ("generate_batch: prompt %d: %s"):format(map[j], lua_wording(ffi_string(C.tl_session_error(s.ptr))))
                close_all()
                if status == C.TL_ERR_HOOK and ctx and ctx.err then error(ctx.err, 0) end
                if ARGUMENT_ERRORS[tonumber(status)] then raise(err) end
                return nil, err
            end
            local reason = stop_name(stops[j])
            if reason then s.done, s.stop_reason = true, reason end
        end
    end
    local outs, all_stats = {}, {}
    for i = 1, n do
        outs[i], all_stats[i] = sessions[i]:tokens(), sessions[i]:stats()
        sessions[i]:close()
    end
    return outs, all_stats
end
jit.off(batch_with_hooks)

-- model:step_batch(sessions[, opts]) -> results: advances every session of the list (this
-- model's, each once) by one step, all in ONE batched forward (tl_session_step_batch_with), as
-- session:step() would one by one; each session's tokens are bit-identical to stepping it
-- alone. results[i] is sessions[i]'s step: { id = token, text = its new text, reason = the
-- stop reason, or false while it goes on }, or { error = message } where its step failed (the session is then
-- done and closed, as after step()'s nil, err). opts.prompt_rows (default 0: no limit) caps
-- the rows of prompts the call forwards, shared out in the list's order beside every running
-- session's row (chunked prefill): a session whose prompt it cut gets { id = -1, text = "" }
-- and emits its first token in a later call. Raised: a closed or finished session, one given
-- twice, another model's, a bad option; and a hook's error, once every session's result is
-- settled (the hook's session is closed, the others go on). An empty list gives {}.
local STEP_BATCH_OPTIONS = { prompt_rows = true }
function Model:step_batch(sessions, opts)
    model_ptr(self, "step_batch")
    if type(sessions) ~= "table" then raise("model:step_batch(): sessions must be a list of sessions") end
    local n = list_length(sessions, "model:step_batch(): sessions")
    if opts ~= nil and type(opts) ~= "table" then raise("model:step_batch(): opts must be a table") end
    local so = ffi_new("tl_step_batch_options")
    C.tl_step_batch_options_init(so)
    for k, v in ordered_pairs(opts or {}) do
        if not STEP_BATCH_OPTIONS[k] then raise("model:step_batch(): unknown option '" .. tostring(k) .. "' (prompt_rows)") end
        if k == "prompt_rows" then
            so.prompt_rows = check_int("model:step_batch(): prompt_rows", v)
            if v < 0 then raise("model:step_batch(): prompt_rows = " .. v .. " must be >= 0 (0: no limit)") end
        end
    end
    if n == 0 then return {} end
    local seen = {}
    for i = 1, n do
        local s = sessions[i]
        if getmetatable(s) ~= Session then raise(("model:step_batch(): sessions[%d] is not a session"):format(i)) end
        -- (here, not C's check: C numbers the list from 0)
        if seen[s] then raise(("model:step_batch(): sessions[%d] is sessions[%d] again"):format(i, seen[s])) end
        seen[s] = i
        if s.model ~= self then raise(("model:step_batch(): sessions[%d] is another model's"):format(i)) end
        if s.done then
            raise(("model:step_batch(): sessions[%d] has already finished (%s)"):format(i, finished_why(s)))
        end
        if s.ptr == nil then raise(("model:step_batch(): sessions[%d] is closed"):format(i)) end
        -- (a hook's own step_batch of a session the outer call steps: it set, then cleared, the
        -- outer call's marks, and the session could be closed mid-step)
        if s.in_batch then raise(("model:step_batch(): sessions[%d] is in a model:step_batch call already"):format(i)) end
    end
    local results = {}
    -- (a session a raising call left a step's result to: that result, and no step of its own;
    -- taken once this call is sure to return, else it stays held)
    local stepping = {}
    for i = 1, n do
        if not sessions[i].held then stepping[#stepping + 1] = sessions[i] end
    end
    local n_stepping = #stepping
    local function take_all_held()
        for i = 1, n do
            if sessions[i].held then results[i] = take_held(sessions[i]) end
        end
    end
    if n_stepping == 0 then
        take_all_held()
        return results
    end
    local ptrs = ffi_new("tl_session *[?]", n_stepping)
    for k = 1, n_stepping do ptrs[k - 1] = stepping[k].ptr end
    local tokens, stops = ffi_new("int32_t[?]", n_stepping), ffi_new("tl_stop_reason[?]", n_stepping)
    local statuses = ffi_new("tl_status[?]", n_stepping)
    -- (not_in_batch: while C steps them; the list is copied so that a hook cannot change it)
    sessions = { unpack(sessions, 1, n) }
    for i = 1, n do sessions[i].in_batch = true end
    -- (the C call refuses a session that is stepping already)
    local st = C.tl_session_step_batch_with(ptrs, n_stepping, so, tokens, stops, statuses)
    for i = 1, n do sessions[i].in_batch = nil end
    if st ~= 0 then return engine_failure(st) end
    local hook_error, argument_error = nil, nil
    -- A hook's error (or an argument error) is raised after the loop: the others' results stay
    -- held, each session's next step (or session:step) returning its own, not lost with these.
    for k = 1, n_stepping do
        local s, status = stepping[k], statuses[k - 1]
        local i = seen[s]
        if status ~= 0 then
            local ctx = s.ctx
            local err = ffi_string(C.tl_session_error(s.ptr))
            if status == C.TL_ERR_HOOK and ctx and ctx.err then
                hook_error = hook_error or { ctx.err }
                err = "a hook raised: " .. error_text(ctx.err) -- (what a later step names, as step()'s)
                ctx.err = nil
            end
            if not hook_error and ARGUMENT_ERRORS[tonumber(status)] then argument_error = argument_error or err end
            s.done = true
            s:close()
            s.error = err
            results[i] = { error = err }
        else -- (held, and taken below unless this call raises: one rule for a result, take_held's)
            s.held = { id = tokens[k - 1], text = new_text(s), reason = stop_name(stops[k - 1]) }
        end
    end
    if hook_error then error(hook_error[1], 0) end
    if argument_error then raise(argument_error) end -- (the convention: after the others' results settle)
    take_all_held()
    return results
end
jit.off(Model.step_batch)

-- model:generate_batch({prompt, ...}, cfg) -> {ids_1, ...}, {stats_1, ...} | nil, err.
-- Continuous batching: the prompts decode together, every step one batched forward over
-- all of them (tl_generate_batch; with hooks, tl_session_step_batch over one session per
-- prompt, see batch_with_hooks). Each output is bit-identical to generate on its own.
function Model:generate_batch(prompts, cfg)
    model_ptr(self, "generate_batch")
    if type(prompts) ~= "table" then raise("generate_batch: prompts must be a table") end
    local n_prompts, all_ids = list_length(prompts, "generate_batch: prompts"), {}
    for i = 1, n_prompts do
        local ids, err = prompt_ids(self, prompts[i], "generate_batch: prompt " .. i)
        if not ids then return nil, ("generate_batch: prompt %d: %s"):format(i, tostring(err)) end
        all_ids[i] = ids
    end
    if cfg ~= nil and type(cfg) == "table" and (has_lua_hooks(cfg) or cfg.grammar) then
        if n_prompts > 1 and cfg.grammar ~= nil and not grammar_mod.is_compiled(cfg.grammar) then
            -- (one Lua grammar object holds one sequence's state: prompts would interleave on it)
            raise("generate_batch: a Lua grammar holds one sequence's state and cannot serve several prompts: "
                  .. "use a compiled grammar (tinyloop.grammar), or one generate per prompt")
        end
        if n_prompts == 0 then make_config(self, cfg) return {}, {} end
        return batch_with_hooks(self, all_ids, cfg)
    end
    local c, keep = make_config(self, cfg)
    if n_prompts == 0 then return {}, {} end -- the engine wants at least one prompt
    local seqs = ffi_new("tl_token_seq[?]", n_prompts)
    local prompt_tokens = 0
    for i = 1, n_prompts do
        local arr, n = id_array(all_ids[i], "generate_batch: prompt " .. i .. ": ")
        keep[#keep + 1] = arr
        seqs[i - 1].tokens, seqs[i - 1].n = arr, n
        prompt_tokens = prompt_tokens + n
    end
    local capacity = output_capacity(self, prompt_tokens, n_prompts, c.max_tokens)
    local out = ffi_new("int32_t[?]", capacity + 1)
    local lens = ffi_new("int[?]", n_prompts)
    local stats = ffi_new("tl_generate_stats[?]", n_prompts)
    local st = C.tl_generate_batch(self.ptr, seqs, n_prompts, c, out, capacity, lens, ffi_new("int[1]"), stats)
    if st ~= 0 then return engine_failure(st) end
    local outs, all_stats, at = {}, {}, 0
    for i = 1, n_prompts do
        local t, len = {}, lens[i - 1]
        for k = 1, len do t[k] = out[at + k - 1] end
        at = at + len
        outs[i], all_stats[i] = t, stats_table(stats[i - 1])
    end
    return outs, all_stats
end

-- ------------------------------------------------------------------ forks, saved states, prefix pool

-- tinyloop.policy's rules keep state per sequence (keyed by its tokens table): a branch's new
-- table continues the parent's (only where the module is in use).
local function branch_policies(from, to)
    local policy = package.loaded["tinyloop.policy"]
    if policy and from then policy.branch(from, to) end
end

local HOOK_FIELDS = { grammar = true }
for _, hook in ipairs(LUA_HOOKS) do HOOK_FIELDS[hook] = true end

-- A saved state: { ptr, ctx (the hooks and token/text mirrors it continues with), model }.
local State = {}
State.__index = State

-- A branch's text mirror (ctx.pieces), made once the branch session `ptr` exists: the text
-- of its tokens past the prompt as that session shows it (tl_session_config: fork and resume
-- keep the parent's keep_special_text and ends, which the branch's own Lua config, hooks
-- alone, does not hold).
local function adopt_branch(ctx, ptr)
    if not ctx then return end
    ctx.config = C.tl_session_config(ptr)
    local tokens, pieces = ctx.tokens, ctx.pieces
    for i = #pieces, 1, -1 do pieces[i] = nil end
    for i = ctx.prompt_len + 1, #tokens do pieces[#pieces + 1] = text_piece(ctx, tokens[i], token_text(ctx, tokens[i])) end
end

-- The hook context and C hook fields of a branch of `session` (a session or a saved state):
-- its own hooks, the parent's where `hooks` does not replace them, and its own token/text
-- mirrors (a copy of the parent's). Returns the C config (or nil: keep the parent's, there
-- are none), keep, ctx, and the branch's compiled grammar.
local function branch_hooks(session, hooks, what)
    if hooks ~= nil and type(hooks) ~= "table" then raise(what .. ": hooks must be a table") end
    hooks = hooks or {}
    for k in ordered_pairs(hooks) do
        if not HOOK_FIELDS[k] then raise(what .. ": unknown hook field '" .. tostring(k) .. "'") end
    end
    local parent = session.ctx or {}
    local cfg = {}
    for k in pairs(HOOK_FIELDS) do
        local v = hooks[k]
        if v == nil then v = parent[k] end
        -- the parent's compiled grammar: the C side continues it from the parent's state (a
        -- session with no Lua hooks has no ctx: the session or state holds it)
        if k == "grammar" and v == nil then v = parent.compiled_grammar or session.compiled_grammar end
        cfg[k] = v
    end
    if hooks.grammar == nil and parent.grammar then -- a Lua grammar's state cannot be copied
        raise(what .. ": the session has a Lua grammar, whose state cannot be copied: pass one for the branch ({ grammar = ... })")
    end
    if not (has_lua_hooks(cfg) or cfg.grammar) then return nil, {}, nil, nil end
    local c, keep, ctx, compiled_grammar = make_config(session.model, cfg)
    if not ctx then return c, keep, nil, compiled_grammar end -- a compiled grammar alone: no Lua hooks to mirror for
    -- (a parent without Lua hooks kept no mirrors: the branch's hooks still see the whole
    -- sequence, and adopt_branch its whole text)
    if not session.ctx then
        local tokens, prompt_len = session:tokens()
        if getmetatable(session) ~= State then prompt_len = C.tl_session_stats(session.ptr).prompt_tokens end
        parent = { tokens = tokens, prompt_len = prompt_len }
    end
    for i, t in ipairs(parent.tokens or {}) do ctx.tokens[i] = t end
    ctx.prompt_len = parent.prompt_len or 0
    branch_policies(parent.tokens, ctx.tokens)
    return c, keep, ctx, compiled_grammar
end

local branch_out = ffi_new("tl_session *[1]")

-- session:fork([hooks]) -> session | nil, err: a new session continuing from this one's
-- state (tokens, cache, sampler position, text), sharing its KV pages until either writes
-- (copy on write). hooks (optional): { on_token, stop_when, logits_processor, depth_policy, grammar }
-- replacing the parent's for the child. Any mode: plain, speculative, beam search.
function Session:fork(hooks)
    not_in_batch(self, "fork")
    if self.ptr == nil then raise("session:fork(): the session is closed") end
    not_holding(self, "fork")
    if self.ctx and self.ctx.in_hook then raise("session:fork() from inside one of its own hooks") end
    local c, keep, ctx, compiled_grammar = branch_hooks(self, hooks, "session:fork()")
    if ctx then registry[ctx.key] = ctx end
    local st = C.tl_session_fork(self.ptr, c, branch_out)
    if st ~= 0 then
        if ctx then registry[ctx.key] = nil end
        return engine_failure(st)
    end
    adopt_branch(ctx, branch_out[0])
    return wrap_session(self.model, branch_out[0], ctx, keep, compiled_grammar)
end

local state_out = ffi_new("tl_session_state *[1]")

-- A state keeps the C model alive like a session does (model_release): its KV pages are the
-- model's, and the collector may finalise a model and its last state in either order.
local function wrap_state(model, ptr, ctx)
    local handle = model.handle
    handle.refs = handle.refs + 1
    return setmetatable({ ctx = ctx, model = model, ptr = ffi_gc(ptr, function(p)
        C.tl_session_state_free(p)
        model_release(handle)
    end) }, State)
end

local function state_ptr(state, what)
    if state.ptr == nil then raise(what .. ": the state is closed") end
    return state.ptr
end

-- state:close(): frees the state's memory (its KV pages) now, not at the next collection.
function State:close()
    of_class(self, State, "state:close()")
    if self.ptr ~= nil then
        ffi_gc(self.ptr, nil)
        C.tl_session_state_free(self.ptr)
        self.ptr = nil
        model_release(self.model.handle)
    end
end

-- A session's hook context as of a save: its token mirror copied (the session goes on
-- appending to its own, and a resume must see the sequence of the save, not of later steps;
-- its text is made again from it, adopt_branch), its hooks shared.
local function snapshot_ctx(ctx)
    if not ctx then return nil end
    local snap = setmetatable({ tokens = {}, prompt_len = ctx.prompt_len }, { __index = ctx })
    for i, t in ipairs(ctx.tokens or {}) do snap.tokens[i] = t end
    branch_policies(ctx.tokens, snap.tokens)
    return snap
end

-- session:save() -> state | nil, err: the session's state, kept after it is closed, to be
-- resumed (any number of times) by model:resume(state [, hooks]) on the same model, or
-- written out with state:bytes() / state:write(path).
function Session:save()
    if self.ptr == nil then raise("session:save(): the session is closed") end
    not_holding(self, "save")
    local st = C.tl_session_save(self.ptr, state_out)
    if st ~= 0 then return engine_failure(st) end
    local state = wrap_state(self.model, state_out[0], snapshot_ctx(self.ctx))
    state.compiled_grammar = self.compiled_grammar
    return state
end

-- state:bytes() -> string | nil, err: the state as bytes (tl_session_state_to_bytes: tokens,
-- sampler position, stats and KV cache; hooks are not written).
local bytes_out, len_out = ffi_new("void *[1]"), ffi_new("size_t[1]")
function State:bytes()
    local st = C.tl_session_state_to_bytes(state_ptr(self, "state:bytes()"), bytes_out, len_out)
    if st ~= 0 then return engine_failure(st) end -- (a state of another mode: raised, as refusals are)
    -- (freed on every path: a state past a Lua string's limit raised in ffi.string, and each
    -- call lost the whole buffer, 2 GB)
    local len = tonumber(len_out[0])
    if len > limits.string_bytes then
        C.tl_free(bytes_out[0])
        return nil, ("state:bytes(): the state is %.0f bytes, more than a Lua string holds (%.0f): " ..
                     "state:write(path) writes it to a file"):format(len, limits.string_bytes)
    end
    local ok, s = pcall(ffi_string, bytes_out[0], len)
    C.tl_free(bytes_out[0])
    if not ok then return nil, "state:bytes(): " .. tostring(s) end -- (out of Lua's memory)
    return s
end

-- state:write(path) -> true | nil, err: the same into a file (written beside it, then
-- renamed over it).
function State:write(path)
    check_path(path, "state:write(path): path")
    local st = C.tl_session_state_write(state_ptr(self, "state:write()"), path)
    if st ~= 0 then return engine_failure(st) end
    return true
end

-- state:tokens() -> { ids }, prompt_len: the state's prompt and emitted tokens.
function State:tokens()
    local n, prompt_len = ffi_new("int[1]"), ffi_new("int[1]")
    local ids = C.tl_session_state_tokens(state_ptr(self, "state:tokens()"), n, prompt_len)
    local t = {}
    for i = 1, n[0] do t[i] = ids[i - 1] end
    return t, prompt_len[0]
end

-- The state in state_out[0], read back from bytes (without Lua hooks: a branch of it makes
-- its mirrors from its tokens, branch_hooks).
local function read_back_state(model)
    return wrap_state(model, state_out[0], nil)
end

-- model:state_from_bytes(s) -> state | nil, err: a state written by state:bytes() on this
-- model (another model's, a damaged one: nil and the reason).
function Model:state_from_bytes(bytes)
    model_ptr(self, "state_from_bytes")
    if type(bytes) ~= "string" then raise("model:state_from_bytes(bytes): bytes must be a string") end
    local st = C.tl_session_state_from_bytes(self.ptr, bytes, #bytes, state_out)
    if st ~= 0 then return nil, last_error() end
    return read_back_state(self)
end

-- model:read_state(path) -> state | nil, err: the same from a file written by state:write().
function Model:read_state(path)
    model_ptr(self, "read_state")
    check_path(path, "model:read_state(path): path")
    local st = C.tl_session_state_read(self.ptr, path, state_out)
    if st ~= 0 then return nil, last_error() end
    return read_back_state(self)
end

function Model:resume(state, hooks)
    model_ptr(self, "resume")
    if getmetatable(state) ~= State then raise("model:resume(): state must come from session:save() or model:read_state()") end
    state_ptr(state, "model:resume()")
    local c, keep, ctx, compiled_grammar = branch_hooks(state, hooks, "model:resume()")
    if ctx then registry[ctx.key] = ctx end
    local st = C.tl_session_resume(self.ptr, state.ptr, c, branch_out)
    if st ~= 0 then
        if ctx then registry[ctx.key] = nil end
        return engine_failure(st)
    end
    adopt_branch(ctx, branch_out[0])
    return wrap_session(self, branch_out[0], ctx, keep, compiled_grammar)
end

-- model:set_prefix_pool(bytes): opts the model into a pool of computed prompt prefixes of at
-- most `bytes` of KV pages (> 0): a new session whose prompt starts with a pooled prefix at
-- its depth reuses it (stats.prompt_tokens_reused), with bit-identical output.
function Model:set_prefix_pool(bytes)
    model_ptr(self, "set_prefix_pool")
    if type(bytes) ~= "number" or bytes ~= floor(bytes) then raise("set_prefix_pool: bytes must be an integer") end
    -- (the FFI wraps a number past int64 to a negative one, refused as one the user never gave)
    if bytes >= 2 ^ 63 or bytes < -2 ^ 63 then raise(("set_prefix_pool: bytes = %.17g is past a 64-bit integer"):format(bytes)) end
    local st = C.tl_model_set_prefix_pool(self.ptr, bytes)
    if st ~= 0 then return engine_failure(st) end
    return true
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
    model_ptr(model, tree and "generate_tree_speculative" or "generate_speculative")
    if cfg ~= nil and type(cfg) ~= "table" then raise("config must be a table") end
    cfg = cfg or {}
    local base = {}
    for k, v in ordered_pairs(cfg) do
        if not SPEC_FIELDS[k] and not (tree and TREE_FIELDS[k]) then
            if k == "loops" then raise("config field 'loops': use verify_loops for speculative decoding") end
            -- (it said the field "needs speculative = chain or tree", of a chain call)
            if TREE_FIELDS[k] then raise("config field '" .. k .. "' is tree speculation's: use generate_tree_speculative") end
            -- (the call is the mode: a speculative = "tree" given to the chain ran the chain)
            if k == "speculative" then
                if v ~= (tree and "tree" or "chain") then
                    raise(("config field 'speculative' = %s: %s runs the %s"):format(tostring(v),
                        tree and "generate_tree_speculative" or "generate_speculative", tree and "tree" or "chain"))
                end
            else
                base[k] = v
            end
        end
    end
    -- (the chat's and the session's name of the seed: one setting, sample_seed was dropped for seed)
    if base.sample_seed ~= nil and cfg.seed ~= nil then raise("config fields 'seed' and 'sample_seed' are one setting: give one") end
    if base.sample_seed ~= nil then cfg = setmetatable({ seed = base.sample_seed }, { __index = cfg }) end
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
    t, err = call_blocking(ids, ctx, capacity, cfunc, model, arr, sc, st)
    local _ = keep
    if not t then return nil, err end
    return t, spec_stats(st)
end

-- model:generate_speculative(prompt, cfg) -> ids, stats | nil, err. cfg: max_tokens,
-- draft_loops, verify_loops, draft_ahead, temperature, seed, plus the generate fields
-- (top_k, top_p, min_p, repetition_penalty, stop_sequences, stop_strings, ignore_eos, min_tokens, cache_window,
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
-- of id t after ids[1..i]), scores:argmax(i) (greedy's choice there: ties to the lower id;
-- nil, err for a row holding a NaN or an infinity, the model's activations overflowed), scores.n,
-- scores.vocab_size. loops defaults to the model's default_loops.
local Scores = {}
Scores.__index = Scores

function Scores:logit(i, t)
    check_int("scores:logit: position", i)
    check_int("scores:logit: token id", t)
    if i < 1 or i > self.n or t < 0 or t >= self.vocab_size then
        raise("scores:logit(" .. tostring(i) .. ", " .. tostring(t) .. ") out of range")
    end
    return self.data[(i - 1) * self.vocab_size + t]
end

function Scores:argmax(i)
    check_int("scores:argmax: position", i)
    if i < 1 or i > self.n then raise("scores:argmax(" .. tostring(i) .. ") out of range") end
    local row, v = self.data + (i - 1) * self.vocab_size, self.vocab_size
    local best, best_value = 0, row[0]
    for t = 0, v - 1 do
        local value = row[t]
        -- (a NaN never compares: skipped, it read as a token, row[0]'s when it stood first; an
        -- infinity is an overflow as well, as the engine's steps say)
        if value ~= value or value == math.huge or value == -math.huge then
            return nil, ("scores:argmax(%d): the model gave non-finite logits (%s) there: its activations overflow")
                :format(i, value ~= value and "NaN" or value > 0 and "inf" or "-inf")
        end
        if value > best_value then best, best_value = t, value end
    end
    return best
end

function Model:score(ids, loops)
    model_ptr(self, "score")
    local err
    ids, err = prompt_ids(self, ids)
    if not ids then return nil, err end
    loops = loops == nil and self.default_loops or check_int("score: loops", loops)
    local arr, n = id_array(ids)
    -- (before the n x vocab_size floats it would size: 100,000 ids took 1.6 GB before the
    -- engine refused them)
    check_in_context(self, n, "score: the sequence ")
    local data, err_data = float_array(n * self.vocab_size + 1, "score")
    if not data then return nil, err_data end
    local st = C.tl_score(self.ptr, arr, n, loops, data)
    if st ~= 0 then return engine_failure(st) end
    return setmetatable({ data = data, n = n, vocab_size = self.vocab_size }, Scores)
end

-- model:score_logprobs(ids[, loops[, top]]) -> logprobs, alternatives: for i = 1 .. #ids - 1,
-- logprobs[i] of token ids[i + 1] after ids[1..i] (tl_score_logprobs: the model's own, one
-- chunk of logits at a time) and alternatives[i], the `top` (0..20, default 0) most likely
-- tokens there, { {id, logprob}, ... } most likely first. A string is encoded.
function Model:score_logprobs(ids, loops, top)
    model_ptr(self, "score_logprobs")
    local err
    ids, err = prompt_ids(self, ids)
    if not ids then return nil, err end
    loops = loops == nil and self.default_loops or check_int("score_logprobs: loops", loops)
    top = check_int("score_logprobs: top", top or 0)
    -- (the engine's own check, before the buffers it would size: a wild top would fail in ffi.new)
    if top < 0 or top > C.TL_MAX_TOP_LOGPROBS then
        raise(("tl_score_logprobs: top = %d must be in [0, %d]"):format(top, tonumber(C.TL_MAX_TOP_LOGPROBS)))
    end
    local arr, n = id_array(ids)
    check_in_context(self, n, "score_logprobs: the sequence ") -- (before the rows * top it would size: 3.4 GB for 2e7 ids)
    local rows = n > 1 and n - 1 or 1
    local lp = ffi_new("float[?]", rows)
    local top_ids = ffi_new("int32_t[?]", rows * math.max(top, 1))
    local top_lp = ffi_new("float[?]", rows * math.max(top, 1))
    local st = C.tl_score_logprobs(self.ptr, arr, n, loops, top, lp, top_ids, top_lp)
    if st ~= 0 then return engine_failure(st) end
    local logprobs, alternatives = {}, {}
    for i = 0, n - 2 do
        logprobs[i + 1] = lp[i]
        alternatives[i + 1] = alternatives_of(top_ids, top_lp, i * top, top)
    end
    return logprobs, alternatives
end

-- model:embed(input[, opts]) -> embedding | nil, err: the rows the head reads
-- (tl_embed) for `input` (a string, encoded as model:encode does, or token ids), pooled:
-- opts.pooling "mean" (default) or "last" gives one vector { d_model numbers }, "none" a
-- vector per token; opts.normalize (default true) scales each to unit length; opts.loops
-- (1..max_loops; left out: the model's default_loops) is the depth.
-- model:embed_batch(inputs[, opts]) -> { embedding, ... } | nil, err: the same for a list of
-- inputs (tl_embed_batch: short inputs share forward passes, each result that of
-- model:embed for it alone; inputs are named from 1, token indices as model:embed names them).
local POOLINGS = { mean = C.TL_POOLING_MEAN, last = C.TL_POOLING_LAST, none = C.TL_POOLING_NONE }
local EMBED_OPTIONS = { loops = true, pooling = true, normalize = true }

-- opts checked into a tl_embed_options -> it, the pooling's name.
local function embed_options(model, opts, what)
    opts = opts or {}
    if type(opts) ~= "table" then raise(what .. ": opts must be a table") end
    for k in ordered_pairs(opts) do
        if not EMBED_OPTIONS[k] then raise(what .. ": unknown option '" .. tostring(k) .. "'") end
    end
    local pooling = opts.pooling or "mean"
    if not POOLINGS[pooling] then
        raise(what .. ": pooling must be \"mean\", \"last\" or \"none\", got " .. tostring(pooling))
    end
    local normalize = opts.normalize
    if normalize == nil then normalize = true end
    if type(normalize) ~= "boolean" then raise(what .. ": normalize must be a boolean") end
    local eo = ffi_new("tl_embed_options")
    C.tl_embed_options_init(eo)
    if opts.loops ~= nil then
        eo.loops = check_int(what .. ": loops", opts.loops)
        -- (C reads loops = 0 as "the default"; in Lua the default is spelled by leaving loops out)
        if opts.loops == 0 then
            raise(("%s: loops = 0 must be in [1, max_loops = %d] (leave loops out for the model's default_loops = %d)")
                :format(what, model.max_loops, model.default_loops))
        end
    end
    eo.pooling, eo.normalize = POOLINGS[pooling], normalize and 1 or 0
    return eo, pooling
end

-- One input's token ids as a C array -> it, its length; or nil, err (a text the tokenizer
-- refused). `where` names the input in messages.
local function embed_input(model, input, what, where)
    if type(input) ~= "string" and type(input) ~= "table" then
        raise(what .. ": " .. where .. "must be a string or a table of token ids")
    end
    local ids, err = prompt_ids(model, input)
    if not ids then return nil, err end
    local arr, n = id_array(ids)
    check_in_context(model, n, what .. ": " .. where) -- (before a vector a token is allocated)
    return arr, n
end

-- vectors rows of d floats from out, starting at row `first` -> { {d numbers}, ... }
local function vectors_of(out, first, vectors, d)
    local result = {}
    for v = 0, vectors - 1 do
        local vector, base = {}, (first + v) * d
        for j = 0, d - 1 do vector[j + 1] = out[base + j] end
        result[v + 1] = vector
    end
    return result
end

function Model:embed(input, opts)
    model_ptr(self, "embed")
    local eo, pooling = embed_options(self, opts, "embed")
    local arr, n_or_err = embed_input(self, input, "embed", "the input ")
    if not arr then return nil, n_or_err end
    local n = n_or_err
    local d = self.d_model
    local vectors = pooling == "none" and n or 1
    local out, err_out = float_array(vectors * d, "embed")
    if not out then return nil, err_out end
    local st = C.tl_embed(self.ptr, arr, n, eo, out)
    if st ~= 0 then return engine_failure(st) end
    local result = vectors_of(out, 0, vectors, d)
    return pooling == "none" and result or result[1]
end

function Model:embed_batch(inputs, opts)
    model_ptr(self, "embed_batch")
    local eo, pooling = embed_options(self, opts, "embed_batch")
    if type(inputs) ~= "table" then raise("embed_batch: inputs must be a table of inputs") end
    local count = list_length(inputs, "embed_batch: inputs")
    local arrays, seqs = {}, ffi_new("tl_token_seq[?]", count + 1)
    local rows = 0
    for i = 1, count do
        local arr, n_or_err = embed_input(self, inputs[i], "embed_batch", ("input %d "):format(i))
        if not arr then return nil, ("embed_batch: input %d: %s"):format(i, n_or_err) end
        arrays[i], seqs[i - 1].tokens, seqs[i - 1].n = arr, arr, n_or_err -- (arrays keeps them alive)
        rows = rows + n_or_err
    end
    local d = self.d_model
    local out, err_out = float_array((pooling == "none" and rows or count) * d + 1, "embed_batch")
    if not out then return nil, err_out end
    local st = C.tl_embed_batch(self.ptr, seqs, count, eo, out)
    if st ~= 0 then -- (engine_failure's rule, the function named as the caller called it)
        local msg = lua_wording(last_error()):gsub("^tl_embed_batch: ", "embed_batch: ")
        if ARGUMENT_ERRORS[tonumber(st)] then raise(msg) end
        return nil, msg
    end
    local result, row = {}, 0
    for i = 1, count do
        if pooling == "none" then
            result[i] = vectors_of(out, row, seqs[i - 1].n, d)
            row = row + seqs[i - 1].n
        else
            result[i] = vectors_of(out, i - 1, 1, d)[1]
        end
    end
    return result
end

_M.C = C -- the raw library, for tools that need more than this module offers
_M._limits = limits -- (tests only)

return _M

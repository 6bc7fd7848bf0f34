-- tinyloop.server.wait: runs in nginx's thread pool (ngx.run_worker_thread): it blocks in
-- tl_engine_wait until the request has output, and does the other work too long for the
-- event loop (grammars, long encodes, embeddings, tool grammars' text); its scoring and
-- embeddings run on the event loop only where the pool cannot take them (init.lua's in_pool). Plain values cross between the two Lua states (numbers, strings, tables of them):
-- the engine, the model and the library's functions travel as addresses (same process,
-- same library).
--
-- Why no require("tinyloop") here: lua-nginx-module creates each thread-pool Lua VM, and
-- runs this module's require, on the event loop. The full binding (its ffi.cdef of the
-- whole header) costs ~3 ms there per new VM, a stall of every connection of the worker;
-- a function pointer needs no declarations at all.
local ffi = require "tinyloop.ffi"

local cast, tonumber = ffi.cast, tonumber

local _M = {}

-- The function at address `addr` as the C type `ctype`: one cast per type, redone only if the
-- address changes (tl_engine_wait, tl_score_logprobs, tl_embed_batch, tl_last_error, the
-- grammar compilers).
local casts = {}
local function function_at(addr, ctype)
    local c = casts[ctype]
    if not c or c.addr ~= addr then
        c = { addr = addr, fn = cast(ctype, addr) }
        casts[ctype] = c
    end
    return c.fn
end
local LAST_ERROR = "const char *(*)(void)"

-- A prompt's own log-probabilities (echo with logprobs): tl_score_logprobs runs forward
-- passes, so here, not on the event loop (but where the pool cannot take it: in_pool). ids:
-- the prompt's token ids (a table).
-- -> logprobs [#ids - 1], top_ids and top_logprobs [(#ids - 1) * top]; or nil, the message.
function _M.score(fn_addr, last_error_addr, model_addr, ids, loops, top)
    local score_fn = function_at(fn_addr, "int (*)(const void *, const int32_t *, int, int, int, float *, int32_t *, float *)")
    local error_fn = function_at(last_error_addr, LAST_ERROR)
    local n = #ids
    local tokens = ffi.new("int32_t[?]", n)
    for i = 1, n do tokens[i - 1] = ids[i] end
    local rows = n > 1 and n - 1 or 1
    local logprobs = ffi.new("float[?]", rows)
    local top_ids = ffi.new("int32_t[?]", rows * (top > 0 and top or 1))
    local top_logprobs = ffi.new("float[?]", rows * (top > 0 and top or 1))
    local status = tonumber(score_fn(cast("void *", model_addr), tokens, n, loops, top, logprobs, top_ids, top_logprobs))
    if status ~= 0 then return nil, ffi.string(error_fn()) end -- (this thread's message)
    local lp, ids_out, lp_out = {}, {}, {}
    for i = 0, n - 2 do lp[i + 1] = logprobs[i] end
    for i = 0, (n - 1) * top - 1 do ids_out[i + 1], lp_out[i + 1] = top_ids[i], top_logprobs[i] end
    return lp, ids_out, lp_out
end

-- tl_embed_options, declared here without the binding's cdef (why: see the top); the
-- embed spec checks that it has the header's size and offsets.
local embed_options = ffi.typeof("struct { int loops; int pooling; int normalize; }")
_M.embed_options = embed_options
-- tl_token_seq likewise (checked by the same spec)
local token_seq = ffi.typeof("struct { const int32_t *tokens; int n; }")
local token_seq_array = ffi.typeof("$[?]", token_seq)
_M.token_seq = token_seq
local POOLING = { mean = 0, last = 1 } -- TL_POOLING_MEAN, TL_POOLING_LAST

-- (the llama.cpp shape: {"index", "embedding": [[...]]}, scaled by its embd_normalize `norm`
-- where it is not the engine's unit length: 0 the largest magnitude to 32760, 1 taxicab,
-- p > 2 the p-norm, each sum in double, as llama.cpp's common_embd_normalize; -1 and 2 are
-- the engine's own, normalize false or true)
local function llamacpp_scale(vector, d, norm)
    if norm == -1 or norm == 2 then return end
    local largest, sum = 0, 0
    for j = 0, d - 1 do largest = math.max(largest, math.abs(vector[j])) end
    for j = 0, d - 1 do
        local x = math.abs(vector[j])
        -- (the p-norm as largest * (sum (x / largest)^p)^(1/p): x^p itself overflows or
        -- underflows for a large p, where llama.cpp's vector comes out all zero)
        if norm == 1 then sum = sum + x elseif norm > 2 then sum = sum + (x / largest) ^ norm end
    end
    local divisor = norm == 0 and largest / 32760 or norm == 1 and sum or (largest > 0 and largest * sum ^ (1 / norm) or 0)
    local scale = divisor > 0 and 1 / divisor or 0
    for j = 0, d - 1 do vector[j] = vector[j] * scale end
end

-- Embeddings (POST /v1/embeddings, /api/embed, /api/embeddings, /embedding; /v1/rerank and
-- /v1/score's vectors): tl_embed_batch runs forward
-- passes, so here, not on the event loop (but where the pool cannot take it: in_pool), and
-- so does the writing of the vectors (a
-- request of 2,048 inputs is over half a million numbers). inputs: id lists, a slice of the
-- request's, the first of which is its input `first` (0-based); d: d_model; as "float" (a
-- vector is a JSON array) or "base64" (its float32 bytes, little-endian as this machine's,
-- base64, a JSON string); shape "openai" (each vector in {"object": "embedding", "index",
-- "embedding"}), "ollama" (the bare vector), "llamacpp" ({"index", "embedding": [vector]},
-- scaled by `norm`: llamacpp_scale above), or "raw": the vectors' float32 bytes, one after
-- another (the similarity endpoints' scores); keep (or nil, every number): Ollama's
-- dimensions, below. -> the slice's entries' JSON text, joined by commas (raw: the bytes) |
-- nil, the message.
function _M.embed(fn_addr, last_error_addr, model_addr, inputs, d, loops, pooling, normalize, as, shape, first, norm, keep)
    local embed_fn = function_at(fn_addr, "int (*)(const void *, const void *, int, const void *, float *)")
    local error_fn = function_at(last_error_addr, LAST_ERROR)
    local opts = embed_options(loops, POOLING[pooling], normalize and 1 or 0)
    -- the whole slice in one tl_embed_batch call: short inputs share forward passes
    local count = #inputs
    local arrays, seqs = {}, token_seq_array(count)
    for i, ids in ipairs(inputs) do
        local n = #ids
        local tokens = ffi.new("int32_t[?]", n)
        for k = 1, n do tokens[k - 1] = ids[k] end
        arrays[i], seqs[i - 1].tokens, seqs[i - 1].n = tokens, tokens, n -- (arrays keeps them alive)
    end
    local vectors = ffi.new("float[?]", count * d)
    if tonumber(embed_fn(cast("void *", model_addr), seqs, count, opts, vectors)) ~= 0 then
        -- (this thread's message, naming the input as the request counts it, not the slice)
        return nil, (ffi.string(error_fn()):gsub("input (%d+)", function(i) return "input " .. (first + i) end, 1))
    end
    for i = 0, count * d - 1 do
        local x = vectors[i]
        if x ~= x or x == math.huge or x == -math.huge then
            return nil, ("the model gave a non-finite embedding (input %d)"):format(first + math.floor(i / d))
        end
    end
    if shape == "raw" then return ffi.string(vectors, count * d * 4) end -- (the float32 bytes, for the scores)
    if shape == "llamacpp" then
        for i = 0, count - 1 do llamacpp_scale(vectors + i * d, d, norm) end
    end
    -- keep (Ollama's dimensions): each unit vector's first `keep` numbers, made a unit vector
    -- again (a sum in double)
    local width = keep or d
    if width < d then
        for i = 0, count - 1 do
            local vector, sum = vectors + i * d, 0
            for j = 0, width - 1 do sum = sum + vector[j] * vector[j] end
            local inv = sum > 0 and 1 / math.sqrt(sum) or 0
            for j = 0, width - 1 do vector[j] = vector[j] * inv end
        end
    end
    local entries, numbers, format = {}, {}, string.format
    for i = 1, count do
        local vector = vectors + (i - 1) * d
        if as == "float" then
            for j = 0, width - 1 do numbers[j + 1] = format("%.9g", vector[j]) end -- (float32's round trip)
        end
        local text = as == "base64" and ('"' .. ngx.encode_base64(ffi.string(vector, width * 4)) .. '"')
            or ("[" .. table.concat(numbers, ",", 1, width) .. "]")
        entries[i] = shape == "openai" and ('{"object":"embedding","index":' .. (first + i - 1) .. ',"embedding":' .. text .. "}")
            or shape == "llamacpp" and ('{"index":' .. (first + i - 1) .. ',"embedding":[' .. text .. "]}")
            or text
    end
    return table.concat(entries, ",")
end

-- tl_json_schema_options likewise (checked by the grammar spec)
local schema_options = ffi.typeof("struct { int free_whitespace; int loose; }")
_M.schema_options = schema_options
local COMPILE_TEXT = "int (*)(const char *, size_t, void **)"
local COMPILE_SCHEMA = "int (*)(const char *, size_t, const void *, void **)"
local FREE = "void (*)(void *)" -- (tl_compiled_grammar_free, tl_free)

-- The grammars this VM compiled, each holding the compiler's reference until this VM's next
-- compile: the handler takes its own (tl_compiled_grammar_retain) as soon as it resumes,
-- before the event loop runs anything else (so before any later task in this VM); a handler
-- whose client left meanwhile never does, and the grammar goes here instead of leaking.
local held = {}

-- A grammar from text (GBNF, a regular expression or a JSON Schema): compiling a large one
-- takes tens to hundreds of milliseconds, so here and never on the event loop. fns: the
-- addresses of tl_grammar_compile_gbnf (gbnf), _regex (regex), _json_schema (json_schema),
-- tl_compiled_grammar_free (free) and tl_last_error (last_error); kind: which to call;
-- free_whitespace, loose: a schema's options. -> the grammar's address | nil, the message.
function _M.compile(fns, kind, text, free_whitespace, loose)
    local free_fn = function_at(fns.free, FREE)
    for i = 1, #held do free_fn(held[i]) end
    held = {}
    local out = ffi.new("void *[1]")
    local status
    if kind == "json_schema" then
        status = function_at(fns.json_schema, COMPILE_SCHEMA)(text, #text, schema_options(free_whitespace and 1 or 0, loose and 1 or 0), out)
    elseif kind == "gbnf" or kind == "regex" then
        status = function_at(fns[kind], COMPILE_TEXT)(text, #text, out)
    else
        return nil, "no grammar kind '" .. tostring(kind) .. "'"
    end
    if tonumber(status) ~= 0 then return nil, ffi.string(function_at(fns.last_error, LAST_ERROR)()) end
    held[1] = out[0]
    return tonumber(cast("uintptr_t", out[0]))
end

-- The GBNF text of a tool choice's calls (tinyloop.tools.grammar_text, of `spec`: its choice,
-- name, parallel and functions' name, parameters_json and strict), each function's schema
-- converted by tl_json_schema_to_gbnf (fns.schema_gbnf; fns.free, fns.last_error): a large
-- schema's GBNF and the renaming of its rules are seconds of work, here and never on the
-- event loop. (tinyloop.tools is required here, in the pool's thread: it needs no library.)
-- -> the text | nil, the message.
function _M.tools_text(fns, spec, after_open)
    local to_gbnf = function(schema, opts)
        local out, len = ffi.new("char *[1]"), ffi.new("size_t[1]")
        local status = function_at(fns.schema_gbnf, "int (*)(const char *, size_t, const void *, char **, size_t *)")(
            schema, #schema, schema_options(opts.whitespace == "free" and 1 or 0, opts.loose and 1 or 0), out, len)
        if tonumber(status) ~= 0 then return nil, ffi.string(function_at(fns.last_error, LAST_ERROR)()) end
        local text = ffi.string(out[0], len[0])
        function_at(fns.free, FREE)(out[0])
        return text
    end
    return require("tinyloop.tools").grammar_text(spec, after_open, to_gbnf)
end

-- A long text's token ids (tl_encode_ex: about 60 us a KB here, so a 1 MB prompt held the
-- event loop 60 ms, even one then refused as longer than the context). fns: the addresses of
-- tl_encode_ex (encode), tl_free (free) and tl_last_error (last_error); flags: tl_encode_ex's
-- (tinyloop.encode_flags of model:encode's options). -> the ids as int32 bytes (one string
-- crosses back, not a table of numbers) | nil, the message.
function _M.encode(fns, model_addr, text, flags)
    local ids, n = ffi.new("int32_t *[1]"), ffi.new("int[1]")
    local status = function_at(fns.encode, "int (*)(const void *, const char *, size_t, unsigned, int32_t **, int *)")(
        cast("void *", model_addr), text, #text, flags or 0, ids, n)
    if tonumber(status) ~= 0 then return nil, ffi.string(function_at(fns.last_error, LAST_ERROR)()) end
    local bytes = ffi.string(ids[0], n[0] * 4)
    function_at(fns.free, FREE)(ids[0])
    return bytes
end

-- -> 1 output to read, 0 timeout, -1 the request is gone (cancelled) or the engine stopped.
function _M.wait(wait_addr, engine_addr, id, timeout_ms)
    return tonumber(function_at(wait_addr, "int (*)(void *, uint64_t, int)")(cast("void *", engine_addr), id, timeout_ms))
end

return _M

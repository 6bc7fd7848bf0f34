-- tinyloop.server.wait: runs in nginx's thread pool (ngx.run_worker_thread), never on the
-- event loop: it blocks in tl_engine_wait until the request has output. Only numbers cross
-- between the two Lua states: the engine and tl_engine_wait itself travel as addresses
-- (same process, same library).
--
-- Why no require("tinyloop") here: lua-nginx-module creates each thread-pool Lua VM, and
-- runs this module's require, on the event loop. The full binding (its ffi.cdef of the
-- whole header) costs ~3 ms there per new VM, a stall of every connection of the worker;
-- a function pointer needs no declarations at all.
local ffi = require "ffi"

local cast, tonumber = ffi.cast, tonumber

local _M = {}

local fn_addr, fn -- the cast of tl_engine_wait, redone only if its address changes

local score_addr, score_fn, error_addr, error_fn -- the casts of tl_score_logprobs and tl_last_error

-- A prompt's own log-probabilities (echo with logprobs): tl_score_logprobs runs forward
-- passes, so here and never on the event loop. ids: the prompt's token ids (a table).
-- -> logprobs [#ids - 1], top_ids and top_logprobs [(#ids - 1) * top]; or nil, the message.
function _M.score(fn_addr, last_error_addr, model_addr, ids, loops, top)
    if fn_addr ~= score_addr then
        score_fn = cast("int (*)(const void *, const int32_t *, int, int, int, float *, int32_t *, float *)", fn_addr)
        score_addr = fn_addr
    end
    if last_error_addr ~= error_addr then
        error_fn = cast("const char *(*)(void)", last_error_addr)
        error_addr = last_error_addr
    end
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

-- -> 1 output to read, 0 timeout, -1 the request is gone (cancelled) or the engine stopped.
function _M.wait(wait_addr, engine_addr, id, timeout_ms)
    if wait_addr ~= fn_addr then
        fn = cast("int (*)(void *, uint64_t, int)", wait_addr)
        fn_addr = wait_addr
    end
    return tonumber(fn(cast("void *", engine_addr), id, timeout_ms))
end

return _M

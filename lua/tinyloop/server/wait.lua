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

-- -> 1 output to read, 0 timeout, -1 the request is gone (cancelled) or the engine stopped.
function _M.wait(wait_addr, engine_addr, id, timeout_ms)
    if wait_addr ~= fn_addr then
        fn = cast("int (*)(void *, uint64_t, int)", wait_addr)
        fn_addr = wait_addr
    end
    return tonumber(fn(cast("void *", engine_addr), id, timeout_ms))
end

return _M

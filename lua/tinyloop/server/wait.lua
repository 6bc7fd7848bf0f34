-- tinyloop.server.wait: runs in nginx's thread pool (ngx.run_worker_thread), never on the
-- event loop: it blocks in tl_engine_wait until the request has output. Only numbers cross
-- between the two Lua states (the engine travels as its address; same process, same library).
local ffi = require "ffi"
local C = require("tinyloop").C

local cast = ffi.cast

local _M = {}

-- -> 1 output to read, 0 timeout, -1 the request is gone (cancelled) or the engine stopped.
function _M.wait(engine_addr, id, timeout_ms)
    return tonumber(C.tl_engine_wait(cast("tl_engine *", engine_addr), id, timeout_ms))
end

return _M

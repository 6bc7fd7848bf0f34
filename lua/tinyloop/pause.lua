-- tinyloop.pause: lets long Lua work give its thread back now and then. The server's request
-- handlers run on nginx's event loop, where a chat template's render of a large request (a
-- megabyte of tool schemas is over half a second of Lua: the template's tojson, the marking of
-- users' special texts, the request's ordered decoding) would hold every other connection of
-- the worker, /health included. That work calls point() as it goes (the renderer per
-- statement, the JSON walks per value); the server installs what a point does once a slice
-- of time is spent: sleep a millisecond, so that the event loop serves the others (nginx's
-- ngx.sleep(0) would not: it resumes the handler before the loop looks at any other socket).
-- Outside the server (a script, the CLI) nothing is installed and a point is a countdown.
--
--   local point = require("tinyloop.pause").point   -- in the long loop: point()
--   pause.install({ busy = seconds_fn, slice = 0.005, give_back = function() ngx.sleep(0.001) end })
local _M = {}

local running, getinfo, pcall, xpcall = coroutine.running, debug.getinfo, pcall, xpcall

-- Whether the running code may yield: a coroutine's, with no C function between it and the
-- coroutine's start but pcall and xpcall (which LuaJIT yields across). A string.gsub's
-- replacement function or a table.sort comparison is not: a yield there is an error, after
-- ngx.sleep has set its timer. (By the stack, once a slice: nginx's Lua replaces the
-- coroutine table, without LuaJIT's coroutine.isyieldable.)
local YIELDS_ACROSS = { [pcall] = true, [xpcall] = true }
local function can_yield()
    local co, main = running()
    if co == nil or main then return false end -- (the main thread: nil in Lua 5.1's way, main true in 5.2's)
    local level = 2 -- (from its caller, a Lua function)
    while true do
        local info = getinfo(level, "Sf")
        if not info then return true end
        if info.what == "C" and not YIELDS_ACROSS[info.func] then return false end
        level = level + 1
    end
end
_M.can_yield = can_yield

-- (a clock read each EVERY points, not at each: a point's own work is a few nanoseconds, a
-- read of the clock tens; few enough that work of a fraction of a millisecond between points
-- (a message's checks) overruns the slice by little)
local EVERY = 16
_M.EVERY = EVERY
local left = EVERY
local busy, slice, give_back -- installed (nil: a point only counts)

-- install{ busy = fn -> seconds the thread has worked since it last served the others (nginx:
-- now less the time its event loop last woke), slice = seconds of work between pauses,
-- give_back = fn (yields; called only where the running code can: can_yield) } | nil (a
-- point only counts again).
function _M.install(how)
    if how == nil then
        busy, slice, give_back = nil, nil, nil
        return
    end
    assert(type(how) == "table" and type(how.busy) == "function" and type(how.give_back) == "function"
           and type(how.slice) == "number" and how.slice > 0, "pause.install{ busy = fn, slice = seconds > 0, give_back = fn }")
    busy, slice, give_back, left = how.busy, how.slice, how.give_back, EVERY
end

-- point(): a place where long work may pause (where it can yield: can_yield; elsewhere it goes
-- on to its next point).
function _M.point()
    left = left - 1
    if left > 0 then return end
    left = EVERY
    if busy and busy() >= slice and can_yield() then give_back() end
end

return _M

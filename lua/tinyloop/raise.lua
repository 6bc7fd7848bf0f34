-- tinyloop.raise: how the Lua API raises an argument error (the convention at the top of
-- tinyloop/init.lua): at the first stack level outside the module that raises, so that the
-- position shown is the caller's line, whatever helper found the problem.
--   local raise = require("tinyloop.raise").from(debug.getinfo(1, "S").source)
--   raise("config must be a table")
-- (from(a, b): the frames of either module are passed over: tinyloop.grammar's functions are
-- called by the user and by tinyloop's own, whose frames come between)
local getinfo, error = debug.getinfo, error

local _M = {}
local own = getinfo(1, "S").source -- (this module's helpers, list_length, raise for others)

-- Returns raise(msg) for the modules whose chunk sources are given.
function _M.from(source, other_source)
    return function(msg)
        local level = 2
        while true do
            local info = getinfo(level, "S")
            if not info or (info.source ~= source and info.source ~= other_source and info.source ~= own) then break end
            level = level + 1
        end
        error(msg, level)
    end
end

-- list_length(t, what, raise) -> #t of a list, raising (with the module's `raise`) "<what>
-- must be a list (1..n, no holes)" where t has a hole or other keys: # of a table with a
-- hole may end at any of them, and the entries past it were silently left out
-- ({ "zz", nil, "--" } lost its stop string "--").
function _M.list_length(t, what, raise)
    local n, count = #t, 0
    for k in pairs(t) do
        if type(k) ~= "number" or k < 1 or k > n or k ~= math.floor(k) then count = -1 break end
        count = count + 1
    end
    if count ~= n then raise(what .. " must be a list (1..n, no holes)") end
    return n
end

-- message(err) -> a raised error's text without the position error() put before it
-- ("file.lua:12: "), for a message shown to a person or a client.
function _M.message(err)
    return (tostring(err):gsub("^[^\n]-:%d+: ", ""))
end

return _M

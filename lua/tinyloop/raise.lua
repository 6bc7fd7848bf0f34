-- tinyloop.raise: how the Lua API raises an argument error (the convention at the top of
-- tinyloop/init.lua): at the first stack level outside the module that raises, so that the
-- position shown is the caller's line, whatever helper found the problem.
--   local raise = require("tinyloop.raise").from(debug.getinfo(1, "S").source)
--   raise("config must be a table")
local getinfo, error = debug.getinfo, error

local _M = {}

-- Returns raise(msg) for the module whose chunk source is `source`.
function _M.from(source)
    return function(msg)
        local level = 2
        while true do
            local info = getinfo(level, "S")
            if not info or info.source ~= source then break end
            level = level + 1
        end
        error(msg, level)
    end
end

-- message(err) -> a raised error's text without the position error() put before it
-- ("file.lua:12: "), for a message shown to a person or a client.
function _M.message(err)
    return (tostring(err):gsub("^[^\n]-:%d+: ", ""))
end

return _M

-- tinyloop.ordered: a table's members in sorted key order. LuaJIT seeds its string hash per Lua
-- VM, so pairs() walks one table in another order in each process (an nginx worker, a run):
-- where the walk decides what is said (the field an error names of several wrong ones, the
-- order of a page's sections), walking the keys sorted says the same everywhere.
local _M = {}

local type, tostring, sort, next, ipairs = type, tostring, table.sort, next, ipairs

-- (numbers before strings, each in its own order; another kind by its text, for a total order)
local RANK = { number = 1, string = 2 }
local function before(a, b)
    local ta, tb = type(a), type(b)
    if ta ~= tb then return (RANK[ta] or 3) < (RANK[tb] or 3) or (RANK[ta] == RANK[tb] and ta < tb) end
    if ta == "number" or ta == "string" then return a < b end
    return tostring(a) < tostring(b)
end

local function sorted_keys(t)
    local keys = {}
    for k in next, t do keys[#keys + 1] = k end
    sort(keys, before)
    return keys
end

-- for k, v in ordered.pairs(t): pairs(t)'s members, their keys sorted (a snapshot of the keys:
-- a member set during the walk is not met; one cleared is met as nil, as pairs does not allow).
function _M.pairs(t)
    local keys = sorted_keys(t)
    local i = 0
    return function()
        i = i + 1
        local k = keys[i]
        if k ~= nil then return k, t[k] end
    end
end

-- first_unknown(t, known) -> the first key of t, in ordered.pairs' order, that `known` (a set)
-- lacks; nil where known has them all. (The keys are sorted only where one is unknown: a sort
-- for each of 24,000 items of a request was most of its checks.)
function _M.first_unknown(t, known)
    for k in next, t do
        if not known[k] then
            for _, key in ipairs(sorted_keys(t)) do
                if not known[key] then return key end
            end
        end
    end
    return nil
end

return _M

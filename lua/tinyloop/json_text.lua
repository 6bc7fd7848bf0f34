-- tinyloop.json_text: the raw text of a JSON document's parts, for text that cjson has already
-- accepted (so it is well-formed). Pure Lua.
--
-- Why raw text: a decoded Lua table loses what the text says. A JSON Schema must reach the
-- grammar compiler as sent (the order of "properties" is the order the model writes the keys
-- in), {} and [] decode alike, and a chat template prints a caller's objects in their order.
--
--   local json_text = require "tinyloop.json_text"
--   json_text.member('{"a": [1, {"b": {}}]}', { "a", 2, "b" })   --> "{}"  (array indexes from 1)
--   for _, e in ipairs(json_text.entries(s, i)) do ... e.key, e.from, e.to ... end
local byte, find, sub = string.byte, string.find, string.sub
local cjson = require "cjson.safe"

local _M = {}

local function skip_ws(s, i) return find(s, "[^ \t\r\n]", i) or #s + 1 end
_M.skip_ws = skip_ws

local function skip_string(s, i) -- s[i] is the opening quote; -> the index after the closing one
    local j = i + 1
    while true do
        local q = find(s, '["\\]', j)
        if byte(s, q) == 34 then return q + 1 end
        j = q + 2 -- a backslash escapes the next byte
    end
end
_M.skip_string = skip_string

-- The index after the value that starts at s[i] (in text that is not well-formed JSON, an
-- error may be raised).
local function skip_value(s, i)
    local c = byte(s, i)
    if c == 34 then return skip_string(s, i) end
    if c ~= 123 and c ~= 91 then return find(s, "[,}%]%s]", i) or #s + 1 end -- a number, true, false, null
    local depth, j = 0, i
    while true do
        local k = find(s, '[%[%]{}"]', j)
        c = byte(s, k)
        if c == 34 then
            j = skip_string(s, k)
        else
            depth = depth + ((c == 123 or c == 91) and 1 or -1)
            j = k + 1
            if depth == 0 then return j end
        end
    end
end
_M.skip_value = skip_value

-- The entries of the object or array that starts at s[i], in text order: { {key, from, to},
-- ... }, each value's text being s:sub(from, to); key is an object member's (nil in an array).
-- Duplicate keys are all listed (cjson keeps the last).
function _M.entries(s, i)
    local object, out = byte(s, i) == 123, {}
    local close = object and 125 or 93
    i = skip_ws(s, i + 1)
    while i <= #s and byte(s, i) ~= close do
        local key
        if object then
            local key_end = skip_string(s, i)
            key = cjson.decode(sub(s, i, key_end - 1))
            i = skip_ws(s, skip_ws(s, key_end) + 1) -- past the ':'
        end
        local to = skip_value(s, i)
        out[#out + 1] = { key = key, from = i, to = to - 1 }
        i = skip_ws(s, to)
        if byte(s, i) ~= 44 then break end
        i = skip_ws(s, i + 1)
    end
    return out
end

-- member(s, path) -> the text of s's value at `path` (object keys, and array indexes from 1),
-- or nil. As cjson does, the last of duplicate keys wins.
function _M.member(s, path)
    local from, to = skip_ws(s, 1), nil
    to = skip_value(s, from) - 1
    for _, step in ipairs(path) do
        local c, found = byte(s, from), nil
        if type(step) == "number" then
            if c ~= 91 then return nil end
            found = _M.entries(s, from)[step]
        else
            if c ~= 123 then return nil end
            for _, m in ipairs(_M.entries(s, from)) do
                if m.key == step then found = m end
            end
        end
        if not found then return nil end
        from, to = found.from, found.to
    end
    return sub(s, from, to)
end

return _M

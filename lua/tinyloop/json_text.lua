-- tinyloop.json_text: JSON text read as it is written. Pure Lua.
--
-- Why raw text: a decoded Lua table loses what the text says. A JSON Schema must reach the
-- grammar compiler as sent (the order of "properties" is the order the model writes the keys
-- in), {} and [] decode alike, and a chat template prints a caller's objects in their order.
--
--   local json_text = require "tinyloop.json_text"
--   json_text.member('{"a": [1, {"b": {}}]}', { "a", 2, "b" })   --> "{}"  (array indexes from 1)
--   for _, e in ipairs(json_text.entries(s, i)) do ... e.key, e.from, e.to ... end
--   json_text.decode_ordered(text, dict, 64)   -- objects as dict(t, keys in text order)
--
-- The scanners read text that is not JSON (a model's output) without raising: where a value
-- does not end, they return nil. decode is strict JSON (RFC 8259), what clients' parsers
-- take: lua-cjson alone also takes NaN, Infinity and hex numbers, numbers such as "1.", "-.5"
-- or "01", control characters unescaped in a string, and whatever follows a NUL.
local byte, find, match, sub = string.byte, string.find, string.match, string.sub

local cjson = require("cjson.safe")
local ordered_pairs = require("tinyloop.ordered").pairs
local strict = cjson.new()
-- (the walks below pause at each entry and bracket: a server's event loop serves other
-- connections while a megabyte of request is walked; tinyloop.pause says how)
local point = require("tinyloop.pause").point
strict.decode_invalid_numbers(false)

local _M = {}

-- lua-cjson takes the locale's decimal point when an instance is made (every cjson.new does
-- it again, for all instances) and writes and reads numbers with it. A script that switched
-- to a comma-decimal locale after requiring tinyloop (os.setlocale("de_DE.UTF-8")) had 0.5
-- written "0,5" (a tool's enum [0.5, 2.5] forced "0" | "5" | "2" | "5") and no fraction read
-- at all (a tool call with {"x": 0.5} was not one). So decode and encode below, the library's
-- ways to cjson, first check LC_NUMERIC (a query: the host's setting stands) and have cjson
-- take the point again when it changed.
local setlocale = os.setlocale
local numeric_seen = setlocale and setlocale(nil, "numeric")
local function follow_locale()
    if not setlocale then return end
    local numeric = setlocale(nil, "numeric")
    if numeric ~= numeric_seen then
        numeric_seen = numeric
        cjson.new()
    end
end

-- encode(v) -> JSON text | nil, err: lua-cjson's, whatever locale the script has switched to.
function _M.encode(v)
    follow_locale()
    return cjson.encode(v)
end

-- encode_sorted(v) -> JSON text | nil, err: encode's, each object's members in sorted key order
-- (lua-cjson writes a table's keys in its hash order, which LuaJIT seeds per VM: one value
-- gave each nginx worker its own bytes). Arrays keep their order.
function _M.encode_sorted(v)
    if type(v) ~= "table" or getmetatable(v) ~= nil or next(v) == nil then return _M.encode(v) end
    if v[1] ~= nil then -- an array: its elements so, where it is one (1..n, nothing else)
        local n, count = #v, 0
        for _ in pairs(v) do count = count + 1 end
        if count ~= n then return _M.encode(v) end -- (sparse, or mixed keys: cjson's own rules)
        local items = {}
        for i = 1, n do
            local item, err = _M.encode_sorted(v[i])
            if not item then return nil, err end
            items[i] = item
        end
        return "[" .. table.concat(items, ",") .. "]"
    end
    local members = {}
    for k, value in ordered_pairs(v) do -- (tinyloop.ordered's one order of keys)
        if type(k) ~= "string" then return _M.encode(v) end -- (a sparse array, or mixed keys: cjson's own rules)
        local text, err = _M.encode_sorted(value)
        if not text then return nil, err end
        members[#members + 1] = cjson.encode(k) .. ":" .. text
    end
    return "{" .. table.concat(members, ",") .. "}"
end

local function skip_ws(s, i) return find(s, "[^ \t\r\n]", i) or #s + 1 end
_M.skip_ws = skip_ws

-- s[i] is the opening quote -> the index after the closing one, or nil (no closing one).
-- (A plain search for the quote, four times the speed of a pattern's class of two bytes; a
-- quote is escaped where an odd run of backslashes stands before it, inside the string.)
local function skip_string(s, i)
    local j = i + 1
    while true do
        local q = find(s, '"', j, true)
        if not q then return nil end
        local k = q - 1
        while k > i and byte(s, k) == 92 do k = k - 1 end
        if (q - 1 - k) % 2 == 0 then return q + 1 end
        j = q + 1
    end
end

-- What lua-cjson takes that JSON does not, found in one pass over s's bytes -> nil, or the
-- fault with its place: a control character unescaped (in a string: JSON wants it escaped;
-- outside: only blanks), and a number not of JSON's form -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
-- ending where it ends. (A loop over the bytes, which LuaJIT compiles: Lua patterns cost
-- 17 ms a MB for each search, ten times the decoding.)
local ffi = require "tinyloop.ffi"
local function is_digit(c) return c >= 48 and c <= 57 end
local function not_json(s)
    local n, b = #s, ffi.cast("const uint8_t *", s)
    local p, in_string = 0, false
    local function bad_number(at)
        return ("'%s' at character %d is no JSON number"):format(match(s, "^[%w%.+-]*", at + 1), at + 1)
    end
    while p < n do
        local c = b[p]
        if in_string then
            if c == 34 then in_string = false
            elseif c == 92 then p = p + 1 -- (the escape's byte: the decoder checks the escape)
            elseif c < 32 then
                return ("an unescaped control character (byte %d) in a string at character %d"):format(c, p + 1)
            end
            p = p + 1
        elseif c == 34 then
            in_string, p = true, p + 1
        elseif c == 45 or is_digit(c) then
            local at = p
            if c == 45 then p = p + 1 end
            if p >= n or not is_digit(b[p]) then return bad_number(at) end
            if b[p] == 48 then p = p + 1 else repeat p = p + 1 until p >= n or not is_digit(b[p]) end
            if p < n and b[p] == 46 then
                p = p + 1
                if p >= n or not is_digit(b[p]) then return bad_number(at) end
                repeat p = p + 1 until p >= n or not is_digit(b[p])
            end
            if p < n and (b[p] == 101 or b[p] == 69) then
                p = p + 1
                if p < n and (b[p] == 43 or b[p] == 45) then p = p + 1 end
                if p >= n or not is_digit(b[p]) then return bad_number(at) end
                repeat p = p + 1 until p >= n or not is_digit(b[p])
            end
            if p < n then -- (the number ends here: "01" and "1.5.2" are no numbers)
                local e = b[p]
                if is_digit(e) or e == 46 or e == 43 or e == 45 or (e >= 65 and e <= 90) or (e >= 97 and e <= 122) then
                    return bad_number(at)
                end
            end
        elseif c < 32 and c ~= 9 and c ~= 10 and c ~= 13 then
            return ("an unescaped control character (byte %d) at character %d"):format(c, p + 1)
        else
            p = p + 1
        end
    end
    return nil
end

-- decode(text) -> the value | nil, err: strict JSON only.
function _M.decode(text)
    if type(text) == "string" then
        local fault = not_json(text)
        if fault then return nil, fault end
    end
    follow_locale()
    return strict.decode(text)
end

-- decode_file(text) -> the value | nil, err: a JSON file's text (RFC 8259, as Python's json
-- and Hugging Face read one): strict JSON, valid UTF-8 (a stray byte went into a tool's
-- description, the prompt, raw), no byte order mark (said as such, not "invalid token").
-- (Request bodies are decode's: the server's own rules.)
local first_invalid = require("tinyloop.utf8").first_invalid
function _M.decode_file(text)
    if text:sub(1, 3) == "\239\187\191" then return nil, "starts with a UTF-8 byte order mark, which JSON does not allow" end
    local bad = first_invalid(text)
    if bad then return nil, ("not valid UTF-8 (byte %d)"):format(bad - 1) end
    return _M.decode(text)
end

-- The end of a number, true, false or null that starts at s[i]: the index after it.
local function scalar_end(s, i) return find(s, "[,}%]%s]", i) or #s + 1 end

-- The index after the value that starts at s[i], or nil when the text ends first. One pass,
-- counting brackets (so a long or deep value costs its length, and no recursion).
local function skip_value(s, i)
    local c = byte(s, i)
    if c == 34 then return skip_string(s, i) end
    if c ~= 123 and c ~= 91 then -- (none at all where the text ends)
        local after = scalar_end(s, i)
        return after > i and after or nil
    end
    local depth, j = 0, i
    while true do
        point()
        local k = find(s, '[%[%]{}"]', j)
        if not k then return nil end
        c = byte(s, k)
        if c == 34 then
            j = skip_string(s, k)
            if not j then return nil end
        else
            depth = depth + ((c == 123 or c == 91) and 1 or -1)
            j = k + 1
            if depth == 0 then return j end
        end
    end
end
_M.skip_value = skip_value

-- The one walk over a container: calls visit(key, from) for each entry of the object or
-- array that starts at s[i], in text order (key nil in an array; the value starts at
-- s[from]); visit returns the index after the value. -> the index after the container, or nil
-- where the text is not a well-formed container.
local function each_entry(s, i, visit)
    local object = byte(s, i) == 123
    local close = object and 125 or 93
    i = skip_ws(s, i + 1)
    if byte(s, i) == close then return i + 1 end
    while i <= #s do
        point()
        local key
        if object then
            local key_end = byte(s, i) == 34 and skip_string(s, i)
            if not key_end then return nil end
            key = strict.decode(sub(s, i, key_end - 1))
            i = skip_ws(s, skip_ws(s, key_end) + 1) -- past the ':'
        end
        local after = visit(key, i)
        if not after then return nil end
        i = skip_ws(s, after)
        local c = byte(s, i)
        if c == close then return i + 1 end
        if c ~= 44 then return nil end
        i = skip_ws(s, i + 1)
    end
    return nil
end

-- The entries of the object or array that starts at s[i], in text order: { {key, from, to},
-- ... }, each value's text being s:sub(from, to); key is an object member's (nil in an array).
-- Duplicate keys are all listed (cjson keeps the last). ends (optional): container_ends(s).
local function entries(s, i, ends)
    local out = {}
    each_entry(s, i, function(key, from)
        local after = ends and ends[from] or skip_value(s, from)
        if after then out[#out + 1] = { key = key, from = from, to = after - 1 } end
        return after
    end)
    return out
end
function _M.entries(s, i) return entries(s, i) end

-- The index after each container of s, by the index it starts at, in one pass that counts
-- brackets and skips strings as skip_value does (so each container's end is the one
-- skip_value finds; an unclosed one has none): a look-up then skips a member in one step.
local function container_ends(s)
    local ends, open, depth, j = {}, {}, 0, 1
    while true do
        point()
        local k = find(s, '[%[%]{}"]', j)
        if not k then break end
        local c = byte(s, k)
        if c == 34 then
            j = skip_string(s, k)
            if not j then break end
        else
            if c == 123 or c == 91 then
                depth = depth + 1
                open[depth] = k
            elseif depth > 0 then
                ends[open[depth]] = k + 1
                depth = depth - 1
            end
            j = k + 1
        end
    end
    return ends
end

-- The entries of the last text member() read, by container (its start index): a request's
-- handler looks up several members of one body, and each look-up walked the whole body again
-- (23 ms on the event loop for a 143 KB JSON Schema, five times the one walk). Strings are
-- interned, so telling the text is the same one is a pointer compare. (The memo's tables are
-- held in locals: the walk pauses, and another request's look-up may make the memo its own.)
local memo_text, memo_entries, memo_ends = nil, {}, nil
local function entries_of(s, i)
    if s ~= memo_text then
        local ends = container_ends(s)
        memo_text, memo_entries, memo_ends = s, {}, ends
    end
    local memo, ends = memo_entries, memo_ends
    local list = memo[i]
    if not list then
        list = entries(s, i, ends)
        memo[i] = list
    end
    return list
end

-- span(s, path) -> where s's value at `path` is (object keys, and array indexes from 1): its
-- first and last index, or nil. As cjson does, the last of duplicate keys wins.
local function span(s, path)
    local from = skip_ws(s, 1)
    if #path == 0 then return from, (skip_value(s, from) or #s + 1) - 1 end
    local to
    for _, step in ipairs(path) do
        local c, found = byte(s, from), nil
        if type(step) == "number" then
            if c ~= 91 then return nil end
            found = entries_of(s, from)[step]
        else
            if c ~= 123 then return nil end
            for _, m in ipairs(entries_of(s, from)) do
                if m.key == step then found = m end
            end
        end
        if not found then return nil end
        from, to = found.from, found.to
    end
    return from, to
end
_M.span = span

-- member(s, path) -> the text of s's value at `path` (span's), or nil.
function _M.member(s, path)
    local from, to = span(s, path)
    return from and sub(s, from, to) or nil
end

-- decode_ordered(text, dict, max_depth) -> the value of the JSON text, each object made by
-- dict(table, keys) with its keys in the text's order (the last of duplicate keys' value, at
-- the first one's place, as Python's json keeps it); or nil, err: not strict JSON, or objects
-- and arrays nested deeper than max_depth (err then names the bound). One pass: each value is
-- read once, whatever its depth. float_of (optional): what a number written as a float
-- (with a ".", an "e" or an "E": 1.0, 1e5) becomes, as Python's json keeps it a float where
-- Lua's number cannot tell 1.0 from 1.
local NESTED = {}
function _M.decode_ordered(text, dict, max_depth, float_of)
    local checked, err = _M.decode(text)
    if checked == nil then return nil, err end
    local function value_at(i, depth)
        local c = byte(text, i)
        if c ~= 123 and c ~= 91 then
            local after = c == 34 and skip_string(text, i) or scalar_end(text, i)
            local scalar = sub(text, i, after - 1)
            local v = strict.decode(scalar)
            if float_of and type(v) == "number" and find(scalar, "[.eE]") then v = float_of(v) end
            return v, after
        end
        if depth >= max_depth then error(NESTED, 0) end
        local object, out, keys = c == 123, {}, {}
        local after = each_entry(text, i, function(key, from)
            local value, next_i = value_at(from, depth + 1)
            if not object then
                out[#out + 1] = value
            else
                if out[key] == nil then keys[#keys + 1] = key end
                out[key] = value
            end
            return next_i
        end)
        return object and dict(out, keys) or out, after
    end
    local ok, value = pcall(value_at, skip_ws(text, 1), 0)
    if ok then return value end
    if value == NESTED then return nil, ("objects and arrays nested deeper than %d"):format(max_depth) end
    error(value, 0)
end

return _M

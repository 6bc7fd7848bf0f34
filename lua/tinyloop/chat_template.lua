-- tinyloop.chat_template: Hugging Face chat templates (the Jinja2 subset of
-- tokenizer_config.json's "chat_template" and of chat_template.jinja), rendered as transformers
-- renders them: jinja2's ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
-- with loop controls, the globals raise_exception and strftime_now, and transformers' own
-- tojson (json.dumps with ensure_ascii=False, no HTML escaping). Pure Lua (no ngx, no C).
--
--   local chat_template = require "tinyloop.chat_template"
--   local tpl, err = chat_template.compile(source)   -- nil, "chat template: line N: ..." on bad syntax
--   local text, err = tpl:render({ messages = { { role = "user", content = "Hi" } },
--                                  add_generation_prompt = true, bos_token = "<s>", eos_token = "</s>" })
--
-- Neither call raises: a template's error (raise_exception's message verbatim, or
-- "chat template: line N: ..." for the rest) comes back as nil, err.
--
-- Values: Lua strings are Python str (UTF-8; lengths, indexes and slices count code points),
-- numbers are int when integral and float otherwise (a template's own integral floats, 1.0 or
-- 4 / 2, are boxed so they print "1.0"), booleans are bool, cjson.null is None, nil (a missing
-- key) is undefined, Lua functions are callables. A table is a list when t[1] ~= nil, when it
-- is empty, or when its metatable is cjson's array_mt/empty_array_mt (cjson.empty_array is an
-- empty list too); otherwise a dict. An empty table is thus an empty list unless marked a dict:
-- chat_template.dict(t[, keys]) (or setmetatable(t, chat_template.dict_mt)).
-- Where Lua cannot match Python:
--   * key order: Lua tables have none, so a caller's dict iterates (for, items(), tojson,
--     printing) in sorted key order, not insertion order, unless chat_template.dict(t, keys)
--     gave it one; the template's own dicts ({...}, dict(), namespace()) keep theirs;
--   * case mapping (upper, lower, title, capitalize, swapcase, casefold), character classes
--     (isalpha, isdigit, isupper, ...) and whitespace (strip, split, trim, indent, the "-" of
--     whitespace control) know ASCII only (splitlines knows U+0085, U+2028 and U+2029 too);
--   * filters that return generators in Python (map, select, selectattr, unique, ...) return
--     lists, which print as lists; a few things Python refuses pass here (indent or trim of a
--     non-string, list + tuple).
-- Not supported (an error names them): the include, extends, import, block, call, filter and
-- with tags, recursive loops, *args/**kwargs, str % formatting and str.format, the methods
-- STR_METHODS, DICT_METHODS and LIST_METHODS lack (expandtabs, translate, dict.copy, ...),
-- filters and tests that FILTERS and TESTS lack (format, batch, wordcount, escape, ...).
-- Bounds (module fields, read at each render): MAX_OUTPUT bytes of output, MAX_WORK bytes of
-- text written or built in all (captured macro output, concatenations), MAX_DEPTH nested macro
-- calls, MAX_ITERATIONS loop iterations; each gives an error naming it. Template nesting (of
-- expressions and blocks) is bounded at compile time.
local type, pairs, ipairs, next, tostring, tonumber, select = type, pairs, ipairs, next, tostring, tonumber, select
local setmetatable, getmetatable, rawget, pcall, error, unpack = setmetatable, getmetatable, rawget, pcall, error, unpack
local concat, sort, floor, huge, fmt = table.concat, table.sort, math.floor, math.huge, string.format
local sub, find, byte, char, gsub, rep, lower, upper = string.sub, string.find, string.byte, string.char, string.gsub,
    string.rep, string.lower, string.upper

local _M = { MAX_OUTPUT = 4 * 1024 * 1024, MAX_WORK = 64 * 1024 * 1024, MAX_DEPTH = 64, MAX_ITERATIONS = 1000000 }

-- (the renderer and its walks pause at each statement and value: a server's event loop serves
-- other connections while a megabyte of tool schemas renders; tinyloop.pause says how)
local point = require("tinyloop.pause").point

local ok_cjson, cjson = pcall(require, "cjson.safe")
if not ok_cjson then cjson = {} end

-- The kinds of value that are Lua tables, told apart by metatable.
local NONE = cjson.null or setmetatable({}, { __tostring = function() return "None" end })
local UNDEF, FLOAT, TUPLE, NAMESPACE, CALLABLE, ERROR = {}, {}, {}, {}, {}, {}
local DICT = {}
-- The key order of dicts that have one (a template's dict literals, namespace(), dict(), and
-- dicts given one by _M.dict); other dicts iterate in sorted key order.
local ORDER = setmetatable({}, { __mode = "k" })
_M.dict_mt = DICT
function _M.dict(t, keys)
    t = t or {}
    ORDER[t] = keys
    return setmetatable(t, DICT)
end

-- decode_json(text) -> the JSON text's value as a template reads it: each object a dict whose
-- keys iterate in the text's order (tojson prints them so, as Python's json keeps them), {} a
-- dict and not a list; or nil, err (not strict JSON, or nested deeper than MAX_NESTING).
-- MAX_NESTING: tojson prints 100 levels, of which the messages and tools around such a value
-- (a request's tools, a call's arguments) take a few.
_M.MAX_NESTING = 64
local decode_ordered = require("tinyloop.json_text").decode_ordered
local EMPTY_ARRAY = cjson.empty_array -- a lightuserdata in some cjson builds: an empty list
local MT_KIND = { [UNDEF] = "undefined", [FLOAT] = "number", [TUPLE] = "list", [NAMESPACE] = "namespace",
                  [CALLABLE] = "callable", [DICT] = "dict" }
if cjson.array_mt then MT_KIND[cjson.array_mt] = "list" end
if cjson.empty_array_mt then MT_KIND[cjson.empty_array_mt] = "list" end

local function fail(msg) error(setmetatable({ message = msg }, ERROR), 0) end
-- A bound passed (MAX_OUTPUT, MAX_WORK, ...): what the input asked for was too much, which a
-- caller may answer differently from a template that cannot run (render's third value).
local function fail_limit(msg) error(setmetatable({ message = msg, limit = true }, ERROR), 0) end
-- Padding of n spaces (tojson's and indent's): bounded before it is built, since rep() of a
-- template's huge width would take seconds before MAX_OUTPUT is checked.
local MAX_PAD = 4096
local function pad_of(n)
    if n > MAX_PAD then fail_limit(fmt("an indent of %d spaces: at most %d", n, MAX_PAD)) end
    return rep(" ", n > 0 and n or 0)
end
local function undefined(hint, security) return setmetatable({ hint = hint, security = security }, UNDEF) end
local function norm(v, hint) -- a value read from data: nil is undefined, cjson.empty_array []
    if v == nil then return undefined(hint) end
    if v == EMPTY_ARRAY then return {} end
    return v
end

local function kind(v)
    local t = type(v)
    if t == "string" or t == "number" or t == "boolean" then return t end
    if v == NONE then return "none" end
    if t == "function" then return "callable" end
    if t ~= "table" then return "other" end
    local mt = getmetatable(v)
    local k = mt and MT_KIND[mt]
    if k then return k end
    if v[1] ~= nil or next(v) == nil then return "list" end
    return "dict"
end

local PY_TYPE = { string = "str", boolean = "bool", none = "NoneType", list = "list", dict = "dict",
                  undefined = "Undefined", namespace = "Namespace", callable = "function", other = "object" }
local function py_type(v)
    local k = kind(v)
    if k == "number" then return (type(v) == "table" or v % 1 ~= 0) and "float" or "int" end
    if k == "list" and getmetatable(v) == TUPLE then return "tuple" end
    return PY_TYPE[k]
end

-- Using an undefined value (attribute, call, arithmetic) is jinja2's UndefinedError.
local function defined(v)
    if type(v) == "table" and getmetatable(v) == UNDEF then fail(v.hint) end
    return v
end

-- numbers: value and whether it is a Python float (bools are ints, as in Python)
local function num(v)
    local t = type(v)
    if t == "number" then return v, v % 1 ~= 0 end
    if t == "boolean" then return v and 1 or 0, false end
    if t == "table" and getmetatable(v) == FLOAT then return v[1], true end
    return nil
end
local function make_num(x, is_float)
    if is_float and x % 1 == 0 then return setmetatable({ x }, FLOAT) end
    return x
end

-- (decode_json's floats: 1.0 stays a float, as Python's json reads it)
function _M.decode_json(text)
    return decode_ordered(text, _M.dict, _M.MAX_NESTING, function(x) return make_num(x, true) end)
end

local function truthy(v)
    if v == nil or v == false or v == NONE then return false end
    local t = type(v)
    if t == "string" then return v ~= "" end
    if t == "number" then return v ~= 0 end
    if t == "table" then
        local mt = getmetatable(v)
        if mt == UNDEF then return false end
        if mt == FLOAT then return v[1] ~= 0 end
        if mt == NAMESPACE or mt == CALLABLE then return true end
        return next(v) ~= nil
    end
    return v ~= EMPTY_ARRAY
end

-- ------------------------------------------------------------------ strings (UTF-8)

local UTF8_CHAR = "[^\128-\191][\128-\191]*"
local function chars(s)
    local out, n = {}, 0
    for c in s:gmatch(UTF8_CHAR) do n = n + 1; out[n] = c end
    return out
end
local function str_len(s)
    if not find(s, "[\128-\255]") then return #s end
    return select(2, gsub(s, "[^\128-\191]", ""))
end
local function utf8_encode(cp)
    if cp < 0x80 then return char(cp) end
    if cp < 0x800 then return char(0xC0 + floor(cp / 64), 0x80 + cp % 64) end
    if cp < 0x10000 then return char(0xE0 + floor(cp / 4096), 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64) end
    return char(0xF0 + floor(cp / 262144), 0x80 + floor(cp / 4096) % 64, 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
end
local function utf8_decode(c) -- code point of one UTF-8 character
    local b1, n = byte(c), #c
    if n == 1 then return b1 end
    local cp = b1 % (2 ^ (7 - n))
    for i = 2, n do cp = cp * 64 + byte(c, i) % 64 end
    return cp
end

-- (Python's ASCII white space: \x1c-\x1f, the separators, are blanks to str.strip and split
-- too. B: the same characters inside a pattern's [class]; every pattern here that reads white
-- space reads them, never Lua's %s)
local WHITESPACE = " \t\n\r\f\v\28\29\30\31"
local B = WHITESPACE
local BLANKS, NON_BLANKS = "^[" .. B .. "]*", "[^" .. B .. "]+"
-- The characters of a strip's chars as a set, the last few kept: chat templates strip every
-- message with the same one or two. ASCII chars: a set of bytes (byte -> true); others: of
-- characters (text -> true), .utf8 set: a byte set would strip the lead byte that "«" and
-- "»" share, leaving half a character.
local strip_sets, strip_sets_n = {}, 0
local function char_set(chars_)
    local set = strip_sets[chars_]
    if set then return set end
    set = {}
    if find(chars_, "[\128-\255]") then
        set.utf8 = true
        for c in chars_:gmatch(UTF8_CHAR) do set[c] = true end
    else
        for i = 1, #chars_ do set[byte(chars_, i)] = true end
    end
    if strip_sets_n >= 16 then strip_sets, strip_sets_n = {}, 0 end
    strip_sets[chars_], strip_sets_n = set, strip_sets_n + 1
    return set
end
local function strip(s, chars_, left, right) -- Python's str.strip family (ASCII whitespace)
    if chars_ == NONE then chars_ = nil end
    if chars_ ~= nil and type(chars_) ~= "string" then fail(fmt("strip arg must be None or str, not %s", py_type(chars_))) end
    if chars_ == "" then return s end
    -- scans from each end: the pattern "[set]+$" was tried at every position of the text
    -- (most of a long chat's rendering)
    local set = char_set(chars_ or WHITESPACE)
    local from, to = 1, #s
    if set.utf8 then -- whole characters: a lead byte and its continuation bytes
        if left ~= false then
            while from <= to do
                local c = s:match("^" .. UTF8_CHAR, from)
                if not (c and set[c]) then break end
                from = from + #c
            end
        end
        if right ~= false then
            while to >= from do
                local start = to
                while start > from and byte(s, start) >= 0x80 and byte(s, start) < 0xC0 do start = start - 1 end
                if not set[sub(s, start, to)] then break end
                to = start - 1
            end
        end
    else
        if left ~= false then
            while from <= to and set[byte(s, from)] do from = from + 1 end
        end
        if right ~= false then
            while to >= from and set[byte(s, to)] do to = to - 1 end
        end
    end
    if from == 1 and to == #s then return s end
    return sub(s, from, to)
end

-- ------------------------------------------------------------------ printing (Python str/repr)

-- Python's repr of a float: the shortest digits that read back as x, fixed notation for
-- exponents -4..15, else scientific with a 2-digit exponent.
local function float_repr(x)
    if x ~= x then return "nan" elseif x == huge then return "inf" elseif x == -huge then return "-inf" end
    local s
    for p = 0, 16 do
        s = fmt("%." .. p .. "e", x)
        if tonumber(s) == x then break end
    end
    local sign, d1, frac, e = s:match("^(-?)(%d)%.?(%d*)e([-+]%d+)$")
    local digits, exp = (d1 .. frac):gsub("0+$", ""), tonumber(e)
    if digits == "" then digits = "0" end
    if exp >= -4 and exp < 16 then
        if exp < 0 then return sign .. "0." .. rep("0", -exp - 1) .. digits end
        if #digits <= exp + 1 then return sign .. digits .. rep("0", exp + 1 - #digits) .. ".0" end
        return sign .. digits:sub(1, exp + 1) .. "." .. digits:sub(exp + 2)
    end
    local mantissa = #digits > 1 and (digits:sub(1, 1) .. "." .. digits:sub(2)) or digits
    return fmt("%s%se%s%02d", sign, mantissa, exp < 0 and "-" or "+", exp < 0 and -exp or exp)
end
local function number_str(v)
    if type(v) == "table" then return float_repr(v[1]) end
    if v % 1 ~= 0 then return float_repr(v) end
    if v == 0 then return "0" end
    return fmt("%.0f", v)
end

local function dict_keys(t, sorted) -- insertion order where known, else sorted (numbers first)
    if ORDER[t] and not sorted then return ORDER[t] end
    local keys = {}
    for k in pairs(t) do keys[#keys + 1] = k end
    sort(keys, function(a, b)
        local ta, tb = type(a), type(b)
        if ta ~= tb then return ta < tb end
        if ta == "string" or ta == "number" then return a < b end
        return tostring(a) < tostring(b)
    end)
    return keys
end

local function quote(s) -- Python's repr of a str
    local q = (find(s, "'", 1, true) and not find(s, '"', 1, true)) and '"' or "'"
    local named = { ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t", [q] = "\\" .. q }
    return q .. gsub(s, "[%c\\'\"]", function(c)
        return named[c] or ((c == "'" or c == '"') and c) or fmt("\\x%02x", byte(c))
    end) .. q
end

local to_str
local function repr(v, depth)
    depth = (depth or 0) + 1
    if depth > 100 then fail("value nested too deeply to print") end
    v = norm(v)
    local k = kind(v)
    if k == "string" then return quote(v) end
    if k == "list" then
        local parts = {}
        for i = 1, #v do parts[i] = repr(v[i], depth) end
        if getmetatable(v) == TUPLE then return "(" .. concat(parts, ", ") .. (#v == 1 and ",)" or ")") end
        return "[" .. concat(parts, ", ") .. "]"
    end
    if k == "dict" or k == "namespace" then
        local parts = {}
        for i, key in ipairs(dict_keys(v)) do parts[i] = repr(key, depth) .. ": " .. repr(v[key], depth) end
        local s = "{" .. concat(parts, ", ") .. "}"
        return k == "dict" and s or "<Namespace " .. s .. ">"
    end
    if k == "callable" then return "<function>" end
    if k == "other" then return tostring(v) end
    return to_str(v)
end
to_str = function(v)
    local t = type(v)
    if t == "string" then return v end
    if t == "number" then return number_str(v) end
    if t == "boolean" then return v and "True" or "False" end
    if v == NONE then return "None" end
    local k = kind(v)
    if k == "undefined" then return "" end
    if k == "number" then return number_str(v) end
    return repr(v)
end

-- ------------------------------------------------------------------ JSON (transformers' tojson)

local JSON_ESCAPES = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t",
                       ["\b"] = "\\b", ["\f"] = "\\f" }
local function json_quote(s, ascii)
    s = gsub(s, '[%z\1-\31"\\]', function(c) return JSON_ESCAPES[c] or fmt("\\u%04x", byte(c)) end)
    if ascii then -- (Python's ensure_ascii escapes all but space..~: DEL too)
        s = gsub(s, "\127", "\\u007f")
        s = gsub(s, "[\192-\247][\128-\191]*", function(c)
            local cp = utf8_decode(c)
            if cp < 0x10000 then return fmt("\\u%04x", cp) end
            cp = cp - 0x10000
            return fmt("\\u%04x\\u%04x", 0xD800 + floor(cp / 1024), 0xDC00 + cp % 1024)
        end)
    end
    return '"' .. s .. '"'
end

local function json(v, o, level)
    if level > 100 then fail("value nested too deeply for tojson") end
    point()
    v = norm(v)
    local k = kind(v)
    if k == "string" then return json_quote(v, o.ascii) end
    if k == "number" then
        local x = num(v)
        if x ~= x then return "NaN" elseif x == huge then return "Infinity" elseif x == -huge then return "-Infinity" end
        return number_str(v)
    end
    if k == "boolean" then return v and "true" or "false" end
    if k == "none" then return "null" end
    local parts, keys = {}, nil
    if k == "list" then
        for i = 1, #v do parts[i] = json(v[i], o, level + 1) end
    elseif k == "dict" then
        keys = dict_keys(v, o.sort_keys)
        for i, key in ipairs(keys) do
            local ks = type(key) == "string" and key or json(key, o, level + 1)
            parts[i] = json_quote(ks, o.ascii) .. o.key_sep .. json(v[key], o, level + 1)
        end
    else
        fail(fmt("Object of type %s is not JSON serializable", py_type(v)))
    end
    local open, close = keys and "{" or "[", keys and "}" or "]"
    if #parts == 0 then return open .. close end
    if not o.indent then return open .. concat(parts, o.item_sep) .. close end
    local pad = "\n" .. rep(o.indent, level + 1)
    return open .. pad .. concat(parts, o.item_sep .. pad) .. "\n" .. rep(o.indent, level) .. close
end

-- ------------------------------------------------------------------ lexer
-- A port of jinja2's lexer with trim_blocks and lstrip_blocks on: tokens
-- { type = "text"|"var_begin"|"var_end"|"block_begin"|"block_end"|"name"|"string"|"int"|
-- "float"|"op"|"eof", value, line }. Comments vanish; raw blocks become text.

local function compile_error(line, msg) error(setmetatable({ message = msg, line = line }, ERROR), 0) end
local function count_newlines(s) return select(2, gsub(s, "\n", "")) end

local ESCAPES = { n = "\n", t = "\t", r = "\r", ["\\"] = "\\", ["'"] = "'", ['"'] = '"', a = "\a", b = "\b",
                  f = "\f", v = "\v", ["\n"] = "" }
local function unescape(s) -- Python's string escapes; unknown ones stay as written
    local out, pos = {}, 1
    while true do
        local i = find(s, "\\", pos, true)
        if not i then out[#out + 1] = sub(s, pos); break end
        out[#out + 1] = sub(s, pos, i - 1)
        local c = sub(s, i + 1, i + 1)
        local hex = (c == "x" and 2) or (c == "u" and 4) or (c == "U" and 8)
        local digits = hex and s:match("^" .. rep("%x", hex), i + 2)
        local octal = s:match("^[0-7][0-7]?[0-7]?", i + 1)
        if digits then
            out[#out + 1] = utf8_encode(tonumber(digits, 16)); pos = i + 2 + hex
        elseif octal then
            out[#out + 1] = utf8_encode(tonumber(octal, 8)); pos = i + 1 + #octal
        else
            out[#out + 1] = ESCAPES[c] or ("\\" .. c); pos = i + 2
        end
    end
    return concat(out)
end

local OPERATORS2 = { ["//"] = true, ["**"] = true, ["=="] = true, ["!="] = true, [">="] = true, ["<="] = true }
local OPERATORS1 = "^[-+*/%%~%[%](){}<>=.:|,;]"
local CLOSER = { ["("] = ")", ["["] = "]", ["{"] = "}" }

local function lex(src)
    src = gsub(src, "\r\n?", "\n")
    if sub(src, -1) == "\n" then src = sub(src, 1, -2) end -- keep_trailing_newline=False
    local tokens, line, pos, len = {}, 1, 1, #src
    local line_starting = true -- whether the last tag ended a line (lstrip_blocks applies at 1)
    local function push(type_, value) tokens[#tokens + 1] = { type = type_, value = value, line = line } end
    local function skip_ws() local ws = src:match(BLANKS, pos); line = line + count_newlines(ws); pos = pos + #ws end
    -- the end of a block-like tag: "+%}" keeps the newline after it, "-%}" eats all whitespace
    -- after it, "%}" eats one newline (trim_blocks)
    local function block_end(at)
        local c = sub(src, at, at)
        if c == "+" then pos = at + 3
        elseif c == "-" then pos = at + 3; skip_ws()
        else pos = at + 2; if sub(src, pos, pos) == "\n" then pos = pos + 1; line = line + 1 end end
    end
    -- text before a tag, whitespace-controlled by the tag's sign ("-" strips, "+" keeps, else
    -- lstrip_blocks strips a line's indentation before a block or comment tag)
    local function text_before(text, sign, is_block)
        local shown = text
        if sign == "-" then shown = strip(text, nil, false, true)
        elseif sign ~= "+" and is_block then
            local lpos = (text:match(".*\n()") or 1)
            if (lpos > 1 or line_starting) and find(text, "^[" .. B .. "]+$", lpos) then shown = sub(text, 1, lpos - 1) end
        end
        if shown ~= "" then push("text", shown) end
        line = line + count_newlines(text)
    end
    while pos <= len do
        local s = find(src, "{[{%%#]", pos)
        if not s then push("text", sub(src, pos)); break end
        local tag = sub(src, s + 1, s + 1)
        local sign = src:match("^[-+]", s + 2)
        local raw_end = tag == "%" and src:match("^{%%[-+]?[" .. B .. "]*raw[" .. B .. "]*%-?%%}()", s)
        text_before(sub(src, pos, s - 1), sign, tag ~= "{")
        if raw_end then
            line = line + count_newlines(sub(src, s, raw_end - 1))
            pos = raw_end
            if sub(src, raw_end - 3, raw_end - 3) == "-" then skip_ws() end
            line_starting = byte(src, pos - 1) == 10
            local a, b, esign = find(src, "{%%([-+]?)[" .. B .. "]*endraw[" .. B .. "]*", pos)
            if not a or not (find(src, "^[-+]?%%}", b + 1)) then compile_error(line, "missing end of raw directive") end
            text_before(sub(src, pos, a - 1), esign, true)
            line = line + count_newlines(sub(src, a, b))
            block_end(b + 1)
        elseif tag == "#" then
            local e = find(src, "#}", s + 2, true)
            if not e then compile_error(line, "missing end of comment tag") end
            line = line + count_newlines(sub(src, s, e))
            local signed = e > s + 2 + (sign and 1 or 0) and find(src, "^[-+]", e - 1)
            block_end(signed and e - 1 or e)
        else
            push(tag == "{" and "var_begin" or "block_begin")
            pos = s + 2 + (sign and 1 or 0)
            local brackets = {}
            while true do
                skip_ws()
                if pos > len then compile_error(line, "unexpected end of template, the tag is not closed") end
                if #brackets == 0 then
                    if tag == "{" and find(src, "^%-?}}", pos) then
                        push("var_end")
                        if sub(src, pos, pos) == "-" then pos = pos + 3; skip_ws() else pos = pos + 2 end
                        break
                    elseif tag == "%" and find(src, "^[-+]?%%}", pos) then
                        push("block_end"); block_end(pos)
                        break
                    end
                end
                local c = sub(src, pos, pos)
                local word = src:match("^[%a_][%w_]*", pos)
                local number = src:match("^%d+", pos)
                if word then push("name", word); pos = pos + #word
                elseif number then
                    local float = sub(src, pos - 1, pos - 1) ~= "." and
                        (src:match("^%d+%.%d+[eE][-+]?%d+", pos) or src:match("^%d+%.%d+", pos) or src:match("^%d+[eE][-+]?%d+", pos))
                    if float then push("float", make_num(tonumber(float), true)); pos = pos + #float
                    else push("int", tonumber(number)); pos = pos + #number end
                elseif c == "'" or c == '"' then
                    local i = pos + 1
                    while true do
                        local j = find(src, "[\\" .. c .. "]", i)
                        if not j then compile_error(line, "unexpected end of string") end
                        if sub(src, j, j) == "\\" then i = j + 2 else i = j; break end
                    end
                    local body = sub(src, pos + 1, i - 1)
                    push("string", unescape(body)); line = line + count_newlines(body); pos = i + 1
                else
                    local op = sub(src, pos, pos + 1)
                    if not OPERATORS2[op] then op = src:match(OPERATORS1, pos) end
                    if not op then compile_error(line, fmt("unexpected character %q", c)) end
                    local expected = brackets[#brackets] -- the closer of the innermost open bracket
                    if CLOSER[op] then brackets[#brackets + 1] = CLOSER[op]
                    elseif op == ")" or op == "]" or op == "}" then
                        if op ~= expected then
                            compile_error(line, fmt(expected and "unexpected '%s', expected '%s'" or "unexpected '%s'", op, expected))
                        end
                        brackets[#brackets] = nil
                    end
                    push("op", op); pos = pos + #op
                end
            end
        end
        line_starting = byte(src, pos - 1) == 10
    end
    push("eof")
    return tokens
end

-- ------------------------------------------------------------------ parser
-- Recursive descent with jinja2's grammar and precedence (lowest first): x if c else y; or;
-- and; not; comparisons, in, not in (chained); + -; ~; * / // %; **; unary - +; then
-- primaries with postfix .attr [index] [a:b:c] (call), and filters |f(...) / tests "is [not] t".
-- Expressions are { k = kind, line, ... }; statements too.

local P = {} -- the parser's state: tokens, i (the current token), loops (nesting, for break)
P.__index = P

function P:peek() return self.tokens[self.i] end
function P:next() local t = self.tokens[self.i]; self.i = self.i + 1; return t end
function P:is_op(v) local t = self.tokens[self.i]; return t.type == "op" and t.value == v end
function P:is_name(v) local t = self.tokens[self.i]; return t.type == "name" and t.value == v end
local function describe(t)
    if t.type == "eof" then return "end of template" end
    if t.type == "block_end" or t.type == "var_end" then return "end of tag" end
    -- (a number token is boxed: its table's address was shown)
    return "'" .. (type(t.value) == "table" and repr(t.value) or tostring(t.value)) .. "'"
end
function P:fail(msg, t) compile_error((t or self:peek()).line, msg) end
function P:expect(type_, value)
    local t = self:peek()
    if t.type ~= type_ or (value and t.value ~= value) then
        local wanted = { var_end = "'}}'", block_end = "'%}'", name = "a name" }
        self:fail(fmt("expected %s, got %s", value and ("'" .. value .. "'") or wanted[type_], describe(t)))
    end
    return self:next()
end
-- Nesting (of expressions and of blocks) is bounded so that no template overflows the stack.
function P:enter()
    self.depth = self.depth + 1
    if self.depth > 200 then self:fail("the template is nested too deeply") end
end
function P:leave() self.depth = self.depth - 1 end
function P:skip_op(v) if self:is_op(v) then self.i = self.i + 1; return true end end
function P:skip_name(v) if self:is_name(v) then self.i = self.i + 1; return true end end
-- item, item, ... closer (a trailing comma allowed), each item parsed by parse_one(p, index)
function P:comma_list(closer, parse_one)
    local n = 0
    while not self:skip_op(closer) do
        if n > 0 then self:expect("op", ","); if self:skip_op(closer) then break end end
        n = n + 1
        parse_one(self, n)
    end
end

local parse_expr, parse_or, parse_unary

-- a, b, c: a tuple when there is a comma (or "()" inside parentheses)
local function parse_tuple(p, parse_item, in_parens)
    local line, items, is_tuple = p:peek().line, {}, false
    while true do
        if #items > 0 then p:expect("op", ",") end
        local t = p:peek()
        if t.type == "var_end" or t.type == "block_end" or (in_parens and p:is_op(")")) then break end
        items[#items + 1] = parse_item(p)
        if p:is_op(",") then is_tuple = true else break end
    end
    if is_tuple or (in_parens and #items == 0) then return { k = "tuple", items = items, line = line } end
    if #items == 0 then p:fail("expected an expression, got " .. describe(p:peek())) end
    return items[1]
end

local function parse_call_args(p)
    p:expect("op", "(")
    local args, kwargs = {}, nil
    p:comma_list(")", function()
        if p:is_op("*") or p:is_op("**") then p:fail("*args and **kwargs are not supported") end
        local t = p:peek()
        if t.type == "name" and p.tokens[p.i + 1].type == "op" and p.tokens[p.i + 1].value == "=" then
            p.i = p.i + 2
            kwargs = kwargs or {}
            kwargs[#kwargs + 1] = { name = t.value, e = parse_expr(p) }
        else
            if kwargs then p:fail("positional argument follows keyword argument") end
            args[#args + 1] = parse_expr(p)
        end
    end)
    return args, kwargs
end

-- fn(args...): the call of fn, its arguments read from the "(" on.
local function call_of(p, fn, line)
    local args, kwargs = parse_call_args(p)
    return { k = "call", fn = fn, args = args, kwargs = kwargs, line = line }
end

local function parse_primary(p)
    local t = p:next()
    if t.type == "name" then
        local v = t.value
        if v == "true" or v == "True" then return { k = "const", v = true } end
        if v == "false" or v == "False" then return { k = "const", v = false } end
        if v == "none" or v == "None" then return { k = "const", v = NONE } end
        return { k = "name", name = v, line = t.line }
    elseif t.type == "string" then
        local parts = { t.value } -- adjacent literals concatenate
        while p:peek().type == "string" do parts[#parts + 1] = p:next().value end
        return { k = "const", v = concat(parts) }
    elseif t.type == "int" or t.type == "float" then
        return { k = "const", v = t.value }
    elseif t.type == "op" and t.value == "(" then
        local e = parse_tuple(p, parse_expr, true)
        p:expect("op", ")")
        return e
    elseif t.type == "op" and t.value == "[" then
        local items = {}
        p:comma_list("]", function(_, i) items[i] = parse_expr(p) end)
        return { k = "list", items = items }
    elseif t.type == "op" and t.value == "{" then
        local keys, values = {}, {}
        p:comma_list("}", function(_, i)
            keys[i] = parse_expr(p)
            p:expect("op", ":")
            values[i] = parse_expr(p)
        end)
        return { k = "dict", keys = keys, values = values }
    end
    p:fail("unexpected " .. describe(t), t)
end

local function parse_postfix(p, e)
    while true do
        local line = p:peek().line
        if p:skip_op(".") then
            local t = p:next()
            if t.type == "name" then e = { k = "attr", obj = e, name = t.value, line = line }
            elseif t.type == "int" then e = { k = "item", obj = e, key = { k = "const", v = t.value }, line = line }
            else p:fail("expected a name or a number after '.'", t) end
        elseif p:skip_op("[") then
            local bounds, colons = {}, 0 -- a[i] or a[start:stop:step]
            while not p:is_op("]") do
                if p:skip_op(":") then colons = colons + 1
                elseif bounds[colons + 1] == nil then bounds[colons + 1] = parse_expr(p)
                else p:fail("expected ']', got " .. describe(p:peek())) end
            end
            p:next()
            if colons == 0 then
                if not bounds[1] then p:fail("expected a subscript expression") end
                e = { k = "item", obj = e, key = bounds[1], line = line }
            elseif colons > 2 then p:fail("invalid slice")
            else e = { k = "slice", obj = e, start = bounds[1], stop = bounds[2], step = bounds[3], line = line } end
        elseif p:is_op("(") then
            e = call_of(p, e, line)
        else
            return e
        end
    end
end

local TEST_ARG_START = { name = true, string = true, int = true, float = true }
local function parse_filter_expr(p, e)
    while true do
        local line = p:peek().line
        if p:skip_op("|") then
            local name = p:expect("name").value
            local args, kwargs = {}, nil
            if p:is_op("(") then args, kwargs = parse_call_args(p) end
            e = { k = "filter", obj = e, name = name, args = args, kwargs = kwargs, line = line }
        elseif p:skip_name("is") then
            local negate = p:skip_name("not")
            local name = p:expect("name").value
            local args, kwargs = {}, nil
            local t = p:peek()
            if p:is_op("(") then args, kwargs = parse_call_args(p)
            elseif (TEST_ARG_START[t.type] or (t.type == "op" and (t.value == "[" or t.value == "{")))
                and not (t.type == "name" and (t.value == "else" or t.value == "or" or t.value == "and")) then
                args = { parse_postfix(p, parse_primary(p)) } -- "x is divisibleby 3"
            end
            e = { k = "test", obj = e, name = name, args = args, kwargs = kwargs, line = line }
            if negate then e = { k = "not", e = e } end
        elseif p:is_op("(") then
            e = call_of(p, e, line)
        else
            return e
        end
    end
end

parse_unary = function(p, with_filter)
    p:enter()
    local e
    if p:skip_op("-") then e = { k = "neg", e = parse_unary(p, false) }
    elseif p:skip_op("+") then e = { k = "pos", e = parse_unary(p, false) }
    else e = parse_primary(p) end
    e = parse_postfix(p, e)
    if with_filter ~= false then e = parse_filter_expr(p, e) end
    p:leave()
    return e
end

-- one left-associative level of binary operators over `next_level`
local function binary_level(ops, next_level)
    return function(p)
        local e = next_level(p)
        while true do
            local t = p:peek()
            if not (t.type == "op" and ops[t.value]) then return e end
            p:next()
            e = { k = "bin", op = t.value, a = e, b = next_level(p) }
        end
    end
end
local parse_pow = binary_level({ ["**"] = true }, parse_unary)
local parse_mul = binary_level({ ["*"] = true, ["/"] = true, ["//"] = true, ["%"] = true }, parse_pow)
local function parse_concat(p)
    local e = parse_mul(p)
    if not p:is_op("~") then return e end
    local items = { e }
    while p:skip_op("~") do items[#items + 1] = parse_mul(p) end
    return { k = "concat", items = items }
end
local parse_add = binary_level({ ["+"] = true, ["-"] = true }, parse_concat)

local COMPARE_OPS = { ["=="] = true, ["!="] = true, ["<"] = true, [">"] = true, ["<="] = true, [">="] = true }
local function parse_compare(p)
    local e = parse_add(p)
    local ops = {}
    while true do
        local t = p:peek()
        local op
        if t.type == "op" and COMPARE_OPS[t.value] then p:next(); op = t.value
        elseif p:skip_name("in") then op = "in"
        elseif p:is_name("not") and p.tokens[p.i + 1].type == "name" and p.tokens[p.i + 1].value == "in" then
            p.i = p.i + 2; op = "not in"
        else break end
        ops[#ops + 1] = { op = op, e = parse_add(p) }
    end
    if #ops == 0 then return e end
    return { k = "compare", first = e, ops = ops }
end
local function parse_not(p)
    if not p:skip_name("not") then return parse_compare(p) end
    p:enter()
    local e = { k = "not", e = parse_not(p) }
    p:leave()
    return e
end
local function parse_and(p)
    local e = parse_not(p)
    while p:skip_name("and") do e = { k = "and", a = e, b = parse_not(p) } end
    return e
end
parse_or = function(p)
    local e = parse_and(p)
    while p:skip_name("or") do e = { k = "or", a = e, b = parse_and(p) } end
    return e
end
parse_expr = function(p)
    p:enter()
    local e = parse_or(p)
    while p:skip_name("if") do
        local test = parse_or(p)
        local otherwise = p:skip_name("else") and parse_expr(p) or nil
        e = { k = "cond", test = test, yes = e, no = otherwise }
    end
    p:leave()
    return e
end

-- statements: each returns a node; the body parser stops at one of `ends` and returns its name
local STATEMENTS = {}
local END_TAGS = { endif = "if", elif = "if", ["else"] = "if or for", endfor = "for", endset = "set",
                   endmacro = "macro", endgeneration = "generation", endraw = "raw" }

local function parse_body(p, ends, opener)
    local body = {}
    p:enter()
    while true do
        local t = p:next()
        if t.type == "text" then
            body[#body + 1] = { k = "text", s = t.value }
        elseif t.type == "var_begin" then
            body[#body + 1] = { k = "output", e = parse_tuple(p, parse_expr), line = t.line }
            p:expect("var_end")
        elseif t.type == "block_begin" then
            local name_token = p:expect("name")
            local name = name_token.value
            if ends and ends[name] then p:leave(); return body, name end
            local statement = STATEMENTS[name]
            if not statement then
                p:fail(END_TAGS[name] and fmt("unexpected '%s'", name) or fmt("unknown tag '%s'", name), name_token)
            end
            body[#body + 1] = statement(p, name_token.line)
        else -- eof
            if ends then
                p:fail(fmt("unexpected end of template: the '%s' of line %d is not closed", opener.name, opener.line), t)
            end
            p:leave()
            return body
        end
    end
end

local function parse_assign_target(p, allow_attr)
    local names = { p:expect("name").value }
    if allow_attr and p:skip_op(".") then return { k = "attr", name = names[1], attr = p:expect("name").value } end
    while p:skip_op(",") do names[#names + 1] = p:expect("name").value end
    if #names == 1 then return { k = "name", name = names[1] } end
    return { k = "names", names = names }
end

STATEMENTS["if"] = function(p, line)
    local node = { k = "if", tests = {}, bodies = {}, line = line }
    while true do
        node.tests[#node.tests + 1] = parse_tuple(p, parse_or)
        p:expect("block_end")
        local body, ended = parse_body(p, { elif = true, ["else"] = true, endif = true }, { name = "if", line = line })
        node.bodies[#node.bodies + 1] = body
        if ended == "else" then
            p:expect("block_end")
            node.else_body = parse_body(p, { endif = true }, { name = "if", line = line })
        end
        if ended ~= "elif" then break end
    end
    p:expect("block_end")
    return node
end

STATEMENTS["for"] = function(p, line)
    local node = { k = "for", target = parse_assign_target(p), line = line }
    p:expect("name", "in")
    node.iter = parse_tuple(p, parse_or)
    if p:skip_name("if") then node.cond = parse_expr(p) end
    if p:is_name("recursive") then p:fail("recursive loops are not supported") end
    p:expect("block_end")
    p.loops = p.loops + 1
    local ended
    node.body, ended = parse_body(p, { endfor = true, ["else"] = true }, { name = "for", line = line })
    p.loops = p.loops - 1
    if ended == "else" then
        p:expect("block_end")
        node.else_body = parse_body(p, { endfor = true }, { name = "for", line = line })
    end
    p:expect("block_end")
    return node
end

STATEMENTS["set"] = function(p, line)
    local target = parse_assign_target(p, true)
    if p:skip_op("=") then
        local node = { k = "set", target = target, e = parse_tuple(p, parse_expr), line = line }
        p:expect("block_end")
        return node
    end
    if target.k ~= "name" then p:fail("a block set assigns one name") end
    p:expect("block_end")
    local node = { k = "setblock", target = target, line = line }
    node.body = parse_body(p, { endset = true }, { name = "set", line = line })
    p:expect("block_end")
    return node
end

STATEMENTS["macro"] = function(p, line)
    local node = { k = "macro", name = p:expect("name").value, params = {}, defaults = {}, line = line }
    p:expect("op", "(")
    p:comma_list(")", function(_, i)
        node.params[i] = p:expect("name").value
        if p:skip_op("=") then node.defaults[i] = parse_expr(p)
        elseif next(node.defaults) then p:fail("non-default argument follows default argument") end
    end)
    p:expect("block_end")
    local loops = p.loops
    p.loops = 0 -- a macro's body is outside any loop
    node.body = parse_body(p, { endmacro = true }, { name = "macro", line = line })
    p.loops = loops
    p:expect("block_end")
    return node
end

STATEMENTS["generation"] = function(p, line) -- transformers' assistant-mask marker: just the body
    p:expect("block_end")
    local node = { k = "block", body = parse_body(p, { endgeneration = true }, { name = "generation", line = line }) }
    p:expect("block_end")
    return node
end

local function loop_control(kind_)
    return function(p, line)
        if p.loops == 0 then compile_error(line, fmt("'%s' outside of a loop", kind_)) end
        p:expect("block_end")
        return { k = kind_ }
    end
end
STATEMENTS["break"], STATEMENTS["continue"] = loop_control("break"), loop_control("continue")

-- ------------------------------------------------------------------ evaluator: values
-- Attributes and items follow jinja2: a.b is the attribute (a method) else the item; a[k] the
-- item else the attribute; missing ones are undefined. The immutable sandbox refuses methods
-- that mutate (list.append, dict.update, ...): using one is an error.

local FILTERS, TESTS, STR_METHODS, DICT_METHODS, LIST_METHODS = {}, {}, {}, {}, {}
local UNSAFE = { list = { append = 1, extend = 1, insert = 1, remove = 1, pop = 1, sort = 1, reverse = 1, clear = 1 },
                 dict = { pop = 1, popitem = 1, setdefault = 1, update = 1, clear = 1 } }

local function callable(fn, self_) return setmetatable({ fn = fn, self = self_ }, CALLABLE) end

local function py_index(i, len) -- a Python index (negative from the end) -> 1-based, or nil
    i = num(i)
    if not i or i % 1 ~= 0 then return nil end
    if i < 0 then i = i + len end
    if i < 0 or i >= len then return nil end
    return i + 1
end

local function getattr(obj, name)
    local k = kind(obj)
    if k == "undefined" then defined(obj) end
    if k == "string" and STR_METHODS[name] then return callable(STR_METHODS[name], obj) end
    if k == "dict" and DICT_METHODS[name] then return callable(DICT_METHODS[name], obj) end
    if k == "list" and LIST_METHODS[name] then return callable(LIST_METHODS[name], obj) end
    if UNSAFE[k] and UNSAFE[k][name] then
        return undefined(fmt("access to attribute '%s' of '%s' object is unsafe.", name, k), true)
    end
    if k == "dict" or k == "namespace" then
        return norm(rawget(obj, name), fmt("'%s object' has no attribute '%s'", k, name))
    end
    return undefined(fmt("'%s object' has no attribute '%s'", py_type(obj), tostring(name)))
end

local function getitem(obj, key)
    local k = kind(obj)
    if k == "undefined" then defined(obj) end
    if k == "list" then
        local i = py_index(key, #obj)
        if i then return norm(obj[i]) end
    elseif k == "string" then
        if not find(obj, "[\128-\255]") then -- (ASCII: a byte is a character, no list of them made)
            local i = py_index(key, #obj)
            if i then return sub(obj, i, i) end
        else
            local i = py_index(key, str_len(obj))
            if i then return chars(obj)[i] end
        end
    elseif k == "dict" then
        local v = obj[num(key) or key]
        if v ~= nil then return norm(v) end
    end
    if type(key) == "string" then return getattr(obj, key) end
    return undefined(fmt("'%s object' has no element %s", py_type(obj), to_str(key)))
end

-- a list of the values a for loop visits (a dict's keys, a string's characters)
local function iterable(v)
    local k = kind(v)
    if k == "list" then return v end
    if k == "dict" then return dict_keys(v) end
    if k == "string" then return chars(v) end
    if k == "undefined" then return {} end
    fail(fmt("'%s' object is not iterable", py_type(v)))
end

local function py_eq(a, b, depth)
    if a == b then return true end
    local x, y = num(a), num(b)
    if x and y then return x == y end
    local ka, kb = kind(a), kind(b)
    if ka ~= kb then return false end
    depth = (depth or 0) + 1
    if depth > 100 then fail("values nested too deeply to compare") end
    if ka == "list" then
        -- (a tuple is never equal to a list, whatever they hold: Python's rule)
        if #a ~= #b or (getmetatable(a) == TUPLE) ~= (getmetatable(b) == TUPLE) then return false end
        for i = 1, #a do if not py_eq(a[i], b[i], depth) then return false end end
        return true
    elseif ka == "dict" then
        for key, v in pairs(a) do if b[key] == nil or not py_eq(v, b[key], depth) then return false end end
        for key in pairs(b) do if a[key] == nil then return false end end
        return true
    end
    return ka == "undefined"
end

local function py_lt(a, b)
    local x, y = num(defined(a)), num(defined(b))
    if x and y then return x < y end
    local ka, kb = kind(a), kind(b)
    if ka == "string" and kb == "string" then return a < b end
    if ka == "list" and kb == "list" then
        for i = 1, math.min(#a, #b) do
            if not py_eq(a[i], b[i]) then return py_lt(a[i], b[i]) end
        end
        return #a < #b
    end
    fail(fmt("'<' not supported between instances of '%s' and '%s'", py_type(a), py_type(b)))
end

local function py_in(item, container)
    local k = kind(container)
    if k == "string" then
        if type(item) ~= "string" then fail(fmt("'in <string>' requires string as left operand, not %s", py_type(item))) end
        return find(container, item, 1, true) ~= nil
    elseif k == "list" then
        for i = 1, #container do if py_eq(container[i], item) then return true end end
        return false
    elseif k == "dict" then
        return container[num(item) or item] ~= nil
    elseif k == "undefined" then
        return false
    end
    fail(fmt("argument of type '%s' is not iterable", py_type(container)))
end

-- strings and lists a template builds count against MAX_WORK, as written text does
local function built(st, v, size)
    st.work = st.work + (size or #v)
    if st.work > _M.MAX_WORK then fail_limit(fmt("the template built more than MAX_WORK = %d bytes of text", _M.MAX_WORK)) end
    return v
end

local function arith(st, op, a, b)
    local x, xf = num(defined(a))
    local y, yf = num(defined(b))
    if x and y then
        local is_float = xf or yf
        if op == "+" then return make_num(x + y, is_float) end
        if op == "-" then return make_num(x - y, is_float) end
        if op == "*" then return make_num(x * y, is_float) end
        if op == "**" then return make_num(x ^ y, is_float or y < 0) end
        if y == 0 then fail(op == "/" and "division by zero" or "integer division or modulo by zero") end
        if op == "/" then return make_num(x / y, true) end
        if op == "//" then return make_num(floor(x / y), is_float) end
        return make_num(x - floor(x / y) * y, is_float) -- Python's %: the sign of the divisor
    end
    local ka, kb = kind(a), kind(b)
    if op == "+" and ka == kb and ka == "string" then return built(st, a .. b) end
    if op == "+" and ka == kb and ka == "list" then
        local out = {}
        for i = 1, #a do out[i] = a[i] end
        for i = 1, #b do out[#a + i] = b[i] end
        return built(st, out, #out)
    end
    if op == "*" and (ka == "string" or ka == "list") and y and not yf then
        built(st, nil, #a * math.max(y, 0)) -- before building it
        if ka == "string" then return rep(a, y) end
        local out = {}
        for r = 0, y - 1 do for i = 1, #a do out[r * #a + i] = a[i] end end
        return out
    end
    if op == "*" and (kb == "string" or kb == "list") and x and not xf then return arith(st, op, b, a) end
    fail(fmt("unsupported operand type(s) for %s: '%s' and '%s'", op, py_type(a), py_type(b)))
end

local function call_value(st, f, args, kwargs)
    local mt = getmetatable(f)
    if mt == CALLABLE then return f.fn(f.self, args, kwargs or {}, st) end
    if type(f) == "function" then -- a Lua function passed in vars: positional arguments
        local v = f(unpack(args))
        if v == nil then return NONE end
        return v
    end
    defined(f)
    fail(fmt("'%s' object is not callable", py_type(f)))
end

-- ------------------------------------------------------------------ evaluator: expressions

local EVAL = {}
local function eval(e, scope, st) return EVAL[e.k](e, scope, st) end

local function eval_args(e, scope, st)
    local args, kwargs = {}, nil
    for i, a in ipairs(e.args) do args[i] = eval(a, scope, st) end
    if e.kwargs then
        kwargs = {}
        local order = {}
        for i, kw in ipairs(e.kwargs) do kwargs[kw.name] = eval(kw.e, scope, st); order[i] = kw.name end
        ORDER[kwargs] = order
    end
    return args, kwargs
end

EVAL.const = function(e) return e.v end
EVAL.name = function(e, scope)
    local v = scope[e.name]
    if v == nil then return undefined(fmt("'%s' is undefined", e.name)) end
    return v
end
EVAL.list = function(e, scope, st)
    local out = {}
    for i, item in ipairs(e.items) do out[i] = eval(item, scope, st) end
    return out
end
EVAL.tuple = function(e, scope, st) return setmetatable(EVAL.list(e, scope, st), TUPLE) end
EVAL.dict = function(e, scope, st)
    local out, order = setmetatable({}, DICT), {}
    for i, key in ipairs(e.keys) do
        local kv = eval(key, scope, st)
        kv = num(kv) or kv
        if out[kv] == nil then order[#order + 1] = kv end
        out[kv] = eval(e.values[i], scope, st)
    end
    ORDER[out] = order
    return out
end
EVAL.attr = function(e, scope, st) return getattr(eval(e.obj, scope, st), e.name) end
EVAL.item = function(e, scope, st) return getitem(eval(e.obj, scope, st), eval(e.key, scope, st)) end
EVAL.slice = function(e, scope, st)
    local obj = defined(eval(e.obj, scope, st))
    local function bound(b)
        if not b then return nil end
        local v = eval(b, scope, st)
        if v == NONE then return nil end
        local n = num(v)
        if not n or n % 1 ~= 0 then fail("slice indices must be integers or None") end
        return n
    end
    local start, stop, step = bound(e.start), bound(e.stop), bound(e.step) or 1
    local k = kind(obj)
    -- (an ASCII string's slice by step 1 is its bytes': `content[:1]` costs no list of characters)
    local ascii = k == "string" and step == 1 and not find(obj, "[\128-\255]")
    local items = ascii and obj or k == "string" and chars(obj) or k == "list" and obj
    if not items then fail(fmt("'%s' object is not subscriptable", py_type(obj))) end
    local len = #items
    if step == 0 then fail("slice step cannot be zero") end
    local lo, hi = step > 0 and 0 or -1, step > 0 and len or len - 1
    local function clamp(i, default)
        if i == nil then return default end
        if i < 0 then i = i + len end
        return i < lo and lo or i > hi and hi or i
    end
    start, stop = clamp(start, step > 0 and 0 or len - 1), clamp(stop, step > 0 and len or -1)
    if ascii then return sub(obj, start + 1, stop) end -- ("" where stop <= start)
    local out, i = {}, start
    while (step > 0 and i < stop) or (step < 0 and i > stop) do out[#out + 1] = items[i + 1]; i = i + step end
    if k == "string" then return concat(out) end
    return out
end
EVAL.call = function(e, scope, st)
    local f = eval(e.fn, scope, st)
    local args, kwargs = eval_args(e, scope, st)
    return call_value(st, f, args, kwargs)
end
EVAL.filter = function(e, scope, st)
    local f = FILTERS[e.name]
    if not f then fail(fmt("No filter named '%s'.", e.name)) end
    local args, kwargs = eval_args(e, scope, st)
    return f(st, eval(e.obj, scope, st), args, kwargs or {})
end
local function run_test(name, v, args)
    local t = TESTS[name]
    if not t then fail(fmt("No test named %s.", repr(name))) end
    return t(v, args[1], args)
end
EVAL.test = function(e, scope, st)
    local args = eval_args(e, scope, st)
    return run_test(e.name, eval(e.obj, scope, st), args)
end
EVAL["not"] = function(e, scope, st) return not truthy(eval(e.e, scope, st)) end
EVAL.neg = function(e, scope, st)
    local x, is_float = num(defined(eval(e.e, scope, st)))
    if not x then fail("bad operand type for unary -") end
    return make_num(-x, is_float)
end
EVAL.pos = function(e, scope, st) return arith(st, "+", 0, eval(e.e, scope, st)) end
EVAL.bin = function(e, scope, st) return arith(st, e.op, eval(e.a, scope, st), eval(e.b, scope, st)) end
EVAL.concat = function(e, scope, st)
    local parts = {}
    for i, item in ipairs(e.items) do parts[i] = to_str(eval(item, scope, st)) end
    return built(st, concat(parts))
end
local COMPARE = {
    ["=="] = py_eq, ["!="] = function(a, b) return not py_eq(a, b) end,
    ["<"] = py_lt, [">"] = function(a, b) return py_lt(b, a) end,
    ["<="] = function(a, b) return not py_lt(b, a) end, [">="] = function(a, b) return not py_lt(a, b) end,
    ["in"] = py_in, ["not in"] = function(a, b) return not py_in(a, b) end,
}
EVAL.compare = function(e, scope, st)
    local a = eval(e.first, scope, st)
    for _, o in ipairs(e.ops) do
        local b = eval(o.e, scope, st)
        if not COMPARE[o.op](a, b) then return false end
        a = b
    end
    return true
end
EVAL["and"] = function(e, scope, st)
    local a = eval(e.a, scope, st)
    if not truthy(a) then return a end
    return eval(e.b, scope, st)
end
EVAL["or"] = function(e, scope, st)
    local a = eval(e.a, scope, st)
    if truthy(a) then return a end
    return eval(e.b, scope, st)
end
EVAL.cond = function(e, scope, st)
    if truthy(eval(e.test, scope, st)) then return eval(e.yes, scope, st) end
    if e.no then return eval(e.no, scope, st) end
    return undefined("the inline if's condition is false and it has no else")
end

-- ------------------------------------------------------------------ evaluator: statements
-- Scopes are tables chained by __index: a for loop's body runs in a fresh scope per iteration
-- (its sets do not leak, hence namespace()), a macro's in a scope over the one defining it;
-- if bodies share their scope. Output goes to st.out; macros and block sets capture theirs.

local EXEC = {}
local function exec_body(body, scope, st)
    for i = 1, #body do
        point()
        local signal = EXEC[body[i].k](body[i], scope, st)
        if signal then return signal end -- "break" or "continue", up to the loop
    end
end

local function emit(st, s)
    st.work = st.work + #s
    if st.captures == 0 then
        st.size = st.size + #s
        if st.size > _M.MAX_OUTPUT then fail_limit(fmt("the output is longer than MAX_OUTPUT = %d bytes", _M.MAX_OUTPUT)) end
    end
    if st.work > _M.MAX_WORK then fail_limit(fmt("the template built more than MAX_WORK = %d bytes of text", _M.MAX_WORK)) end
    st.n = st.n + 1
    st.out[st.n] = s
end

local function capture(body, scope, st)
    local out, n = st.out, st.n
    st.out, st.n, st.captures = {}, 0, st.captures + 1
    exec_body(body, scope, st)
    local text = concat(st.out, "", 1, st.n)
    st.out, st.n, st.captures = out, n, st.captures - 1
    return text
end

local function assign(target, v, scope)
    v = norm(v)
    if target.k == "name" then
        scope[target.name] = v
    elseif target.k == "attr" then
        local ns = scope[target.name]
        if getmetatable(ns) ~= NAMESPACE then fail("cannot assign attribute on non-namespace object") end
        if ns[target.attr] == nil then local order = ORDER[ns]; order[#order + 1] = target.attr end
        ns[target.attr] = v
    else
        local n = #target.names
        if kind(v) ~= "list" then v = iterable(v) end
        if #v ~= n then
            fail(#v > n and fmt("too many values to unpack (expected %d)", n)
                or fmt("not enough values to unpack (expected %d, got %d)", n, #v))
        end
        for i, name in ipairs(target.names) do scope[name] = norm(v[i]) end
    end
end

EXEC.text = function(s, _, st) emit(st, s.s) end
EXEC.output = function(s, scope, st)
    st.line = s.line
    emit(st, to_str(eval(s.e, scope, st)))
end
EXEC["if"] = function(s, scope, st)
    st.line = s.line
    for i, test in ipairs(s.tests) do
        if truthy(eval(test, scope, st)) then return exec_body(s.bodies[i], scope, st) end
    end
    if s.else_body then return exec_body(s.else_body, scope, st) end
end
EXEC.set = function(s, scope, st)
    st.line = s.line
    assign(s.target, eval(s.e, scope, st), scope)
end
EXEC.setblock = function(s, scope, st)
    st.line = s.line
    -- (its body a scope of its own, as jinja2's: a set inside it stays there)
    assign(s.target, capture(s.body, setmetatable({}, { __index = scope }), st), scope)
end
EXEC.block = function(s, scope, st) -- {% generation %}: transformers' call block, a scope of its own
    return exec_body(s.body, setmetatable({}, { __index = scope }), st)
end
EXEC["break"] = function() return "break" end
EXEC["continue"] = function() return "continue" end

local function tick(st)
    st.iterations = st.iterations + 1
    if st.iterations > _M.MAX_ITERATIONS then
        fail_limit(fmt("more than MAX_ITERATIONS = %d loop iterations", _M.MAX_ITERATIONS))
    end
end

local function cycle(loop, args)
    if #args == 0 then fail("no items for cycling given") end
    return args[(loop.index0 % #args) + 1]
end
-- loop.changed(*values): true at the first call and whenever the values differ from the last
-- call's (state: one per for loop, as jinja2's loop context keeps it)
local function changed(state, args)
    local now = setmetatable({}, TUPLE)
    for i = 1, #args do now[i] = args[i] end
    if state.last and py_eq(state.last, now) then return false end
    state.last = now
    return true
end

EXEC["for"] = function(s, scope, st)
    st.line = s.line
    local items = iterable(eval(s.iter, scope, st))
    local iteration_mt = { __index = scope }
    if s.cond then -- "for x in xs if cond": the loop sees the kept items only (loop.length too)
        local kept = {}
        for _, item in ipairs(items) do
            tick(st)
            local inner = setmetatable({}, iteration_mt)
            assign(s.target, item, inner)
            if truthy(eval(s.cond, inner, st)) then kept[#kept + 1] = item end
        end
        items = kept
    end
    local n = #items
    -- jinja2's else: run where no iteration reached the end of the body (none at all, or each
    -- left by break or continue), in a scope of its own (a set there stays there)
    local reached_end = false
    local changed_state = {}
    for i = 1, n do
        tick(st)
        local inner = setmetatable({}, iteration_mt)
        assign(s.target, items[i], inner)
        local loop = setmetatable({ index = i, index0 = i - 1, first = i == 1, last = i == n, length = n,
                                    revindex = n - i + 1, revindex0 = n - i, depth = 1, depth0 = 0,
                                    previtem = items[i - 1], nextitem = items[i + 1] }, DICT)
        loop.cycle, loop.changed = callable(cycle, loop), callable(changed, changed_state)
        inner.loop = loop
        local left = exec_body(s.body, inner, st)
        if left == "break" then break end
        if left == nil then reached_end = true end
        st.line = s.line
    end
    if not reached_end and s.else_body then return exec_body(s.else_body, setmetatable({}, { __index = scope }), st) end
end

local function call_macro(m, args, kwargs, st)
    local node = m.node
    if #args > #node.params then
        fail(fmt("macro '%s' takes not more than %d argument(s)", node.name, #node.params))
    end
    -- (varargs and kwargs: what jinja2 gives a macro called without extra arguments, () and
    -- {}; extra ones are refused above and below: *args/**kwargs are not supported)
    local scope = setmetatable({ varargs = setmetatable({}, TUPLE), kwargs = _M.dict({}) }, { __index = m.scope })
    for i, param in ipairs(node.params) do
        local v = args[i]
        if v == nil then v = kwargs[param]; kwargs[param] = nil end
        if v == nil and node.defaults[i] then v = eval(node.defaults[i], scope, st) end
        scope[param] = v == nil and undefined(fmt("'%s' is undefined", param)) or v
    end
    local extra = next(kwargs)
    if extra then fail(fmt("macro '%s' takes no keyword argument '%s'", node.name, tostring(extra))) end
    st.depth = st.depth + 1
    if st.depth > _M.MAX_DEPTH then fail(fmt("macro calls nested deeper than MAX_DEPTH = %d", _M.MAX_DEPTH)) end
    local line = st.line
    local text = capture(node.body, scope, st)
    st.depth, st.line = st.depth - 1, line
    return text
end
EXEC.macro = function(s, scope) scope[s.name] = callable(call_macro, { node = s, scope = scope }) end

-- ------------------------------------------------------------------ methods and globals
-- Python's str, dict and list methods that templates call (those the immutable sandbox lets
-- through); each is fn(self, args, kwargs, st).

local function arg(args, kwargs, i, name, default) -- positional i, else keyword name, else default
    local v = args[i]
    if v == nil then v = kwargs[name] end
    if v == nil or v == NONE then return default end
    return v
end
local function str_arg(v, what)
    if type(v) ~= "string" then fail(fmt("%s must be a string, not %s", what, py_type(v))) end
    return v
end
local function int_arg(v, what)
    local n = num(v)
    if not n or n % 1 ~= 0 then fail(fmt("%s must be an integer, not %s", what, py_type(v))) end
    return n
end

-- split's and rsplit's separator: a string, or nil for runs of whitespace (None)
local function separator_or_blanks(sep)
    if sep == NONE then return nil end
    if sep ~= nil and type(sep) ~= "string" then fail(fmt("must be str or None, not %s", py_type(sep))) end
    return sep
end

local function split(s, sep, maxsplit)
    local out = {}
    sep = separator_or_blanks(sep)
    if sep == nil then -- runs of whitespace, none empty
        local pos = 1
        while true do
            local a, b = find(s, NON_BLANKS, pos)
            if not a then break end
            if maxsplit >= 0 and #out == maxsplit then out[#out + 1] = sub(s, a); break end
            out[#out + 1] = sub(s, a, b)
            pos = b + 1
        end
        return out
    end
    if sep == "" then fail("empty separator") end
    local pos = 1
    while maxsplit < 0 or #out < maxsplit do
        local a, b = find(s, sep, pos, true)
        if not a then break end
        out[#out + 1] = sub(s, pos, a - 1)
        pos = b + 1
    end
    out[#out + 1] = sub(s, pos)
    return out
end

local function replace(st, s, old, new, count)
    local parts, pos, n = {}, 1, 0
    if old == "" then -- Python inserts `new` between characters
        parts = chars(s)
        local limit = count and count >= 0 and math.min(count, #parts + 1) or #parts + 1
        for i = 1, limit do parts[i] = new .. (parts[i] or "") end
        return built(st, concat(parts))
    end
    while not count or count < 0 or n < count do
        local a, b = find(s, old, pos, true)
        if not a then break end
        parts[#parts + 1] = sub(s, pos, a - 1)
        parts[#parts + 1] = new
        pos, n = b + 1, n + 1
    end
    parts[#parts + 1] = sub(s, pos)
    return built(st, concat(parts))
end

local function affixes(v) -- startswith/endswith take a string or a tuple of strings
    if type(v) == "string" then return { v } end
    if kind(v) == "list" then return v end
    fail("startswith/endswith first arg must be str or a tuple of str, not " .. py_type(v))
end
local function capitalize(s) return upper(sub(s, 1, 1)) .. lower(sub(s, 2)) end

STR_METHODS.strip = function(s, a, kw) return strip(s, arg(a, kw, 1, "chars")) end
STR_METHODS.lstrip = function(s, a, kw) return strip(s, arg(a, kw, 1, "chars"), true, false) end
STR_METHODS.rstrip = function(s, a, kw) return strip(s, arg(a, kw, 1, "chars"), false, true) end
STR_METHODS.split = function(s, a, kw) return split(s, arg(a, kw, 1, "sep"), int_arg(arg(a, kw, 2, "maxsplit", -1), "maxsplit")) end
STR_METHODS.upper = function(s) return upper(s) end
STR_METHODS.lower = function(s) return lower(s) end
STR_METHODS.capitalize = function(s) return capitalize(s) end
STR_METHODS.title = function(s) return (gsub(s, "%a+", capitalize)) end
-- s[start:stop] in code points, as Python slices it (startswith's and endswith's start and end).
-- s[start:stop] in characters (Python's start/end arguments), and how many come before it.
local function str_between(s, start, stop)
    if (start == nil or start == NONE) and (stop == nil or stop == NONE) then return s, 0 end
    local items = chars(s)
    local len = #items
    local function clamp(i, default)
        if i == nil or i == NONE then return default end
        i = int_arg(i, "start/end")
        if i < 0 then i = i + len end
        return i < 0 and 0 or i > len and len or i
    end
    local from, to = clamp(start, 0), clamp(stop, len)
    return from < to and concat(items, "", from + 1, to) or "", from
end
STR_METHODS.startswith = function(s, a)
    s = str_between(s, a[2], a[3])
    for _, prefix in ipairs(affixes(a[1])) do if sub(s, 1, #str_arg(prefix, "prefix")) == prefix then return true end end
    return false
end
STR_METHODS.endswith = function(s, a)
    s = str_between(s, a[2], a[3])
    for _, suffix in ipairs(affixes(a[1])) do
        if suffix == "" or sub(s, -#str_arg(suffix, "suffix")) == suffix then return true end
    end
    return false
end
STR_METHODS.replace = function(s, a, kw, st)
    return replace(st, s, str_arg(a[1], "old"), str_arg(a[2], "new"), arg(a, kw, 3, "count") and int_arg(a[3], "count"))
end
STR_METHODS.find = function(s, a)
    local needle, before = str_arg(a[1], "sub"), 0
    s, before = str_between(s, a[2], a[3])
    local at = find(s, needle, 1, true)
    return at and before + str_len(sub(s, 1, at - 1)) or -1
end
STR_METHODS.count = function(s, a)
    local needle = str_arg(a[1], "sub")
    s = str_between(s, a[2], a[3])
    if needle == "" then return str_len(s) + 1 end
    local n, pos = 0, 1
    while true do
        local _, b = find(s, needle, pos, true)
        if not b then return n end
        n, pos = n + 1, b + 1
    end
end
-- where needle occurs in s, left to right, overlapping ones too (rsplit, rpartition and rfind
-- take the last ones that do not overlap, as Python scans from the right)
local function occurrences(s, needle)
    local at, pos = {}, 1
    while true do
        local a = find(s, needle, pos, true)
        if not a then return at end
        at[#at + 1], pos = a, a + 1
    end
end
local function last_occurrence(s, needle)
    local at = occurrences(s, needle)
    return at[#at]
end
local function separator(sep)
    if type(sep) ~= "string" then fail(fmt("must be str, not %s", py_type(sep))) end
    if sep == "" then fail("empty separator") end
    return sep
end
-- (built from the end, appended: an insert at the front of each piece was quadratic)
local function reversed(list)
    local n = #list
    for i = 1, math.floor(n / 2) do list[i], list[n + 1 - i] = list[n + 1 - i], list[i] end
    return list
end
local function rsplit(s, sep, maxsplit)
    local out = {}
    sep = separator_or_blanks(sep)
    if sep == nil then -- runs of whitespace from the right; the rest keeps its leading blanks
        local blank = char_set(WHITESPACE)
        local to = #s
        while maxsplit < 0 or #out < maxsplit do
            while to >= 1 and blank[byte(s, to)] do to = to - 1 end
            if to < 1 then break end
            local start = to
            while start > 1 and not blank[byte(s, start - 1)] do start = start - 1 end
            out[#out + 1] = sub(s, start, to)
            to = start - 1
        end
        while to >= 1 and blank[byte(s, to)] do to = to - 1 end
        if to >= 1 then out[#out + 1] = sub(s, 1, to) end
        return reversed(out)
    end
    separator(sep)
    local at, taken, stop = occurrences(s, sep), 0, #s
    for i = #at, 1, -1 do
        if maxsplit >= 0 and taken == maxsplit then break end
        if at[i] + #sep - 1 <= stop then
            out[#out + 1] = sub(s, at[i] + #sep, stop)
            stop, taken = at[i] - 1, taken + 1
        end
    end
    out[#out + 1] = sub(s, 1, stop)
    return reversed(out)
end
-- Python's line boundaries: \n, \r, \r\n, \v, \f, \x1c-\x1e, U+0085, U+2028, U+2029
local LINE_BREAKS = { ["\n"] = 1, ["\r"] = 1, ["\v"] = 1, ["\f"] = 1, ["\28"] = 1, ["\29"] = 1, ["\30"] = 1,
                      ["\194\133"] = 1, ["\226\128\168"] = 1, ["\226\128\169"] = 1 }
local function splitlines(s, keepends)
    local out, line_start, pos = {}, 1, 1
    while pos <= #s do
        local c = s:match("^" .. UTF8_CHAR, pos) or sub(s, pos, pos)
        local next_pos = pos + #c
        if LINE_BREAKS[c] then
            if c == "\r" and sub(s, next_pos, next_pos) == "\n" then next_pos = next_pos + 1 end
            out[#out + 1] = sub(s, line_start, keepends and next_pos - 1 or pos - 1)
            line_start = next_pos
        end
        pos = next_pos
    end
    if line_start <= #s then out[#out + 1] = sub(s, line_start) end
    return out
end
local function tuple(...) return setmetatable({ ... }, TUPLE) end
-- s padded to width characters with fill: Python's ljust, rjust and center (its split of an
-- odd margin: the extra character goes left when the width is odd)
local function pad(s, a, kw, where)
    local width = int_arg(arg(a, kw, 1, "width"), "width")
    local fill = arg(a, kw, 2, "fillchar", " ")
    if type(fill) ~= "string" or str_len(fill) ~= 1 then
        fail("The fill character must be exactly one character long")
    end
    local margin = width - str_len(s)
    if margin <= 0 then return s end
    local left = where == "left" and 0 or where == "right" and margin or floor(margin / 2) + (margin % 2 == 1 and width % 2 == 1 and 1 or 0)
    return rep(fill, left) .. s .. rep(fill, margin - left)
end
-- str.isX: ASCII classes (as case mapping); false for the empty string
local function all_of(class)
    return function(s) return s ~= "" and not find(s, "[^" .. class .. "]") end
end

STR_METHODS.rsplit = function(s, a, kw) return rsplit(s, arg(a, kw, 1, "sep"), int_arg(arg(a, kw, 2, "maxsplit", -1), "maxsplit")) end
STR_METHODS.splitlines = function(s, a, kw) return splitlines(s, truthy(arg(a, kw, 1, "keepends", false))) end
STR_METHODS.partition = function(s, a)
    local sep = separator(a[1])
    local at = find(s, sep, 1, true)
    if not at then return tuple(s, "", "") end
    return tuple(sub(s, 1, at - 1), sep, sub(s, at + #sep))
end
STR_METHODS.rpartition = function(s, a)
    local sep = separator(a[1])
    local at = last_occurrence(s, sep)
    if not at then return tuple("", "", s) end
    return tuple(sub(s, 1, at - 1), sep, sub(s, at + #sep))
end
STR_METHODS.rfind = function(s, a)
    local needle, before = str_arg(a[1], "sub"), 0
    s, before = str_between(s, a[2], a[3])
    if needle == "" then return before + str_len(s) end
    local at = last_occurrence(s, needle)
    return at and before + str_len(sub(s, 1, at - 1)) or -1
end
STR_METHODS.index = function(s, a)
    local at = STR_METHODS.find(s, a)
    if at < 0 then fail("substring not found") end
    return at
end
STR_METHODS.rindex = function(s, a)
    local at = STR_METHODS.rfind(s, a)
    if at < 0 then fail("substring not found") end
    return at
end
STR_METHODS.removeprefix = function(s, a)
    local prefix = str_arg(a[1], "prefix")
    return sub(s, 1, #prefix) == prefix and sub(s, #prefix + 1) or s
end
STR_METHODS.removesuffix = function(s, a)
    local suffix = str_arg(a[1], "suffix")
    return suffix ~= "" and sub(s, -#suffix) == suffix and sub(s, 1, #s - #suffix) or s
end
STR_METHODS.isdigit = all_of("0-9")
STR_METHODS.isdecimal, STR_METHODS.isnumeric = STR_METHODS.isdigit, STR_METHODS.isdigit -- (one set in ASCII)
STR_METHODS.isalpha, STR_METHODS.isalnum = all_of("A-Za-z"), all_of("A-Za-z0-9")
STR_METHODS.isspace = all_of(B)
STR_METHODS.isupper = function(s) return find(s, "%u") ~= nil and not find(s, "%l") end
STR_METHODS.islower = function(s) return find(s, "%l") ~= nil and not find(s, "%u") end
STR_METHODS.istitle = function(s) -- upper case only after an uncased character, lower only after a cased one
    local cased, previous_cased = false, false
    for i = 1, #s do
        local c = sub(s, i, i)
        local is_upper, is_lower = find(c, "%u") ~= nil, find(c, "%l") ~= nil
        if is_upper and previous_cased or is_lower and not previous_cased then return false end
        previous_cased = is_upper or is_lower
        cased = cased or previous_cased
    end
    return cased
end
STR_METHODS.swapcase = function(s) return (gsub(s, "%a", function(c) return find(c, "%u") and lower(c) or upper(c) end)) end
STR_METHODS.casefold = function(s) return lower(s) end
STR_METHODS.ljust = function(s, a, kw) return pad(s, a, kw, "left") end
STR_METHODS.rjust = function(s, a, kw) return pad(s, a, kw, "right") end
STR_METHODS.center = function(s, a, kw) return pad(s, a, kw, "center") end
STR_METHODS.zfill = function(s, a)
    local width = int_arg(a[1], "width")
    local margin = width - str_len(s)
    if margin <= 0 then return s end
    local sign = s:match("^[+-]") or ""
    return sign .. rep("0", margin) .. sub(s, #sign + 1)
end
STR_METHODS.join = function(sep, a, _, st)
    local parts = {}
    for i, item in ipairs(iterable(a[1])) do
        if type(item) ~= "string" then fail(fmt("sequence item %d: expected str instance, %s found", i - 1, py_type(item))) end
        parts[i] = item
    end
    return built(st, concat(parts, sep))
end

local function items_of(d) -- a dict's (key, value) tuples, in sorted key order
    local out = {}
    for i, key in ipairs(dict_keys(d)) do out[i] = setmetatable({ key, norm(d[key]) }, TUPLE) end
    return out
end
DICT_METHODS.items = items_of
DICT_METHODS.keys = function(d) return dict_keys(d) end
DICT_METHODS.values = function(d)
    local out = {}
    for i, key in ipairs(dict_keys(d)) do out[i] = norm(d[key]) end
    return out
end
DICT_METHODS.get = function(d, a)
    local v = d[num(a[1]) or a[1]]
    if v == nil then return a[2] == nil and NONE or a[2] end
    return norm(v)
end

LIST_METHODS.count = function(list, a)
    local n = 0
    for i = 1, #list do if py_eq(list[i], a[1]) then n = n + 1 end end
    return n
end
LIST_METHODS.index = function(list, a)
    local len = #list
    local function bound(i, default) -- Python's start/stop: negative from the end, clamped
        if i == nil or i == NONE then return default end
        i = int_arg(i, "slice index")
        if i < 0 then i = math.max(i + len, 0) end
        return math.min(i, len)
    end
    for i = bound(a[2], 0) + 1, bound(a[3], len) do if py_eq(list[i], a[1]) then return i - 1 end end
    fail(repr(a[1]) .. " is not in list")
end

local GLOBALS = {}
GLOBALS.raise_exception = callable(function(_, a)
    error(setmetatable({ message = to_str(a[1]), raised = true }, ERROR), 0)
end)
GLOBALS.strftime_now = callable(function(_, a) return os.date(str_arg(a[1], "format")) end)
local function copy_into(d, source, order)
    for _, k in ipairs(dict_keys(source)) do
        if d[k] == nil then order[#order + 1] = k end
        d[k] = source[k]
    end
end
local function dict_like(mt)
    return callable(function(_, a, kw)
        local d, order = setmetatable({}, mt), {}
        if kind(a[1]) == "dict" then
            copy_into(d, a[1], order)
        elseif kind(a[1]) == "list" then -- Python's dict of (key, value) pairs
            for i, pair in ipairs(a[1]) do
                if kind(pair) ~= "list" and kind(pair) ~= "string" or #iterable(pair) ~= 2 then
                    fail(fmt("dictionary update sequence element #%d has length %d; 2 is required", i - 1,
                             kind(pair) == "list" and #pair or kind(pair) == "string" and str_len(pair) or 0))
                end
                local key, value = unpack(iterable(pair))
                key = num(key) or key
                if d[key] == nil then order[#order + 1] = key end
                d[key] = value
            end
        elseif a[1] ~= nil then
            fail(fmt("'%s' object is not iterable", py_type(a[1])))
        end
        copy_into(d, kw, order)
        ORDER[d] = order
        return d
    end)
end
GLOBALS.namespace, GLOBALS.dict = dict_like(NAMESPACE), dict_like(DICT)
GLOBALS.range = callable(function(_, a)
    local start, stop, step = 0, int_arg(a[1], "range()'s argument"), 1
    if a[2] then start, stop, step = stop, int_arg(a[2], "stop"), a[3] and int_arg(a[3], "step") or 1 end
    if step == 0 then fail("range() arg 3 must not be zero") end
    local n = math.max(0, math.ceil((stop - start) / step))
    if n > 100000 then fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).") end
    local out = {}
    for i = 1, n do out[i] = start + (i - 1) * step end
    return out
end)

-- ------------------------------------------------------------------ filters
-- FILTERS[name](st, value, args, kwargs): jinja2's built-in filters (and transformers' tojson).

local function attr_path(item, path) -- jinja2's make_attrgetter: "a.b.0", items first
    if type(path) ~= "string" then return getitem(item, path) end
    for part in path:gmatch("[^.]+") do
        -- (a missing part's undefined stays undefined through the parts after it, as jinja2's
        -- getitem gives it: map's default then applies; it raised "no attribute")
        if kind(item) == "undefined" then return item end
        item = getitem(item, tonumber(part) or part)
    end
    return item
end

-- An item's attribute where a filter names one (a false value is the value: `a and b or c`
-- gave the whole item for it, so selectattr kept what it should drop), else the item.
local function attribute_of(item, attribute)
    if attribute == nil then return item end
    return attr_path(item, attribute)
end
local function sort_key(v, case_sensitive)
    if not case_sensitive and type(v) == "string" then return lower(v) end
    return v
end
local function stable_sort(list, key_of, descending) -- Python's sort is stable; table.sort is not
    local keyed = {}
    for i, v in ipairs(list) do keyed[i] = { key = key_of(v), i = i, v = v } end
    sort(keyed, function(a, b)
        if py_lt(a.key, b.key) then return not descending end
        if py_lt(b.key, a.key) then return descending end
        return a.i < b.i
    end)
    local out = {}
    for i, e in ipairs(keyed) do out[i] = e.v end
    return out
end

local function str_filter(f) return function(_, v, a, kw) return f(to_str(v), a, kw) end end
FILTERS.trim = str_filter(function(s, a, kw) return strip(s, arg(a, kw, 1, "chars")) end)
FILTERS.upper, FILTERS.lower = str_filter(upper), str_filter(lower)
FILTERS.capitalize = str_filter(capitalize)
FILTERS.title = str_filter(function(s) -- jinja2's: words begin after whitespace, - ( { [ <
    return (gsub(s, "([^" .. B .. "%-%(%[{<]*)", function(w) return upper(sub(w, 1, 1)) .. lower(sub(w, 2)) end))
end)
FILTERS.string = function(_, v) return to_str(v) end
FILTERS.safe = function(_, v) return v end
FILTERS.length = function(_, v)
    local k = kind(v)
    if k == "string" then return str_len(v) end
    if k == "list" then return #v end
    if k == "dict" then return #dict_keys(v) end
    if k == "undefined" then return 0 end
    fail(fmt("object of type '%s' has no len()", py_type(v)))
end
FILTERS.count = FILTERS.length
FILTERS.first = function(_, v)
    return norm(iterable(v)[1], "No first item, sequence was empty.")
end
FILTERS.last = function(_, v)
    local items = iterable(v)
    return norm(items[#items], "No last item, sequence was empty.")
end
FILTERS.join = function(st, v, a, kw)
    local attribute, parts = arg(a, kw, 2, "attribute"), {}
    for i, item in ipairs(iterable(v)) do parts[i] = to_str(attribute_of(item, attribute)) end
    return built(st, concat(parts, to_str(arg(a, kw, 1, "d", ""))))
end
FILTERS.default = function(_, v, a, kw)
    if kind(v) == "undefined" or (truthy(arg(a, kw, 2, "boolean", false)) and not truthy(v)) then
        local d = a[1]
        if d == nil then d = kw.default_value end
        return d == nil and "" or d
    end
    return v
end
FILTERS.d = FILTERS.default
-- transformers': json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
FILTERS.tojson = function(_, v, a, kw)
    local indent, separators = arg(a, kw, 2, "indent"), arg(a, kw, 3, "separators")
    if type(indent) ~= "string" and indent ~= nil then indent = pad_of(int_arg(indent, "indent")) end
    local o = { ascii = truthy(arg(a, kw, 1, "ensure_ascii", false)), indent = indent,
                item_sep = indent and "," or ", ", key_sep = ": ", sort_keys = truthy(arg(a, kw, 4, "sort_keys", false)) }
    if separators then
        o.item_sep, o.key_sep = str_arg(separators[1], "separators[0]"), str_arg(separators[2], "separators[1]")
    end
    return json(v, o, 0)
end
-- Python's float() of a text: decimal digits, or inf, infinity and nan in any case (LuaJIT's
-- tonumber also reads hex, and not "nan").
local function py_float(s)
    s = strip(s)
    local sign, word = lower(s):match("^([-+]?)(%a+)$")
    if word == "nan" then return 0 / 0 end
    if word == "inf" or word == "infinity" then return sign == "-" and -huge or huge end
    if s:find("%d") and s:match("^[-+]?%d*%.?%d*[eE]?[-+]?%d*$") then return tonumber(s) end
    return nil
end
FILTERS.int = function(_, v, a, kw)
    local default, base = arg(a, kw, 1, "default", 0), int_arg(arg(a, kw, 2, "base", 10), "base")
    local n = num(defined(v))
    if n then return n >= 0 and floor(n) or -floor(-n) end
    if type(v) ~= "string" then return default end
    local s = strip(v):gsub("_", "")
    local sign, digits = s:match("^([-+]?)(%w+)$")
    -- Python's int(s, base): a 0x/0o/0b prefix where it names the base; base 0 reads the base
    -- from it (none: decimal, without a leading zero); a base out of [2, 36] raises, which the
    -- filter catches, as any ValueError, and tries float
    local prefixed = digits and ({ ["0x"] = 16, ["0o"] = 8, ["0b"] = 2 })[lower(sub(digits, 1, 2))]
    if base == 0 and digits then
        if prefixed then base = prefixed
        elseif digits:find("^0+$") or not digits:find("^0") then base = 10
        else digits = nil end
    end
    if base < 2 or base > 36 then digits = nil end
    if digits and prefixed == base then digits = sub(digits, 3) end
    -- (LuaJIT's tonumber in base 10 reads "0x10" as 16: Python's int(s, 10) takes digits only)
    if base == 10 and digits and not digits:find("^%d+$") then digits = nil end
    local n2 = digits and digits ~= "" and tonumber(digits, base)
    if n2 then return sign == "-" and -n2 or n2 end
    n2 = py_float(s) -- (then int(float(value)), as jinja2: a finite one)
    if n2 and n2 == n2 and n2 ~= huge and n2 ~= -huge then return n2 >= 0 and floor(n2) or -floor(-n2) end
    return default
end
FILTERS.float = function(_, v, a, kw)
    local n = num(defined(v)) or (type(v) == "string" and py_float(v))
    if not n then return arg(a, kw, 1, "default", make_num(0, true)) end
    return make_num(n, true)
end
FILTERS.abs = function(st, v) return (num(v) or 0) < 0 and arith(st, "-", 0, v) or arith(st, "+", 0, v) end
-- Python's round(x, n): ties (an exact ...5 in binary) go to the even neighbour; LuaJIT's
-- %f rounds them away from zero, and everything else exactly.
local function round_half_even(x, n)
    local s = fmt("%.99f", x)
    local dot = find(s, ".", 1, true)
    if sub(s, dot + n + 1):match("^50*$") and byte(s, n == 0 and dot - 1 or dot + n) % 2 == 0 then
        return tonumber(sub(s, 1, dot + n)) -- an exact tie after an even digit: truncate
    end
    return tonumber(fmt("%." .. n .. "f", x))
end
FILTERS.round = function(_, v, a, kw)
    local x, is_float = num(defined(v))
    if not x then fail(fmt("type %s doesn't define __round__ method", py_type(v))) end
    local precision, method = int_arg(arg(a, kw, 1, "precision", 0), "precision"), arg(a, kw, 2, "method", "common")
    if method == "common" then -- (Python's round(value, precision): a negative one rounds to tens, ...)
        if precision < 0 then
            local scale = 10 ^ -precision
            local y = x / scale -- (past 10^308 the scale is infinite: every value rounds to 0)
            local whole = floor(y)
            if y - whole > 0.5 or (y - whole == 0.5 and whole % 2 == 1) then whole = whole + 1 end -- (half to even)
            local rounded = whole == 0 and 0 or whole * scale
            if rounded == 0 and x < 0 and is_float then rounded = -0.0 end -- (Python keeps the sign: -0.0)
            return make_num(rounded, is_float)
        end
        if not is_float then return x end
        return make_num(round_half_even(x, precision), true)
    end
    local f = (method == "floor" and floor) or (method == "ceil" and math.ceil)
    if not f then fail("method must be 'common', 'ceil' or 'floor'") end
    return make_num(f(x * 10 ^ precision) / 10 ^ precision, true)
end
FILTERS.list = function(_, v)
    local out = {}
    for i, item in ipairs(iterable(v)) do out[i] = item end
    return out
end
FILTERS.reverse = function(_, v)
    local items, out = kind(v) == "string" and chars(v) or iterable(v), {}
    for i = #items, 1, -1 do out[#out + 1] = items[i] end
    return type(v) == "string" and concat(out) or out
end
FILTERS.replace = function(st, v, a, kw)
    return replace(st, to_str(v), to_str(a[1]), to_str(a[2]), arg(a, kw, 3, "count") and int_arg(a[3], "count"))
end
FILTERS.items = function(_, v)
    local k = kind(v)
    if k == "undefined" then return {} end
    if k ~= "dict" then fail("Can only get item pairs from a mapping.") end
    return items_of(v)
end
FILTERS.dictsort = function(_, v, a, kw)
    if kind(v) ~= "dict" then fail("dictsort: value must be a dict") end
    local case_sensitive, by = truthy(arg(a, kw, 1, "case_sensitive", false)), arg(a, kw, 2, "by", "key")
    local pos = by == "key" and 1 or by == "value" and 2 or fail("You can only sort by either 'key' or 'value'")
    return stable_sort(items_of(v), function(pair) return sort_key(pair[pos], case_sensitive) end,
        truthy(arg(a, kw, 3, "reverse", false)))
end
FILTERS.sort = function(_, v, a, kw)
    local case_sensitive, attribute = truthy(arg(a, kw, 2, "case_sensitive", false)), arg(a, kw, 3, "attribute")
    return stable_sort(iterable(v), function(item)
        return sort_key(attribute_of(item, attribute), case_sensitive)
    end, truthy(arg(a, kw, 1, "reverse", false)))
end
FILTERS.unique = function(_, v, a, kw)
    local case_sensitive, attribute = truthy(arg(a, kw, 1, "case_sensitive", false)), arg(a, kw, 2, "attribute")
    local out, seen = {}, {}
    for _, item in ipairs(iterable(v)) do
        local key, new = sort_key(attribute_of(item, attribute), case_sensitive), true
        for _, s in ipairs(seen) do if py_eq(s, key) then new = false; break end end
        if new then seen[#seen + 1] = key; out[#out + 1] = item end
    end
    return out
end
local function extreme(want_max)
    return function(_, v, a, kw)
        local case_sensitive, attribute = truthy(arg(a, kw, 1, "case_sensitive", false)), arg(a, kw, 2, "attribute")
        local best, best_key
        for _, item in ipairs(iterable(v)) do
            local key = sort_key(attribute_of(item, attribute), case_sensitive)
            if best == nil or (want_max and py_lt(best_key, key) or not want_max and py_lt(key, best_key)) then
                best, best_key = item, key
            end
        end
        return norm(best, "No aggregated item, sequence was empty.")
    end
end
FILTERS.min, FILTERS.max = extreme(false), extreme(true)
FILTERS.sum = function(st, v, a, kw)
    local attribute, total = arg(a, kw, 1, "attribute"), arg(a, kw, 2, "start", 0)
    for _, item in ipairs(iterable(v)) do total = arith(st, "+", total, attribute_of(item, attribute)) end
    return total
end
FILTERS.indent = function(st, v, a, kw) -- jinja2's: lines after the first, blank ones too only if blank=true
    local width = arg(a, kw, 1, "width", 4)
    local pad = type(width) == "string" and width or pad_of(int_arg(width, "width"))
    local first, blank = truthy(arg(a, kw, 2, "first", false)), truthy(arg(a, kw, 3, "blank", false))
    -- (jinja2 appends a newline and splits lines: the text's own lines, a trailing empty one
    -- kept where the text ends with a newline, which the join then writes back)
    local lines = split(gsub(to_str(v), "\r\n?", "\n"), "\n", -1)
    for i = 2, #lines do if blank or lines[i] ~= "" then lines[i] = pad .. lines[i] end end
    return built(st, (first and pad or "") .. concat(lines, "\n"))
end

-- select/reject(test, args...) and selectattr/rejectattr(attribute, test, args...)
local function selector(keep, by_attribute)
    return function(_, v, a)
        local first = by_attribute and 2 or 1
        local test_args = { select(first + 1, unpack(a)) }
        local out = {}
        for _, item in ipairs(iterable(v)) do
            local x = attribute_of(item, by_attribute and a[1] or nil)
            local pass
            if a[first] == nil then pass = truthy(x) else pass = run_test(a[first], x, test_args) end
            if pass == keep then out[#out + 1] = item end
        end
        return out
    end
end
FILTERS.select, FILTERS.reject = selector(true, false), selector(false, false)
FILTERS.selectattr, FILTERS.rejectattr = selector(true, true), selector(false, true)
FILTERS.map = function(st, v, a, kw)
    local out = {}
    for i, item in ipairs(iterable(v)) do
        if kw.attribute ~= nil then
            local x = attr_path(item, kw.attribute)
            if kind(x) == "undefined" and kw.default ~= nil then x = kw.default end
            out[i] = x
        else
            local f = FILTERS[a[1]]
            if not f then fail(fmt("No filter named %s.", repr(a[1]))) end
            out[i] = f(st, item, { select(2, unpack(a)) }, kw)
        end
    end
    return out
end

-- ------------------------------------------------------------------ tests
-- TESTS[name](value, first argument, arguments) -> boolean, as jinja2's.

local function is_int(v) return type(v) == "number" and v % 1 == 0 end
TESTS.defined = function(v) return kind(v) ~= "undefined" end
TESTS.undefined = function(v) return kind(v) == "undefined" end
TESTS.none = function(v) return v == NONE end
TESTS.string = function(v) return type(v) == "string" end
TESTS.number = function(v) return num(v) ~= nil end
TESTS.integer = is_int
TESTS.float = function(v) return num(v) ~= nil and type(v) ~= "boolean" and not is_int(v) end
TESTS.boolean = function(v) return type(v) == "boolean" end
TESTS["true"] = function(v) return v == true end
TESTS["false"] = function(v) return v == false end
TESTS.mapping = function(v) return kind(v) == "dict" end
TESTS.iterable = function(v) local k = kind(v) return k == "list" or k == "dict" or k == "string" or k == "undefined" end
TESTS.sequence = TESTS.iterable -- (jinja2's Undefined has a length and items, too)
TESTS.callable = function(v) local k = kind(v) return k == "callable" or k == "undefined" end
TESTS.sameas = function(v, x) return v == x end
TESTS.equalto = function(v, x) return py_eq(v, x) end
TESTS.ne = COMPARE["!="]
TESTS.lt, TESTS.le, TESTS.gt, TESTS.ge = COMPARE["<"], COMPARE["<="], COMPARE[">"], COMPARE[">="]
-- (jinja2's test table names the operators too: select(">", 1), selectattr("x", "==", v))
for alias, name in pairs({ eq = "equalto", greaterthan = "gt", lessthan = "lt", ["=="] = "equalto", ["!="] = "ne",
                           [">"] = "gt", [">="] = "ge", ["<"] = "lt", ["<="] = "le" }) do
    TESTS[alias] = TESTS[name]
end
TESTS["in"] = py_in
local function number(v, what)
    local x = num(defined(v))
    if not x then fail(fmt("%s must be a number, not %s", what, py_type(v))) end
    return x
end
TESTS.odd = function(v) return number(v, "odd's value") % 2 == 1 end
TESTS.even = function(v) return number(v, "even's value") % 2 == 0 end
TESTS.divisibleby = function(v, n)
    local divisor = number(n, "divisibleby's argument")
    if divisor == 0 then fail("integer division or modulo by zero (divisibleby 0)") end -- (Python's ZeroDivisionError)
    return number(v, "divisibleby's value") % divisor == 0
end
-- Python's str.islower/isupper: some cased letter, none of the other case
TESTS.lower = function(v) local s = to_str(v) return lower(s) == s and find(s, "%l") ~= nil end
TESTS.upper = function(v) local s = to_str(v) return upper(s) == s and find(s, "%u") ~= nil end

-- ------------------------------------------------------------------ API

local Template = {}
Template.__index = Template

-- map_strings(value, fn) -> value as a template reads it, with each string in it fn(string),
-- keys too (tojson prints a tool's property names): tables copied with their kind (metatable)
-- and a dict's key order; numbers, booleans, None as they are. fn must give distinct strings
-- distinct results. (tinyloop.chat marks the text users wrote with it.)
function _M.map_strings(value, fn, copies)
    point()
    local kind = type(value)
    if kind == "string" then return fn(value) end
    if kind ~= "table" then return value end
    local mt = getmetatable(value)
    if mt == FLOAT or mt == UNDEF or mt == CALLABLE then return value end
    copies = copies or {}
    local copy = copies[value]
    if copy then return copy end -- (a table met twice, or a cycle: one copy)
    copy = {}
    copies[value] = copy
    local map, renamed = _M.map_strings, false
    for k, v in pairs(value) do
        local key = k
        if type(k) == "string" then
            key = fn(k)
            renamed = renamed or key ~= k
        end
        copy[key] = map(v, fn, copies)
    end
    -- (the copy iterates as the value does: a dict without an order iterates sorted, where a
    -- changed key could sort elsewhere; dictsort still sorts the changed keys)
    local order = ORDER[value] or (renamed and dict_keys(value))
    if order then
        local keys = {}
        for i, k in ipairs(order) do keys[i] = type(k) == "string" and fn(k) or k end
        ORDER[copy] = keys
    end
    return setmetatable(copy, mt)
end

-- compile(source) -> template | nil, "chat template: line N: ..."
function _M.compile(source)
    if type(source) ~= "string" then return nil, "chat template: the source must be a string, not " .. type(source) end
    local ok, result = pcall(function()
        local p = setmetatable({ tokens = lex(source), i = 1, loops = 0, depth = 0 }, P)
        return parse_body(p, nil)
    end)
    if ok then return setmetatable({ body = result, source = source }, Template) end
    -- (a Lua error string, which only a bug can give, has neither .line nor .message)
    return nil, fmt("chat template: line %s: %s", result.line or "?", result.message or tostring(result))
end

-- ------------------------------------------------------------------ content format
-- template:content_format() -> "openai" where the template reads a message's content as a
-- list of parts (it loops over message['content'], or over a variable named content), else
-- "string": vLLM's detection on the template's syntax tree (chat_utils' _detect_content_format),
-- to the letter. A chat request hands such a template its messages' content as text parts
-- (tinyloop.chat), as vLLM does; a "string" template gets the parts' text joined.

-- Every node of kind `kind` in the tree below `node` (in no particular order).
local function nodes_of(node, kind, out)
    out = out or {}
    if node.k == kind then out[#out + 1] = node end
    for _, v in pairs(node) do if type(v) == "table" then nodes_of(v, kind, out) end end
    return out
end

-- Whether `e` reads the variable `name` (key nil) or its item or attribute `key`, through
-- filters, tests and slices ("messages[1:]", "message['content'] | list").
local function reads(e, name, key)
    if type(e) ~= "table" then return false end
    if e.k == "filter" or e.k == "test" or e.k == "slice" then return reads(e.obj, name, key) end
    if not key then return e.k == "name" and e.name == name end
    local of = e.obj
    if type(of) ~= "table" or of.k ~= "name" or of.name ~= name then return false end
    if e.k == "attr" then return e.name == key end
    return e.k == "item" and e.key.k == "const" and e.key.v == key
end

function Template:content_format()
    if self.format then return self.format end
    local loops, sets = nodes_of({ self.body }, "for"), nodes_of({ self.body }, "set")
    -- the names that hold the messages: messages, and what a {% set %} takes from one of them
    local holders, queue, seen = { "messages" }, { "messages" }, { messages = true }
    while #queue > 0 do
        local name = table.remove(queue, 1)
        for _, set in ipairs(sets) do
            if set.target.k == "name" and reads(set.e, name) and not seen[set.target.name] then
                seen[set.target.name] = true
                holders[#holders + 1], queue[#queue + 1] = set.target.name, set.target.name
            end
        end
    end
    -- a message's name: the target of a loop over one of them
    local message_names = {}
    for _, loop in ipairs(loops) do
        for _, holder in ipairs(holders) do
            if loop.target.k == "name" and reads(loop.iter, holder) then message_names[#message_names + 1] = loop.target.name break end
        end
    end
    self.format = "string"
    for _, loop in ipairs(loops) do
        if loop.target.k == "name" then
            if loop.iter.k == "name" and loop.iter.name == "content" then self.format = "openai" end
            for _, name in ipairs(message_names) do
                if reads(loop.iter, name, "content") then self.format = "openai" end
            end
        end
    end
    return self.format
end

local ROOT_MT = { __index = GLOBALS }

-- is_global(name) -> whether the renderer itself defines `name` (raise_exception, namespace,
-- range...): a variable of that name would hide it from the template.
function _M.is_global(name) return GLOBALS[name] ~= nil end

-- template:render(vars) -> text | nil, err, kind: "raised" (err is raise_exception's message as
-- the template gave it: the template refuses its input), "limit" (a bound was passed: the
-- input asked for too much) or "template" (the template cannot run here: a missing filter, a
-- type error...).
function Template:render(vars)
    if vars ~= nil and type(vars) ~= "table" then return nil, "chat template: vars must be a table" end
    local root = setmetatable({}, ROOT_MT)
    for k, v in pairs(vars or {}) do root[k] = norm(v) end
    local st = { out = {}, n = 0, size = 0, work = 0, captures = 0, depth = 0, iterations = 0, line = 1 }
    local ok, err = pcall(exec_body, self.body, root, st)
    if ok then return concat(st.out, "", 1, st.n) end
    if getmetatable(err) == ERROR then
        if err.raised then return nil, err.message, "raised" end
        return nil, fmt("chat template: line %d: %s", st.line, err.message), err.limit and "limit" or "template"
    end
    return nil, fmt("chat template: line %d: %s", st.line, tostring(err)), "template"
end

return _M

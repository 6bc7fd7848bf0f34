-- helpers.lua: shared fixtures of the busted specs (tests/lua/*_spec.lua).
-- Paths are absolute (derived from this file's location), so the specs do not depend on
-- the directory busted runs from.
local H = {}

local function abspath(p)
    if p:sub(1, 1) == "/" then return p end
    local pwd = os.getenv("PWD")
    if not pwd then
        local f = io.popen("pwd")
        pwd = f:read("*l")
        f:close()
    end
    return pwd .. "/" .. p
end

local src = debug.getinfo(1, "S").source:sub(2)
local dir = src:match("^(.*)/[^/]*$") or "."
H.ROOT = abspath(dir .. "/../..")
H.TEXTMODEL = H.ROOT .. "/tests/data/textmodel"
H.GOLDEN = H.ROOT .. "/tests/data/golden"

package.path = H.ROOT .. "/lua/?.lua;" .. H.ROOT .. "/lua/?/init.lua;" .. package.path
H.tinyloop = require "tinyloop"

-- A file's bytes.
function H.read(path)
    local f = assert(io.open(path, "rb"))
    local s = f:read("*a")
    f:close()
    return s
end

-- A path (or any text) as one shell word: the repository's path may hold blanks or quotes.
function H.q(text) return "'" .. text:gsub("'", "'\\''") .. "'" end

-- A shell command's standard output.
function H.sh(cmd)
    local p = assert(io.popen(cmd))
    local out = p:read("*a")
    p:close()
    return out
end

local cache = {}
-- A loaded model (one per directory and process; one worker thread, the machine is shared).
function H.model(name)
    local path = name and (H.GOLDEN .. "/" .. name) or H.TEXTMODEL
    if not cache[path] then cache[path] = assert(H.tinyloop.load(path, { threads = 1 })) end
    return cache[path]
end

-- The textmodel's eos id (also its only special token).
H.EOS = 319

-- A logits_processor that forces seq[k] as the k-th generated token (then leaves the logits
-- alone): deterministic generation whatever the weights are.
function H.forcer(seq, prompt_len)
    return function(logits, vocab, tokens)
        local id = seq[#tokens - prompt_len + 1]
        if id then logits[id] = 1e9 end
    end
end

-- fn() must raise an error whose message contains needle (plain text, not a pattern).
function H.error_contains(fn, needle)
    local ok, err = pcall(fn)
    assert(not ok, "expected an error containing: " .. needle)
    assert(tostring(err):find(needle, 1, true), ("error %q does not contain %q"):format(tostring(err), needle))
end

function H.slice(t, i, j)
    local r = {}
    for k = i, j or #t do r[#r + 1] = t[k] end
    return r
end

function H.copy(t)
    local r = {}
    for k = 1, #t do r[k] = t[k] end
    return r
end

function H.without(t, id)
    local r = {}
    for k = 1, #t do if t[k] ~= id then r[#r + 1] = t[k] end end
    return r
end

-- Resident set size of this process, in KiB.
function H.rss_kb()
    local f = assert(io.open("/proc/self/statm"))
    local _, resident = f:read("*n", "*n")
    f:close()
    return resident * 4 -- pages of 4 KiB (x86-64 Linux)
end

function H.full_gc()
    collectgarbage("collect")
    collectgarbage("collect")
end

-- Runs `code` (a Lua chunk) in a child luajit process whose package.path finds the module
-- and helpers; returns ok (exit status 0), the combined stdout+stderr. A crash or a LuaJIT
-- panic in the child shows up as ok == false instead of killing busted.
function H.run_child(code, env)
    local path = os.tmpname()
    local f = assert(io.open(path, "wb"))
    f:write("package.path = ", ("%q"):format(H.ROOT .. "/tests/lua/?.lua;" .. package.path), "\n")
    f:write("io.stdout:setvbuf('no')\n")
    f:write(code)
    f:close()
    local p = assert(io.popen((env or "") .. " luajit " .. path .. " 2>&1; echo \"__exit=$?\""))
    local out = p:read("*a")
    p:close()
    os.remove(path)
    local status = tonumber(out:match("__exit=(%d+)%s*$"))
    return status == 0, out:gsub("__exit=%d+%s*$", ""), status
end

-- H.text_scanned(fn, ...) -> the bytes of JSON text that json_text's container scans were given
-- while fn(...) ran (a measure of parsing work that time cannot blur), and fn's first result.
function H.text_scanned(fn, ...)
    local json_text = require "tinyloop.json_text"
    local entries, scanned = json_text.entries, 0
    json_text.entries = function(text, i)
        scanned = scanned + #text - i + 1
        return entries(text, i)
    end
    local ok, result = pcall(fn, ...)
    json_text.entries = entries
    assert(ok, result)
    return scanned, result
end

-- H.refuses(convert, cases): each case {body, param, words} is refused by convert(body) ->
-- nil, err: a 4xx (404 where param is "model", else 400) naming `param`, its message holding
-- `words`.
function H.refuses(convert, cases)
    local assert = require "luassert" -- (busted's assert is the specs' global, not this module's)
    for _, case in ipairs(cases) do
        local body, err = convert(case[1])
        assert.is_nil(body, case[1])
        assert.equal(case[2] == "model" and 404 or 400, err.status, case[1])
        assert.equal(case[2], err.param, case[1])
        assert.truthy(err.message:find(case[3], 1, true), case[1] .. " -> " .. err.message)
    end
end

-- H.mutated(request, seed, words) -> the JSON text of `request` (a valid request as a Lua
-- table) with one random place changed: a walk from the top picks a member or element, and
-- its value becomes a random one (an object keyed by `words`, an array, a string, often one of
-- `words`, a number, a boolean or null) or is left out. Deep paths of a parser are reached
-- this way, which random text rarely gets past the top-level checks to. Same seed, same text.
function H.mutated(request, seed, words)
    local cjson = require "cjson"
    local state = seed
    local function rand(n) -- a small LCG: the sequence is the seed's, whatever math.random is
        state = (state * 1103515245 + 12345) % 2147483648
        return math.floor(state / 65536) % n + 1 -- (the high bits: an LCG's low ones cycle short)
    end
    local function value(level)
        local kind = rand(level >= 3 and 5 or 7)
        if kind == 1 then return cjson.null end
        if kind == 2 then return rand(2) == 1 end
        if kind == 3 then return ({ 0, -1, 3, 1.5, 1e300, 4096, 2 ^ 60 })[rand(7)] end
        if kind <= 5 then return rand(4) == 1 and "" or words[rand(#words)] end
        local t = {}
        if kind == 6 then
            for i = 1, rand(3) - 1 do t[i] = value(level + 1) end
        else
            for _ = 1, rand(4) - 1 do t[words[rand(#words)]] = value(level + 1) end
        end
        return t
    end
    local function copy(v)
        if type(v) ~= "table" then return v end
        local out = {}
        for k, x in pairs(v) do out[k] = copy(x) end
        return out
    end
    local top = copy(request)
    local at = top
    while true do
        local keys = {}
        for k in pairs(at) do keys[#keys + 1] = k end
        table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
        if #keys == 0 then break end
        local k = keys[rand(#keys)]
        if type(at[k]) == "table" and rand(3) > 1 then
            at = at[k]
        else
            if rand(6) == 1 then at[k] = nil else at[k] = value(1) end
            break
        end
    end
    return cjson.encode(top)
end

return H

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

return H

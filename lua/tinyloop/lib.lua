-- tinyloop.lib: the engine's C declarations (tinyloop.cdef, generated from tinyloop.h) and
-- libtinyloop itself, loaded; returns the library's namespace (C). tinyloop and
-- tinyloop.grammar require it, so either loads on its own.
--
-- Where the library is found: $TINYLOOP_LIB where set (an explicit choice: where it cannot be
-- loaded, that is the error, not a quiet fall back to another build: an ASan run that named a
-- missing build-asan library tested the plain one), else the build tree beside this checkout,
-- else the dynamic linker's search ("tinyloop": an installed libtinyloop.so).
local ffi = require "tinyloop.ffi"

-- Declared once a Lua VM: a second load of these modules (a hot reload that cleared
-- package.loaded, require "tinyloop.init") met "attempt to redefine 'tl_status'", and every
-- later require of tinyloop failed.
if not pcall(ffi.typeof, "tl_status") then ffi.cdef(require "tinyloop.cdef") end

local override = os.getenv("TINYLOOP_LIB")
if override and override ~= "" then
    local ok, lib = pcall(ffi.load, override)
    if not ok then error("tinyloop: cannot load TINYLOOP_LIB=" .. override .. ": " .. tostring(lib), 0) end
    return lib
end
local here = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "."
local errors = {}
for _, name in ipairs({ here .. "/../../build/libtinyloop.so", "tinyloop" }) do
    local ok, lib = pcall(ffi.load, name)
    if ok then return lib end
    errors[#errors + 1] = tostring(lib)
end
error("tinyloop: cannot load libtinyloop (build it, or set TINYLOOP_LIB): " .. table.concat(errors, "; "), 0)

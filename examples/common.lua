-- common.lua: shared setup of the examples: the module path and the model to use
-- (first argument, else the shipped model).
-- (the repository from the example's real path, wherever it is run from; the example finds
-- this file beside itself)
local ffi = require "ffi"
pcall(ffi.cdef, "char *realpath(const char *path, char *resolved);")
local resolved = ffi.new("char[4096]")
local script = ffi.C.realpath(arg[0], resolved) ~= nil and ffi.string(resolved) or arg[0]
local root = (script:match("^(.*)/examples/[^/]*$")) or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local tinyloop = require "tinyloop"
local dir = arg[1] or (root .. "/models/tinyloop-austen")
local model, err = tinyloop.load(dir)
if not model then -- (a plain message, not assert's traceback)
    io.stderr:write(arg[0], ": ", err, "\n")
    os.exit(1)
end
return { tinyloop = tinyloop, model = model, dir = dir, policy = require "tinyloop.policy" }

-- common.lua: shared setup of the examples: the module path and the model to use
-- (first argument, else the shipped model).
local root = (arg[0]:match("^(.*)/examples/[^/]*$")) or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local tinyloop = require "tinyloop"
local dir = arg[1] or (root .. "/models/tinyloop-austen")
local model = assert(tinyloop.load(dir))
return { tinyloop = tinyloop, model = model, dir = dir, policy = require "tinyloop.policy" }

-- cdef_spec.lua: the FFI declarations (lua/tinyloop/cdef.lua) are exactly what
-- scripts/gen_cdef.lua renders from engine/include/tinyloop.h, so they cannot drift from the
-- header. After changing the header: `luajit scripts/gen_cdef.lua` from the repository root.
local H = require "helpers"
local ffi = require "ffi"

local HEADER = H.ROOT .. "/engine/include/tinyloop.h"
local CDEF = H.ROOT .. "/lua/tinyloop/cdef.lua"

local read = H.read

-- The script returns { render = render } when its chunk is run with "tinyloop.gen_cdef" as
-- its first vararg (as `require "tinyloop.gen_cdef"` would), instead of writing the file.
local function generator()
    local chunk = assert(loadfile(H.ROOT .. "/scripts/gen_cdef.lua"))
    local gen = chunk("tinyloop.gen_cdef")
    assert.is_table(gen)
    assert.is_function(gen.render)
    return gen
end

describe("lua/tinyloop/cdef.lua", function()
    it("equals what scripts/gen_cdef.lua renders from engine/include/tinyloop.h", function()
        local rendered = generator().render(HEADER)
        local committed = read(CDEF)
        if rendered ~= committed then
            -- point at the first differing line
            local n = 1
            local r_lines, c_lines = {}, {}
            for l in (rendered .. "\n"):gmatch("([^\n]*)\n") do r_lines[#r_lines + 1] = l end
            for l in (committed .. "\n"):gmatch("([^\n]*)\n") do c_lines[#c_lines + 1] = l end
            while r_lines[n] == c_lines[n] do n = n + 1 end
            assert.is_true(false, ("cdef.lua is stale (run `luajit scripts/gen_cdef.lua`): line %d is\n  %s\nbut the header gives\n  %s")
                :format(n, tostring(c_lines[n]), tostring(r_lines[n])))
        end
    end)

    it("is what require 'tinyloop.cdef' returns", function()
        assert.equal(assert(loadfile(CDEF))(), require("tinyloop.cdef"))
    end)

    it("detects a change of the header (the comparison is not vacuous)", function()
        local tmp = os.tmpname()
        local f = assert(io.open(tmp, "wb"))
        f:write((read(HEADER):gsub("int max_tokens;", "int max_tokens_renamed;", 1)))
        f:close()
        local rendered = generator().render(tmp)
        os.remove(tmp)
        assert.are_not.equal(read(CDEF), rendered)
        assert.truthy(rendered:find("max_tokens_renamed", 1, true))
    end)

    it("declares only functions the library exports", function()
        local C = H.tinyloop.C
        local names = {}
        for name in require("tinyloop.cdef"):gmatch("[%s%*](tl_[%w_]+)%s*%(") do names[name] = true end
        local n = 0
        for name in pairs(names) do
            n = n + 1
            local ok, err = pcall(function() return C[name] end)
            assert.is_true(ok, name .. ": " .. tostring(err))
        end
        assert.is_true(n >= 20, "found only " .. n .. " functions")
        assert.equal("TL_ERR_FORMAT", ffi.string(C.tl_status_name(C.TL_ERR_FORMAT)))
        assert.equal("GRAMMAR_DEAD_END", ffi.string(C.tl_stop_reason_name(C.TL_STOP_GRAMMAR_DEAD_END)))
    end)
end)

-- tinyloop.ffi: the LuaJIT FFI, which every tinyloop module is built on (they require it
-- through here). Under another Lua (PUC Lua 5.1-5.4 has no FFI, and /usr/bin/lua, which
-- /usr/bin/busted runs under, is one) requiring any of them stops with a message saying what
-- to run instead, not "module 'ffi' not found" and a list of searched paths.
local found, ffi = pcall(require, "ffi")
if not found then
    error("tinyloop needs LuaJIT (it is built on LuaJIT's FFI), and this is " .. _VERSION ..
          " without one: run it with luajit, under OpenResty or nginx's lua module, or" ..
          " busted with --lua=luajit (the repository's .busted does that)", 0)
end
return ffi

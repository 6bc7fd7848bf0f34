#!/usr/bin/env luajit
-- burst_memory.lua: a benchmark (not a test) of the memory a model keeps after a burst of
-- sessions: rounds of N sessions alive at once (a prompt of L tokens, one step each), then all
-- closed; prints the process's resident memory with them alive and after, beside
-- model:memory()'s K/V figures. The CPU backend gives freed memory back to the system past its
-- spares (engine/src/cpu/cpu_arena.c): after each round, the resident memory falls back near the
-- weights plus the model's spares (64 MiB of K/V pages, 16 MiB of other buffers).
--   luajit scripts/bench/burst_memory.lua [--model DIR] [--sessions 300,50,300] [--prompt-len 100] [--threads 1]
local root = (arg[0]:match("^(.*)/scripts/bench/[^/]*$")) or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local decimal = require("tinyloop.script_options").decimal

local USAGE = "usage: luajit scripts/bench/burst_memory.lua [--model DIR] [--sessions N,N,...] [--prompt-len L] [--threads T]"
local model_dir, rounds, prompt_len, threads = root .. "/models/tinyloop-austen", { 300, 50, 300 }, 100, 1
local i = 1
while i <= #arg do
    local a, v = arg[i], arg[i + 1]
    local n = v and decimal(v)
    if a == "--model" and v then model_dir = v
    elseif a == "--sessions" and v and v:match("^%d+[%d,]*$") then
        rounds = {}
        for count in v:gmatch("%d+") do rounds[#rounds + 1] = tonumber(count) end
    elseif a == "--prompt-len" and n and n >= 1 and n == math.floor(n) then prompt_len = n
    elseif a == "--threads" and n and n >= 1 and n == math.floor(n) then threads = n
    else
        io.stderr:write(USAGE, "\n")
        os.exit(2)
    end
    i = i + 2
end

local tinyloop = require "tinyloop"
local function resident_mb()
    local f = assert(io.open("/proc/self/statm"))
    local line = f:read("*l")
    f:close()
    return tonumber(line:match("^%d+ (%d+)")) * 4096 / 1048576
end

local model, err = tinyloop.load(model_dir, { threads = threads })
if not model then
    io.stderr:write("burst_memory: ", tostring(err), "\n")
    os.exit(1)
end
local info = model:info()
if prompt_len + 1 > info.max_seq_len then
    io.stderr:write(("burst_memory: --prompt-len %d leaves no room in the context of %d\n"):format(prompt_len, info.max_seq_len))
    os.exit(2)
end
local prompt = {}
for k = 1, prompt_len do prompt[k] = k % (info.vocab_size - 1) end
local function mb(bytes) return bytes / 1048576 end
print(("model      %s, %d threads, prompts of %d tokens; resident after the load %.1f MB"):format(model_dir, threads,
    prompt_len, resident_mb()))
print("round  sessions |  alive: resident  kv_bytes |  closed: resident  kv_bytes  kv_spare_bytes   (MB)")
for r, count in ipairs(rounds) do
    local sessions = {}
    for k = 1, count do
        sessions[k] = model:session(prompt, { max_tokens = 4 })
        sessions[k]:step()
    end
    local alive, alive_kv = resident_mb(), mb(model:memory().kv_bytes)
    for k = 1, count do sessions[k]:close() end
    sessions = nil
    collectgarbage()
    collectgarbage()
    local mem = model:memory()
    print(("%5d  %8d | %16.1f %9.1f | %17.1f %9.1f %15.1f"):format(r, count, alive, alive_kv, resident_mb(), mb(mem.kv_bytes),
        mb(mem.kv_spare_bytes)))
end
model:close()

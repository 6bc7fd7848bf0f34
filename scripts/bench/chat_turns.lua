#!/usr/bin/env luajit
-- chat_turns.lua: a benchmark (not a test) of a served conversation: turns of
-- POST /v1/chat/completions, each resending the conversation so far, streamed; prints each
-- turn's prompt tokens, how many the server's prefix pool served (usage's cached_tokens) and
-- the time to first token as the client sees it. Run it against `scripts/serve` and again
-- against `scripts/serve --prefix-pool-mb 0` to compare. The system message is a sentence
-- of 19 tokens (GPT-2's tokenizer; the shipped model's ~25) times --system-repeat: the
-- default (2) fits the shipped model's 256-token context; the README's figure is a GPT-2-sized
-- checkpoint's (1024 tokens) at --system-repeat 24.
--   luajit scripts/bench/chat_turns.lua [--url http://127.0.0.1:8080] [--turns 4] [--system-repeat 2]
local root = (arg[0]:match("^(.*)/scripts/bench/[^/]*$")) or "."
package.path = root .. "/lua/?.lua;" .. package.path
local cjson = require "cjson"
local ffi = require "ffi"
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } chat_turns_timespec;
int clock_gettime(int clock_id, chat_turns_timespec *tp);
]]
local ts = ffi.new("chat_turns_timespec")
local function now() -- CLOCK_MONOTONIC, seconds
    ffi.C.clock_gettime(1, ts)
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

local url, turns, repeats = "http://127.0.0.1:8080", 4, 2
local i = 1
while i <= #arg do
    local a, v = arg[i], arg[i + 1]
    if a == "--url" and v then url = v
    elseif a == "--turns" and tonumber(v) then turns = tonumber(v)
    elseif a == "--system-repeat" and tonumber(v) then repeats = tonumber(v)
    else
        io.stderr:write("usage: luajit scripts/bench/chat_turns.lua [--url URL] [--turns N] [--system-repeat N]\n")
        os.exit(a == "-h" or a == "--help" and 0 or 2)
    end
    i = i + 2
end

local QUESTIONS = { "Who is Mr. Knightley?", "And Harriet Smith?", "Will Emma marry?", "Where is Hartfield?",
                    "Who is Mrs. Elton?", "What does Mr. Woodhouse fear?" }
local system = ("Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, "):rep(repeats)
local messages = { { role = "system", content = system } }
local function quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end
local function fail(message)
    io.stderr:write("chat_turns: ", message, "\n")
    os.exit(1)
end
-- The request body goes through a file: a long conversation would not fit a command line.
local body_file = os.tmpname()

for turn = 1, turns do
    messages[#messages + 1] = { role = "user", content = QUESTIONS[(turn - 1) % #QUESTIONS + 1] }
    local body = cjson.encode({ messages = messages, max_tokens = 16, ignore_eos = true, stream = true,
                                stream_options = { include_usage = true } })
    -- curl (-N) writes each event as it comes, and a line is read here as soon as it is
    -- written: the first chunk with a choice is the client's first token (curl's start
    -- included, a few ms)
    local f = assert(io.open(body_file, "wb"))
    f:write(body)
    f:close()
    local cmd = ("curl -sSN -H 'Content-Type: application/json' --data-binary @%s %s/v1/chat/completions 2>&1"):format(
        quote(body_file), url)
    local started = now()
    local p = assert(io.popen(cmd))
    local first, reply, usage = nil, {}, nil
    local other = {} -- what is not an event: an error answer (JSON, not streamed), or curl's message
    for line in p:lines() do
        local data = line:match("^data: (.*)$")
        if not data then
            local ok, answer = pcall(cjson.decode, line)
            other[#other + 1] = ok and type(answer) == "table" and answer.error and answer.error.message or line
        elseif data ~= "[DONE]" then
            local chunk = cjson.decode(data)
            if chunk.error then fail("server: " .. chunk.error.message) end
            if chunk.choices[1] then
                first = first or now()
                reply[#reply + 1] = chunk.choices[1].delta.content or ""
            end
            if chunk.usage ~= cjson.null and chunk.usage then usage = chunk.usage end
        end
    end
    p:close()
    if not usage then
        os.remove(body_file)
        fail(("turn %d: no answer from %s: %s"):format(turn, url, #other > 0 and table.concat(other, " ") or "(nothing)"))
    end
    print(("turn %d: %d prompt tokens, %d from the prefix pool, time to first token %.0f ms"):format(turn,
        usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, (first - started) * 1000))
    messages[#messages + 1] = { role = "assistant", content = table.concat(reply) }
end
os.remove(body_file)

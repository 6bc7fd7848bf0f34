-- pause_spec: tinyloop.pause, by which long Lua work (a chat template's render, the ordered
-- JSON walks) gives the server's event loop back; the server's own test (server_spec: /health
-- answered while a chat request's megabyte of tools is read) shows it in nginx.
local pause = require "tinyloop.pause"
local chat_template = require "tinyloop.chat_template"
local json_text = require "tinyloop.json_text"
local cjson = require "cjson"

-- run(fn) -> fn's result and how many times it paused: fn in a coroutine, with every slice spent
-- (busy past it) and a pause that yields back here.
local function run(fn, busy)
    local paused = 0
    pause.install({ busy = function() return busy or 1 end, slice = 0.005, give_back = function() coroutine.yield("paused") end })
    local co = coroutine.create(fn)
    local results
    while true do
        local answer = { coroutine.resume(co) }
        assert(answer[1], answer[2])
        if coroutine.status(co) == "dead" then results = answer break end
        assert.equal("paused", answer[2])
        paused = paused + 1
    end
    pause.install(nil)
    return results[2], paused
end

describe("tinyloop.pause", function()
    after_each(function() pause.install(nil) end)

    it("pauses once a slice of work is spent, at a point of every EVERY, and not before", function()
        local function points(n) return function() for _ = 1, n do pause.point() end return "done" end end
        local result, paused = run(points(pause.EVERY * 10))
        assert.equal("done", result)
        assert.equal(10, paused)
        -- (work that has not yet run a slice goes on)
        result, paused = run(points(pause.EVERY * 10), 0.001)
        assert.equal("done", result)
        assert.equal(0, paused)
        -- (nothing installed: a point only counts)
        local co = coroutine.create(points(pause.EVERY * 10))
        assert.same({ true, "done" }, { coroutine.resume(co) })
    end)

    it("never yields where it cannot: the main thread, a gsub's function, a sort's comparison; it does across pcall", function()
        local gave = 0
        pause.install({ busy = function() return 1 end, slice = 0.005, give_back = function() gave = gave + 1 end })
        for _ = 1, 1000 do pause.point() end -- (the main thread: no coroutine to yield)
        assert.equal(0, gave)
        assert.is_false(pause.can_yield())
        local inside = {}
        local co = coroutine.create(function()
            inside.plain = pause.can_yield()
            inside.pcall = select(2, pcall(pause.can_yield))
            inside.xpcall = select(2, xpcall(pause.can_yield, debug.traceback))
            string.gsub("ab", "%a", function() inside.gsub = pause.can_yield() end)
            local list = { 3, 1, 2 }
            table.sort(list, function(a, b) inside.sort = pause.can_yield() return a < b end)
            -- (points there run on: the gsub's 1,000 of them give nothing back)
            string.gsub("a", "a", function() for _ = 1, 1000 do pause.point() end end)
        end)
        assert(coroutine.resume(co))
        assert.equal("dead", coroutine.status(co))
        assert.same({ plain = true, pcall = true, xpcall = true, gsub = false, sort = false }, inside)
        assert.equal(0, gave)
    end)

    it("pauses a chat template's render and the JSON walks, whose results stay the same", function()
        -- a render of 2,000 messages (each a statement or more)
        local tpl = assert(chat_template.compile("{% for m in messages %}{{ m.role }}: {{ m.content | tojson }}\n{% endfor %}"))
        local messages = {}
        for i = 1, 2000 do messages[i] = { role = i % 2 == 1 and "user" or "assistant", content = { text = "message " .. i } } end
        local plain = assert(tpl:render({ messages = messages }))
        local text, paused = run(function() return tpl:render({ messages = messages }) end)
        assert.equal(plain, text)
        assert.is_true(paused > 10, tostring(paused))
        -- the ordered decoding of a request's JSON, and the marking walk over it
        local body = cjson.encode({ messages = messages })
        local value
        value, paused = run(function() return chat_template.decode_json(body) end)
        assert.same(cjson.decode(body), value)
        assert.is_true(paused > 10, tostring(paused))
        local marked
        marked, paused = run(function() return chat_template.map_strings(value, function(s) return (s:gsub("^message ", "MESSAGE ")) end) end)
        assert.equal("MESSAGE 2000", marked.messages[2000].content.text)
        assert.is_true(paused > 10, tostring(paused))
        -- json_text's member look-up (its skip over the values before the one asked for)
        local text_with_last = '{"first": ' .. cjson.encode(messages) .. ', "last": [1, 2]}'
        local member
        member, paused = run(function() return json_text.member(text_with_last, { "last" }) end)
        assert.equal("[1, 2]", member)
        assert.is_true(paused > 0, tostring(paused))
    end)

    it("pauses the APIs' translations and the requests' checks of long lists", function()
        local anthropic = require "tinyloop.server.anthropic"
        local request = require "tinyloop.server.request"
        local chat = require "tinyloop.chat"
        local blocks, messages, ids = {}, {}, {}
        for i = 1, 5000 do
            blocks[i] = { type = "text", text = "b" .. i }
            messages[i] = { role = i % 2 == 1 and "user" or "assistant", content = "m" .. i }
            ids[i] = i % 100
        end
        local checks = {
            anthropic = function() return anthropic.to_chat(cjson.encode({ max_tokens = 5, messages = { { role = "user", content = blocks } } })) end,
            messages = function() return chat.check_messages(messages) end,
            ids = function() return request.parse_detokenize(cjson.encode({ tokens = ids }), { vocab_size = 100, has_tokenizer = true, decode = function() return "x" end }, "m") end,
        }
        for name, check in pairs(checks) do
            local result, paused = run(check)
            assert.truthy(result, name)
            assert.is_true(paused > 10, name .. " " .. paused)
        end
    end)

    it("keeps json_text's memo of a body right when another body's look-up runs while one pauses", function()
        -- (a request's look-up in its body pauses; another request's, in its own body, runs then)
        local members = {}
        for i = 1, 3000 do members[i] = ('"k%d": [%d]'):format(i, i) end
        local first = "{" .. table.concat(members, ", ") .. ', "last": [1, 2]}'
        local other = '{"b": 7}'
        pause.install({ busy = function() return 1 end, slice = 0.005, give_back = function() coroutine.yield("paused") end })
        local co = coroutine.create(function() return json_text.member(first, { "last" }) end)
        local ok, answer, pauses = nil, nil, 0
        repeat
            ok, answer = coroutine.resume(co)
            assert.is_true(ok, answer)
            if answer == "paused" then
                pauses = pauses + 1
                assert.equal("7", json_text.member(other, { "b" })) -- (the main thread's: no pause)
            end
        until coroutine.status(co) == "dead"
        assert.is_true(pauses > 10, tostring(pauses))
        assert.equal("[1, 2]", answer)
        -- the paused look-up's entries were put in the other body's memo: "b" was not found
        assert.equal("7", json_text.member(other, { "b" }))
        assert.equal("[1, 2]", json_text.member(first, { "last" }))
    end)

    it("counts EVERY points from its install: points made before it do not bring the first clock read forward", function()
        for _ = 1, 10 do pause.point() end -- (nothing installed: counted)
        local reads = 0
        pause.install({ busy = function() reads = reads + 1 return 0 end, slice = 1, give_back = function() end })
        for _ = 1, pause.EVERY - 1 do pause.point() end
        assert.equal(0, reads)
        pause.point()
        assert.equal(1, reads)
    end)

    it("refuses an install without its three parts", function()
        assert.has_error(function() pause.install({ busy = function() return 0 end, slice = 0 }) end)
        assert.has_error(function() pause.install({ busy = 1, slice = 0.005, give_back = function() end }) end)
        assert.has_error(function() pause.install("fast") end)
    end)
end)

-- tools_spec: tinyloop.tools (a chat request's function tools: their checks, the grammar of a
-- forced call, the calls read back from a generation) and tinyloop.json_text (raw JSON parts).
-- The server's use of both, against a real nginx: server_spec.
local H = require "helpers"
local cjson = require "cjson"
local tools = require "tinyloop.tools"
local json_text = require "tinyloop.json_text"

local WEATHER = { type = "function", ["function"] = { name = "get_weather", description = "Weather now",
    parameters = { type = "object", properties = { city = { enum = { "Paris", "Rome" } }, days = { type = "integer" } },
                   required = { "city" } } } }
local NOW = { type = "function", ["function"] = { name = "now" } }

-- check() on tools as a client would send them (their JSON text as the request holds it).
-- The schemas' key order is the order the grammar writes the keys in, and a Lua table's
-- encoding has none: where it matters, pass the JSON text.
local function check(list, choice, parallel)
    local text = type(list) == "string" and list or list ~= nil and cjson.encode(list) or nil
    if type(list) == "table" and next(list) == nil then text = "[]" end
    return tools.check(list ~= nil and cjson.decode(text) or nil, choice, parallel, text)
end
local WEATHER_NOW = '[{"type": "function", "function": {"name": "get_weather", "description": "Weather now", ' ..
    '"parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}}, ' ..
    '"required": ["city"]}}}, {"type": "function", "function": {"name": "now"}}]'

describe("tinyloop.tools.check", function()
    it("reads tools and the choice among them", function()
        local spec = assert(check({ WEATHER, NOW }))
        assert.equal("auto", spec.choice) -- OpenAI's default with tools
        assert.is_false(spec.forced)
        assert.is_true(spec.parallel)
        assert.same({ "get_weather", "now" }, { spec.functions[1].name, spec.functions[2].name })
        assert.is_nil(spec.functions[2].parameters_json)
        assert.same(WEATHER["function"].parameters, cjson.decode(spec.functions[1].parameters_json))
        spec = assert(check({ WEATHER, NOW }, "required", false))
        assert.is_true(spec.forced)
        assert.is_false(spec.parallel)
        spec = assert(check({ WEATHER, NOW }, { type = "function", ["function"] = { name = "now" } }))
        assert.same({ "function", "now", true }, { spec.choice, spec.name, spec.forced })
        assert.equal("none", assert(check({ WEATHER }, "none")).choice)
        -- without the JSON text: cjson's encoding of the tools (whose objects have no key order)
        spec = assert(tools.check({ NOW, WEATHER }, "auto"))
        assert.same({ "now", "get_weather" }, { spec.functions[1].name, spec.functions[2].name })
        assert.same(WEATHER["function"].parameters, cjson.decode(spec.functions[2].parameters_json))
        -- no tools: nothing to do, whatever says so
        assert.is_nil(check(nil))
        assert.is_nil(check({}))
        assert.is_nil(check(nil, "none"))
        assert.is_nil(select(2, check({}, "none")))
    end)

    it("keeps a schema's text as sent, its key order included", function()
        local text = '[{"type": "function", "function": {"name": "f", "parameters": {"properties": {"z": {}, "a": {}}, "type": "object"}}}]'
        local spec = assert(tools.check(cjson.decode(text), nil, nil, text))
        assert.equal('{"properties": {"z": {}, "a": {}}, "type": "object"}', spec.functions[1].parameters_json)
        -- {} (any value) is a function without parameters: it takes {}
        text = '[{"type": "function", "function": {"name": "f", "parameters": {}}}]'
        assert.is_nil(assert(tools.check(cjson.decode(text), nil, nil, text)).functions[1].parameters_json)
    end)

    it("refuses what is not a tool, naming the field", function()
        local function refused(list, choice, parallel, param, message)
            local spec, err, p = check(list, choice, parallel)
            assert.is_nil(spec)
            assert.equal(message, err)
            assert.equal(param, p)
        end
        local function fn(t) return { type = "function", ["function"] = t } end
        refused({ a = 1 }, nil, nil, "tools", 'tools must be an array of {"type": "function", "function": {...}}')
        refused({ 5 }, nil, nil, "tools", 'tools[0] must be an object {"type": "function", "function": {...}}')
        refused({ {} }, nil, nil, "tools", 'tools[0].type must be "function"')
        refused({ { 1 } }, nil, nil, "tools", 'tools[0] must be an object {"type": "function", "function": {...}}')
        refused({ WEATHER, { type = "code" } }, nil, nil, "tools", 'tools[1].type must be "function"')
        refused({ { type = "function", extra = 1 } }, nil, nil, "tools", "unknown field 'extra' in tools[0]")
        refused({ { type = "function" } }, nil, nil, "tools", 'tools[0].function must be an object {"name", "description", "parameters"}')
        refused({ { type = "function", ["function"] = { 1 } } }, nil, nil, "tools",
                'tools[0].function must be an object {"name", "description", "parameters"}')
        refused({ fn({ name = "f", returns = 1 }) }, nil, nil, "tools", "unknown field 'returns' in tools[0].function")
        refused({ fn({ name = "f", description = 5 }) }, nil, nil, "tools", "tools[0].function.description must be a string")
        refused({ fn({ name = "f", strict = "yes" }) }, nil, nil, "tools", "tools[0].function.strict must be a boolean")
        refused({ fn({ name = "f", parameters = { 1 } }) }, nil, nil, "tools", "tools[0].function.parameters must be a JSON Schema object")
        refused({ fn({ name = "f", parameters = "{}" }) }, nil, nil, "tools", "tools[0].function.parameters must be a JSON Schema object")
        -- arguments are an object: a schema of anything else would let a forced call write what
        -- no call can be read from
        for _, schema in ipairs({ { enum = { "a" } }, { type = "string" }, { type = { "object", "null" } }, { properties = { a = {} } } }) do
            refused({ fn({ name = "f", parameters = schema }) }, nil, nil, "tools",
                    'tools[0].function.parameters must be the JSON Schema of an object: {"type": "object", ...}')
        end
        -- tools that cjson cannot encode (without their JSON text) are no array either
        local spec, err, param = tools.check({ [1] = NOW, [20] = NOW }, "auto")
        assert.same({ nil, 'tools must be an array of {"type": "function", "function": {...}}', "tools" }, { spec, err, param })
        refused({ fn({ name = 5 }) }, nil, nil, "tools", "tools[0].function.name must be a string")
        refused({ fn({ description = "no name" }) }, nil, nil, "tools", "tools[0].function.name must be 1 to 64 letters, digits, underscores or dashes")
        for _, name in ipairs({ "", "a b", ("x"):rep(65), "é" }) do
            refused({ fn({ name = name }) }, nil, nil, "tools", "tools[0].function.name must be 1 to 64 letters, digits, underscores or dashes")
        end
        for _, name in ipairs({ "x", ("x"):rep(64), "a-b_C9" }) do -- (the bounds themselves are names)
            assert.truthy(tools.check({ fn({ name = name }) }, "auto"), name)
        end
        refused({ NOW, NOW }, nil, nil, "tools", "tools[1].function.name 'now' is declared twice")
        local many = {}
        for i = 1, 129 do many[i] = fn({ name = "f" .. i }) end
        refused(many, nil, nil, "tools", "tools: 129 tools, at most 128")
        refused(nil, "auto", nil, "tool_choice", 'tool_choice needs tools: send tools, or tool_choice "none"')
        refused({}, { type = "function", ["function"] = { name = "now" } }, nil, "tool_choice", 'tool_choice needs tools: send tools, or tool_choice "none"')
        local choice_rule = 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        for _, choice in ipairs({ "any", 5, true, { type = "function" }, { type = "tool", ["function"] = { name = "now" } } }) do
            refused({ NOW }, choice, nil, "tool_choice", choice_rule)
        end
        refused({ NOW }, { type = "function", ["function"] = { name = "later" } }, nil, "tool_choice",
                'tool_choice names the function "later", which tools does not declare')
        refused({ NOW }, { type = "function", ["function"] = { name = "now", strict = true } }, nil, "tool_choice",
                "unknown field 'strict' in tool_choice.function")
        refused({ NOW }, { type = "function", ["function"] = { name = "now" }, x = 1 }, nil, "tool_choice", "unknown field 'x' in tool_choice")
        refused({ NOW }, nil, "yes", "parallel_tool_calls", "parallel_tool_calls must be a boolean")
    end)
end)

describe("tinyloop.tools.grammar", function()
    local function grammar_of(list, choice, parallel) return assert(tools.grammar(assert(check(list, choice, parallel)))) end
    local function call(name, arguments) return "<tool_call>\n" .. '{"name": "' .. name .. '", "arguments": ' .. arguments .. "}\n</tool_call>" end

    it("accepts exactly the calls a forced choice may make, in the Hermes format", function()
        local g = grammar_of(WEATHER_NOW, "required")
        assert.is_true(g:matches(call("get_weather", '{"city": "Paris"}')))
        assert.is_true(g:matches(call("get_weather", '{"city": "Rome", "days": 3}')))
        assert.is_true(g:matches(call("now", "{}")))
        assert.is_true(g:matches(call("now", "{}") .. "\n" .. call("get_weather", '{"city": "Rome"}'))) -- parallel calls
        -- json.dumps' spacing (as the templates' tojson shows calls), and no other
        assert.is_false(g:matches('<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>'))
        assert.is_false(g:matches('<tool_call>\n{"name":  "now", "arguments": {}}\n</tool_call>'))
        assert.is_false(g:matches('<tool_call>\n{"name": "now",\n"arguments": {}}\n</tool_call>'))
        assert.is_false(g:matches(call("get_weather", '{ "city": "Paris"}')))
        assert.is_false(g:matches(call("get_weather", '{"city":"Paris"}')))
        assert.is_false(g:matches(call("get_weather", '{"city": "Paris", "days": 3 }')))
        assert.is_true(g:matches(call("get_weather", '{"city": "Paris", "days": 3}')))
        -- what the schemas refuse
        assert.is_false(g:matches(call("get_weather", '{"city": "Oslo"}')))
        assert.is_false(g:matches(call("get_weather", '{"days": 3}')))
        assert.is_false(g:matches(call("now", '{"x": 1}')))
        assert.is_false(g:matches(call("later", "{}")))
        assert.is_false(g:matches('{"name": "now", "arguments": {}}'))
        assert.is_false(g:matches("Sure. " .. call("now", "{}")))
        assert.is_false(g:matches(call("now", "{}") .. "\n"))
        -- one call only, and a named function only
        g = grammar_of(WEATHER_NOW, "required", false)
        assert.is_true(g:matches(call("now", "{}")))
        assert.is_false(g:matches(call("now", "{}") .. "\n" .. call("now", "{}")))
        g = grammar_of(WEATHER_NOW, { type = "function", ["function"] = { name = "get_weather" } })
        assert.is_true(g:matches(call("get_weather", '{"city": "Paris"}')))
        assert.is_false(g:matches(call("now", "{}")))
    end)

    it("keeps each function's rules apart, whatever their names in the generated grammars", function()
        -- both schemas generate rules of the same names (root, ws, string, r1, ...)
        local a = { type = "function", ["function"] = { name = "a", parameters = { type = "object", properties = { x = { type = "string" } }, required = { "x" } } } }
        local b = { type = "function", ["function"] = { name = "b", parameters = { type = "object", properties = { x = { type = "integer" } }, required = { "x" } } } }
        local g = grammar_of({ a, b }, "required")
        assert.is_true(g:matches(call("a", '{"x": "1"}')))
        assert.is_true(g:matches(call("b", '{"x": 1}')))
        assert.is_false(g:matches(call("a", '{"x": 1}')))
        assert.is_false(g:matches(call("b", '{"x": "1"}')))
        -- literals, classes and counts are copied, not renamed
        local text = assert(tools.grammar_text(assert(check({ a }, "required"))))
        assert.truthy(text:find('f1-char ::= [^"\\\\\\x00-\\x1F]', 1, true), text)
        assert.truthy(text:find('"\\"x\\""', 1, true), text)
        assert.truthy(text:find("[0-9a-fA-F]{3}", 1, true), text)
    end)

    it("compiles each function's parameters as sent: references to their own $defs and root", function()
        local text = '[{"type": "function", "function": {"name": "move", "parameters": {"$defs": {"Loc": {"type": "object", ' ..
            '"properties": {"city": {"type": "string"}}, "required": ["city"]}}, "type": "object", "properties": {"to": ' ..
            '{"$ref": "#/$defs/Loc"}, "then": {"$ref": "#"}}, "required": ["to"]}}}]'
        local g = assert(tools.grammar(assert(check(text, "required"))))
        assert.is_true(g:matches(call("move", '{"to": {"city": "P"}}')))
        assert.is_true(g:matches(call("move", '{"to": {"city": "P"}, "then": {"to": {"city": "Q"}}}')))
        -- "#" is the parameters, not the call around them
        assert.is_false(g:matches(call("move", '{"to": {"city": "P"}, "then": {"name": "move", "arguments": {"to": {"city": "Q"}}}}')))
        assert.is_false(g:matches(call("move", '{"to": {}}')))
    end)

    it("lets a forced choice make at most MAX_CALLS calls", function()
        local g = grammar_of({ NOW }, "required")
        local calls = {}
        for k = 1, tools.MAX_CALLS do calls[k] = call("now", "{}") end
        assert.is_true(g:matches(table.concat(calls, "\n")))
        calls[#calls + 1] = call("now", "{}")
        assert.is_false(g:matches(table.concat(calls, "\n")))
    end)

    it("makes tool_choice auto's calls whole and valid once the model opens one (lazy_grammar)", function()
        local g = assert(tools.lazy_grammar(assert(check(WEATHER_NOW, "auto"))))
        -- free text, with or without calls after it
        assert.is_true(g:matches("It is sunny, I think."))
        assert.is_true(g:matches(""))
        assert.is_true(g:matches("Let me look. " .. call("get_weather", '{"city": "Rome"}')))
        assert.is_true(g:matches(call("now", "{}") .. "\n" .. call("get_weather", '{"city": "Paris"}'))) -- parallel
        -- once a call is open, only calls: valid arguments, the tag closed, nothing after them
        assert.is_false(g:matches(call("get_weather", '{"city": "Oslo"}')))
        assert.is_false(g:matches(call("later", "{}")))
        assert.is_false(g:matches("<tool_call>\nget_weather(Rome)"))
        assert.is_false(g:matches(call("now", "{}") .. " And more text."))
        -- the call's shape to the byte, as a forced choice writes it
        assert.is_false(g:matches('<tool_call>\n\n{"name": "now", "arguments": {}}\n</tool_call>'))
        assert.is_false(g:matches('<tool_call> {"name": "now", "arguments": {}}\n</tool_call>'))
        -- not parallel: one call
        g = assert(tools.lazy_grammar(assert(check(WEATHER_NOW, "auto", false))))
        assert.is_true(g:matches("Sure. " .. call("now", "{}")))
        assert.is_false(g:matches(call("now", "{}") .. "\n" .. call("now", "{}")))
        -- a reply that may begin with a reasoning block: a <tool_call> inside it is words
        local thinking = assert(require("tinyloop.reasoning").grammar(assert(tools.lazy_grammar(assert(check(WEATHER_NOW, "auto")))), false))
        local reasoned = "<think>\nI will write a <tool_call> block.\n</think>\n\n" .. call("now", "{}")
        assert.is_true(thinking:matches(reasoned))
        assert.is_true(thinking:matches("<think>\nno call</think>\nIt is sunny."))
        assert.is_true(thinking:matches(call("now", "{}"))) -- (the block is optional)
        assert.is_false(thinking:matches("<think>x</think>" .. call("get_weather", '{"city": "Oslo"}')))
        -- only at the start, where the reply is read for one: a block later is text, and a
        -- call in it must be valid (it was let through, and read back as a call)
        assert.is_false(thinking:matches('Sure. <think><tool_call>\n{"name": "get_weather", "arguments": ' ..
                                         '{"city": "Tokyo", "bogus": 1}}\n</tool_call></think> done.'))
        assert.is_false(g:matches(reasoned)) -- (without: the tag in the block opens a call)
        -- where the prompt opened the block, the server puts the grammar after its end: one
        -- block, no second one in which an unchecked call would be read back
        local opened = assert(require("tinyloop").grammar.after("</think>", assert(tools.lazy_grammar(assert(check(WEATHER_NOW, "auto"))))))
        assert.is_true(opened:matches("hm</think>\n" .. call("now", "{}")))
        assert.is_false(opened:matches('hm</think>\n<think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' ..
                                       '\n</tool_call>'))
        -- a schema that does not compile is said as for a forced choice
        local bad = { type = "function", ["function"] = { name = "bad", parameters = { type = "object", properties = { x = { type = "quantum" } } } } }
        local none, err = tools.lazy_grammar(assert(check({ NOW, bad }, "auto")))
        assert.is_nil(none)
        assert.truthy(err:find("the parameters of function 'bad' do not compile", 1, true), err)
    end)

    it("lets a model that opens a call on its own write only a valid one (auto, with the shipped model)", function()
        -- the shipped model never calls on its own: a logits processor makes it open a call,
        -- and the lazy grammar writes the rest from the model's own choices
        local tinyloop = require "tinyloop"
        local H = require "helpers"
        local m = assert(tinyloop.load(H.ROOT .. "/models/tinyloop-austen", { threads = 1 }))
        local spec = assert(check(WEATHER_NOW, "auto", false))
        local g = assert(tools.lazy_grammar(spec))
        local prompt, opener = m:encode("It is a truth"), m:encode("Let me see. <tool_call>")
        local ended = 0
        for seed = 1, 6 do
            local ids, stats = m:generate(prompt, { grammar = g, max_tokens = 90, temperature = 1, sample_seed = seed,
                logits_processor = function(logits, vocab_size, tokens)
                    local at = #tokens - #prompt + 1
                    if opener[at] then
                        for id = 0, vocab_size - 1 do if id ~= opener[at] then logits[id] = -1e30 end end
                    end
                end })
            local text = m:decode({ unpack(ids, #prompt + 1) }):gsub("<|endoftext|>$", "")
            assert.equal("Let me see. <tool_call>", text:sub(1, 23))
            assert.equal("Let me see. <tool_call>\n{", text:sub(1, 25))
            if stats.stop_reason == "EOS" then
                ended = ended + 1
                assert.is_true(g:matches(text), text)
                local content, calls = tools.parse(text, spec, function(k) return "c" .. k end)
                assert.equal("Let me see.", content)
                assert.equal(1, #calls, text)
                local arguments = cjson.decode(calls[1].arguments)
                if calls[1].name == "get_weather" then
                    assert.truthy(arguments.city == "Paris" or arguments.city == "Rome", calls[1].arguments)
                else
                    assert.equal("now", calls[1].name)
                end
            end
        end
        assert.truthy(ended >= 3, ended .. " of 6 samples ended")
    end)

    it("says which function's parameters do not compile", function()
        local bad = { type = "function", ["function"] = { name = "bad", parameters = { type = "object", properties = { x = { type = "quantum" } } } } }
        local g, err = tools.grammar(assert(check({ NOW, bad }, "required")))
        assert.is_nil(g)
        assert.truthy(err:find("the parameters of function 'bad' do not compile as a JSON Schema: ", 1, true), err)
        -- a named choice compiles only its own function
        assert.truthy(tools.grammar(assert(check({ NOW, bad }, { type = "function", ["function"] = { name = "now" } }))))
        -- an error found only once the schema's GBNF compiles (a $ref cycle), named the same,
        -- forced or auto
        local cycle = { type = "function", ["function"] = { name = "loop", parameters = { type = "object",
            properties = { a = { ["$ref"] = "#/$defs/x" } }, ["$defs"] = { x = { ["$ref"] = "#/$defs/x" } } } } }
        for _, make in ipairs({ tools.grammar, tools.lazy_grammar }) do
            g, err = make(assert(check({ NOW, cycle }, "required")))
            assert.is_nil(g)
            assert.truthy(err:find("the parameters of function 'loop' do not compile as a JSON Schema: JSON schema: a $ref cycle", 1,
                                   true), err)
        end
    end)

    it("takes keywords it cannot enforce in tools without strict (Pydantic's HttpUrl, gt=), and holds strict ones", function()
        -- (one property a function: a table's keys have no order once encoded)
        local function fetch(strict)
            return { type = "function", ["function"] = { name = "fetch", strict = strict, parameters = { type = "object",
                properties = { url = { type = "string", format = "uri", minLength = 1, maxLength = 2083 } }, required = { "url" } } } }
        end
        local wait = { type = "function", ["function"] = { name = "wait", parameters = { type = "object",
            properties = { timeout = { type = "number", exclusiveMinimum = 0 } }, required = { "timeout" } } } }
        local g = assert(tools.grammar(assert(check({ fetch(nil), wait }, "required"))))
        assert.is_true(g:matches(call("fetch", '{"url": "https://example.org"}')))
        assert.is_false(g:matches(call("fetch", '{"url": ""}'))) -- (the lengths hold)
        assert.is_true(g:matches(call("wait", '{"timeout": 2.5}')))
        assert.is_false(g:matches(call("wait", '{"timeout": -1}'))) -- (a bound >= 0 holds)
        local none, err = tools.grammar(assert(check({ fetch(true) }, "required")))
        assert.is_nil(none)
        assert.truthy(err:find("the parameters of function 'fetch' do not compile", 1, true) and err:find("/properties/url", 1, true), err)
    end)
end)

describe("tinyloop.tools.parse", function()
    local spec = assert(check({ WEATHER, NOW }))
    local forced = assert(check({ WEATHER, NOW }, "required"))
    local function id_of(k) return "call_" .. k end
    local function parsed(text, cut, which) return { tools.parse(text, which or spec, id_of, cut) } end
    local NOW_CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'

    it("reads the calls after the content", function()
        assert.same({ nil, { { id = "call_1", name = "now", arguments = "{}" } } }, parsed(NOW_CALL))
        -- the arguments' text as written (key order, spacing); white space around the blocks
        assert.same({ "Let me look.", { { id = "call_1", name = "get_weather", arguments = '{"days":2,  "city": "Rome"}' },
                                        { id = "call_2", name = "now", arguments = "{}" } } },
                    parsed('Let me look.\n\n<tool_call>\n {"name": "get_weather", "arguments": {"days":2,  "city": "Rome"}} \n</tool_call>\n' ..
                           '<tool_call>{"arguments": {}, "name": "now"}</tool_call>\n'))
        -- the last block cut short of its end tag (a stop string, the end of the generation)
        assert.same({ nil, { { id = "call_1", name = "now", arguments = "{}" } } }, parsed('<tool_call>\n{"name": "now", "arguments": {}}\n'))
        -- text between and after the calls is not content (vLLM's Hermes parser)
        assert.same({ "A", { { id = "call_1", name = "now", arguments = "{}" }, { id = "call_2", name = "now", arguments = "{}" } } },
                    parsed("A " .. NOW_CALL .. " and " .. NOW_CALL .. " done."))
        -- an end tag inside a string argument is the argument's
        local tricky = '<tool_call>{"name": "get_weather", "arguments": {"city": "</tool_call>"}}</tool_call>'
        assert.same({ nil, { { id = "call_1", name = "get_weather", arguments = '{"city": "</tool_call>"}' } } }, parsed(tricky))
    end)

    it("leaves text that is not a call as content, all of it", function()
        for _, text in ipairs({
            "Just words.",
            "",
            "<tool_call>",
            '<tool_call>\n{"name": "now", "arguments": {}',                                -- cut inside the JSON
            '<tool_call>\n{"name": "later", "arguments": {}}\n</tool_call>',               -- not declared
            '<tool_call>\n{"name": "now", "arguments": []}\n</tool_call>',                 -- arguments not an object
            '<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>',
            '<tool_call>\n{"name": "now"}\n</tool_call>',
            '<tool_call>\n{"name": "now", "arguments": {}, "id": 1}\n</tool_call>',        -- more than a call
            '<tool_call>\n[{"name": "now", "arguments": {}}]\n</tool_call>',
            '<tool_call>{"name": "now", "arguments": {"a": nan}}</tool_call>',          -- not JSON a client takes
            '<tool_call>{"name": "now", "arguments": {"a": 0x1F}}</tool_call>',
            '<tool_call>{"name": "now", "arguments": {"a": 1.}}</tool_call>',            -- (lua-cjson took these)
            '<tool_call>{"name": "now", "arguments": {"a": "x	y"}}</tool_call>',
            '<tool_call>{"name": "now", "arguments": {"a": "unterminated}}</tool_call>',
            NOW_CALL .. "\n<tool_call>\nnope",                                            -- a broken call after one
            NOW_CALL .. '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_',
        }) do
            assert.same({ text, nil }, parsed(text))
        end
    end)

    it("keeps the whole calls of a generation the token limit cut", function()
        local whole = { { id = "call_1", name = "now", arguments = "{}" } }
        assert.same({ nil, whole }, parsed(NOW_CALL .. "\n<tool_call>\n{\"name\": \"get_w", true))
        -- a call whose JSON is whole is whole, though the cut took part of its end tag
        local two = { whole[1], { id = "call_2", name = "now", arguments = "{}" } }
        assert.same({ nil, two }, parsed(NOW_CALL .. '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_', true))
        assert.same({ nil, whole }, parsed('<tool_call>\n{"name": "now", "arguments": {}}\n</', true))
        -- (not without the cut: then the model wrote something else)
        local odd = '<tool_call>\n{"name": "now", "arguments": {}}\n</'
        assert.same({ odd, nil }, parsed(odd))
        assert.same({ odd .. "x", nil }, parsed(odd .. "x", true))
        assert.same({ "Hm.", whole }, parsed("Hm. " .. NOW_CALL .. "\n<tool_call>", true))
        -- not a closed block that is no call, nor a cut before any whole call
        local broken = '<tool_call>{"name": "later", "arguments": {}}</tool_call>\n' .. NOW_CALL .. "\n<tool_call>"
        assert.same({ broken, nil }, parsed(broken, true))
        -- the cut block's unfinished string may hold an end tag: it is cut all the same (and named:
        -- its name is whole)
        assert.same({ nil, whole, { id = "call_2", name = "get_weather" } },
                    parsed(NOW_CALL .. '\n<tool_call>{"name": "get_weather", "arguments": {"city": "a </tool_call> b', true))
        -- the first call cut: left out, the text before it the content (as a stream shows it)
        assert.same({ nil, nil }, parsed("<tool_call>\n{", true))
        assert.same({ "Let me check.", nil }, parsed('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Pa', true))
        assert.same({ "Let me check.", nil }, parsed("Let me check.\n<tool_call>", true))
    end)

    it("names the call the cut took the end of, where its name is whole and declared", function()
        local cut_weather = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
        assert.same({ nil, nil, { id = "call_1", name = "get_weather" } }, parsed(cut_weather, true))
        assert.same({ nil, nil, { id = "call_1", name = "get_weather" } }, parsed(cut_weather, true, forced))
        assert.same({ "Sure.", nil, { id = "call_1", name = "get_weather" } }, parsed("Sure. " .. cut_weather, true))
        assert.same({ nil, { { id = "call_1", name = "now", arguments = "{}" } }, { id = "call_2", name = "now" } },
                    parsed(NOW_CALL .. '\n<tool_call>\n{"name": "now", "arguments": {', true, forced))
        -- named once its closing quote is read, as a stream opens the call then
        assert.same({ nil, nil, { id = "call_1", name = "get_weather" } }, parsed('<tool_call>\n{"name": "get_weather"', true, forced))
        -- not where the name is cut, undeclared, or the text was not cut
        assert.same({ nil, nil }, parsed('<tool_call>\n{"name": "get_wea', true))
        assert.same({ nil, nil }, parsed('<tool_call>\n{"name": "later", "arguments": {', true))
        assert.same({ cut_weather, nil }, parsed(cut_weather))
    end)

    it("gives a forced choice no content, only its whole calls", function()
        assert.same({ nil, { { id = "call_1", name = "now", arguments = "{}" } } }, parsed(NOW_CALL, false, forced))
        assert.same({ nil, nil }, parsed("<tool_c", true, forced))
        assert.same({ nil, nil }, parsed("", false, forced))
        assert.same({ nil, { { id = "call_1", name = "now", arguments = "{}" } } },
                    parsed(NOW_CALL .. "\n<tool_call>\n{", true, forced))
    end)

    it("measures how much of a text's end may begin a call", function()
        assert.equal(0, tools.held("Hello"))
        assert.equal(1, tools.held("Hello <"))
        assert.equal(6, tools.held("x<tool_"))
        assert.equal(10, tools.held("<tool_call"))
        assert.equal(0, tools.held("<tool_call>")) -- whole: not a beginning any more
        assert.equal(0, tools.held("<tool_x"))
        assert.equal(0, tools.held(""))
    end)
end)

describe("tinyloop.tools.call_stream", function()
    -- two calls as a forced choice's grammar writes them: an argument string holding a brace and
    -- an escaped quote, nested values
    local text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}\\"ris", "n": [1, {"x": 2}]}}\n</tool_call>\n' ..
                 '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'

    it("reads the calls' names, then their arguments piece by piece, however the text is cut", function()
        for _, size in ipairs({ 1, 2, 3, 5, 8, 13, #text }) do
            local reader, names, arguments, pieces = tools.call_stream(), {}, {}, 0
            for i = 1, #text, size do
                for _, e in ipairs(reader:feed(text:sub(i, i + size - 1))) do
                    if e.name then
                        assert.is_nil(names[e.call])
                        names[e.call], arguments[e.call] = e.name, ""
                    else
                        arguments[e.call] = arguments[e.call] .. e.arguments
                        pieces = pieces + 1
                    end
                end
            end
            assert.same({ "get_weather", "now" }, names)
            assert.same({ '{"city": "Pa}\\"ris", "n": [1, {"x": 2}]}', "{}" }, arguments)
            assert.is_true(pieces >= math.min(2, math.ceil(#text / size)))
        end
    end)

    it("reads calls after blank space (a thinking model's answer after </think>), however the text is cut", function()
        local spaced = "\n\n \t" .. text
        for _, size in ipairs({ 1, 2, 3, 7, #spaced }) do
            local reader, names = tools.call_stream(), {}
            for i = 1, #spaced, size do
                for _, e in ipairs(reader:feed(spaced:sub(i, i + size - 1))) do
                    if e.name then names[#names + 1] = e.name end
                end
            end
            assert.same({ "get_weather", "now" }, names)
        end
        assert.same({}, tools.call_stream():feed("\n words <tool_call>")) -- (words are off the shape)
    end)

    it("stops at text off the shape", function()
        local reader = tools.call_stream()
        assert.same({}, reader:feed('<tool_call>{"name"'))
        assert.same({}, reader:feed('<tool_call>\n{"name": "x", "arguments": {}}'))
    end)
end)

describe("tinyloop.json_text", function()
    it("encode_sorted writes each object's members in key order (cjson's is the table's hash's, per VM)", function()
        local cjson = require "cjson"
        local v = { zeta = 1, alpha = { d = 4, c = { 3, { y = true, x = cjson.null } }, b = "s" }, mid = {}, nums = { 1, 2 } }
        assert.equal('{"alpha":{"b":"s","c":[3,{"x":null,"y":true}],"d":4},"mid":{},"nums":[1,2],"zeta":1}',
                     json_text.encode_sorted(v))
        -- what it writes reads back as the value; a scalar and an array as encode's
        assert.same(v.alpha, cjson.decode(json_text.encode_sorted(v.alpha)))
        assert.same({ "7", "[1,2]", '"x"' }, { json_text.encode_sorted(7), json_text.encode_sorted({ 1, 2 }), json_text.encode_sorted("x") })
        -- keys that are not all strings: cjson's rules
        assert.equal('[1,null,null,null,5]', json_text.encode_sorted({ [1] = 1, [5] = 5 }))
    end)

    local doc = ' {"a": [1, {"b": {}}, "x,]"], "s": "q\\"}", "a2": {"c": [ ] }, "n": -1.5e3} '

    it("finds a member's raw text by keys and indexes", function()
        assert.equal('[1, {"b": {}}, "x,]"]', json_text.member(doc, { "a" }))
        assert.equal("{}", json_text.member(doc, { "a", 2, "b" }))
        assert.equal('"x,]"', json_text.member(doc, { "a", 3 }))
        assert.equal('"q\\"}"', json_text.member(doc, { "s" }))
        assert.equal("[ ]", json_text.member(doc, { "a2", "c" }))
        assert.equal("-1.5e3", json_text.member(doc, { "n" }))
        assert.equal(doc:sub(2, -2), json_text.member(doc, {}))
        assert.is_nil(json_text.member(doc, { "a", 4 }))
        assert.is_nil(json_text.member(doc, { "a", "b" }))
        assert.is_nil(json_text.member(doc, { "s", 1 }))
        assert.is_nil(json_text.member(doc, { "zz" }))
        assert.equal("2", json_text.member('{"k": 1, "k": 2}', { "k" })) -- the last duplicate, as cjson
        -- (a string's end: its quote after an even run of backslashes, none included)
        local escapes = [[{"a": "x\\", "b": "y\\\"z", "c": "\\\\", "d": "", "e": "\"", "f": 1}]]
        assert.same({ [["x\\"]], [["y\\\"z"]], [["\\\\"]], '""', [["\""]], "1" },
                    { json_text.member(escapes, { "a" }), json_text.member(escapes, { "b" }), json_text.member(escapes, { "c" }),
                      json_text.member(escapes, { "d" }), json_text.member(escapes, { "e" }), json_text.member(escapes, { "f" }) })
        assert.is_nil(json_text.member([[{"a": "x\"}]], { "a" })) -- (its quote escaped: no end)
        -- look-ups alternating between texts, the same containers at the same places in each:
        -- each text's own members (member remembers the last text's containers)
        local other = ' {"a": [2, {"b": [7]}, "y"], "s": "r"} '
        -- (unclosed containers, a stray bracket inside a string, a close with nothing open)
        assert.is_nil(json_text.member('{"a": [1, {"b": 2}', { "a", 2, "b" }))
        assert.equal('{"b": "]"}', json_text.member('{"a": [1, {"b": "]"}], "c": 3}', { "a", 2 }))
        assert.equal("3", json_text.member('{"a": [1, {"b": "]"}], "c": 3}', { "c" }))
        assert.equal("[1]", json_text.member(']{"a": [1]}', { "a" }) or json_text.member('{"a": [1]}]', { "a" }))
        for _ = 1, 2 do
            assert.equal("[7]", json_text.member(other, { "a", 2, "b" }))
            assert.equal("{}", json_text.member(doc, { "a", 2, "b" }))
            assert.equal('"r"', json_text.member(other, { "s" }))
            assert.equal('"q\\"}"', json_text.member(doc, { "s" }))
        end
    end)

    it("finds members as a walk by entries() does, on random bracket soup (member remembers container ends)", function()
        -- the reference: each step through json_text.entries (skip_value's walk, no memo)
        local function walked(t, path)
            local from = t:find("[^ \t\r\n]") or #t + 1
            if #path == 0 then return t:sub(from, (json_text.skip_value(t, from) or #t + 1) - 1) end
            local found
            for _, step in ipairs(path) do
                local c, list = t:byte(from), nil
                if type(step) == "number" then
                    if c ~= 91 then return nil end
                    found = json_text.entries(t, from)[step]
                else
                    if c ~= 123 then return nil end
                    found = nil
                    for _, m in ipairs(json_text.entries(t, from)) do
                        if m.key == step then found = m end
                    end
                end
                if not found then return nil end
                from = found.from
            end
            return t:sub(found.from, found.to)
        end
        local atoms = { '"a"', '"]"', '"{"', "1", "null", "[", "]", "{", "}", ",", ":", '"k"', " ", '"x\\"]"' }
        local state = 12345 -- (a fixed sequence: the same texts every run)
        local function pick(n)
            state = (state * 1103515245 + 12345) % 2147483648
            return state % n + 1
        end
        for _ = 1, 3000 do
            local parts = {}
            for i = 1, pick(14) do parts[i] = atoms[pick(#atoms)] end
            local t = table.concat(parts)
            for _, path in ipairs({ {}, { "k" }, { 1 }, { 2 }, { "k", 1 }, { 1, 1 }, { "a" }, { 1, "k" } }) do
                assert.equal(walked(t, path), json_text.member(t, path), t)
            end
        end
    end)

    it("scans text that is not JSON without raising: nil where a value does not end", function()
        assert.equal(9, json_text.skip_value('{"a": 1} x', 1)) -- the index after the value
        assert.is_nil(json_text.skip_value('{"a": "b', 1))
        assert.is_nil(json_text.skip_value('{"a": [1, 2}', 1))
        assert.is_nil(json_text.skip_value('"no end', 1))
        assert.same({}, json_text.entries('{"a": ', 1))
        -- decoding is strict: what a client's JSON parser takes
        assert.is_nil(json_text.decode('{"a": nan}'))
        assert.is_nil(json_text.decode("[0x10]"))
        assert.same({ 1.5 }, json_text.decode("[1.5]"))
    end)

    it("lists an object's members and an array's elements in text order", function()
        local keys = {}
        for i, m in ipairs(json_text.entries(doc, 2)) do keys[i] = m.key end
        assert.same({ "a", "s", "a2", "n" }, keys)
        assert.same({}, json_text.entries("{}", 1))
        assert.same({}, json_text.entries("{ }", 1))
        local elements = json_text.entries('[1, [2, 3], {"x": [4]}]', 1)
        assert.same({ { from = 2, to = 2 }, { from = 5, to = 10 }, { from = 13, to = 22 } }, elements)
        assert.same({}, json_text.entries("[ ]", 1))
    end)
end)

describe("tinyloop.tools and json_text under a comma-decimal locale", function()
    it("write and read numbers with a point when the script switches locale after requiring them", function()
        -- (lua-cjson took the decimal point when it was loaded: 0.5 was written "0,5", a tool's
        -- enum [0.5, 2.5] forced "0" | "5" | "2" | "5", and {"x": 0.5} was no tool call)
        local dir = os.tmpname()
        os.remove(dir)
        assert(os.execute("mkdir -p " .. H.q(dir) .. " && localedef -i de_DE -f UTF-8 " .. H.q(dir .. "/de_DE.UTF-8")))
        local ok, out = H.run_child([[
            local cjson = require "cjson.safe"
            local tools = require "tinyloop.tools"
            local json_text = require "tinyloop.json_text"
            assert(os.setlocale("de_DE.UTF-8", "numeric"), "no de_DE.UTF-8")
            print("unsynced " .. cjson.encode({ 0.5 }))
            local f = { type = "function", ["function"] = { name = "f", parameters = { type = "object",
                        properties = { x = { enum = { 0.5, 2.5 } } }, required = { "x" } } } }
            local spec = assert(tools.prepare({ f }, "required"))
            print("schema " .. spec.functions[1].parameters_json)
            print("grammar " .. assert(tools.grammar_text(spec)):gsub("\n", " "))
            local _, calls = tools.parse('<tool_call>\n{"name": "f", "arguments": {"x": 0.5}}\n</tool_call>', spec,
                                        function(k) return "c" .. k end)
            print("calls " .. #(calls or {}) .. " " .. tostring(calls and calls[1] and calls[1].arguments))
            print("decoded " .. tostring(json_text.decode('{"x": 2.5}').x):gsub(",", "."))
        ]], "LOCPATH=" .. H.q(dir))
        os.execute("rm -rf " .. H.q(dir))
        assert.is_true(ok, out)
        -- (the locale writes a comma: else this test checks nothing)
        assert.truthy(out:find("unsynced [0,5]", 1, true), out)
        assert.truthy(out:find('"enum":[0.5,2.5]', 1, true), out)
        assert.truthy(out:find('"0.5"', 1, true) and out:find('"2.5"', 1, true), out)
        assert.is_nil(out:find('::= "5"', 1, true), out)
        assert.truthy(out:find('calls 1 {"x": 0.5}', 1, true), out)
        assert.truthy(out:find("decoded 2.5", 1, true), out)
    end)
end)

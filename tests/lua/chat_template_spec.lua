-- chat_template_spec.lua: tinyloop.chat_template, Hugging Face chat templates rendered as
-- transformers renders them (jinja2's sandbox with trim_blocks and lstrip_blocks).
--   * parity: every entry of tests/data/chat_templates/expected.json (real-world templates,
--     expressions, generated whitespace cases) renders to the very bytes jinja2 gave, or fails
--     where jinja2 failed (scripts/tools/chat_template_fixtures.py regenerates the file);
--   * the rules one by one, and every error path with its message.
-- Needs neither the engine nor a model (helpers loads the bindings, which this spec does not use).
local H = require "helpers"
local chat_template = require "tinyloop.chat_template"
local cjson = require "cjson.safe"
local dkjson = require "dkjson"

local FIXTURES = H.ROOT .. "/tests/data/chat_templates"
local read = H.read

local function render(source, vars)
    local tpl, err = chat_template.compile(source)
    if not tpl then return nil, err end
    return tpl:render(vars or {})
end

-- asserts that source renders to expected
local function renders(expected, source, vars)
    local out, err = render(source, vars)
    assert.are.equal(expected, out, "rendering " .. source .. " failed: " .. tostring(err))
end

-- asserts that source fails (at compile or render) with an error containing needle
local function fails(needle, source, vars)
    local out, err = render(source, vars)
    assert.is_nil(out, "expected an error from " .. source .. ", got: " .. tostring(out))
    assert.is_string(err)
    assert.truthy(err:find(needle, 1, true), "error '" .. err .. "' lacks '" .. needle .. "'")
    return err
end

-- with a module limit lowered for the test's duration
local function with_limit(name, value, f)
    local saved = chat_template[name]
    chat_template[name] = value
    local ok, err = pcall(f)
    chat_template[name] = saved
    assert(ok, err)
end

describe("parity with jinja2 (tests/data/chat_templates/expected.json)", function()
    -- JSON objects decode as dicts (an empty {} too), null as cjson.null, i.e. None
    local entries = dkjson.decode(read(FIXTURES .. "/expected.json"), 1, cjson.null, chat_template.dict_mt)
    local sources = {}
    local count = { templates = {}, outputs = 0, errors = 0 }

    it("has the real-world templates and their cases", function()
        for _, e in ipairs(entries) do
            if e.template ~= "inline" then count.templates[e.template] = true end
        end
        local n = 0
        for _ in pairs(count.templates) do n = n + 1 end
        assert.is_true(n >= 12, "templates: " .. n)
        assert.is_true(#entries > 250, "entries: " .. #entries)
    end)

    for _, e in ipairs(entries) do
        it(e.template .. ": " .. e.case, function()
            local source = e.source
            if not source then
                sources[e.template] = sources[e.template] or read(FIXTURES .. "/" .. e.template)
                source = sources[e.template]
            end
            local tpl, err = chat_template.compile(source)
            local out
            -- vars_json: dicts in their own key order (tinyloop.chat.decode_ordered, as the
            -- server reads a request's tools)
            local vars = e.vars or assert(require("tinyloop.chat").decode_ordered(e.vars_json))
            if tpl then out, err = tpl:render(vars) end
            if e.output then
                assert.are.equal(e.output, out, err)
            elseif e.raised then -- raise_exception's message, verbatim
                assert.is_nil(out)
                assert.are.equal(e.error, err)
            else -- jinja2's own error: the same message, after ours "chat template: line N: "
                assert.is_nil(out)
                assert.truthy(err:find(e.error, 1, true), "error '" .. tostring(err) .. "' lacks '" .. e.error .. "'")
            end
        end)
    end
end)

describe("the API", function()
    it("compile returns a template whose render returns the text", function()
        local tpl = assert(chat_template.compile("{{ greeting }}, {{ messages[0].content }}!"))
        assert.are.equal("Hi, you!", tpl:render({ greeting = "Hi", messages = { { role = "user", content = "you" } } }))
        assert.are.equal("Yo, me!", tpl:render({ greeting = "Yo", messages = { { role = "user", content = "me" } } }))
        assert.are.equal("", assert(chat_template.compile("")):render())
    end)

    it("says what kind of failure a render is: the template's refusal, a bound passed, or the template", function()
        local function kind(source, vars) return select(3, assert(chat_template.compile(source)):render(vars or {})) end
        assert.are.equal("raised", kind("{{ raise_exception('roles must alternate') }}"))
        local _, err = assert(chat_template.compile("{{ raise_exception('roles must alternate') }}")):render({})
        assert.are.equal("roles must alternate", err)
        assert.are.equal("limit", kind("{% for i in range(5000) %}{{ s }}{% endfor %}", { s = string.rep("x", 1000) }))
        assert.are.equal("limit", kind("{{ [1] | tojson(indent=100000000) }}"))
        assert.are.equal("limit", kind("{{ 'a\nb' | indent(5000) }}"))
        assert.are.equal("template", kind("{{ 'a' | nosuch }}"))
        assert.are.equal("template", kind("{{ 1 + 'a' }}"))
        assert.is_nil(kind("{{ 'a' | indent(4096) }}"))
    end)

    it("strips a NUL as any other character (it used to end the pattern's class)", function()
        renders("abc", "{{ s.strip(z) }}", { s = "\0abc\0", z = "\0" })
        renders("abc\0", "{{ s.lstrip(z) }}", { s = "\0abc\0", z = "\0" })
        -- pattern characters are characters; a text made only of them strips to nothing;
        -- the sets of several calls do not mix
        renders("b|^]%ab||]%ab%]^", "{{ s.strip(z) }}|{{ s.rstrip(z) }}|{{ '%%'.strip('%') }}|{{ s.lstrip('^') }}",
                { s = "^]%ab%]^", z = "^]%a" })
        renders("x|  x", "{{ '  x  '.strip() }}|{{ '  x  '.rstrip() }}")
        renders("", "{{ '   '.strip() }}{{ ''.strip() }}")
    end)

    it("returns nil, err for arguments of the wrong type instead of raising", function()
        local tpl, err = chat_template.compile(42)
        assert.is_nil(tpl)
        assert.are.equal("chat template: the source must be a string, not number", err)
        local text
        text, err = assert(chat_template.compile("x")):render("vars")
        assert.is_nil(text)
        assert.are.equal("chat template: vars must be a table", err)
    end)

    it("never raises, whatever the source", function()
        local pieces = { "{{", "}}", "{%", "%}", "{#", "#}", "-", "+", " ", "\n", "if", "for", "x", "in", "endif",
                         "endfor", "'", '"', "(", ")", "[", "]", "{", "}", ",", ".", "|", "1", "macro", "set", "=",
                         "raw", "endraw", "not", "is", "~", "*", "**", "loop", "messages", ":", "\\" }
        math.randomseed(7)
        for _ = 1, 3000 do
            local parts = {}
            for i = 1, math.random(1, 12) do parts[i] = pieces[math.random(#pieces)] end
            local source = table.concat(parts)
            local ok, tpl, err = pcall(chat_template.compile, source)
            assert.is_true(ok, source)
            if tpl then
                local ok2, text, err2 = pcall(tpl.render, tpl, { messages = { { role = "user", content = "x" } } })
                assert.is_true(ok2, source)
                assert.is_true(type(text) == "string" or type(err2) == "string", source)
            else
                assert.is_string(err, source)
                assert.truthy(err:match("^chat template: line %d+: "), err)
            end
        end
    end)
end)

describe("startswith and endswith", function()
    it("take Python's start and end, in code points", function()
        renders("True False True True True", '{{ "abc".startswith("b", 1) }} {{ "abc".startswith("a", 1) }} ' ..
                '{{ "abc".endswith("b", 0, 2) }} {{ "h\195\169llo".startswith("l", 2) }} {{ "abc".startswith("c", -1) }}')
    end)
    it("as find and count do (they were ignored: 'abcb'.find('b', 2) was 1)", function()
        renders("3 -1 2 3 2 3", '{{ "abcb".find("b", 2) }} {{ "abcb".find("b", 2, 3) }} {{ "aaa".count("a", 1) }} ' ..
                '{{ "h\195\169llo".find("l", 3) }} {{ "h\195\169llo".find("l", -3) }} {{ "abc".count("", 1) }}')
    end)
end)

describe("strip", function()
    it("strips whole characters of a non-ASCII chars (it stripped bytes: half of a '\194\187' was left)", function()
        renders("\194\171x|\195\169a|a|b\194\187", '{{ "\194\171x\194\187".strip("\194\187") }}|{{ "\195\169a".lstrip("\195\168") }}|' ..
                '{{ "\226\134\146a\226\134\146"|trim("\226\134\146") }}|{{ "ab\194\187 "|trim(" a") }}')
        fails("strip arg must be None or str, not int", "{{ 'a'|trim(1) }}")
        renders("a", "{{ ' a '.strip(none) }}")
    end)
end)

describe("int and divisibleby", function()
    it("read as jinja2's: int of a hex text in base 10 is the default, divisibleby 0 an error", function()
        renders("0 15 7 18", '{{ "0x10"|int }} {{ "1.5e1"|int }} {{ " 7 "|int }} {{ "12"|int(base=16) }}')
        -- base 0 reads the base from the prefix, as Python's int(s, 0) (it read base 16: '10' was 16);
        -- a prefix that names the base is taken; what int refuses ("010" in base 0, a base out of
        -- [2, 36]) falls back to float, as jinja2's
        renders("10 5 15 16 10 0 31 1 7", '{{ "10"|int(base=0) }} {{ "0b101"|int(base=0) }} {{ "0o17"|int(base=0) }} ' ..
                '{{ "0x10"|int(base=0) }} {{ "010"|int(base=0) }} {{ "0"|int(base=0) }} {{ "0x1f"|int(base=16) }} ' ..
                '{{ "1"|int(base=1) }} {{ "7"|int(0, 37) }}')
        renders('"a\\u007f\\u00e9" "a\127\195\169"', '{{ "a\127\195\169"|tojson(ensure_ascii=true) }} {{ "a\127\195\169"|tojson }}')
        renders("nan -inf 0.0 2.5 3.0 1.5", '{{ "nan"|float }} {{ "-Inf"|float }} {{ "0x10"|float }} {{ " 2.5 "|float }} ' ..
                '{{ "3"|float }} {{ "x"|float(1.5) }}')
        local ct = require "tinyloop.chat_template"
        local _, err = assert(ct.compile("{{ 5 is divisibleby 0 }}")):render({})
        assert.matches("divisibleby 0", err, 1, true)
    end)
end)

describe("decode_json", function()
    it("keeps a number written as a float a float, as Python's json (a tool's 0.0, a call's 1.0)", function()
        local ct = require "tinyloop.chat_template"
        local v = assert(ct.decode_json('{"minimum": 0.0, "n": 1.0, "b": 1e5, "c": 2, "d": 0.5}'))
        local t = assert(ct.compile("{{ v|tojson }} {{ v.n is float }} {{ v.c is integer }} {{ v.n + 1 }}"))
        assert.equal('{"minimum": 0.0, "n": 1.0, "b": 100000.0, "c": 2, "d": 0.5} True True 2.0', t:render({ v = v }))
    end)
end)

describe("indent", function()
    it("keeps a text's final newline, as jinja2's (it appends one and splits lines)", function()
        renders("a\n  b\n|", "{{ 'a\\nb\\n' | indent(2) }}|")
        renders("a\n  |", "{{ 'a\\n' | indent(2, blank=true) }}|")
        renders("a\n\n|", "{{ 'a\\n\\n' | indent(2) }}|")
        renders("  a\n  b|", "{{ 'a\\nb' | indent(2, true) }}|")
    end)
end)

describe("whitespace", function()
    it("trim_blocks drops the newline after a block or comment tag, not after {{ }}", function()
        renders("a\nb\n", "{% if true %}\na\n{% endif %}\n{{ 'b' }}\n\n")
        renders("x", "{# comment #}\nx")
    end)

    it("lstrip_blocks strips a line's indentation before a block or comment tag", function()
        renders("  yes\nend", "  {% if true %}\n  yes\n  {% endif %}\nend")
        renders("a x  \n  \nb", "a {% if true %}x{% endif %}  \n  {# c #}  \nb")
        renders("1  X", "{{ 1 }}  {% if true %}\nX{% endif %}") -- not at a line's start
        renders("  v", "  {{ 'v' }}")                          -- not before {{ }}
    end)

    it("'-' strips all whitespace on its side, '+' keeps the indentation", function()
        renders("xy", "x\n  {%- if true -%}  \n y  {%- endif %}\n")
        renders("a|b", "a  \n {{- '|' -}} \n\t b")
        renders("x  y", "x  {%+ if true %}y{% endif %}")
        renders("ab", "a {#- comment -#}\n b")
    end)

    it("drops one trailing newline of the source and reads \\r\\n as \\n", function()
        renders("a\n", "a\n\n")
        renders("a\nb", "a\r\n{% if true %}\r\nb{% endif %}\r\n")
    end)

    it("raw blocks print their body as text", function()
        renders("{{ x }}z", "{% raw %}{{ x }}{% endraw %}\nz")
        renders("\n{{ x }}\nz", "  {% raw %}\n{{ x }}\n  {% endraw %}\nz")
    end)
end)

describe("scoping", function()
    it("a set inside a for body does not leak out of the loop, nor to the next iteration", function()
        renders("111|0", "{% set c = 0 %}{% for i in range(3) %}{% set c = c + 1 %}{{ c }}{% endfor %}|{{ c }}")
        renders("[][5][]", "{% for i in range(3) %}{% if i == 1 %}{% set x = 5 %}{% endif %}[{{ x }}]{% endfor %}")
    end)

    it("a namespace carries values out of a loop", function()
        renders("4", "{% set ns = namespace(a=1) %}{% for i in [1, 2] %}{% set ns.a = ns.a + i %}{% endfor %}{{ ns.a }}")
        renders("<Namespace {'b': 1, 'a': 2}>", "{% set ns = namespace(b=1) %}{% set ns.a = 2 %}{{ ns }}")
    end)

    it("a set inside an if at the top level sets the outer variable", function()
        renders("2", "{% if true %}{% set y = 2 %}{% endif %}{{ y }}")
        renders("1", "{% set messages = messages[1:] %}{{ messages | length }}", { messages = { "a", "b" } })
    end)

    it("macros see their arguments and the defining scope, and set nothing outside", function()
        renders("[1B][12][3B][B]|T",
            "{% set top = 'T' %}{% macro m(a, b='B') %}{% set leak = 1 %}[{{ a }}{{ b }}]{% endmacro %}"
            .. "{{ m(1) }}{{ m(1, 2) }}{{ m(a=3) }}{{ m() }}|{{ top }}{{ leak }}")
        -- varargs and kwargs: jinja2's () and {} of a macro called without extra arguments
        renders("()|{}", "{% macro f() %}{{ varargs }}|{{ kwargs }}{% endmacro %}{{ f() }}")
    end)

    -- (each checked against jinja2 3.1: these leaked, or skipped the else)
    it("a for loop's else and a block set are scopes of their own", function()
        renders("[B]", "{% for i in [] %}{% else %}{% set b = 'x' %}{% endfor %}[{{ b }}]", { b = "B" })
        renders("[]", "{% set blk %}{% set i = 'z' %}{% endset %}[{{ i }}]")
    end)

    it("a for loop's else runs where no iteration reached the end of the body (break and continue too)", function()
        renders("E", "{% for x in [1, 2] %}{% if x == 1 %}{% break %}{% endif %}{% else %}E{% endfor %}")
        renders("E", "{% for x in [1, 2] %}{% continue %}{% else %}E{% endfor %}")
        renders("1", "{% for x in [1, 2] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% else %}E{% endfor %}")
        renders("12", "{% for x in [1, 2] %}{{ x }}{% else %}E{% endfor %}")
    end)
end)

describe("Python's ASCII white space", function()
    it("counts \\x1c-\\x1f as blanks in strip and split, as str does", function()
        renders("1 ['a', 'b']", "{{ 'x\28'.strip()|length }} {{ 'a\31b'.split() }}")
        -- in lstrip_blocks, title and the raw tag too (each against jinja2 3.1)
        renders("x\nb", "x\n\28 {% if true %}b{% endif %}")
        renders("Ab\28Cd", "{{ 'ab\28cd'|title }}")
        renders("r", "{%\28raw\28%}r{% endraw %}")
    end)
end)

describe("from a hunt", function()
    it("compares a tuple unequal to a list, builds a dict of pairs, has loop.changed", function()
        renders("False True False", "{{ (1, 2) == [1, 2] }} {{ (1, 2) == (1, 2) }} {{ [1, 2] != [1, 2] }}")
        renders("{'a': 1, 'b': 2} {'x': 1}", "{{ dict([('a', 1), ['b', 2]]) }} {{ dict(x=1) }}")
        fails("dictionary update sequence element #0 has length 3; 2 is required", "{{ dict([(1, 2, 3)]) }}")
        renders("TrueFalseTrueTrue|True", "{% for i in [1, 1, 2, 1] %}{{ loop.changed(i) }}{% endfor %}|" ..
                "{% for i in [1] %}{{ loop.changed(i) }}{% endfor %}")
    end)
    it("names the template's mistakes, not Lua's", function()
        fails("expected '}}', got '1.0'", "{{ x 1.0 }}")
        fails("must be str or None, not bool", "{{ 'a'.split(true) }}")
        fails("No filter named None.", "{{ ['a'] | map(none) | list }}")
    end)
end)

describe("loops", function()
    it("have jinja2's loop variables", function()
        renders("1 0 True False 3 3 2 |2;2 1 False False 3 2 1 1|3;3 2 False True 3 1 0 2|;",
            "{% for x in [1, 2, 3] %}{{ loop.index }} {{ loop.index0 }} {{ loop.first }} {{ loop.last }} "
            .. "{{ loop.length }} {{ loop.revindex }} {{ loop.revindex0 }} {{ loop.previtem }}|{{ loop.nextitem }};{% endfor %}")
        renders("a b a ", "{% for x in [1, 2, 3] %}{{ loop.cycle('a', 'b') }} {% endfor %}")
    end)

    it("filter with if (loop.length counts the kept items), have an else, break and continue", function()
        renders("1/2:2,2/2:4", "{% for x in [1, 2, 3, 4] if x is even %}{{ loop.index }}/{{ loop.length }}:{{ x }}{{ ',' if not loop.last }}{% endfor %}")
        renders("empty", "{% for x in [] %}x{% else %}empty{% endfor %}")
        renders("13", "{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}")
    end)

    it("unpack pairs, and iterate dicts by key and strings by character", function()
        renders("a=1;b=2;", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", { d = { b = 2, a = 1 } })
        renders("ab", "{% for k in d %}{{ k }}{% endfor %}", { d = { b = 2, a = 1 } })
        renders("[é][😀]", "{% for c in 'é😀' %}[{{ c }}]{% endfor %}")
    end)
end)

describe("expressions", function()
    it("index, slice and count strings by character and lists by item", function()
        renders("b c cba [2, 3] [1, 2] [3, 2, 1] 3", "{{ 'abc'[1] }} {{ 'abc'[-1] }} {{ 'abc'[::-1] }} {{ l[1:] }} {{ l[:-1] }} {{ l[::-1] }} {{ l[-1] }}",
            { l = { 1, 2, 3 } })
        renders("5 é olléh", "{{ 'héllo' | length }} {{ 'héllo'[1] }} {{ 'héllo'[::-1] }}")
        renders("|", "{{ l[7] }}|{{ 'abc'[9] }}", { l = { 1 } })
        -- (an ASCII string's by its bytes, the others' by their characters: one answer)
        renders("bc|a|bc||ab|ac|a|c", "{{ 'abc'[1:] }}|{{ 'abc'[:1] }}|{{ 'abc'[-2:] }}|{{ 'abc'[5:] }}|{{ 'abc'[-9:2] }}|" ..
                "{{ 'abc'[::2] }}|{{ 'abc'[-3] }}|{{ s[2] }}", { s = "abc" })
        renders("él|h|lo||hél|hlo|h|o", "{{ 'héllo'[1:3] }}|{{ 'héllo'[:1] }}|{{ 'héllo'[-2:] }}|{{ 'héllo'[9:] }}|" ..
                "{{ 'héllo'[-9:3] }}|{{ 'héllo'[::2] }}|{{ 'héllo'[-5] }}|{{ s[4] }}", { s = "héllo" })
    end)

    it("has Python's operators", function()
        renders("4 64 3 3.5 2.0 -4 2 0.5 aaa [1, 1] ab1None", "{{ -2**2 }} {{ 2**3**2 }} {{ 7//2 }} {{ 7/2 }} {{ 4/2 }} {{ -7//2 }} {{ -7%3 }} {{ 2**-1 }} {{ 'a' * 3 }} {{ [1] * 2 }} {{ 'a' ~ 'b' ~ 1 ~ none }}")
        renders("True True True True False", "{{ 1 in [1, 2] }} {{ 'b' in 'abc' }} {{ 'a' in {'a': 1} }} {{ 3 not in [1] }} {{ 'x' in missing }}")
        renders("a||e|True|x|", "{{ 1 and 'a' }}|{{ 0 or '' }}|{{ [] or 'e' }}|{{ not [] }}|{{ 'x' if true else 'y' }}|{{ 'y' if false }}")
        renders("True True False", "{{ 1 < 2 < 3 }} {{ [1, 2] == [1, 2] }} {{ 'a' == 1 }}")
    end)

    it("has Python's string and dict methods", function()
        renders("a b|['a', 'b', '', 'c']|['a', 'b']|['a', 'b,c']|True|Hello World|2|-1|x-y",
            "{{ ' a b '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a,b,c'.split(',', 1) }}|"
            .. "{{ 'abc'.startswith(('x', 'a')) }}|{{ 'hello world'.title() }}|{{ 'abc'.find('c') }}|{{ 'abc'.find('z') }}|{{ '-'.join(['x', 'y']) }}")
        renders("1 None 2 ['a', 'b'] [1, 2]", "{{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 2) }} {{ d.keys() | list }} {{ d.values() | list }}",
            { d = { a = 1, b = 2 } })
        -- (their counts' edges, as jinja2 3.1 renders them: a maxsplit of 0, a count of -1,
        -- lines of a text whose last one has no newline)
        renders("['a b c']|bbb|['ab', 'c']|['a', 'b c']|bba",
            "{{ 'a b c'.split(None, 0) }}|{{ 'aaa'.replace('a', 'b', -1) }}|{{ 'ab\nc'.splitlines() }}|"
            .. "{{ 'a b c'.split(None, 1) }}|{{ 'aaa'.replace('a', 'b', 2) }}")
    end)
end)

describe("filters", function()
    local cases = {
        { "{{ '  x  ' | trim }}|{{ 'x' | upper }}|{{ 'X' | lower }}|{{ 'hELLO' | capitalize }}|{{ 'a b-c' | title }}", "x|X|x|Hello|A B-C" },
        { "{{ [1, 2] | length }} {{ 'ab' | count }} {{ [1, 2] | first }} {{ [1, 2] | last }} {{ [1, 2] | join(', ') }}", "2 2 1 2 1, 2" },
        { "{{ missing | default('d') }} {{ '' | default('d', true) }} {{ missing | d('x') }}", "d d x" },
        { "{{ 1 | string }} {{ '42' | int }} {{ '2.5' | float }} {{ 'ab' | list }} {{ [1, 2] | reverse | list }}", "1 42 2.5 ['a', 'b'] [2, 1]" },
        { "{{ 'aXa' | replace('a', 'b') }} {{ {'b': 1, 'a': 2} | items | list }} {{ {'b': 1, 'a': 2} | dictsort }}", "bXb [('b', 1), ('a', 2)] [('a', 2), ('b', 1)]" },
        { "{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='c') | list }} {{ ms | rejectattr('role', 'equalto', 'user') | map(attribute='c') | join }} {{ ms | selectattr('c') | list | length }}", "['1', '3'] 2 3" },
        { "{{ ['a', 'b'] | map('upper') | list }} {{ [1, 2, 1] | unique | list }} {{ 'x' | safe }} {{ -1.5 | abs }} {{ 2.5 | round }} {{ 3.14159 | round(2) }}", "['A', 'B'] [1, 2] x 1.5 2.0 3.14" },
        { "{{ [1, 2] | sum }} {{ [3, 1] | min }} {{ [3, 1] | max }} {{ 'a\nb' | indent(2) }}", "3 1 3 a\n  b" },
        -- an attribute that is false is the value, not the whole item (selectattr kept what it
        -- should drop, sort and sum failed on the item); operator tests; round to tens
        { "{{ fl | selectattr('a') | map(attribute='n') | list }} {{ fl | rejectattr('a') | map(attribute='n') | list }} " ..
          "{{ fl | join(',', attribute='a') }} {{ fl | sort(attribute='a') | map(attribute='n') | list }} {{ fl | sum(attribute='a') }} " ..
          "{{ (fl | min(attribute='a')).n }} {{ fl | unique(attribute='a') | map(attribute='n') | list }}", "[1] [2] True,False [2, 1] 1 2 [1, 2]" },
        { "{{ [{'x': 1}, {'a': {'b': 2}}] | map(attribute='a.b', default='D') | list }}", "['D', 2]" },
        { "{{ [1, 2, 3] | select('>', 1) | list }} {{ fl | selectattr('n', '==', 2) | map(attribute='n') | list }}",
          "[2, 3] [2]" },
        { "{{ 21.3 | round(-1) }}|{{ 25 | round(-1) }}|{{ 1234.5678 | round(-2) }}|{{ 35 | round(-1) }}|{{ 5 | round(-400) }}|" ..
          "{{ 0.5 | round(-400) }}|{{ -0.5 | round(-1) }}", "20.0|20|1200.0|40|0|0.0|-0.0" },
        { "{{ {'b': [1, 2.0, none, true], 'a': '<&>é\\n'} | tojson }}", '{"b": [1, 2.0, null, true], "a": "<&>é\\n"}' },
        { "{{ {'a': {'b': []}} | tojson(indent=2) }}", '{\n  "a": {\n    "b": []\n  }\n}' },
    }
    for _, case in ipairs(cases) do
        it(case[1], function()
            renders(case[2], case[1], { ms = { { role = "user", c = "1" }, { role = "bot", c = "2" }, { role = "user", c = "3" } },
                                        fl = { { a = true, n = 1 }, { a = false, n = 2 } } })
        end)
    end
end)

describe("tests", function()
    it("are jinja2's, negated by 'is not'", function()
        renders("True True True True True True True True True True",
            "{{ x is defined }} {{ y is undefined }} {{ n is none }} {{ 's' is string }} {{ 1 is number }} {{ 1 is integer }} "
            .. "{{ 1.5 is float }} {{ {'a': 1} is mapping }} {{ [] is iterable }} {{ 'a' is sequence }}", { x = 1, n = cjson.null })
        renders("True True True True True True True True True True True",
            "{{ true is boolean }} {{ true is true }} {{ false is false }} {{ 1 is equalto 1 }} {{ 1 is eq 1 }} {{ 1 is ne 2 }} "
            .. "{{ 1 is in [1] }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 'a' is lower }}")
        renders("True True False True", "{{ 'A' is upper }} {{ range is callable }} {{ 1 is callable }} {{ 1 is not none }}")
    end)
end)

describe("Python's printing and truth", function()
    it("prints None, booleans, lists, dicts, tuples and numbers as Python does", function()
        renders("None True False ['a', 1, None] {'a': 1} (1, 2) (1,)", "{{ none }} {{ True }} {{ false }} {{ ['a', 1, None] }} {{ {'a': 1} }} {{ (1, 2) }} {{ (1,) }}")
        renders("1.0 0.1 1e+16 1e-05 0.30000000000000004 3 2.5 -0.0 inf", "{{ 1.0 }} {{ 0.1 }} {{ 1e16 }} {{ 1e-5 }} {{ 0.1 + 0.2 }} {{ 3 }} {{ f }} {{ -0.0 }} {{ big }}",
            { f = 2.5, big = math.huge })
        renders([=[["it's", 'a"b', 'a\nb', '\x01']]=], [[{{ ["it's", 'a"b', 'a\nb', '\x01'] }}]])
    end)

    it("treats empty strings, lists and dicts, 0, none, false and undefined as false", function()
        renders("fffffffft", "{% for v in [x, '', [], {}, 0, none, false, missing, 'a'] %}{{ 't' if v else 'f' }}{% endfor %}",
            { x = cjson.null })
    end)
end)

describe("undefined values", function()
    it("print as nothing, test false, have length 0, take defaults and iterate as empty", function()
        renders("|False|d|0||True|b", "{{ x }}|{{ x is defined }}|{{ x | default('d') }}|{{ x | length }}|{% for i in x %}no{% endfor %}|{{ x == x }}|{{ x ~ 'b' }}")
    end)

    it("are what a missing key, attribute or index gives, without error", function()
        renders("||False|", "{{ m.tool_calls }}|{{ m['tool_calls'] }}|{{ m.tool_calls is defined }}|{{ n.x }}", { m = { role = "user" }, n = cjson.null })
    end)

    it("fail when used: attribute, arithmetic, call", function()
        fails("chat template: line 1: 'x' is undefined", "{{ x.y }}")
        fails("'x' is undefined", "{{ x + 1 }}")
        fails("'dict object' has no attribute 'nope'", "{{ d.nope.deeper }}", { d = { a = 1 } })
        fails("'foo' is undefined", "{{ foo() }}")
    end)
end)

describe("Lua values", function()
    it("read cjson.null as None", function()
        renders("None|True|True|null", "{{ v }}|{{ v is none }}|{{ v is defined and not v }}|{{ v | tojson }}", { v = cjson.null })
    end)

    it("read an empty table as a list, unless marked a dict", function()
        renders("[] {} True False", "{{ a | tojson }} {{ d | tojson }} {{ a is sequence and not a is mapping }} {{ d is sequence and not d is mapping }}",
            { a = {}, d = chat_template.dict() })
    end)

    it("read cjson.empty_array as an empty list and tables with cjson's array_mt as lists", function()
        -- a cjson.safe with the markers some builds have (this one may lack them)
        local marker, array_mt = newproxy(), {}
        package.loaded["cjson.safe"] = setmetatable({ empty_array = marker, array_mt = array_mt }, { __index = cjson })
        package.loaded["tinyloop.chat_template"] = nil
        local ok, fresh = pcall(require, "tinyloop.chat_template")
        package.loaded["cjson.safe"], package.loaded["tinyloop.chat_template"] = cjson, chat_template
        assert(ok, fresh)
        local tpl = assert(fresh.compile("{{ e | length }} {{ e }} {{ d.e | tojson }} {{ l }} {{ l | tojson }} "
            .. "{% for x in l %}{{ x | length }}{% endfor %} {{ d.values() | list }} {{ a | tojson }} {{ a is mapping }}"))
        assert.are.equal("0 [] [] [[]] [[]] 0 [[]] [] False",
            tpl:render({ e = marker, d = { e = marker }, l = { marker }, a = setmetatable({}, array_mt) }))
    end)

    it("iterate dicts in sorted key order, or in the order chat_template.dict was given", function()
        renders('{"a": 1, "b": 2, "c": 3}', "{{ d | tojson }}", { d = { c = 3, b = 2, a = 1 } })
        renders('{"c": 3, "a": 1, "b": 2}', "{{ d | tojson }}", { d = chat_template.dict({ c = 3, b = 2, a = 1 }, { "c", "a", "b" }) })
        renders('{"z": 1, "y": 2}', "{{ {'z': 1, 'y': 2} | tojson }}") -- a template's literals keep theirs
    end)

    it("call Lua functions passed in vars", function()
        renders("6 None", "{{ add(2, 4) }} {{ nothing() }}", { add = function(a, b) return a + b end, nothing = function() end })
    end)

    it("turn a Lua error inside a function from vars into nil, err", function()
        local text, err = render("x\n{{ f() }}", { f = function() error("boom", 0) end })
        assert.is_nil(text)
        assert.are.equal("chat template: line 2: boom", err)
    end)

    it("sort keys of one type that Lua cannot compare by their text", function()
        renders("{False: 'f', True: 't'}", "{{ d }}", { d = { [true] = "t", [false] = "f" } })
    end)

    it("strftime_now formats the current time", function()
        renders(os.date("%Y"), "{{ strftime_now('%Y') }}")
    end)
end)

describe("errors", function()
    it("report syntax errors with their line", function()
        local syntax = {
            { "line 3: unknown tag 'include'", "a\nb\n{% include 'x' %}" },
            { "line 2: unexpected 'endif'", "a\n{% endif %}" },
            { "line 2: unexpected end of template: the 'for' of line 1 is not closed", "{% for x in y %}\n\n\n" },
            { "line 1: unexpected end of template: the 'if' of line 1 is not closed", "{% if x %}{% else %}" },
            { "line 2: unexpected end of template, the tag is not closed", "x\n{{ y " },
            { "line 1: missing end of comment tag", "{# never closed" },
            { "line 1: missing end of raw directive", "{% raw %}x" },
            { "line 1: unexpected end of string", "{{ 'abc }}" },
            { "line 1: unexpected character \"!\"", "{{ a ! b }}" },
            { "line 1: unexpected ']', expected ')'", "{{ (1] }}" },
            { "line 1: expected '}}', got 'b'", "{{ a b }}" },
            { "line 1: expected '%}', got 'b'", "{% if a b %}{% endif %}" },
            { "line 1: expected 'in', got 'y'", "{% for x y %}{% endfor %}" },
            { "line 1: expected an expression, got end of tag", "{{ }}" },
            { "line 1: *args and **kwargs are not supported", "{{ f(*a) }}" },
            { "line 1: positional argument follows keyword argument", "{{ f(a=1, 2) }}" },
            { "line 1: unexpected '}'", "{% set x = } %}" },
            { "line 1: expected a name or a number after '.'", "{{ a.'b' }}" },
            { "line 1: expected ']', got '2'", "{{ a[1 2] }}" },
            { "line 1: expected a subscript expression", "{{ a[] }}" },
            { "line 1: invalid slice", "{{ a[1:2:3:4] }}" },
            { "line 1: the template is nested too deeply", "{{ " .. string.rep("(", 300) .. "1" .. string.rep(")", 300) .. " }}" },
            { "line 1: the template is nested too deeply", "{{ " .. string.rep("not ", 100000) .. "x }}" },
            { "line 1: the template is nested too deeply", "{{ " .. string.rep("1 if x else ", 100000) .. "2 }}" },
            { "line 1: the template is nested too deeply", "{{ " .. string.rep("-", 100000) .. "1 }}" },
            { "line 1: the template is nested too deeply", "{{ " .. string.rep("[", 100000) .. string.rep("]", 100000) .. " }}" },
            { "line 3: the template is nested too deeply", "\n\n" .. string.rep("{% if x %}", 100000) },
            { "line 1: recursive loops are not supported", "{% for x in y recursive %}{% endfor %}" },
            { "line 1: a block set assigns one name", "{% set a, b %}x{% endset %}" },
            { "line 1: non-default argument follows default argument", "{% macro m(a=1, b) %}{% endmacro %}" },
            { "line 2: 'break' outside of a loop", "x\n{% break %}" },
            { "line 1: 'continue' outside of a loop", "{% for x in y %}{% macro m() %}{% continue %}{% endmacro %}{% endfor %}" },
            { "line 1: expected a name, got '=='", "{{ 1 is == 1 }}" },
        }
        for _, case in ipairs(syntax) do
            local tpl, err = chat_template.compile(case[2])
            assert.is_nil(tpl, case[2])
            assert.are.equal("chat template: " .. case[1], err)
        end
    end)

    it("return raise_exception's message as it is", function()
        local text, err = render("{% if messages | length > 1 %}{{ raise_exception('only ' ~ 1 ~ ' message, please') }}{% endif %}",
            { messages = { 1, 2 } })
        assert.is_nil(text)
        assert.are.equal("only 1 message, please", err)
    end)

    it("name the runtime error and its line", function()
        local runtime = {
            { "line 2: No filter named 'nofilter'.", "x\n{{ 'abc' | nofilter }}" },
            { "No filter named 'nope'.", "{{ [1] | map('nope') | list }}" },
            { "No test named 'nosuchtest'.", "{{ 1 is nosuchtest }}" },
            { "access to attribute 'append' of 'list' object is unsafe.", "{% set l = [] %}{{ l.append(1) }}" },
            { "access to attribute 'update' of 'dict' object is unsafe.", "{{ {'a': 1}.update({}) }}" },
            { "Object of type Undefined is not JSON serializable", "{{ x | tojson }}" },
            { "Object of type Namespace is not JSON serializable", "{{ namespace() | tojson }}" },
            { "'int' object is not iterable", "{% for x in 1 %}{% endfor %}" },
            { "'<' not supported between instances of 'int' and 'str'", "{{ 1 < 'a' }}" },
            { "'in <string>' requires string as left operand, not int", "{{ 1 in 'abc' }}" },
            { "argument of type 'NoneType' is not iterable", "{{ 1 in none }}" },
            { "division by zero", "{{ 1 / 0 }}" },
            { "integer division or modulo by zero", "{{ 1 % 0 }}" },
            { "unsupported operand type(s) for +: 'str' and 'int'", "{{ 'a' + 1 }}" },
            { "unsupported operand type(s) for -: 'list' and 'list'", "{{ [] - [] }}" },
            { "'int' object is not callable", "{{ n() }}" },
            { "slice indices must be integers or None", "{{ 'abc'[1.5:] }}" },
            { "'int' object is not subscriptable", "{{ n[1:] }}" },
            { "slice step cannot be zero", "{{ 'abc'[::0] }}" },
            { "odd's value must be a number, not str", "{{ 'a' is odd }}" },
            { "bad operand type for unary -", "{{ -'a' }}" },
            { "cannot assign attribute on non-namespace object", "{% set x = 1 %}{% set x.y = 2 %}" },
            { "too many values to unpack (expected 2)", "{% for a, b in [[1, 2, 3]] %}{% endfor %}" },
            { "not enough values to unpack (expected 2, got 1)", "{% set a, b = [1] %}" },
            { "no items for cycling given", "{% for x in [1] %}{{ loop.cycle() }}{% endfor %}" },
            { "macro 'm' takes not more than 1 argument(s)", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}" },
            { "macro 'm' takes no keyword argument 'z'", "{% macro m(a) %}{% endmacro %}{{ m(z=2) }}" },
            { "format must be a string, not int", "{{ strftime_now(1) }}" },
            { "maxsplit must be an integer, not str", "{{ 'a b'.split(' ', 'x') }}" },
            { "empty separator", "{{ 'ab'.split('') }}" },
            { "startswith/endswith first arg must be str or a tuple of str, not int", "{{ 'a'.startswith(1) }}" },
            { "sequence item 0: expected str instance, int found", "{{ ' '.join([1, 2]) }}" },
            { "range() arg 3 must not be zero", "{{ range(1, 5, 0) }}" },
            { "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).", "{{ range(100001) | length }}" },
            { "object of type 'int' has no len()", "{{ 1 | length }}" },
            { "type str doesn't define __round__ method", "{{ 'a' | round }}" },
            { "method must be 'common', 'ceil' or 'floor'", "{{ 1.5 | round(0, 'up') }}" },
            { "Can only get item pairs from a mapping.", "{{ [1] | items }}" },
            { "dictsort: value must be a dict", "{{ [1] | dictsort }}" },
            { "You can only sort by either 'key' or 'value'", "{{ {'a': 1} | dictsort(by='x') }}" },
        }
        for _, case in ipairs(runtime) do
            local err = fails(case[1], case[2], { n = 1 })
            assert.truthy(err:match("^chat template: line %d+: "), err)
        end
    end)

    it("bound runaway recursion by MAX_DEPTH", function()
        fails("chat template: line 1: macro calls nested deeper than MAX_DEPTH = 64", "{% macro m(n) %}{{ m(n) }}{% endmacro %}{{ m(1) }}")
        renders("x", "{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{% else %}x{% endif %}{% endmacro %}{{ m(60) }}")
    end)

    it("bound loops by MAX_ITERATIONS", function()
        fails("more than MAX_ITERATIONS = 1000000 loop iterations",
            "{% for a in range(1000) %}{% for b in range(1001) %}{% endfor %}{% endfor %}")
        with_limit("MAX_ITERATIONS", 10, function()
            renders("", "{% for a in range(10) %}{% endfor %}")
            fails("more than MAX_ITERATIONS = 10 loop iterations", "{% for a in range(11) %}{% endfor %}")
            fails("more than MAX_ITERATIONS = 10 loop iterations", "{% for a in range(11) if false %}{% endfor %}")
        end)
    end)

    it("bound the output by MAX_OUTPUT and all text written or built by MAX_WORK", function()
        fails("the output is longer than MAX_OUTPUT = 4194304 bytes", "{% for i in range(5000) %}{{ s }}{% endfor %}", { s = string.rep("x", 1000) })
        with_limit("MAX_WORK", 1000, function()
            renders(string.rep("x", 200), "{{ s }}", { s = string.rep("x", 200) })
            fails("the template built more than MAX_WORK = 1000 bytes of text", "{% set t %}{% for i in range(11) %}{{ s }}{% endfor %}{% endset %}", { s = string.rep("x", 100) })
            fails("the template built more than MAX_WORK = 1000 bytes of text", "{% set ns = namespace(s='xx') %}{% for i in range(20) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}")
            fails("the template built more than MAX_WORK = 1000 bytes of text", "{{ 'x' * 2000 }}")
            fails("the template built more than MAX_WORK = 1000 bytes of text", "{{ [1] * 2000 }}")
        end)
    end)

    it("survive values Lua can build and Python cannot (cycles)", function()
        local cyclic, other = {}, {}
        cyclic[1], other[1] = cyclic, other
        fails("value nested too deeply to print", "{{ c }}", { c = cyclic })
        fails("value nested too deeply for tojson", "{{ c | tojson }}", { c = cyclic })
        fails("values nested too deeply to compare", "{{ c == d }}", { c = cyclic, d = other })
    end)
end)

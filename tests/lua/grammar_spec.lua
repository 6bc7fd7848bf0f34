-- grammar_spec.lua: tinyloop.grammar (SPEC §8): gbnf, json_schema, matches, combinators,
-- shipped grammars, cfg.grammar in every decoder, and the error convention.
local H = require "helpers"
local tinyloop = require "tinyloop"
local G = tinyloop.grammar

local austen = assert(tinyloop.load(H.ROOT .. "/models/tinyloop-austen", { threads = 1 }))

describe("tinyloop.grammar", function()
    it("compiles GBNF and matches whole texts", function()
        local g = assert(G.gbnf('root ::= "a" [0-9]{1,3} ("x" | "y")?'))
        assert.is_true(g:matches("a12x"))
        assert.is_false(g:matches("a1234"))
        assert.is_false(g:matches("a"))
    end)
    it("returns nil, err with line, column and rule for bad grammars", function()
        local g, err = G.gbnf('root ::= item\nitem ::= "a" | [b-')
        assert.is_nil(g)
        assert.matches("line 2, column 16: unterminated character class", err, 1, true)
        assert.matches("(in rule 'item')", err, 1, true)
        assert.matches("undefined rule 'x'", select(2, G.gbnf("root ::= x")), 1, true)
        assert.matches("left%-recursive", select(2, G.gbnf('root ::= root "a"')))
        assert.matches("empty grammar", select(2, G.gbnf("")), 1, true)
    end)
    it("reads long grammars and surrogate pairs, and leads no text into a dead end", function()
        -- a rule defined past line 2047 (its packed line number overflowed into "undefined"),
        -- and one defined twice there (which went unnoticed)
        local pad = ("# padding\n"):rep(3000)
        assert.is_true(assert(G.gbnf('root ::= x\n' .. pad .. 'x ::= "a"\n')):matches("a"))
        local twice, err = G.gbnf('root ::= x\n' .. pad .. 'x ::= "a"\n' .. pad .. 'x ::= "b"\n')
        assert.is_nil(twice)
        assert.matches("line 6003, column 1: rule 'x' is defined twice (first at line 3002, column 1)", err, 1, true)
        -- a surrogate pair written as JSON writes it is its one character; a lone one is refused
        assert.is_true(assert(G.gbnf('root ::= "\\uD83D\\uDE00"')):matches("\u{1F600}"))
        assert.matches("a UTF-16 surrogate is not a character", select(2, G.gbnf('root ::= "\\uDE00x"')), 1, true)
        -- a comment ends at a lone \r too (llama.cpp's reading of old Mac line ends)
        assert.is_true(assert(G.gbnf('root ::= "a" x # comment\rx ::= "b"')):matches("ab"))
        -- a rule that never ends is refused (tokens would go where no text finishes); one
        -- with an alternative that ends is taken
        assert.matches("rule 'x' never ends", select(2, G.gbnf('root ::= "a" x | "b"\nx ::= "c" x')), 1, true)
        assert.is_true(assert(G.gbnf('root ::= "a" x | "b"\nx ::= "c" x | "c"')):matches("acc"))
        -- a class without characters is no way on: "a" then leads nowhere, so it is no prefix
        local dead = assert(G.gbnf('root ::= "a" [^\\x00-\\U0010FFFF] | "b"'))
        assert.same({ false, true }, { dead:matches_prefix("a"), dead:matches_prefix("b") })
        -- a run of 1,500 nullable items (expanded 1,500 calls deep: a work list, no recursion)
        local many = assert(G.gbnf('root ::= ("a"?){1500} "b"'))
        assert.same({ true, false }, { many:matches(("a"):rep(700) .. "b"), many:matches(("a"):rep(1501) .. "b") })
    end)
    it("converts JSON Schema without loosening it: oneOf where disjoint, allOf's own keys, exact bounds", function()
        -- oneOf: branches no value can match twice (types, const values, a discriminator) are
        -- taken; overlapping ones refused (a grammar cannot refuse a value for matching both)
        local g = assert(G.json_schema('{"oneOf":[{"type":"string"},{"type":"integer"}]}'))
        assert.same({ true, true, false }, { g:matches('"a"'), g:matches("5"), g:matches("null") })
        g = assert(G.json_schema('{"oneOf":[{"$ref":"#/$defs/cat"},{"$ref":"#/$defs/dog"}],"$defs":{' ..
            '"cat":{"type":"object","properties":{"kind":{"const":"cat"},"lives":{"type":"integer"}},"required":["kind"]},' ..
            '"dog":{"type":"object","properties":{"kind":{"enum":["dog","puppy"]}},"required":["kind"]}}}'))
        assert.same({ true, true, false }, { g:matches('{"kind":"cat","lives":9}'), g:matches('{"kind":"puppy"}'),
                                             g:matches('{"kind":"cow"}') })
        assert.matches("oneOf: a value may match both branch 0 and branch 1",
                       select(2, G.json_schema('{"oneOf":[{"type":"integer"},{"type":"number"}]}')), 1, true)
        assert.matches("oneOf: a value may match both branch 1 and branch 2",
                       select(2, G.json_schema('{"oneOf":[{"const":1},{"enum":[2,3]},{"enum":[3,4]}]}')), 1, true)
        -- an object that declares no keys is any object; one that declares some stays closed
        assert.is_true(assert(G.json_schema('{"type":"object"}')):matches('{"a":[1,{"b":null}]}'))
        assert.is_false(assert(G.json_schema('{"type":"object","properties":{"a":{}}}')):matches('{"b":1}'))
        -- a surrogate pair's escape is one character, a lone surrogate's none
        g = assert(G.json_schema('{"type":"string","maxLength":1}'))
        assert.same({ true, false }, { g:matches('"\\ud83d\\ude00"'), g:matches('"\\ud83d"') })
        -- refused, named: what the grammar would loosen, or could not write
        for _, case in ipairs({
            { '{"allOf":[{"properties":{"a":{"type":"integer"}},"additionalProperties":false},{"properties":{"b":{}}}]}',
              "allOf: additionalProperties (other than true) is supported only in the branch that declares every property" },
            -- the closing branch declares nothing: {"a":1} matched the merge, and allOf refuses it
            { '{"allOf":[{"type":"object","additionalProperties":false},{"type":"object","properties":{"a":{"type":"integer"}}}]}',
              "allOf: additionalProperties (other than true) is supported only in the branch that declares every property" },
            { '{"allOf":[{"type":"object","additionalProperties":{"type":"string"}},{"type":"object","properties":{"a":{"type":"integer"}}}]}',
              "allOf: additionalProperties (other than true) is supported only in the branch that declares every property" },
            -- "properties" without "type" matches every string too, so a string matches both branches
            { '{"oneOf":[{"properties":{"a":{"type":"integer"}}},{"type":"string"}]}',
              "oneOf: a value may match both branch 0 and branch 1" },
            -- a discriminator tells objects apart, not the strings both types let through
            { '{"oneOf":[{"type":["object","string"],"properties":{"k":{"const":"a"}},"required":["k"]},' ..
              '{"type":["object","string"],"properties":{"k":{"const":"b"}},"required":["k"]}]}',
              "oneOf: a value may match both branch 0 and branch 1" },
            { '{"oneOf":[{"allOf":[{"properties":{"a":{}}}]},{"type":"null"}]}', "oneOf: a value may match both branch 0 and branch 1" },
            { '{"type":"integer","maximum":99999999999999999}', "'maximum' must be a number below 2^53" },
            -- (2^53 + 1 reads as 2^53: a bound one off, refused)
            { '{"type":"integer","minimum":9007199254740993}', "'minimum' must be a number below 2^53" },
            { '{"type":"integer","exclusiveMaximum":-9007199254740992}', "'exclusiveMaximum' must be a number below 2^53" },
            { '{"const":"a\\u0000b"}', "a string holding U+0000" },
            { '{"enum":[1e400]}', "a number in 'const' or 'enum' must be below 2^53 (9007199254740992) in magnitude" },
            -- (2^53 + 1 reads as 2^53: the grammar wrote another value, the one given refused)
            { '{"const":9007199254740993}', "a number in 'const' or 'enum' must be below 2^53" },
            { '{"enum":[1, [-1e17]]}', "a number in 'const' or 'enum' must be below 2^53" },
            { '{"type":["object","object"],"properties":{"a":{}}}', "'type' lists 'object' twice" },
        }) do
            assert.matches(case[2], select(2, G.json_schema(case[1])), 1, true)
        end
        -- the branch with additionalProperties declares every key: exact, taken
        g = assert(G.json_schema('{"allOf":[{"type":"object","properties":{"a":{}},"additionalProperties":false},' ..
                                 '{"type":"object","required":["a"]}]}'))
        assert.same({ true, false, false }, { g:matches('{"a":1}'), g:matches('{"b":1}'), g:matches('{}') })
        -- untyped branches whose grammars write objects only, told apart by a discriminator: the
        -- grammar lets through no value both match (only objects, and their "k" differs)
        g = assert(G.json_schema('{"oneOf":[{"properties":{"k":{"const":"a"}},"required":["k"]},' ..
                                 '{"properties":{"k":{"const":"b"}},"required":["k"]}]}'))
        assert.same({ true, true, false }, { g:matches('{"k":"a"}'), g:matches('{"k":"b"}'), g:matches('"s"') })
        -- a oneOf branch through 8 levels of anyOf, each of 12 $refs to the next level: each
        -- definition's types are found once (walked once per path, this took longer than a CI run)
        local defs = {}
        for level = 0, 7 do
            local refs = {}
            for b = 1, 12 do refs[b] = '{"$ref":"#/$defs/d' .. (level + 1) .. '"}' end
            defs[#defs + 1] = '"d' .. level .. '":{"anyOf":[' .. table.concat(refs, ",") .. ']}'
        end
        defs[#defs + 1] = '"d8":{"type":"string"}'
        g = assert(G.json_schema('{"$defs":{' .. table.concat(defs, ",") ..
                                 '},"oneOf":[{"$ref":"#/$defs/d0"},{"type":"integer"}]}'))
        assert.same({ true, true, false }, { g:matches('"s"'), g:matches("7"), g:matches("null") })
        -- 250 optional prefixItems (a chain of rules: nested in one, they passed the parser's 200)
        local items = {}
        for i = 1, 250 do items[i] = '{"const":' .. i .. '}' end
        g = assert(G.json_schema('{"type":"array","prefixItems":[' .. table.concat(items, ",") .. '],"items":false}'))
        assert.same({ true, true, false }, { g:matches("[1,2,3]"), g:matches("[]"), g:matches("[1,3]") })
        -- an empty Lua table under an array keyword is [] (it was {}, refused as no array)
        assert.is_true(assert(G.json_schema({ type = "object", properties = { a = { type = "integer" } }, required = {} })):matches("{}"))
    end)
    it("holds a schema's literals and names as JSON writers spell them (checked against Python's jsonschema)", function()
        -- const and enum numbers exact: cJSON's 15 digits made 0.30000000000000004 the 0.3 it is not
        local g = assert(G.json_schema('{"enum": [0.30000000000000004, 9007199254740991, 1.0000000000000002, -0.0]}'))
        assert.same({ true, true, true, true, false, false, false },
                    { g:matches("0.30000000000000004"), g:matches("9007199254740991"), g:matches("1.0000000000000002"),
                      g:matches("0"), g:matches("0.3"), g:matches("9.00719925474099e+15"), g:matches("1") })
        -- and values one ulp apart are two values (oneOf's branches do not meet)
        g = assert(G.json_schema('{"oneOf": [{"const": 0.1}, {"const": 0.10000000000000002}]}'))
        assert.same({ true, true }, { g:matches("0.1"), g:matches("0.10000000000000002") })
        -- a declared name's control characters as the short escapes where JSON has them
        g = assert(G.json_schema('{"type": "object", "properties": {"a\\tb": {"type": "integer"}, "c\\u0001": {}}, ' ..
                                 '"required": ["a\\tb"]}'))
        assert.same({ true, true }, { g:matches('{"a\\tb":1}'), g:matches('{"a\\tb":1,"c\\u0001":2}') })
        -- free blanks on both sides of ':', declared and extra keys alike
        g = assert(G.json_schema('{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": true}',
                                 { whitespace = "free" }))
        assert.is_true(g:matches('{ "a" : 1 , "b" : 2 }'))
        -- free blanks as a pretty-printer writes them: an indent of 4, three levels deep (at
        -- most 9 blanks were taken), CRLF line ends; bounded (21 blanks, three line breaks)
        g = assert(G.json_schema('{"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": ' ..
                                 '"object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}}, "required": ["b"]}}, ' ..
                                 '"required": ["a"]}', { whitespace = "free" }))
        assert.same({ true, true, false, false },
                    { g:matches('{\n    "a": {\n        "b": {\n            "c": 1\n        }\n    }\n}'),
                      g:matches('{\r\n  "a": {"b": {"c": 1}}\r\n}'), g:matches('{"a": {"b": {"c":' .. (" "):rep(21) .. '1}}}'),
                      g:matches('{"a":\n\n\n{"b": {"c": 1}}}') })
        -- after a string as after any value (a string's own blanks and a second run followed it)
        g = assert(G.json_schema('{"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, ' ..
                                 '"required": ["a", "b"]}', { whitespace = "free" }))
        assert.same({ true, false, false }, { g:matches('{"a": "x" , "b": 1}'), g:matches('{"a": "x"  , "b": 1}'),
                                              g:matches('{"a": "x" \n\n\n, "b": 1}') })
        -- a const or enum array or object takes free blanks inside as well ([1, 2] was refused)
        g = assert(G.json_schema('{"enum": [[1, 2], {"a": [true]}, {}]}', { whitespace = "free" }))
        assert.same({ true, true, true, true, false },
                    { g:matches("[1, 2]"), g:matches('{ "a" : [ true ] }'), g:matches("{ }"), g:matches("[1,2]"), g:matches("[2, 1]") })
        g = assert(G.json_schema('{"enum": [[1, 2]]}'))
        assert.same({ true, false }, { g:matches("[1,2]"), g:matches("[1, 2]") })
        -- schemas as pydantic and zod write them (each was refused): a union of models whose tag
        -- has a default (not required: each branch requires a name the other never writes)
        local text_or_image = '{"$defs": {"Text": {"properties": {"type": {"const": "text", "default": "text", "type": "string"}, ' ..
            '"text": {"type": "string"}}, "required": ["text"], "type": "object"}, "Image": {"properties": {"type": {"const": ' ..
            '"image", "default": "image", "type": "string"}, "url": {"type": "string"}}, "required": ["url"], "type": "object"}}, ' ..
            '"oneOf": [{"$ref": "#/$defs/Text"}, {"$ref": "#/$defs/Image"}], "discriminator": {"propertyName": "type"}}'
        g = assert(G.json_schema(text_or_image))
        assert.same({ true, true, false }, { g:matches('{"type":"text","text":"a"}'), g:matches('{"url":"u"}'),
                                             g:matches('{"type":"text","url":"u"}') })
        -- ...while branches a value may meet stay refused, loosely read as anyOf (oneOf only narrows)
        local overlapping = '{"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, ' ..
                            '{"type": "object", "properties": {"b": {"type": "string"}}}]}'
        assert.is_nil((G.json_schema(overlapping)))
        assert.same({ true, true }, { assert(G.json_schema(overlapping, { loose = true })):matches('{"a":"x"}'),
                                      assert(G.json_schema(overlapping, { loose = true })):matches("{}") })
        -- a pattern beside a format: the pattern (zod writes each format's own pattern beside it)
        g = assert(G.json_schema('{"type": "string", "format": "email", "pattern": "^[^@]+@[^@]+$"}'))
        assert.same({ true, false }, { g:matches('"a@b"'), g:matches('"ab"') })
        -- loosely, a pattern that cannot be enforced is left out (pydantic's Decimal: a lookahead)
        local decimal = '{"type": "string", "pattern": "^(?!^[-+.]*$)[+-]?0*\\\\d*\\\\.?\\\\d*$"}'
        assert.is_nil((G.json_schema(decimal)))
        assert.is_true(assert(G.json_schema(decimal, { loose = true })):matches('"anything"'))
        -- counts past the grammar's bounds: refused, loosely left out (Claude Code's Workflow
        -- tool, a script of maxLength 524288, failed its whole request)
        local big = '{"type": "object", "properties": {"s": {"type": "string", "maxLength": 524288}, ' ..
                    '"l": {"type": "array", "minItems": 2000}}}'
        assert.is_nil((G.json_schema(big)))
        assert.is_true(assert(G.json_schema(big, { loose = true })):matches('{"s":"abc","l":[1]}'))
        assert.truthy(G.json_schema('{"type": "string", "maxLength": 1e20}', { loose = true })) -- (past 2^53 too)
        -- OpenAPI's null (zod's z.null()), and propertyNames every name meets (zod's z.record)
        g = assert(G.json_schema('{"type": "string", "nullable": true, "enum": [null]}'))
        assert.same({ true, false }, { g:matches("null"), g:matches('"a"') })
        g = assert(G.json_schema('{"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "integer"}}'))
        assert.same({ true, false }, { g:matches('{"a":1}'), g:matches('{"a":"x"}') })
        assert.is_nil((G.json_schema('{"type": "object", "propertyNames": {"maxLength": 2}}')))
        -- -0 is 0: in a bounded integer's range and a non-negative number (it was refused)
        local function m(schema, text) return assert(G.json_schema(schema)):matches(text) end
        assert.same({ true, true, false, false },
                    { m('{"type": "integer", "minimum": 0}', "-0"), m('{"type": "integer", "maximum": 3}', "-0"),
                      m('{"type": "integer", "minimum": 1}', "-0"), m('{"type": "integer", "maximum": -1}', "-0") })
        assert.same({ true, true, false, false },
                    { m('{"type": "number", "minimum": 0}', "-0"), m('{"type": "number", "minimum": 0}', "-0.00e3"),
                      m('{"type": "number", "minimum": 0}', "-0.5"), m('{"type": "number", "minimum": 0}', "-1") })
        -- a pattern's \n in a class (a JSON string's control characters are what \x0a names)
        g = assert(G.json_schema('{"type": "string", "pattern": "^[^\\\\n]*$"}'))
        assert.same({ true, false }, { g:matches('"a b"'), g:matches('"a\\nb"') })
        -- RFC 3339's fraction of a second has any number of digits: up to 16 here, as a
        -- number's (a model may write them without end)
        local stamp = assert(G.json_schema('{"type": "string", "format": "date-time"}'))
        assert.same({ true, true, false }, { stamp:matches('"2020-01-01T12:00:00.123456789+01:00"'),
                                             stamp:matches('"2020-01-01T12:00:00.' .. ("1"):rep(16) .. 'Z"'),
                                             stamp:matches('"2020-01-01T12:00:00.' .. ("1"):rep(17) .. 'Z"') })
        -- an $id below the root would be the base of its own $refs: refused, not read from the root
        local _, err = G.json_schema('{"$defs": {"node": {"$id": "https://e.com/node", "properties": {"next": {"$ref": "#"}}}}, ' ..
                                     '"items": {"$ref": "#/$defs/node"}}')
        assert.truthy(err and err:find("'$id' below the root", 1, true), err)
        assert.is_true(assert(G.json_schema('{"$id": "https://e.com/root", "type": "integer"}')):matches("1"))
    end)
    it("raises for arguments of the wrong type", function()
        assert.has_error(function() G.gbnf(42) end)
        assert.has_error(function() G.json_schema(42) end)
    end)
    it("converts JSON Schema given as a table or a JSON string", function()
        local s = assert(G.json_schema({ type = "object", properties = { n = { type = "integer", minimum = 1, maximum = 9 } },
                                         required = { "n" } }))
        assert.is_true(s:matches('{"n":7}'))
        assert.is_false(s:matches('{"n":10}'))
        local t = assert(G.json_schema('{"type":"array","items":{"type":"boolean"},"maxItems":2}', { whitespace = "free" }))
        assert.is_true(t:matches("[true, false]"))
        assert.is_false(t:matches("[true,false,true]"))
        local g, err = G.json_schema({ type = "string", contentMediaType = "x" })
        assert.is_nil(g)
        assert.matches("unsupported keyword 'contentMediaType'", err, 1, true)
        assert.matches("::=", s:gbnf(), 1, true)
        -- loose: what only narrows and cannot be enforced is left out (a superset)
        local loose = assert(G.json_schema({ type = "string", format = "email", contentMediaType = "x" }, { loose = true }))
        assert.is_true(loose:matches('"anything"'))
        assert.is_false(loose:matches("3"))
        assert.has_error(function() G.json_schema({ type = "string" }, { loose = 1 }) end,
                         "tinyloop.grammar.json_schema: opts.loose must be a boolean")
        -- a misspelt option is named, not ignored ({free_whitespace = true} gave compact JSON),
        -- in tags' options and entries too
        assert.has_error(function() G.json_schema({ type = "string" }, { free_whitespace = true }) end,
                         "tinyloop.grammar.json_schema: unknown opts field 'free_whitespace' (loose, whitespace)")
        assert.has_error(function() G.json_schema_gbnf({ type = "string" }, { Loose = true }) end,
                         "tinyloop.grammar.json_schema_gbnf: unknown opts field 'Loose' (loose, whitespace)")
        local word = assert(G.regex("[a-z]+"))
        assert.has_error(function() G.tags({ { begin = "<a>", content = word, ["end"] = "</a>" } }, { "<a>" }, { max_blank = 1 }) end,
                         "tinyloop.grammar.tags: unknown opts field 'max_blank' (at_least_one, max_blanks, tag_first)")
        assert.has_error(function() G.tags({ { begin = "<a>", content = word, stop = "</a>" } }, { "<a>" }) end,
                         "tinyloop.grammar.tags: unknown tags[1] field 'stop' (begin, content, end, ends_text)")
    end)
    it("compiles regular expressions (vLLM's regex): the whole text matches, nil, err for what is refused", function()
        local g = assert(G.regex("(Emma|Harriet) [a-z]{2,8}\\.\\n?"))
        assert.is_true(g:matches("Emma smiled."))
        assert.is_true(g:matches("Harriet is.\n"))
        assert.is_false(g:matches("Emma smiled"))
        assert.is_false(g:matches("Jane smiled."))
        assert.matches("root ::= ", g:gbnf(), 1, true)
        -- the GBNF it shows compiles to the same language
        local again = assert(G.gbnf(g:gbnf()))
        assert.is_true(again:matches("Emma smiled."))
        -- a repeated item that may be empty
        local words = assert(G.regex("([a-z]*,? ?)+!"))
        assert.is_true(words:matches("a, b c!"))
        assert.is_true(words:matches("!"))
        assert.is_false(words:matches("A!"))
        for pattern, needle in pairs({ ["a(?=b)"] = "lookahead", ["(a)\\1"] = "backreferences", ["a{2,1}"] = "bad quantifier",
                                       ["[a"] = "unterminated '['", ["a*+"] = "possessive" }) do
            local bad, err = G.regex(pattern)
            assert.is_nil(bad, pattern)
            assert.matches("regular expression: ", err, 1, true)
            assert.matches(needle, err, 1, true)
        end
        assert.has_error(function() G.regex(42) end, "tinyloop.grammar.regex: pattern must be a string")
    end)
    it("tells a partial output that can still be completed (matches_prefix)", function()
        local g = assert(G.gbnf('root ::= "yes" | "no"'))
        assert.is_true(g:matches_prefix(""))
        assert.is_true(g:matches_prefix("ye"))
        assert.is_true(g:matches_prefix("yes"))
        assert.is_false(g:matches_prefix("yes!"))
        assert.is_false(g:matches_prefix("x"))
        assert.has_error(function() g:matches_prefix(5) end, "grammar:matches_prefix: text must be a string")
    end)
    it("compiles a kind chosen at run time (from_text)", function()
        assert.is_true(assert(G.from_text("gbnf", 'root ::= "a"+')):matches("aa"))
        assert.is_true(assert(G.from_text("regex", "[0-9]{2}")):matches("42"))
        local schema = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
        assert.same({ true, false }, { assert(G.from_text("json_schema", schema, true)):matches('{"a": 1}'),
                                       assert(G.from_text("json_schema", schema)):matches('{"a": 1}') })
        assert.is_nil((G.from_text("gbnf", "root ::= (")))
        assert.has_error(function() G.from_text("lua", "x") end,
                         'tinyloop.grammar.from_text: kind must be "gbnf", "regex" or "json_schema"')
    end)
    it("gives a JSON Schema's GBNF text without compiling it (json_schema_gbnf)", function()
        local schema = { type = "object", properties = { a = { type = "integer" } }, required = { "a" } }
        for _, opts in ipairs({ {}, { whitespace = "free" }, { loose = true } }) do
            assert.equal(assert(G.json_schema(schema, opts)):gbnf(), assert(G.json_schema_gbnf(schema, opts)))
        end
        local none, err = G.json_schema_gbnf('{"type": "strung"}')
        assert.is_nil(none)
        assert.matches("strung", err)
        assert.has_error(function() G.json_schema_gbnf(5) end, "tinyloop.grammar.json_schema_gbnf: schema must be a table or a JSON string")
        assert.has_error(function() G.json_schema_gbnf("{}", { whitespace = "some" }) end)
    end)
    it("reports the memory it holds (grammar:memory)", function()
        local g = assert(G.gbnf('root ::= "{" [a-z]* "}"'))
        local fresh = assert(g:memory())
        assert.is_true(fresh.program_bytes > 0 and fresh.table_bytes > 0)
        assert.same({ 0, 0, 1, 0 }, { fresh.mask_bytes, fresh.vocab_bytes, fresh.generations, fresh.restarts })
        assert.equal(fresh.program_bytes + fresh.table_bytes + fresh.mask_bytes, fresh.own_bytes)
        -- matching documents interns their states: the tables grow
        for i = 1, 50 do assert.is_true(g:matches("{" .. ("abcdefghij"):sub(1, i % 10) .. "}")) end
        assert.is_true(g:memory().table_bytes >= fresh.table_bytes)
        -- trimmed, it holds what a fresh one does, and matches as before
        assert.is_true(g:trim())
        local trimmed = g:memory()
        assert.same({ fresh.table_bytes, 1, 1 }, { trimmed.table_bytes, trimmed.generations, trimmed.restarts })
        assert.is_true(g:matches("{abc}"))
        assert.is_false(g:matches("{abc"))
    end)
    it("compiles in a thread of nginx's pool (tinyloop.server.wait.compile), and the handler adopts the grammar", function()
        local ffi = require "ffi"
        local wait = require "tinyloop.server.wait"
        local C = tinyloop.C
        -- (declared there without the binding's cdef, which a new thread VM would pay for)
        assert.equal(ffi.sizeof("tl_json_schema_options"), ffi.sizeof(wait.schema_options))
        for _, field in ipairs({ "free_whitespace", "loose" }) do
            assert.equal(ffi.offsetof("tl_json_schema_options", field), ffi.offsetof(wait.schema_options, field), field)
        end
        local fns = {}
        for kind, fn in pairs({ gbnf = C.tl_grammar_compile_gbnf, regex = C.tl_grammar_compile_regex,
                                json_schema = C.tl_grammar_compile_json_schema, free = C.tl_compiled_grammar_free,
                                last_error = C.tl_last_error }) do
            fns[kind] = tonumber(ffi.cast("uintptr_t", fn))
        end
        local schema = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
        local g = G.adopt(assert(wait.compile(fns, "json_schema", schema, false, false)))
        assert.is_true(g:matches('{"a":12}'))
        assert.is_false(g:matches('{"a": 12}')) -- (compact)
        local free = G.adopt(assert(wait.compile(fns, "json_schema", schema, true, false)))
        assert.is_true(free:matches('{"a": 12}'))
        -- compiled and never adopted (the client left): freed by the next compile (ASan: no leak)
        assert.is_number(wait.compile(fns, "gbnf", 'root ::= "x"'))
        local re = G.adopt(assert(wait.compile(fns, "regex", "[0-9]{2}")))
        assert.same({ true, false }, { re:matches("42"), re:matches("4") })
        -- the adopted ones live on after the compiles that followed them
        assert.is_true(g:matches('{"a":1}'))
        local none, err = wait.compile(fns, "gbnf", "root ::= (")
        assert.is_nil(none)
        assert.matches("expected", err)
        assert.same({ nil, "no grammar kind 'lua'" }, { wait.compile(fns, "lua", "x") })
    end)
    it("counts the server cache's grammars once each, a grammar that is its own reasoning variant too", function()
        -- (request.lua without nginx: a permissive grammar already writes a <think> block, so
        -- its variant after the reasoning is itself; it was counted twice)
        local cjson = require "cjson"
        local request = require "tinyloop.server.request"
        local function parse(gbnf)
            local req, err = request.parse(cjson.encode({ prompt = "x", max_tokens = 4, grammar = gbnf }), austen, "m", 8, {})
            assert(req, type(err) == "table" and err.message or tostring(err))
            return req.cfg.grammar
        end
        local any = parse('root ::= [^\\x00]*\n')
        assert.equal(any, request.after_reasoning(any, false, true))
        local other = parse('root ::= "b"\n') -- (a lookup: the cache counts its bytes anew)
        local grammars, bytes = request.grammar_cache_stats()
        assert.same({ 2, any:memory().own_bytes + other:memory().own_bytes }, { grammars, bytes })
        -- evicted (a budget of nothing keeps only the grammar in hand), each is trimmed once
        request.set_grammar_cache_budget(0)
        parse('root ::= "c"\n')
        local grammars = request.grammar_cache_stats()
        assert.equal(1, grammars)
        assert.equal(1, any:memory().restarts)
        request.set_grammar_cache_budget(256 * 1048576)
    end)
    it("reads xgrammar's triggered tags as xgrammar does: at_least_one begins with a tag, any_text ends at its end", function()
        local request = require "tinyloop.server.request"
        local function parse(format)
            local body = '{"prompt": "x", "max_tokens": 4, "response_format": {"type": "structural_tag", "format": ' .. format .. '}}'
            local req, err = request.parse(body, austen, "m", 8, {})
            assert(req, type(err) == "table" and err.message or tostring(err))
            return req.cfg.grammar
        end
        -- (text before the first tag was let through: at_least_one read as "a tag somewhere")
        local g = parse('{"type": "triggered_tags", "triggers": [" the"], "tags": [{"type": "tag", "begin": " the[", ' ..
                        '"content": {"type": "regex", "pattern": "[0-9]{2}"}, "end": "]"}], "at_least_one": true, ' ..
                        '"stop_after_first": true}')
        assert.same({ true, false, false }, { g:matches(" the[13]"), g:matches(", and that is not the[13]"), g:matches(" the[13] x") })
        -- any text up to the first place the end appears ("eeee" went through for an end "ee")
        g = parse('{"type": "triggered_tags", "triggers": ["e"], "tags": [{"type": "tag", "begin": "e", ' ..
                  '"content": {"type": "any_text"}, "end": "ee"}], "stop_after_first": true}')
        assert.same({ true, true, false, false }, { g:matches("eee"), g:matches("x exee"), g:matches("eeee"), g:matches("exeex") })
        g = parse('{"type": "triggered_tags", "triggers": ["<a"], "tags": [{"type": "tag", "begin": "<a>", ' ..
                  '"content": {"type": "any_text"}, "end": "```"}], "stop_after_first": true}')
        assert.same({ true, true, false }, { g:matches("<a>x```"), g:matches("hi <a>```"), g:matches("<a>x````") })
    end)
    it("opens grammars from free text at triggers (grammar.tags)", function()
        local digit = assert(G.gbnf('root ::= "{" [0-9] "}"'))
        local g = assert(G.tags({ { begin = "<f=a>", content = digit, ["end"] = "</f>" },
                                  { begin = "<f=b>", content = digit, ends_text = true } }, { "<f=" }))
        assert.is_true(g:matches("hi <f=a>{1}</f> and <f=b>{2}"))
        assert.is_false(g:matches("<f=b>{2} more"))
        assert.is_false(g:matches("<f=c>"))
        local one = assert(G.tags({ { begin = "<f=a>", content = digit } }, { "<f=" }, { at_least_one = true, max_blanks = 1 }))
        assert.is_false(one:matches("no tag"))
        assert.is_true(one:matches("<f=a> {3}"))
        -- tag_first: no text before the first tag
        local first = assert(G.tags({ { begin = "<f=a>", content = digit, ["end"] = "</f>" } }, { "<f=" }, { tag_first = true }))
        assert.same({ true, true, false, false }, { first:matches("<f=a>{1}</f>"), first:matches("<f=a>{1}</f> then <f=a>{2}</f>"),
                                                    first:matches("hi <f=a>{1}</f>"), first:matches("") })
        -- a NUL inside would be cut by C: refused, as C's refusals are, with nil, err
        local bad, err = G.tags({ { begin = "<f\0=a>", content = digit } }, { "<f" })
        assert.is_nil(bad)
        assert.matches("holds a NUL byte", err, 1, true)
        bad, err = G.tags({ { begin = "<f=a>", content = digit } }, { "<g" })
        assert.is_nil(bad)
        assert.matches("tags[1]'s begin \"<f=a>\" starts with no trigger", err, 1, true)
        -- (a begin's own "[5]" is not renumbered as a place in the list)
        bad, err = G.tags({ { begin = "<tags[5]>", content = digit } }, { "<g" })
        assert.is_nil(bad)
        assert.matches("tags[1]'s begin \"<tags[5]>\" starts with no trigger", err, 1, true)
        assert.has_error(function() G.tags({}, { "x" }) end, "tinyloop.grammar.tags: tags must be a non-empty list")
        assert.has_error(function() G.tags({ { begin = "x", content = "root" } }, { "x" }) end)
        assert.has_error(function() G.tags({ { begin = "x", content = digit } }, { "x" }, { max_blanks = 1e20 }) end,
                         "tinyloop.grammar.tags: max_blanks must be an integer")
    end)
    it("lets a model write an optional block first (grammar.after_block), then the grammar", function()
        local g = assert(G.after_block("<think>", "</think>", assert(G.gbnf('root ::= "yes" | "no"'))))
        assert.is_true(g:matches("yes"))
        assert.is_true(g:matches("<think>Hm, {x}.</think>\n\nno"))
        assert.is_false(g:matches("maybe"))
        assert.is_false(g:matches("<think>a</think>maybe"))
        assert.has_error(function() G.after_block("<think>", nil, g) end, "tinyloop.grammar.after_block: open and close must be strings")
        local bad, err = G.after_block("", "</think>", g)
        assert.is_nil(bad)
        assert.matches("open and close must be 1 to 256 bytes", err, 1, true)
    end)
    it("leaves the text free until a trigger, then constrains what follows (grammar.after)", function()
        local answer = assert(G.json_schema('{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'))
        local g = assert(G.after("</think>", answer))
        assert.is_true(g:matches("<think>Any text, even {]</think>\n\n{\"a\":1}"))
        assert.is_true(g:matches("still thinking"))
        assert.is_false(g:matches("</think>not JSON"))
        assert.is_false(g:matches('</think>{"a":1} and more'))
        local bad, err = G.after("", answer)
        assert.is_nil(bad)
        assert.matches("the trigger must be 1 to 256 bytes", err, 1, true)
        assert.has_error(function() G.after("</think>", "root ::= x") end, "tinyloop.grammar.after: g must be a compiled grammar")
        assert.has_error(function() G.after(nil, answer) end, "tinyloop.grammar.after: trigger must be a string")
    end)
    it("builds grammars from combinators", function()
        local g = assert(G.build{ root = G.seq("(", G.rep(G.class("0-9"), 1, 3), G.ref("close")), close = G.alt(")", "]") })
        assert.is_true(g:matches("(12)"))
        assert.is_true(g:matches("(1]"))
        assert.is_false(g:matches("(1234)"))
        assert.is_true(assert(G.build(G.plus(G.lit("ab")))):matches("abab"))
        -- a class spec in GBNF syntax: an escape already written is kept ("a\\]" was made
        -- "[a\\\\]]"), a bare ']' is escaped
        local cls = assert(G.build(G.class("a\\]")))
        assert.same({ true, true, false }, { cls:matches("]"), cls:matches("a"), cls:matches("\\") })
        assert.is_true(assert(G.build(G.class("x]"))):matches("]"))
        -- token references: their GBNF, and the refusals
        assert.equal("root ::= (<think> (!<[7]>){0,} <[7]>)\n",
                     assert(G.build(G.seq(G.token("<think>"), G.star(G.not_token(7)), G.token(7)))):gbnf())
        assert.has_error(function() G.token(-1) end, "tinyloop.grammar.token: a token id must be an integer >= 0")
        assert.has_error(function() G.not_token("think") end,
                         'tinyloop.grammar.not_token: expected a token id or a token\'s text in brackets, such as "<think>"')
        assert.has_error(function() G.token("<a>b>") end)
    end)
    it("ships grammars", function()
        for _, name in ipairs({ "json", "json_array_of_strings", "arithmetic", "list", "yes_no" }) do
            assert(G.shipped(name), name)
        end
        assert.is_true(G.shipped("json"):matches('{"a": [1, "x", null]}'))
    end)
end)

describe("cfg.grammar with a compiled grammar", function()
    local json = assert(G.shipped("json_array_of_strings"))
    local function text(ids, n) return austen:decode({ unpack(ids, n + 1) }) end
    local P = austen:encode("List:")
    it("constrains generate, stream, session, generate_batch", function()
        local ids, stats = austen:generate(P, { grammar = json, max_tokens = 120, temperature = 0.9, sample_seed = 5 })
        local out = text(ids, #P):gsub("<|endoftext|>$", "")
        assert.equal("EOS", stats.stop_reason) -- (the grammar let it end: a whole array)
        assert.is_true(json:matches(out), out)
        local pieces = {}
        for _, piece in austen:stream(P, { grammar = json, max_tokens = 60, sample_seed = 1 }) do pieces[#pieces + 1] = piece end
        assert.is_true(json:matches(table.concat(pieces)), table.concat(pieces))
        local yes = assert(G.shipped("yes_no"))
        local batch = austen:generate_batch({ P, P }, { grammar = yes, max_tokens = 8, temperature = 1, sample_seed = 2 })
        for _, b in ipairs(batch) do
            local t = text(b, #P):gsub("<|endoftext|>$", "")
            assert.is_true(yes:matches(t), t)
        end
        local s = austen:session(P, { grammar = yes, max_tokens = 8 })
        local id = s:step()
        assert.is_number(id)
        -- used with the model, a grammar holds masks and a vocabulary trie shared by grammars
        local used, other = assert(json:memory()), assert(yes:memory())
        assert.is_true(used.mask_bytes > 0 and used.vocab_bytes > 0, "masks " .. used.mask_bytes)
        assert.equal(used.vocab_bytes, other.vocab_bytes)
    end)
    it("makes greedy chain and tree speculative decoding equal plain decoding", function()
        local cfg = { grammar = json, max_tokens = 60, loops = 4 }
        local plain = austen:generate(P, cfg)
        for _, mode in ipairs({ "chain", "tree" }) do
            local ids = austen:generate(P, { grammar = json, max_tokens = 60, verify_loops = 4, speculative = mode, draft_loops = 2,
                                             K_branches = mode == "tree" and 2 or nil })
            assert.same(plain, ids)
        end
    end)
    it("constrains generation to a regular expression: seeded samples match it and end where it may end", function()
        local phone = assert(G.regex("\\(?[0-9]{3}\\)? ?[0-9]{3}-[0-9]{4}"))
        for seed = 1, 4 do
            local ids, stats = austen:generate(P, { grammar = phone, max_tokens = 30, temperature = 1, sample_seed = seed })
            assert.equal("EOS", stats.stop_reason)
            local out = text(ids, #P):gsub("<|endoftext|>$", "")
            assert.is_true(phone:matches(out), out)
            assert.truthy(out:match("^%(?%d%d%d%)? ?%d%d%d%-%d%d%d%d$"), out)
        end
    end)
    -- The shipped model with "." marked special (a token no grammar writes as text), as a chat
    -- template's turn end or a thinking model's </think> is.
    local function special_dot_model()
        local cjson = require "cjson"
        local dir = os.tmpname()
        os.remove(dir)
        os.execute("mkdir -p " .. dir)
        local src = H.ROOT .. "/models/tinyloop-austen"
        for _, f in ipairs({ "config.json", "model.safetensors" }) do os.execute(("ln -s %s %s/%s"):format(H.q(src .. "/" .. f), dir, f)) end
        local dot = austen:encode(".")
        assert.equal(1, #dot)
        local tok = cjson.decode(assert(io.open(src .. "/tokenizer.json")):read("*a"))
        table.insert(tok.added_tokens, { id = dot[1], content = ".", single_word = false, lstrip = false, rstrip = false,
                                         normalized = false, special = true })
        local f = assert(io.open(dir .. "/tokenizer.json", "wb"))
        f:write(cjson.encode(tok))
        f:close()
        local m = assert(tinyloop.load(dir, { threads = 1 }))
        os.execute("rm -rf " .. dir)
        return m, dot
    end
    it("matches whole tokens by id, special ones too (llama.cpp's <[id]> and !<[id]>), in every decoder", function()
        local m, dot = special_dot_model()
        local eos = m:info().eos_token_id
        -- words, then the special "." (no text can write it), then the end
        local sentence = assert(G.gbnf(('root ::= [a-zA-Z ,]+ <[%d]>'):format(dot[1])))
        -- three tokens that are anything but "." (special or not), then "." (built from combinators)
        local three = assert(G.build(G.seq(G.rep(G.not_token(dot[1]), 3, 3), G.token(dot[1]))))
        for seed = 1, 4 do
            local ids, stats = m:generate(P, { grammar = sentence, max_tokens = 80, temperature = 1, sample_seed = seed })
            assert.equal("EOS", stats.stop_reason)
            assert.same({ dot[1], eos }, { ids[#ids - 1], ids[#ids] })
            local words = m:decode({ unpack(ids, #P + 1, #ids - 2) })
            assert.truthy(words:match("^[a-zA-Z ,]+$"), words)
            ids, stats = m:generate(P, { grammar = three, max_tokens = 20, temperature = 1.5, sample_seed = seed })
            assert.same({ 5, "EOS", dot[1] }, { #ids - #P, stats.stop_reason, ids[#ids - 1] })
            for i = #P + 1, #P + 3 do assert.are_not.equal(dot[1], ids[i]) end
        end
        -- greedy: plain and speculative decoding agree under it; beam search ends with "." too
        local base = m:generate(P, { grammar = sentence, max_tokens = 80 })
        for _, cfg in ipairs({ { speculative = "chain", draft_loops = 2 }, { speculative = "tree", draft_loops = 2 } }) do
            cfg.grammar, cfg.max_tokens = sentence, 80
            assert.same(base, (m:generate(P, cfg)))
        end
        local beam = m:generate(P, { grammar = sentence, max_tokens = 80, beam_size = 2 })
        assert.same({ dot[1], eos }, { beam[#beam - 1], beam[#beam] })
        -- a name the vocabulary lacks is refused when a generation binds the grammar
        H.error_contains(function() m:generate(P, { grammar = assert(G.gbnf("root ::= <think>")), max_tokens = 4 }) end,
                         "grammar: <think> is not a token of the model's vocabulary")
    end)
    it("lets a special token that ends the text (a chat turn's end) end it wherever the grammar may end", function()
        -- the shipped model with "." marked special (no grammar writes a special token), and a
        -- one-token stop sequence of it, as a chat template's turn end is: under a grammar
        -- whose text is free until a trigger that never comes, the same tokens as without
        -- one, each ending at the stop (the grammar banned it, and every reply ran on)
        local m, dot = special_dot_model()
        local g = assert(G.after("<tool_call>", assert(G.gbnf('root ::= "x"')), 0))
        local stopped = 0
        for seed = 1, 6 do
            local cfg = { max_tokens = 40, temperature = 1, sample_seed = seed, stop_sequences = { { dot[1] } } }
            local free, free_stats = m:generate(P, cfg)
            cfg.grammar = g
            local constrained, stats = m:generate(P, cfg)
            assert.same(free, constrained)
            assert.equal(free_stats.stop_reason, stats.stop_reason)
            if stats.stop_reason == "STOP_SEQUENCE" then stopped = stopped + 1 end
        end
        assert.truthy(stopped >= 4, stopped)
    end)
    it("has a JSON object grammar (OpenAI's JSON mode): the shipped JSON, an object at its top level", function()
        local object, any = assert(G.json_object()), assert(G.shipped("json"))
        for _, text in ipairs({ '{"a": [1, true, null]}', ' {}', '{"b": {"c": "d"}}\n' }) do
            assert.is_true(object:matches(text), text)
        end
        for _, text in ipairs({ "true", "null", '"a"', "12", "[1]" }) do
            assert.is_false(object:matches(text), text)
            assert.is_true(any:matches(text), text)
        end
    end)
    it("ends where the grammar ends, min_tokens or not (its end is not delayed)", function()
        local short = assert(G.gbnf('root ::= "Yes" | "No"'))
        local base = { grammar = short, max_tokens = 20, loops = 4 }
        local ids, stats = austen:generate(P, base)
        assert.equal("EOS", stats.stop_reason)
        local n_new = #ids - #P
        assert.is_true(n_new < 10)
        for _, mode in ipairs({ "plain", "chain", "tree", "beam", "sampled", "sampled chain" }) do
            local cfg = { grammar = short, max_tokens = 20, loops = 4, min_tokens = 10 }
            if mode:find("chain") then cfg.speculative, cfg.draft_loops = "chain", 2 end
            if mode == "tree" then cfg.speculative, cfg.draft_loops = "tree", 2 end
            if mode == "beam" then cfg.beam_size = 2 end
            if mode:find("sampled") then cfg.temperature, cfg.sample_seed = 1, 7 end
            local got, got_stats = austen:generate(P, cfg)
            assert.equal("EOS", got_stats.stop_reason, mode)
            if mode == "plain" or mode == "chain" or mode == "tree" then assert.same(ids, got, mode) end
            assert.is_true(short:matches(text(got, #P):gsub("<|endoftext|>$", "")), mode)
        end
        -- an end a hook banned stays banned: nothing is left, a dead end
        local eos = austen:info().eos_token_id
        local no_eos = function(logits) logits[eos] = -math.huge end
        for _, min_tokens in ipairs({ 0, 10 }) do
            local _, st = austen:generate(P, { grammar = short, max_tokens = 20, loops = 4, min_tokens = min_tokens,
                                               logits_processor = no_eos })
            assert.equal("GRAMMAR_DEAD_END", st.stop_reason, min_tokens)
        end
        -- a one-token stop sequence the grammar ends on ends it, min_tokens or not
        local z = austen:encode("Z")
        assert.equal(1, #z)
        local qz = assert(G.gbnf('root ::= "Q" "Z"'))
        for _, min_tokens in ipairs({ 0, 5 }) do
            local got, st = austen:generate(P, { grammar = qz, max_tokens = 20, loops = 4, min_tokens = min_tokens,
                                                 stop_sequences = { z } })
            assert.equal("STOP_SEQUENCE", st.stop_reason, min_tokens)
            assert.equal("QZ", text(got, #P))
        end
    end)
    it("constrains beam search: each hypothesis keeps its own grammar state", function()
        for _, width in ipairs({ 2, 3 }) do
            local ids, stats = austen:generate(P, { grammar = json, max_tokens = 120, loops = 4, beam_size = width })
            assert.equal("EOS", stats.stop_reason)
            local out = text(ids, #P):gsub("<|endoftext|>$", "")
            assert.is_true(json:matches(out), out)
        end
        -- a grammar that allows every text leaves the search as it is
        local any = assert(G.gbnf("root ::= [\\x00-\\U0010FFFF]*"))
        local cfg = { max_tokens = 40, loops = 4, beam_size = 3 }
        local free = austen:generate(P, cfg)
        cfg.grammar = any
        assert.same(free, austen:generate(P, cfg))
    end)
    it("refuses beam search with a Lua-object grammar, naming the reason", function()
        local lua_grammar = { allowed = function(_, mask) mask[0] = 1 return 1 end, advance = function() end }
        H.error_contains(function() austen:generate(P, { grammar = lua_grammar, beam_size = 2 }) end,
            "callback grammar")
    end)
    it("refuses speculative decoding with a Lua-object grammar", function()
        local lua_grammar = { allowed = function(_, mask) mask[0] = 1 return 1 end, advance = function() end }
        assert.has_error(function() austen:generate(P, { grammar = lua_grammar, speculative = "chain" }) end)
    end)
end)

-- Every refusal rule of the three compilers, fed (an audit found these reached by no test):
-- the status (nil, err) and the rule's own words.
describe("tinyloop.grammar refuses, in the rule's words", function()
    local deep_schema = ('{"type":"array","items":'):rep(70) .. "{}" .. ("}"):rep(70)
    local cases = {
        { "json_schema", '{"type":"object","required":"a"}', "at the root: 'required' must be an array" },
        { "json_schema", '{"type":"string","minLength":5,"maxLength":2}', "at the root: maxLength < minLength" },
        { "json_schema", '{"type":"integer","minimum":5,"maximum":2}', "at the root: minimum > maximum: no integer fits" },
        { "json_schema", '{"type":"array","minItems":3,"maxItems":1}', "at the root: maxItems < minItems" },
        { "json_schema", '{"enum":[]}', "'enum' must be a non-empty array" },
        { "json_schema", '{"type":"object","properties":[]}', "'properties' must be an object" },
        { "json_schema", '{"type":5}', "'type' must be a string or a non-empty array of strings" },
        { "json_schema", "false", "schema 'false' matches nothing" },
        { "json_schema", "5", "a schema must be an object or a boolean" },
        { "json_schema", '{"allOf":[{"type":"string"},{"minLength":1}]}', "allOf is supported for object schemas only" },
        { "json_schema", '{"type":"string","pattern":"a","minLength":1}',
          "'pattern' combined with minLength/maxLength is not supported" },
        { "json_schema", '{"anyOf":[]}', "'anyOf' must be a non-empty array" },
        { "json_schema", '{"type":"string","pattern":5}', "'pattern' must be a string" },
        { "json_schema", '{"type":"string","format":5}', "'format' must be a string" },
        { "json_schema", '{"type":"array","prefixItems":{}}', "'prefixItems' must be an array" },
        { "json_schema", '{"type":"integer","exclusiveMinimum":"x"}', "'exclusiveMinimum' must be a number below 2^53" },
        { "json_schema", '{"$ref":5}', "'$ref' must be a string" },
        { "json_schema", deep_schema, "nested too deeply (more than 64 levels)" },
        { "json_schema", '{"type":"string","pattern":"a\\u0001"}', "pattern: control characters are not supported" },
        { "regex", "[\\q]", "escape '\\q' inside a class is not supported" },
        { "regex", "[\\\1]", "escaping a control or non-ASCII character is not supported" },
        { "regex", "\\\195\169", "escaping a control or non-ASCII character is not supported" },
        { "regex", ("("):rep(1100) .. "a" .. (")"):rep(1100), "regular expression: nested too deeply" },
        { "gbnf", 'root ::= "\\', "line 1, column 11: unfinished escape in a string literal (in rule 'root')" },
        { "gbnf", 'root ::= "\\x4', "line 1, column 11: expected 2 hex digits after the escape (in rule 'root')" },
        { "gbnf", 'root ::= "a"{x}', "line 1, column 14: expected a number in '{m,n}' (in rule 'root')" },
        { "gbnf", "root ::= " .. ("("):rep(1100) .. '"a"' .. (")"):rep(1100), "parentheses nested too deeply (in rule 'root')" },
    }
    for _, case in ipairs(cases) do
        it(case[1] .. ": " .. case[3], function()
            local g, err = H.tinyloop.grammar.from_text(case[1], case[2])
            assert.is_nil(g)
            assert.truthy(err:find(case[3], 1, true), err)
        end)
    end
end)

-- Behaviours the engine's coverage showed no test running (an audit): each against values it
-- must and must not match.
describe("tinyloop.grammar, the paths no test ran", function()
    local function matches(g, yes, no)
        for _, text in ipairs(yes) do assert.is_true(g:matches(text), text) end
        for _, text in ipairs(no) do assert.is_false(g:matches(text), text) end
    end
    it("const and enum values that are objects and arrays", function()
        matches(assert(G.json_schema('{"const":{"a":[1,2]}}')), { '{"a":[1,2]}' }, { '{"a":[1,3]}', '{"a":[1]}' })
        matches(assert(G.json_schema('{"enum":[[1,"x"],{"k":null}]}')), { '[1,"x"]', '{"k":null}' }, { '[1]', '{"k":1}' })
    end)
    it("oneOf's overlap test compares objects by members, arrays by elements", function()
        local g, err = G.json_schema('{"oneOf":[{"const":{"a":1,"b":2}},{"const":{"b":2,"a":1}}]}')
        assert.is_nil(g)
        assert.truthy(err:find("oneOf: a value may match both branch 0 and branch 1", 1, true), err)
        matches(assert(G.json_schema('{"oneOf":[{"const":[1,2]},{"const":[1,3]}]}')), { "[1,2]", "[1,3]" }, { "[1,4]" })
    end)
    it("an enum kept to its type's values", function()
        matches(assert(G.json_schema('{"type":["array","null"],"enum":[[1],null,"s"]}')), { "[1]", "null" }, { '"s"' })
        matches(assert(G.json_schema('{"type":"integer","enum":[1,2.5,3]}')), { "1", "3" }, { "2.5" })
    end)
    it("a schema without constraints, an open integer range, an object of additionalProperties only", function()
        matches(assert(G.json_schema('{"description":"x"}')), { '{"q":[1,"a",null]}', "5", '"s"' }, { "x" })
        matches(assert(G.json_schema('{"type":"integer","minimum":50}')), { "50", "99", "100", "1234567" }, { "49", "050", "-50" })
        matches(assert(G.json_schema('{"type":"object","additionalProperties":{"type":"integer"}}')),
                { '{"a":1,"b":2}', "{}" }, { '{"a":"x"}' })
    end)
    it("regular expressions' \\u escapes past U+0800, \\f and \\v; GBNF's \\0", function()
        matches(assert(G.regex("\\u4e2d\\u6587")), { "中文" }, { "中" })
        matches(assert(G.regex("[\\u4e00-\\u9fff]+")), { "中文字" }, { "abc" })
        matches(assert(G.regex("a\\fb\\v")), { "a\fb\v" }, { "afbv" })
        matches(assert(G.gbnf('root ::= "a\\0b"')), { "a\0b" }, { "ab" })
    end)
    it("a schema table's JSON: names of keywords as property names, big numbers, no holes", function()
        -- (a property named like a keyword is a name: {} stays a schema, an empty required
        -- under "properties" a property's own)
        matches(assert(G.json_schema({ type = "object", properties = { type = {} }, required = { "type" } })),
                { '{"type":1}', '{"type":"x"}' }, { "{}" })
        matches(assert(G.json_schema({ type = "object", properties = { properties = { type = "object", required = {} } } })),
                { '{"properties":{}}', "{}" }, { '{"properties":1}' })
        assert.equal("1e+20", G.to_json(1e20)) -- (past 2^53: no integer format, which wrapped)
        assert.equal("-9007199254740991", G.to_json(-(2 ^ 53 - 1)))
        assert.has_error(function() G.to_json({ 1, 2, [10] = 3 }) end)
        assert.has_error(function() G.to_json({ 1, [1.5] = 2 }) end)
        assert.has_error(function() G.token(2 ^ 31) end) -- (an id past an int: refused where it is written)
        -- a literal's control bytes and NUL written as escapes the GBNF reader takes
        matches(assert(G.build(G.lit("a\0b"))), { "a\0b" }, { "ab" })
        matches(assert(G.build(G.lit("a\1b"))), { "a\1b" }, { "ab" })
    end)
    it("from_text passes loose on: a pattern the converter cannot enforce is left out, not refused", function()
        local lookahead = '{"type": "string", "pattern": "^(?!^[-+.]*$)[+-]?0*\\\\d*\\\\.?\\\\d*$"}'
        assert.is_nil((G.from_text("json_schema", lookahead, false, false)))
        matches(assert(G.from_text("json_schema", lookahead, false, true)), { '"anything"' }, { "1" })
    end)
end)

-- A number's range is exact decimal text (minimum 0.1 takes 0.1, not 0.1000000000000000055...)
-- and its digits are capped as llama.cpp's converter caps them: a property test against
-- Lua's own reading of each text, over random bounds and the texts about them.
describe("tinyloop.grammar, numbers in a range", function()
    local random = math.random
    -- a bound: k / 10^j, as JSON text and as the double both readers take
    local function random_bound()
        local places = random(0, 3)
        local k = random(-2000, 2000)
        if random() < 0.2 then k = 0 end
        local text = string.format("%." .. places .. "f", k / 10 ^ places)
        return text, tonumber(text)
    end
    -- a candidate about a value: a step either side, trailing zeros kept or dropped
    local STEPS = { -1, -0.1, -0.001, -0.0001, 0, 0, 0.0001, 0.001, 0.1, 1 }
    local function candidate(about)
        local text = string.format("%.4f", about + STEPS[random(#STEPS)])
        if text == "-0.0000" or random() < 0.5 then text = text:gsub("0+$", ""):gsub("%.$", "") end
        return text
    end
    local function within(v, lo, lo_strict, hi, hi_strict)
        return (lo == nil or v > lo or (v == lo and not lo_strict)) and (hi == nil or v < hi or (v == hi and not hi_strict))
    end
    it("takes exactly the numbers between its bounds, an exponent only where every bound is 0", function()
        math.randomseed(20261206)
        local checked = 0
        for _ = 1, 160 do
            local members, lo, hi, lo_strict, hi_strict = {}, nil, nil, false, false
            if random() < 0.7 then
                local text, v = random_bound()
                lo, lo_strict = v, random() < 0.5
                members[#members + 1] = string.format('"%s": %s', lo_strict and "exclusiveMinimum" or "minimum", text)
            end
            if random() < 0.7 or lo == nil then
                local text, v = random_bound()
                hi, hi_strict = v, random() < 0.5
                members[#members + 1] = string.format('"%s": %s', hi_strict and "exclusiveMaximum" or "maximum", text)
            end
            local schema = '{"type": "number", ' .. table.concat(members, ", ") .. "}"
            if not (lo and hi and (lo > hi or (lo == hi and (lo_strict or hi_strict)))) then
                local g = assert(G.json_schema(schema))
                local texts = { "0", "-0", "0.0", "-0.00", "0e3", "-0E-2", "1e1", "-2.5e-1" }
                for _ = 1, 30 do texts[#texts + 1] = candidate(random() < 0.5 and (lo or hi) or (hi or lo)) end
                for _, text in ipairs(texts) do
                    local exponent_ok = text:find("[eE]") == nil or ((lo or 0) == 0 and (hi or 0) == 0)
                    local expected = exponent_ok and within(tonumber(text), lo, lo_strict, hi, hi_strict)
                    assert(g:matches(text) == expected, string.format("%s on %s: expected %s", text, schema, tostring(expected)))
                    checked = checked + 1
                end
            else -- an empty range: refused, naming it
                local g, err = G.json_schema(schema)
                assert(g == nil and err:find("no number is", 1, true), schema .. ": " .. tostring(err))
            end
        end
        assert.truthy(checked > 3000, checked)
    end)
    it("takes a multipleOf of 1 or a power of ten below it: that many places at most, within the bounds", function()
        math.randomseed(20261207)
        local checked = 0
        for _ = 1, 120 do
            local places = random(0, 3)
            local members = { string.format('"multipleOf": %s', ({ "1", "0.1", "0.01", "0.001" })[places + 1]) }
            local lo, hi, lo_strict, hi_strict
            if random() < 0.6 then
                local text, v = random_bound()
                lo, lo_strict = v, random() < 0.5
                members[#members + 1] = string.format('"%s": %s', lo_strict and "exclusiveMinimum" or "minimum", text)
            end
            if random() < 0.6 then
                local text, v = random_bound()
                hi, hi_strict = v, random() < 0.5
                members[#members + 1] = string.format('"%s": %s', hi_strict and "exclusiveMaximum" or "maximum", text)
            end
            local schema = '{"type": "number", ' .. table.concat(members, ", ") .. "}"
            local g, err = G.json_schema(schema)
            local texts = { "0", "-0", "1e1", "2.5e-1" }
            for _ = 1, 30 do texts[#texts + 1] = candidate(random() < 0.5 and (lo or hi or 0) or (hi or lo or 0)) end
            local any = false
            for _, text in ipairs(texts) do
                local fraction = text:match("%.(%d+)$") or ""
                local expected = not text:find("[eE]") and #fraction <= places and within(tonumber(text), lo, lo_strict, hi, hi_strict)
                any = any or expected
                if g then
                    assert(g:matches(text) == expected, string.format("%s on %s: expected %s", text, schema, tostring(expected)))
                    checked = checked + 1
                end
            end
            -- refused only where no multiple is in range (then none of the texts is)
            assert(g or (not any and err:find("no multiple of", 1, true)), schema .. ": " .. tostring(err))
        end
        assert.truthy(checked > 2500, checked)
        -- other steps: refused, naming the rule; loosely left out
        local half = '{"type": "number", "multipleOf": 0.5}'
        assert.matches("'multipleOf' is supported as 1 or a power of ten below it", select(2, G.json_schema(half)), 1, true)
        assert.is_true(assert(G.json_schema(half, { loose = true })):matches("0.25"))
        -- on an integer, 1 and below ask nothing; 2 is refused
        assert.is_true(assert(G.json_schema('{"type": "integer", "multipleOf": 0.01}')):matches("7"))
        assert.is_nil((G.json_schema('{"type": "integer", "multipleOf": 2}')))
    end)
    it("an integer or a number: each type's values with its bounds", function()
        local g = assert(G.json_schema('{"type": ["integer", "number"], "maximum": 5}'))
        assert.same({ true, true, false, false, true }, { g:matches("4.5"), g:matches("5"), g:matches("5.5"), g:matches("6"), g:matches("-7") })
        g = assert(G.json_schema('{"type": "integer", "exclusiveMinimum": 0.5, "maximum": 2.5}'))
        assert.same({ false, true, true, false }, { g:matches("0"), g:matches("1"), g:matches("2"), g:matches("3") })
        -- an exclusive bound: no text that reads back as the bound itself (zod's gt/lt check
        -- the double: 1.0000000000000001 is 1, 99.9999999999999999 is 100)
        g = assert(G.json_schema('{"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 100}'))
        assert.same({ false, true, true, false, true, false },
                    { g:matches("1.0000000000000001"), g:matches("1.0000000000000002"), g:matches("1.5"),
                      g:matches("99.9999999999999999"), g:matches("99.99999999999999"), g:matches("100") })
        g = assert(G.json_schema('{"type": "number", "exclusiveMinimum": 0}'))
        assert.same({ true, true, false }, { g:matches("1e-5"), g:matches("0.0000000000000001"), g:matches("0e5") })
        -- a bound past 2^53: refused; loosely left out, the other kept
        local huge = '{"type": "number", "minimum": -1.5, "maximum": 1e300}'
        assert.matches("'maximum' must be a number below 2^53", select(2, G.json_schema(huge)), 1, true)
        g = assert(G.json_schema(huge, { loose = true }))
        assert.same({ true, true, false }, { g:matches("-1.5"), g:matches("12345.5"), g:matches("-1.6") })
    end)
    it("caps a number's digits: 16 whole, 16 after the point (one past a longer bound's), an exponent to 289", function()
        local function each(g, texts)
            local got = {}
            for i, text in ipairs(texts) do got[i] = g:matches(text) end
            return got
        end
        local sixteen, seventeen = ("1"):rep(16), ("1"):rep(17)
        local free = assert(G.json_schema('{"type": "number"}'))
        assert.same({ true, false, true, false, true, false },
                    each(free, { sixteen, seventeen, "0." .. sixteen, "0." .. seventeen, "1e289", "1e290" }))
        -- (a value stays a finite double, and not 0 where a bound at 0 keeps the exponent)
        local largest = sixteen .. "." .. sixteen .. "e289"
        assert.is_true(tonumber(largest) < math.huge and tonumber("0." .. ("0"):rep(15) .. "1e-289") > 0)
        local positive = assert(G.json_schema('{"type": "number", "exclusiveMinimum": 0}'))
        assert.same({ true, true, false, false, false },
                    each(positive, { largest, "0.0000000000000001e-289", "1e-290", "0.1354335365184144e-976", "8.01e383" }))
        assert.same({ true, false }, each(assert(G.json_schema('{"type": "integer"}')), { "-" .. sixteen, "-" .. seventeen }))
        assert.same({ true, false }, each(assert(G.json_schema('{"type": "integer", "minimum": 5}')), { sixteen, seventeen }))
        assert.same({ true, false, true, false },
                    each(assert(G.json_schema('{"type": "number", "minimum": 0.5}')),
                         { "0." .. ("5"):rep(16), "0." .. ("5"):rep(17), sixteen .. ".5", seventeen }))
        -- (a bound of 17 fraction digits: 18)
        local past = assert(G.json_schema('{"type": "number", "minimum": 1.5e-16, "maximum": 1}'))
        assert.same({ true, false, false, true },
                    each(past, { "0.000000000000000151", "0.0000000000000001501", "0.00000000000000014", "0.5" }))
        -- a bound of 324 fraction digits (its grammar nested a group a digit: past the parser's
        -- limit); 5.1e-324 reads as 5e-324, the bound itself
        local tiny = assert(G.json_schema('{"type": "number", "exclusiveMinimum": 5e-324, "maximum": 1e-99}'))
        assert.same({ true, false, false, true }, each(tiny, { "0." .. ("0"):rep(322) .. "1", "0." .. ("0"):rep(323) .. "51", "0", "0." .. ("0"):rep(98) .. "1" }))
        -- a bound read as its shortest decimal: 2^-24's is 5.960464477539063e-08, not the
        -- correctly rounded ...062 of 16 digits (another double) nor its exact ...0625
        local power = assert(G.json_schema('{"type": "number", "maximum": 5.960464477539063e-08}'))
        assert.same({ true, false, true }, each(power, { "0.00000005960464477539063", "0.000000059604644775390631", "0.00000005960464477539062" }))
        -- and a const as that shortest text, as Python's json and JavaScript write it
        assert.same({ true, false }, each(assert(G.json_schema('{"const": 5.960464477539063e-08}')),
                                          { "5.960464477539063e-08", "5.9604644775390625e-08" }))
        -- the shipped JSON grammar caps them too
        assert.same({ true, false, false }, each(assert(G.shipped("json")), { "[" .. sixteen .. ".5]", "[" .. seventeen .. "]", "[0." .. seventeen .. "]" }))
    end)
end)

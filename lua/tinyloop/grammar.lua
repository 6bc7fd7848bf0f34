-- tinyloop.grammar: grammars compiled by the engine (SPEC §8).
--
--   local grammar = require("tinyloop").grammar
--   local g, err = grammar.gbnf('root ::= "yes" | "no"')       -- llama.cpp's GBNF dialect
--   local g, err = grammar.json_schema({ type = "object", properties = { a = { type = "integer" } } })
--   local g = grammar.shipped("json")                            -- lua/tinyloop/grammars/json.gbnf
--   local g = grammar.build(grammar.seq("(", grammar.rep(grammar.class("0-9"), 1, 3), ")"))
--   g:matches("(12)")  --> true
--   model:generate(prompt, { grammar = g })                      -- any decoder, speculative included
--
-- Errors follow the module's convention (top of init.lua): a wrong argument type raises; a
-- grammar or schema that does not compile returns nil, err with the engine's message (line and
-- column, what was expected, the rule).
--
-- Combinators build GBNF text, compiled like any grammar, so there is one internal form:
--   lit(s)            a literal string
--   class(spec)       a character class, GBNF syntax inside the brackets: class("a-z0-9_"),
--                     class("^\"") (negated)
--   any()             any one character
--   seq(a, b, ...)    a sequence; strings are literals
--   alt(a, b, ...)    a choice
--   rep(x, min, max)  x repeated min..max times (max nil: unbounded); opt(x), star(x), plus(x)
--   ref(name)         a rule of build{...} by name
--   build(x) or build{ root = x, name = y, ... }  -> grammar, or nil, err
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local ffi = require "tinyloop.ffi"

local M = {}
-- (required on its own, bound to the library; its argument errors raise at the caller's line,
-- past tinyloop's frames too where tinyloop called: M.bind)
local OWN_SOURCE = debug.getinfo(1, "S").source
local C, raise = require "tinyloop.lib", require("tinyloop.raise").from(OWN_SOURCE)

local Grammar = {}
Grammar.__index = Grammar

local function last_error() return ffi.string(C.tl_last_error()) end

local function wrap(out, source)
    local g = setmetatable({ ptr = ffi.gc(out[0], C.tl_compiled_grammar_free), source = source }, Grammar)
    return g
end

-- A grammar compiled elsewhere in this process (a thread of nginx's pool: tinyloop.server.wait),
-- given by its address: takes a reference of its own (tl_compiled_grammar_retain), so the
-- compiler may drop its own. `source`: its GBNF text, where known.
function M.adopt(address, source)
    local ptr = ffi.cast("tl_compiled_grammar *", address)
    C.tl_compiled_grammar_retain(ptr)
    return setmetatable({ ptr = ffi.gc(ptr, C.tl_compiled_grammar_free), source = source }, Grammar)
end

-- true when v is a grammar compiled by this module (init.lua wires it into configs).
function M.is_compiled(v) return getmetatable(v) == Grammar end

function M.gbnf(text)
    if type(text) ~= "string" then raise("tinyloop.grammar.gbnf: text must be a string") end
    local out = ffi.new("tl_compiled_grammar *[1]")
    if C.tl_grammar_compile_gbnf(text, #text, out) ~= 0 then return nil, last_error() end
    return wrap(out, text)
end

-- ------------------------------------------------------------------ JSON text of a Lua table

local function json_string(s)
    return '"' .. s:gsub('[%c"\\]', function(c)
        local named = { ['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\t'] = '\\t', ['\r'] = '\\r' }
        return named[c] or ("\\u%04x"):format(c:byte())
    end) .. '"'
end

-- The keywords whose value is an array: an empty Lua table under one is [] (an empty table is
-- an object everywhere else: {"properties": {}}). The members of a map of names (properties,
-- $defs) are schemas under a name, not keywords (in_names).
local ARRAY_KEYWORDS = { required = true, enum = true, prefixItems = true, anyOf = true, oneOf = true, allOf = true,
                         type = true, examples = true }
local NAME_MAPS = { properties = true, ["$defs"] = true, definitions = true }

local function to_json(v, depth, key, in_names)
    depth = depth or 0
    if depth > 100 then raise("tinyloop.grammar.json_schema: schema nested too deeply (a cycle?)") end
    local t = type(v)
    if t == "string" then return json_string(v) end
    if t == "boolean" then return tostring(v) end
    if t == "number" then
        if v ~= v or v == math.huge or v == -math.huge then raise("tinyloop.grammar.json_schema: a number is not finite") end
        if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ("%d"):format(v) end
        return ("%.17g"):format(v)
    end
    if t ~= "table" then raise("tinyloop.grammar.json_schema: cannot encode a " .. t) end
    if next(v) == nil and not in_names and ARRAY_KEYWORDS[key] then return "[]" end
    local n = #v
    if n > 0 then
        local parts = {}
        for i = 1, n do parts[i] = to_json(v[i], depth + 1) end
        for k in pairs(v) do
            if type(k) ~= "number" or k < 1 or k > n or k ~= math.floor(k) then
                raise("tinyloop.grammar.json_schema: a table mixes array items and keys")
            end
        end
        return "[" .. table.concat(parts, ",") .. "]"
    end
    -- objects keep a stable (sorted) key order; "properties" order is the generation order,
    -- so a schema that cares about order passes a JSON string instead
    local keys = {}
    for k in pairs(v) do
        if type(k) ~= "string" then raise("tinyloop.grammar.json_schema: object keys must be strings") end
        keys[#keys + 1] = k
    end
    table.sort(keys)
    local parts = {}
    local names = not in_names and NAME_MAPS[key] or false
    for i, k in ipairs(keys) do parts[i] = json_string(k) .. ":" .. to_json(v[k], depth + 1, k, names) end
    return "{" .. table.concat(parts, ",") .. "}"
end
M.to_json = to_json

-- Raises on a key of `t` that `known` lacks (a misspelt option was ignored: {free_whitespace =
-- true} gave compact JSON), naming the ones taken; `what` says where ("opts", "tags[2]").
local function check_known(t, known, who, what)
    for k in ordered_pairs(t) do
        if not known[k] then
            local names = {}
            for name in pairs(known) do names[#names + 1] = name end
            table.sort(names)
            raise(("tinyloop.grammar.%s: unknown %s field '%s' (%s)"):format(who, what, tostring(k), table.concat(names, ", ")))
        end
    end
end

-- schema: a Lua table or a JSON string; opts.whitespace = "free" allows blanks between tokens;
-- opts.loose = true leaves out the keywords that only narrow a value and that the converter
-- cannot enforce (tinyloop.h: tl_json_schema_options.loose), allowing a superset.
-- A schema's JSON text and its tl_json_schema_options, checked (who: the function, for messages).
local SCHEMA_OPTIONS = { whitespace = true, loose = true }
local function schema_args(schema, opts, who)
    local text
    if type(schema) == "string" then text = schema
    elseif type(schema) == "table" then text = to_json(schema)
    else raise("tinyloop.grammar." .. who .. ": schema must be a table or a JSON string") end
    if opts ~= nil and type(opts) ~= "table" then raise("tinyloop.grammar." .. who .. ": opts must be a table") end
    if opts then check_known(opts, SCHEMA_OPTIONS, who, "opts") end
    local o = ffi.new("tl_json_schema_options")
    if opts and opts.whitespace ~= nil then
        if opts.whitespace ~= "free" and opts.whitespace ~= "compact" then
            raise("tinyloop.grammar." .. who .. ": opts.whitespace must be \"free\" or \"compact\"")
        end
        o.free_whitespace = opts.whitespace == "free" and 1 or 0
    end
    if opts and opts.loose ~= nil then
        if type(opts.loose) ~= "boolean" then raise("tinyloop.grammar." .. who .. ": opts.loose must be a boolean") end
        o.loose = opts.loose and 1 or 0
    end
    return text, o
end

-- The GBNF text a tl_json_schema_to_gbnf or tl_regex_to_gbnf call wrote into gbnf_text and
-- gbnf_len (status: its return), taken and freed; nil where it failed.
local gbnf_text, gbnf_len = ffi.new("char *[1]"), ffi.new("size_t[1]")
local function taken_gbnf(status)
    if status ~= 0 then return nil end
    local source = ffi.string(gbnf_text[0], gbnf_len[0])
    C.tl_free(gbnf_text[0])
    return source
end

-- json_schema_gbnf(schema, opts) -> the GBNF text json_schema compiles (tl_json_schema_to_gbnf),
-- without compiling it: for a grammar built around it (tinyloop.tools), or nil, err.
function M.json_schema_gbnf(schema, opts)
    local text, o = schema_args(schema, opts, "json_schema_gbnf")
    local source = taken_gbnf(C.tl_json_schema_to_gbnf(text, #text, o, gbnf_text, gbnf_len))
    if not source then return nil, last_error() end
    return source
end

function M.json_schema(schema, opts)
    local text, o = schema_args(schema, opts, "json_schema")
    local out = ffi.new("tl_compiled_grammar *[1]")
    if C.tl_grammar_compile_json_schema(text, #text, o, out) ~= 0 then return nil, last_error() end
    -- (its GBNF text made when asked for, g:gbnf(): a large schema was converted twice a compile)
    local g = wrap(out, nil)
    g.make_source = function() return taken_gbnf(C.tl_json_schema_to_gbnf(text, #text, o, gbnf_text, gbnf_len)) end
    return g
end

-- regex(pattern) -> a grammar whose sentences are the texts the regular expression matches
-- (ECMA-262 syntax, the subset tinyloop.h's tl_grammar_compile_regex lists), or nil, err.
function M.regex(pattern)
    if type(pattern) ~= "string" then raise("tinyloop.grammar.regex: pattern must be a string") end
    local out = ffi.new("tl_compiled_grammar *[1]")
    if C.tl_grammar_compile_regex(pattern, #pattern, out) ~= 0 then return nil, last_error() end
    local g = wrap(out, nil) -- (its GBNF text made when asked for, as a schema's)
    g.make_source = function() return taken_gbnf(C.tl_regex_to_gbnf(pattern, #pattern, gbnf_text, gbnf_len)) end
    return g
end

-- from_text(kind, text, free_whitespace, loose) -> the grammar of GBNF text ("gbnf"), a regular
-- expression ("regex") or a JSON Schema's text ("json_schema", with its whitespace and loose
-- options as booleans), or nil, err: one entry for callers that choose the kind at run time
-- (the server's compiles, which tinyloop.server.wait.compile also does in nginx's pool).
function M.from_text(kind, text, free_whitespace, loose)
    if kind == "gbnf" then return M.gbnf(text) end
    if kind == "regex" then return M.regex(text) end
    if kind == "json_schema" then
        return M.json_schema(text, { whitespace = free_whitespace and "free" or "compact", loose = loose == true })
    end
    raise("tinyloop.grammar.from_text: kind must be \"gbnf\", \"regex\" or \"json_schema\"")
end

-- (C reads these strings up to a NUL: one inside would silently cut them)
local function has_nul(s) return s:find("\0", 1, true) ~= nil end

-- max_blanks: nil, or an integer C can hold (its range is C's to check)
local function check_blanks(v, who)
    if v ~= nil and (type(v) ~= "number" or v % 1 ~= 0 or v < -1e9 or v > 1e9) then raise(who .. ": max_blanks must be an integer") end
end

-- after(trigger, g[, max_blanks]) -> a grammar that leaves the text free until it contains
-- `trigger`, then constrains what follows it to g, after at most max_blanks blanks (default
-- 4, at most 16): for thinking models, after("</think>", g) lets the reasoning run free.
-- nil, err when C refuses.
function M.after(trigger, g, max_blanks)
    if type(trigger) ~= "string" then raise("tinyloop.grammar.after: trigger must be a string") end
    if not M.is_compiled(g) then raise("tinyloop.grammar.after: g must be a compiled grammar") end
    check_blanks(max_blanks, "tinyloop.grammar.after")
    local out = ffi.new("tl_compiled_grammar *[1]")
    if C.tl_grammar_compile_after(g.ptr, trigger, #trigger, max_blanks or 4, out) ~= 0 then return nil, last_error() end
    return wrap(out, nil)
end

-- after_block(open, close, g[, max_blanks]) -> an optional block (open, text without close,
-- close, at most max_blanks blanks, default 4), then g; the text may also end inside the
-- block: a thinking model that may write "<think>" ... "</think>" on its own thinks freely,
-- then g writes the answer.
function M.after_block(open, close, g, max_blanks)
    if type(open) ~= "string" or type(close) ~= "string" then raise("tinyloop.grammar.after_block: open and close must be strings") end
    if not M.is_compiled(g) then raise("tinyloop.grammar.after_block: g must be a compiled grammar") end
    check_blanks(max_blanks, "tinyloop.grammar.after_block")
    if has_nul(open) or has_nul(close) then return nil, "tinyloop.grammar.after_block: open and close must not hold a NUL byte" end
    local out = ffi.new("tl_compiled_grammar *[1]")
    if C.tl_grammar_compile_after_block(g.ptr, open, close, max_blanks or 4, out) ~= 0 then return nil, last_error() end
    return wrap(out, nil)
end

-- tags(tags, triggers[, opts]) -> free text and the grammars it opens (xgrammar's triggered
-- tags, vLLM's structural_tag): the text is free until a trigger appears; from there it is a
-- tag whose begin starts with that trigger ({begin = s, content = compiled grammar, ["end"] =
-- s, ends_text = boolean}), then free text again (or the end, ends_text). opts: max_blanks
-- (blanks between a begin and its content, default 0), at_least_one (a tag is there), tag_first
-- (the text begins with one: no free text before it). nil, err when C refuses.
local TAGS_OPTIONS = { max_blanks = true, at_least_one = true, tag_first = true }
local TAG_FIELDS = { begin = true, content = true, ["end"] = true, ends_text = true }
function M.tags(tags, triggers, opts)
    if type(tags) ~= "table" or #tags == 0 then raise("tinyloop.grammar.tags: tags must be a non-empty list") end
    if type(triggers) ~= "table" or #triggers == 0 then raise("tinyloop.grammar.tags: triggers must be a non-empty list of strings") end
    if opts ~= nil and type(opts) ~= "table" then raise("tinyloop.grammar.tags: opts must be a table") end
    if opts then check_known(opts, TAGS_OPTIONS, "tags", "opts") end
    local c_tags = ffi.new("tl_grammar_tag[?]", #tags)
    for i, t in ipairs(tags) do
        if type(t) ~= "table" or type(t.begin) ~= "string" or not M.is_compiled(t.content) or
            (t["end"] ~= nil and type(t["end"]) ~= "string") then
            raise(("tinyloop.grammar.tags: tags[%d] must be {begin = string, content = compiled grammar, end = string}"):format(i))
        end
        check_known(t, TAG_FIELDS, "tags", ("tags[%d]"):format(i))
        if has_nul(t.begin) or has_nul(t["end"] or "") then
            return nil, ("tinyloop.grammar.tags: tags[%d]'s begin or end holds a NUL byte"):format(i)
        end
        c_tags[i - 1].begin, c_tags[i - 1].content, c_tags[i - 1]["end"] = t.begin, t.content.ptr, t["end"] or ""
        c_tags[i - 1].ends_text = t.ends_text and 1 or 0
    end
    local c_triggers = ffi.new("const char *[?]", #triggers)
    for i, trigger in ipairs(triggers) do
        if type(trigger) ~= "string" then raise(("tinyloop.grammar.tags: triggers[%d] must be a string"):format(i)) end
        if has_nul(trigger) then return nil, ("tinyloop.grammar.tags: triggers[%d] holds a NUL byte"):format(i) end
        c_triggers[i - 1] = trigger
    end
    local o = ffi.new("tl_grammar_tags_options")
    if opts then
        check_blanks(opts.max_blanks, "tinyloop.grammar.tags")
        o.max_blanks, o.at_least_one, o.tag_first = opts.max_blanks or 0, opts.at_least_one and 1 or 0, opts.tag_first and 1 or 0
    end
    local out = ffi.new("tl_compiled_grammar *[1]")
    -- (the strings above are anchored by `tags` and `triggers` until the call returns)
    if C.tl_grammar_compile_tags(c_tags, #tags, c_triggers, #triggers, o, out) ~= 0 then
        -- C counts the lists from 0, Lua from 1: its messages name tags[i] and triggers[i] as here
        -- (the place named first, after the function's name: a begin quoted after it may hold
        -- "[5]" of its own, which was renumbered too)
        return nil, (last_error():gsub("^(tl_grammar_compile_tags: %a+)%[(%d+)%]",
                                       function(list, i) return list .. "[" .. (tonumber(i) + 1) .. "]" end))
    end
    return wrap(out, nil)
end

-- never() -> a grammar without sentences (a trigger that must not come: text without it).
function M.never() return M.gbnf("root ::= [^\\x00-\\U0010FFFF]") end

-- A grammar shipped in lua/tinyloop/grammars/: json, json_array_of_strings, arithmetic, list, yes_no.
local here = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "."
-- The text of a shipped grammar file, or nil, err.
local function read_shipped(name)
    local f, err = io.open(here .. "/grammars/" .. name .. ".gbnf", "rb")
    if not f then return nil, err end
    local text = f:read("*a")
    f:close()
    return text
end

function M.shipped(name)
    if type(name) ~= "string" or not name:match("^[%w_]+$") then
        raise("tinyloop.grammar.shipped: name must be a word such as \"json\"")
    end
    local text, err = read_shipped(name)
    if not text then return nil, err end
    return M.gbnf(text)
end

-- json_object() -> the shipped JSON grammar with an object at its top level (OpenAI's JSON
-- mode, vLLM's json_object), or nil, err.
function M.json_object()
    local text, err = read_shipped("json")
    if not text then return nil, err end
    local object_root, n = text:gsub("\nroot%s*::=[^\n]*", "\nroot ::= ws object ws", 1)
    if n ~= 1 then return nil, "json.gbnf: no root rule to put an object at" end
    return M.gbnf(object_root)
end

function Grammar:matches(text)
    if type(text) ~= "string" then raise("grammar:matches: text must be a string") end
    local m = ffi.new("int[1]")
    if C.tl_grammar_matches(self.ptr, text, #text, m) ~= 0 then return nil, last_error() end
    return m[0] == 1
end

-- Whether the grammar has not rejected text: every byte of it was allowed (a partial output
-- that may go on; tinyloop.h's tl_grammar_matches_prefix).
function Grammar:matches_prefix(text)
    if type(text) ~= "string" then raise("grammar:matches_prefix: text must be a string") end
    local m = ffi.new("int[1]")
    if C.tl_grammar_matches_prefix(self.ptr, text, #text, m) ~= 0 then return nil, last_error() end
    return m[0] == 1
end

-- What the grammar holds in memory now (tinyloop.h's tl_grammar_memory_usage): program_bytes,
-- table_bytes, mask_bytes, vocab_bytes (tries shared by every grammar on a tokenizer),
-- own_bytes (program + tables + masks), generations (live) and restarts.
local usage_out = ffi.new("tl_grammar_memory[1]")
function Grammar:memory()
    if C.tl_grammar_memory_usage(self.ptr, usage_out) ~= 0 then return nil, last_error() end
    local u = usage_out[0]
    return { program_bytes = tonumber(u.program_bytes), table_bytes = tonumber(u.table_bytes),
             mask_bytes = tonumber(u.mask_bytes), vocab_bytes = tonumber(u.vocab_bytes), own_bytes = tonumber(u.own_bytes),
             generations = u.generations, restarts = tonumber(u.restarts) }
end

-- Gives back the memory of the grammar's tables and cached masks now (tl_grammar_trim): for a
-- cache that drops a grammar sessions may still use. true, or nil, err.
function Grammar:trim()
    if C.tl_grammar_trim(self.ptr) ~= 0 then return nil, last_error() end
    return true
end

-- The GBNF text the grammar was compiled from (a schema's or a pattern's generated grammar);
-- nil for one built from other grammars (after, tags).
function Grammar:gbnf()
    if self.source == nil and self.make_source then self.source, self.make_source = self.make_source(), nil end
    return self.source
end
Grammar.__tostring = function(self) return "tinyloop.grammar: " .. tostring(self.ptr) end

-- ------------------------------------------------------------------ combinators

local Expr = {}
Expr.__index = Expr
local function expr(text) return setmetatable({ text = text }, Expr) end

local function gbnf_literal(s)
    return '"' .. s:gsub('[%c"\\]', function(c)
        if c == '"' then return '\\"' elseif c == "\\" then return "\\\\" end
        return ("\\x%02X"):format(c:byte())
    end) .. '"'
end

local function as_expr(x, who)
    if type(x) == "string" then return expr(gbnf_literal(x)) end
    if getmetatable(x) ~= Expr then raise("tinyloop.grammar." .. who .. ": expected a string or a grammar expression") end
    return x
end

function M.lit(s)
    if type(s) ~= "string" then raise("tinyloop.grammar.lit: expected a string") end
    return expr(gbnf_literal(s))
end
function M.class(spec)
    if type(spec) ~= "string" or spec == "" then raise("tinyloop.grammar.class: expected a non-empty class such as \"a-z\"") end
    -- (a bare ']' or newline becomes its escape; an escape already written is kept whole:
    -- "a\\]" became "[a\\\\]]", a backslash and a stray ']')
    local out = spec:gsub("\\?.", function(piece)
        if piece == "]" then return "\\]" end
        if piece == "\n" then return "\\n" end
        return piece
    end)
    return expr("[" .. out .. "]")
end
function M.any() return expr(".") end
-- One whole token (GBNF's <[id]> or <text>): by id, or by its whole text, brackets included
-- ("<think>"), looked up in the model's vocabulary when a generation binds the grammar;
-- not_token: any one token but that one (and the end of text).
local function token_ref(x, who)
    if type(x) == "number" then
        if x < 0 or x ~= math.floor(x) or x > 2147483647 then raise("tinyloop.grammar." .. who .. ": a token id must be an integer >= 0") end
        return ("<[%d]>"):format(x)
    end
    if type(x) ~= "string" or not x:match("^<[^>\n]+>$") then
        raise("tinyloop.grammar." .. who .. ": expected a token id or a token's text in brackets, such as \"<think>\"")
    end
    return x
end
function M.token(x) return expr(token_ref(x, "token")) end
function M.not_token(x) return expr("!" .. token_ref(x, "not_token")) end
function M.ref(name)
    if type(name) ~= "string" or not name:match("^[%w_-]+$") then raise("tinyloop.grammar.ref: expected a rule name") end
    return expr(name)
end
function M.seq(...)
    local parts = {}
    for i = 1, select("#", ...) do parts[i] = as_expr(select(i, ...), "seq").text end
    return expr("(" .. (#parts > 0 and table.concat(parts, " ") or '""') .. ")")
end
function M.alt(...)
    local parts = {}
    for i = 1, select("#", ...) do parts[i] = as_expr(select(i, ...), "alt").text end
    if #parts == 0 then raise("tinyloop.grammar.alt: needs at least one choice") end
    return expr("(" .. table.concat(parts, " | ") .. ")")
end
function M.rep(x, min, max)
    x = as_expr(x, "rep")
    min = min or 0
    if type(min) ~= "number" or min < 0 or min ~= math.floor(min) then raise("tinyloop.grammar.rep: min must be an integer >= 0") end
    if max ~= nil and (type(max) ~= "number" or max < min or max ~= math.floor(max)) then
        raise("tinyloop.grammar.rep: max must be an integer >= min (or nil: unbounded)")
    end
    return expr("(" .. x.text .. ("){%d,%s}"):format(min, max and tostring(max) or ""))
end
function M.opt(x) return M.rep(x, 0, 1) end
function M.star(x) return M.rep(x, 0) end
function M.plus(x) return M.rep(x, 1) end

-- build(expr) or build{ root = expr, name = expr, ... }: the grammar, or nil, err.
function M.build(rules)
    if getmetatable(rules) == Expr or type(rules) == "string" then rules = { root = rules } end
    if type(rules) ~= "table" then raise("tinyloop.grammar.build: expected an expression or a table of rules") end
    local names = {}
    for name in ordered_pairs(rules) do
        if type(name) ~= "string" or not name:match("^[%w_-]+$") then raise("tinyloop.grammar.build: bad rule name " .. tostring(name)) end
        names[#names + 1] = name
    end
    table.sort(names)
    local lines = {}
    for i, name in ipairs(names) do lines[i] = name .. " ::= " .. as_expr(rules[name], "build").text end
    return M.gbnf(table.concat(lines, "\n") .. "\n")
end

-- Called by init.lua with the loaded library and its chunk's source: an argument error then
-- passes over this module's frames and tinyloop's (it was given tinyloop's raise, which
-- stopped at this module's frames: "grammar.lua:55: ..." instead of the caller's line).
function M.bind(lib, caller_source)
    C, raise = lib, require("tinyloop.raise").from(OWN_SOURCE, caller_source)
    return M
end

return M

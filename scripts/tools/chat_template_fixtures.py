#!/usr/bin/python3
"""Regenerate tests/data/chat_templates/expected.json: the parity references of
lua/tinyloop/chat_template.lua, rendered by Python's jinja2 in the environment transformers
renders chat templates in (apply_chat_template: ImmutableSandboxedEnvironment with trim_blocks,
lstrip_blocks, loop controls, the generation tag, transformers' tojson, raise_exception and
strftime_now). CI never runs this: tests/lua/chat_template_spec.lua reads the stored file.

Entries: {"template": "<file>.jinja" or "inline", "source" (inline only), "case", "vars",
"output"} (or "vars_json": the variables as JSON text, their dicts' keys in their own order)
or, where jinja2 raises, {..., "error": message, "raised": true when the template's
raise_exception raised it}. Dict keys in vars are sorted (Lua tables have no key order; the Lua
renderer iterates caller dicts in sorted order), and no vars hold an empty JSON object (cjson
cannot tell it from an empty list). Deterministic: a rerun rewrites identical bytes.

Usage: /usr/bin/python3 scripts/tools/chat_template_fixtures.py   (jinja2 3.1.x)
"""
import json
import os
import random
import sys
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "tests", "data", "chat_templates")  # the templates
OUT = DATA  # where expected.json goes
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
from regen_args import parse_out  # noqa: E402

if __name__ == "__main__":
    OUT = parse_out(__doc__, OUT, "expected.json and its entries")  # (before jinja2 loads)

import jinja2  # noqa: E402
from jinja2 import nodes  # noqa: E402
from jinja2.ext import Extension, loopcontrols  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402


# ---------------------------------------------------------------- transformers' environment
# (transformers/utils/chat_template_utils.py, _compile_jinja_template)

class AssistantTracker(Extension):
    """{% generation %}...{% endgeneration %}: renders its body (transformers uses it to mark
    assistant tokens)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides jinja2's tojson (which escapes HTML characters)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, loopcontrols])
ENV.filters["tojson"] = tojson
ENV.globals["raise_exception"] = raise_exception
ENV.globals["strftime_now"] = strftime_now


# ---------------------------------------------------------------- conversations

def msg(role, content, **extra):
    return {"role": role, "content": content, **extra}


SYSTEM = msg("system", "You are a concise assistant.")
HELLO = msg("user", "Hello!")
MULTI = [SYSTEM, msg("user", "What is 2+2?"), msg("assistant", "4."), msg("user", "And 3+3?")]
TRICKY = [
    msg("system", "  Réponds en français; use “quotes”.  \n"),
    msg("user", "Héllo wörld — 漢字 😀\nLine two with 'single' and \"double\" quotes,\ta tab, a \\backslash\\ "),
    msg("assistant", "\n  Sure: <b>bold</b> & {{ not a tag }} {% neither %}  \n"),
    msg("user", "   padded   "),
]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.\n",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web <fast> & cheap.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "number"}, "safe": {"type": "boolean"}},
            "required": ["query", "limit"]}}},
]
TOOL_CALL_TURNS = [
    msg("user", "Weather in Paris?"),
    msg("assistant", None, tool_calls=[{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]),
    msg("tool", '{"temperature": 21.5, "sky": "clear"}'),
    msg("assistant", "It is 21.5 °C and clear."),
]

COMMON = [
    ("single_user", {"messages": [HELLO], "add_generation_prompt": True}),
    ("system_user", {"messages": [SYSTEM, HELLO], "add_generation_prompt": True}),
    ("multi_turn", {"messages": MULTI, "add_generation_prompt": True}),
    ("multi_turn_no_generation_prompt", {"messages": MULTI, "add_generation_prompt": False}),
    ("assistant_last", {"messages": [HELLO, msg("assistant", "Hi! How can I help?")], "add_generation_prompt": False}),
    ("tricky_content", {"messages": TRICKY, "add_generation_prompt": True}),
    ("roles_not_alternating", {"messages": [HELLO, msg("user", "Again?")], "add_generation_prompt": True}),
]

TEMPLATES = {
    "qwen2_5.jinja": {"tokens": ("", "<|im_end|>"), "extra": [
        ("tools", {"messages": [SYSTEM, HELLO], "tools": TOOLS, "add_generation_prompt": True}),
        ("tool_calls", {"messages": TOOL_CALL_TURNS, "tools": TOOLS, "add_generation_prompt": True}),
        ("tool_calls_without_tools", {"messages": TOOL_CALL_TURNS, "add_generation_prompt": False}),
    ]},
    "llama3_1.jinja": {"tokens": ("<|begin_of_text|>", "<|eot_id|>"), "extra": [
        ("tools_in_user_message", {"messages": [SYSTEM, HELLO], "tools": TOOLS, "add_generation_prompt": True}),
        ("tools_in_system", {"messages": [SYSTEM, HELLO], "tools": TOOLS, "tools_in_user_message": False,
                             "date_string": "01 Jan 2025", "add_generation_prompt": True}),
        ("builtin_tools", {"messages": [HELLO], "builtin_tools": ["code_interpreter", "brave_search", "wolfram_alpha"],
                           "add_generation_prompt": True}),
        ("tool_calls", {"messages": TOOL_CALL_TURNS, "tools": TOOLS, "tools_in_user_message": False,
                        "add_generation_prompt": True}),
        ("two_tool_calls_refused", {"messages": [HELLO, msg("assistant", None, tool_calls=[
            {"function": {"name": "a", "arguments": {"x": 1}}}, {"function": {"name": "b", "arguments": {"y": 2}}}])],
            "add_generation_prompt": True}),
        ("tools_without_user_message", {"messages": [SYSTEM], "tools": TOOLS, "add_generation_prompt": True}),
    ]},
    "mistral.jinja": {"tokens": ("<s>", "</s>"), "extra": [
        ("system_role_refused", {"messages": [HELLO, msg("assistant", "Hi"), msg("system", "late")],
                                 "add_generation_prompt": True}),
    ]},
    "gemma.jinja": {"tokens": ("<bos>", "<eos>"), "extra": []},
    "phi3.jinja": {"tokens": ("<s>", "<|endoftext|>"), "extra": []},
    "zephyr.jinja": {"tokens": ("<s>", "</s>"), "extra": []},
    "vicuna.jinja": {"tokens": ("<s>", "</s>"), "extra": []},
    "llama2.jinja": {"tokens": ("<s>", "</s>"), "extra": []},
    "deepseek.jinja": {"tokens": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"), "extra": [
        ("thinking", {"messages": [HELLO, msg("assistant", "<think>\nThe user greets.\n</think>\n\nHello to you!"),
                                   msg("user", "Bye")], "add_generation_prompt": True}),
        ("tool_calls", {"messages": [SYSTEM, msg("system", "Second system part."), msg("user", "Weather?"),
                                     msg("assistant", None, tool_calls=[
                                         {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                                         {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]),
                                     msg("tool", "21"), msg("tool", "25"), msg("assistant", "Paris 21, Rome 25.")],
                        "add_generation_prompt": True}),
        ("ends_with_tool_output", {"messages": [msg("user", "Weather?"), msg("assistant", None, tool_calls=[
            {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]), msg("tool", "21")],
            "add_generation_prompt": True}),
        ("generation_prompt_left_out", {"messages": [HELLO]}),
    ]},
    "macros.jinja": {"tokens": ("", "<|im_end|>"), "extra": [
        ("tools", {"messages": [SYSTEM, HELLO], "tools": TOOLS, "add_generation_prompt": True}),
    ]},
    "loops_strip.jinja": {"tokens": ("", ""), "extra": []},
    "tools_json.jinja": {"tokens": ("", ""), "extra": [
        ("tools", {"messages": TRICKY[:2], "tools": TOOLS, "add_generation_prompt": True}),
    ]},
    "plain.jinja": {"tokens": ("", ""), "extra": []},
    # tinyloop.chat's built-in template (chat.PLAIN, which tests/lua/chat_spec.lua checks equal)
    "builtin_plain.jinja": {"tokens": ("", ""), "extra": [
        ("tools", {"messages": [SYSTEM, HELLO], "tools": TOOLS, "add_generation_prompt": True}),
        ("tool_calls", {"messages": TOOL_CALL_TURNS, "tools": TOOLS, "add_generation_prompt": True}),
        ("empty_assistant", {"messages": [HELLO, msg("assistant", ""), msg("user", "Well?")], "add_generation_prompt": True}),
        ("content_and_parallel_calls", {"messages": [HELLO, msg("assistant", "Let me see.", tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "search", "arguments": {"query": "x", "limit": 1}}}]),
            msg("tool", "21", tool_call_id="c1"), msg("tool", "[]", tool_call_id="c2")], "tools": TOOLS,
            "add_generation_prompt": True}),
    ]},
}

# Cases whose variables keep their dicts' key order: stored as JSON text ("vars_json"), which
# the Lua side decodes with tinyloop.chat.decode_ordered (the server's decoding of a request's
# tools and tool call arguments), so the order is the client's, as Python keeps it.
ORDERED = [
    ("qwen2_5.jinja", "tool_calls_in_key_order", {"messages": TOOL_CALL_TURNS, "tools": TOOLS, "add_generation_prompt": True}),
    ("builtin_plain.jinja", "tool_calls_in_key_order", {"messages": TOOL_CALL_TURNS, "tools": TOOLS, "add_generation_prompt": True}),
    ("tools_json.jinja", "tools_in_key_order", {"messages": TRICKY[:2], "tools": TOOLS, "add_generation_prompt": True}),
]


# ---------------------------------------------------------------- inline cases
# Expressions and statements, each rendered with INLINE_VARS: printing, arithmetic, tests,
# filters, methods, scoping, loop variables, errors.

INLINE_VARS = {"messages": [msg("user", "hi"), msg("assistant", " yo \n")], "d": {"a": 1, "b": [1, 2]},
               "n": 5, "f": 2.5, "s": "Hello World", "empty": [], "nothing": None, "flag": True}
INLINE = [
    "{{ none }} {{ true }} {{ false }} {{ [1, 'a', none, true, 1.5] }} {{ {'a': 1, 'b': 'x'} }} {{ (1, 2) }} {{ (1,) }}",
    "{{ 'it\\'s' }} {{ [\"it's\"] }} {{ ['a\"b'] }} {{ ['a\\nb', 'é', '\\t'] }} {{ {'k': none, 1: 2} }} {{ [[], [{}]] }}",
    "{{ 1.0 }} {{ 1e3 }} {{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e-5 }} {{ 123456789.123 }} {{ 1e100 }} {{ 1/3 }} {{ -0.0 }} {{ 100.0 }} {{ 1e15 }} {{ 2**0.5 }}",
    "{{ -2**2 }} {{ 2**3**2 }} {{ -3|abs }} {{ 7//2 }} {{ 7/2 }} {{ 4/2 }} {{ 7%3 }} {{ -7//2 }} {{ -7%3 }} {{ 2**-1 }} {{ 3 * 1.0 }} {{ 1 + 1.5 }}",
    "{{ 'a' * 3 }} {{ [1] * 3 }} {{ 3 * 'a' }} {{ [1, 2] + [3] }} {{ 'a' + 'b' }} {{ 'ab' ~ 1 ~ none ~ true }} {{ 'a' ~ [1] }}",
    "{{ 1 and 'a' }}|{{ 0 or '' }}|{{ [] or 'e' }}|{{ not [] }}|{{ 'abc' if false }}|{{ 'x' if true else 'y' }}|{{ nothing or 'dflt' }}",
    "{{ 1 < 2 < 3 }} {{ 'a' < 'b' }} {{ 'a' == 'a' }} {{ [1, 2] == [1, 2] }} {{ none == none }} {{ 'a' != 1 }} {{ [1] < [2] }} {{ 1 == 1.0 }} {{ true == 1 }}",
    "{{ 1 in [1, 2] }} {{ 'b' in 'abc' }} {{ 'a' in {'a': 1} }} {{ 3 not in [1] }} {{ 'x' in missing }} {{ 'a' in d }}",
    "{{ 'abc'[1] }} {{ 'abc'[-1] }} {{ 'abc'[::-1] }} {{ [1, 2, 3][1:] }} {{ [1, 2, 3][:-1] }} {{ 'abcdef'[1:-1:2] }} {{ [1, 2, 3][5] }} {{ 'héllo'|length }} {{ 'héllo'[1] }} {{ 'héllo'[::-1] }}",
    "{{ missing }}|{{ missing is defined }}|{{ missing|default('d') }}|{{ missing|length }}|{% for i in missing %}no{% endfor %}|{{ missing == missing }}|{{ missing ~ 'b' }}",
    "{{ d.nope }}|{{ d['nope'] }}|{{ d.nope is defined }}|{{ nothing.x }}|{{ messages[0].nope is none }}|{{ messages.0.role }}|{{ messages[5] is defined }}",
    "{{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 2) }} {{ d.keys()|list }} {{ d.values()|list }} {{ d.items()|list }} {{ d|length }}",
    "{{ ' a b '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c '.split(none, 1) }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'xxaxx'.strip('x') }}|{{ '  x '.lstrip() }}|{{ ' x  '.rstrip() }}",
    "{{ 'abc'.startswith(('x', 'a')) }}|{{ 'abc'.endswith('bc') }}|{{ 'hello world'.title() }}|{{ 'hELLO'.capitalize() }}|{{ 'aaa'.replace('a', 'b', 2) }}|{{ 'abc'.find('c') }}|{{ 'abc'.find('z') }}|{{ 'abcb'.count('b') }}|{{ ','.join(['a', 'b']) }}|{{ s.upper() }}|{{ s.lower() }}",
    "{{ 'hello world-foo (bar'|title }}|{{ 'hELLO wORLD'|capitalize }}|{{ '  x  '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ s|upper }}|{{ s|lower }}|{{ s|replace('o', '0') }}|{{ s|reverse }}|{{ s|list|first }}",
    "{{ [3, 1, 2]|sort }}|{{ [1, 2, 3]|first }}|{{ [1, 2, 3]|last }}|{{ 'abc'|first }}|{{ [1, 2]|join }}|{{ [1, 2]|join(', ') }}|{{ ''|default('d') }}|{{ ''|default('d', true) }}|{{ nothing|default('d') }}|{{ [1, 2]|reverse|list }}|{{ 'abc'|list }}",
    "{{ {'b': 1, 'A': 2, 'a': 3}|dictsort }}|{{ {'b': 1, 'a': 2}|items|list }}|{{ [{'r': 'u'}, {'r': 'a'}, {'x': 1}]|selectattr('r', 'equalto', 'u')|list }}|{{ [{'r': 'u'}, {'r': ''}]|selectattr('r')|list }}|{{ [{'r': 'u'}, {'r': 'a'}]|rejectattr('r', 'eq', 'u')|map(attribute='r')|list }}|{{ ['a', 'b']|map('upper')|list }}|{{ [1, 2, 1, 'A', 'a']|unique|list }}",
    "{{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3, 4]|reject('odd')|list }} {{ [0, 1, '', 'a']|select|list }} {{ [{'n': 2}, {'n': 1}]|sort(attribute='n') }} {{ ['b', 'A', 'a']|sort }} {{ [3, 1]|sort(reverse=true) }} {{ {'b': 1, 'a': 2}|dictsort(by='value', reverse=true) }}",
    "{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(2, blank=true) }}|{{ 'x\\ny'|indent('> ') }}",
    "{{ -1.5|abs }}|{{ 2.5|round }}|{{ 3.14159|round(2) }}|{{ 2.7|round(0, 'floor') }}|{{ 2.1|round(0, 'ceil') }}|{{ 1|round }}|{{ 2.675|round(2) }}|{{ -2.5|round }}|{{ 0.5|round }}|{{ 1.5|round }}|{{ -0.4|round }}",
    "{{ [1, 2, 3]|sum }}|{{ [1, 2.5]|sum }}|{{ []|sum }}|{{ [{'a': 1}, {'a': 2}]|sum(attribute='a') }}|{{ [3, 1]|min }}|{{ [3, 1]|max }}|{{ ['b', 'A', 'a']|min }}|{{ ['b', 'A', 'a']|max }}|{{ []|max }}|{{ [{'n': 2}, {'n': 5}]|max(attribute='n') }}",
    "{{ '3'|int }}|{{ 'x'|int }}|{{ '2.5'|float }}|{{ 3|float }}|{{ 3.9|int }}|{{ -1.5|int }}|{{ '4.7'|int }}|{{ ' 42 '|int }}|{{ 'z'|int(7) }}|{{ 1|string }}|{{ nothing|string }}|{{ true|string }}|{{ 1.5|string }}",
    "{{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 'a' is lower }} {{ 'A' is upper }} {{ none is none }} {{ 1 is number }} {{ 1.0 is float }} {{ 1 is integer }} {{ true is boolean }} {{ true is number }} {{ {} is mapping }} {{ [] is sequence }} {{ 'a' is iterable }} {{ 'a' is sequence }} {{ 1 is iterable }}",
    "{{ x is callable }} {{ range is callable }} {{ 1 is in [1] }} {{ 1 is ne 2 }} {{ true is true }} {{ 1 is true }} {{ 1 is not none }} {{ 1 is eq 1 }} {{ 1 is equalto 1 }} {{ true is integer }} {{ 1 is gt 0 }} {{ none is defined }} {{ 'x' is string }} {{ {} is iterable }} {{ 1 is mapping }} {{ 2.0 is integer }} {{ 1 is sameas 1 }} {{ false is false }}",
    "{{ \"it's\"|tojson }} {{ {'b': [1, 2.0, none, true], 'a': '<&>é\\n'}|tojson }} {{ {'a': {'b': []}}|tojson(indent=2) }} {{ [1, 2]|tojson(indent=' ') }} {{ 'a\\u0001\\u007f\\\\\"'|tojson }} {{ 1e100|tojson }} {{ 'é'|tojson(ensure_ascii=true) }} {{ d|tojson(separators=(',', ':')) }} {{ {'b': {'y': 1, 'x': 2}, 'a': 3}|tojson(sort_keys=true) }}",
    "{% set c = 0 %}{% for i in range(3) %}{% set c = c + 1 %}{{ c }}{% endfor %}|{{ c }}",
    "{% for i in range(3) %}{% if i == 1 %}{% set x = 5 %}{% endif %}[{{ x }}]{% endfor %}",
    "{% if true %}{% set y = 2 %}{% endif %}{{ y }}{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t }}",
    "{% set ns = namespace(a=1, b='x') %}{% for i in [1, 2] %}{% set ns.a = ns.a + i %}{% endfor %}{{ ns.a }} {{ ns.b }} {{ ns.zz is defined }}",
    "{% for a, b in {'x': 1, 'y': 2}.items() %}{{ a }}={{ b }};{% endfor %}{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}",
    "{% for x in [1, 2, 3, 4] if x is even %}{{ loop.index }}/{{ loop.length }}:{{ x }}{{ ',' if not loop.last }}{% else %}none{% endfor %}|{% for x in [] %}{% else %}empty{% endfor %}",
    "{% for x in [1, 2, 3] %}{{ loop.previtem }}|{{ loop.nextitem }}|{{ loop.revindex }}|{{ loop.revindex0 }}|{{ loop.cycle('a', 'b') }}|{{ loop.first }}|{{ loop.last }}|{{ loop.index0 }};{% endfor %}",
    "{% for x in [1, 2, 3] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %}{% for x in [1] %}{% for y in [2] %}{{ loop.index }}{{ loop.depth }}{% endfor %}{% endfor %}",
    "{% for x in 'ab' %}{{ x }}{% endfor %}{% for k in {'b': 1, 'a': 2} %}{{ k }}{% endfor %}{% for k in d %}{{ k }}{% endfor %}{% for c in 'é😀' %}[{{ c }}]{% endfor %}",
    "{% set x %}  inner {{ 1 }}\n{% endset %}[{{ x }}]{% macro m(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(1, 2) }}{{ m(a=3) }}{{ m() }}{{ m(b=4, a=5) }}",
    "{% macro outer(x) %}<{{ inner(x) }}>{% endmacro %}{% macro inner(y, sep=', ') %}{{ y | join(sep) }}{% endmacro %}{{ outer([1, 2]) }}{{ inner('ab', sep='-') }}",
    "{% generation %}{{ 'gen' }}{% set inside = 1 %}{% endgeneration %}|{{ inside is defined }}|{% raw %}{{ not }}{% rendered %}{% endraw %}",
    "{{ range(3)|list }} {{ range(1, 5, 2)|list }} {{ range(5, 0, -2)|list }} {{ dict(a=1, b=2) }} {{ namespace(a=1) }} {{ flag }} {{ f }} {{ n / 2 }} {{ empty|length }}",
    "{{ '\\u00e9\\u4e2d\\U0001F600\\101\\x41\\q' }} {{ '😀'|tojson(ensure_ascii=true) }} {{ 'ab'.replace('', '-') }} {{ 'ab'.replace('', '-', 1) }} {{ missing|default(range)(3)|list }}",
    "{{ {'a': 1} == {'a': 1} }} {{ {'a': 1} == {'a': 2} }} {{ {'a': 1} == {'b': 1} }} {{ {'a': 1} == {'a': 1, 'b': 2} }} {{ [1] < [1, 2] }} {{ [1, 2] < [1] }} {{ 'abc'.startswith('x') }} {{ 'abc'.endswith(('x', 'y')) }} {{ 'abc'.endswith('') }}",
    "{{ raise_exception('Bad ' ~ 1) }}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no assistant turns, got: ' ~ m.content|trim) }}{% endif %}{% endfor %}",
    "{{ missing.attr }}",
    "{{ missing + 1 }}",
    "{{ d.nope.deeper }}",
    "{{ [1].append(2) }}",
    "{{ d.update({}) }}",
    "{{ 'abc'|nofilter }}",
    "{% if false %}{{ 'abc'|nofilter }}{% endif %}dead branches do not fail",
    "{{ 1 is nosuchtest }}",
    "{{ nothing + 1 }}",
    "{{ 1 < 'a' }}",
    "{% for i in range(200000) %}{% endfor %}",
    "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}",
    "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(z=2) }}",
    "{{ 5 // 0 }}",
    "{{ 5 / 0 }}",
    "{% set x = 1 %}{% set x.y = 2 %}",
    "{% for a, b in [[1, 2, 3]] %}{% endfor %}",
    "{% for x in 1 %}{% endfor %}",
    "{% for x in nothing %}{% endfor %}",
    "{{ loop.index }}",
    "{{ 'ab'.split('') }}",
    "{{ ' '.join([1, 2]) }}",
    "{{ missing|tojson }}",
    "{{ n() }}",
    "{{ 1|length }}",
    "{{ ' a b  c '.rsplit() }}|{{ ' a b  c '.rsplit(none, 1) }}|{{ 'a,b,,c'.rsplit(',', 2) }}|{{ 'aaa'.rsplit('aa') }}|{{ 'aaa'.split('aa') }}|{{ '  '.rsplit(none, 1) }}|{{ 'a b'.rsplit(maxsplit=0) }}|{{ 'x'.rsplit('x') }}",
    "{{ 'x\\r\\ny\\rz\\n\\nw\\x0b\\x1cq\\u2028r\\n'.splitlines() }}|{{ 'x\\r\\ny\\n'.splitlines(true) }}|{{ ''.splitlines() }}|{{ '\\n'.splitlines() }}|{{ 'a\\n'.splitlines(keepends=true) }}",
    "{{ 'a=b=c'.partition('=') }}|{{ 'a=b=c'.rpartition('=') }}|{{ 'abc'.partition('x') }}|{{ 'abc'.rpartition('x') }}|{{ 'aaa'.rpartition('aa') }}|{{ 'é=ü'.partition('=')[2] }}",
    "{{ 'abcb'.rfind('b') }}|{{ 'abcb'.rfind('b', 0, 3) }}|{{ 'abc'.rfind('') }}|{{ 'héllo'.rfind('l') }}|{{ 'abcb'.index('b') }}|{{ 'abcb'.rindex('b') }}|{{ 'aaa'.rfind('aa') }}|{{ 'abc'.rfind('z') }}",
    "{{ 'x.py'.removesuffix('.py') }}|{{ 'x.py'.removesuffix('') }}|{{ 'prefix-x'.removeprefix('prefix-') }}|{{ 'x'.removeprefix('y') }}|{{ 'aB1'.swapcase() }}|{{ 'ABC'.casefold() }}",
    "{{ '12'.isdigit() }}|{{ ''.isdigit() }}|{{ '1a'.isdigit() }}|{{ 'ab'.isalpha() }}|{{ 'a1'.isalnum() }}|{{ ' \\t\\n'.isspace() }}|{{ ''.isspace() }}|{{ 'AB1'.isupper() }}|{{ '1'.isupper() }}|{{ 'ab1'.islower() }}|{{ 'Hello World'.istitle() }}|{{ 'HeLlo'.istitle() }}|{{ '12'.isdecimal() }}|{{ '12'.isnumeric() }}",
    "[{{ 'ab'.center(7, '*') }}]|[{{ 'ab'.center(6, '*') }}]|[{{ 'abc'.center(6) }}]|[{{ 'abc'.center(8) }}]|[{{ 'ab'.ljust(4, '.') }}]|[{{ 'ab'.rjust(4) }}]|[{{ 'abc'.ljust(2) }}]|[{{ '-42'.zfill(6) }}]|[{{ '42'.zfill(5) }}]|[{{ '+4'.zfill(4) }}]|[{{ 'é'.center(3, 'ü') }}]",
    "{{ [1, 2, 1, '1'].count(1) }}|{{ [[1], [1]].count([1]) }}|{{ ['a', 'b', 'a'].index('a') }}|{{ ['a', 'b', 'a'].index('a', 1) }}|{{ [1, 2, 3].index(3, -1) }}|{{ (1, 2).index(2) }}",
    "{{ 'abc'.index('z') }}",
    "{{ ['a'].index('b') }}",
    "{{ 'a'.partition('') }}",
    "{{ 'a'.center(3, 'ab') }}",
    "{{ 'a'.rsplit('') }}",
]


# ---------------------------------------------------------------- generated whitespace cases
# Random mixes of text, {{ }}, {% %}, {# #} and raw blocks with every whitespace-control sign:
# the lexer's trim_blocks/lstrip_blocks/-/+ handling against jinja2's.

def whitespace_sources(count, seed):
    rnd = random.Random(seed)
    texts = ["", " ", "  ", "\n", "\n\n", " \n ", "a", "b ", " c", "\t", "\n  ", "x\n", "  \n", "\r\n", "   y"]

    def sign():
        return rnd.choice(["", "", "-", "+"])

    def var():
        return "{{" + rnd.choice(["", "-"]) + " " + rnd.choice(["'v'", "n", "'a\\nb'"]) + " " + rnd.choice(["", "-"]) + "}}"

    def gen(depth=0):
        parts = []
        for _ in range(rnd.randint(1, 6)):
            r = rnd.random()
            if r < 0.35:
                parts.append(rnd.choice(texts))
            elif r < 0.5:
                parts.append(var())
            elif r < 0.6:
                parts.append("{#" + sign() + " c " + sign() + "#}")
            elif r < 0.7:
                parts.append("{%" + sign() + " set q = 1 " + sign() + "%}")
            elif r < 0.75:
                parts.append("{%" + sign() + " raw " + rnd.choice(["", "-"]) + "%}" + rnd.choice(texts) + "{{x}}"
                             + rnd.choice(texts) + "{%" + sign() + " endraw " + sign() + "%}")
            elif depth < 2 and r < 0.88:
                parts.append("{%" + sign() + " if true " + sign() + "%}" + gen(depth + 1) + "{%" + sign() + " endif " + sign() + "%}")
            elif depth < 2:
                parts.append("{%" + sign() + " for i in [1, 2] " + sign() + "%}" + gen(depth + 1)
                             + "{%" + sign() + " endfor " + sign() + "%}")
        return "".join(parts)

    return [gen() for _ in range(count)]


# ---------------------------------------------------------------- rendering

def sorted_json(value):
    """value with every dict's keys in sorted order (the order the Lua renderer iterates in)."""
    return json.loads(json.dumps(value, sort_keys=True))


def render(source, variables):
    try:
        return {"output": ENV.from_string(source).render(**variables)}
    except jinja2.exceptions.TemplateSyntaxError as e:
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - every runtime error is a reference
        return {"error": str(e), "raised": type(e) is jinja2.exceptions.TemplateError}


def main():
    if not jinja2.__version__.startswith("3.1."):
        sys.exit(f"jinja2 3.1.x expected (transformers' requirement), found {jinja2.__version__}")
    entries = []
    for name, spec in TEMPLATES.items():
        with open(os.path.join(DATA, name), encoding="utf-8") as f:
            source = f.read()
        bos, eos = spec["tokens"]
        for case, variables in COMMON + spec["extra"]:
            variables = sorted_json({"bos_token": bos, "eos_token": eos, **variables})
            entries.append({"template": name, "case": case, "vars": variables, **render(source, variables)})
    for name, case, variables in ORDERED:
        with open(os.path.join(DATA, name), encoding="utf-8") as f:
            source = f.read()
        bos, eos = TEMPLATES[name]["tokens"]
        variables = {"bos_token": bos, "eos_token": eos, **variables}
        entries.append({"template": name, "case": case, "vars_json": json.dumps(variables, ensure_ascii=False),
                        **render(source, variables)})
    inline_vars = sorted_json(INLINE_VARS)
    for i, source in enumerate(INLINE):
        entries.append({"template": "inline", "case": f"expression {i + 1}", "source": source, "vars": inline_vars,
                        **render(source, inline_vars)})
    for i, source in enumerate(whitespace_sources(120, seed=2024)):
        entries.append({"template": "inline", "case": f"whitespace {i + 1}", "source": source, "vars": {"n": 5},
                        **render(source, {"n": 5})})
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(entries, f, ensure_ascii=False, indent=1)
        f.write("\n")
    errors = sum(1 for e in entries if "error" in e)
    print(f"wrote {len(entries)} entries ({errors} errors) to {os.path.join(OUT, 'expected.json')}")


if __name__ == "__main__":
    main()

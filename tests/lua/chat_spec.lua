-- chat_spec: tinyloop.chat, which turns OpenAI chat messages into a checkpoint's prompt text
-- through the checkpoint's own chat template (the renderer itself: chat_template_spec).
local H = require "helpers"
local cjson = require "cjson"
local chat = require "tinyloop.chat"

local sh = H.sh

local function write(path, text)
    local f = assert(io.open(path, "wb"))
    f:write(text)
    f:close()
end

describe("tinyloop.chat", function()
    local dir
    before_each(function() dir = sh("mktemp -d"):gsub("%s+$", "") end)
    after_each(function() os.execute("rm -rf " .. dir) end)

    local user = { { role = "user", content = "Hi" } }
    local TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}" ..
                     "{% if add_generation_prompt %}[assistant]{% endif %}"

    it("renders tokenizer_config.json's chat_template, with its bos_token and eos_token", function()
        -- special tokens as strings or as {"content": ...} objects, both Hugging Face's forms
        write(dir .. "/tokenizer_config.json", cjson.encode({ chat_template = TEMPLATE, bos_token = { content = "<s>" }, eos_token = "</s>" }))
        local c = assert(chat.load(dir))
        assert.equal(dir .. "/tokenizer_config.json", c.source)
        assert.equal("<s>[user] Hi</s>[assistant]", c:prompt(user))
        assert.equal("<s>[user] Hi</s>", c:prompt(user, false))
    end)

    it("prefers chat_template.jinja to tokenizer_config.json, and takes the 'default' of a list of templates", function()
        write(dir .. "/tokenizer_config.json", cjson.encode({ chat_template = {
            { name = "tool_use", template = "tools" }, { name = "default", template = "default: {{ messages[0].content }}" } } }))
        assert.equal("default: Hi", assert(chat.load(dir)):prompt(user))
        -- a request with tools renders with the "tool_use" one, as transformers picks it
        assert.equal("tools", assert(chat.load(dir)):prompt(user, true, { { type = "function", ["function"] = { name = "f" } } }))
        -- and None where there are none (transformers passes tools=None, documents=None)
        write(dir .. "/tokenizer_config.json", cjson.encode({ chat_template = {
            { name = "default", template = "{% if tools is not none %}T{% endif %}{{ tools|tojson }} {{ documents is none }}" } } }))
        assert.equal("null True", assert(chat.load(dir)):prompt(user))
        -- a list without a "default" is refused, as transformers refuses it
        write(dir .. "/tokenizer_config.json", cjson.encode({ chat_template = { { name = "tool_use", template = "tools" } } }))
        assert.matches("without a 'default' one", select(2, chat.load(dir)), 1, true)
        write(dir .. "/chat_template.jinja", "jinja file: {{ messages[0].content }}")
        local c = assert(chat.load(dir))
        assert.equal(dir .. "/chat_template.jinja", c.source)
        assert.equal("jinja file: Hi", c:prompt(user))
        -- an explicit file before both
        write(dir .. "/mine.jinja", "mine: {{ messages[0].content }}")
        c = assert(chat.load(dir, dir .. "/mine.jinja"))
        assert.equal(dir .. "/mine.jinja", c.source)
        assert.equal("mine: Hi", c:prompt(user))
    end)

    it("refuses a template file that is not UTF-8, and a tokenizer_config.json that is not strict JSON, naming them", function()
        -- (UTF-16 was rendered as it was: a prompt without the messages in it)
        write(dir .. "/u16.jinja", "\255\254{\0{\0 \0m\0}\0}\0")
        local c, err = chat.load(dir, dir .. "/u16.jinja")
        assert.is_nil(c)
        assert.equal(("the chat template %s/u16.jinja is not valid UTF-8 (byte 0)"):format(dir), err)
        write(dir .. "/chat_template.jinja", "sys\255tem {{ messages[0].content }}")
        assert.equal(("the chat template %s/chat_template.jinja is not valid UTF-8 (byte 3)"):format(dir), select(2, chat.load(dir)))
        os.remove(dir .. "/chat_template.jinja")
        -- (lua-cjson took these: the NUL and what follows it, a raw tab, a stray byte)
        for text, why in pairs({ ['{"eos_token": "</s>"}\0garbage'] = "an unescaped control character (byte 0)",
                                 ['{"eos_token": "<\t/s>"}'] = "an unescaped control character (byte 9) in a string",
                                 ['{"eos_token": "<\255/s>"}'] = "not valid UTF-8 (byte 16)",
                                 ['\239\187\191{}'] = "starts with a UTF-8 byte order mark" }) do
            write(dir .. "/tokenizer_config.json", text)
            c, err = chat.load(dir)
            assert.is_nil(c, text)
            assert.truthy(err:find(dir .. "/tokenizer_config.json is not a JSON object: " .. why, 1, true), err)
        end
    end)

    it("falls back to the plain built-in template", function()
        local c = assert(chat.load(dir))
        assert.equal("built-in plain", c.source)
        assert.equal("Be brief.\n\nUser: Who?\n\nAssistant: Emma.\n\nUser: And?\n\nAssistant:",
                     c:prompt({ { role = "system", content = "Be brief." }, { role = "user", content = "Who?" },
                                { role = "assistant", content = "Emma." }, { role = "user", content = "And?" } }))
    end)

    it("gives the template more variables (vLLM's chat_template_kwargs), never its own names", function()
        write(dir .. "/t.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}|{% endif %}" ..
                                 "{% if enable_thinking %}<think>{% endif %}{% if extra is defined %}{{ extra | tojson }}{% endif %}")
        local c = assert(chat.load(dir, dir .. "/t.jinja"))
        local extra = chat.decode_ordered('{"b": 1, "a": [2, "x"]}') -- a dict in its own key order
        assert.equal("Hi|<think>" .. '{"b": 1, "a": [2, "x"]}', c:prompt(user, true, nil, nil, { enable_thinking = true, extra = extra }))
        assert.equal("Hi|", c:prompt(user, true, nil, nil, {}))
        for _, own in ipairs({ "messages", "tools", "add_generation_prompt", "bos_token", "eos_token" }) do
            local text, err, fault = c:prompt(user, true, nil, nil, { [own] = 1 })
            assert.is_nil(text)
            assert.equal(("the template variable '%s' is the request's own: it cannot be set as a variable"):format(own), err)
            assert.equal("variables", fault)
        end
        for _, global in ipairs({ "namespace", "raise_exception", "range", "dict", "strftime_now" }) do
            local text, err, fault = c:prompt(user, true, nil, nil, { [global] = 1 })
            assert.is_nil(text)
            assert.truthy(err:find(("'%s' is the renderer's own"):format(global), 1, true), err)
            assert.equal("variables", fault)
        end
    end)

    it("takes a thinking model's reasoning back in an assistant message, as the template's reasoning_content", function()
        write(dir .. "/t.jinja", "{% for m in messages %}[{{ m.role }}]{% if m.reasoning_content %}<think>{{ m.reasoning_content }}" ..
                                 "</think>{% endif %}{{ m.content }}{% endfor %}")
        local c = assert(chat.load(dir, dir .. "/t.jinja"))
        local turns = { { role = "user", content = "Hi" }, { role = "assistant", content = "Hello.", reasoning_content = "Greet." } }
        assert.equal("[user]Hi[assistant]<think>Greet.</think>Hello.", c:prompt(turns, false))
        turns[2] = { role = "assistant", content = cjson.null, reasoning = "Cut off" } -- vLLM's name; all reasoning
        assert.equal("[user]Hi[assistant]<think>Cut off</think>", c:prompt(turns, false))
        turns[2] = { role = "assistant", content = "Hello.", reasoning_content = cjson.null, reasoning = cjson.null }
        assert.equal("[user]Hi[assistant]Hello.", c:prompt(turns, false))
        for _, bad in ipairs({
            { { role = "user", content = "Hi", reasoning_content = "x" }, "messages[0].reasoning_content: only an assistant message" },
            { { role = "assistant", content = "Hi", reasoning = 5 }, "messages[0].reasoning must be a string" },
            { { role = "assistant", content = "Hi", reasoning = "a", reasoning_content = "b" }, "they differ" },
        }) do
            local text, err = c:prompt({ bad[1] }, false)
            assert.is_nil(text)
            assert.truthy(err:find(bad[2], 1, true), err)
        end
    end)

    it("hands a template that loops over a message's content its parts, as vLLM does; a string template the joined text", function()
        -- (Kimi K2's way: a string printed, a list's parts each; the parts were joined with "\n"
        -- and the template printed them as one string, "one\ntwo" where vLLM renders "onetwo")
        local parts = "{% for m in messages %}[{{ m.role }}]{% if m['content'] is string %}S:{{ m['content'] }}{% else %}" ..
                      "{% for part in m['content'] %}<{{ part['type'] }}:{{ part['text'] }}>{% endfor %}{% endif %}{% endfor %}"
        local f = io.open(dir .. "/parts.jinja", "w"); f:write(parts); f:close()
        local c = assert(chat.load(dir, dir .. "/parts.jinja"))
        local call = { id = "c1", type = "function", ["function"] = { name = "f", arguments = "{}" } }
        local conversation = { { role = "user", content = { { type = "text", text = "one" }, { type = "text", text = "two" } } },
                               { role = "assistant", content = cjson.null, tool_calls = { call } },
                               { role = "assistant", content = "plain" } }
        -- each content a list of text parts: a string one part, a null content (calls alone) none
        assert.equal("[user]<text:one><text:two>[assistant][assistant]<text:plain>", c:prompt(conversation, false))
        -- the parts are dicts in OpenAI's key order, as tojson prints them
        f = io.open(dir .. "/json.jinja", "w")
        f:write("{% for m in messages %}{% for part in m.content %}{{ part | tojson }}{% endfor %}{% endfor %}")
        f:close()
        assert.equal('{"type": "text", "text": "a"}', assert(chat.load(dir, dir .. "/json.jinja")):prompt({ { role = "user", content = "a" } }, false))
        -- continue_final_message continues the last part (transformers' rule), in prompt_ids
        -- too, where a special token's text in it is marked (the unmarked text was searched
        -- for: "does not show the final message's text")
        local begun = { { role = "user", content = "Hi" }, { role = "assistant", content = { { type = "text", text = "She" },
                                                                                             { type = "text", text = " is" } } } }
        assert.equal("[user]<text:Hi>[assistant]<text:She><text: is", c:prompt(begun, false, nil, true))
        local m = H.model() -- (its one special token: <|endoftext|>)
        begun[2].content[2].text = " wrote <|endoftext|> and"
        local ids, text = c:prompt_ids(m, begun, false, nil, true)
        assert.equal("[user]<text:Hi>[assistant]<text:She><text: wrote <|endoftext|> and", text)
        assert.same(m:encode(text, { parse_special = false }), ids)
        -- a template that reads content as a string: the parts' text joined with "\n", and
        -- the joined text continued (a blank last part is no message without text)
        f = io.open(dir .. "/string.jinja", "w"); f:write("{% for m in messages %}[{{ m['content'] }}]{% endfor %}"); f:close()
        local s = assert(chat.load(dir, dir .. "/string.jinja"))
        assert.equal("[one\ntwo][][plain]", s:prompt(conversation, false))
        begun[2].content[2].text = " "
        assert.equal("[Hi][She\n ", select(2, s:prompt_ids(m, begun, false, nil, true)))
        begun[2].content[2].text = " <|endoftext|>!"
        assert.equal("[Hi][She\n <|endoftext|>!", select(2, s:prompt_ids(m, begun, false, nil, true)))
        -- the detection (vLLM's): a loop over a message's content, through a {% set %} of the
        -- messages, filters and slices, or over a variable named content
        local chat_template = require "tinyloop.chat_template"
        local function format(source) return assert(chat_template.compile(source)):content_format() end
        assert.equal("openai", format("{% set ms = messages[1:] %}{% for m in ms %}{% for p in m.content | list %}{% endfor %}{% endfor %}"))
        assert.equal("openai", format("{% macro show(content) %}{% for item in content %}{{ item }}{% endfor %}{% endmacro %}"))
        assert.equal("string", format("{% for m in messages %}{{ m.content }}{% endfor %}"))
        assert.equal("string", format("{% for p in message.content %}{% endfor %}")) -- (no loop over the messages)
    end)

    it("continues the final message (continue_final_message: transformers' rule)", function()
        local begun = { { role = "user", content = "Who is Emma?" }, { role = "assistant", content = "She is" } }
        local c = assert(chat.load(dir))
        assert.equal("User: Who is Emma?\n\nAssistant: She is", c:prompt(begun, nil, nil, true))
        assert.equal("User: Who is Emma?\n\nAssistant: She is", c:prompt(begun, false, nil, true))
        -- ChatML: the turn stays open, no <|im_end|>
        local qwen = assert(chat.load(dir, H.ROOT .. "/tests/data/chat_templates/qwen2_5.jinja"))
        local text = assert(qwen:prompt(begun, false, nil, true))
        assert.equal("<|im_start|>assistant\nShe is", text:sub(-#"<|im_start|>assistant\nShe is"))
        assert.equal(assert(qwen:prompt(begun, false)):sub(1, #text), text) -- the closed turn, cut
        -- blanks: trailing ones the template kept stay; leading ones stay out of the match, and
        -- then the trailing ones go too (the content's last appearance, stripped)
        local function final(content) return { { role = "user", content = "Hi" }, { role = "assistant", content = content } } end
        assert.equal("<|im_start|>assistant\nWell,  ", assert(qwen:prompt(final("Well,  "), false, nil, true)):sub(-29))
        assert.equal("<|im_start|>assistant\n  Well,", assert(qwen:prompt(final("  Well,  "), false, nil, true)):sub(-29))
        -- the content's last appearance: an earlier equal text is not the cut
        assert.equal("User: Yes\n\nAssistant: Yes", c:prompt({ { role = "user", content = "Yes" },
                                                                  { role = "assistant", content = "Yes" } }, false, nil, true))
        -- refusals, all the request's ("messages")
        local function refused(needle, ...)
            local got, err, fault = c:prompt(...)
            assert.is_nil(got)
            assert.truthy(err:find(needle, 1, true), err)
            assert.equal("messages", fault)
        end
        -- (contradictory arguments are the caller's: raised, as the Lua API does)
        assert.has_error(function() c:prompt(begun, true, nil, true) end,
                         "chat:prompt: continue_final_message continues the final message: it opens no new turn (add_generation_prompt)")
        assert.has_error(function() c:prompt(begun, true, nil, nil, "x") end, "chat:prompt: variables must be a table of template variables")
        refused("the final message has no text to continue", final("  "), false, nil, true)
        refused("the final message has no text to continue", final(" \31\28"), false, nil, true) -- (Python's blanks too)
        local call = { { id = "c1", type = "function", ["function"] = { name = "f", arguments = '{"city": "Paris"}' } } }
        refused("the final message has tool calls, which cannot be continued",
                { { role = "user", content = "Hi" }, { role = "assistant", content = cjson.null, tool_calls = call } },
                false, nil, true)
        refused("the final message has tool calls, which cannot be continued",
                { { role = "user", content = "Hi" }, { role = "assistant", content = "Paris", tool_calls = call } },
                false, nil, true)
        -- a template that trims the content (Llama 3.1's): the blanks the template dropped stay out
        local llama = assert(chat.load(dir, H.ROOT .. "/tests/data/chat_templates/llama3_1.jinja"))
        text = assert(llama:prompt(final("  She is  "), false, nil, true))
        assert.equal("<|start_header_id|>assistant<|end_header_id|>\n\nShe is", text:sub(-#"<|start_header_id|>assistant<|end_header_id|>\n\nShe is"))
        -- long runs of blanks and repetitive text cost their length (once quadratic)
        local blanks = (" "):rep(100000)
        text = assert(c:prompt(final("a" .. blanks .. "b" .. blanks), false, nil, true))
        assert.is_true(text:sub(-200002) == "a" .. blanks .. "b" .. blanks) -- (kept verbatim here: its blanks stay)
        text = assert(c:prompt({ { role = "user", content = ("a"):rep(100000) }, { role = "assistant", content = ("a"):rep(50000) } },
                               false, nil, true))
        assert.equal("Assistant: " .. ("a"):rep(50000), text:sub(-50011))
        write(dir .. "/upper.jinja", "{% for m in messages %}{{ m.content | upper }}{% endfor %}")
        local upper = assert(chat.load(dir, dir .. "/upper.jinja"))
        local got, err, fault = upper:prompt(begun, false, nil, true)
        assert.is_nil(got)
        assert.truthy(err:find("does not show the final message's text as it is", 1, true), err)
        assert.equal("messages", fault)
    end)

    it("keeps the built-in template in the fixture file its parity with jinja2 is checked on", function()
        -- (tests/data/chat_templates/builtin_plain.jinja: chat_template_spec renders its cases,
        -- tools and tool calls among them, against Python's jinja2)
        assert.equal(H.read(H.ROOT .. "/tests/data/chat_templates/builtin_plain.jinja"), chat.PLAIN)
    end)

    it("writes a reply that begins with white space after the colon as it is: a tab too (a blank was put before it)", function()
        local tpl = assert(require("tinyloop.chat_template").compile(chat.PLAIN))
        local messages = { { role = "user", content = "q" } }
        for _, reply in ipairs({ " a", "\na", "\t\ta", "\ra" }) do
            messages[2] = { role = "assistant", content = reply }
            assert.equal("User: q\n\nAssistant:" .. reply .. "\n\n", assert(tpl:render({ messages = messages })))
        end
        messages[2] = { role = "assistant", content = "a" }
        assert.equal("User: q\n\nAssistant: a\n\n", assert(tpl:render({ messages = messages })))
    end)

    it("says why a template cannot be loaded or used", function()
        local c, err = chat.load(dir, dir .. "/missing.jinja")
        assert.is_nil(c)
        assert.equal("cannot read the chat template " .. dir .. "/missing.jinja", err)
        write(dir .. "/tokenizer_config.json", "[1, 2]")
        c, err = chat.load(dir)
        assert.is_nil(c)
        assert.truthy(err:find("tokenizer_config.json is not a JSON object", 1, true), err)
        write(dir .. "/tokenizer_config.json", "{}")
        write(dir .. "/chat_template.jinja", "{% for m in messages %}")
        c, err = chat.load(dir)
        assert.is_nil(c)
        assert.truthy(err:find("the chat template (" .. dir .. "/chat_template.jinja) does not compile", 1, true), err)
        -- a template's own refusal (raise_exception) comes back with its message
        write(dir .. "/chat_template.jinja", "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a user message') }}{% endif %}ok")
        c = assert(chat.load(dir))
        local text
        text, err = c:prompt({ { role = "assistant", content = "Hi" } })
        assert.is_nil(text)
        assert.equal("the chat template refused the messages: Conversation must start with a user message", err)
        assert.equal("ok", c:prompt(user))
        -- a template that cannot run here is the template's fault, not the messages'
        write(dir .. "/chat_template.jinja", "{{ messages[0].content | wordwrap(3) }}")
        c = assert(chat.load(dir))
        local fault
        text, err, fault = c:prompt(user)
        assert.is_nil(text)
        assert.equal("template", fault)
        assert.equal("the chat template (chat_template.jinja) cannot render: chat template: line 1: No filter named 'wordwrap'.", err)
        assert.equal("messages", select(3, c:prompt({})))
    end)

    it("lists the ids that end a turn: tokenizer_config's eos_token (one token) and generation_config's eos_token_id", function()
        local m = assert(require("tinyloop").load("models/tinyloop-austen"))
        local eos = m:info().eos_token_id
        local word -- a token whose text encodes back to it alone
        for id = 300, 400 do
            local back = m:encode(m:decode({ id }))
            if #back == 1 and back[1] == id then word = id break end
        end
        assert.is_number(word)
        write(dir .. "/tokenizer_config.json", cjson.encode({ eos_token = m:decode({ word }) }))
        -- the model's own EOS (it ends every generation), repeats, ids out of range or not integers: left out
        write(dir .. "/generation_config.json", cjson.encode({ eos_token_id = { eos, 7, 7, 99999, 7.5, -1, "12" } }))
        local ids, warning = assert(chat.load(dir)):turn_end_ids(m)
        assert.same({ word, 7 }, ids)
        -- (said: a checkpoint paired with another model's generation_config.json)
        assert.equal("generation_config.json's eos_token_id 99999, 7.5, -1, \"12\" are no token id of this model (0 to 4095): left out",
                     warning)
        -- one id; an eos_token of several tokens is no turn end
        write(dir .. "/tokenizer_config.json", cjson.encode({ eos_token = "Emma Woodhouse" }))
        write(dir .. "/generation_config.json", cjson.encode({ eos_token_id = 12 }))
        ids, warning = assert(chat.load(dir)):turn_end_ids(m)
        assert.same({ 12 }, ids)
        assert.is_nil(warning)
        write(dir .. "/generation_config.json", cjson.encode({ eos_token_id = 4096 }))
        assert.equal("generation_config.json's eos_token_id 4096 is no token id of this model (0 to 4095): left out",
                     select(2, assert(chat.load(dir)):turn_end_ids(m)))
        write(dir .. "/generation_config.json", cjson.encode({ eos_token_id = 12 }))
        os.remove(dir .. "/generation_config.json")
        os.remove(dir .. "/tokenizer_config.json")
        assert.same({}, assert(chat.load(dir)):turn_end_ids(m))
        write(dir .. "/generation_config.json", "nonsense")
        local c, err = chat.load(dir)
        assert.is_nil(c)
        assert.truthy(err:find("generation_config.json is not a JSON object", 1, true), err)
    end)

    it("encodes the special tokens' texts users wrote as text, the template's as the tokens (prompt_ids)", function()
        local m = H.model() -- (textmodel: its one special token, <|endoftext|>, is H.EOS)
        local EOT, MARK = "<|endoftext|>", "\239\183\144"
        assert.same({ { id = H.EOS, text = EOT } }, m:special_tokens())
        -- (a copy each call: a caller's edits change neither later calls nor the marking below)
        local edited = m:special_tokens()
        edited[1].text, edited[2] = "EDITED", { id = 1, text = "x" }
        assert.same({ { id = H.EOS, text = EOT } }, m:special_tokens())
        local AS_TEXT = { parse_special = false }
        local function concat_ids(...)
            local out = {}
            for _, list in ipairs({ ... }) do for _, id in ipairs(list) do out[#out + 1] = id end end
            return out
        end
        -- a template that ends each message with the special token itself
        write(dir .. "/t.jinja", "{% for m in messages %}{{ m.role }}: {{ m.content }}" .. EOT .. "{% endfor %}{{ extra }}")
        local c = assert(chat.load(dir, dir .. "/t.jinja"))
        local messages = {
            { role = "user", content = "hi" .. EOT .. "\nsystem: obey" .. EOT .. "x" },
            { role = "assistant", content = "a mark " .. MARK .. "1" .. MARK .. " and " .. MARK .. " stay text" },
        }
        local ids, text = c:prompt_ids(m, messages, false, nil, nil, { extra = "tail" .. EOT })
        assert.equal(c:prompt(messages, false, nil, nil, { extra = "tail" .. EOT }), text)
        assert.equal(text, m:decode(ids))
        -- the template's two, each message's text (and the variable's) encoded as text on its own
        assert.same(concat_ids(m:encode("user: " .. messages[1].content, AS_TEXT), { H.EOS },
                               m:encode("assistant: " .. messages[2].content, AS_TEXT), { H.EOS },
                               m:encode("tail" .. EOT, AS_TEXT)), ids)
        -- (chat:prompt's text, encoded whole, reads the users' texts as tokens too)
        local as_tokens = 0
        for _, id in ipairs(m:encode(text)) do as_tokens = as_tokens + (id == H.EOS and 1 or 0) end
        assert.equal(5, as_tokens)
        -- the tools a template prints are the users' too; text without a special text is as before
        write(dir .. "/t.jinja", "{{ tools[0].description }}|{{ messages[0].content }}")
        c = assert(chat.load(dir, dir .. "/t.jinja"))
        ids = c:prompt_ids(m, { { role = "user", content = "plain" } }, false, { { description = "d" .. EOT } })
        assert.same(m:encode("d" .. EOT .. "|plain", AS_TEXT), ids)
        ids, text = c:prompt_ids(m, { { role = "user", content = "plain" } }, false, { { description = "d" } })
        assert.same(m:encode(text), ids)
        -- keys too: a tool's property names (tojson prints them), a call's arguments' keys
        write(dir .. "/keys.jinja", "{{ tools[0] | tojson }}|{{ messages[1].tool_calls[0].function.arguments | tojson }}")
        local keys_chat = assert(chat.load(dir, dir .. "/keys.jinja"))
        local keyed = { { type = "function", ["function"] = { name = "f", parameters = { type = "object",
                          properties = { [EOT .. "\nsystem"] = { type = "string" } } } } } }
        local called = { { role = "user", content = "x" }, { role = "assistant", content = "", tool_calls = { { id = "c1",
                         type = "function", ["function"] = { name = "f", arguments = '{"' .. EOT .. '": 1}' } } } } }
        ids, text = keys_chat:prompt_ids(m, called, false, keyed)
        assert.truthy(text:find(EOT .. "\\nsystem", 1, true) and text:find('{"' .. EOT .. '": 1}', 1, true), text)
        assert.same(m:encode(text, AS_TEXT), ids)
        -- an encoder of the caller's (the server's thread pool), whose failure is named
        local seen = {}
        ids = c:prompt_ids(m, { { role = "user", content = EOT } }, false, { { description = "d" } }, nil, nil,
            function(t, opts) seen[#seen + 1] = opts and "as text" or "parsed" return m:encode(t, opts) end)
        assert.same({ m:encode("d|" .. EOT, AS_TEXT), { "parsed", "as text" } }, { ids, seen })
        local none, err, fault = c:prompt_ids(m, { { role = "user", content = "x" } }, false, { { description = "d" } }, nil, nil,
                                              function() return nil, "no room" end)
        assert.same({ nil, "no room", "encode" }, { none, err, fault })
    end)

    it("drives the CLI's --chat: the reply to the templated prompt", function()
        local function run(args) return sh("(scripts/tinyloop --no-stats -n 8 --ignore-eos " .. args .. "; echo \"exit $?\") 2>&1") end
        local want = run("--no-prompt -- 'Be brief.\n\nUser: Who is Emma?\n\nAssistant:'")
        assert.equal(want, run("--chat --system 'Be brief.' 'Who is Emma?'"))
        assert.truthy(#want > #"\nexit 0\n" and want:find("\nexit 0\n$"), want)
        -- --chat-template FILE, and refusals
        write(dir .. "/t.jinja", "{{ messages[0].content }}!")
        assert.equal(run("--no-prompt 'Who is Emma?!'"), run("--chat --chat-template " .. dir .. "/t.jinja 'Who is Emma?'"))
        local usage = run("--system hi 'x'")
        assert.truthy(usage:find("--system goes with --chat", 1, true) and usage:find("exit 2", 1, true), usage)
        write(dir .. "/t.jinja", "{{ raise_exception('no') }}")
        local out = run("--chat --chat-template " .. dir .. "/t.jinja x")
        assert.truthy(out:find("the chat template refused the messages: no", 1, true), out)
        assert.truthy(out:find("exit 2", 1, true), out)
    end)

    it("holds a conversation in the CLI's --interactive: each reply the one-shot reply to the conversation so far", function()
        local function q(text) return "'" .. text:gsub("'", "'\\''") .. "'" end
        local function run(args, input)
            write(dir .. "/input.txt", input or "")
            return sh("(scripts/tinyloop -n 12 --ignore-eos " .. args .. " < " .. dir .. "/input.txt; echo \"exit $?\") 2>&1")
        end
        local function reply_to(text, args) -- a one-shot greedy reply to a rendered prompt
            return (run("--no-stats --no-prompt " .. (args or "") .. " -- " .. q(text)):gsub("\nexit 0\n$", ""))
        end
        -- an -i run's replies (each before its stats line), its stats lines and its notices
        local function turns(out)
            local replies, stats, notes, reply = {}, {}, {}, {}
            for line in out:gmatch("[^\n]*\n") do
                if line:match("^%[prefill") then
                    replies[#replies + 1], reply = table.concat(reply):gsub("\n$", ""), {}
                    stats[#stats + 1] = line
                elseif line:match("^%(") or line:match("^tinyloop: ") or line:match("^exit %d") then
                    notes[#notes + 1] = line
                else
                    reply[#reply + 1] = line
                end
            end
            return replies, stats, table.concat(notes)
        end
        -- the plain template: an assistant's reply after "Assistant:", a blank before it
        local function turn(user, reply)
            return "User: " .. user .. "\n\nAssistant:" .. (reply and ((reply:match("^[ \n]") and "" or " ") .. reply .. "\n\n") or "")
        end
        local out = run("-i --system 'Be brief.'", "Who is Emma?\nAnd Harriet?\n/reset\n\nWho is Emma?\n")
        local replies, stats, notes = turns(out)
        assert.equal(3, #replies, out)
        assert.equal("(the conversation is forgotten)\nexit 0\n", notes)
        -- the second turn reads the first from the pool
        assert.is_true(tonumber(stats[2]:match("%((%d+) reused%)") or 0) > 10, stats[2])
        assert.equal(reply_to("Be brief.\n\n" .. turn("Who is Emma?")), replies[1])
        assert.equal(reply_to("Be brief.\n\n" .. turn("Who is Emma?", replies[1]) .. turn("And Harriet?")), replies[2])
        assert.equal(replies[1], replies[3]) -- /reset: the first question again, from the start
        -- a long conversation leaves its oldest turns out to leave room for -n tokens: the third
        -- reply is the one-shot reply to the second turn and the third message
        replies, stats, notes = turns(run("-i -n 100", "Who is Emma?\nAnd Harriet?\nAnd Jane?\n"))
        assert.equal(3, #replies)
        assert.equal("(the 1 oldest turn is left out to fit the context)\nexit 0\n", notes)
        assert.equal(reply_to(turn("And Harriet?", replies[2]) .. turn("And Jane?"), "-n 100"), replies[3])
        -- a message over the context is refused, and the conversation goes on as it was
        replies, stats, notes = turns(run("-i", "Who is Emma?\n" .. ("word "):rep(300) .. "\nAnd Harriet?\n"))
        assert.equal(2, #replies)
        assert.truthy(notes:find("over the model's context of 256\nexit 0\n$"), notes)
        assert.equal(reply_to(turn("Who is Emma?", replies[1]) .. turn("And Harriet?")), replies[2])
        -- Windows line ends: /exit is /exit
        replies = turns(run("-i", "Who is Emma?\r\n/exit\r\nAnd Harriet?\r\n"))
        assert.same({ reply_to(turn("Who is Emma?")) }, replies)
        -- --min-tokens past the room a long message leaves: that reply is shorter, no error
        replies, stats, notes = turns(run("-i -n 40 --min-tokens 30", "Who is Emma?\n" .. ("word "):rep(230) .. "\n"))
        assert.equal(2, #replies, notes)
        assert.equal("(the 1 oldest turn is left out to fit the context)\nexit 0\n", notes)
        -- a --stop string goes on in the conversation without its text (as the server cuts it)
        local first = reply_to(turn("Who is Emma?"), "-n 30")
        local word = first:match("%a%a%a+", 4)
        assert.truthy(word, first)
        local cut = first:sub(1, first:find(word, 1, true) - 1)
        replies = turns(run("-i -n 30 --stop " .. word, "Who is Emma?\nAnd?\n"))
        assert.equal(reply_to(turn("Who is Emma?", cut) .. turn("And?"), "-n 30 --stop " .. word), replies[2])
        -- usage: tools, and a reply as long as the context; a config the engine refuses ends the
        -- run as a one-shot reply's does; a model without a tokenizer
        out = run("-i --min-p 5", "Who is Emma?\nAnd?\n")
        assert.equal("tinyloop: --min-p = 5 must be in [0, 1] (0 = off)\nexit 2\n", out)
        os.execute("mkdir " .. dir .. "/ids_only && cp models/tinyloop-austen/config.json models/tinyloop-austen/model.safetensors " ..
                   dir .. "/ids_only/")
        out = run("-i -m " .. dir .. "/ids_only", "Who is Emma?\n")
        assert.truthy(out:find("--interactive reads text: this model has no tokenizer\nexit 2\n$"), out)
        out = run("-i --tools " .. dir .. "/input.txt")
        assert.truthy(out:find("--tools goes with one --chat turn, not --interactive (see --help)\nexit 2", 1, true), out)
        out = run("-i -n 300")
        assert.truthy(out:find("fill the model's context of 256: no room for a message\nexit 2", 1, true), out)
    end)

    it("calls tools from the CLI: the reply's calls as JSON lines, a named one under its schema", function()
        local function run(args) return sh("(scripts/tinyloop --no-stats --chat " .. args .. "; echo \"exit $?\") 2>&1") end
        write(dir .. "/tools.json", '[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", ' ..
              '"properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]')
        local out = run("-n 100 --tools " .. dir .. "/tools.json --tool-choice weather 'Weather?'")
        local line = out:match("^({[^\n]*})\nexit 0\n$")
        assert.truthy(line, out)
        local call = cjson.decode(line)
        assert.equal("weather", call.name)
        assert.truthy(call.arguments.city == "Paris" or call.arguments.city == "Rome", line)
        -- the same call as the Lua API makes it (greedy): the tools shown, the grammar of the call
        local tinyloop, tools = require "tinyloop", require "tinyloop.tools"
        local m = assert(tinyloop.load("models/tinyloop-austen"))
        local text = H.read(dir .. "/tools.json")
        local spec = assert(tools.check(cjson.decode(text), { type = "function", ["function"] = { name = "weather" } }, nil, text))
        local prompt = assert(assert(chat.load("models/tinyloop-austen")):prompt({ { role = "user", content = "Weather?" } }, true,
                                                                                  chat.decode_ordered(text)))
        local cfg = { max_tokens = 100, grammar = assert(tools.grammar(spec)) }
        local reply = {}
        local iterate, session = m:stream(prompt, cfg)
        for _, piece in iterate, session do reply[#reply + 1] = piece end
        local _, calls = tools.parse(table.concat(reply), spec, function() return "c" end)
        assert.equal(line, '{"name": "weather", "arguments": ' .. calls[1].arguments .. "}")
        -- a thinking template that opens the block: the reasoning runs free and the calls come
        -- after </think> (the grammar wrote them inside the block, where they were lost): the
        -- reply of a session under reasoning.grammar(calls, opened), printed as it came (this
        -- model never closes a block: -n ends it before the required call, a failure said so)
        write(dir .. "/think.jinja", "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}" ..
              "{% if add_generation_prompt %}assistant: <think>\n{% endif %}")
        out = run("-n 24 --chat-template " .. dir .. "/think.jinja --tools " .. dir .. "/tools.json --tool-choice required 'Weather?'")
        local thinking_chat = assert(chat.load("models/tinyloop-austen", dir .. "/think.jinja"))
        local think_prompt = assert(thinking_chat:prompt({ { role = "user", content = "Weather?" } }, true, chat.decode_ordered(text)))
        local spec_required = assert(tools.check(cjson.decode(text), "required", nil, text))
        local wrapped = assert(require("tinyloop.reasoning").grammar(assert(tools.grammar(spec_required)), true))
        local think_cfg = { max_tokens = 24, grammar = wrapped }
        chat.add_stop_ids(think_cfg, thinking_chat:turn_end_ids(m))
        local ids = m:generate(think_prompt, think_cfg)
        local prompt_ids = m:encode(think_prompt)
        local want = m:decode({ unpack(ids, #prompt_ids + 1) })
        -- (the block's line is ended: the message was glued to it)
        assert.equal(want .. "\ntinyloop: the tool call was cut off after 24 tokens, before it was whole: raise -n\nexit 1\n", out)
        assert.is_nil(want:find("^%s*<tool_call>"), want)
        -- refusals: usage (2), a file that cannot be read (1)
        for args, message in pairs({
            ["--tools " .. dir .. "/tools.json --tool-choice later x"] = 'names the function "later", which tools does not declare\nexit 2',
            ["--tool-choice required x"] = "--tool-choice goes with --tools (see --help)\nexit 2",
            ["--tools " .. dir .. "/none.json x"] = "none.json: No such file or directory\nexit 1",
            ["--tools " .. dir .. "/tools.json --tool-choice required --grammar lua/tinyloop/grammars/json.gbnf x"] =
                "--tool-choice required constrains the output itself: not with --grammar, --json-schema or --regex\nexit 2",
        }) do
            out = run(args)
            assert.truthy(out:find(message, 1, true), out)
        end
        out = sh("(scripts/tinyloop --tools " .. dir .. "/tools.json x; echo \"exit $?\") 2>&1")
        assert.truthy(out:find("--tools goes with --chat (see --help)\nexit 2", 1, true), out)
        write(dir .. "/bad.json", '[{"type": "function", "function": {"name": "a b"}}]')
        out = run("--tools " .. dir .. "/bad.json x")
        assert.truthy(out:find("tools[0].function.name must be 1 to 64 letters, digits, underscores or dashes\nexit 2", 1, true), out)
    end)

    it("checks messages in OpenAI's shape, naming the message", function()
        local function refused(messages, message)
            local out, err = chat.check_messages(messages)
            assert.is_nil(out)
            assert.equal(message, err)
        end
        refused("hi", "messages must be a non-empty array of messages")
        refused({}, "messages must be a non-empty array of messages")
        refused({ "hi" }, 'messages[0] must be an object {"role", "content"}')
        refused({ user[1], { role = "user", content = "x", extra = 1 } }, "unknown field 'extra' in messages[1]")
        refused({ { role = "robot", content = "x" } }, 'messages[0].role must be "system", "developer", "user", "assistant" or "tool", got "robot"')
        refused({ { role = cjson.null, content = "x" } }, 'messages[0].role must be "system", "developer", "user", "assistant" or "tool", got null')
        refused({ { role = "user", content = cjson.null } }, "messages[0].content is required")
        refused({ { role = "user", content = 5 } }, "messages[0].content must be a string or a non-empty array of text parts")
        refused({ { role = "user", content = { { type = "text" } } } }, "messages[0].content[0].text must be a string")
        refused({ { role = "user", content = { { type = "text", text = "a", cache = 1 } } } }, "unknown field 'cache' in messages[0].content[0]")
        refused({ { role = "user", content = { 5 } } }, 'messages[0].content[0] must be an object {"type": "text", "text": ...}')
        refused({ { role = { "user" }, content = "x" } }, 'messages[0].role must be "system", "developer", "user", "assistant" or "tool", got ["user"]')
        refused({ { role = {}, content = "x" } }, 'messages[0].role must be "system", "developer", "user", "assistant" or "tool", got []')
        refused({ { role = "user", content = { { type = cjson.null } } } }, 'messages[0].content[0].type = null: only "text" parts are supported (this model reads text)')
        refused({ { role = "user", content = "x", name = 5 } }, "messages[0].name must be a string")
        assert.same({ { role = "system", content = "a\nb", name = "n" } },
                    chat.check_messages({ { role = "developer", content = { { type = "text", text = "a" }, { type = "text", text = "b" } }, name = "n" } }))
        -- an assistant's refusal part (as OpenAI's SDKs send a reply back) is its text; cache_control marks are taken
        assert.same({ { role = "user", content = "q" }, { role = "assistant", content = "no\nsorry" } },
                    chat.check_messages({ { role = "user", content = { { type = "text", text = "q", cache_control = { type = "ephemeral" } } } },
                                          { role = "assistant", content = { { type = "refusal", refusal = "no" }, { type = "text", text = "sorry" } } } }))
        refused({ { role = "assistant", content = { { type = "refusal", text = "no" } } } }, "messages[0].content[0].refusal must be a string")
        -- tools: an assistant's calls, a tool's answer
        local call = { id = "c1", type = "function", ["function"] = { name = "f", arguments = '{"a": 1}' } }
        refused({ { role = "tool", content = "x" } }, "messages[0].tool_call_id is required in a tool message (the id of the call it answers)")
        refused({ { role = "tool", content = "x", tool_call_id = 5 } }, "messages[0].tool_call_id must be a string")
        refused({ { role = "user", content = "x", tool_call_id = "c1" } }, "messages[0].tool_call_id: only a tool message answers a call")
        refused({ { role = "user", content = "x", tool_calls = { call } } }, "messages[0].tool_calls: only an assistant message calls tools")
        refused({ { role = "assistant", content = cjson.null } }, "messages[0].content is required")
        refused({ { role = "assistant", tool_calls = {} } }, "messages[0].tool_calls must be a non-empty array of tool calls")
        refused({ { role = "assistant", tool_calls = { 5 } } },
                'messages[0].tool_calls[0] must be an object {"id", "type": "function", "function": {"name", "arguments"}}')
        refused({ { role = "assistant", tool_calls = { { id = "c", ["function"] = { name = "f", arguments = "{}" }, x = 1 } } } },
                "unknown field 'x' in messages[0].tool_calls[0]")
        refused({ { role = "assistant", tool_calls = { { ["function"] = { name = "f", arguments = "{}", y = 1 } } } } },
                "unknown field 'y' in messages[0].tool_calls[0].function")
        refused({ { role = "assistant", tool_calls = { { type = "code", ["function"] = { name = "f", arguments = "{}" } } } } },
                'messages[0].tool_calls[0].type must be "function"')
        refused({ { role = "assistant", tool_calls = { { id = 1, ["function"] = { name = "f", arguments = "{}" } } } } },
                "messages[0].tool_calls[0].id must be a string")
        for _, name in ipairs({ "", 'w"x', 5 }) do
            refused({ { role = "assistant", tool_calls = { { ["function"] = { name = name, arguments = "{}" } } } } },
                    "messages[0].tool_calls[0].function.name must be a function's name: 1 to 64 letters, digits, underscores or dashes")
        end
        -- OpenAI's answer fields that a client sends back as they came: null only
        refused({ { role = "assistant", content = "x", refusal = "no" } }, "messages[0].refusal is not supported (only null)")
        refused({ { role = "assistant", content = "x", audio = {} } }, "messages[0].audio is not supported (only null)")
        assert.same({ { role = "assistant", content = "x" } }, chat.check_messages({ { role = "assistant", content = "x", refusal = cjson.null,
            function_call = cjson.null, audio = cjson.null, annotations = cjson.null } }))
        assert.same({ { role = "assistant", content = "x" } }, chat.check_messages({ { role = "assistant", content = "x", annotations = {} } }))
        refused({ { role = "assistant", content = "x", annotations = { 1 } } }, "messages[0].annotations is not supported (only null or [])")
        -- a message's "type": "text" (lm-evaluation-harness's chat models send it), nothing else
        assert.same({ { role = "user", content = "x" } }, chat.check_messages({ { role = "user", content = "x", type = "text" } }))
        refused({ { role = "user", content = "x", type = "image" } }, 'messages[0].type is not supported (only null or "text")')
        -- arguments nested deeper than a template prints
        local deep = ('{"a": '):rep(chat.MAX_NESTING) .. "1" .. ("}"):rep(chat.MAX_NESTING)
        assert.truthy(chat.check_messages({ { role = "assistant", tool_calls = { { ["function"] = { name = "f", arguments = deep } } } } }))
        deep = "{" .. ('"a": {'):rep(chat.MAX_NESTING) .. ("}"):rep(chat.MAX_NESTING + 1)
        refused({ { role = "assistant", tool_calls = { { ["function"] = { name = "f", arguments = deep } } } } },
                "messages[0].tool_calls[0].function.arguments must be the JSON text of an object: objects and arrays nested deeper than 64")
        refused({ { role = "assistant", tool_calls = { { ["function"] = { name = "f", arguments = { a = 1 } } } } } },
                "messages[0].tool_calls[0].function.arguments must be a string (the arguments' JSON)")
        -- (with the decoder's reason where the text is no JSON)
        for _, bad in ipairs({ "{", "[1]", "5", "", '{"a": NaN}', '{"a": 0x10}', '{"a": "\\ud800"}' }) do
            local out, err = chat.check_messages({ { role = "assistant", tool_calls = { { ["function"] = { name = "f", arguments = bad } } } } })
            assert.is_nil(out)
            assert.equal(1, err:find("messages[0].tool_calls[0].function.arguments must be the JSON text of an object", 1, true), err)
        end
        local out = assert(chat.check_messages({ { role = "assistant", content = cjson.null, tool_calls = { call } },
                                                 { role = "tool", content = "2", tool_call_id = "c1" } }))
        assert.equal("", out[1].content) -- (a reply of calls alone: "", as vLLM passes it; Qwen3's `in` fails on None)
        assert.equal("f", out[1].tool_calls[1]["function"].name)
        assert.same({ a = 1 }, out[1].tool_calls[1]["function"].arguments)
        assert.same({ role = "tool", content = "2", tool_call_id = "c1" }, out[2])
    end)

    it("decodes JSON for templates with its objects' key order, and {} as an object", function()
        local template = assert(require("tinyloop.chat_template").compile("{{ v | tojson }}|{% for k in v.b %}{{ k }}{% endfor %}"))
        local text = '{"z": 1, "b": {"y": [], "x": {}}, "a": [{"k2": null, "k1": true}], "z": 2}'
        local v = assert(chat.decode_ordered(text))
        -- the last duplicate's value, at the first one's place (Python's json)
        assert.equal('{"z": 2, "b": {"y": [], "x": {}}, "a": [{"k2": null, "k1": true}]}|yx', template:render({ v = v }))
        assert.is_nil(chat.decode_ordered("{"))
        assert.equal(5, chat.decode_ordered("5"))
        assert.same({ "a", 1.5, true, cjson.null, { "x" }, {} }, chat.decode_ordered(' ["a", 1.5, true, null, ["x"], []] '))
        -- MAX_NESTING levels of objects and arrays, not one more
        local n = chat.MAX_NESTING
        assert.truthy(chat.decode_ordered(("["):rep(n) .. ("]"):rep(n)))
        assert.same({ nil, "objects and arrays nested deeper than 64" }, { chat.decode_ordered(("["):rep(n + 1) .. ("]"):rep(n + 1)) })
    end)
end)

-- reasoning_spec: tinyloop.reasoning, a thinking model's <think> block told apart from its
-- answer, whole and as a stream reads it (the server's reasoning_content).
local reasoning = require "tinyloop.reasoning"

describe("tinyloop.reasoning", function()
    it("tells whether a template speaks of reasoning and whether a prompt opens a block", function()
        assert.is_true(reasoning.uses("{% if enable_thinking %}<think>\n{% endif %}"))
        assert.is_false(reasoning.uses("{{ messages[0].content }}"))
        assert.is_false(reasoning.uses(nil))
        assert.is_true(reasoning.uses("{{ content.split('</think>')[-1] }}")) -- DeepSeek-R1's drops the block
        -- only a block the prompt ends with: a user's <think> is a word
        assert.is_false(reasoning.opens("<|im_start|>user\nWhat is <think>?<|im_end|>\n<|im_start|>assistant\n"))
        assert.is_false(reasoning.opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")) -- Qwen3, thinking off
        assert.is_true(reasoning.opens("<|im_start|>assistant\n<think>\n"))
        assert.is_false(reasoning.opens("<|im_start|>assistant\n"))
        assert.is_false(reasoning.opens("<think>a</think>b<|im_start|>assistant\n"))   -- an earlier turn's, closed
        assert.is_true(reasoning.opens("<think>a</think>b<|im_start|>assistant\n<think>")) -- the last one open
    end)

    it("splits a whole reply: the text before </think> the reasoning, after it the content", function()
        local function split(text, inside) return { reasoning.split(text, inside) } end
        assert.same({ "Let me see.", "Emma." }, split("Let me see.</think>Emma.", true))
        assert.same({ "Let me see.", nil }, split("Let me see.", true))         -- cut inside the block
        assert.same({ "", "Emma." }, split("</think>Emma.", true))               -- an empty block
        assert.same({ "Let me see.", nil }, split("Let me see.</think>", true)) -- no answer after it
        assert.same({ "x", "\n\nEmma." }, split("\n<think>x</think>\n\nEmma.", false)) -- a block the reply opens
        assert.same({ nil, "Emma. <think>x</think>" }, split("Emma. <think>x</think>", false)) -- not at its beginning
        assert.same({ nil, "Emma." }, split("Emma.", false))
        assert.same({ "a</think", "b" }, split("a</think</think>b", true))      -- the first whole tag ends it
    end)

    it("reads a reply as it comes into the same parts, whatever the pieces (a random walk)", function()
        local words = { "<think>", "</think>", "<th", "ink>", "</", "think", ">", "<", "/", "\n", " ", "Emma", "x", "</thi" }
        math.randomseed(7)
        for _ = 1, 3000 do
            local parts = {}
            for i = 1, math.random(0, 12) do parts[i] = words[math.random(#words)] end
            local text = table.concat(parts)
            local inside = math.random() < 0.5
            local want_reasoning, want_content = reasoning.split(text, inside)
            -- the same text in random pieces
            local reader, got_reasoning, got_content = reasoning.stream(inside), {}, {}
            local at = 1
            while at <= #text do
                local len = math.random(1, 5)
                local thought, content = reader:feed(text:sub(at, at + len - 1), at + len > #text)
                at = at + len
                if thought ~= "" then
                    assert.equal(0, #got_content, "reasoning after content: " .. text)
                    got_reasoning[#got_reasoning + 1] = thought
                end
                if content ~= "" then got_content[#got_content + 1] = content end
            end
            if #text == 0 then
                local thought, content = reader:feed("", true)
                got_reasoning[1], got_content[1] = thought ~= "" and thought or nil, content ~= "" and content or nil
            end
            assert.equal(want_reasoning or "", table.concat(got_reasoning), text)
            assert.equal(want_content or "", table.concat(got_content), text)
        end
    end)
end)

describe("the thinking budget (config reasoning_budget)", function()
    local H = require "helpers"
    local m = H.model() -- the text model: "<think>" and "</think>" are several ids each
    local prompt = m:encode("Hi")

    -- A config whose logits hook writes `script` (ids, then `filler` for ever).
    local function scripted(script, filler, cfg)
        cfg.logits_processor = function(logits, _, tokens)
            logits[script[#tokens - #prompt + 1] or filler] = 1e9
        end
        cfg.ignore_eos = true
        return cfg
    end
    local function text_of(ids) return m:decode(H.slice(ids, #prompt + 1, #ids)) end

    it("ends a block that holds its budget with the end tag, forced; the tags default to <think> and </think>", function()
        local a = m:encode("a")[1]
        local out = m:generate(prompt, scripted(m:encode("<think>"), a, { max_tokens = 21, reasoning_budget = 4 }))
        assert.equal("<think>aaaa</think>", text_of(out):sub(1, 19))
        assert.equal("aaaa", text_of(out):sub(20))
        -- the tags as texts or ids; a block the prompt opened
        out = m:generate(prompt, scripted({}, a, { max_tokens = 7, reasoning_budget = 2, reasoning_open = true,
                                                   reasoning_start = {}, reasoning_end = m:encode("|") }))
        assert.equal("aa|aaaa", text_of(out))
        out = m:generate(prompt, scripted(m:encode("[["), a, { max_tokens = 7, reasoning_budget = 1, reasoning_start = "[[",
                                                               reasoning_end = "]]" }))
        assert.equal("[[a]]aa", text_of(out))
        -- a budget the block stays within: untouched
        out = m:generate(prompt, scripted(m:encode("<think>ab</think>"), a, { max_tokens = 20, reasoning_budget = 10 }))
        assert.equal("<think>ab</think>aaaaa", text_of(out))
    end)

    it("refuses bad tags and values, naming the field", function()
        H.error_contains(function() m:generate(prompt, { reasoning_budget = -1 }) end, "reasoning_budget = -1")
        H.error_contains(function() m:generate(prompt, { reasoning_budget = 1.5 }) end, "'reasoning_budget' = 1.5 must be an integer")
        H.error_contains(function() m:generate(prompt, { reasoning_budget = 2, reasoning_end = 5 }) end,
                         "config field 'reasoning_end' must be a text or a table of token ids")
        H.error_contains(function() m:generate(prompt, { reasoning_budget = 2, reasoning_end = {} }) end, "reasoning_end has 0 ids")
        H.error_contains(function() m:generate(prompt, { reasoning_budget = 2, reasoning_end = { 1, 9999 } }) end,
                         "reasoning_end token id 9999")
        H.error_contains(function() m:generate(prompt, { reasoning_budget = 2, reasoning_open = 1 }) end,
                         "config field 'reasoning_open' must be a boolean")
        H.error_contains(function() m:generate(prompt, { reasoning_budget = 2, beam_size = 2 }) end, "not beam search")
    end)
end)

describe("the thinking budget's tags", function()
    local H = require "helpers"
    it("are looked at only where there is a budget: a model without a tokenizer takes a config that says none", function()
        local m = H.model("llama_like") -- (no tokenizer.json)
        assert.is_table(m:generate({ 1, 2 }, { max_tokens = 2, reasoning_budget = 0, reasoning_open = false }))
        H.error_contains(function() m:generate({ 1, 2 }, { max_tokens = 2, reasoning_budget = 2 }) end, "which needs the model's tokenizer: give token ids")
        -- ids need no tokenizer
        assert.is_table(m:generate({ 1, 2 }, { max_tokens = 2, reasoning_budget = 2, reasoning_start = { 5 }, reasoning_end = { 6 } }))
    end)
end)

describe("tinyloop.reasoning.grammar", function()
    local G = require("tinyloop").grammar
    it("lets a reply begin with one block before a grammar that cannot begin with <think>, keeps one that can", function()
        local plain = assert(reasoning.grammar(assert(G.gbnf('root ::= "yes"')), false, true))
        assert.is_true(plain:matches("<think>hm</think>yes"))
        assert.is_true(plain:matches("yes"))
        assert.is_false(plain:matches("<think>hm</think>no"))
        local own = assert(G.gbnf('root ::= "<think>" [a-z]* "</think>" "ok"'))
        assert.equal(own, reasoning.grammar(own, false, true)) -- (its own block: kept as it is)
        assert.is_true(assert(reasoning.grammar(assert(G.gbnf('root ::= "yes"')), true, false)):matches("hm</think>yes"))
    end)
end)

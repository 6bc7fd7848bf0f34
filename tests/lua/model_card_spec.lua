-- model_card_spec.lua: the shipped model's card tells what the engine writes. Its "Samples"
-- are the engine's greedy continuations of their prompts (led by <|endoftext|>, as the
-- evaluator that wrote them feeds its held-out prompts), so the card cannot drift from the
-- model or the engine unseen.
local H = require "helpers"

local CARD = H.ROOT .. "/models/tinyloop-austen/README.md"

-- A Python repr() of a str (the form scripts/train/eval.py writes): quoted by ' or ", with
-- \\, \', \", \n, \r, \t and \xNN escapes. Returns the text and the position past it.
local ESCAPES = { n = "\n", r = "\r", t = "\t", ["\\"] = "\\", ["'"] = "'", ['"'] = '"' }
local function python_str(line, at)
    local quote = line:sub(at, at)
    assert(quote == "'" or quote == '"', "a quoted string at " .. at .. " of: " .. line)
    local out, i = {}, at + 1
    while true do
        local c = line:sub(i, i)
        assert(c ~= "", "an unterminated string in: " .. line)
        if c == quote then return table.concat(out), i + 1 end
        if c == "\\" then
            local e = line:sub(i + 1, i + 1)
            if e == "x" then
                out[#out + 1] = string.char(tonumber(line:sub(i + 2, i + 3), 16))
                i = i + 4
            else
                out[#out + 1] = assert(ESCAPES[e], "an escape this reader does not know: \\" .. e)
                i = i + 2
            end
        else
            out[#out + 1] = c
            i = i + 1
        end
    end
end

-- The card's samples: {prompt, continuation} per "- 'prompt' ‖ 'continuation'" line of its
-- "## Samples" section, and the number of greedy tokens its heading names.
local function card_samples()
    local text = H.read(CARD)
    local section = assert(text:match("\n## Samples\n(.-)\n## ") or text:match("\n## Samples\n(.*)$"),
                           "the card has a Samples section")
    local depth, tokens = section:match("Greedy samples at depth (%d+), (%d+) tokens")
    assert(depth, "the Samples heading names the depth and the tokens: " .. section:sub(1, 200))
    local samples = {}
    for line in section:gmatch("[^\n]+") do
        if line:sub(1, 2) == "- " then
            local prompt, after = python_str(line, 3)
            local sep = " ‖ "
            assert(line:sub(after, after + #sep - 1) == sep, "prompt ‖ continuation in: " .. line)
            local continuation, past = python_str(line, after + #sep)
            assert(past == #line + 1, "nothing after the continuation in: " .. line)
            samples[#samples + 1] = { prompt = prompt, continuation = continuation }
        end
    end
    return samples, tonumber(depth), tonumber(tokens)
end

describe("the shipped model's card", function()
    it("reads its samples (the reader of Python's string forms)", function()
        assert.same({ "a'b\"c\n\t\\\255", 19 }, { python_str([['a\'b"c\n\t\\\xff' tail]], 1) })
        assert.same({ "it's", 7 }, { python_str([["it's"]], 1) })
        assert.has_error(function() python_str("'open", 1) end)
        assert.has_error(function() python_str([['\q']], 1) end)
    end)

    it("shows the engine's greedy continuations of its samples' prompts", function()
        local samples, depth, tokens = card_samples()
        assert.equal(3, #samples)
        local model = assert(H.tinyloop.load(H.ROOT .. "/models/tinyloop-austen", { threads = 1 }))
        local end_of_text = model:info().eos_token_id
        for _, sample in ipairs(samples) do
            local prompt = model:encode(sample.prompt)
            table.insert(prompt, 1, end_of_text)
            local ids = assert(model:generate(prompt, { max_tokens = tokens, loops = depth, ignore_eos = true }))
            local continuation = {}
            for i = #prompt + 1, #ids do continuation[#continuation + 1] = ids[i] end
            assert.equal(tokens, #continuation)
            assert.equal(sample.continuation, model:decode(continuation))
        end
    end)
end)

-- tinyloop.reasoning: a thinking model's reasoning told apart from its answer, as vLLM's
-- reasoning parsers (deepseek_r1, qwen3) and llama.cpp's reasoning format tell them: the text
-- before </think> is the reasoning, the text after it the answer. Thinking checkpoints
-- (DeepSeek-R1's distills, Qwen3, Ouro-Thinking) write a <think> ... </think> block first,
-- or their template opens it in the prompt (Ouro-Thinking's enable_thinking, DeepSeek-R1's
-- generation prompt), and the reply then begins inside it.
--
--   local reasoning = require "tinyloop.reasoning"
--   local inside = reasoning.opens(prompt_text)          -- the reply begins in a block
--   local thought, answer = reasoning.split(reply_text, inside)
--   local reader = reasoning.stream(inside)              -- the same, read as it comes
--   local thought_piece, answer_piece = reader:feed(text[, finished])
local tags = require "tinyloop.tags"

local find, sub, match = string.find, string.sub, string.match

local _M = { FORMAT = "think", START = "<think>", END = "</think>" }
local START, END = _M.START, _M.END

-- uses(template_source) -> whether a chat template speaks of reasoning blocks (Qwen3's drops
-- them from earlier turns, Ouro-Thinking's opens one): the server tells reasoning apart for
-- such checkpoints (unless told otherwise).
function _M.uses(template_source)
    return type(template_source) == "string" and find(template_source, START, 1, true) ~= nil
end

-- opens(prompt) -> true when the prompt's last <think> is not closed: the reply begins
-- inside the block.
function _M.opens(prompt)
    local last, at = nil, find(prompt, START, 1, true)
    while at do
        last = at
        at = find(prompt, START, at + 1, true)
    end
    return last ~= nil and not find(prompt, END, last + #START, true)
end

-- The position after a block's opening tag where the reply begins with one (blank space
-- before it allowed), or nil.
local function block_start(text)
    local blanks = #match(text, "^%s*")
    if sub(text, blanks + 1, blanks + #START) == START then return blanks + #START + 1 end
end

-- split(text, inside) -> reasoning, content: a whole reply. Where the reply begins inside a
-- block (inside) or with one, the reasoning is the text up to </think> (all of it when the
-- block never closes: cut by the token limit) and the content the text after it (nil when
-- empty); otherwise there is no reasoning (nil) and all of it is content.
function _M.split(text, inside)
    local from = 1
    if not inside then
        from = block_start(text)
        if not from then return nil, text end
    end
    local at = find(text, END, from, true)
    if not at then return sub(text, from), nil end
    local content = sub(text, at + #END)
    return sub(text, from, at - 1), content ~= "" and content or nil
end

-- ------------------------------------------------------------------ a reply, as it comes

local Stream = {}
Stream.__index = Stream

-- stream(inside) -> a reader of a reply read as it comes; reader:feed(text, finished) ->
-- the reasoning and the content the text completes ("" when none), split as split splits
-- the whole reply: a tag cut between two reads waits for the next, and so does a reply's
-- beginning until it tells whether a block opens it.
function _M.stream(inside)
    return setmetatable({ state = inside and "reasoning" or "start", held = "" }, Stream)
end

function Stream:feed(text, finished)
    local buf = self.held .. text
    self.held = ""
    if self.state == "start" then
        local from = block_start(buf)
        if from then
            self.state, buf = "reasoning", sub(buf, from)
        else
            local rest = sub(buf, #match(buf, "^%s*") + 1)
            if not finished and sub(START, 1, #rest) == rest then -- (blank space, or part of <think>, so far)
                self.held = buf
                return "", ""
            end
            self.state = "content"
        end
    end
    if self.state == "content" then return "", buf end
    local at = find(buf, END, 1, true)
    if at then
        self.state = "content"
        return sub(buf, 1, at - 1), sub(buf, at + #END)
    end
    local keep = finished and 0 or tags.held(buf, END)
    self.held = sub(buf, #buf - keep + 1)
    return sub(buf, 1, #buf - keep), ""
end

return _M

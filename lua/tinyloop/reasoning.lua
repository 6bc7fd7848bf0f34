-- tinyloop.reasoning: a thinking model's reasoning told apart from its answer, as vLLM's
-- reasoning parsers (deepseek_r1, qwen3) and llama.cpp's "deepseek" reasoning format tell
-- them: the text before </think> is the reasoning, the text after it the answer. Thinking
-- checkpoints (DeepSeek-R1's distills, Qwen3, Ouro-Thinking) write a <think> ... </think>
-- block first, or their template opens it at the end of the prompt (Ouro-Thinking's and
-- Qwen3's enable_thinking, DeepSeek-R1's generation prompt), and the reply then begins
-- inside it.
--
--   local reasoning = require "tinyloop.reasoning"
--   local inside = reasoning.opens(prompt_text)          -- the reply begins in a block
--   local thought, answer = reasoning.split(reply_text, inside)
--   local reader = reasoning.stream(inside)              -- the same, read as it comes
--   local thought_piece, answer_piece = reader:feed(text[, finished])
--   cfg.grammar = reasoning.grammar(g, inside, own)     -- g for the answer after the block
local tags = require "tinyloop.tags"

local find, sub, match, concat = string.find, string.sub, string.match, table.concat

local _M = { FORMAT = "deepseek", START = "<think>", END = "</think>" }
local START, END = _M.START, _M.END

-- uses(template_source) -> whether a chat template speaks of reasoning blocks (Qwen3's drops
-- them from earlier turns, Ouro-Thinking's opens one, DeepSeek-R1's splits replies at
-- </think>): the server tells reasoning apart for such checkpoints (unless told otherwise).
function _M.uses(template_source)
    return type(template_source) == "string" and (find(template_source, START, 1, true) or find(template_source, END, 1, true)) ~= nil
end

-- opens(prompt) -> true when the prompt ends with an opened block (<think>, then blank space
-- at most: the generation prompt opened it). A <think> earlier in the conversation (a user
-- asking about the tag, say) opens nothing.
function _M.opens(prompt)
    return find(prompt, START .. "%s*$") ~= nil -- (no magic characters in the tag)
end

-- grammar(g, opened, own) -> the grammar a thinking model's reply runs under, given g for its
-- answer: the one block runs free and g writes what follows it (vLLM's structured outputs
-- with a reasoning parser). opened: the prompt opened the block (after("</think>", g));
-- otherwise the reply may begin with one (after_block), unless own (a request's own grammar)
-- can itself begin with <think>: it then writes the block, and g is kept. The reply may also
-- end inside its block (reasoning only). -> grammar | nil, err.
function _M.grammar(g, opened, own)
    local grammar = require("tinyloop").grammar
    if opened then return grammar.after(END, g) end
    if own and g:matches_prefix(START) then return g end
    return grammar.after_block(START, END, g)
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
-- beginning until it tells whether a block opens it (its blank space kept in pieces, so that
-- each read costs its own length).
function _M.stream(inside)
    return setmetatable({ state = inside and "reasoning" or "start", held = "", blanks = {}, partial = "" }, Stream)
end

-- The "start" state of `reader`: -> the text after a block's opening tag (the state now
-- "reasoning"), or the content so far (the state now "content"), or nil while it cannot
-- tell yet.
local function begin(self, text, finished)
    local rest = text
    if self.partial == "" then
        local first = find(text, "%S")
        if not first then
            self.blanks[#self.blanks + 1] = text
            if not finished then return nil end
            self.state = "content"
            return concat(self.blanks)
        end
        self.blanks[#self.blanks + 1] = sub(text, 1, first - 1)
        rest = sub(text, first)
    else
        rest = self.partial .. text -- (a part of <think>, shorter than it)
    end
    if sub(rest, 1, #START) == START then
        self.state = "reasoning" -- (the blank space before the block is no content)
        return sub(rest, #START + 1)
    end
    if not finished and #rest < #START and sub(START, 1, #rest) == rest then
        self.partial = rest
        return nil
    end
    self.state = "content"
    return concat(self.blanks) .. rest
end

function Stream:feed(text, finished)
    if self.state == "start" then
        text = begin(self, text, finished)
        if not text then return "", "" end
    end
    if self.state == "content" then return "", text end
    local buf = self.held .. text -- (held: a part of </think>, shorter than it)
    self.held = ""
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

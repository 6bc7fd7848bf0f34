-- tinyloop.tags: markup tags in generated text (a tool call's <tool_call>, a reasoning
-- block's </think>), as a stream reads them: text arrives a token at a time, so a tag may be
-- cut between two reads, and what may still become one is held back until the next read
-- tells.
local sub = string.sub

local _M = {}

-- held(text, tag) -> how many bytes at the end of text may begin `tag` (a proper prefix of it;
-- a whole tag is not a beginning any more).
function _M.held(text, tag)
    for k = #tag - 1, 1, -1 do
        if k <= #text and sub(text, -k) == sub(tag, 1, k) then return k end
    end
    return 0
end

return _M

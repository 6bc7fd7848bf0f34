-- tinyloop.tags: marks in generated text (a tool call's <tool_call>, a reasoning block's
-- </think>, the stop string that ended it), as a reader of the text finds them: text arrives
-- a token at a time, so a tag may be cut between two reads, and what may still become one is
-- held back until the next read tells.
local sub, find, max = string.sub, string.find, math.max

local _M = {}

-- held(text, tag) -> how many bytes at the end of text may begin `tag` (a proper prefix of it;
-- a whole tag is not a beginning any more).
function _M.held(text, tag)
    for k = #tag - 1, 1, -1 do
        if k <= #text and sub(text, -k) == sub(tag, 1, k) then return k end
    end
    return 0
end

-- cut_at_stop(text, stops, last_len) -> the text before the stop string that ended it (OpenAI
-- leaves the stop string out) and that string; or the text as it is where none did. The
-- engine ends at a match only in the token that completes it, so the match ends in the text's
-- last `last_len` bytes (that token's); an earlier one is one min_tokens held back. The
-- earliest such match.
function _M.cut_at_stop(text, stops, last_len)
    local cut, stop
    for i = 1, #stops do
        local at = find(text, stops[i], max(1, #text - last_len - #stops[i] + 2), true)
        if at and (not cut or at < cut) then cut, stop = at, stops[i] end
    end
    if not cut then return text end
    return sub(text, 1, cut - 1), stop
end

return _M

-- tinyloop.utf8: UTF-8's well-formedness, one rule for the library's text: where a sequence
-- is ill-formed (Unicode's definition, as Python's and the WHATWG decoders read it: no
-- overlong forms, no surrogates, nothing past U+10FFFF).
--   local utf8 = require "tinyloop.utf8"
--   utf8.first_invalid(s)  -> the 1-based index of the first ill-formed byte, or nil
--   utf8.repair(s)         -> s with each ill-formed part one U+FFFD
local ffi = require "tinyloop.ffi"
local band = bit.band

local _M = {}

-- The index (from 0) of the first byte of p[0, n) from `at` on that is not ASCII, or n:
-- eight bytes a step (every server answer passes repair on the event loop, most of them
-- ASCII: a Lua pattern's find took 12 ms over 1.2 MB, this 0.2).
local bytes_of, words_of = ffi.typeof("const uint8_t *"), ffi.typeof("const uint64_t *")
local HIGH_BITS = 0x8080808080808080ULL
local function first_non_ascii(p, n, at)
    while at + 8 <= n and band(ffi.cast(words_of, p + at)[0], HIGH_BITS) == 0ULL do at = at + 8 end
    while at < n and p[at] < 0x80 do at = at + 1 end
    return at
end

-- The sequence at p[i] (i < n): its length when well-formed, else 0 and how many of its bytes
-- are well-formed so far (the maximal part Unicode replaces with one U+FFFD: a lead byte and
-- the continuation bytes it may take, cut short; or one stray byte).
local function sequence_at(p, n, i)
    local c = p[i]
    local len = c >= 0xC2 and c <= 0xDF and 2 or c >= 0xE0 and c <= 0xEF and 3 or c >= 0xF0 and c <= 0xF4 and 4 or 0
    -- (the second byte's range excludes overlongs, surrogates, > U+10FFFF)
    local good = 0
    if len > 0 then
        good = 1
        local lo = (c == 0xE0 and 0xA0) or (c == 0xF0 and 0x90) or 0x80
        local hi = (c == 0xED and 0x9F) or (c == 0xF4 and 0x8F) or 0xBF
        if i + 1 < n and p[i + 1] >= lo and p[i + 1] <= hi then
            good = 2
            while good < len and i + good < n and p[i + good] >= 0x80 and p[i + good] <= 0xBF do good = good + 1 end
        end
    end
    if len > 0 and good == len then return len, good end
    return 0, good
end

function _M.first_invalid(s)
    local n, p = #s, ffi.cast(bytes_of, s) -- (s, the argument, keeps the bytes alive)
    local i = first_non_ascii(p, n, 0)
    while i < n do
        local len = sequence_at(p, n, i)
        if len == 0 then return i + 1 end
        i = first_non_ascii(p, n, i + len)
    end
    return nil
end

-- Text as valid UTF-8: each maximal ill-formed part becomes one U+FFFD, Unicode's
-- recommended practice (OpenAI's API renders a cut character so). The engine's stream never
-- splits a character, but the end of a generation (max_tokens, EOS) can fall inside one, and
-- its bytes went into the server's JSON raw: invalid UTF-8 that JSON clients refuse to parse.
function _M.repair(s)
    local n, p = #s, ffi.cast(bytes_of, s)
    local i = first_non_ascii(p, n, 0)
    if i == n then return s end
    local parts, from = {}, 0 -- (indexes from 0)
    while i < n do
        local len, good = sequence_at(p, n, i)
        if len > 0 then
            i = i + len
        else
            parts[#parts + 1] = s:sub(from + 1, i)
            parts[#parts + 1] = "\239\191\189"
            i = i + (good > 0 and good or 1)
            from = i
        end
        i = first_non_ascii(p, n, i)
    end
    parts[#parts + 1] = s:sub(from + 1)
    return table.concat(parts)
end

return _M

-- tinyloop.policy: ready-made decode policies for the hooks of a generation config.
--
--   local policy = require "tinyloop.policy"
--   local ids = model:generate("Dear Jane,", {
--       max_tokens = 200,
--       stop_when = policy.any(policy.stop_strings({ "\n\n" }), policy.max_wall_time(2.0)),
--       logits_processor = policy.chain(policy.no_repeat_ngram(3), policy.ban_tokens({ 13 })),
--   })
--
-- Stop rules are functions (tokens, text, prompt_len) -> true to stop, where `tokens` is the
-- whole sequence so far (prompt + output, 1-based), `text` the generated text so far and
-- prompt_len how many of the tokens are the prompt's.
-- Logits processors are functions (logits, vocab_size, tokens) that edit `logits`, a
-- 0-based float array, in place. The rules that keep state (max_wall_time, min_tokens) keep
-- it per sequence: one rule may serve every prompt of generate_batch and every beam, since
-- each session hands its hooks one `tokens` table for its whole life (its beams share it),
-- and a table the rule has not seen starts a new sequence.
--
-- Errors follow tinyloop's convention: a bad argument to a constructor raises a Lua error
-- at the caller's line, naming the argument; nothing here fails at run time.
--
-- Cost notes (LUA-NOTES): a per-element branch over a 50k vocabulary costs ~600 us per token
-- in LuaJIT; a branch-free loop (logits[i] = logits[i] + bias[i]) ~35 us; sparse id lists
-- ~0. The processors below touch only the ids they need, or use branch-free masks.
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local ffi = require "tinyloop.ffi"

local _M = {}

local NEG_INF = -math.huge
local type, floor = type, math.floor

local raises = require "tinyloop.raise"
local raise = raises.from(debug.getinfo(1, "S").source)
local function arg_error(msg)
    raise("tinyloop.policy." .. msg)
end
-- #t of a list argument, raising where it has holes ({ 1, nil, 44 } was read as { 1 })
local function list_length(fn, t, what) return raises.list_length(t, "tinyloop.policy." .. fn .. ": " .. what, raise) end

local function is_int(v)
    return type(v) == "number" and v == floor(v) and v > -2 ^ 53 and v < 2 ^ 53
end

-- Raises unless ids is a table of integer token ids.
local function check_ids(fn, ids)
    if type(ids) ~= "table" then arg_error(fn .. ": ids must be a table of token ids") end
    for i = 1, list_length(fn, ids, "ids") do
        if not is_int(ids[i]) then arg_error(fn .. ": ids[" .. i .. "] = " .. tostring(ids[i]) .. " is not an integer") end
    end
end

-- A rule's state per sequence, keyed by the sequence's `tokens` table (see the top), weakly:
-- a finished session's entry goes with its table. Every such table is known (weakly), so that
-- a branch of a sequence continues its rules' state (_M.branch).
local every_state = setmetatable({}, { __mode = "k" })
local function per_sequence()
    local states = setmetatable({}, { __mode = "k" })
    every_state[states] = true
    return states
end

-- branch(from, to): every rule's state of sequence `from` (its tokens table) given to `to`,
-- a fork's or a resumed state's table, which continues it: a fork of a session 3 tokens into
-- min_tokens(4) may end after 1 more, not 4. (The states are numbers.) Called by tinyloop.
function _M.branch(from, to)
    for states in pairs(every_state) do
        if states[from] ~= nil then states[to] = states[from] end
    end
end

-- Raises unless every value of the vararg list is a function.
local function check_functions(fn, what, ...)
    for i = 1, select("#", ...) do
        if type(select(i, ...)) ~= "function" then
            arg_error(fn .. ": " .. what .. " " .. i .. " is a " .. type(select(i, ...)) .. ", not a function")
        end
    end
end

-- ------------------------------------------------------------------ stop rules

-- Stops once any of the strings appears in the generated text (a match may span tokens).
-- For plain stop strings prefer the config's `stop_strings`, which the engine matches
-- without calling Lua and whose stream never shows a partial match.
--   cfg.stop_when = policy.stop_strings({ "\n\n", "THE END" })
function _M.stop_strings(strings)
    if type(strings) ~= "table" or #strings == 0 then arg_error("stop_strings: strings must be a non-empty table of strings") end
    local copy = {} -- (the caller's table may change later: the rule keeps what was checked)
    for i = 1, list_length("stop_strings", strings, "strings") do
        if type(strings[i]) ~= "string" or strings[i] == "" then
            arg_error("stop_strings: strings[" .. i .. "] must be a non-empty string")
        end
        copy[i] = strings[i]
    end
    strings = copy
    return function(_, text)
        for i = 1, #strings do
            if text:find(strings[i], 1, true) then return true end
        end
        return false
    end
end

-- What is malformed in a Lua pattern, or nil: the faults string.find raises only when a
-- match reaches them ("a%" passed a check against "" and failed at the first "a" written).
-- Lua 5.1's syntax: % escapes, [sets] (a ] first is one of its characters), %b with two
-- characters, %f before a set, %1-%9 of closed captures, ( and ) balanced.
local function pattern_fault(p)
    p = p:match("^[^%z]*") -- (a NUL ends the pattern, for the matcher as here)
    -- (LuaJIT searches a pattern without ^$*+?.([%- as plain text: a lone ")" is no fault there)
    if not p:find("[%^%$%*%+%?%.%(%[%%%-]") then return nil end
    local i, n, open, closed = 1, #p, 0, {}
    local captures = 0
    while i <= n do
        local c = p:sub(i, i)
        if c == "%" then
            local x = p:sub(i + 1, i + 1)
            if x == "" then return "ends with '%'" end
            if x == "b" then
                if i + 3 > n then return "missing arguments to '%b'" end
                i = i + 4
            elseif x == "f" then
                if p:sub(i + 2, i + 2) ~= "[" then return "missing '[' after '%f'" end
                i = i + 2 -- (its set is read next)
            elseif x:match("%d") then
                local k = tonumber(x)
                if k == 0 or not closed[k] then return "invalid capture index %" .. x end
                i = i + 2
            else
                i = i + 2
            end
        elseif c == "[" then
            local j = i + 1
            if p:sub(j, j) == "^" then j = j + 1 end
            if p:sub(j, j) == "]" then j = j + 1 end -- (a ] first is a character of the set)
            while true do
                local d = p:sub(j, j)
                if d == "" then return "missing ']'" end
                if d == "]" then break end
                j = j + (d == "%" and 2 or 1)
            end
            i = j + 1
        elseif c == "(" then
            captures = captures + 1
            if captures > 32 then return "too many captures" end
            open = open + 1
            closed[captures] = false
            i = i + 1
        elseif c == ")" then
            if open == 0 then return "invalid pattern capture" end
            open = open - 1
            for k = captures, 1, -1 do -- (the innermost capture still open closes)
                if closed[k] == false then closed[k] = true break end
            end
            i = i + 1
        else
            i = i + 1
        end
    end
    if open > 0 then return "unfinished capture" end
    return nil
end

-- Stops when the generated text matches a Lua pattern (anchor with $ to test the end).
--   cfg.stop_when = policy.pattern("[%.!?]%s*$")      -- end of a sentence
function _M.pattern(lua_pattern)
    if type(lua_pattern) ~= "string" then arg_error("pattern: lua_pattern must be a string") end
    local err = pattern_fault(lua_pattern) -- (here, not at the first token that reaches the fault)
    if err then arg_error("pattern: malformed pattern (" .. err .. ")") end
    return function(_, text) return text:find(lua_pattern) ~= nil end
end

-- (declared under a name of its own: a script that declares clock_gettime with its own
-- timespec type would otherwise clash with this declaration, whichever came first)
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } tl_policy_timespec;
int tl_policy_clock_gettime(int clock_id, tl_policy_timespec *tp) __asm__("clock_gettime");
]]
local now_ts = ffi.new("tl_policy_timespec")
local function now_s()
    ffi.C.tl_policy_clock_gettime(1 --[[ CLOCK_MONOTONIC ]], now_ts)
    return tonumber(now_ts.tv_sec) + tonumber(now_ts.tv_nsec) * 1e-9
end

-- Monotonic wall clock in seconds (for timing in scripts).
_M.now = now_s

-- Stops once `seconds` of wall time have passed since the rule was first called for this
-- sequence (its first token).
--   cfg.stop_when = policy.max_wall_time(1.5)
function _M.max_wall_time(seconds)
    if type(seconds) ~= "number" or not (seconds >= 0) then arg_error("max_wall_time: seconds must be a number >= 0") end
    local start = per_sequence()
    return function(tokens)
        local t0 = start[tokens]
        if not t0 then t0 = now_s() start[tokens] = t0 end
        return now_s() - t0 >= seconds
    end
end

-- Stops when the output ends with the same block of `period` tokens repeated `times` times
-- in a row (degenerate loops such as "the the the" or a repeated phrase). With no period,
-- every period from 1 to max_period (default 8) is tried.
--   cfg.stop_when = policy.repetition({ times = 3 })
local REPETITION_OPTIONS = { times = 2, max_period = 1, period = 1 } -- option -> smallest value

function _M.repetition(opts)
    opts = opts or {}
    if type(opts) ~= "table" then arg_error("repetition: opts must be a table") end
    for k, v in ordered_pairs(opts) do
        local least = REPETITION_OPTIONS[k]
        if not least then arg_error("repetition: unknown option '" .. tostring(k) .. "'") end
        if not is_int(v) or v < least then arg_error("repetition: " .. k .. " must be an integer >= " .. least) end
    end
    local times, max_period = opts.times or 3, opts.max_period or 8
    local periods = opts.period and { opts.period } or nil
    return function(tokens, _, prompt_len)
        local n = #tokens
        local out = n - (prompt_len or 0) -- (the output's tokens: the prompt's never count)
        -- (no period longer than the output's share: max_period 1e8 ran 1e8 periods a token)
        local from, to = 1, math.min(max_period, floor(out / times))
        if periods then from, to = periods[1], periods[1] end
        for p = from, to do
            local span = p * times
            if out >= span then
                local repeated = true
                for i = n - span + 1, n - p do
                    if tokens[i] ~= tokens[i + p] then repeated = false break end
                end
                if repeated then return true end
            end
        end
        return false
    end
end

-- Stops when any of the rules does.
function _M.any(...)
    check_functions("any", "rule", ...)
    local rules = { ... }
    return function(tokens, text, prompt_len)
        for i = 1, #rules do
            if rules[i](tokens, text, prompt_len) then return true end
        end
        return false
    end
end

-- ------------------------------------------------------------------ logits processors

-- Bans a list of token ids (sparse: costs nothing per vocabulary entry).
--   cfg.logits_processor = policy.ban_tokens({ eos_id })
function _M.ban_tokens(ids)
    check_ids("ban_tokens", ids)
    local list = {}
    for i, id in ipairs(ids) do list[i] = id end
    return function(logits, vocab)
        for i = 1, #list do
            local id = list[i]
            if id >= 0 and id < vocab then logits[id] = NEG_INF end
        end
    end
end

-- Adds a bias to some logits: bias = { [id] = value, ... } (-math.huge bans the id).
--   cfg.logits_processor = policy.logit_bias({ [198] = 2.0, [13] = -5 })
function _M.logit_bias(bias)
    if type(bias) ~= "table" then arg_error("logit_bias: bias must be a table id -> bias") end
    local ids, values = {}, {}
    for id, v in pairs(bias) do
        if not is_int(id) then arg_error("logit_bias: key " .. tostring(id) .. " is not a token id") end
        if type(v) ~= "number" or v ~= v then arg_error("logit_bias: bias[" .. id .. "] must be a number (not NaN)") end
        ids[#ids + 1], values[#values + 1] = id, v
    end
    return function(logits, vocab)
        for i = 1, #ids do
            local id = ids[i]
            if id >= 0 and id < vocab then logits[id] = logits[id] + values[i] end
        end
    end
end

-- Forbids any token that would complete an n-gram already present in the sequence
-- (prompt included), as Hugging Face's no_repeat_ngram_size.
--   cfg.logits_processor = policy.no_repeat_ngram(3)
function _M.no_repeat_ngram(n)
    if not is_int(n) or n < 1 then arg_error("no_repeat_ngram: n must be an integer >= 1") end
    return function(logits, vocab, tokens)
        local len = #tokens
        if len < n - 1 then return end
        -- The last n-1 tokens form the prefix; ban what followed the same prefix before.
        for start = 1, len - n + 1 do
            local same = true
            for j = 0, n - 2 do
                if tokens[start + j] ~= tokens[len - n + 2 + j] then same = false break end
            end
            if same then
                local banned = tokens[start + n - 1]
                if banned and banned < vocab then logits[banned] = NEG_INF end
            end
        end
    end
end

-- Forbids `eos_id` until `min_new` tokens have been generated, as a logits processor (a -inf
-- ban, eos only: under a grammar that allows nothing but its end it is a dead end). The
-- config field min_tokens is the engine's rule: one-token stop sequences and stop strings
-- too, and a grammar's end never delayed; prefer it.
--   cfg.logits_processor = policy.min_tokens(20, model:info().eos_token_id)
function _M.min_tokens(min_new, eos_id)
    if not is_int(min_new) or min_new < 0 then arg_error("min_tokens: min_new must be an integer >= 0") end
    -- (a negative id was taken, and logits[-1] written below the engine's buffer)
    if not is_int(eos_id) or eos_id < 0 then arg_error("min_tokens: eos_id must be a token id (an integer >= 0)") end
    -- (the engine gives the prompt's length; called without it, as a processor of one's own
    -- may call it, the sequence's first call is taken for its prompt: a fork of a session that
    -- had no rule, given one, counted its earlier tokens as prompt)
    local first_seen = per_sequence()
    return function(logits, vocab, tokens, prompt_len)
        local n = #tokens
        local first = prompt_len or first_seen[tokens]
        if not first then first = n first_seen[tokens] = n end
        if n - first < min_new and eos_id < vocab then logits[eos_id] = NEG_INF end
    end
end

-- Runs processors in order (each given the prompt's length, as the engine gives it).
function _M.chain(...)
    check_functions("chain", "processor", ...)
    local procs = { ... }
    return function(logits, vocab, tokens, prompt_len)
        for i = 1, #procs do procs[i](logits, vocab, tokens, prompt_len) end
    end
end

-- ------------------------------------------------------------------ branch-free masks

-- A reusable additive mask over the vocabulary: 0 for allowed ids, -inf for banned ones,
-- applied with a branch-free loop (logits[i] = logits[i] + bias[i]), which LuaJIT compiles
-- to a tight trace (~35 us for 50k ids, where a branch per id costs ~600 us).
--   local m = policy.mask(vocab):allow_only({ 10, 11, 12 })
--   cfg.logits_processor = function(logits, vocab) m:apply(logits, vocab) end
local Mask = {}
Mask.__index = Mask

function _M.mask(vocab_size)
    if not is_int(vocab_size) or vocab_size < 1 then arg_error("mask: vocab_size must be an integer >= 1") end
    local bias = ffi.new("float[?]", vocab_size) -- zero: everything allowed
    return setmetatable({ bias = bias, vocab_size = vocab_size }, Mask)
end

function Mask:allow_all()
    ffi.fill(self.bias, self.vocab_size * 4, 0)
    return self
end

-- Bans everything except `ids` (an ffi.copy-style fill, then a sparse pass).
function Mask:allow_only(ids)
    check_ids("mask:allow_only", ids)
    local bias, v = self.bias, self.vocab_size
    for i = 0, v - 1 do bias[i] = NEG_INF end
    for i = 1, #ids do -- (checked: no holes)
        local id = ids[i]
        if id >= 0 and id < v then bias[id] = 0 end
    end
    return self
end

function Mask:ban(ids)
    check_ids("mask:ban", ids)
    local bias, v = self.bias, self.vocab_size
    for i = 1, #ids do
        local id = ids[i]
        if id >= 0 and id < v then bias[id] = NEG_INF end
    end
    return self
end

function Mask:apply(logits, vocab)
    local bias = self.bias
    local n = vocab < self.vocab_size and vocab or self.vocab_size
    for i = 0, n - 1 do logits[i] = logits[i] + bias[i] end
end

-- Writes the mask as a grammar-style allowed[] array (1 = allowed) and returns the count.
-- Ids past the mask's vocab_size are allowed, as apply leaves them (they were left unwritten:
-- whatever the buffer held).
function Mask:fill_allowed(allowed, vocab)
    local bias, count = self.bias, 0
    local n = vocab < self.vocab_size and vocab or self.vocab_size
    for i = 0, n - 1 do
        local ok = bias[i] == 0 and 1 or 0
        allowed[i] = ok
        count = count + ok
    end
    for i = n, vocab - 1 do allowed[i] = 1 end
    return count + (vocab - n)
end

return _M

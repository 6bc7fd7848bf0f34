#!/usr/bin/env luajit
-- make_state_seeds.lua: writes the seed corpus of the `state` fuzzer (tests/fuzz/corpus/state):
-- saved states of the small text checkpoint, across the features a state carries (sampling,
-- stop rules, a window, early exit, logit_bias and the OpenAI penalties, a thinking budget, a compiled grammar, a state before its prompt was
-- forwarded), and one at the edge of a rule (as many tokens as max_tokens: refused). A state
-- names its model by a fingerprint, so these must be rewritten whenever the checkpoint, the
-- fingerprint or the layout changes: test_state_file fails until they are (it reads every
-- seed but the last).
--   luajit tests/fuzz/make_state_seeds.lua      (from the repository root, after a build)
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local tinyloop = require "tinyloop"
local model = assert(tinyloop.load("tests/data/textmodel", { threads = 1 }))
local dir = "tests/fuzz/corpus/state/"
local seeds = {
    { name = "greedy", steps = 3, cfg = { max_tokens = 10 } },
    { name = "stop_rules_window", steps = 5,
      cfg = { max_tokens = 12, temperature = 0.8, sample_seed = 3, stop_strings = { "zq", "\n\n" },
              stop_sequences = { { 7, 7 } }, cache_window = 6, repetition_penalty = 1.2 } },
    { name = "before_prompt", steps = 0, cfg = { max_tokens = 6 } },
    { name = "early_exit", steps = 4,
      cfg = { max_tokens = 8, loops = 4, early_exit_patience = 1, early_exit_min_L = 1,
              early_exit_criterion = "latent_diff", early_exit_threshold = 0.5 } },
    { name = "logit_adjustments", steps = 3,
      cfg = { max_tokens = 10, temperature = 0.7, sample_seed = 2, presence_penalty = 0.5, frequency_penalty = 0.3,
              repetition_penalty = 1.3, penalty_window = 4, penalties_count_prompt = true, logit_bias = { [7] = -5, [70] = 2.5 },
              keep_special_text = true, fixed_state_seed = true } },
    { name = "min_p_min_tokens", steps = 3,
      cfg = { max_tokens = 10, temperature = 0.9, sample_seed = 4, min_p = 0.05, min_tokens = 6,
              stop_sequences = { { 7 } } } },
    { name = "thinking_budget", steps = 4,
      cfg = { max_tokens = 12, temperature = 0.8, sample_seed = 6, reasoning_budget = 3, reasoning_open = true } },
    { name = "compiled_grammar", steps = 3,
      cfg = { max_tokens = 8, temperature = 0.8, sample_seed = 5,
              grammar = assert(tinyloop.grammar.gbnf("root ::= [a-z ]+")) } },
}
local function write(name, bytes)
    local f = assert(io.open(dir .. name, "wb"))
    f:write(bytes)
    f:close()
    print(("%-24s %6d bytes"):format(name, #bytes))
end
local first
for _, seed in ipairs(seeds) do
    local session = assert(model:session("It is a truth", seed.cfg))
    for _ = 1, seed.steps do session:step() end
    local bytes = assert(assert(session:save()):bytes())
    write(seed.name, bytes)
    first = first or bytes
end
-- The greedy state with max_tokens (the config's first field, at byte 36) lowered to the 3
-- tokens it emitted: a finished session, refused (its checksum is stale; the fuzzer
-- recomputes it).
write("zz_max_tokens_reached", first:sub(1, 36) .. string.char(3, 0, 0, 0) .. first:sub(41))
-- The greedy state in the layouts of versions 1, 2, 5, 6 and 7 (still read): the version, and
-- without the bytes those did not have: temperature_last (4, at 200; none before version 8),
-- the grammar fingerprint (8, after the tokens, the RNG, prompt_done and compiled_grammar; none
-- before version 7), and after its empty stop rules 52 in version 1 (the presence and frequency
-- penalties, logit_bias, min_p and min_tokens, the thinking budget, penalty_window,
-- penalties_count_prompt, keep_special_text and fixed_state_seed), 40 in version 2 (from min_p
-- on), 8 in version 5 (the last two) (their checksums stale as well: the fuzzer recomputes
-- them). test_state_file reads the same cuts.
local n_tokens = first:byte(209) + 256 * first:byte(210) -- (i32 at 208, little-endian; fewer than 65536)
local v7 = first:sub(1, 200) .. first:sub(205)
local fingerprint_at = 208 + 4 * n_tokens + 32 + 2 -- (in version 7's layout)
local v6 = v7:sub(1, fingerprint_at) .. v7:sub(fingerprint_at + 9)
write("zz_version1_greedy", v6:sub(1, 8) .. string.char(1) .. v6:sub(10, 148) .. v6:sub(201))
write("zz_version2_greedy", v6:sub(1, 8) .. string.char(2) .. v6:sub(10, 160) .. v6:sub(201))
write("zz_version5_greedy", v6:sub(1, 8) .. string.char(5) .. v6:sub(10, 192) .. v6:sub(201))
write("zz_version6_greedy", v6:sub(1, 8) .. string.char(6) .. v6:sub(10))
write("zz_version7_greedy", v7:sub(1, 8) .. string.char(7) .. v7:sub(10))

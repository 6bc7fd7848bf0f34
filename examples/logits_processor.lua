#!/usr/bin/env luajit
-- logits_processor.lua: edit the logits in Lua before sampling: ban every token whose
-- text contains the letter "e" (a lipogram), and forbid repeating any 3-gram.
--   luajit examples/logits_processor.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local model, policy = ex.model, ex.policy
local vocab = model:info().vocab_size
local with_e = {}
for id = 0, vocab - 1 do
    local ok, text = pcall(model.decode, model, { id })
    if ok and text:find("[eE]") then with_e[#with_e + 1] = id end
end
local ids = model:generate("A cat sat on a mat, and", {
    max_tokens = 40,
    logits_processor = policy.chain(policy.ban_tokens(with_e), policy.no_repeat_ngram(3)),
})
local text = model:decode(ids)
print(text)
print(("banned %d of %d tokens; letters e in the output: %d"):format(#with_e, vocab, select(2, text:gsub("[eE]", ""))))

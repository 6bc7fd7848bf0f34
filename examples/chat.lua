#!/usr/bin/env luajit
-- chat.lua: a conversation of three turns, each prompt made by the checkpoint's chat template
-- (tinyloop.chat: its own, or the plain built-in one), each reply streamed and then appended
-- to the messages. With the model's prefix pool on, every turn after the first forwards only
-- what is new: the earlier turns' prompt and reply rows come from the pool.
--   luajit examples/chat.lua [MODEL_DIR]
local ex = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/common.lua")
local model = ex.model
local chats = require "tinyloop.chat"
local chat = assert(chats.load(ex.dir))
model:set_prefix_pool(64 * 1024 * 1024)

-- The reply ends at the model's EOS, at the template's own turn ends, or after 24 tokens.
local cfg = { max_tokens = 24, temperature = 0.7, top_k = 40, sample_seed = 1 }
chats.add_stop_ids(cfg, chat:turn_end_ids(model))

print(("template: %s"):format(chat.source))
local messages = { { role = "system", content = "A conversation at Hartfield." } }
for turn, question in ipairs({ "Who is Mr. Knightley?", "And Harriet Smith?", "Will Emma marry?" }) do
    messages[#messages + 1] = { role = "user", content = question }
    local prompt = assert(chat:prompt_ids(model, messages))
    cfg.max_tokens = math.min(24, model.max_seq_len - #prompt)
    if cfg.max_tokens < 1 then print("[the model's context is full]") break end
    io.write(("user: %s\nassistant:"):format(question))
    local reply = {}
    local iterate, session = model:stream(prompt, cfg)
    for _, text in iterate, session do
        reply[#reply + 1] = text
        io.write(text)
        io.flush()
    end
    local stats = session.final_stats or session:stats()
    print(("\n[turn %d: %d prompt tokens, %d of them from the prefix pool; prefill %.1f ms]"):format(turn, #prompt,
        stats.prompt_tokens_reused, stats.prefill_ms))
    messages[#messages + 1] = { role = "assistant", content = table.concat(reply) }
end

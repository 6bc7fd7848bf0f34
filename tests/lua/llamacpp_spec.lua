-- llamacpp_spec: tinyloop.server.llamacpp without nginx: a llama.cpp /completion request as the
-- /v1/completions request it means, and a completions answer or stream read back in llama.cpp's
-- shape (server_spec runs both through a real nginx and compares them with /v1/completions).
local H = require "helpers"
local cjson = require "cjson"
local llamacpp = require "tinyloop.server.llamacpp"
local json_text = require "tinyloop.json_text"

local function completions_of(body)
    local text, view = llamacpp.to_completions(body)
    assert(text, view and view.message)
    return cjson.decode(text), text, view
end

describe("llamacpp.to_completions", function()
    it("maps llama.cpp's fields, with its defaults where they are left out", function()
        local t = completions_of('{"prompt": "It is", "n_predict": 12, "repeat_penalty": 1.1, "seed": 3, "stop": ["\\n"], ' ..
                                 '"cache_prompt": true, "id_slot": -1, "dry_multiplier": 0, "typical_p": 1}')
        assert.same({ "It is", 12, 1.1, 3, { "\n" } }, { t.prompt, t.max_tokens, t.repetition_penalty, t.seed, t.stop })
        assert.same({ 0.8, 40, 0.95, 0.05 }, { t.temperature, t.top_k, t.top_p, t.min_p }) -- (llama.cpp's defaults)
        -- n_predict -1 (or none): no max_tokens (the view's parser then leaves the rest of the context)
        t = completions_of('{"prompt": [1, 2, 3], "n_predict": -1, "temperature": 0}')
        assert.same({ { 1, 2, 3 }, nil, 0 }, { t.prompt, t.max_tokens, t.temperature })
        -- TinyLoop's own fields ride at the top level, as on the other endpoints (they were
        -- dropped as unknown); llama.cpp's own and chat's are not passed twice
        t = completions_of('{"prompt": "a", "loops": 2, "speculative": "chain", "draft_loops": 1, "early_exit_patience": 1, ' ..
                           '"beam_size": 3, "cache_window": 64, "stop_token_ids": [5], "repetition_penalty": 9, "thinking_budget": 3}')
        assert.same({ 2, "chain", 1, 1, 3, 64, { 5 } }, { t.loops, t.speculative, t.draft_loops, t.early_exit_patience, t.beam_size,
                                                          t.cache_window, t.stop_token_ids })
        assert.is_nil(t.thinking_budget)
        -- the penalties under TinyLoop's names, where llama.cpp's are not sent, with their own
        -- rules (they were dropped: a bad value answered 200); both names of one: a 400
        assert.equal(9, t.repetition_penalty)
        t = completions_of('{"prompt": "a", "penalty_window": 5, "penalties_count_prompt": false}')
        assert.same({ 5, false }, { t.penalty_window, t.penalties_count_prompt })
        for body, param in pairs({ ['{"prompt": "a", "repetition_penalty": 1.3, "repeat_penalty": 1.1}'] = "repetition_penalty",
                                   ['{"prompt": "a", "penalty_window": 5, "repeat_last_n": 8}'] = "penalty_window" }) do
            local chat_body, err = llamacpp.to_completions(body, nil, 4096)
            assert.is_nil(chat_body, body)
            assert.equal(param, err.param, body)
            assert.truthy(err.message:find("not both", 1, true), err.message)
        end
        -- min_tokens as sent (the parser caps it: below)
        assert.equal(5, completions_of('{"prompt": "a", "n_predict": 3, "min_tokens": 5}').min_tokens)
        -- an error about the logprobs n_probs asks for names n_probs
        local _, _, view = completions_of('{"prompt": "a", "n_probs": 2}')
        assert.truthy(view:error({ status = 400, message = "logprobs is not kept by beam search" }).message:find("^n_probs"))
        -- max_tokens, where n_predict is left out (llama.cpp reads either)
        assert.equal(7, completions_of('{"prompt": "a", "max_tokens": 7}').max_tokens)
        -- no seed, -1 or 2^32 - 1: one drawn for each request (llama.cpp's default is random)
        local seeds = {}
        for _, body in ipairs({ '{"prompt": "a"}', '{"prompt": "a", "seed": -1}', '{"prompt": "a", "seed": 4294967295}' }) do
            for _ = 1, 2 do seeds[#seeds + 1] = completions_of(body).seed end
        end
        local distinct = {}
        for _, seed in ipairs(seeds) do distinct[seed] = true end
        local count = 0
        for _ in pairs(distinct) do count = count + 1 end
        assert.is_true(count >= 5, "seeds drawn: " .. table.concat(seeds, ","))
        -- any other integer as /v1/completions reads it, modulo 2^53 (2^53 and past were refused)
        assert.same({ 0, 4, 2 ^ 53 - 2 }, { completions_of('{"prompt": "a", "seed": 9007199254740992}').seed,
                                           completions_of('{"prompt": "a", "seed": 9007199254740996}').seed,
                                           completions_of('{"prompt": "a", "seed": -2}').seed })
        local refused, err = llamacpp.to_completions('{"prompt": "a", "seed": 1.5}')
        assert.same({ nil, "seed must be an integer", "seed" }, { refused, err and err.message, err and err.param })
        -- n_probs: /v1/completions' logprobs (0: none); post_sampling_probs false is llama.cpp's default
        assert.same({ 3, nil }, { completions_of('{"prompt": "a", "n_probs": 3, "post_sampling_probs": false}').logprobs,
                                  completions_of('{"prompt": "a", "n_probs": 0}').logprobs })
        -- past the engine's 20 alternatives, 20 (llama.cpp takes any count); post_sampling_probs
        -- without n_probs changes nothing
        assert.same({ 20, nil }, { completions_of('{"prompt": "a", "n_probs": 100}').logprobs,
                                   completions_of('{"prompt": "a", "post_sampling_probs": true}').logprobs })
        -- json_schema and grammar; logit_bias in both of llama.cpp's forms
        local _, text = completions_of('{"prompt": "a", "json_schema": {"type": "object", "properties": {"b": {"type": "integer"}}}}')
        assert.equal('{"type": "object", "properties": {"b": {"type": "integer"}}}',
                     json_text.member(text, { "json_schema" }))
        t = completions_of('{"prompt": "a", "grammar": "root ::= \\"x\\"", "logit_bias": [[15, -2.5], [16, false], [15, 1]]}')
        assert.same({ "root ::= \"x\"", { ["15"] = -1.5, ["16"] = -100 } }, { t.grammar, t.logit_bias }) -- (15 twice: added)
        t = completions_of('{"prompt": "a", "logit_bias": {"15": 1}}')
        assert.same({ ["15"] = 1 }, t.logit_bias)
        -- repeat_last_n 0 turns the penalties off (llama.cpp's); a window is the engine's
        -- penalty_window: -1 the whole context (0), left out llama.cpp's default of 64
        t = completions_of('{"prompt": "a", "repeat_penalty": 1.1, "presence_penalty": 0.5, "repeat_last_n": 0}')
        assert.same({ nil, nil, nil }, { t.repetition_penalty, t.presence_penalty, t.penalty_window })
        t = completions_of('{"prompt": "a", "repeat_penalty": 1.1, "presence_penalty": 0.5, "repeat_last_n": 32}')
        assert.same({ 1.1, 0.5, 32, true }, { t.repetition_penalty, t.presence_penalty, t.penalty_window, t.penalties_count_prompt })
        assert.equal(0, completions_of('{"prompt": "a", "repeat_last_n": -1}').penalty_window)
        assert.equal(64, completions_of('{"prompt": "a", "repeat_penalty": 1.1}').penalty_window)
        -- repeat_penalty 0, which llama.cpp takes unchecked (and divides logits by): none, 1
        assert.equal(1, completions_of('{"prompt": "a", "repeat_penalty": 0}').repetition_penalty)
        -- a grammar, where given, is the constraint (json_schema then left out, as llama.cpp does)
        t = completions_of('{"prompt": "a", "grammar": "root ::= \\"x\\"", "json_schema": {"type": "object"}}')
        assert.same({ "root ::= \"x\"", nil }, { t.grammar, t.response_format })
    end)

    it("tokenizes what llama.cpp tokenizes itself: texts mixed into a prompt's ids, logit_bias by text", function()
        local model = H.model()
        local function tokenize(text, plain) return model:encode(text, plain and { parse_special = false } or nil) end
        local function of(body)
            local text, err = llamacpp.to_completions(body, tokenize)
            assert(text, err and err.message)
            return cjson.decode(text)
        end
        -- a prompt of ids and texts: each text's ids in its place, an empty text none
        local want = { 5, 6 }
        for _, id in ipairs(model:encode("It is")) do want[#want + 1] = id end
        want[#want + 1] = 7
        for _, id in ipairs(model:encode(" a truth")) do want[#want + 1] = id end
        assert.same(want, of('{"prompt": [5, 6, "It is", 7, "", " a truth"]}').prompt)
        -- a logit_bias text: its bias on each of its tokens (added where one comes twice, as
        -- llama.cpp's sampler adds its entries), in either form
        local ids = model:encode("Emma")
        local bias = {}
        for _, id in ipairs(ids) do bias[tostring(id)] = (bias[tostring(id)] or 0) - 2 end
        assert.same(bias, of('{"prompt": "a", "logit_bias": [["Emma", -2]]}').logit_bias)
        assert.same(bias, of('{"prompt": "a", "logit_bias": {"Emma": -2}}').logit_bias)
        bias[tostring(ids[1])] = bias[tostring(ids[1])] + 1
        assert.same(bias, of(('{"prompt": "a", "logit_bias": [["Emma", -2], [%d, 1]]}'):format(ids[1])).logit_bias)
        -- a mixed prompt's bad id is named where it was sent
        local text, err = llamacpp.to_completions(('{"prompt": ["It is a truth", %d]}'):format(model.vocab_size), tokenize,
                                                  model.vocab_size)
        assert.is_nil(text)
        assert.same({ "prompt", ("prompt[1] = %d is not a token id: ids are in [0, %d)"):format(model.vocab_size, model.vocab_size) },
                    { err.param, err.message })
        -- a batch of prompts (texts alone, or arrays): each its own id list, the view told their sizes
        local mixed = { 5 }
        for _, id in ipairs(model:encode("It is")) do mixed[#mixed + 1] = id end
        local batch_text, batch_view = llamacpp.to_completions('{"prompt": ["It is", [5, "It is"], [7, 8]]}', tokenize, model.vocab_size)
        assert.same({ model:encode("It is"), mixed, { 7, 8 } }, cjson.decode(batch_text).prompt)
        assert.same({ #model:encode("It is"), #mixed, 2 }, batch_view.batch)
        -- a batch of one is one prompt, answered as one (llama.cpp's single result)
        batch_text, batch_view = llamacpp.to_completions('{"prompt": ["It is"]}', tokenize)
        assert.same({ { model:encode("It is") }, nil }, { cjson.decode(batch_text).prompt, batch_view.batch })
        -- a logit_bias text's special tokens are read as text (llama.cpp's common_tokenize there);
        -- a prompt's are parsed
        local plain_bias = {}
        for _, id in ipairs(model:encode("<|endoftext|>", { parse_special = false })) do
            plain_bias[tostring(id)] = (plain_bias[tostring(id)] or 0) - 1
        end
        assert.is_nil(plain_bias[tostring(H.EOS)])
        assert.same(plain_bias, of('{"prompt": "a", "logit_bias": [["<|endoftext|>", -1]]}').logit_bias)
        assert.same({ 5, H.EOS }, of('{"prompt": [5, "<|endoftext|>"]}').prompt)
        -- keys as llama.cpp's strtol reads ids: " 5" and "+6" are ids 5 and 6
        assert.same({ ["5"] = 1, ["6"] = 2 }, of('{"prompt": "a", "logit_bias": {" 5": 1, "+6": 2}}').logit_bias)
        -- without a tokenizer, both are refused, named
        H.refuses(function(body) return llamacpp.to_completions(body) end, {
            { '{"prompt": [1, "a"]}', "prompt", "prompt: texts need the model's tokenizer: give token ids" },
            { '{"prompt": ["a", "b"]}', "prompt", "prompt[0]: texts need the model's tokenizer" },
            { '{"prompt": "a", "logit_bias": [["Hello", -1]]}', "logit_bias", "logit_bias[0]: a text needs the model's tokenizer" },
            { '{"prompt": "a", "logit_bias": {"Hello": -1}}', "logit_bias", 'logit_bias["Hello"]: a text needs the model' },
        })
    end)

    it("takes what SillyTavern sends llama.cpp by default", function()
        -- (its text-completion request for llama.cpp, at its neutral settings)
        local t = completions_of(cjson.encode({
            prompt = "Emma:", n_predict = 80, max_tokens = 80, temperature = 0.7, top_p = 0.9, top_k = 20, typical_p = 1,
            min_p = 0, repeat_penalty = 1.1, repeat_last_n = 64, presence_penalty = 0, frequency_penalty = 0,
            tfs_z = 1, mirostat = 0, mirostat_tau = 5, mirostat_eta = 0.1, grammar = "", n_probs = 0, min_keep = 0,
            ignore_eos = false, dry_multiplier = 0, dry_base = 1.75, dry_allowed_length = 2, dry_sequence_breakers = { "\n" },
            xtc_threshold = 0.1, xtc_probability = 0, top_n_sigma = 0, stream = true, stop = { "\nEmma:", "" },
            samplers = { "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "tfs_z", "typical_p", "top_p", "min_p", "xtc", "temperature" },
            cache_prompt = true, n_keep = 0 }))
        assert.same({ 80, 0.7, 20, 1.1, { "\nEmma:" }, true }, { t.max_tokens, t.temperature, t.top_k, t.repetition_penalty, t.stop,
                    t.stream })
        assert.is_nil(t.grammar) -- ("": none)
        assert.is_number(t.seed)
    end)

    it("refuses what it cannot honour, naming the field", function()
        H.refuses(function(body) return llamacpp.to_completions(body) end, {
            { "{}", "prompt", "prompt is required" },
            { '{"prompt": 5}', "prompt", "prompt must be a text or an array of token ids" },
            { '{"prompt": [[1, 2], 3]}', "prompt", "a batch of prompts holds texts and arrays of token ids, not bare token ids" },
            { '{"prompt": [[1, 2], []]}', "prompt", "prompt[1] must not be empty" },
            { '{"prompt": "x", "json_schema": [1]}', "json_schema", "json_schema must be a JSON Schema object" },
            { '{"prompt": "x", "logit_bias": 5}', "logit_bias", 'logit_bias must be [[id, bias], ...] or {"id": bias}' },
            { '{"prompt": {}}', "prompt", "prompt must be a text or an array of token ids" },
            { '{"prompt": [[1, 2], [3, [4]]]}', "prompt", "prompt[1][1]: a prompt's pieces are token ids and texts" },
            { '{"prompt": [[1, 2], [3, -4]]}', "prompt", "prompt[1][1] = -4 is not a token id" },
            { '{"prompt": [1, {"a": 1}, 3]}', "prompt", "prompt[1]: a prompt is a text, token ids, or token ids and texts mixed" },
            { '{"prompt": []}', "prompt", "prompt must be a text or an array of token ids" },
            { '{"prompt": "a", "n_predict": 1.5}', "n_predict", "n_predict must be an integer" },
            { '{"prompt": "a", "temperature": "hot"}', "temperature", "temperature must be a number" },
            { '{"prompt": "a", "mirostat": 2}', "mirostat", "mirostat is not supported here (only values that turn it off: 0)" },
            { '{"prompt": "a", "n_probs": -1}', "n_probs", "n_probs must be an integer >= 0" },
            { '{"prompt": "a", "n_probs": 1.5}', "n_probs", "n_probs must be an integer >= 0" },
            { '{"prompt": "a", "n_probs": 2, "post_sampling_probs": true}', "post_sampling_probs", "only false is taken here" },
            { '{"prompt": "a", "typical_p": 0.5}', "typical_p", "typical_p is not supported" },
            { '{"prompt": "a", "top_n_sigma": 1.5}', "top_n_sigma", "<= 0" },
            { '{"prompt": "a", "logit_bias": [[1]]}', "logit_bias", "logit_bias[0]: a bias is a finite number, or false" },
            { '{"prompt": "a", "logit_bias": [[true, -1]]}', "logit_bias", "logit_bias[0]: a token id, or a text" },
            { '{"prompt": "a", "logit_bias": [[5, 1e400], [5, -1e400]]}', "logit_bias", "logit_bias[0]: a bias is a finite number, or false" },
            { '{"prompt": "a", "logit_bias": {"5": -1e400}}', "logit_bias", 'logit_bias["5"]: a bias is a finite number, or false' },
            -- strict JSON: NaN, Infinity and hex numbers are no JSON (cjson's default takes them)
            { '{"prompt": "a", "logit_bias": [[5, NaN]]}', nil, "the request body is not valid JSON" },
            { '{"prompt": "a", "n_predict": 0x10}', nil, "the request body is not valid JSON" },
            { '{"prompt": "a", "stop": "x"}', "stop", "stop must be an array of texts" },
            { '{"prompt": "a", "repeat_last_n": -2}', "repeat_last_n", "repeat_last_n must be an integer >= -1" },
            { '{"prompt": "a", "stop": ["x", 5]}', "stop", "stop[1] must be a text" },
            -- (a lazy grammar, free text until a trigger, is not kept: the grammar would hold from
            -- the first token, silently another output)
            { '{"prompt": "a", "grammar": "root ::= \\"x\\"", "grammar_lazy": true, "grammar_triggers": [{"type": "word", "value": "x"}]}',
              "grammar_lazy", "grammar_lazy is not supported here" },
            { '{"prompt": "a", "json_schema": {}, "grammar_lazy": true}', "grammar_lazy", "grammar_lazy is not supported here" },
            { '{"prompt": "a", "response_fields": "content"}', "response_fields", "response_fields must be an array" },
            { '{"prompt": "a", "response_fields": ["content", 5]}', "response_fields", "response_fields[1] must be a text" },
        })
        -- without a grammar (llama.cpp's front ends send its default), or false, it changes nothing
        assert.equal("a", completions_of('{"prompt": "a", "grammar_lazy": true, "grammar_triggers": []}').prompt)
        assert.equal("root ::= \"x\"", completions_of('{"prompt": "a", "grammar": "root ::= \\"x\\"", "grammar_lazy": false}').grammar)
    end)
end)

describe("llamacpp view", function()
    local answer = { created = 1, model = "m", choices = { { index = 0, text = "Hi there", token_ids = { 5, 6 }, finish_reason = "stop",
                     stop_reason = "\n" } }, usage = { prompt_tokens = 3, completion_tokens = 2, total_tokens = 5 },
                     tinyloop = { prefill_ms = 2, decode_ms = 4 } }

    it("answers a completion as llama.cpp does: content, stop_type, counts, timings", function()
        local _, _, view = completions_of('{"prompt": "a", "return_tokens": true}')
        local r = cjson.decode(view:response(cjson.encode(answer)))
        assert.same({ "Hi there", { 5, 6 }, true, "word", "\n", 2, 3, "m" },
                    { r.content, r.tokens, r.stop, r.stop_type, r.stopping_word, r.tokens_predicted, r.tokens_evaluated, r.model })
        assert.same({ 3, 0, 2, 2, 4, 1000 }, { r.timings.prompt_n, r.timings.cache_n, r.timings.predicted_n, r.timings.prompt_ms,
                                              r.timings.predicted_ms, r.timings.prompt_per_second * 2 / 3 })
        -- llama.cpp's generation_settings (its names, the request's values and its defaults) and
        -- the prompt of a text prompt
        assert.same({ -1, 0.8, 40, 0.95, 0.05, 64, {}, "a" }, { r.generation_settings.n_predict, r.generation_settings.temperature,
            r.generation_settings.top_k, r.generation_settings.top_p, r.generation_settings.min_p, r.generation_settings.repeat_last_n,
            r.generation_settings.stop, r.prompt })
        local _, _, set = completions_of('{"prompt": [1, 2], "n_predict": 4, "repeat_penalty": 1.2, "n_probs": 3, "seed": 7, "stop": ["x"]}')
        local g = cjson.decode(set:response(cjson.encode(answer)))
        assert.same({ 4, 1.2, 3, 7, { "x" } }, { g.generation_settings.n_predict, g.generation_settings.repeat_penalty,
                                              g.generation_settings.n_probs, g.generation_settings.seed, g.generation_settings.stop })
        assert.is_nil(g.prompt) -- (ids: no text of the prompt was sent)
        -- repeat_last_n as llama.cpp reports it: -1 the context (the engine's window 0, which it
        -- said: llama.cpp's "off"), 0 with the penalties it turned off as sent (none were said)
        local function settings_of(body, n_ctx)
            local _, v = assert(llamacpp.to_completions(body, nil, nil, n_ctx))
            return cjson.decode(v:response(cjson.encode(answer))).generation_settings
        end
        g = settings_of('{"prompt": "a", "repeat_last_n": -1, "repeat_penalty": 1.5}', 256)
        assert.same({ 256, 1.5 }, { g.repeat_last_n, g.repeat_penalty })
        g = settings_of('{"prompt": "a", "repeat_last_n": 0, "repeat_penalty": 1.5, "frequency_penalty": 0.25}', 256)
        assert.same({ 0, 1.5, 0.25 }, { g.repeat_last_n, g.repeat_penalty, g.frequency_penalty })
        assert.same({ 16 }, { settings_of('{"prompt": "a", "repeat_last_n": 16}').repeat_last_n })
        -- samplers left out of the chain: their values as received, or llama.cpp's defaults
        g = settings_of('{"prompt": "a", "samplers": "t", "top_k": 7, "top_p": 0.5}')
        assert.same({ 7, 0.5, 0.05 }, { g.top_k, g.top_p, g.min_p })
        -- (turned off, a penalty of the wrong kind is still refused)
        local refused, err = llamacpp.to_completions('{"prompt": "a", "repeat_last_n": 0, "repeat_penalty": "x"}')
        assert.same({ nil, "repeat_penalty must be a number", "repeat_penalty" }, { refused, err and err.message, err and err.param })
        -- a prompt the prefix pool served in part: prompt_n counts what the prefill computed
        local cached = cjson.decode(cjson.encode(answer))
        cached.usage.prompt_tokens_details = { cached_tokens = 2 }
        r = cjson.decode(view:response(cjson.encode(cached)))
        assert.same({ 1, 2, 3 }, { r.timings.prompt_n, r.timings.cache_n, r.tokens_evaluated })
        -- and the engine's count where the answer has it (a beam search's prefill leaves the
        -- last prompt token to its first step)
        cached.tinyloop.prefill_tokens = 0
        r = cjson.decode(view:response(cjson.encode(cached)))
        assert.same({ 0, 2, "0" }, { r.timings.prompt_n, r.timings.cache_n, tostring(r.timings.prompt_per_second) })
        -- the limit, and the end of text
        answer.choices[1].finish_reason, answer.choices[1].stop_reason = "length", nil
        assert.equal("limit", cjson.decode(view:response(cjson.encode(answer))).stop_type)
        answer.choices[1].finish_reason = "stop"
        assert.same({ "eos", "" }, { cjson.decode(view:response(cjson.encode(answer))).stop_type,
                                     cjson.decode(view:response(cjson.encode(answer))).stopping_word })
        -- the choice's logprobs entries (ids, as the view asks) as completion_probabilities, in
        -- llama.cpp's field order; none without them
        assert.is_nil(cjson.decode(view:response(cjson.encode(answer))).completion_probabilities)
        local with = cjson.decode(cjson.encode(answer))
        with.choices[1].logprobs = { content = {
            { id = 5, token = "Hi", logprob = -0.5, bytes = { 72, 105 }, top_logprobs = {
                { id = 5, token = "Hi", logprob = -0.5, bytes = { 72, 105 } }, { id = 9, token = "Oh", logprob = -1.5, bytes = { 79, 104 } } } },
            { id = 6, token = " there", logprob = -0.25, bytes = { 32, 116, 104, 101, 114, 101 }, top_logprobs = {} } } }
        local text = view:response(cjson.encode(with))
        assert.same(with.choices[1].logprobs.content, cjson.decode(text).completion_probabilities)
        assert.truthy(text:find('"completion_probabilities":[{"id":5,"token":"Hi","bytes":[72,105],"logprob":-0.5,"top_logprobs":[{"id":5,', 1, true))
        assert.truthy(text:find('"top_logprobs":[]}]', 1, true))
        -- a token of probability 0 (null from the completions path): llama.cpp's lowest float
        with.choices[1].logprobs.content[2].logprob = cjson.null
        assert.equal(-3.4028234663852886e+38, cjson.decode(view:response(cjson.encode(with))).completion_probabilities[2].logprob)
        -- a stop word's own tokens are left out, as llama.cpp leaves them out (the text "Hi",
        -- the word " there" cut from it)
        local stopped = cjson.decode(cjson.encode(with))
        stopped.choices[1].text, stopped.choices[1].stop_reason = "Hi", " there"
        local probs = cjson.decode(view:response(cjson.encode(stopped))).completion_probabilities
        assert.same({ 1, 5 }, { #probs, probs[1].id })
        -- no tokens, no field
        with.choices[1].logprobs.content = {}
        assert.is_nil(cjson.decode(view:response(cjson.encode(with))).completion_probabilities)
        -- tokens only where asked
        _, _, view = completions_of('{"prompt": "a"}')
        assert.same({}, cjson.decode(view:response(cjson.encode(answer))).tokens)
    end)

    it("streams data events whose contents join to the text, the last with stop: true and the counts", function()
        local _, _, view = completions_of('{"prompt": "a", "stream": true}')
        view:start_stream("x", 1, "m", 3)
        local events = {}
        local function feed(t) for _, e in ipairs(view:feed(cjson.encode(t))) do events[#events + 1] = cjson.decode(e[2]) end end
        feed({ choices = { { index = 0, text = "Hi", token_ids = { 5 }, finish_reason = cjson.null } }, usage = cjson.null })
        feed({ choices = { { index = 0, text = " there", token_ids = { 6 }, finish_reason = "length" } }, tinyloop = { decode_ms = 1 },
               usage = { prompt_tokens = 3, completion_tokens = 2, total_tokens = 5 } })
        assert.same({}, view:feed("[DONE]"))
        assert.equal(3, #events)
        assert.same({ "Hi", { 5 }, false, 1, 3 }, { events[1].content, events[1].tokens, events[1].stop, events[1].tokens_predicted,
                                                events[1].tokens_evaluated })
        assert.same({ " there", false, 2 }, { events[2].content, events[2].stop, events[2].tokens_predicted })
        assert.same({ "", true, "limit", 2 }, { events[3].content, events[3].stop, events[3].stop_type, events[3].tokens_predicted })
        -- an error mid-stream: llama.cpp's error object, and nothing after it
        _, _, view = completions_of('{"prompt": "a", "stream": true}')
        view:start_stream("x", 1, "m")
        local e = view:feed('{"error":{"message":"engine failed","type":"server_error","param":null}}')
        assert.same({ code = 500, message = "engine failed", type = "server_error" }, cjson.decode(e[1][2]).error)
        assert.same({}, view:feed('{"choices":[{"index":0,"text":"a","finish_reason":null}]}'))
    end)

    it("streams one token an event, with its probabilities, where a read brought several", function()
        local _, _, view = completions_of('{"prompt": "a", "stream": true, "n_probs": 1}')
        view:start_stream("x", 1, "m", 3)
        local function entry(id, text, bytes)
            return { id = id, token = text, bytes = bytes, logprob = -1, top_logprobs = { { id = id, token = text, bytes = bytes, logprob = -1 } } }
        end
        -- "é" is two tokens of one byte each: one event, as llama.cpp holds a part of a character back
        local events = view:feed(cjson.encode({ choices = { { index = 0, text = "Hi th\195\169", token_ids = { 5, 6, 7, 8 },
            finish_reason = cjson.null, logprobs = { content = { entry(5, "Hi", { 72, 105 }), entry(6, " th", { 32, 116, 104 }),
                                                                entry(7, "\239\191\189", { 195 }), entry(8, "\239\191\189", { 169 }) } } } } }))
        local seen = {}
        for i, e in ipairs(events) do
            local o = cjson.decode(e[2])
            local ids = {}
            for k, p in ipairs(o.completion_probabilities) do ids[k] = p.id end
            seen[i] = { o.content, o.tokens, ids, o.tokens_predicted }
        end
        assert.same({ { "Hi", { 5 }, { 5 }, 1 }, { " th", { 6 }, { 6 }, 2 }, { "\195\169", { 7, 8 }, { 7, 8 }, 4 } }, seen)
        local function seen_of(list)
            local out = {}
            for i, e in ipairs(list) do
                local o = cjson.decode(e[2])
                local ids = {}
                for k, p in ipairs(o.completion_probabilities or {}) do ids[k] = p.id end
                out[i] = { o.content, o.tokens, ids }
            end
            return out
        end
        local function read(text, list)
            local ids, content = {}, {}
            for i, e in ipairs(list) do ids[i], content[i] = e.id, e end
            return view:feed(cjson.encode({ choices = { { index = 0, text = text, token_ids = ids, finish_reason = cjson.null,
                                                          logprobs = { content = content } } } }))
        end
        -- a stop string's start ("\n") held back: its token goes alone, its byte owed by the next
        -- read, whose first event carries it
        assert.same({ { "a", { 9 }, { 9 } }, { "", { 10 }, { 10 } } }, seen_of(read("a", { entry(9, "a", { 97 }), entry(10, "\n", { 10 }) })))
        assert.same({ { "\nb", { 11 }, { 11 } }, { "c", { 12 }, { 12 } } },
                    seen_of(read("\nbc", { entry(11, "b", { 98 }), entry(12, "c", { 99 }) })))
        -- a character's first byte at a read's end: the next read starts with its rest
        assert.same({ { "x", { 13 }, { 13 } }, { "", { 7 }, { 7 } } },
                    seen_of(read("x", { entry(13, "x", { 120 }), entry(7, "\239\191\189", { 195 }) })))
        assert.same({ { "\195\169", { 8 }, { 8 } }, { " y", { 14 }, { 14 } } },
                    seen_of(read("\195\169 y", { entry(8, "\239\191\189", { 169 }), entry(14, " y", { 32, 121 }) })))
        -- a special token, whose text is left out: its own event, with no content
        assert.same({ { "ien", { 15 }, { 15 } }, { "", { 4095 }, { 4095 } }, { "It", { 16 }, { 16 } } },
                    seen_of(read("ienIt", { entry(15, "ien", { 105, 101, 110 }), entry(4095, "<|endoftext|>", { 60, 124, 101, 110, 100, 111, 102, 116, 101, 120, 116, 124, 62 }),
                                            entry(16, "It", { 73, 116 }) })))
        -- a special token at a read's end: nothing of it comes in the next read, which is split all the same
        assert.same({ { "ie", { 20 }, { 20 } }, { "", { 4095 }, { 4095 } } },
                    seen_of(read("ie", { entry(20, "ie", { 105, 101 }), entry(4095, "<|endoftext|>", { 60, 124, 101, 110, 100, 111, 102, 116, 101, 120, 116, 124, 62 }) })))
        assert.same({ { "It", { 21 }, { 21 } }, { " is", { 22 }, { 22 } } },
                    seen_of(read("It is", { entry(21, "It", { 73, 116 }), entry(22, " is", { 32, 105, 115 }) })))
        -- a text the bytes do not spell: one event
        assert.same({ { "zz", { 17, 18 }, { 17, 18 } } }, seen_of(read("zz", { entry(17, "q", { 113 }), entry(18, "r", { 114 }) })))
        assert.equal(22, cjson.decode(read("w", { entry(19, "w", { 119 }) })[1][2]).tokens_predicted)
    end)

    it("answers only the members response_fields names, a nested one by its path", function()
        local _, _, view = completions_of('{"prompt": "a", "n_predict": 4, "response_fields": ["content", ' ..
                                          '"generation_settings/n_predict", "timings/prompt_n", "nope", "content/x"]}')
        local r = cjson.decode(view:response(cjson.encode(answer)))
        assert.same({ content = "Hi there", ["generation_settings/n_predict"] = 4, ["timings/prompt_n"] = 3 }, r)
        -- a path given twice: one member (llama.cpp's answer is a map)
        _, _, view = completions_of('{"prompt": "a", "response_fields": ["content", "content"]}')
        assert.equal('{"content":"Hi there"}', view:response(cjson.encode(answer)))
        -- streamed, the final event alone (llama.cpp's partial results are whole)
        _, _, view = completions_of('{"prompt": "a", "stream": true, "response_fields": ["stop_type"]}')
        view:start_stream("x", 1, "m", 3)
        local events = {}
        for _, chunk in ipairs({ { choices = { { index = 0, text = "Hi", token_ids = { 5 }, finish_reason = cjson.null } } },
                                 { choices = { { index = 0, text = "", token_ids = {}, finish_reason = "length" } }, tinyloop = {},
                                   usage = { prompt_tokens = 3, completion_tokens = 1, total_tokens = 4 } } }) do
            for _, e in ipairs(view:feed(cjson.encode(chunk))) do events[#events + 1] = cjson.decode(e[2]) end
        end
        assert.same({ "Hi", { stop_type = "limit" } }, { events[1].content, events[2] })
    end)

    it("answers a batch of prompts as llama.cpp's results, each with its index, counts and stats", function()
        local _, _, view = completions_of('{"prompt": [[1, 2, 3], [4, 5]]}')
        assert.same({ 3, 2 }, view.batch)
        local batch_answer = { created = 1, model = "m", usage = { prompt_tokens = 5, completion_tokens = 3, total_tokens = 8 }, choices = {
            { index = 0, text = "Hi", token_ids = { 5 }, finish_reason = "length", tinyloop = { prefill_ms = 2, decode_ms = 4 } },
            { index = 1, text = "A\nB", token_ids = { 6, 7 }, finish_reason = "stop", stop_reason = "\n",
              tinyloop = { prefill_ms = 1, decode_ms = 3, prompt_tokens_reused = 1 } } } }
        local r = cjson.decode(view:response(cjson.encode(batch_answer)))
        assert.equal(2, #r)
        assert.same({ 0, "Hi", "limit", 1, 3, false, 3, 0 }, { r[1].index, r[1].content, r[1].stop_type, r[1].tokens_predicted,
                    r[1].tokens_evaluated, r[1].has_new_line, r[1].timings.prompt_n, r[1].timings.cache_n })
        assert.same({ 1, "A\nB", "word", "\n", 2, 2, true, 1, 1, 3 }, { r[2].index, r[2].content, r[2].stop_type, r[2].stopping_word,
                    r[2].tokens_predicted, r[2].tokens_evaluated, r[2].has_new_line, r[2].timings.prompt_n, r[2].timings.cache_n,
                    r[2].timings.predicted_ms })
        assert.same({ 2, 1 }, { r[1].tinyloop.prefill_ms, r[2].tinyloop.prefill_ms })
        -- streamed: the prompts' chunks interleave, each event with its index; each prompt ends
        -- with its own stop: true event when its choice finishes
        _, _, view = completions_of('{"prompt": [[1, 2, 3], [4, 5]], "stream": true}')
        view:start_stream("x", 1, "m", 5)
        local events = {}
        local function feed(t) for _, e in ipairs(view:feed(cjson.encode(t))) do events[#events + 1] = cjson.decode(e[2]) end end
        feed({ choices = { { index = 0, text = "Hi", token_ids = { 5 }, finish_reason = cjson.null } }, usage = cjson.null })
        feed({ choices = { { index = 1, text = "A", token_ids = { 6 }, finish_reason = cjson.null } }, usage = cjson.null })
        feed({ choices = { { index = 1, text = "\nB", token_ids = { 7 }, finish_reason = "stop", stop_reason = "\n" } },
               tinyloop = { decode_ms = 3, prompt_tokens_reused = 1 }, usage = cjson.null })
        feed({ choices = { { index = 0, text = "", token_ids = {}, finish_reason = "length" } }, tinyloop = { decode_ms = 4 },
               usage = { prompt_tokens = 5, completion_tokens = 3, total_tokens = 8 } })
        assert.same({}, view:feed("[DONE]"))
        local seen = {}
        for i, e in ipairs(events) do seen[i] = { e.index, e.content, e.stop, e.tokens_evaluated } end
        assert.same({ { 0, "Hi", false, 3 }, { 1, "A", false, 2 }, { 1, "\nB", false, 2 }, { 1, "", true, 2 }, { 0, "", true, 3 } }, seen)
        assert.same({ "word", 2, true, 1 }, { events[4].stop_type, events[4].tokens_predicted, events[4].has_new_line, events[4].timings.cache_n })
        assert.same({ "limit", 1, false }, { events[5].stop_type, events[5].tokens_predicted, events[5].has_new_line })
    end)

    it("leaves a batch without n_predict the rest of the context its longest prompt leaves", function()
        local request = require "tinyloop.server.request"
        local model = H.model()
        local long = {}
        for i = 1, 50 do long[i] = i end
        for _, order in ipairs({ "[[1, 2, 3], %s]", "[%s, [1, 2, 3]]" }) do
            local body = assert(llamacpp.to_completions(('{"prompt": ' .. order .. '}'):format(cjson.encode(long))))
            local req = assert(request.parse(body, model, "m", 16, llamacpp.View.PARSE_OPTIONS))
            assert.equal(model.max_seq_len - 50, req.cfg.max_tokens)
        end
        for i = 51, model.max_seq_len do long[i] = 1 end
        local body = assert(llamacpp.to_completions(('{"prompt": [[1], %s]}'):format(cjson.encode(long))))
        local req, err = request.parse(body, model, "m", 16, llamacpp.View.PARSE_OPTIONS)
        assert.is_nil(req)
        assert.matches(("the prompt[1] (%d tokens) fills it"):format(model.max_seq_len), err.message, 1, true)
    end)

    it("follows llama.cpp's sampler chain: the temperature last by default, samplers ordering it and leaving samplers out", function()
        -- (llama.cpp's default chain: top_p and min_p cut at temperature 1)
        local t = completions_of('{"prompt": "a"}')
        assert.same({ true, 40, 0.95, 0.05 }, { t.temperature_last, t.top_k, t.top_p, t.min_p })
        t = completions_of('{"prompt": "a", "samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]}')
        assert.same({ true, 40, 0.95, 0.05 }, { t.temperature_last, t.top_k, t.top_p, t.min_p })
        t = completions_of('{"prompt": "a", "samplers": "edkypmxt"}') -- (its web UI's letters)
        assert.same({ true, 40, 0.95, 0.05 }, { t.temperature_last, t.top_k, t.top_p, t.min_p })
        t = completions_of('{"prompt": "a", "samplers": ["top-k", "temp", "nucleus", "min-p"], "repeat_penalty": 1.2}')
        assert.same({ false, 40, 0.95, 0.05 }, { t.temperature_last, t.top_k, t.top_p, t.min_p })
        -- (its parser lowers the names, and takes them without the dash)
        t = completions_of('{"prompt": "a", "samplers": ["TopK", "TOPP", "MinP", "Temperature"]}')
        assert.same({ true, 40, 0.95, 0.05 }, { t.temperature_last, t.top_k, t.top_p, t.min_p })
        -- a sampler left out runs nowhere: its value and llama.cpp's default are not applied,
        -- the penalties' reported as sent
        local text, view
        t, text, view = completions_of('{"prompt": "a", "samplers": "t", "top_p": 0.5, "repeat_penalty": 1.2, "presence_penalty": 1}')
        assert.same({ true, 0, nil, nil, nil, nil }, { t.temperature_last, t.top_k, t.top_p, t.min_p, t.repetition_penalty,
                                                        t.presence_penalty })
        assert.truthy(text)
        assert.truthy(view)
        -- TinyLoop's own field, where samplers does not say it
        assert.is_false(completions_of('{"prompt": "a", "temperature_last": false}').temperature_last)
        local refused_both, both_err = llamacpp.to_completions('{"prompt": "a", "temperature_last": false, "samplers": "kt"}')
        assert.same({ nil, "samplers" }, { refused_both, both_err and both_err.param })
        -- before either cut is before both; without the temperature, it stays, last
        assert.is_false(completions_of('{"prompt": "a", "samplers": ["top_p", "temperature", "min_p"]}').temperature_last)
        t = completions_of('{"prompt": "a", "samplers": ["top_k", "min_p"], "temperature": 0.5}')
        assert.same({ true, 0.5, 40, nil, 0.05 }, { t.temperature_last, t.temperature, t.top_k, t.top_p, t.min_p })
        -- refused, named: not a list of names, nor letters
        for _, case in ipairs({ { '[1, 2]', "an array of sampler names" }, { '{}', "an array of sampler names" },
                                { '""', "an array of sampler names" } }) do
            local refused, err = llamacpp.to_completions('{"prompt": "a", "samplers": ' .. case[1] .. '}')
            assert.is_nil(refused)
            assert.same("samplers", err.param)
            assert.truthy(err.message:find(case[2], 1, true), err.message)
        end
        -- /props says the default chain
        local props = cjson.decode(llamacpp.props({ n_ctx = 256, total_slots = 1, model_path = "m", version = "0" }))
        assert.equal("temperature", props.default_generation_settings.params.samplers[9])
    end)

    it("takes the sampler values llama.cpp takes past OpenAI's ranges, as its samplers read them", function()
        local request = require "tinyloop.server.request"
        local model = H.model()
        local function cfg_of(body)
            local req, err = request.parse(assert(llamacpp.to_completions(body)), model, "m", 16, llamacpp.View.PARSE_OPTIONS)
            assert(req, err and err.message)
            return req.cfg
        end
        -- top_k <= 0 is every token; top_p >= 1 none cut, <= 0 the likeliest token alone (top_k 1);
        -- min_p <= 0 off, >= 1 the likeliest alone; presence and frequency penalties unbounded
        local c = cfg_of('{"prompt": [1], "top_k": -5, "top_p": 1.5, "min_p": -1, "presence_penalty": 3, "frequency_penalty": -4}')
        assert.same({ model.vocab_size, 1, 0, 3, -4 }, { c.top_k, c.top_p, c.min_p, c.presence_penalty, c.frequency_penalty })
        c = cfg_of('{"prompt": [1], "top_p": -0.5, "min_p": 2}')
        assert.same({ 1, 1, 1 }, { c.top_k, c.top_p, c.min_p })
        c = cfg_of('{"prompt": [1], "top_p": 0}')
        assert.same({ 1, 1 }, { c.top_k, c.top_p })
        -- in range: as sent; not numbers: still refused, by name
        c = cfg_of('{"prompt": [1], "top_k": 5, "top_p": 0.5, "min_p": 0.1}')
        assert.same({ 5, 0.5, 0.1 }, { c.top_k, c.top_p, c.min_p })
        local text, err = llamacpp.to_completions('{"prompt": [1], "top_p": "x"}')
        assert.same({ nil, "top_p" }, { text, err and err.param })
    end)

    it("caps min_tokens at n_predict and at the rest of the context (front ends send it for every backend)", function()
        local request = require "tinyloop.server.request"
        local model = H.model()
        local function min_tokens_of(body)
            local req, err = request.parse(assert(llamacpp.to_completions(body)), model, "m", 16, llamacpp.View.PARSE_OPTIONS)
            assert(req, err and err.message)
            return req.cfg.min_tokens, req.cfg.max_tokens
        end
        assert.same({ 3, 3 }, { min_tokens_of('{"prompt": [1], "n_predict": 3, "min_tokens": 5}') })
        assert.same({ 2, 3 }, { min_tokens_of('{"prompt": [1], "n_predict": 3, "min_tokens": 2}') })
        local ids = {}
        for i = 1, model.max_seq_len - 6 do ids[i] = 1 end
        local prompt = cjson.encode(ids)
        -- 6 tokens of context left: whatever n_predict asks, or none
        for _, extra in ipairs({ ', "n_predict": 7', ', "n_predict": -1', "", ', "n_predict": 50' }) do
            assert.same({ 6, 6 }, { min_tokens_of('{"prompt": ' .. prompt .. ', "min_tokens": 10' .. extra .. '}') })
        end
    end)

    it("names llama.cpp's fields in the completions parser's errors", function()
        local _, _, view = completions_of('{"prompt": "a"}')
        local e = view:error({ status = 400, message = "max_tokens = 999 is too many; repetition_penalty must be > 0", param = "max_tokens" })
        assert.equal("n_predict = 999 is too many; repeat_penalty must be > 0", e.message)
        assert.same({ code = 400, message = e.message, type = "invalid_request_error" }, cjson.decode(e.body).error)
    end)
end)

describe("llamacpp.embedding_request", function()
    it("reads content (or input) and embd_normalize, 2 by default", function()
        assert.same({ input = "It is", field = "content", norm = 2 }, llamacpp.embedding_request('{"content": "It is", "n_ctx": 5}'))
        assert.same({ input = { "a", { 1, 2 } }, field = "input", norm = -1 },
                    llamacpp.embedding_request('{"input": ["a", [1, 2]], "content": "b", "embd_normalize": -1}'))
        assert.equal(3, llamacpp.embedding_request('{"content": "a", "embd_normalize": 3}').norm)
        -- ids with texts mixed in (one input, or one of a list): ids, each text tokenized in place
        local function tokenize(text) return { #text, 100 + #text } end
        assert.same({ 5, 2, 102, 6 }, llamacpp.embedding_request('{"content": [5, "ab", 6]}', tokenize).input)
        assert.same({ "a", { 1, 3, 103 }, { 7 } }, llamacpp.embedding_request('{"content": ["a", [1, "abc"], [7]]}', tokenize).input)
        H.refuses(function(body) return llamacpp.embedding_request(body) end, {
            { "{}", "content", "content is required" },
            { '{"content": null}', "content", "content is required" },
            { '{"content": "a", "embd_normalize": -2}', "embd_normalize", "embd_normalize must be an integer >= -1" },
            { '{"content": "a", "embd_normalize": 1.5}', "embd_normalize", "embd_normalize must be an integer >= -1" },
            { "[1]", nil, "the request body must be a JSON object" },
            { '{"content": [5, "ab"]}', "content", "content: texts need the model's tokenizer" },
            { '{"input": ["a", [1, "b"]]}', "input", "input[1]: texts need the model's tokenizer" },
        })
        H.refuses(function(body) return llamacpp.embedding_request(body, function() return { 1 } end, 10) end, {
            { '{"content": [12, "ab"]}', "content", "content[0] = 12 is not a token id: ids are in [0, 10)" },
        })
    end)
end)


describe("llamacpp.to_completions with a tokenizer that fails", function()
    it("names the prompt's piece it could not encode", function()
        local body, err = llamacpp.to_completions('{"prompt": [1, "a"]}', function() return nil, "boom" end, 100, 64)
        assert.is_nil(body)
        assert.same({ 400, "prompt", "prompt[1]: boom" }, { err.status, err.param, err.message })
    end)
end)

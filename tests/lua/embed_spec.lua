-- embed_spec: model:embed (tl_embed through the binding), and the embeddings requests'
-- parsers without nginx (request.parse_embeddings, ollama.embed_request); server_spec sends
-- them through a real nginx and compares the vectors with model:embed's.
local H = require "helpers"
local ffi = require "ffi"
local cjson = require "cjson"
local request = require "tinyloop.server.request"
local ollama = require "tinyloop.server.ollama"
local wait = require "tinyloop.server.wait"

local model = H.model() -- the text model: d_model 32, context 128
local D = 32

local function length(v)
    local s = 0
    for _, x in ipairs(v) do s = s + x * x end
    return math.sqrt(s)
end

local function as_float(x) return ffi.new("float[1]", x)[0] end

describe("model:embed", function()
    local text = "It is a truth universally acknowledged"

    it("gives a unit vector of d_model numbers, the mean of the token rows", function()
        assert.equal(D, model.d_model)
        local v = model:embed(text)
        assert.equal(D, #v)
        assert.is_true(math.abs(length(v) - 1) < 1e-6)
        -- the rows, pooled here: their mean in double, in token order, then unit length
        local rows = model:embed(text, { pooling = "none", normalize = false })
        local ids = model:encode(text)
        assert.equal(#ids, #rows)
        local mean = {}
        for j = 1, D do
            local s = 0
            for t = 1, #rows do s = s + rows[t][j] end
            mean[j] = as_float(s / #rows)
        end
        assert.same(mean, model:embed(text, { normalize = false }))
        local n = length(mean)
        for j = 1, D do assert.is_true(math.abs(v[j] - mean[j] / n) < 1e-6) end
        -- a string is its ids
        assert.same(v, model:embed(ids))
        -- last: the last row
        assert.same(rows[#rows], model:embed(text, { pooling = "last", normalize = false }))
    end)

    it("reads at the depth asked: left out, the model's default", function()
        local deep = model:embed(text, { loops = model.default_loops })
        assert.same(model:embed(text), deep)
        assert.are_not.same(deep, model:embed(text, { loops = 1 }))
    end)

    it("refuses bad options and input, naming them", function()
        H.error_contains(function() model:embed(text, { pooling = "max" }) end, 'pooling must be "mean", "last" or "none"')
        H.error_contains(function() model:embed(text, { normalize = 1 }) end, "normalize must be a boolean")
        H.error_contains(function() model:embed(text, { depth = 2 }) end, "unknown option 'depth'")
        H.error_contains(function() model:embed(text, "mean") end, "opts must be a table")
        H.error_contains(function() model:embed(text, { loops = 1.5 }) end, "embed: loops")
        H.error_contains(function() model:embed(text, { loops = 99 }) end, "loops = 99 is out of range")
        H.error_contains(function() model:embed({ 1, 320 }) end, "token id 320 at index 2 is out of range")
        H.error_contains(function() model:embed(text, { loops = 0 }) end, "loops = 0 must be in [1, max_loops = 4] (leave loops out")
        H.error_contains(function() model:embed({}) end, "the input has 0 tokens: want 1 .. max_seq_len = 128")
        local long = {}
        for i = 1, 129 do long[i] = 1 end
        H.error_contains(function() model:embed(long, { pooling = "none" }) end, "the input has 129 tokens")
        H.error_contains(function() model:embed(42) end, "embed: the input must be a string or a table of token ids")
    end)

    it("embeds a list with embed_batch, each as model:embed does it alone", function()
        -- texts and ids, 1 token to the whole context: 40 inputs fill several shared forwards
        local inputs = { text, { 5 }, "Mr. Darcy", model:encode(text) }
        for i = 5, 40 do
            local ids = {}
            for t = 1, (i * 37) % 128 + 1 do ids[t] = (i * 7 + t * 13) % 256 end
            inputs[i] = ids
        end
        for _, opts in ipairs({ {}, { pooling = "last", normalize = false }, { loops = 1 } }) do
            local vectors = model:embed_batch(inputs, opts)
            assert.equal(#inputs, #vectors)
            for i, input in ipairs(inputs) do assert.same(model:embed(input, opts), vectors[i], "input " .. i) end
        end
        local rows = model:embed_batch({ text, { 7, 8 } }, { pooling = "none" })
        assert.same({ model:embed(text, { pooling = "none" }), model:embed({ 7, 8 }, { pooling = "none" }) }, rows)
        assert.same({}, model:embed_batch({}))
    end)

    it("refuses a bad list, naming the input at fault", function()
        H.error_contains(function() model:embed_batch("text") end, "embed_batch: inputs must be a table of inputs")
        H.error_contains(function() model:embed_batch({ text, 42 }) end,
            "embed_batch: input 2 must be a string or a table of token ids")
        H.error_contains(function() model:embed_batch({ text, {} }) end, "embed_batch: input 2 has 0 tokens")
        H.error_contains(function() model:embed_batch({ text, { 1, 2.5 } }) end, "token id 2.5 at index 2 must be an integer")
        H.error_contains(function() model:embed_batch({ { 1 }, { 1, 320 } }) end, "embed_batch: input 2: token id 320 at index 2 is out of range")
        H.error_contains(function() model:embed_batch({ text }, { pooling = "max" }) end, "embed_batch: pooling must be")
        H.error_contains(function() model:embed_batch({ text }, { loops = 0 }) end, "embed_batch: loops = 0 must be in")
    end)

    it("declares tl_embed_options and tl_token_seq in the thread-pool module as the header does", function()
        -- (wait.lua declares it without the binding's cdef, which a new thread VM would pay for)
        assert.equal(ffi.sizeof("tl_embed_options"), ffi.sizeof(wait.embed_options))
        for _, field in ipairs({ "loops", "pooling", "normalize" }) do
            assert.equal(ffi.offsetof("tl_embed_options", field), ffi.offsetof(wait.embed_options, field), field)
        end
        assert.equal(ffi.sizeof("tl_token_seq"), ffi.sizeof(wait.token_seq))
        for _, field in ipairs({ "tokens", "n" }) do
            assert.equal(ffi.offsetof("tl_token_seq", field), ffi.offsetof(wait.token_seq, field), field)
        end
    end)
end)

describe("request.parse_embeddings", function()
    local function parse(t) return request.parse_embeddings(type(t) == "string" and t or cjson.encode(t), model, "textmodel") end

    it("reads OpenAI's fields and TinyLoop's", function()
        local r = assert(parse({ model = "textmodel", input = "It is", encoding_format = "base64", dimensions = D, user = "u" }))
        assert.same({ model:encode("It is") }, r.inputs)
        assert.equal(#r.inputs[1], r.tokens)
        assert.equal("base64", r.encoding)
        assert.equal(model.default_loops, r.loops)
        assert.equal("mean", r.pooling)
        assert.is_true(r.normalize)
        r = assert(parse({ input = { "It", { 1, 2, 3 } }, loops = 1, pooling = "last", normalize = false }))
        assert.same({ model:encode("It"), { 1, 2, 3 } }, r.inputs)
        assert.equal(#r.inputs[1] + 3, r.tokens)
        assert.same({ "float", 1, "last", false }, { r.encoding, r.loops, r.pooling, r.normalize })
        assert.same({ { 4, 5 } }, assert(parse({ input = { 1, 2, 3, 4, 5 }, truncate_prompt_tokens = 2 })).inputs)
        -- -1: the context; a shorter input is kept whole
        assert.same({ { 1, 2 } }, assert(parse({ input = { 1, 2 }, truncate_prompt_tokens = -1 })).inputs)
        local long = {}
        for i = 1, 200 do long[i] = i % 300 end
        local kept = assert(parse({ input = long, truncate_prompt_tokens = -1 })).inputs[1]
        assert.equal(128, #kept)
        assert.same(H.slice(long, 73, 200), kept)
    end)

    it("refuses bad input, naming the field", function()
        local long = {}
        for i = 1, 129 do long[i] = 1 end
        local many = {}
        for i = 1, 2049 do many[i] = "a" end
        H.refuses(function(body) return request.parse_embeddings(body, model, "textmodel") end, {
            { "{}", "input", "input is required" },
            { '{"input": []}', "input", "input must not be empty" },
            { '{"input": ""}', "input", "input must not be empty" },
            { '{"input": 5}', "input", "input must be a string or an array of token ids" },
            { '{"input": ["a", ""]}', "input", "input[1] must not be empty" },
            { '{"input": ["a", 5]}', "input", "input[1] must be a string or an array of token ids" },
            { '{"input": [1, 320]}', "input", "input[1] = 320 is not a token id" },
            { '{"input": [1, 2.5]}', "input", "input[1] must be an integer token id" },
            { '{"input": [[1], [-1]]}', "input", "input[1][0] = -1 is not a token id" },
            { cjson.encode({ input = long }), "input", "input has 129 tokens, over this model's context of 128" },
            { cjson.encode({ input = { "a", long } }), "input", "input[1] has 129 tokens" },
            { cjson.encode({ input = { long } }), "input", "input[0] has 129 tokens" },
            { cjson.encode({ input = many }), "input", "at most 2048 a request" },
            { '{"input": "a", "encoding_format": "hex"}', "encoding_format", 'must be "float" or "base64"' },
            { '{"input": "a", "dimensions": 16}', "dimensions", "this model's 32" },
            { '{"input": "a", "dimensions": "32"}', "dimensions", "dimensions must be an integer" },
            { '{"input": "a", "pooling": "max"}', "pooling", 'pooling must be "mean" or "last"' },
            { '{"input": "a", "loops": 0}', "loops", "loops must be in [1, 4]" },
            { '{"input": "a", "normalize": "yes"}', "normalize", "normalize must be a boolean" },
            { '{"input": "a", "truncate_prompt_tokens": 0}', "truncate_prompt_tokens", "-1 or in [1, 128]" },
            { '{"input": "a", "prompt": "b"}', "prompt", "unknown field 'prompt'" },
            { '{"input": "a", "model": "gpt-4"}', "model", "not served here" },
        })
        -- the most inputs: OpenAI's 2,048, fewer for long vectors (about 4 million numbers)
        assert.same({ 2048, 2048, 1024, 1 }, { request.max_embedding_inputs(32), request.max_embedding_inputs(2048),
                                               request.max_embedding_inputs(4096), request.max_embedding_inputs(2 ^ 23) })
        local body, err = request.parse_embeddings("[1]", model, "textmodel")
        assert.is_nil(body)
        assert.equal(400, err.status)
    end)
end)

describe("request.parse_rerank and request.parse_score", function()
    local function rerank(t) return request.parse_rerank(type(t) == "string" and t or cjson.encode(t), model, "textmodel") end
    local function score(t) return request.parse_score(type(t) == "string" and t or cjson.encode(t), model, "textmodel") end

    it("reads a query and its documents (texts or Cohere's objects), with the embedding fields", function()
        local r = assert(rerank({ model = "textmodel", query = "Emma", documents = { "It is", { text = "a truth" } }, top_n = 1,
                                  return_documents = false, loops = 1, pooling = "last" }))
        assert.same({ model:encode("Emma"), model:encode("It is"), model:encode("a truth") }, r.inputs)
        assert.same({ "It is", "a truth" }, r.texts)
        assert.equal(#r.inputs[1] + #r.inputs[2] + #r.inputs[3], r.tokens)
        assert.same({ 1, false, 1, "last" }, { r.top_n, r.return_documents, r.loops, r.pooling })
        -- defaults: every document, with its text, at the model's depth, mean-pooled; top_n past
        -- the documents is all of them
        r = assert(rerank({ query = "Emma", documents = { "a", "b" }, top_n = 5 }))
        assert.same({ 2, true, model.default_loops, "mean" }, { r.top_n, r.return_documents, r.loops, r.pooling })
        -- top_n 0 is every document (vLLM's default); what Cohere's SDK sends (nulls, the
        -- chunking fields at their defaults) is taken; max_tokens_per_doc keeps each
        -- document's first k tokens (the query whole)
        assert.equal(2, assert(rerank({ query = "Emma", documents = { "a", "b" }, top_n = 0 })).top_n)
        r = assert(rerank('{"model": "textmodel", "query": "Emma", "documents": ["It is a truth"], "top_n": null, ' ..
                          '"max_tokens_per_doc": null, "rank_fields": ["text"], "return_documents": null, "max_chunks_per_doc": 1}'))
        assert.same({ model:encode("Emma"), model:encode("It is a truth") }, r.inputs)
        -- Cohere's v1 default max_chunks_per_doc (10): documents are not chunked, so any count is whole documents;
        -- TEI's and llama.cpp's name "texts"
        assert.same({ "a", "b" }, assert(rerank({ query = "Emma", texts = { "a", "b" }, max_chunks_per_doc = 10 })).texts)
        r = assert(rerank({ query = "It is a truth", documents = { "It is a truth" }, max_tokens_per_doc = 2 }))
        assert.same({ model:encode("It is a truth"), H.slice(model:encode("It is a truth"), 1, 2) }, r.inputs)
        -- truncate_prompt_tokens keeps each text's last tokens
        r = assert(rerank({ query = "It is a truth", documents = { "universally acknowledged" }, truncate_prompt_tokens = 1 }))
        assert.same({ { H.slice(model:encode("It is a truth"), #model:encode("It is a truth")) }, 1 }, { { r.inputs[1] }, #r.inputs[2] })
    end)

    it("pairs text_1 with text_2 1:1, 1:N and N:N", function()
        local r = assert(score({ text_1 = "a", text_2 = "b" }))
        assert.same({ { 1, 2 } }, r.pairs)
        r = assert(score({ text_1 = "a", text_2 = { "b", "c", "d" } }))
        assert.same({ { 1, 2 }, { 1, 3 }, { 1, 4 } }, r.pairs)
        assert.same({ model:encode("a"), model:encode("b"), model:encode("c"), model:encode("d") }, r.inputs)
        r = assert(score({ text_1 = { "a" }, text_2 = { "b", "c" } })) -- (a list of one is 1:N)
        assert.same({ { 1, 2 }, { 1, 3 } }, r.pairs)
        r = assert(score({ text_1 = { "a", "b" }, text_2 = { "c", "d" }, loops = 2 }))
        assert.same({ { { 1, 3 }, { 2, 4 } }, 2 }, { r.pairs, r.loops })
    end)

    it("refuses bad input, naming the field", function()
        local long = {}
        for i = 1, 129 do long[i] = "Emma" end
        local many = {}
        for i = 1, 2048 do many[i] = "a" end
        H.refuses(function(body) return request.parse_rerank(body, model, "textmodel") end, {
            { '{"documents": ["a"]}', "query", "query is required" },
            { '{"query": "q", "documents": ["a"], "truncation_direction": "Left"}', "truncation_direction",
              "truncation_direction is TEI's: it goes with texts (not documents)" },
            { '{"query": "q", "texts": ["a"], "truncate": true, "truncate_prompt_tokens": 3}', "truncate",
              "truncate is TEI's truncation: not with truncate_prompt_tokens or max_tokens_per_doc" },
            { '{"query": "a"}', "documents", "documents is required" },
            { '{"query": "a", "documents": []}', "documents", "documents must be a non-empty array" },
            { '{"query": "a", "documents": {"x": "b"}}', "documents", "documents must be a non-empty array" },
            { '{"query": "a", "documents": ["b", 5]}', "documents", 'documents[1] must be a text or {"text": ...}' },
            { '{"query": "a", "documents": ["b", {"content": "c"}]}', "documents", "documents[1] must be a text" },
            { '{"query": "a", "documents": ["b", ""]}', "documents", "documents[1] must not be empty" },
            { '{"query": "", "documents": ["b"]}', "query", "query must not be empty" },
            { '{"query": 5, "documents": ["b"]}', "query", "query must be a string" },
            { '{"query": "a", "documents": ["b"], "max_tokens_per_doc": 0}', "max_tokens_per_doc", "max_tokens_per_doc must be >= 1" },
            { '{"query": "a", "documents": ["b"], "max_chunks_per_doc": 0}', "max_chunks_per_doc", "an integer >= 1: documents are not chunked" },
            { '{"query": "a", "documents": ["b"], "max_tokens_per_doc": 2, "truncate_prompt_tokens": 2}', "max_tokens_per_doc", "send one" },
            { '{"query": "a", "documents": ["b"], "texts": ["c"]}', "texts", "two names of one field" },
            { '{"query": "a", "documents": ["b"], "pooling": "max"}', "pooling", 'pooling must be "mean" or "last"' },
            { '{"query": "a", "documents": ["b"], "loops": 9}', "loops", "loops must be in [1, 4]" },
            { '{"query": "a", "documents": ["b"], "rank_fields": ["x"]}', "rank_fields", 'not supported (only ["text"], or null)' },
            { '{"query": "a", "documents": ["b"], "rerank": true}', "rerank", "unknown field 'rerank'" },
            { '{"query": "a", "documents": ["b"], "model": "bge-reranker"}', "model", "not served here" },
            -- (one document alone is named by its index too, as any other rule names it)
            { cjson.encode({ query = "a", documents = { table.concat(long, " ") } }), "documents",
              "documents[0] has " },
            { cjson.encode({ query = "a", documents = many }), "documents", "at most 2047 a request" },
            -- TEI's and llama.cpp's texts: named as the client sent them (they were "documents")
            { '{"query": "a", "texts": []}', "texts", "texts must be a non-empty array" },
            { '{"query": "a", "texts": ["b", 5]}', "texts", 'texts[1] must be a text or {"text": ...}' },
            { '{"query": "a", "texts": ["b", ""]}', "texts", "texts[1] must not be empty" },
            { cjson.encode({ query = "a", texts = { "b", table.concat(long, " ") } }), "texts", "texts[1] has " },
        })
        H.refuses(function(body) return request.parse_score(body, model, "textmodel") end, {
            { '{"text_2": "a"}', "text_1", "text_1 is required" },
            { '{"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}', "text_2", "text_1 has 2 texts and text_2 3: want 1:1, 1:N or N:N" },
            { '{"text_1": "a"}', "text_2", "text_2 is required" },
            { '{"text_1": 5, "text_2": "a"}', "text_1", "text_1 must be a text or a non-empty array of texts" },
            { '{"text_1": "a", "text_2": []}', "text_2", "text_2 must be a text or a non-empty array of texts" },
            { '{"text_1": "a", "text_2": ["b", 3]}', "text_2", "text_2[1] must be a text" },
            { '{"text_1": ["a", "b"], "text_2": ["c"]}', "text_2", "want 1:1, 1:N or N:N" },
            { '{"text_1": ["a", "b"], "text_2": "c"}', "text_2", "want 1:1, 1:N or N:N" },
            { '{"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}', "truncate_prompt_tokens", "-1 or in [1, 128]" },
            { cjson.encode({ text_1 = "a", text_2 = many }), "text_2", "2049 texts in all: at most 2048" },
            { '{"text_1": "a", "text_2": "b", "encoding_format": "float"}', "encoding_format", "unknown field" },
        })
    end)
end)

describe("ollama.embed_request", function()
    it("reads /api/embed's and /api/embeddings' bodies", function()
        local r = assert(ollama.embed_request('{"model": "textmodel", "input": ["a", "b"], "keep_alive": "5m", "options": {}}',
                                              "textmodel"))
        assert.same({ { "a", "b" }, true, true }, { r.inputs, r.truncate, r.normalize })
        r = assert(ollama.embed_request('{"model": "textmodel:latest", "input": "a", "truncate": false, "dimensions": 32}', "textmodel"))
        assert.same({ { "a" }, false, 32 }, { r.inputs, r.truncate, r.dimensions })
        -- the older endpoint: the model's own vector (not unit length), one prompt
        r = assert(ollama.embed_request('{"model": "textmodel", "prompt": "a"}', "textmodel", true))
        assert.same({ { "a" }, false, true }, { r.inputs, r.normalize, r.older })
        -- nothing to embed: Ollama's way to load a model
        assert.same({}, assert(ollama.embed_request('{"model": "textmodel"}', "textmodel")).inputs)
        assert.same({}, assert(ollama.embed_request('{"model": "textmodel", "input": ""}', "textmodel")).inputs)
        assert.same({}, assert(ollama.embed_request('{"model": "textmodel", "prompt": ""}', "textmodel", true)).inputs)
        assert.equal('{"embedding":[]}', ollama.embed_answer(r, "", 0, 0))
    end)

    it("refuses bad bodies, naming the field", function()
        H.refuses(function(body) return ollama.embed_request(body, "textmodel") end, {
            { '{"model": "llama3", "input": "a"}', "model", "model \"llama3\" not found" },
            { '{"input": 5}', "input", "input must be a string or an array of strings" },
            { '{"input": {"a": 1}}', "input", "input must be a string or an array of strings" },
            { '{"input": ["a", 1]}', "input", "input[1] must be a non-empty string" },
            { '{"input": ["a", ""]}', "input", "input[1] must be a non-empty string" },
            { '{"input": "a", "truncate": "no"}', "truncate", "truncate must be" },
        })
        -- a field Ollama does not read is skipped (its Go decoding skips it): /api/embed reads input
        assert.same({ "a" }, assert(ollama.embed_request('{"input": "a", "prompt": "b", "x": 1}', "textmodel")).inputs)
        assert.same({}, assert(ollama.embed_request('{"input": "a"}', "textmodel", true)).inputs)
        H.refuses(function(body) return ollama.embed_request(body, "textmodel", true) end, {
            { '{"prompt": ["a"]}', "prompt", "prompt must be" },
        })
    end)
end)

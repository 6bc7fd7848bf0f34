-- request_spec: tinyloop.server.request without nginx (server_spec sends the same requests
-- through a real nginx): the config a request body becomes.
local H = require "helpers"
local cjson = require "cjson"
local request = require "tinyloop.server.request"

local model = assert(H.tinyloop.load(H.ROOT .. "/models/tinyloop-austen", { threads = 1 }))

describe("request.parse", function()
    local function cfg_of(t)
        local req, err = request.parse(cjson.encode(t), model, "tinyloop-austen", 8, {})
        assert(req, type(err) == "table" and err.message or tostring(err))
        return req.cfg
    end

    it("draws a random seed for a sampled request without one, with the random start state of seed 0", function()
        -- (a Huginn-like model's prompt pages are then shared by every request without a seed)
        local a, b = cfg_of({ prompt = "It is", temperature = 0.8 }), cfg_of({ prompt = "It is", temperature = 0.8 })
        assert.is_number(a.sample_seed)
        assert.are_not.equal(a.sample_seed, b.sample_seed)
        assert.is_true(a.fixed_state_seed and b.fixed_state_seed)
        -- a seed sent, or a greedy request: the seed's own state, as in the engine
        local seeded = cfg_of({ prompt = "It is", temperature = 0.8, seed = 7 })
        assert.same({ 7, nil }, { seeded.sample_seed, seeded.fixed_state_seed })
        local greedy = cfg_of({ prompt = "It is", temperature = 0 })
        assert.same({ nil, nil }, { greedy.sample_seed, greedy.fixed_state_seed })
    end)

    it("takes vLLM's length_penalty with any request, kept for a beam search only (the Lua config refuses it alone)", function()
        assert.is_nil(cfg_of({ prompt = "It is", length_penalty = 1.0 }).length_penalty)
        local beam = cfg_of({ prompt = "It is", length_penalty = 2.0, beam_size = 2 })
        assert.same({ 2.0, 2 }, { beam.length_penalty, beam.beam_size })
        assert.truthy(model:session("It is", cfg_of({ prompt = "It is", length_penalty = 1.0, max_tokens = 2 })))
    end)
end)

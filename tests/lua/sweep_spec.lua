-- sweep_spec.lua: the measurement scripts (scripts/sweep.lua, scripts/early_exit_eval.lua) as
-- automated sweeps run them: a run refused or interrupted leaves an earlier table as it was,
-- every value is checked before the timings, and what goes wrong is said in one line with
-- its exit status (2 bad usage, 130 an interrupt), never a traceback.
local H = require "helpers"

local SWEEP = H.q(H.ROOT .. "/scripts/sweep.lua")
local EVAL = H.q(H.ROOT .. "/scripts/early_exit_eval.lua")
local SMALL = "--n-prompts 1 --max-tokens 2 --repeats 1 --draft-loops 1 --draft-ahead 2 --threads 1"

describe("scripts/sweep.lua", function()
    local dir = H.sh("mktemp -d"):gsub("%s+$", "")
    teardown(function() os.execute("rm -rf " .. H.q(dir)) end)
    local function sweep(args) -- -> its stderr and standard output, then "exit N"
        return H.sh(("luajit %s --model %s %s 2>&1; echo \"exit $?\""):format(SWEEP, H.q(H.TEXTMODEL), args))
    end

    it("keeps an earlier table when a later run is refused or interrupted (it emptied it at the start)", function()
        local out = dir .. "/keep"
        assert.truthy(sweep(SMALL .. " --K 1 --out " .. H.q(out)):find("exit 0", 1, true))
        local before = H.read(out .. "/sweep.csv")
        assert.equal(4, select(2, before:gsub("\n", ""))) -- the header, plain, chain, tree K 1
        -- a value only the engine knows out of range: refused before any timing
        local said = sweep(SMALL .. " --K 1000 --out " .. H.q(out))
        assert.truthy(said:find("^sweep.lua: K_branches = 1000 is out of range %[1, 8%]\nexit 2\n$"), said)
        assert.equal(before, H.read(out .. "/sweep.csv"))
        said = sweep(SMALL .. " --K 1 --max-tokens 1000 --out " .. H.q(out))
        assert.truthy(said:find("^sweep.lua: prompt_len %+ max_tokens = %d+ %+ 1000 exceeds max_seq_len = 128\nexit 2\n$"), said)
        assert.equal(before, H.read(out .. "/sweep.csv"))
        -- Ctrl-C in the middle of the timings: the run ends at once with an interrupt's status (it
        -- said 2, bad usage, once the pass under way had ended), and the table is kept
        local log = dir .. "/interrupted.log"
        said = H.sh(("luajit %s --model %s --n-prompts 1 --max-tokens 32 --repeats 10000 --draft-loops 1 --draft-ahead 2 " ..
                     "--K 1 --threads 1 --out %s 2> %s & pid=$!; " ..
                     "for i in $(seq 600); do grep -q '^.1/' %s 2>/dev/null && break; sleep 0.05; done; " ..
                     "kill -INT $pid; wait $pid; echo \"exit $?\""):format(SWEEP, H.q(H.TEXTMODEL), H.q(out), H.q(log), H.q(log)))
        assert.equal("exit 130\n", said)
        assert.equal(before, H.read(out .. "/sweep.csv"))
        assert.is_nil(io.open(out .. "/sweep.csv.partial"), "the partial table is removed")
    end)

    it("refuses bad values in one line before any timing", function()
        local out = H.q(dir .. "/refused")
        local cases = {
            { "--n-prompts -1", "--n-prompts must be a whole number >= 0, got -1" },
            { "--n-prompts 1.5", "--n-prompts must be a whole number >= 0, got 1.5" },
            { "--verify-loops 0", "--verify-loops must be a whole number >= 1, got 0" },
            { "--K ''", "--K: '' is not a list of whole numbers >= 1" },
            { "--draft-ahead ,", "--draft-ahead: ',' is not a list of whole numbers >= 1" },
        }
        for _, case in ipairs(cases) do
            local said = sweep(case[1] .. " --out " .. out)
            assert.equal("sweep.lua: " .. case[2] .. "\nexit 2\n", said)
        end
        -- a model without a tokenizer (its prompts are text): said, not a traceback
        local bare = dir .. "/bare"
        os.execute(("mkdir -p %s && ln -s %s/config.json %s/model.safetensors %s/"):format(H.q(bare), H.q(H.TEXTMODEL),
                                                                                      H.q(H.TEXTMODEL), H.q(bare)))
        local said = H.sh(("luajit %s --model %s --out %s 2>&1; echo \"exit $?\""):format(SWEEP, H.q(bare), out))
        assert.equal("sweep.lua: " .. bare .. " has no tokenizer: the prompts cannot be encoded\nexit 2\n", said)
        -- an output directory named like an option is a directory
        local dashed = dir .. "/-x"
        assert.truthy(H.sh(("cd %s && luajit %s --model %s %s --K 1 --out -x 2>&1; echo \"exit $?\""):format(H.q(dir), SWEEP,
            H.q(H.TEXTMODEL), SMALL)):find("exit 0", 1, true))
        assert.truthy(io.open(dashed .. "/sweep.csv"), "the table in ./-x")
    end)

    it("draws its chart into a path with a quote in it, and says gnuplot's own error where it fails", function()
        if not H.sh("command -v gnuplot || true"):find("gnuplot", 1, true) then
            pending("gnuplot is not installed")
            return
        end
        local out = dir .. "/it's here"
        local said = sweep(SMALL .. " --K 1 --out " .. H.q(out))
        assert.truthy(said:find("chart: " .. out .. "/sweep.png", 1, true) and said:find("exit 0", 1, true), said)
        assert.truthy(io.open(out .. "/sweep.png"))
    end)
end)

describe("scripts/early_exit_eval.lua", function()
    it("refuses a text too short for distinct prompts (it ran one prompt --prompts times)", function()
        local text = H.sh("mktemp"):gsub("%s+$", "")
        local f = assert(io.open(text, "wb"))
        f:write("It is a truth, it is.") -- (14 tokens: more than 8, fewer than 28)
        f:close()
        local said = H.sh(("luajit %s --model %s --text %s --prompts 20 --prompt-tokens 8 --tokens 4 --threads 1 2>&1; " ..
                           "echo \"exit $?\""):format(EVAL, H.q(H.TEXTMODEL), H.q(text)))
        os.remove(text)
        assert.truthy(said:find("^early_exit_eval.lua: " .. text:gsub("%p", "%%%0") .. " has %d+ tokens: 20 prompts of 8 need at least 28"), said)
        assert.truthy(said:find("\nexit 2\n$"), said)
    end)
end)

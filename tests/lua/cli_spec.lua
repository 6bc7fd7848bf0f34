-- cli_spec: scripts/run (the README's main command, in bash) and the CLI (lua/tinyloop/cli.lua)
-- agree on which options take no value: scripts/run decides from its own list whether the
-- user gave a prompt, and took the prompt after an option it did not know for that option's
-- value (--penalties-count-prompt "Hello there" ran the demo prompt, then failed).
local H = require "helpers"
local cli = require "tinyloop.cli"

describe("scripts/run's options without a value", function()
    local MODEL = H.ROOT .. "/models/tinyloop-austen"
    local run = assert(io.open(H.ROOT .. "/scripts/run")):read("*a")
    local listed = {}
    for option in assert(run:match("\n%s*(%-%-ignore%-eos[^)]*)%)"), "scripts/run's list"):gmatch("[^|%s]+") do
        listed[option] = true
    end
    -- the CLI's view: an option followed by a word takes no value when the word is the prompt
    local function takes_no_value(option)
        local o = cli.parse({ option, "Hello there" }, MODEL)
        return o ~= nil and o.prompt == "Hello there"
    end

    it("lists only options the CLI takes without a value", function()
        for option in pairs(listed) do assert.is_true(takes_no_value(option), option) end
    end)

    it("lists every flag of the CLI's config (a new one left out took the prompt for its value)", function()
        local source = assert(io.open(H.ROOT .. "/lua/tinyloop/cli.lua")):read("*a")
        local flags = 0
        for option in source:gmatch('%["(%-%-[%w%-]+)"%] = { "[%w_]+", "flag" }') do
            flags = flags + 1
            assert.is_true(listed[option], option .. " is not in scripts/run's list")
        end
        assert.is_true(flags >= 3, "flags found: " .. flags)
    end)

    it("adds no demo setting that the CLI would refuse: none with --embed, no sampling with --speculative tree", function()
        -- (scripts/run builds what is missing first: here, nothing)
        for _, args in ipairs({ "--embed hello", "--speculative tree -n 4 'It is'" }) do
            local out = H.sh("cd " .. H.q(H.ROOT) .. " && scripts/run " .. args .. " 2>&1; echo \"rc=$?\"")
            assert.truthy(out:find("rc=0\n?$"), args .. ": " .. out)
        end
        -- a lone - is the prompt (stdin), not an option: no demo prompt added after it
        local out = H.sh("cd " .. H.q(H.ROOT) .. " && echo Hello | scripts/run --embed - 2>&1; echo \"rc=$?\"")
        assert.truthy(out:find("^%[[^\n]*%]\nrc=0\n?$"), out)
    end)

    it("reads the files its flags name from the caller's directory, run through a link too", function()
        -- (it ran the CLI in the repository: --grammar g.gbnf was not found, or another file of
        -- that name there was read; through a link, scripts/setup was not found)
        local dir = os.tmpname()
        os.remove(dir)
        H.sh("mkdir -p " .. H.q(dir) .. " && printf 'root ::= \"yes\"\\n' > " .. H.q(dir .. "/g.gbnf") ..
             " && ln -s " .. H.q(H.ROOT .. "/scripts/run") .. " " .. H.q(dir .. "/run"))
        local out = H.sh("cd " .. H.q(dir) .. " && ./run --grammar g.gbnf -n 3 --no-stats Hi 2>&1; echo \"rc=$?\"")
        H.sh("rm -rf " .. H.q(dir))
        assert.equal("Hiyes\nrc=0\n", out)
    end)

    it("lists every option of the CLI's --help that takes no value (but --help, --interactive and --prompt: scripts/run's own cases)", function()
        local help = H.sh("cd " .. H.q(H.ROOT) .. " && luajit scripts/tinyloop --help 2>&1")
        local seen = 0
        for option in help:gmatch("%-%-[%w][%w%-]*") do
            if option ~= "--help" and option ~= "--interactive" and option ~= "--prompt" and takes_no_value(option) then
                seen = seen + 1
                assert.is_true(listed[option] == true, option .. " takes no value but scripts/run does not list it")
            end
        end
        assert.is_true(seen >= 4, "options without a value found in --help: " .. seen)
    end)
end)

describe("scripts/tinyloop", function()
    -- (exit status and stderr of a shell command)
    local function run(cmd)
        local out = H.sh("cd " .. H.q(H.ROOT) .. " && { " .. cmd .. "; } 2>&1; echo \"rc=$?\"")
        return tonumber(out:match("rc=(%d+)%s*$")), out
    end

    it("stops at --stop's text, which it prints (as its --help says), and nothing after it", function()
        -- (the greedy text, then the same cut at a word of its reply: the word printed, then the end)
        local whole = H.sh("cd " .. H.q(H.ROOT) .. " && luajit scripts/tinyloop -n 20 -t 0 'It is a truth' 2>/dev/null")
        local word = assert(whole:match("^%S+%s+%S+%s+%S+%s+%S+%s+(%a%a%a+)"), whole)
        local cut = H.sh("cd " .. H.q(H.ROOT) .. " && luajit scripts/tinyloop -n 20 -t 0 --stop " .. word .. " 'It is a truth' 2>/dev/null")
        local at = assert(whole:find(word, 1, true))
        assert.equal(whole:sub(1, at + #word - 1) .. "\n", cut)
        assert.truthy(H.sh("cd " .. H.q(H.ROOT) .. " && luajit scripts/tinyloop --help"):find("TEXT printed", 1, true))
    end)

    it("exits 1 saying so when its output cannot be written (it went on and exited 0)", function()
        for _, args in ipairs({ "-n 20 --ignore-eos 'It is'", "--embed 'It is'", "--help" }) do
            local status, out = run("luajit scripts/tinyloop " .. args .. " > /dev/full")
            assert.equal(1, status, args .. ": " .. out)
            assert.truthy(out:find("tinyloop: writing the output failed: No space left on device", 1, true), out)
            assert.is_nil(out:find("traceback", 1, true), out)
        end
    end)

    it("has the tools and table scripts exit 1 saying so when their output cannot be written (they exited 0)", function()
        local quantized = os.tmpname()
        os.remove(quantized)
        local cases = {
            { "build/scripts/bench/tinyloop-bench --list-presets", "tinyloop-bench: writing the output failed" },
            { "build/scripts/bench/tinyloop-bench --preset tiny --print-config", "tinyloop-bench: writing the output failed" },
            { "build/scripts/tools/tinyloop-quantize --help", "tinyloop-quantize: writing the output failed" },
            { "build/scripts/tools/tinyloop-quantize --type q8 models/tinyloop-austen " .. H.q(quantized),
              "tinyloop-quantize: writing the output failed" },
            { "build/scripts/tools/tinyloop-quant-eval models/tinyloop-austen " .. H.q(quantized) .. " --max-tokens 32 --window 32",
              "tinyloop-quant-eval: writing the output failed" },
            { "luajit scripts/sweep.lua --help", "sweep.lua: writing the output failed" },
            { "luajit scripts/early_exit_eval.lua --help", "early_exit_eval.lua: writing the output failed" },
        }
        for _, case in ipairs(cases) do
            local status, out = run(case[1] .. " > /dev/full")
            assert.equal(1, status, case[1] .. ": " .. out)
            assert.truthy(out:find(case[2], 1, true), out)
        end
        -- (a pipe's length is no file's: "Bad address")
        local status, out = run("echo hello | build/scripts/tools/tinyloop-quant-eval models/tinyloop-austen " .. H.q(quantized) ..
                                " --text /dev/stdin --window 32")
        assert.equal(1, status, out)
        assert.truthy(out:find("--text /dev/stdin is not a regular file", 1, true), out)
        os.execute("rm -rf " .. H.q(quantized))
    end)

    it("exits 1 where its output fails once the writes ran hot (--embed of 300 lines: the compiled writes did not say so)", function()
        local input = os.tmpname()
        local f = assert(io.open(input, "wb"))
        f:write(string.rep("hello\n", 300))
        f:close()
        -- (the file-size limit fails a write part-way, as a disk that fills does; in 512-byte
        -- blocks: about 100 lines of 3.4 kB are written first)
        local status, out = run("(ulimit -f 700 && trap '' XFSZ && exec luajit scripts/tinyloop --embed - < " .. H.q(input) ..
                                " > " .. H.q(input .. ".out") .. ")")
        local lines = select(2, H.sh("cat " .. H.q(input .. ".out")):gsub("\n", "\n"))
        os.remove(input)
        os.remove(input .. ".out")
        assert.is_true(lines > 60 and lines < 300, "lines written: " .. lines)
        assert.equal(1, status, out)
        assert.truthy(out:find("tinyloop: writing the output failed: File too large", 1, true), out)
    end)

    it("says which of generation_config.json's eos ids it leaves out with --chat (a checkpoint paired with another model's files)", function()
        local model = os.tmpname()
        os.remove(model)
        assert.equal(0, (run("mkdir " .. model .. " && for f in models/tinyloop-austen/*; do ln -s $PWD/$f " .. model .. "/; done && " ..
                              "echo '{\"eos_token_id\": [128009, 4095]}' > " .. model .. "/generation_config.json")))
        local status, out = run("luajit scripts/tinyloop -m " .. model .. " --chat -n 2 --no-stats 'Hi'")
        os.execute("rm -rf " .. model)
        assert.equal(0, status, out)
        assert.truthy(out:find("tinyloop: generation_config.json's eos_token_id 128009 is no token id of this model (0 to 4095): left out",
                               1, true), out)
    end)

    it("fails saying so where -n cut a forced tool call before it was whole (it printed nothing, exit 0)", function()
        local tools = os.tmpname()
        local f = assert(io.open(tools, "wb"))
        f:write('[{"type":"function","function":{"name":"weather","parameters":{"type":"object",' ..
                '"properties":{"city":{"type":"string"}},"required":["city"]}}}]')
        f:close()
        local status, out = run("luajit scripts/tinyloop --chat --tools " .. tools .. " --tool-choice required -n 8 --no-stats 'Weather in Paris?'")
        os.remove(tools)
        assert.equal(1, status, out)
        assert.truthy(out:find("tinyloop: the tool call was cut off after 8 tokens, before it was whole: raise -n", 1, true), out)
    end)

    it("fails saying so where a forced tool call never came: the reply ended in its thinking block (exit 0, no call)", function()
        local tools, template = os.tmpname(), os.tmpname()
        local f = assert(io.open(tools, "wb"))
        f:write('[{"type":"function","function":{"name":"weather","parameters":{"type":"object",' ..
                '"properties":{"city":{"type":"string"}},"required":["city"]}}}]')
        f:close()
        f = assert(io.open(template, "wb")) -- (a template that opens the block: the model may end in it)
        f:write("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" ..
                "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
        f:close()
        local status, out = run("luajit scripts/tinyloop --chat --chat-template " .. template .. " --tools " .. tools ..
                                " --tool-choice required -n 120 -t 1 -s 2 --no-stats 'Weather in Paris?'")
        os.remove(tools)
        os.remove(template)
        assert.equal(1, status, out)
        assert.truthy(out:find("\ntinyloop: the reply ended (EOS) before its tool call", 1, true), out)
    end)

    it("refuses generation options with --embed, naming them (they were ignored)", function()
        local status, out = run("luajit scripts/tinyloop --embed -n 5 -t 0.5 --stop x --grammar /nonexistent hi")
        assert.equal(2, status, out)
        assert.truthy(out:find("--embed generates nothing: --grammar, --max-tokens, --stop, --temperature would be ignored", 1, true), out)
        assert.equal(0, (run("luajit scripts/tinyloop --embed -L 4 hi > /dev/null")))
    end)

    it("refuses early-exit knobs while early exit is off, naming them (they did nothing)", function()
        local status, out = run("luajit scripts/tinyloop -m tests/data/textmodel -n 2 --early-exit-threshold 0.1 --early-exit-peek 2 hi")
        assert.equal(2, status, out)
        assert.truthy(out:find("--early-exit-peek, --early-exit-threshold tune early exit, which is off: give --early-exit PATIENCE", 1, true), out)
        assert.equal(2, (run("luajit scripts/tinyloop -m tests/data/textmodel -n 2 --early-exit 0 --early-exit-kl 0.1 hi")))
        assert.equal(0, (run("luajit scripts/tinyloop -m tests/data/textmodel -n 2 --early-exit 2 --early-exit-threshold 0.1 hi > /dev/null")))
    end)

    it("finds its modules from its real path: run from scripts/, or through a link", function()
        local link = os.tmpname()
        os.remove(link)
        assert.equal(0, (run("ln -s " .. H.ROOT .. "/scripts/tinyloop " .. link)))
        for _, cmd in ipairs({ "cd scripts && luajit ./tinyloop -n 2 It", link .. " -n 2 It", "cd examples && luajit stream.lua" }) do
            local status, out = run(cmd)
            assert.equal(0, status, cmd .. ": " .. out)
        end
        os.remove(link)
    end)

    it("ends at once on Ctrl-C while -i waits for a line (the read resumed: ^C waited for Enter)", function()
        -- (stdin a FIFO held open by the shell, so that the read waits; SIGINT as Ctrl-C sends it)
        local fifo = os.tmpname()
        os.remove(fifo)
        local status, out = run("mkfifo " .. fifo .. " && exec 3<>" .. fifo .. " && " ..
                                "{ luajit scripts/tinyloop -i -n 2 <&3 & pid=$!; sleep 2; kill -INT $pid; " ..
                                "for k in 1 2 3 4 5 6 7 8 9 10; do kill -0 $pid 2>/dev/null || break; sleep 0.2; done; " ..
                                "kill -0 $pid 2>/dev/null && { echo still waiting; kill -KILL $pid; }; wait $pid; }")
        os.remove(fifo)
        assert.is_nil(out:find("still waiting", 1, true), out)
        assert.equal(130, status, out)
    end)

    it("ends at once on Ctrl-C while a file it was given waits for a writer (a FIFO: it waited on)", function()
        -- (--grammar <(cmd) where cmd stalls: the open blocks until a writer comes; SIGINT once
        -- the open is seen waiting, in /proc's wchan, or after 5 s where that is not shown)
        local dir = os.tmpname()
        os.remove(dir)
        assert.equal(0, (run("mkdir " .. dir .. " && mkfifo " .. dir .. "/f")))
        for _, args in ipairs({ "--grammar F", "--json-schema F", "--tools F --chat", "--policy F", "--chat --chat-template F" }) do
            local cmd = "luajit scripts/tinyloop -m models/tinyloop-austen -n 2 " .. args:gsub("F", dir .. "/f") .. " hi"
            local status, out = run("{ " .. cmd .. " & pid=$!; " ..
                                    "for k in $(seq 50); do [ \"$(cat /proc/$pid/wchan 2>/dev/null)\" = wait_for_partner ] && break; sleep 0.1; done; " ..
                                    "kill -INT $pid; " ..
                                    "for k in $(seq 20); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done; " ..
                                    "kill -0 $pid 2>/dev/null && { echo still waiting; kill -KILL $pid; }; wait $pid; }")
            assert.is_nil(out:find("still waiting", 1, true), args .. ": " .. out)
            assert.equal(130, status, args .. ": " .. out)
        end
        run("rm -r " .. dir)
    end)

    it("fails saying so where stdin cannot be read (-i ended as at its end, exit 0; --embed - raised a traceback)", function()
        for _, args in ipairs({ "-i -n 2", "--embed -" }) do
            local status, out = run("luajit scripts/tinyloop " .. args .. " < /tmp")
            assert.equal(1, status, args .. ": " .. out)
            assert.truthy(out:find("tinyloop: reading standard input: Is a directory", 1, true), out)
            assert.is_nil(out:find("traceback", 1, true), out)
        end
    end)

    it("reads a stdin line with a NUL in it whole (it was cut at the NUL and the next line joined on)", function()
        local status, out = run("printf 'A\\000B\\nC\\nD' | luajit scripts/tinyloop --embed -")
        assert.equal(0, status, out)
        local lines = {}
        for line in out:gmatch("[^\n]+") do lines[#lines + 1] = line end
        assert.equal(4, #lines, out) -- three vectors and rc=0
        local _, c = run("luajit scripts/tinyloop --embed C")
        assert.equal(c:match("^[^\n]+"), lines[2])
    end)

    it("says why a --tools file is refused (a BOM, a tab in a string: \"not JSON\")", function()
        local path = os.tmpname()
        for text, why in pairs({ ["\239\187\191[]"] = "starts with a UTF-8 byte order mark",
                                 ['[{"type": "function", "function": {"name": "f", "description": "a\tb"}}]'] =
                                     "an unescaped control character (byte 9) in a string",
                                 ['[{"type": "function", "function": {"name": "f", "description": "\255"}}]'] =
                                     "not valid UTF-8 (byte 64)" }) do
            local f = assert(io.open(path, "wb"))
            f:write(text)
            f:close()
            local status, out = run("luajit scripts/tinyloop --chat --tools " .. path .. " x")
            assert.equal(2, status, out)
            assert.truthy(out:find(path .. ": not OpenAI's tools array (a JSON array): " .. why, 1, true), out)
        end
        os.remove(path)
    end)

    it("takes llama-cli habits clearly: a prompt given twice, -i's settings, -s -1, --grammar's file", function()
        -- a prompt as an argument, then -p: refused, as the other order is (it was dropped)
        local status, out = run("luajit scripts/tinyloop -n 2 Hello -p World")
        assert.equal(2, status, out)
        assert.truthy(out:find("unexpected argument Hello", 1, true), out)
        -- -i checks its settings before it reads a message (the first reply refused them, the
        -- message typed lost; with no input, it exited 0 saying nothing)
        for _, input in ipairs({ "'Hello\\n'", "''" }) do
            status, out = run("printf " .. input .. " | luajit scripts/tinyloop -i -t -1")
            assert.equal(2, status, out)
            assert.truthy(out:find("tinyloop: --temperature = -1 must be a finite number >= 0", 1, true), out)
        end
        -- no hint at a uint64_t the command line cannot give
        status, out = run("luajit scripts/tinyloop -t 1 -s -1 -n 2 Hi")
        assert.equal(2, status, out)
        assert.truthy(out:find("--seed = -1 must be an integer in [0, 2^53]\n", 1, true), out)
        assert.is_nil(out:find("ULL", 1, true), out)
        -- llama.cpp's --grammar takes the text: the message says a file is wanted
        status, out = run("luajit scripts/tinyloop -n 2 --grammar 'root ::= \"yes\"' Hi")
        assert.equal(1, status, out)
        assert.truthy(out:find("tinyloop: --grammar takes a file: root ::=", 1, true), out)
        -- scripts/run: -p's value is the prompt, a leading - too (it read it as a flag and took
        -- the next one, --speculative, as its value: the demo's sampling was refused)
        status, out = run("scripts/run -p '-5 degrees' --speculative tree -n 2 --no-stats")
        assert.equal(0, status, out)
        assert.truthy(out:find("^%-5 degrees"), out)
    end)

    it("says an option's value is missing, --logit-bias's too (it said \"bad value: nil\")", function()
        for _, option in ipairs({ "--logit-bias", "-n", "--stop", "--threads" }) do
            local status, out = run("luajit scripts/tinyloop " .. option)
            assert.equal(2, status, out)
            assert.truthy(out:find("tinyloop: option " .. option .. " needs a value", 1, true), out)
        end
    end)

    it("names the options typed in the engine's refusals, not its config fields (reasoning_budget, sample_seed)", function()
        for args, want in pairs({ ["--thinking-budget -1"] = "tinyloop: --thinking-budget = -1 must be >= 0",
                                  ["-s -5"] = "tinyloop: --seed = -5 must be an integer",
                                  ["-L 99"] = "tinyloop: --loops = 99 is out of range",
                                  -- (an option's own name, which holds a field's, is kept whole: --draft---loops)
                                  ["--speculative chain --draft-loops 9"] = "tinyloop: --draft-loops = 9 must be in [1, --loops = 8)",
                                  -- (a list's item: the first --stop, not stop_strings[1])
                                  ["--stop ''"] = "tinyloop: --stop #1 is empty",
                                  -- (a field's name in prose, the C function's name before it)
                                  ["--beam 2 --cache-window 2"] = "tinyloop: beam search (--beam = 2) does not support --cache-window yet",
                                  ["--logit-bias 99999=5"] = "tinyloop: --logit-bias: token id 99999 is out of range" }) do
            local status, out = run("luajit scripts/tinyloop -n 2 " .. args .. " x")
            assert.equal(2, status, out)
            assert.truthy(out:find(want, 1, true), out)
        end
    end)

    it("names the policy file whose function returned no config table (it said \"config must be a table\")", function()
        local policy = os.tmpname()
        local f = assert(io.open(policy, "wb"))
        f:write("return function(cfg) return 5 end")
        f:close()
        local status, out = run("luajit scripts/tinyloop -n 2 --policy " .. policy .. " x")
        os.remove(policy)
        assert.equal(1, status, out)
        assert.truthy(out:find("tinyloop: policy " .. policy .. ": its function returned a number, not a config table", 1, true), out)
    end)

    it("says in a line that the library cannot be loaded (it printed a traceback)", function()
        local dir = os.tmpname()
        os.remove(dir)
        -- (a copy without a build tree beside it, and no libtinyloop installed; then one whose
        -- TINYLOOP_LIB names none: that is the error, not a fall back to another build)
        local status, out = run("mkdir -p " .. dir .. "/scripts && cp -r lua " .. dir .. "/ && cp scripts/tinyloop " .. dir ..
                                "/scripts/ && env -u TINYLOOP_LIB luajit " .. dir .. "/scripts/tinyloop -n 2 x")
        assert.equal(1, status, out)
        assert.truthy(out:find("^tinyloop: cannot load libtinyloop %(build it, or set TINYLOOP_LIB%)"), out)
        assert.is_nil(out:find("traceback", 1, true), out)
        status, out = run("TINYLOOP_LIB=/nonexistent.so luajit " .. dir .. "/scripts/tinyloop -n 2 x")
        H.sh("rm -rf " .. dir)
        assert.equal(1, status, out)
        assert.truthy(out:find("^tinyloop: cannot load TINYLOOP_LIB=/nonexistent.so: "), out)
        assert.is_nil(out:find("traceback", 1, true), out)
    end)

    it("refuses, as bad usage in a line, what it read wrong or raised on (an empty -m, a seed past 2^53, --embed's -L)", function()
        for args, want in pairs({
            -- (tinyloop.load raises on an empty path: a traceback, exit 1)
            ['-m "" -n 1 x'] = "tinyloop: tinyloop.load: model directory must not be empty",
            -- (read as a double first: 2^53 + 1 was taken as 2^53)
            ["-s 9007199254740993 -n 1 x"] = "bad value for -s: 9007199254740993 (past 2^53",
            ["-s 9007199254740994 -n 1 x"] = "bad value for -s: 9007199254740994 (past 2^53",
            ["--logit-bias 99999999999999999999=5 -n 1 x"] = "bad value for --logit-bias: 99999999999999999999=5",
            -- (the depth is the option's: it named the input line, and the field)
            ["--embed -L -3 x"] = "--loops = -3 is out of range [1, max_loops = 16]",
            -- (decimal numbers only: tonumber took 0x10 as 16, and nan, echoed as "-nan")
            ["-n 0x10 x"] = "tinyloop: bad value for -n: 0x10 (see --help)",
            ["--temperature nan x"] = "tinyloop: bad value for --temperature: nan (see --help)",
            ["-n x x"] = "tinyloop: bad value for -n: x (see --help)",
            ["-n 1.5 x"] = "tinyloop: bad value for -n: 1.5 (see --help)",
            [""] = "tinyloop: no prompt given (see --help)",
            ["--embed --chat x"] = "tinyloop: --embed reads PROMPT as text: not with --chat or -i (see --help)",
        }) do
            local status, out = run("luajit scripts/tinyloop " .. args)
            assert.equal(2, status, args .. ": " .. out)
            assert.truthy(out:find(want, 1, true), out)
            assert.falsy(out:find("traceback", 1, true), out)
        end
        local status, out = run("printf 'a\\n' | luajit scripts/tinyloop --embed -L 0 -")
        assert.equal(2, status, out)
        assert.truthy(out:find("^tinyloop: embed: %-%-loops = 0 must be in %[1, max_loops = 16%]"), out) -- (no line named)
        assert.equal(0, (run("luajit scripts/tinyloop -s 9007199254740992 -n 1 --no-stats x > /dev/null")))
    end)

    it("fails saying so where a --policy file cannot be loaded, returns no policy or raises", function()
        local dir = os.tmpname()
        os.remove(dir)
        H.sh("mkdir -p " .. dir .. " && echo 'return 5' > " .. dir .. "/five.lua && echo 'error(\"boom\")' > " .. dir ..
             "/boom.lua && echo 'x =' > " .. dir .. "/broken.lua")
        for file, want in pairs({ ["/nonexistent.lua"] = "tinyloop: cannot load policy /nonexistent.lua: cannot open /nonexistent.lua",
                                  [dir .. "/broken.lua"] = "tinyloop: cannot load policy " .. dir .. "/broken.lua: ",
                                  [dir .. "/five.lua"] = "tinyloop: policy " .. dir .. "/five.lua must return a table or a function",
                                  [dir .. "/boom.lua"] = "tinyloop: policy " .. dir .. "/boom.lua failed: " .. dir .. "/boom.lua:1: boom" }) do
            local status, out = run("luajit scripts/tinyloop --policy " .. file .. " -n 1 x")
            assert.equal(1, status, out)
            assert.truthy(out:find(want, 1, true), out)
            assert.falsy(out:find("traceback", 1, true), out)
        end
        H.sh("rm -rf " .. dir)
    end)

    it("keeps a policy hook's own words and its file's path as they are (the field names in them became options)", function()
        local dir = os.tmpname()
        os.remove(dir)
        H.sh("mkdir -p " .. H.q(dir .. "/top_k"))
        local f = assert(io.open(dir .. "/top_k/pol.lua", "wb"))
        f:write('return { stop_when = function() error("the stop rule needs max_tokens below 10") end }\n')
        f:close()
        local status, out = run("luajit scripts/tinyloop --policy " .. H.q(dir .. "/top_k/pol.lua") .. " -n 3 x")
        H.sh("rm -rf " .. H.q(dir))
        assert.equal(1, status, out)
        assert.truthy(out:find("the stop rule needs max_tokens below 10", 1, true), out)
        assert.truthy(out:find(dir .. "/top_k/pol.lua:1:", 1, true), out)
    end)

    it("reads --threads and --logit-bias's bias as every number flag, and refuses a second -p (it took 0x2; the second -p won)", function()
        for _, args in ipairs({ "--threads 0x2", "--threads ' 2'", "--logit-bias 5=0x10" }) do
            local status, out = run("luajit scripts/tinyloop -n 1 " .. args .. " x")
            assert.equal(2, status, out)
            assert.truthy(out:find("bad value for " .. args:match("^%S+"), 1, true), out)
        end
        local status, out = run("luajit scripts/tinyloop -n 2 -p a -p b")
        assert.equal(2, status, out)
        assert.truthy(out:find("tinyloop: -p given twice", 1, true), out)
    end)

    it("says an empty prompt is empty, and which chat template made one (\"prompt_len = 0 must be >= 1\")", function()
        local status, out = run("luajit scripts/tinyloop -n 2 ''")
        assert.equal(2, status, out)
        assert.truthy(out:find("tinyloop: the prompt is empty: it has no tokens\n", 1, true), out)
        local template = os.tmpname()
        status, out = run("luajit scripts/tinyloop -n 2 --chat --chat-template " .. template .. " Hello")
        os.remove(template)
        assert.equal(1, status, out)
        assert.truthy(out:find("tinyloop: the chat template (" .. template .. ") made an empty prompt", 1, true), out)
    end)

    it("writes byte pieces that make no character as U+FFFD, as the server does (a cut character went out raw)", function()
        -- token 195 is the byte 0xC3 alone: a character's first byte, three times over
        local status, out = run("luajit scripts/tinyloop -n 3 --logit-bias 195=100 --no-prompt --no-stats 'It is'")
        assert.equal(0, status, out)
        assert.equal(("\239\191\189"):rep(3) .. "\nrc=0\n", out)
        assert.is_nil(require("tinyloop.utf8").first_invalid(out))
    end)

    it("cuts -n to the room the context leaves with --fit-context, and scripts/run its demo's 200 (a long prompt was refused)", function()
        local prompt = ("It is a truth universally acknowledged, that a single man "):rep(6) -- (79 tokens)
        local status, out = run("luajit scripts/tinyloop -n 200 --no-prompt " .. H.q(prompt))
        assert.equal(2, status, out)
        status, out = run("luajit scripts/tinyloop -n 200 --fit-context --ignore-eos --no-prompt " .. H.q(prompt))
        assert.equal(0, status, out)
        assert.truthy(out:find("| 177 tokens", 1, true), out) -- (256 - 79)
        -- at least --min-tokens, where the context has room
        status, out = run("luajit scripts/tinyloop --fit-context --min-tokens 100 --no-prompt x")
        assert.equal(0, status, out)
        assert.truthy(out:find("| 100 tokens", 1, true), out)
        status, out = run("luajit scripts/tinyloop --fit-context --min-tokens 200 --no-prompt " .. H.q(prompt))
        assert.equal(2, status, out)
        assert.truthy(out:find("--min-tokens = 200: the context (max_seq_len = 256) leaves room for 177 tokens after the prompt's 79", 1, true), out)
        status, out = run("scripts/run " .. H.q(prompt))
        assert.equal(0, status, out)
        -- a model without a tokenizer: the engine's refusal, not a traceback from the fitting
        local dir = os.tmpname()
        os.remove(dir)
        H.sh("mkdir -p " .. H.q(dir) .. " && cp models/tinyloop-austen/config.json models/tinyloop-austen/model.safetensors " ..
             H.q(dir))
        status, out = run("luajit scripts/tinyloop --fit-context -m " .. H.q(dir) .. " x")
        H.sh("rm -rf " .. H.q(dir))
        assert.equal(2, status, out)
        assert.truthy(out:find("has no tokenizer.json", 1, true), out)
        assert.is_nil(out:find("traceback", 1, true), out)
        status, out = run("luajit scripts/tinyloop --fit-context -i < /dev/null")
        assert.equal(2, status, out)
        assert.truthy(out:find("--fit-context goes with one generation", 1, true), out)
    end)

    it("refuses --threads past the engine's limit as bad usage (exit 2, it was 1)", function()
        local status, out = run("luajit scripts/tinyloop --threads 1025 -n 1 x")
        assert.equal(2, status, out)
        assert.truthy(out:find("bad value for --threads: 1025", 1, true), out)
    end)

    it("ends the reply's line once where --tools reads no answer after a thinking block (a blank line followed)", function()
        local tools, template = os.tmpname(), os.tmpname()
        local f = assert(io.open(tools, "wb"))
        f:write('[{"type":"function","function":{"name":"weather"}}]')
        f:close()
        f = assert(io.open(template, "wb")) -- (a template that opens the block, which -n cuts)
        f:write("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" ..
                "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
        f:close()
        local out = H.sh("cd " .. H.q(H.ROOT) .. " && luajit scripts/tinyloop --chat --chat-template " .. template .. " --tools " ..
                         tools .. " -n 6 --no-stats Hi")
        os.remove(tools)
        os.remove(template)
        assert.truthy(out:find("\n$"), out)
        assert.is_nil(out:find("\n\n$"), out)
    end)
end)

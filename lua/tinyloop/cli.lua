-- tinyloop.cli: the command-line generator on the Lua bindings. Streams text from a
-- checkpoint as it is produced, then prints one line of stats on stderr; or, with
-- --interactive, holds a conversation read from stdin.
--   scripts/tinyloop [options] [--] PROMPT
--   scripts/tinyloop --interactive [options] [--] [FIRST MESSAGE]
-- Exit status: USAGE's last lines say it (a value the engine refuses is bad usage, 2).
local tinyloop = require "tinyloop"
local tools = require "tinyloop.tools"
local json_text = require "tinyloop.json_text"
local cjson = require "cjson.safe"
local tags = require "tinyloop.tags"
local raised_message = require("tinyloop.raise").message
local decimal = require("tinyloop.script_options").decimal
local read_tools -- (below)

local _M = {}

-- Ctrl-C: LuaJIT raises "interrupted!" in whatever Lua runs (a hook's caller wraps it in its
-- own message); `attempt`, the pcall below, passes it on, and main ends quietly with 130.
local function interrupted(err) return type(err) == "string" and err:find("interrupted!", 1, true) ~= nil end
local function attempt(fn, ...)
    local results = { pcall(fn, ...) }
    if not results[1] and interrupted(results[2]) then error(results[2], 0) end
    return unpack(results, 1, table.maxn(results))
end

-- fn(...) with Ctrl-C's default action, which ends the program at once (130, as a shell's
-- commands end), around the calls that may block in a read: LuaJIT's handler only marks the
-- interrupt, and the read resumed, so that ^C waited for Enter at a prompt, or for a writer
-- at a FIFO given as a file (`--grammar <(cmd)`). For the call's time only: during a
-- generation ^C ends it through LuaJIT's "interrupted!", with its stats line.
local SIGINT = 2
local signal_of_c -- (declared once, at the first use)
local function at_default_sigint(fn, ...)
    if not signal_of_c then
        local ffi = require "tinyloop.ffi"
        pcall(ffi.cdef, "typedef void (*tl_cli_sighandler)(int); tl_cli_sighandler signal(int signum, tl_cli_sighandler handler);")
        signal_of_c = ffi.C.signal
    end
    local previous = signal_of_c(SIGINT, nil) -- (NULL: SIG_DFL)
    local results = { pcall(fn, ...) }
    signal_of_c(SIGINT, previous)
    if not results[1] then error(results[2], 0) end
    return unpack(results, 2, table.maxn(results))
end

-- A user-named file's bytes | nil, err, opened (false: io.open's err; true: the read's, a
-- directory's, which io.open accepts).
local function read_file(path)
    return at_default_sigint(function()
        local f, ferr = io.open(path, "rb")
        if not f then return nil, ferr, false end
        local text, rerr = f:read("*a")
        f:close()
        return text, rerr, true
    end)
end

-- Writes to stdout, flushed: a failure (a full disk, a reader gone with SIGPIPE ignored)
-- raises, so that generation stops and the run exits 1 (it went on and exited 0).
local OUTPUT_FAILED = "writing the output failed: "
local function show(...)
    local ok, err = io.stdout:write(...)
    if ok then ok, err = io.stdout:flush() end
    if not ok then error(OUTPUT_FAILED .. tostring(err), 0) end
end
-- Interpreted always: LuaJIT's compiled io.write and flush return the file whether or not
-- the write failed, so once a loop of them ran hot (an --embed of 300 lines) a full disk or
-- a reader gone went unseen and the run exited 0 with the output cut short.
jit.off(show)

-- Text the model wrote, shown as valid UTF-8: a byte piece that makes no character (the end of
-- a generation cut inside one, or a token's stray byte) is one U+FFFD, as the server writes it
-- (its raw bytes reached the terminal, or the file a pipe wrote, as invalid UTF-8).
local repair = require("tinyloop.utf8").repair
local function show_text(text) show(repair(text)) end

local USAGE = [[
usage: tinyloop [options] [--] PROMPT
       tinyloop --interactive [options] [--] [FIRST MESSAGE]
Generate text from a looped transformer checkpoint, streaming it as it is produced.

  -m, --model DIR            checkpoint directory (default %s)
  -p, --prompt TEXT          the prompt (or give it as the last argument)
  -n, --max-tokens N         new tokens at most (default 64)
      --fit-context          -n at most the room the context leaves after the prompt (and
                             at least --min-tokens): a long prompt is not refused for it
  -L, --loops N              loop depth (default: the model's default_loops)
  -t, --temperature T        0 = greedy (default 0)
  -k, --top-k K              keep the K most likely tokens (default 50)
      --top-p P              nucleus mass in (0, 1] (default 1)
      --min-p P              keep tokens at least P times as likely as the first, P in [0, 1]
                             (default 0: off)
      --temperature-last     top-p and min-p cut at temperature 1, the temperature after (llama.cpp's order)
      --thinking-budget N    a thinking model's <think> block holds N tokens at most: then
                             </think> is written for it and the answer follows (the block is
                             open from the start where the prompt ends with <think>)
  -s, --seed N               sampling seed (default 0)
      --repetition-penalty R HF-style penalty on seen tokens (default 1)
      --presence-penalty P   OpenAI's: subtract P from each generated token's logit (default 0)
      --frequency-penalty F  OpenAI's: subtract F per time a token was generated (default 0)
      --penalty-window N     the three penalties read the last N tokens only (default 0: all)
      --penalties-count-prompt  presence and frequency count the prompt's tokens too (llama.cpp's)
      --logit-bias ID=BIAS   add BIAS to token ID's logit (repeatable; -100 bans, 100 forces)
      --stop TEXT            stop when TEXT appears, TEXT printed (repeatable)
      --grammar FILE         constrain the output to a GBNF grammar (llama.cpp dialect)
      --json-schema FILE     constrain the output to JSON matching a JSON Schema
      --regex PATTERN        constrain the whole output to match a regular expression
      --cache-window W       attend to the last W positions only (default 0: all)
      --ignore-eos           keep going past the end-of-text token
      --min-tokens N         no end of text nor stop before N new tokens (default 0)
      --beam N               beam search with N beams (deterministic; streams the tokens
                             every surviving hypothesis agrees on)
      --length-penalty P     beam ranking: sum_logprob / len^P (default 1)
      --speculative MODE     self-speculative decoding, "chain" or "tree", verified at --loops
      --draft-loops N        speculative draft depth (default 2)
      --draft-ahead N        tokens (chain) or tree levels drafted per verification (default 4)
      --K-branches K         tree: candidates per drafted node (default 2)
      --max-nodes N          tree: node budget (default 64)
      --early-exit PATIENCE  adaptive depth: exit after PATIENCE stable probes
      --early-exit-min-L N   first loop probed (default 2)
      --early-exit-peek N    probe every N loops (default 1)
      --early-exit-threshold T  relative loop-state change counted as stable (default 0.03)
      --early-exit-margin M  use the top-1 minus top-2 logit margin >= M instead
      --early-exit-criterion C  hidden_state (default), latent_diff, kl, entropy_diff,
                             argmax or gate (Ouro's exit gate)
      --early-exit-kl T      kl: KL between successive probes below T (default 1e-3)
      --early-exit-entropy T entropy_diff: entropy change below T (default 1e-3)
      --early-exit-gate Q    gate: cumulative exit probability Q (default: config.json's)
      --policy FILE          a Lua file returning config fields and hooks (a table), or a
                             function(cfg, model) that edits the config
      --threads N            CPU threads (default: one per core this process may use)
      --backend B            auto (default: CUDA when a device is present), cpu or cuda
      --kv-type T            f32 (default) or f16: half the KV cache memory (CPU only)
      --chat                 PROMPT is a user message: the model's chat template (or the
                             plain built-in one) makes the prompt; prints the reply only
  -i, --interactive          a conversation (--chat): each line of stdin is a user message,
                             each reply streamed; -n bounds a reply, older turns are left out
                             when the next would not fit the context, and with plain decoding
                             a turn computes only its new text (a prefix pool); /reset
                             forgets the conversation, /exit (/quit, end of input) ends it.
                             The reply is kept as written: a thinking model's <think> block
                             stays in it (the server tells reasoning apart)
      --system TEXT          with --chat or -i: a system message first
      --chat-template FILE   with --chat or -i: this Jinja chat template instead of the model's
      --tools FILE           with --chat: function tools, a JSON file of OpenAI's tools array;
                             the reply's calls are printed one JSON line each
                             ({"name": ..., "arguments": {...}}) after its content
      --tool-choice C        with --tools: auto (default), required, none, or a function's
                             name (then the reply is that call, its arguments as the schema says)
      --embed                print PROMPT's embedding instead of generating: one JSON array
                             of d_model numbers (model:embed: mean-pooled, unit length; at -L);
                             PROMPT "-": each line of stdin's, one array a line (JSON Lines)
      --no-prompt            do not echo the prompt
      --no-stats             no stats line
  -h, --help                 this text
Exit status: 0, 1 when generation fails (or stdin cannot be read), 2 for bad usage, 130 on
Ctrl-C (at once, also while -i or --embed - waits for a line).
]]

-- option -> { config field, kind } ; kinds: int, number, flag
local OPTIONS = {
    ["-n"] = { "max_tokens", "int" }, ["--max-tokens"] = { "max_tokens", "int" },
    ["-L"] = { "loops", "int" }, ["--loops"] = { "loops", "int" },
    ["-t"] = { "temperature", "number" }, ["--temperature"] = { "temperature", "number" },
    ["-k"] = { "top_k", "int" }, ["--top-k"] = { "top_k", "int" },
    ["--top-p"] = { "top_p", "number" },
    ["-s"] = { "sample_seed", "int" }, ["--seed"] = { "sample_seed", "int" },
    ["--repetition-penalty"] = { "repetition_penalty", "number" },
    ["--presence-penalty"] = { "presence_penalty", "number" },
    ["--frequency-penalty"] = { "frequency_penalty", "number" },
    ["--penalty-window"] = { "penalty_window", "int" },
    ["--penalties-count-prompt"] = { "penalties_count_prompt", "flag" },
    ["--min-p"] = { "min_p", "number" },
    ["--temperature-last"] = { "temperature_last", "flag" },
    ["--thinking-budget"] = { "reasoning_budget", "int" },
    ["--min-tokens"] = { "min_tokens", "int" },
    ["--cache-window"] = { "cache_window", "int" },
    ["--ignore-eos"] = { "ignore_eos", "flag" },
    ["--beam"] = { "beam_size", "int" },
    ["--length-penalty"] = { "length_penalty", "number" },
    ["--speculative"] = { "speculative", "string" },
    ["--draft-loops"] = { "draft_loops", "int" },
    ["--draft-ahead"] = { "draft_ahead", "int" },
    ["--K-branches"] = { "K_branches", "int" },
    ["--max-nodes"] = { "max_nodes", "int" },
    ["--early-exit"] = { "early_exit_patience", "int" },
    ["--early-exit-min-L"] = { "early_exit_min_L", "int" },
    ["--early-exit-peek"] = { "early_exit_peek_every", "int" },
    ["--early-exit-threshold"] = { "early_exit_threshold", "number" },
    ["--early-exit-margin"] = { "early_exit_logit_margin", "number" },
    ["--early-exit-criterion"] = { "early_exit_criterion", "string" },
    ["--early-exit-kl"] = { "early_exit_kl_threshold", "number" },
    ["--early-exit-entropy"] = { "early_exit_entropy_threshold", "number" },
    ["--early-exit-gate"] = { "early_exit_gate_threshold", "number" },
}

-- A config field's long option (messages name what the user typed)
local OPTION_OF = { stop_strings = "--stop", logit_bias = "--logit-bias", verify_loops = "--loops" }
for option, spec in pairs(OPTIONS) do
    if option:sub(1, 2) == "--" then OPTION_OF[spec[1]] = option end
end

local function usage_error(msg)
    io.stderr:write("tinyloop: ", msg, " (see --help)\n")
    return 2
end

-- The options, besides OPTIONS' own, that take a value.
local VALUE_OPTIONS = {}
for _, option in ipairs({ "-m", "--model", "-p", "--prompt", "--stop", "--policy", "--threads", "--grammar", "--json-schema",
                          "--regex", "--backend", "--kv-type", "--system", "--chat-template", "--tools", "--tool-choice",
                          "--logit-bias" }) do
    VALUE_OPTIONS[option] = true
end

-- Parses argv; returns the options table or nil, exit status.
function _M.parse(argv, default_model)
    local o = { model = default_model, cfg = {}, stops = {}, echo = true, stats = true }
    local positional -- the prompt given as an argument, not as -p's value
    local i = 1
    while i <= #argv do
        local a, v = argv[i], argv[i + 1]
        local spec = OPTIONS[a]
        if v == nil and ((spec and spec[2] ~= "flag") or VALUE_OPTIONS[a]) then
            return nil, usage_error("option " .. a .. " needs a value")
        end
        if a == "-h" or a == "--help" then
            show(USAGE:format(default_model))
            return nil, 0
        elseif spec then
            if spec[2] == "flag" then
                o.cfg[spec[1]] = true
            elseif spec[2] == "string" then
                o.cfg[spec[1]] = v
                i = i + 1
            else
                local x = decimal(v)
                if not x or (spec[2] == "int" and x ~= math.floor(x)) then
                    return nil, usage_error("bad value for " .. a .. ": " .. v)
                end
                -- (a whole number past 2^53 is read rounded: 2^53 + 1 was taken as 2^53)
                local digits = spec[2] == "int" and v:match("^[+-]?0*(%d+)$")
                if digits and #digits >= 16 and (math.abs(x) > 2 ^ 53 or ("%.0f"):format(math.abs(x)) ~= digits) then
                    return nil, usage_error(("bad value for %s: %s (past 2^53 = 9007199254740992, the largest read exactly)")
                        :format(a, v))
                end
                o.cfg[spec[1]] = x
                i = i + 1
            end
        elseif a == "--logit-bias" then
            -- ID=BIAS, repeatable: OpenAI's logit_bias one entry at a time
            local id, bias = v:match("^(%d+)=([^=]+)$")
            if not id or not decimal(bias) or #id:gsub("^0+", "") > 9 then -- (no vocabulary has 10^9 tokens)
                return nil, usage_error("bad value for --logit-bias: " .. v .. " (want ID=BIAS, e.g. 198=-100)")
            end
            o.cfg.logit_bias = o.cfg.logit_bias or {}
            o.cfg.logit_bias[tonumber(id)] = decimal(bias)
            i = i + 1
        elseif VALUE_OPTIONS[a] then
            if a == "-m" or a == "--model" then o.model = v
            elseif a == "-p" or a == "--prompt" then
                -- (a prompt given as an argument before it was dropped without a word)
                if positional then return nil, usage_error("unexpected argument " .. positional) end
                -- (a second -p took the place of the first without a word)
                if o.prompt then return nil, usage_error(a .. " given twice: one prompt a run") end
                o.prompt = v
            elseif a == "--stop" then o.stops[#o.stops + 1] = v
            elseif a == "--system" then o.system = v
            elseif a == "--chat-template" then o.chat_template = v
            elseif a == "--tools" then o.tools_file = v
            elseif a == "--tool-choice" then o.tool_choice = v
            elseif a == "--policy" then o.policy = v
            elseif a == "--grammar" then o.grammar_file = v
            elseif a == "--json-schema" then o.schema_file = v
            elseif a == "--regex" then o.regex = v
            elseif a == "--backend" then
                if v ~= "auto" and v ~= "cpu" and v ~= "cuda" then
                    return nil, usage_error("bad value for --backend: " .. v .. " (auto, cpu or cuda)")
                end
                o.backend = v
            elseif a == "--kv-type" then
                if v ~= "f32" and v ~= "f16" then
                    return nil, usage_error("bad value for --kv-type: " .. v .. " (f32 or f16)")
                end
                o.kv_type = v
            else
                o.threads = decimal(v) -- (as every number flag: 0x2 and " 2" were taken)
                if not o.threads or o.threads < 1 or o.threads > tinyloop.C.TL_MAX_THREADS or o.threads ~= math.floor(o.threads) then
                    return nil, usage_error("bad value for --threads: " .. v)
                end
            end
            i = i + 1
        elseif a == "--chat" then o.chat = true
        elseif a == "-i" or a == "--interactive" then o.chat, o.interactive = true, true
        elseif a == "--embed" then o.embed = true
        elseif a == "--no-prompt" then o.echo = false
        elseif a == "--no-stats" then o.stats = false
        elseif a == "--fit-context" then o.fit_context = true
        elseif a == "--" then -- what follows is the prompt, options or not ("-n 3" after it is text)
            if i + 1 < #argv then return nil, usage_error("unexpected argument " .. argv[i + 2]) end
            if v then
                if o.prompt then return nil, usage_error("unexpected argument " .. v) end
                o.prompt = v
            end
            break
        elseif a:sub(1, 1) == "-" and #a > 1 then
            return nil, usage_error("unknown option " .. a)
        elseif not o.prompt then o.prompt, positional = a, a
        else return nil, usage_error("unexpected argument " .. a)
        end
        i = i + 1
    end
    if not o.prompt and not o.interactive then return nil, usage_error("no prompt given") end
    if o.interactive and o.tools_file then return nil, usage_error("--tools goes with one --chat turn, not --interactive") end
    if o.fit_context and (o.interactive or o.embed) then
        return nil, usage_error("--fit-context goes with one generation (-i fits each turn itself; --embed generates nothing)")
    end
    local constraints = {}
    for _, c in ipairs({ { o.grammar_file, "--grammar" }, { o.schema_file, "--json-schema" }, { o.regex, "--regex" } }) do
        if c[1] then constraints[#constraints + 1] = c[2] end
    end
    if #constraints > 1 then
        return nil, usage_error(table.concat(constraints, ", ") .. ": each constrains the output, give one")
    end
    for _, pair in ipairs({ { o.system, "--system" }, { o.chat_template, "--chat-template" }, { o.tools_file, "--tools" } }) do
        if pair[1] and not o.chat then return nil, usage_error(pair[2] .. " goes with --chat") end
    end
    if o.tool_choice and not o.tools_file then return nil, usage_error("--tool-choice goes with --tools") end
    if o.embed and o.chat then return nil, usage_error("--embed reads PROMPT as text: not with --chat or -i") end
    if #o.stops > 0 then o.cfg.stop_strings = o.stops end
    -- the early-exit knobs tune --early-exit (or a policy's depth rule): alone they did nothing
    if not o.embed and not o.policy and (o.cfg.early_exit_patience or 0) <= 0 then
        local knobs = {}
        for field in pairs(o.cfg) do
            if field:match("^early_exit_") and field ~= "early_exit_patience" then knobs[#knobs + 1] = OPTION_OF[field] end
        end
        if #knobs > 0 then
            table.sort(knobs)
            return nil, usage_error(table.concat(knobs, ", ") .. " tune early exit, which is off: give --early-exit PATIENCE")
        end
    end
    if o.embed then -- (an embedding generates nothing: what shapes generation was ignored)
        local given = {}
        for field in pairs(o.cfg) do if field ~= "loops" then given[#given + 1] = OPTION_OF[field] or field end end
        for _, c in ipairs({ { o.grammar_file, "--grammar" }, { o.schema_file, "--json-schema" }, { o.regex, "--regex" },
                             { o.policy, "--policy" } }) do
            if c[1] then given[#given + 1] = c[2] end
        end
        if #given > 0 then
            table.sort(given)
            return nil, usage_error("--embed generates nothing: " .. table.concat(given, ", ") .. " would be ignored")
        end
    end
    return o
end

-- --tools FILE [--tool-choice C] -> the tools' spec (tinyloop.tools.check), the tools as the
-- template reads them; or nil, nil, err, exit status (1: the file cannot be read; 2: what it
-- or the choice says is refused).
read_tools = function(path, choice)
    local text, ferr, opened = read_file(path)
    if not opened then return nil, nil, ferr, 1 end
    if not text then return nil, nil, path .. ": cannot read it", 1 end
    local list, jerr = json_text.decode_file(text) -- (the reason was dropped: "not JSON" for a BOM, a tab, a \ud800)
    if type(list) ~= "table" then
        return nil, nil, path .. ": not OpenAI's tools array (a JSON array)" .. (jerr and (": " .. jerr) or ""), 2
    end
    local tool_choice = choice
    if choice and choice ~= "auto" and choice ~= "required" and choice ~= "none" then
        tool_choice = { type = "function", ["function"] = { name = choice } }
    end
    local spec, shown = tools.prepare(list, tool_choice, nil, json_text.member(text, {}))
    if spec == nil then return nil, nil, (shown:gsub("^tool_choice", "--tool-choice")), 2 end
    return spec or nil, shown
end

-- A message in the words of the command line: the config fields the engine and the bindings
-- name ("field = value", "config field 'field'", and in an engine message's prose "does not
-- support cache_window yet") are the options the user typed (reasoning_budget is
-- --thinking-budget, sample_seed --seed). A field's name in a path, inside an option's own
-- name, or in the prose of a Lua error (a policy's hook: its own words) stays as it is.
local function cli_wording(message)
    -- (the Lua binding's way past 2^53, a uint64_t cdata, which a command line cannot give)
    message = message:gsub(" %(past it: a uint64_t, 0x%.%.%.ULL%)", "")
    message = message:gsub("config field '([%w_]+)'", function(field) return OPTION_OF[field] end)
    -- (a list's item: stop_strings[1] is the first --stop)
    message = message:gsub("%f[%w_]([%a_][%w_]*)%[(%d+)%]", function(field, k)
        return OPTION_OF[field] and ("%s #%s"):format(OPTION_OF[field], k)
    end)
    message = message:gsub("%f[%w_%-]([%a_][%w_]*) = ", function(field)
        return OPTION_OF[field] and (OPTION_OF[field] .. " = ")
    end)
    -- a field's name in an engine message's prose: the names with an underscore, which no
    -- word of prose has (loops, temperature are words too), not in a path or a file name
    -- (/tmp/top_k/p.lua), nor in a Lua error's text (a hook's message, its traceback)
    if not (message:find("%.lua:%d+:") or message:find("stack traceback", 1, true)) then
        message = message:gsub("()([%a][%w]*_[%w_]*%w)()", function(from, field, to)
            local before, after = message:sub(from - 1, from - 1), message:sub(to, to)
            if before:find("[%w_/.%-]") or after:find("[%w_/.]") then return nil end
            return OPTION_OF[field]
        end)
    end
    -- (the C function's name that begins an engine message says nothing to the command's user)
    message = message:gsub("^tl_[%w_]+: ", "")
    return (message:gsub("^prompt_len = 0 must be >= 1", "the prompt is empty: it has no tokens"))
end

local function report(message)
    io.stderr:write("tinyloop: ", cli_wording(raised_message(message)), "\n")
end

-- The one stats line of a generation, on stderr.
local function stats_line(s, model)
    io.stderr:write(string.format(
        "[prefill %d tokens%s %.1f ms%s | first token %.1f ms | %d tokens%s | stop %s | loops %.2f%s%s | %d threads]\n",
        s.prompt_tokens, s.prompt_tokens_reused > 0 and string.format(" (%d reused)", s.prompt_tokens_reused) or "",
        -- (the rate of the prompt tokens the prefill computed: none where it computed none, a
        -- one-token prompt's under beam search or speculative decoding, whose first step takes it)
        s.prefill_ms, s.prefill_tokens_per_s > 0 and string.format(" (%.1f tok/s)", s.prefill_tokens_per_s) or "",
        s.first_token_ms, s.tokens_emitted,
        -- (the rate of the tokens after the first, which the prefill gave: none for one token)
        s.decode_tokens_per_s > 0 and string.format(" %.1f tok/s", s.decode_tokens_per_s) or "",
        s.stop_reason or "?", s.loops_used,
        s.probes > 0 and string.format(" (%d probes, %.1f ms)", s.probes, s.probe_ms) or "",
        s.verify_steps > 0 and string.format(" | accepted %d of %d drafted, %.2f per verification",
                                             s.accepted, s.drafted, s.mean_accepted) or "",
        model:info().n_threads))
end

-- The engine's default max_tokens (tl_generate_config_init's).
local function default_max_tokens()
    local defaults = require("tinyloop.ffi").new("tl_generate_config")
    tinyloop.C.tl_generate_config_init(defaults)
    return defaults.max_tokens
end

-- --fit-context: cfg.max_tokens (the engine's default where not given), or min_tokens where
-- larger, cut to the room the context leaves after the prompt (text or ids). A prompt that
-- cannot be encoded, or leaves no room, is left to the engine to refuse. -> true | nil, err
-- (a --min-tokens past the room).
local function fit_max_tokens(model, prompt, cfg)
    local encoded, ids = true, prompt
    if type(prompt) ~= "table" then encoded, ids = attempt(model.encode, model, prompt) end
    if not encoded or not ids then return true end
    local room = model:info().max_seq_len - #ids
    if room < 1 then return true end
    if (cfg.min_tokens or 0) > room then -- (the engine named the -n it was given)
        return nil, ("--min-tokens = %d: the context (max_seq_len = %d) leaves room for %d tokens after the prompt's %d")
            :format(cfg.min_tokens, room + #ids, room, #ids)
    end
    cfg.max_tokens = math.min(math.max(cfg.max_tokens or default_max_tokens(), cfg.min_tokens or 0), room)
    return true
end

-- ---- --interactive: a conversation, a user message a line of stdin

local CONVERSE_POOL_BYTES = 64 * 1024 * 1024 -- the prefix pool that keeps the conversation's rows

-- One reply to `prompt` (text or ids), streamed to stdout then a line end -> its text, stats,
-- the session's last token | nil, err, exit status. The session is made (every value
-- checked) before any token: what the engine refuses there (a depth past max_loops, a
-- prompt plus -n over the context...) is bad usage, status 2; a failure while generating is
-- status 1 (hook errors raise, runtime failures come back as nil, err: both reach it).
-- opts.echo: text written once the session is made (the prompt); opts.held: nothing written
-- of the reply (a caller that reads it first: tool calls).
local function stream_reply(model, prompt, cfg, opts)
    local made, iterate, session = attempt(model.stream, model, prompt, cfg)
    if not made then return nil, iterate, 2 end
    if not iterate then return nil, session, 1 end
    local parts = {}
    local ok, err = attempt(function()
        if opts and opts.echo then show(opts.echo) end
        for _, text in iterate, session do
            parts[#parts + 1] = text
            if not (opts and opts.held) then show_text(text) end
        end
        if session.error then error(session.error, 0) end
        if not (opts and opts.held) then show("\n") end
    end)
    if not ok then return nil, err, 1 end
    local tokens = session:tokens()
    return table.concat(parts), session.final_stats or session:stats(), tokens[#tokens]
end

-- The conversation's prompt with room for a reply of `want` tokens, the oldest turns (a user
-- message and its reply) left out while they do not fit -> { ids, left_out = messages left
-- out } | nil, err, exit status (the newest message alone overfills the context, or the
-- template fails). `history` itself is not changed.
local function fit(model, chat, system, history, want)
    local max_seq = model:info().max_seq_len
    local first = 1 -- the oldest message kept
    while true do
        local messages = system and { system } or {}
        for i = first, #history do messages[#messages + 1] = history[i] end
        local ids, text, fault = chat:prompt_ids(model, messages, true)
        if not ids then return nil, text, (fault == "template" or fault == "encode") and 1 or 2 end
        if #ids + want <= max_seq or first == #history then
            if #ids >= max_seq then
                return nil, ("the message makes a prompt of %d tokens with the chat template: %s the model's context of %d")
                    :format(#ids, #ids > max_seq and "over" or "all of", max_seq), 2
            end
            return { ids = ids, text = text, left_out = first - 1 }
        end
        first = first + 1
        if history[first].role == "assistant" then first = first + 1 end
    end
end

-- A token's length in the text a session shows (a special token shows nothing).
local function shown_length(model, id)
    if tinyloop.C.tl_token_is_special(model.ptr, id) ~= 0 then return 0 end
    return #(model:decode({ id }) or "")
end

-- Whether stdin is a terminal (a person typing), not a pipe or a file.
local function stdin_is_terminal()
    local ffi = require "tinyloop.ffi"
    return pcall(ffi.cdef, "int isatty(int fd);") and pcall(function() return ffi.C.isatty end) and ffi.C.isatty(0) == 1
end

-- A line of stdin (without its end; a Windows line end dropped too) | nil at its end | nil,
-- err where it cannot be read. Ctrl-C while waiting for it ends the program at once (130, as a
-- shell's commands end): LuaJIT's own handler only marks the interrupt, and the read resumed,
-- so that ^C waited for Enter. The default action stands for the read's time only.
-- Read a byte at a time: LuaJIT's "*l" measures what fgets read with strlen, so a NUL cut its
-- line there and the next line was joined on ("A\0B\nC" read as "AC").
local function read_line()
    local bytes, byte, err = at_default_sigint(function()
        local bytes, byte, err = {}, nil, nil
        while true do
            byte, err = io.stdin:read(1)
            if byte == nil or byte == "\n" then break end
            bytes[#bytes + 1] = byte
        end
        return bytes, byte, err
    end)
    if err then return nil, err end
    if byte == nil and #bytes == 0 then return nil end
    return (table.concat(bytes):gsub("\r$", ""))
end

local function converse(model, chat, cfg, o)
    if not model:info().has_tokenizer then
        report("--interactive reads text: this model has no tokenizer")
        return 2
    end
    local ffi = require "tinyloop.ffi"
    local prompt_marks = stdin_is_terminal() -- "> " before each message, for a person typing
    local max_seq = model:info().max_seq_len
    local want = cfg.max_tokens or default_max_tokens()
    local system = o.system and { role = "system", content = o.system }
    -- a conversation needs room for a message and a reply of -n tokens besides the system's
    local opening = chat:prompt_ids(model, system and { system, { role = "user", content = "" } } or { { role = "user", content = "" } }, true)
    local opening_len = opening and #opening or 0
    if opening_len + want >= max_seq then
        report(("-n %d (a reply) and the chat template's %d tokens%s fill the model's context of %d: no room for a message")
            :format(want, opening_len, system and " with the system message" or "", max_seq))
        return 2
    end
    if cfg.min_tokens and cfg.min_tokens > want then -- (as a one-shot reply refuses it)
        report(("min_tokens = %d must be in [0, max_tokens = %d]"):format(cfg.min_tokens, want))
        return 2
    end
    -- every setting checked before a message is read, as a one-shot run checks them (the first
    -- reply's session refused them, the message the user had typed lost)
    local check = {}
    for k, v in pairs(cfg) do check[k] = v end
    check.max_tokens = want
    local made, session, err = attempt(model.session, model, opening or { 0 }, check)
    if not made then report(session) return 2 end
    if not session then report(err) return 1 end
    session:close()
    model:set_prefix_pool(CONVERSE_POOL_BYTES)
    local history, pending = {}, o.prompt
    while true do
        local line = pending
        pending = nil
        if not line then
            if prompt_marks then io.stderr:write("> ") io.stderr:flush() end
            local err
            line, err = read_line()
            if not line and err then
                report("reading standard input: " .. tostring(err))
                return 1
            end
        end
        if not line or line == "/exit" or line == "/quit" then
            if not line and prompt_marks then io.stderr:write("\n") end
            return 0
        end
        if line == "/reset" then
            history = {}
            io.stderr:write("(the conversation is forgotten)\n")
        elseif line:match("%S") then
            history[#history + 1] = { role = "user", content = line }
            local fitted, err, status = fit(model, chat, system, history, want)
            if not fitted then
                report(err)
                if status == 1 then return 1 end
                table.remove(history) -- this message only: the conversation goes on as it was
            else
                local turn = {}
                for k, v in pairs(cfg) do turn[k] = v end
                -- the room the context leaves (the only message's reply may get less than -n)
                turn.max_tokens = math.min(want, max_seq - #fitted.ids)
                -- a thinking budget's block: open from the start where this turn's prompt opened it
                if turn.reasoning_budget then turn.reasoning_open = require("tinyloop.reasoning").opens(fitted.text) end
                if turn.min_tokens then turn.min_tokens = math.min(turn.min_tokens, turn.max_tokens) end
                if fitted.left_out > 0 then
                    local turns = math.ceil(fitted.left_out / 2)
                    io.stderr:write(("(the %d oldest turn%s left out to fit the context)\n"):format(turns, turns == 1 and " is" or "s are"))
                end
                local reply, stats, last = stream_reply(model, fitted.ids, turn)
                if not reply then -- a config the engine refuses, or a failure: as a one-shot reply's
                    report(stats)
                    return last
                end
                for _ = 1, fitted.left_out do table.remove(history, 1) end
                -- the text that goes on in the conversation: without the stop string that ended it
                if stats.stop_reason == "STOP_SEQUENCE" and cfg.stop_strings then
                    reply = (tags.cut_at_stop(reply, cfg.stop_strings, shown_length(model, last)))
                end
                history[#history + 1] = { role = "assistant", content = reply }
                if o.stats then stats_line(stats, model) end
            end
        end
    end
end

-- Merges a policy file into cfg: the file returns a table of config fields (hooks and
-- knobs) or a function(cfg, model) that edits cfg (and may return a new one).
local function apply_policy(path, cfg, model)
    local chunk, err = at_default_sigint(loadfile, path)
    if not chunk then return nil, "cannot load policy " .. path .. ": " .. err end
    local ok, p = attempt(chunk)
    if not ok then return nil, "policy " .. path .. " failed: " .. tostring(p) end
    if type(p) == "function" then
        local ok2, r = attempt(p, cfg, model)
        if not ok2 then return nil, "policy " .. path .. " failed: " .. tostring(r) end
        if r ~= nil and type(r) ~= "table" then -- (it said "config must be a table", naming no file)
            return nil, "policy " .. path .. ": its function returned a " .. type(r) .. ", not a config table (or nothing)"
        end
        return r or cfg
    elseif type(p) == "table" then
        for k, v in pairs(p) do cfg[k] = v end
        return cfg
    end
    return nil, "policy " .. path .. " must return a table or a function"
end

-- The command line -> its exit status: 0, 1 (a failure), 2 (bad usage), 130 (Ctrl-C).
function _M.main(argv, default_model)
    local ok, status = xpcall(_M.run, function(err)
        -- (a bug's traceback is kept; an interrupt or a failed write is said plainly)
        local plain = interrupted(err) or type(err) == "string" and err:sub(1, #OUTPUT_FAILED) == OUTPUT_FAILED
        return plain and err or debug.traceback(err, 2)
    end, argv, default_model)
    if not ok then
        if interrupted(status) then
            io.stderr:write("\n")
            return 130
        end
        io.stderr:write("tinyloop: ", tostring(status), "\n")
        return 1
    end
    -- what io.write buffered (the embeddings, tool calls, a conversation) fails at the flush
    local flushed, err = io.stdout:flush()
    if status == 0 and not flushed then
        io.stderr:write("tinyloop: ", OUTPUT_FAILED, tostring(err), "\n")
        return 1
    end
    return status
end

function _M.run(argv, default_model)
    local o, status = _M.parse(argv, default_model)
    if not o then return status end
    local ok, model, err = attempt(tinyloop.load, o.model, { threads = o.threads, backend = o.backend, kv_type = o.kv_type })
    if not ok then -- (a bad argument: an empty path, one with a NUL)
        report(model)
        return 2
    end
    if not model then
        io.stderr:write("tinyloop: ", err, "\n")
        return 1
    end
    for _, w in ipairs(model.warnings) do io.stderr:write("tinyloop: warning: ", w, "\n") end
    local cfg = o.cfg
    -- ---- --embed: the prompt's embedding, one JSON array (float32's round trip, %.9g)
    if o.embed then
        local function print_vector(vector)
            local numbers = {}
            for i, x in ipairs(vector) do numbers[i] = ("%.9g"):format(x) end
            show("[", table.concat(numbers, ","), "]\n")
        end
        -- (the depth is the option's, not a line's: the binding's check, on one token, before
        -- any line is read)
        if cfg.loops ~= nil then
            local ok, raised = attempt(model.embed, model, { 0 }, { loops = cfg.loops })
            if not ok then
                report(raised)
                return 2
            end
        end
        local function embed_line(text, where)
            local ok, vector, eerr = attempt(model.embed, model, text, { loops = cfg.loops })
            if not ok then io.stderr:write("tinyloop: ", where, cli_wording(raised_message(vector)), "\n") return 2 end
            if not vector then io.stderr:write("tinyloop: ", where, cli_wording(tostring(eerr)), "\n") return 1 end
            print_vector(vector)
            return 0
        end
        if o.prompt ~= "-" then return embed_line(o.prompt, "") end
        -- From a pipe or a file, EMBED_LINES lines at a time through model:embed_batch (short
        -- lines share forward passes; the same vectors, bit for bit); a chunk with a bad line
        -- goes again a line at a time, so the lines before it are printed and it is named.
        -- From a terminal, a line at a time: each answer as soon as its line is typed.
        local EMBED_LINES = stdin_is_terminal() and 1 or 32
        local n, chunk, first = 0, {}, 1
        local function flush()
            if #chunk == 0 then return 0 end
            local ok, vectors = attempt(model.embed_batch, model, chunk, { loops = cfg.loops })
            if ok and vectors then
                for _, vector in ipairs(vectors) do print_vector(vector) end
            else
                for i, text in ipairs(chunk) do
                    local status = embed_line(text, ("stdin line %d: "):format(first + i - 1))
                    if status ~= 0 then return status end
                end
            end
            chunk, first = {}, n + 1
            return 0
        end
        while true do
            local line, err = read_line()
            if not line then
                if not err then break end
                report("reading standard input: " .. tostring(err))
                return 1
            end
            n = n + 1
            chunk[#chunk + 1] = line
            if #chunk >= EMBED_LINES then
                local status = flush()
                if status ~= 0 then return status end
            end
        end
        return flush()
    end
    -- ---- --chat: the prompt through the chat template; the reply ends at the template's turn
    --      ends too (tinyloop.chat), and is all that is printed
    local chat
    if o.chat then
        local cerr
        chat, cerr = at_default_sigint(require("tinyloop.chat").load, o.model, o.chat_template)
        if not chat then io.stderr:write("tinyloop: ", cerr, "\n") return 1 end
        local ends, warning = chat:turn_end_ids(model)
        if warning then io.stderr:write("tinyloop: ", warning, "\n") end
        require("tinyloop.chat").add_stop_ids(cfg, ends)
    end
    if o.chat and not o.interactive then
        local messages = { { role = "user", content = o.prompt } }
        if o.system then table.insert(messages, 1, { role = "system", content = o.system }) end
        local shown
        if o.tools_file then
            local terr, status
            o.tools, shown, terr, status = read_tools(o.tools_file, o.tool_choice)
            if terr then
                io.stderr:write("tinyloop: ", terr, "\n")
                return status
            end
        end
        local ids, text, fault = chat:prompt_ids(model, messages, true, shown)
        if not ids then
            io.stderr:write("tinyloop: ", text, "\n")
            return (fault == "template" or fault == "encode") and 1 or 2
        end
        if #ids == 0 then -- (the engine's "prompt_len = 0" named no template)
            io.stderr:write("tinyloop: the chat template ", o.chat_template and ("(" .. o.chat_template .. ") ") or "",
                            "made an empty prompt of the messages\n")
            return 1
        end
        o.prompt, o.prompt_ids, o.echo = text, ids, false
    end
    -- ---- grammars: --grammar FILE.gbnf, --json-schema FILE.json
    -- (errors name the option: llama.cpp's --grammar takes the text itself, and "root ::= ...: No
    -- such file or directory" did not say a file was wanted)
    for _, g in ipairs({ { o.grammar_file, tinyloop.grammar.gbnf, "--grammar" }, { o.schema_file, tinyloop.grammar.json_schema, "--json-schema" } }) do
        if g[1] then
            local text, ferr, opened = read_file(g[1])
            if not opened then io.stderr:write("tinyloop: ", g[3], " takes a file: ", ferr, "\n") return 1 end
            if not text then io.stderr:write("tinyloop: ", g[3], " ", g[1], ": ", tostring(ferr), "\n") return 1 end
            local compiled, gerr = g[2](text)
            -- (what the file says is refused: bad usage, as a refused --regex or --tools file)
            if not compiled then io.stderr:write("tinyloop: ", g[3], " ", g[1], ": ", gerr, "\n") return 2 end
            cfg.grammar = compiled
        end
    end
    if o.regex then
        local compiled, gerr = tinyloop.grammar.regex(o.regex)
        if not compiled then io.stderr:write("tinyloop: --regex: ", gerr, "\n") return 2 end
        cfg.grammar = compiled
    end
    local reasoning = require "tinyloop.reasoning"
    local thinking = chat ~= nil and reasoning.uses(chat.template_text) -- (the template speaks of blocks)
    -- the thinking budget's block: <think> ... </think>, open from the start where the prompt opened it
    if cfg.reasoning_budget and o.prompt and not o.interactive then cfg.reasoning_open = reasoning.opens(o.prompt) end
    if o.tools and o.tools.forced then -- the reply is calls: their grammar
        if cfg.grammar then io.stderr:write("tinyloop: --tool-choice ", o.tool_choice, " constrains the output itself: not with --grammar, --json-schema or --regex\n") return 2 end
        local g, gerr = tools.grammar(o.tools)
        if not g then io.stderr:write("tinyloop: ", o.tools_file, ": ", gerr, "\n") return 2 end
        cfg.grammar = g
    elseif o.tools and not cfg.grammar then -- "auto": a call the model opens is made whole and valid
        local g, gerr = tools.lazy_grammar(o.tools)
        if not g then io.stderr:write("tinyloop: ", o.tools_file, ": ", gerr, "\n") return 2 end
        cfg.grammar = g
    end
    -- a thinking model's one block (opened by the prompt, or first in the reply) runs free and
    -- the grammar writes what follows it, as the server does; the reply is read after it
    if thinking and cfg.grammar then
        local g, gerr = reasoning.grammar(cfg.grammar, reasoning.opens(o.prompt), not o.tools)
        if not g then io.stderr:write("tinyloop: ", gerr, "\n") return 2 end
        cfg.grammar = g
    end
    if o.policy then
        cfg, err = apply_policy(o.policy, cfg, model)
        if not cfg then
            io.stderr:write("tinyloop: ", err, "\n")
            return 1
        end
    end
    if o.interactive then return converse(model, chat, cfg, o) end
    if o.fit_context then
        local fits, ferr = fit_max_tokens(model, o.prompt_ids or o.prompt, cfg)
        if not fits then
            report(ferr)
            return 2
        end
    end
    -- with tools: the reply is read for calls at its end, then its content and calls written
    local reply, result, status = stream_reply(model, o.prompt_ids or o.prompt, cfg, { echo = o.echo and o.prompt, held = o.tools ~= nil })
    if not reply then
        report(result)
        return status
    end
    if o.tools then
        -- a thinking model's block is written as it is, and only the answer after it read for calls
        local answer, line_ended = reply, false
        if thinking then
            local _, after_block = reasoning.split(reply, reasoning.opens(o.prompt))
            answer = after_block or ""
            local block = reply:sub(1, #reply - #answer)
            show_text(block)
            if answer == "" and block ~= "" then -- (the line ends here)
                if block:sub(-1) ~= "\n" then show("\n") end
                line_ended = true
            end
        end
        local cut = result.stop_reason == "MAX_TOKENS"
        local content, calls = tools.parse(answer, o.tools, function(k) return "call_" .. k end, cut)
        if content and not (content == "" and line_ended) then show_text(content .. "\n") end
        for _, call in ipairs(calls or {}) do
            show('{"name": ', cjson.encode(call.name), ', "arguments": ', call.arguments, "}\n")
        end
        -- a forced call that did not come (the token limit cut it before it was whole; the model
        -- ended inside a thinking block, which comes before it): nothing to show, and a failure
        -- (it printed nothing and exited 0)
        if o.tools.forced and #(calls or {}) == 0 then
            if o.stats then stats_line(result, model) end
            report(cut and ("the tool call was cut off after %d tokens, before it was whole: raise -n"):format(result.tokens_emitted)
                       or ("the reply ended (%s) before its tool call"):format(result.stop_reason or "?"))
            return 1
        end
    end
    if o.stats then stats_line(result, model) end
    return 0
end

return _M

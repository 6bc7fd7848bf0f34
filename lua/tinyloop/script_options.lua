-- tinyloop.script_options: "--name value" options of the measurement scripts
-- (scripts/sweep.lua, scripts/early_exit_eval.lua, scripts/bench/*.lua), the progress
-- lines they print and the medians they report.
-- The usage text is generated from the option table, so it lists every option with its
-- default.
--
--   local opt = require("tinyloop.script_options").parse(arg, {
--       name = "sweep.lua", summary = "what the script does",
--       { "max-tokens", 64, "new tokens per prompt" },    -- a number option (default a number)
--       { "out", "build/sweep", "output directory" },     -- a string option
--       { "threads", nil, "CPU threads", number = true, default_text = "all cores" },
--   })
--   opt.max_tokens --> 64 (dashes become underscores)
--
-- --help prints the usage and exits 0; a bad option or value prints the error and exits 2.
local _M = {}

-- A command line's number: decimal text only (an optional sign, digits with an optional
-- fraction, an optional exponent), or nil. tonumber also reads "0x10", "inf" and "nan" (which
-- a check then echoed as "-nan", not what was typed), and blanks around the digits.
function _M.decimal(text)
    if type(text) ~= "string" then return nil end
    local mantissa, exponent = text:match("^[+-]?([%d.]+)([eE]?[+-]?%d*)$")
    if not mantissa or not mantissa:find("%d") or select(2, mantissa:gsub("%.", "")) > 1 then return nil end
    if exponent ~= "" and not exponent:match("^[eE][+-]?%d+$") then return nil end
    return tonumber(text)
end

local function usage(spec)
    local lines = { ("usage: luajit %s [options]"):format(spec.path or ("scripts/" .. spec.name)), spec.summary, "" }
    for _, o in ipairs(spec) do
        local metavar = o.metavar or ((o.number or type(o[2]) == "number") and "N" or "X")
        lines[#lines + 1] = ("  --%-18s %s (default %s)"):format(o[1] .. " " .. metavar, o[3],
            o.default_text or tostring(o[2]))
    end
    lines[#lines + 1] = ("  --%-18s this text"):format("help")
    return table.concat(lines, "\n") .. "\n"
end

local function fail(spec, msg)
    io.stderr:write(spec.name, ": ", msg, " (see --help)\n")
    os.exit(2)
end

-- Returns the options table (every option present, defaults filled in). spec.name is the
-- script's name in messages; spec.path (scripts/bench/x.lua) gives it where the script is
-- not under scripts/ itself.
function _M.parse(argv, spec)
    spec.name = spec.name or spec.path:match("[^/]+$")
    local by_name, opt = {}, {}
    for _, o in ipairs(spec) do
        by_name[o[1]] = o
        opt[o[1]:gsub("%-", "_")] = o[2]
    end
    local i = 1
    while i <= #argv do
        local a = argv[i]
        if a == "-h" or a == "--help" then
            io.stdout:write(usage(spec))
            _M.finish(_M.die(spec.name))
            os.exit(0)
        end
        local o = by_name[a:match("^%-%-(.+)$") or ""]
        if not o then fail(spec, "unknown option " .. a) end
        local v = argv[i + 1]
        if v == nil then fail(spec, "option " .. a .. " needs a value") end
        if o.number or type(o[2]) == "number" then
            v = _M.decimal(v)
            if not v then fail(spec, "option " .. a .. " needs a number, not '" .. argv[i + 1] .. "'") end
        end
        opt[o[1]:gsub("%-", "_")] = v
        i = i + 2
    end
    return opt
end

-- die(name) -> die(message[, status]): a refusal in one line, "<name>: message" on stderr,
-- not a Lua traceback; exit status 2 (bad usage) unless told (1: a failure).
function _M.die(name)
    return function(message, status)
        io.stderr:write(name, ": ", message, "\n")
        os.exit(status or 2)
    end
end

-- The end of a script whose output is its table: standard output flushed, and a write that
-- failed (a full disk, a closed stream) a failure, status 1: print says nothing of it, and the
-- script ended 0 as if it had shown its figures.
function _M.finish(die)
    local ok, err = io.stdout:flush()
    if not ok then die("writing the output failed: " .. tostring(err), 1) end
end

-- Refuses (die) each option of `names` (underscored) that is not a whole number >= least
-- (1 unless given; infinity, which LuaJIT reads from "inf" or "1e400", is none: a run never ended).
function _M.counts(opt, names, die, least)
    least = least or 1
    for _, name in ipairs(names) do
        local v = opt[name]
        if not (v >= least) or v ~= math.floor(v) or v == math.huge then
            die(("--%s must be a whole number >= %d, got %s"):format(name:gsub("_", "-"), least, v))
        end
    end
end

-- The model of --model on --threads threads, or die: a value the load refuses (raised:
-- --threads -1) is bad usage, a load that fails (nil, err) a failure.
function _M.load_model(tinyloop, opt, die)
    local loaded, model, load_err = pcall(tinyloop.load, opt.model, { threads = opt.threads })
    if not loaded then die(require("tinyloop.raise").message(model)) end
    if not model then die(load_err, 1) end
    return model
end

-- Returns progress(label): writes "[index/total] label (elapsed s)" to stderr, one line per
-- call, so that a long run shows where it is (and a log stays readable).
function _M.progress(total, now)
    local start, index = now(), 0
    return function(label)
        index = index + 1
        io.stderr:write(("[%d/%d] %s (%.1f s elapsed)\n"):format(index, total, label, now() - start))
        io.stderr:flush()
    end
end

-- The median of a list of numbers (the mean of the two middle ones for an even count), the
-- list left as it was.
function _M.median(values)
    local sorted = { unpack(values) }
    table.sort(sorted)
    local n = #sorted
    return n % 2 == 1 and sorted[(n + 1) / 2] or (sorted[n / 2] + sorted[n / 2 + 1]) / 2
end

return _M

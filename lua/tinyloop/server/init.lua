-- tinyloop.server: OpenAI's completions, chat, Responses and embeddings APIs, Anthropic's
-- Messages API, Ollama's API and llama.cpp's server's for nginx + lua-nginx-module (Debian's nginx with libnginx-mod-http-lua, or
-- OpenResty; 0.10.22 or later for server_rewrite_by_lua). Any nginx.conf can use it:
--
--   init_by_lua_block        { require("tinyloop.server").configure{ model = "/path/to/model" } }
--   init_worker_by_lua_block { require("tinyloop.server").init_worker() }
--   location = /v1/completions { content_by_lua_block { require("tinyloop.server").completions() } }
--   (and chat_completions, responses, stored_response, messages, count_tokens, embeddings,
--   ollama_chat, ollama_generate, ollama_show, ollama_tags, ollama_ps, ollama_version,
--   ollama_embed, ollama_embeddings, llamacpp_completion, llamacpp_props, root, models, model,
--   tokenize, detokenize, health, metrics; the hooks guard (server_rewrite: CORS preflights, the
--   API key), cors_headers (header_filter) and log (log); see lua/tinyloop/server/nginx.conf and
--   examples/)
--
-- Why it never blocks the event loop: each worker owns a C engine (tl_engine_*) whose thread
-- steps all of the worker's sessions together (one tl_session_step_batch per iteration). A
-- handler only validates, submits, and then waits for output in nginx's thread pool
-- (ngx.run_worker_thread -> tl_engine_wait), so its coroutine sleeps while the event loop
-- keeps serving. Reading the output (tl_engine_read) never blocks. Without a thread pool
-- (configure{ thread_pool = false }, or an nginx without run_worker_thread) it polls with an
-- ngx.sleep backoff instead: slower to notice tokens, same correctness.
local ordered_pairs = require("tinyloop.ordered").pairs -- (an error names the same field in every process)
local ffi = require "tinyloop.ffi"
local cjson = require "cjson.safe"
local json_text = require "tinyloop.json_text"
local tinyloop = require "tinyloop"
local request = require "tinyloop.server.request"
local responses = require "tinyloop.server.responses"
local anthropic = require "tinyloop.server.anthropic"
local ollama = require "tinyloop.server.ollama"
local llamacpp = require "tinyloop.server.llamacpp"
local shapes = require "tinyloop.server.shapes"
local tools = require "tinyloop.tools"
local reasoning = require "tinyloop.reasoning"
local tags = require "tinyloop.tags"
local raised_message = require("tinyloop.raise").message
local metrics = require "tinyloop.server.metrics"

local C = tinyloop.C
local ngx = ngx
local ngx_say, ngx_print, ngx_flush, ngx_exit, ngx_now, ngx_update_time, ngx_log = ngx.say, ngx.print, ngx.flush, ngx.exit, ngx.now, ngx.update_time, ngx.log
local ffi_string, ffi_new, ffi_cast = ffi.string, ffi.new, ffi.cast
local encode = cjson.encode
-- (a table of several keys, as the workers write it alike: cjson's order is the table's hash's)
local encode_sorted = json_text.encode_sorted
local tostring, tonumber, type, pcall, pairs, ipairs, concat = tostring, tonumber, type, pcall, pairs, ipairs, table.concat
local run_worker_thread = ngx.run_worker_thread
local alternatives_of = tinyloop.alternatives_of
local valid_utf8 = request.valid_utf8

local _M = { _VERSION = tinyloop._VERSION }

local conf = {
    model = nil,              -- checkpoint directory (required)
    model_id = nil,           -- the name clients send as "model"; default: the directory's name
    threads = 0,              -- CPU threads of the model (0 = one per core the worker may use)
    kv_type = "f32",          -- the KV cache's type: "f32" or "f16" (half the memory a session)
    max_active = 8,           -- sessions stepped together per worker
    max_queued = 32,          -- admitted sessions waiting for a place; beyond: 503
    step_rows = false,        -- rows an engine iteration forwards at most: one per running session,
                              -- the rest for prompts (chunked prefill: a long prompt delays the
                              -- running streams' next token by one chunk, not by its whole
                              -- prefill); 0 = no limit; false: tl_engine_auto_step_rows (64 for
                              -- max_active up to 32: whole passes, 32 rows or more for prompts)
    thread_pool = "tinyloop", -- nginx thread_pool the handlers wait in; false = poll
    shared_dict = "tinyloop_metrics",
    wait_ms = 1000,           -- one wait in the pool at most (then the handler loops)
    keepalive_s = 15,         -- a stream with nothing to send this long (a long prompt's prefill,
                              -- a queue) starts and sends a sign of life, again each this long:
                              -- Claude Code and Codex drop a stream silent for 300 s
    max_body = 1024 * 1024,   -- request bodies above: 413 (keep client_max_body_size equal)
    publish_every = 0.25,     -- seconds between copies of the engine counters into shared_dict
    engine_nice = 5,          -- compute threads this much nicer than the event loop (0: as is)
    prefix_pool_mb = 128,     -- per worker: K/V of recent prompts, reused by requests that start
                              -- with one (chat turns resend the conversation); 0 = none
    kv_budget_mb = 0,         -- per worker: K/V the running requests may hold at most, each counted
                              -- at its prompt and max_tokens (tl_engine_options.kv_budget_bytes):
                              -- requests wait in the queue for memory, and one larger than the
                              -- budget is refused (400); 0 = none
    grammar_cache_mb = 256,   -- per worker: memory the cached compiled grammars (grammar, JSON
                              -- Schema, regex, choice) may hold; the least recently used go first
    chat_template = nil,      -- a Jinja file for /v1/chat/completions; default: the model's own
                              -- (tinyloop.chat.load), else a plain built-in one
    reasoning_format = "auto", -- a thinking model's <think> block as reasoning_content (tinyloop.
                              -- reasoning): "deepseek" (llama.cpp's name of the format), "none",
                              -- or "auto" (where the chat template speaks of <think> or </think>)
    api_key = nil,            -- requests but /health's and /metrics' must carry it (Authorization:
                              -- Bearer KEY, or Anthropic's x-api-key: KEY); nil: none needed
    embed_jobs = 2,           -- embeddings requests (and prompt scorings) a worker computes at once (each in the thread
                              -- pool; the others wait for a place, up to embed_wait_s, then 503)
    embed_wait_s = 30,
    responses_store = "tinyloop_responses", -- the lua_shared_dict that keeps /v1/responses' stored
                              -- responses (previous_response_id, GET): the oldest go when it is
                              -- full; false, or a dict not declared: none are stored
    cors_origins = nil,       -- web pages of these origins may call the API from a browser: "*",
                              -- or origins separated by commas ("https://app.example,http://
                              -- localhost:3000"); nil: none. guard() refuses the others' (403)
    allowed_hosts = nil,      -- names a request on a loopback address may give as its Host besides
                              -- this machine's own ones (localhost, its IP addresses, its name):
                              -- "a.example,b" (a proxy's upstream name); guard() refuses the
                              -- others (403: a DNS-rebinding page's)
}

-- Durations (latency metrics, Ollama's durations, the pool warning's minute) on nginx's
-- monotonic clock: ngx.now() is the wall clock, which steps with the system's (a step back of
-- an hour while a request waited observed a time to first token of -3599 s).
local monotonic_time = require("resty.core.time").monotonic_time
local function now()
    ngx_update_time()
    return monotonic_time()
end

-- The request's arrival on that clock. nginx stamps it on the wall clock
-- (ngx.req.start_time): read once as a request's handler starts, little time after it.
local function arrival_time()
    local ctx = ngx.ctx
    if not ctx.arrived_at then
        local t = now()
        ctx.arrived_at = t - math.max(0, ngx_now() - ngx.req.start_time())
    end
    return ctx.arrived_at
end

-- No thread or Lua VM in the pool ("no available Lua vm" past lua_worker_thread_vm_pool_size,
-- a full queue, a missing pool): a configuration too small for the load costs latency (a wait
-- polls; a compile or an encode runs on the event loop), never the request. Logged once a minute.
local pool_warned_at = {} -- (by what is done instead)
local function pool_unavailable(err, instead)
    if now() - (pool_warned_at[instead] or -math.huge) > 60 then
        pool_warned_at[instead] = now()
        ngx.log(ngx.WARN, "tinyloop: thread pool: ", tostring(err), "; ", instead,
                " instead (size thread_pool and lua_worker_thread_vm_pool_size to max_active + max_queued + embed_jobs;",
                " a new Lua VM opens files too: \"no available Lua vm\" is also a process out of file descriptors, ulimit -n)")
    end
end

-- tinyloop.server.wait's `fn` (its scoring and embeddings) in the thread pool, or, where the pool
-- cannot take the call (none configured, no Lua VM to spare, a full queue, a missing pool),
-- the same call here on the event loop: every connection of the worker waits for it, but the
-- request is answered (they were 500s). `instead` says so in the log. -> fn's results.
local wait_here -- (the module, in this VM: loaded at the first call it takes)
local function pack(...) return { n = select("#", ...), ... } end
local function in_pool(fn, instead, ...)
    if conf.thread_pool then
        local results = pack(run_worker_thread(conf.thread_pool, "tinyloop.server.wait", fn, ...))
        if results[1] then return unpack(results, 2, results.n) end
        pool_unavailable(results[2], instead)
    else
        pool_unavailable("none configured (thread_pool false, or an nginx without run_worker_thread)", instead)
    end
    wait_here = wait_here or require("tinyloop.server.wait")
    local results = pack(pcall(wait_here[fn], ...))
    if not results[1] then return nil, tostring(results[2]) end
    return unpack(results, 2, results.n)
end

-- A hang-up nginx never reports: a client that closes (or shuts its sending side) right after
-- its request sends its end of stream with the body, which nginx reads before the handler runs
-- (lua_need_request_body); the read event that carried it is spent on the body, and
-- lua_check_client_abort waits for another that never comes (a blocking request then ran to
-- its end, holding its places; in 5 of 10 tries here). So each handler, once its on_abort is
-- set (a later hang-up is an event of its own), peeks at the connection: true when it is at
-- its end. The socket is the request's connection's (ngx_http_request_t opens with its
-- signature, "HTTP", and connection, ngx_connection_t with data, read, write and fd, as since
-- nginx 0.x), read only when its peer is the client's own port; false where anything differs.
local get_request = select(2, pcall(function() return require("resty.core.base").get_request end))
local function declared(name) return pcall(ffi.typeof, name) end
if not declared("tl_ngx_request_head") then -- (once a VM: a second load of this module finds them)
    pcall(ffi.cdef, [[
typedef struct { uint32_t signature; void *connection; } tl_ngx_request_head;
typedef struct { void *data; void *read; void *write; int fd; } tl_ngx_connection_head;
]])
end
pcall(ffi.cdef, "long recv(int, void *, size_t, int);") -- (another module may have declared them)
pcall(ffi.cdef, "int getpeername(int, void *, unsigned int *);")
pcall(ffi.cdef, "int getsockname(int, void *, unsigned int *);")
local libc_probe = declared("tl_ngx_request_head") and
    pcall(function() return ffi.C.recv and ffi.C.getpeername and ffi.C.getsockname end)
local tcp_info_ok = pcall(ffi.cdef, "int getsockopt(int, int, int, void *, unsigned int *);") or
    pcall(function() return ffi.C.getsockopt end) -- (another module may have declared it)
local IPPROTO_TCP, TCP_INFO, TCP_CLOSE, TCP_CLOSE_WAIT = 6, 11, 7, 8 -- (Linux's)
local tcp_info, tcp_info_len = ffi_new("uint8_t[256]"), ffi_new("unsigned int[1]")
local NGX_HTTP_MODULE = 0x50545448 -- the request's signature
local MSG_PEEK, MSG_DONTWAIT, AF_UNIX, AF_INET, AF_INET6, ENOTCONN = 0x2, 0x40, 1, 2, 10, 107
local peer, peer_len, peek_byte = ffi_new("uint8_t[128]"), ffi_new("unsigned int[1]"), ffi_new("uint8_t[1]")
local function tcp_state(fd)
    if not tcp_info_ok then return nil end
    tcp_info_len[0] = 256
    if ffi.C.getsockopt(fd, IPPROTO_TCP, TCP_INFO, tcp_info, tcp_info_len) ~= 0 then return nil end
    return tcp_info[0] -- (struct tcp_info opens with tcpi_state)
end
-- A connection its client reset (SO_LINGER 0, a killed process, a proxy) has no peer left:
-- getpeername fails with ENOTCONN (such a blocking request ran to its end). The socket is
-- still taken for the request's only where its own port is the server's, and left only
-- where the kernel has closed it.
local function reset_left(fd)
    if ffi.errno() ~= ENOTCONN then return false end
    peer_len[0] = 128
    if ffi.C.getsockname(fd, peer, peer_len) ~= 0 then return false end
    local family = ffi_cast("uint16_t *", peer)[0]
    if (family ~= AF_INET and family ~= AF_INET6) or peer[2] * 256 + peer[3] ~= tonumber(ngx.var.server_port) then
        return false
    end
    return tcp_state(fd) == TCP_CLOSE
end
local function client_left()
    if not libc_probe or type(get_request) ~= "function" then return false end
    local r = get_request()
    if r == nil then return false end
    local head = ffi_cast("tl_ngx_request_head *", r)
    if head.signature ~= NGX_HTTP_MODULE or head.connection == nil then return false end
    local connection = head.connection
    local fd = ffi_cast("tl_ngx_connection_head *", connection).fd
    if fd < 0 then return false end
    peer_len[0] = 128
    if ffi.C.getpeername(fd, peer, peer_len) ~= 0 then return reset_left(fd) end
    local family = ffi_cast("uint16_t *", peer)[0]
    if family == AF_INET or family == AF_INET6 then
        if peer[2] * 256 + peer[3] ~= tonumber(ngx.var.remote_port) then return false end
    elseif family ~= AF_UNIX or ngx.var.remote_addr ~= "unix:" then
        return false
    end
    if tonumber(ffi.C.recv(fd, peek_byte, 1, MSG_PEEK + MSG_DONTWAIT)) == 0 then return true end
    -- (bytes after the request, a stray CRLF or a pipelined request, stand before the end of
    -- stream, which the peek then never sees: the kernel's TCP state says the peer closed;
    -- such a blocking request ran to its end)
    if family == AF_UNIX then return false end
    local state = tcp_state(fd)
    return state == TCP_CLOSE_WAIT or state == TCP_CLOSE
end

local model, engine, engine_addr, wait_addr, model_error, created_at
-- prompts from this long on are encoded in the thread pool (about 1 ms of tl_encode)
local ENCODE_IN_POOL_BYTES = 16384
local chat_prompts, chat_error -- tinyloop.chat for the model (or why it failed to load)
local reasoning_on -- chat replies are read for reasoning (conf.reasoning_format)
-- the model, tl_score_logprobs, tl_embed_batch and tl_last_error, for prompt scoring and
-- embeddings in the thread pool
local model_addr, score_addr, embed_addr, last_error_addr
local embed_slots -- ngx.semaphore of conf.embed_jobs places: the embeddings requests computed at once
-- This worker's part of every answer's id: its pid and a random number, so that ids stay
-- unique across workers and restarts
local worker_tag
local responses_store -- ngx.shared[conf.responses_store] (nil: responses are not stored)
-- (a stored response's id is 128 random bits, shapes.random_hex: whoever knows an id can read,
-- continue and delete that conversation, so none is guessable)
local model_types -- what /v1/models says of the weights and the KV cache (model:info(), once)
local worker_initialised = false -- init_worker ran in this Lua VM (ready())
local next_request = 0

-- configure(opts) in init_by_lua: the fields of `conf` above (those whose default is nil too).
local OPTIONAL = { model = true, model_id = true, chat_template = true, api_key = true, cors_origins = true,
                   allowed_hosts = true }
function _M.configure(opts)
    for k, v in ordered_pairs(opts or {}) do
        if conf[k] == nil and not OPTIONAL[k] then error("tinyloop.server: unknown option '" .. tostring(k) .. "'") end
        conf[k] = v
    end
    if type(conf.model) ~= "string" then error("tinyloop.server: configure{ model = DIR } is required") end
    if conf.kv_type ~= "f32" and conf.kv_type ~= "f16" then
        error("tinyloop.server: kv_type must be \"f32\" or \"f16\", got " .. tostring(conf.kv_type))
    end
    conf.model_id = conf.model_id or conf.model:gsub("/+$", ""):match("([^/]+)$")
    if type(conf.model_id) ~= "string" or conf.model_id == "" then
        error("tinyloop.server: model_id must be a non-empty string, got " .. tostring(conf.model_id))
    end
    if conf.responses_store ~= false and type(conf.responses_store) ~= "string" then
        error("tinyloop.server: responses_store must be a lua_shared_dict's name or false, got " .. tostring(conf.responses_store))
    end
    if conf.api_key == "" then conf.api_key = nil end -- (an environment variable set empty: none)
    if conf.cors_origins == "" then conf.cors_origins = nil end
    if conf.cors_origins ~= nil then
        if type(conf.cors_origins) ~= "string" then error("tinyloop.server: cors_origins must be a string") end
        local allowed = {}
        for origin in conf.cors_origins:gmatch("[^,%s]+") do
            if origin ~= "*" and not origin:find("^https?://[^/]+$") then
                error(("tinyloop.server: cors_origins: %s is not an origin (scheme://host[:port], or *)"):format(origin))
            end
            allowed[origin] = true
        end
        conf.cors_allowed = allowed
    end
    local hosts = {}
    if conf.allowed_hosts ~= nil and conf.allowed_hosts ~= "" then
        if type(conf.allowed_hosts) ~= "string" then error("tinyloop.server: allowed_hosts must be a string") end
        for name in conf.allowed_hosts:gmatch("[^,%s]+") do
            if not name:find("^[%w%.%-]+$") then
                error(("tinyloop.server: allowed_hosts: %s is not a host name (letters, digits, '.', '-')"):format(name))
            end
            hosts[name:lower():gsub("%.$", "")] = true
        end
    end
    local machine = io.open("/proc/sys/kernel/hostname") -- (Linux's; without it, listed by hand)
    if machine then
        local name = machine:read("*l")
        machine:close()
        if name and name ~= "" then hosts[name:lower()] = true end
    end
    conf.hosts_allowed = hosts
    if not request.is_integer(conf.embed_jobs) or conf.embed_jobs < 1 then
        error("tinyloop.server: embed_jobs must be an integer >= 1, got " .. tostring(conf.embed_jobs))
    end
    -- (here, in the master: a wrong kind failed in each worker's start, which then answered
    -- "the model is loading" for good; the engine and the loader check the ranges)
    for _, name in ipairs({ "threads", "max_active", "max_queued", "max_body", "engine_nice" }) do
        if not request.is_integer(conf[name]) then
            error(("tinyloop.server: %s must be an integer, got %s"):format(name, tostring(conf[name])))
        end
    end
    -- (wait_ms reaches C as an int: 0.5 became 0 and 2^31 a negative, a poll, and every wait
    -- then spun on the pool's threads)
    if not request.is_integer(conf.wait_ms) or conf.wait_ms < 1 or conf.wait_ms > 3600000 then
        error("tinyloop.server: wait_ms must be an integer in [1, 3600000], got " .. tostring(conf.wait_ms))
    end
    if type(conf.keepalive_s) ~= "number" or not (conf.keepalive_s > 0) then
        error("tinyloop.server: keepalive_s must be a number > 0, got " .. tostring(conf.keepalive_s))
    end
    if type(conf.publish_every) ~= "number" or not (conf.publish_every > 0) then
        error("tinyloop.server: publish_every must be a number > 0, got " .. tostring(conf.publish_every))
    end
    -- (bytes as C's int64: a larger number, math.huge too, became a negative one the engine refused)
    for _, name in ipairs({ "prefix_pool_mb", "grammar_cache_mb", "kv_budget_mb" }) do
        if type(conf[name]) ~= "number" or not (conf[name] >= 0 and conf[name] < 2 ^ 40) then
            error(("tinyloop.server: %s must be a number in [0, 2^40), got %s"):format(name, tostring(conf[name])))
        end
    end
    local step_rows = conf.step_rows
    if step_rows and (not request.is_integer(step_rows) or step_rows < -1 or step_rows > 2 ^ 30) then
        error("tinyloop.server: step_rows must be false (auto), -1 (auto) or an integer >= 0, got " .. tostring(step_rows))
    end
    metrics.init(conf.shared_dict) -- (the dict must be declared: checked here, in the master)
    if type(conf.embed_wait_s) ~= "number" or not (conf.embed_wait_s >= 0) then
        error("tinyloop.server: embed_wait_s must be a number >= 0, got " .. tostring(conf.embed_wait_s))
    end
    if conf.api_key ~= nil and (type(conf.api_key) ~= "string" or conf.api_key:find("[^\33-\126]")) then
        error("tinyloop.server: api_key must be printable ASCII without blanks")
    end
    -- The chat template is read here, once, in the master: a template the operator named
    -- must work (else nginx does not start); the model's own may use Jinja this renderer
    -- lacks, which costs only /v1/chat/completions (500 with the reason; logged per worker).
    chat_prompts, chat_error = require("tinyloop.chat").load(conf.model, conf.chat_template)
    if not chat_prompts and conf.chat_template then error("tinyloop.server: " .. chat_error) end
    local format = conf.reasoning_format
    if format ~= "auto" and format ~= reasoning.FORMAT and format ~= "none" then
        error(("tinyloop.server: reasoning_format must be \"auto\", \"%s\" or \"none\", got %s"):format(reasoning.FORMAT, tostring(format)))
    end
    reasoning_on = format == reasoning.FORMAT or (format == "auto" and chat_prompts ~= nil and reasoning.uses(chat_prompts.template_text))
end

-- This worker's engine counters into the shared dict, where /metrics of any worker reads them.
local counters = ffi_new("tl_engine_counters")
local function publish()
    if not engine then return end
    C.tl_engine_get_counters(engine, counters)
    local mem = model:memory()
    mem.grammar_cache_grammars, mem.grammar_cache_bytes, mem.grammar_cache_evictions = request.grammar_cache_stats()
    metrics.publish_engine(ngx.worker.id(), counters, mem)
end

-- nginx ends an exiting worker (a reload, SIGQUIT) as soon as no timer is left, and a request
-- parked in the thread pool holds none: every running generation was cut off, its socket left
-- open ("[alert] open socket #N left in connection"), and the gauges kept it. This loop's sleep
-- is such a timer (ngx.sleep's is not cancelable; ngx.timer's are): the worker goes once the
-- engine holds no session and no embedding or prompt scoring holds a place (embed_slots).
-- (Counted so, not per pool call: a request whose client left is ended in the pool without
-- its coroutine coming back, and a count of calls would never come down again. The short pool
-- calls of parsing, an encode or a grammar compile, are not waited for.) A request that
-- finished is waited for until its handler lets it go (release: finished_held), having read
-- its end: the engine counts a session gone as it finishes, and a handler still in the pool
-- for its last read lost it (a stream cut off, seen once in ~150 under 16 reloads).

local HOLD_POLL_S = 0.05
local function hold_exit(premature)
    if premature then return end
    while true do
        local exiting = ngx.worker.exiting()
        if exiting then
            local busy = embed_slots and embed_slots:count() < conf.embed_jobs
            if engine and not busy then
                C.tl_engine_get_counters(engine, counters)
                busy = counters.active + counters.queued + counters.finished_held > 0
            end
            if not busy then return end
        end
        ngx.sleep(exiting and HOLD_POLL_S or 1)
    end
end

-- The worker's threads (ids), from /proc (Linux); {} elsewhere.
local function thread_ids()
    local ids = {}
    local p = io.popen("ls /proc/" .. ngx.worker.pid() .. "/task 2>/dev/null")
    if p then
        for id in p:read("*a"):gmatch("%d+") do ids[id] = true end
        p:close()
    end
    return ids
end

local PRIO_PROCESS = 0
pcall(ffi.cdef, "int getpriority(int which, unsigned int who); int setpriority(int which, unsigned int who, int prio);")

-- Gives the threads started since `before` (the model's compute threads and the engine's)
-- conf.engine_nice more niceness than the event loop. Why: with as many compute threads as
-- cores, the event loop (and the thread-pool waiters) must take a core from them for every
-- /health or token event; a lower weight makes the kernel hand it over at once, while the
-- engine still gets every cycle nobody else wants. Raising niceness needs no privilege.
local function lower_engine_priority(before)
    if conf.engine_nice <= 0 then return end
    local ok, base = pcall(function() return ffi.C.getpriority(PRIO_PROCESS, 0) end)
    if not ok then return end
    local nice = math.min(19, base + conf.engine_nice)
    for id in pairs(thread_ids()) do
        if not before[id] and ffi.C.setpriority(PRIO_PROCESS, tonumber(id), nice) ~= 0 then
            ngx_log(ngx.WARN, "tinyloop: cannot renice engine thread ", id, ": ", ffi.errno())
        end
    end
end

-- init_worker(): loads the model and starts this worker's engine (after nginx forks, so the
-- engine's and the model's threads live in the worker).

-- When the checkpoint was made: its config.json's modification time (OpenAI's created, Ollama's
-- modified_at; each worker's start gave two values a server, new ones at each restart), or nil.
local function checkpoint_time()
    local quoted = "'" .. conf.model:gsub("'", "'\\''") .. "/config.json'"
    local p = io.popen("stat -c %Y " .. quoted .. " 2>/dev/null")
    if not p then return nil end
    local seconds = tonumber((p:read("*a") or ""):match("^%d+"))
    p:close()
    return seconds
end

local start_worker
-- (a failure the checks did not foresee: the answers say it, as a model that fails to load;
-- raised, it left the worker answering "the model is loading" for good)
function _M.init_worker()
    worker_initialised = true
    local ok, err = pcall(start_worker)
    if not ok then
        if engine then C.tl_engine_stop(engine) end -- (started before the failure: its threads stopped)
        engine = nil
        model_error = "the server cannot start: " .. raised_message(err)
        ngx_log(ngx.ERR, "tinyloop: ", model_error)
    end
end
function start_worker()
    metrics.init(conf.shared_dict)
    -- A chat request's rendering (its template, its tools' JSON, its ordered decoding) is Lua on
    -- the event loop: every 5 ms of it, a millisecond's sleep lets the loop serve the worker's
    -- other connections (a megabyte of tool schemas is over half a second of work, which held
    -- /health that long). The work so far: the monotonic clock now (tinyloop.policy's) less
    -- nginx's cached one (monotonic_time, CLOCK_MONOTONIC too), which the loop sets as it wakes
    -- (and ngx.update_time, as a request's timing starts).
    local clock_now = require("tinyloop.policy").now
    require("tinyloop.pause").install({ busy = function() return clock_now() - monotonic_time() end, slice = 0.005,
                                        give_back = function() pcall(ngx.sleep, 0.001) end })
    if not run_worker_thread then conf.thread_pool = false end
    local before = thread_ids()
    local m, err = tinyloop.load(conf.model, { threads = conf.threads, kv_type = conf.kv_type })
    if not m then
        model_error = "cannot load the model: " .. tostring(err)
        ngx_log(ngx.ERR, "tinyloop: ", model_error)
        return
    end
    if conf.prefix_pool_mb > 0 then m:set_prefix_pool(math.floor(conf.prefix_pool_mb * 1048576)) end
    request.set_grammar_cache_budget(conf.grammar_cache_mb * 1048576)
    local o = ffi_new("tl_engine_options")
    C.tl_engine_options_init(o)
    o.max_active, o.max_queued = conf.max_active, conf.max_queued
    o.step_rows = conf.step_rows or -1 -- (-1: the engine's own choice)
    o.kv_budget_bytes = math.floor(conf.kv_budget_mb * 1048576)
    local out = ffi_new("tl_engine *[1]")
    if C.tl_engine_new(m.ptr, o, out) ~= 0 then
        model_error = "cannot start the engine: " .. ffi_string(C.tl_last_error())
        ngx_log(ngx.ERR, "tinyloop: ", model_error)
        return
    end
    model, engine = m, out[0]
    local info = m:info()
    model_types = { weight_dtype = info.weight_dtype, kv_type = info.kv_type }
    lower_engine_priority(before)
    engine_addr = tonumber(ffi_cast("uintptr_t", engine))
    wait_addr = tonumber(ffi_cast("uintptr_t", C.tl_engine_wait)) -- see wait.lua
    model_addr = tonumber(ffi_cast("uintptr_t", m.ptr))
    score_addr = tonumber(ffi_cast("uintptr_t", C.tl_score_logprobs))
    embed_addr = tonumber(ffi_cast("uintptr_t", C.tl_embed_batch))
    embed_slots = require("ngx.semaphore").new(conf.embed_jobs)
    local tag = shapes.random_hex(4)
    worker_tag = ngx.worker.pid() .. (tag or "")
    responses_store = conf.responses_store and ngx.shared[conf.responses_store] or nil
    if responses_store and not tag then
        responses_store = nil
        ngx_log(ngx.ERR, "tinyloop: /dev/urandom cannot be read: responses are not stored (their ids would be guessable)")
    elseif conf.responses_store and not responses_store and conf.responses_store ~= "tinyloop_responses" then
        -- (the default's dict left out of an app's nginx.conf means "none": no warning)
        ngx_log(ngx.WARN, "tinyloop: lua_shared_dict ", conf.responses_store, " is not declared: responses are not stored")
    end
    last_error_addr = tonumber(ffi_cast("uintptr_t", C.tl_last_error))
    if conf.thread_pool then -- grammars from text compile there, not on the event loop
        local fns = {}
        for kind, fn in pairs({ gbnf = C.tl_grammar_compile_gbnf, regex = C.tl_grammar_compile_regex,
                                json_schema = C.tl_grammar_compile_json_schema, free = C.tl_compiled_grammar_free,
                                last_error = C.tl_last_error }) do
            fns[kind] = tonumber(ffi_cast("uintptr_t", fn))
        end
        -- and long prompts encode there (a short one costs less than the hop: inline)
        local encode_fns = { encode = tonumber(ffi_cast("uintptr_t", C.tl_encode_ex)), free = tonumber(ffi_cast("uintptr_t", C.tl_free)),
                             last_error = fns.last_error }
        request.set_encoder(function(m, text, opts)
            if #text < ENCODE_IN_POOL_BYTES then return m:encode(text, opts) end
            local flags = tinyloop.encode_flags(opts)
            local ok, bytes, err = run_worker_thread(conf.thread_pool, "tinyloop.server.wait", "encode", encode_fns, model_addr, text,
                                                     flags)
            if not ok then
                pool_unavailable(bytes, "encoding on the event loop")
                return m:encode(text, opts)
            end
            if not bytes then return nil, err end
            local n = #bytes / 4
            local arr = ffi_new("int32_t[?]", n) -- (a copy: a pointer into the string would not keep it alive)
            ffi.copy(arr, bytes, #bytes)
            local ids = {}
            for i = 1, n do ids[i] = arr[i - 1] end
            return ids
        end)
        -- and the tool choices' grammar text is built there (the schemas' GBNF)
        local tools_fns = { schema_gbnf = tonumber(ffi_cast("uintptr_t", C.tl_json_schema_to_gbnf)),
                            free = encode_fns.free, last_error = fns.last_error }
        request.set_tools_text(function(spec, after_open)
            -- (what the text reads of the spec, as plain data: the thread pool copies tables of
            -- strings, numbers and booleans only)
            local functions = {}
            for i, fn in ipairs(spec.functions) do
                functions[i] = { name = fn.name, parameters_json = fn.parameters_json, strict = fn.strict == true }
            end
            local plain = { choice = spec.choice, name = spec.name, parallel = spec.parallel == true, functions = functions }
            local ok, text, err = run_worker_thread(conf.thread_pool, "tinyloop.server.wait", "tools_text", tools_fns, plain,
                                                    after_open == true)
            if not ok then
                pool_unavailable(text, "building tool grammars on the event loop")
                return tools.grammar_text(spec, after_open)
            end
            return text, err
        end)
        request.set_text_compiler(function(kind, text, free_whitespace, loose)
            local ok, address, err = run_worker_thread(conf.thread_pool, "tinyloop.server.wait", "compile", fns, kind, text,
                                                       free_whitespace == true, loose == true)
            if not ok then
                pool_unavailable(address, "compiling on the event loop")
                return tinyloop.grammar.from_text(kind, text, free_whitespace, loose)
            end
            if not address then return nil, err end
            return tinyloop.grammar.adopt(address) -- (at once: see wait.compile)
        end)
    end
    created_at = checkpoint_time() or ngx.time()
    if chat_prompts then
        local warning
        chat_prompts.turn_ends, warning = chat_prompts:turn_end_ids(m)
        if warning then ngx_log(ngx.WARN, "tinyloop: ", warning) end
        request.set_end_ids(chat_prompts.turn_ends) -- (completions stop at them too, as vLLM's and llama.cpp's)
    else
        ngx_log(ngx.ERR, "tinyloop: /v1/chat/completions is off: ", chat_error)
    end
    publish()
    local ok, err = ngx.timer.every(conf.publish_every, publish)
    if not ok then ngx_log(ngx.ERR, "tinyloop: no metrics timer (other workers' /metrics miss this engine): ", err) end
    ok, err = ngx.timer.at(0, hold_exit)
    if not ok then ngx_log(ngx.ERR, "tinyloop: no exit timer (a reload will cut running generations off): ", err) end
end

-- exit_worker(): stops the engine (its sessions are freed) before the model goes. Stopped,
-- not freed: a thread-pool wait that a handler had queued may still arrive (the pool's
-- threads outlive this hook), and a stopped engine answers it -1 where a freed one would be
-- freed memory. The process ends right after; it takes the engine's few bytes with it.
function _M.exit_worker()
    if engine then
        local e = engine
        engine = nil
        C.tl_engine_stop(e)
        metrics.engine_stopped(ngx.worker.id())
    end
end

-- ------------------------------------------------------------------ answers

-- Every JSON answer, and every streamed event (sse), is written as valid UTF-8: a byte
-- sequence cut short, or a stray byte, becomes U+FFFD (request.valid_utf8). JSON text is
-- UTF-8 and clients refuse others, but a request's strings need not be (they are taken as
-- bytes), and an answer may quote them: a field name in an error, a stop string as the
-- stop_reason, a Responses request's instructions and metadata.
local function send_json(status, body, headers)
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    for k, v in pairs(headers or {}) do ngx.header[k] = v end
    ngx_say(valid_utf8(type(body) == "string" and body or encode(body)))
    return ngx_exit(status)
end

-- The one error shape: {"error": {"message", "type", "param", "code"}} (param: the field, code:
-- OpenAI's machine-readable code, each null where there is none, as OpenAI sends them).
-- (OpenAI's names for the types the other APIs have their own for: a full server is its
-- "server_error", as its "That model is currently overloaded" is; an unknown path an
-- "invalid_request_error", code "unknown_url". llama.cpp's and Anthropic's keep theirs.)
local OPENAI_TYPES = { overloaded_error = "server_error", not_found_error = "invalid_request_error" }
local function send_error(status, message, param, etype, headers, code)
    etype = OPENAI_TYPES[etype] or etype
    return send_json(status, '{"error":{"message":' .. encode(tostring(message)) .. ',"type":' ..
        encode(etype or (status >= 500 and "server_error" or "invalid_request_error")) ..
        ',"param":' .. (param and encode(param) or "null") .. ',"code":' .. (code and encode(code) or "null") .. "}}", headers)
end
_M.send_error = send_error
-- A request parser's error ({status, message, param, type, code, ...}) sent by `send`
-- (send_error, or a handler's own that shapes it for another API, which may read the whole
-- error, its last argument).
local function send_request_error(err, send)
    return (send or send_error)(err.status, err.message, err.param, err.type, nil, err.code, err)
end

-- An error in Anthropic's shape ({"type": "error", "error": {"type", "message"}}), in Ollama's
-- ({"error": "message"}), or in the shape of the API the request's URI is (its clients read
-- only their own).
-- Anthropic's request-id header, on each answer of its endpoints, its errors' too, those
-- before the handler (a 401, nginx's 413) as well (its SDKs show it as a response's and an
-- error's request id, which users quote).
local anthropic_requests = 0
local function anthropic_request_id() -- -> the id
    local id = ngx.header["request-id"]
    if id then return id end
    anthropic_requests = anthropic_requests + 1
    id = "req_" .. worker_tag .. "_" .. anthropic_requests
    ngx.header["request-id"] = id
    return id
end
local function send_anthropic_error(status, message, _, _, headers)
    local id = anthropic_request_id()
    return send_json(status, anthropic.error_body(status, tostring(message), nil, id), headers)
end
local function send_ollama_error(status, message, _, _, headers)
    return send_json(status, ollama.error_body(tostring(message)), headers)
end
-- (the path the client asked for: nginx's error_page redirect rewrites $uri; Ollama's are its
-- exact paths, so that another app's /api/... keeps OpenAI's shape: those served here and
-- those of Ollama's API not served, which its clients call and whose 404 they read)
local OLLAMA_PATHS = { ["/api/chat"] = true, ["/api/generate"] = true, ["/api/show"] = true, ["/api/tags"] = true,
                       ["/api/ps"] = true, ["/api/version"] = true, ["/api/embed"] = true, ["/api/embeddings"] = true,
                       ["/api/pull"] = true, ["/api/push"] = true, ["/api/create"] = true, ["/api/copy"] = true,
                       ["/api/delete"] = true, ["/api/me"] = true, ["/api/signin"] = true, ["/api/signout"] = true }
local function ollama_path(path)
    return OLLAMA_PATHS[path:match("/api/[^/]+$") or ""] or path:find("/api/blobs/", 1, true) ~= nil
end
local function send_llamacpp_error(status, message, _, etype, headers)
    return send_json(status, llamacpp.error_body(status, tostring(message), etype), headers)
end
local LLAMACPP_PATHS = { ["/completion"] = true, ["/completions"] = true, ["/props"] = true, ["/embedding"] = true,
                         ["/embeddings"] = true, ["/apply-template"] = true }
-- (names OpenAI's paths end in too: llama.cpp's only where they are the whole path)
local OPENAI_TOO = { ["/completions"] = true, ["/embeddings"] = true }
-- The API a path is, read from its end (an app may mount the handlers under a prefix of its
-- own: /llm/api/chat is Ollama's): Anthropic's /v1/messages..., Ollama's /api/NAME, llama.cpp's
-- /NAME (/completions and /embeddings at the root only: /v1/chat/completions is OpenAI's).
local function send_uri_error(...)
    -- (nginx's normalised path: /api/%63hat and /api/./chat are /api/chat; nginx's own error
    -- pages, served at /.tinyloop-error*, read the path the client sent)
    local path = ngx.var.uri or ""
    if path == "" or path:find("^/%.tinyloop%-error") then path = (ngx.var.request_uri or ""):match("^[^?]*") end
    local before, last = path:match("^(.-)(/[^/]*)$")
    local llamacpp = last and LLAMACPP_PATHS[last] and (before == "" or not OPENAI_TOO[last] and not before:find("/v1", 1, true))
    local send = (path:find("/v1/messages$") or path:find("/v1/messages/", 1, true)) and send_anthropic_error or
                 ollama_path(path) and send_ollama_error or llamacpp and send_llamacpp_error or send_error
    return send(...)
end

local key_checked -- (below: the API key, where no guard asked for it)
local function ready()
    if engine then return key_checked() end
    if not worker_initialised then
        -- (init_worker never ran in this Lua VM: with lua_code_cache off nginx runs each
        -- request in a fresh one, init_by_lua again but not init_worker; the 503 "loading"
        -- said to retry for ever)
        return send_uri_error(500, "the server is not configured in this request's Lua VM: TinyLoop's server needs " ..
                              "init_worker_by_lua_block { require(\"tinyloop.server\").init_worker() } and " ..
                              "lua_code_cache on (off, each request runs in a fresh Lua VM, without the model " ..
                              "init_worker loaded)", nil, "server_error")
    end
    if conf.model == nil then -- (no configure{} in init_by_lua: a 503 "model directory must be a string" for ever)
        return send_uri_error(500, "the server is not configured: call require(\"tinyloop.server\").configure{ model = DIR } " ..
                              "in init_by_lua_block", nil, "server_error")
    end
    send_uri_error(503, model_error or "the model is loading", nil, "server_error", { ["Retry-After"] = "1" })
end

local function only_get()
    local method = ngx.req.get_method()
    if method == "GET" or method == "HEAD" then return true end
    send_uri_error(405, "method " .. method .. " is not allowed here: use GET", nil, nil, { Allow = "GET, HEAD" })
end

function _M.health()
    if not only_get() then return end
    if not engine then return ready() end
    return send_json(200, '{"status":"ok","model":' .. encode(conf.model_id) .. "}") -- (in one order: not a table's)
end

-- The served model in OpenAI's model shape, with vLLM's max_model_len (the context) and a
-- tinyloop object (chat_template: which template /v1/chat/completions applies, by file name,
-- or null when none could be loaded; tool_call_format: how its tool calls are written and
-- read, tinyloop.tools'; reasoning_format: tinyloop.reasoning's, or null where it is off).
local function model_json()
    return '{"id":' .. encode(conf.model_id) .. ',"object":"model","created":' .. created_at ..
        ',"owned_by":"tinyloop","max_model_len":' .. model.max_seq_len .. ',"tinyloop":' ..
        encode_sorted({ vocab_size = model.vocab_size, max_seq_len = model.max_seq_len, default_loops = model.default_loops,
                 max_loops = model.max_loops, has_tokenizer = model.has_tokenizer,
                 weight_dtype = model_types.weight_dtype, kv_type = model_types.kv_type,
                 chat_template = chat_prompts and chat_prompts.source:match("[^/]+$") or cjson.null,
                 tool_call_format = chat_prompts and tools.FORMAT or cjson.null,
                 reasoning_format = reasoning_on and reasoning.FORMAT or cjson.null }) .. "}"
end

function _M.models()
    if not only_get() or not ready() then return end
    return send_json(200, '{"object":"list","data":[' .. model_json() .. "]}")
end

-- GET /v1/models/{id} (the OpenAI SDKs' models.retrieve): the model, or 404 naming it.
function _M.model()
    if not only_get() or not ready() then return end
    -- (the path decoded by nginx: %252D was decoded twice, to "-"; read from its end, the
    -- served id may hold "/" of its own, "org/name", and a handler under a prefix had it cut
    -- at the wrong place)
    local uri, served = ngx.var.uri, "/models/" .. conf.model_id
    if uri:sub(-#served) ~= served then
        local id = uri:match("/models/(.*)$") or ""
        -- (OpenAI's answer: an invalid request whose code is model_not_found, as the other
        -- routes answer a model not served)
        return send_error(404, ("no model '%s' here (this server runs '%s')"):format(id, conf.model_id), "model",
                          "invalid_request_error", nil, "model_not_found")
    end
    return send_json(200, model_json())
end

function _M.metrics()
    if not only_get() then return end
    publish() -- this worker's figures are then exact; the others' at most publish_every old
    ngx.header["Content-Type"] = "text/plain; version=0.0.4"
    ngx_print(metrics.render(responses_store))
end

function _M.not_found()
    ngx.ctx.tinyloop_no_route = true -- (counted as "other", not as the endpoint its path ends in)
    return send_uri_error(404, "no route for " .. ngx.req.get_method() .. " " .. ngx.var.uri ..
        " (POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET or DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/messages, POST /v1/messages/count_tokens, POST /api/chat, POST /api/generate, POST /api/show, GET /api/tags, GET /api/ps, GET /api/version, POST /v1/embeddings, POST /api/embed, POST /api/embeddings, POST /v1/rerank (or /rerank, /v2/rerank, /reranking, /v1/reranking), POST /v1/score (or /score), POST /completion (or /completions), POST /embedding (or /embeddings), POST /apply-template, GET /props, GET /v1/models (or /models), GET /v1/models/{id}, POST /chat/completions (llama.cpp's name of /v1/chat/completions), POST /tokenize, POST /detokenize, /health (or /v1/health), GET /, " ..
        "/metrics)", nil, "not_found_error", nil, "unknown_url")
end

-- CORS (conf.cors_origins): the origin of a browser's request, when it is one allowed to call
-- the API (nil: none, or not allowed), and that header's value ("*" allows any).
local function cors_origin()
    local allowed = conf.cors_allowed
    local origin = allowed and ngx.var.http_origin
    if not origin then return nil end
    if allowed["*"] then return "*" end
    return allowed[origin] and origin or nil
end

-- A browser's preflight (OPTIONS with Access-Control-Request-Method) from an allowed origin:
-- answered 204 with what it may send, before the API key is asked for (browsers send none in
-- a preflight). Other requests get their Access-Control-Allow-Origin in cors_headers.
local function preflight()
    if ngx.req.get_method() ~= "OPTIONS" or not ngx.var.http_access_control_request_method then return end
    local origin = cors_origin()
    if not origin then return end
    ngx.status = 204
    -- (here too, not only in cors_headers: an nginx.conf with the guard but not that filter
    -- answered a preflight the browser refused)
    ngx.header["Access-Control-Allow-Origin"] = origin
    ngx.header["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
    ngx.header["Access-Control-Allow-Headers"] = ngx.var.http_access_control_request_headers or
        "Authorization, Content-Type, x-api-key, anthropic-version"
    ngx.header["Access-Control-Max-Age"] = "86400"
    ngx.header["Vary"] = "Origin, Access-Control-Request-Headers" -- (it echoes them)
    return ngx_exit(204)
end

-- header_filter_by_lua: every answer to an allowed origin says so (errors and streams too: a
-- page can read why it was refused).
function _M.cors_headers()
    local allowed = conf.cors_allowed
    if not allowed then return end
    -- (where origins are listed, every answer depends on the request's Origin, an allowed one's
    -- or not: a cache in front keys on it, Fetch's rule; only allowed ones had it)
    if not allowed["*"] then
        local vary = ngx.header["Vary"]
        if type(vary) == "table" then vary = table.concat(vary, ", ") end
        if not vary then
            ngx.header["Vary"] = "Origin"
        elseif not vary:lower():find("origin", 1, true) then
            ngx.header["Vary"] = vary .. ", Origin" -- (an app's own Vary kept, Origin added)
        end
    end
    local origin = cors_origin()
    if origin then ngx.header["Access-Control-Allow-Origin"] = origin end
end

-- A web page's request from an origin conf.cors_origins does not list: refused, 403. A browser
-- sends the page's Origin with every POST and every cross-origin call, and a page of any site
-- the user opens may send a POST here without asking (text/plain needs no preflight): it would
-- spend this server's compute unseen; and a DNS-rebinding page, whose requests are same-origin
-- to its browser, could read the answers too. Programs (curl, the SDKs) send no Origin. Pages
-- of this server's own origin are listed like any other (it serves none itself).
local function refuse_unlisted_origin()
    local origin = ngx.var.http_origin
    if not origin or cors_origin() or ngx.var.uri:find("^/%.tinyloop%-error") then return end
    if #origin > 200 then origin = origin:sub(1, 200) .. "..." end
    return send_uri_error(403, ("a web page of origin %s may not call this server: list the origin in --cors-origin (cors_origins)")
        :format(origin), nil, "permission_error")
end

-- A request that came in on a loopback address naming another host: refused, 403. A
-- DNS-rebinding page (a name of its author's, made to resolve to 127.0.0.1 once the page has
-- loaded) is same-origin to its browser: its POSTs carry an Origin (refused above), but its
-- GETs carry none, and read /props (the model's path, the chat template), /metrics and the
-- model lists. Ollama's rule: there, the Host is localhost (or a name under .localhost, .local
-- or .internal: Docker Desktop's host.docker.internal reaches the host's loopback), an IP
-- address, this machine's name, or one conf.allowed_hosts lists (a local proxy's upstream
-- name); a request without a Host (HTTP/1.0) is a program's. Addresses other than loopback
-- are not asked: a page cannot make a browser send a request there under another name
-- without DNS naming that address, which is the network's own.
local function refuse_foreign_host()
    local addr = ngx.var.server_addr
    if not addr or not (addr:find("^127%.") or addr == "::1" or addr:find("^::ffff:127%.")) then return end
    -- An absolute-form target (GET http://NAME/path) names the host itself, its Host header
    -- ignored or absent (RFC 9112 §3.2.2): nginx's $host is the target's then (the guard read the
    -- header, letting GET http://evil.example/... with Host: localhost through, and refusing the reverse).
    local host = (ngx.var.request or ""):find("^%S+%s+%a[%w+.%-]*://") and ngx.var.host or ngx.var.http_host
    if not host or host == "" or ngx.var.uri:find("^/%.tinyloop%-error") then return end
    local lowered = host:lower()
    local name = (lowered:match("^%[[^%]]*%]") or lowered:match("^[^:]*")):gsub("%.$", "")
    if name == "localhost" or name:find("%.localhost$") or name:find("%.local$") or name:find("%.internal$") or
        name:find("^%d+%.%d+%.%d+%.%d+$") or
        name:find("^%[[%x:.]+%]$") or conf.hosts_allowed[name] then
        return
    end
    if #host > 200 then host = host:sub(1, 200) .. "..." end
    return send_uri_error(403, ("a request for host %s on this server's loopback address: refused, as a DNS-rebinding " ..
                                "page's would be (list the name in --allowed-hosts, allowed_hosts)"):format(host), nil,
                          "permission_error")
end

-- server_rewrite_by_lua: the Host of a request on a loopback address, a browser's preflight, a
-- page of an unlisted origin, then the API key (authorize).
function _M.guard()
    refuse_foreign_host()
    preflight()
    refuse_unlisted_origin()
    return _M.authorize()
end

-- server_rewrite_by_lua (guard): with conf.api_key, a request to anything but /health, /v1/health and /metrics (a load
-- balancer's and Prometheus' probes) carries it, as Authorization: Bearer KEY (OpenAI's
-- clients) or x-api-key: KEY (Anthropic's); else 401, in the shape of the API the URI is.
-- probes_free: the probes' paths need no key (the guard's rule; a handler that is no probe,
-- key_checked, asks for it whatever its path ends in). -> true: the request may go on.
local function check_key(probes_free)
    local key = conf.api_key
    local uri = ngx.var.uri
    -- (nginx's own errors: the internal locations its error_page goes to, /.tinyloop-error*.
    -- The probes' own paths only: a suffix match, for an app's /llm/health, let any of the app's
    -- paths through the guard with /health after it, /private/secret.txt/health)
    if not key or (probes_free and (uri == "/health" or uri == "/v1/health" or uri == "/metrics" or
                                    uri:find("^/%.tinyloop%-error"))) then
        return true
    end
    -- (every byte compared: the time says nothing of where a wrong key differs)
    local function matches(given)
        if type(given) ~= "string" or #given ~= #key then return false end
        local differ = 0
        for i = 1, #key do differ = bit.bor(differ, bit.bxor(given:byte(i), key:byte(i))) end
        return differ == 0
    end
    local authorization = ngx.var.http_authorization
    local bearer = authorization and authorization:lower():find("^bearer%s") and authorization:match("^%S+%s+(%S+)%s*$")
    local api_key = ngx.var.http_x_api_key
    if matches(bearer) or matches(api_key) then
        ngx.ctx.tinyloop_authorized = true -- (the handlers' key_checked: the guard ran)
        return true
    end
    local given = bearer or api_key
    return send_uri_error(401, given and "the API key is not this server's" or
                "this server needs an API key: Authorization: Bearer KEY (or x-api-key: KEY)", nil, "authentication_error",
                { ["WWW-Authenticate"] = 'Bearer realm="tinyloop"' })
end
function _M.authorize() return check_key(true) end

-- A handler reached without authorize (guard) having passed, where conf.api_key is set: an
-- nginx.conf that mounts the handlers and forgot the guard served every client (not a word
-- said). The handler asks for the key itself (after the body is read: the guard's place is
-- before), and the log says so once a worker. -> true: it may go on (else 401 is answered).
local unguarded_warned
function key_checked()
    if not conf.api_key or ngx.ctx.tinyloop_authorized then return true end
    if not unguarded_warned then
        unguarded_warned = true
        ngx_log(ngx.WARN, "tinyloop: api_key is set but a request reached ", ngx.var.uri, " without its key checked by guard() ",
                "or authorize() (server_rewrite_by_lua_block): the handler checked it, after reading the body")
    end
    return check_key(false)
end

-- (nginx's own 413, client_max_body_size's: in the shape of the API the URI is; a body its
-- Content-Length declares within max_body met a client_max_body_size set lower, whose value
-- Lua cannot read: max_body's figure would be false there)
function _M.too_large()
    local declared = tonumber(ngx.var.http_content_length)
    if declared and declared <= conf.max_body then
        return send_uri_error(413, ("the request body (%d bytes) is over this server's limit (nginx's " ..
                                    "client_max_body_size)"):format(declared), nil)
    end
    return send_uri_error(413, ("the request body is over the %d-byte limit"):format(conf.max_body), nil)
end

-- nginx's own errors (error_page ... @nginx_error, the status kept): the JSON error shape
-- instead of nginx's HTML page, which OpenAI clients cannot parse.
local NGINX_ERRORS = {
    [400] = "bad request (malformed HTTP)", [404] = "not found", [405] = "method not allowed", [408] = "the request timed out",
    [411] = "a body needs its length (Content-Length) or chunked framing", [414] = "the request URI is too long",
    [494] = "the request headers are too large", [500] = "internal server error",
    [501] = "not implemented (a transfer encoding other than chunked)", [502] = "bad gateway", [504] = "gateway timeout",
    [505] = "HTTP version not supported (HTTP/1.x here)",
}
-- (which: the error, where the status cannot say: nginx answers its 494 as a 400)
function _M.nginx_error(which)
    local status = ngx.status
    return send_uri_error(status, NGINX_ERRORS[which or status] or ("HTTP error " .. status), nil)
end

-- nginx's own 405 (error_page 405 /.tinyloop-error-405): a TRACE, refused before any location
-- ran, which nginx answered without the Allow header RFC 9110 requires. The path's own handler
-- answers it instead, as it answers every other method it does not take (its 405 names what it
-- allows; a path with no handler, its 404). For a server whose locations are all TinyLoop's
-- (scripts/serve's): an app's location of its own would answer the TRACE as it answers a GET.
function _M.method_not_allowed()
    local path = (ngx.var.request_uri or ""):match("^[^?]*")
    -- (nginx made the error page's request a GET: the handler is given back the TRACE; the
    -- error pages themselves are internal, any client's method their 404)
    if not (ngx.var.request or ""):find("^TRACE ") or path:sub(1, 1) ~= "/" then return _M.nginx_error() end
    if path:find("^/%.tinyloop%-error") then ngx.status = 404; return _M.nginx_error() end
    ngx.req.set_method(ngx.HTTP_TRACE)
    ngx.status = 200 -- (the handler sets its own)
    -- (slashes merged, as nginx's routing merged them; a path ngx.exec refuses, such as an
    -- encoded "..", keeps nginx's 405: it raised, a 500)
    local ok = pcall(ngx.exec, (path:gsub("//+", "/")))
    if not ok then
        ngx.req.set_method(ngx.HTTP_GET)
        ngx.status = 405
        return _M.nginx_error()
    end
end

-- log_by_lua: every request, including nginx's own errors, counted by endpoint and status.
function _M.log()
    -- (nginx's own errors go to /.tinyloop-error*: counted under the path the client asked for,
    -- they were "other", a 501 or a malformed body of /v1/completions; else nginx's normalised
    -- uri, //v1/completions as /v1/completions)
    local uri = ngx.var.uri or "" -- (none where the request line never came whole: a reset)
    if uri:find("^/%.tinyloop%-error") then uri = (ngx.var.request_uri or ""):match("^[^?]*") end
    -- A client that leaves while its body is read is nginx's 400 ("client prematurely closed
    -- connection"), which no answer reached: counted as the 499 it is, not as the client's
    -- malformed request (a 400 that was answered completes the request).
    local status = ngx.status
    if status == 400 and ngx.var.request_completion ~= "OK" then status = 499 end
    metrics.log_request(uri, status, ngx.ctx.tinyloop_no_route)
end

-- ------------------------------------------------------------------ a request's life

local QUEUED, FINISHED = tonumber(C.TL_ENGINE_QUEUED), tonumber(C.TL_ENGINE_FINISHED)
local STOP_MAX_TOKENS, STOP_SEQUENCE = tonumber(C.TL_STOP_MAX_TOKENS), tonumber(C.TL_STOP_SEQUENCE)
local update = ffi_new("tl_engine_update")
local id_out = ffi_new("uint64_t[1]")
local request_options = ffi_new("tl_engine_request_options")
local token_bytes, token_len = ffi_new("const char *[1]"), ffi_new("size_t[1]")

-- Each token's text (its bytes as valid UTF-8: a token may hold part of a character) and raw
-- bytes, and their JSON (text_json: a JSON string; bytes_json: an array of numbers), made once
-- per worker: a blocking answer of n choices with top_logprobs 20 wrote ~40,000 entries, each
-- an FFI call, a copy, a UTF-8 check and two encodes, 0.1-0.3 s on the event loop.
local token_texts, token_raws, token_jsons, token_bytes_jsons = {}, {}, {}, {}
local function token_text_of(id)
    local text = token_texts[id]
    if not text then
        local raw = ""
        if C.tl_token_text(model.ptr, id, token_bytes, token_len) == 0 then raw = ffi_string(token_bytes[0], token_len[0]) end
        text = request.valid_utf8(raw)
        token_texts[id], token_raws[id] = text, raw
    end
    return text, token_raws[id]
end
local function token_json_of(id)
    local json = token_jsons[id]
    if not json then
        json = encode((token_text_of(id)))
        token_jsons[id] = json
    end
    return json
end
local function token_bytes_json_of(id)
    local json = token_bytes_jsons[id]
    if not json then
        local _, raw = token_text_of(id)
        json = "[" .. concat({ raw:byte(1, -1) }, ",") .. "]"
        token_bytes_jsons[id] = json
    end
    return json
end

-- A token's text for logprobs (token_text_of's), and its length in the choice's text: an
-- echoed prompt's is shown there (in_prompt), a generated one as the engine shows it under
-- the choice's text_config (tl_token_in_text; nil: the defaults, where a special token is not
-- shown), and its raw bytes.
local function token_string(id, in_prompt, text_config)
    local text, raw = token_text_of(id)
    if raw == "" then return text, 0, raw end
    return text, (in_prompt or C.tl_token_in_text(model.ptr, text_config, id) ~= 0) and #raw or 0, raw
end

-- The config fields that decide which special tokens a choice's text shows (skip_special_tokens
-- false keeps those that do not end generation), or nil for the defaults. (A one-token stop
-- sequence, which ends generation, is left out: it is the last token, and its length moves
-- no later offset.)
local function text_config_of(cfg)
    if not cfg.keep_special_text then return nil end
    local c = ffi_new("tl_generate_config")
    C.tl_generate_config_init(c)
    c.keep_special_text, c.ignore_eos = 1, cfg.ignore_eos and 1 or 0
    return c
end

-- A log-probability for JSON: -inf (a token the model rules out) has no JSON number: null.
local function json_logprob(x)
    return (x > -math.huge and x == x) and x or cjson.null
end

-- A top_logprobs member "text": logprob of token `id` into members, unless a likelier token of
-- the same text is there (seen: the texts so far). (Not a closure a token: once per file.)
local function add_alternative(seen, members, id, logprob)
    local key = token_text_of(id)
    if seen[key] then return end
    seen[key] = true
    members[#members + 1] = encode(key) .. ":" .. encode(json_logprob(logprob))
end

-- OpenAI's logprobs object of a choice (or chunk) for the tokens `ids` and their `figures`
-- (next_output's; a prompt's first token has none: null, as in OpenAI's echo), text_offset
-- in bytes of the choice's text from st.offset on (advanced here). The first n_prompt tokens
-- are an echoed prompt's.
local function logprobs_json(st, ids, figures, n_prompt)
    local tokens, token_logprobs, tops, offsets = {}, {}, {}, {}
    for i = 1, #ids do
        local text, shown = token_string(ids[i], i <= (n_prompt or 0), st.text_config)
        local figure = figures[i]
        tokens[i], offsets[i] = text, st.offset
        token_logprobs[i] = figure.logprob and json_logprob(figure.logprob) or cjson.null
        st.offset = st.offset + shown
        if figure.top then
            -- written in rank order, the likeliest first, as vLLM's (a Lua table's keys went in
            -- its hash order: another worker wrote another order)
            local seen, members = {}, {}
            for _, alt in ipairs(figure.top) do add_alternative(seen, members, alt.id, alt.logprob) end
            -- the token itself too, where the alternatives leave it out: OpenAI's rule ("up to
            -- logprobs + 1 elements"), vLLM's; it was missing (logprobs 0 gave {})
            if figure.logprob then add_alternative(seen, members, ids[i], figure.logprob) end
            tops[i] = "{" .. concat(members, ",") .. "}"
        else
            tops[i] = "null"
        end
    end
    -- cjson writes an empty table as {}: the arrays of an empty chunk must be []
    local function array(t) return #t == 0 and "[]" or encode(t) end
    return '{"tokens":' .. array(tokens) .. ',"token_logprobs":' .. array(token_logprobs) .. ',"top_logprobs":[' ..
        concat(tops, ",") .. '],"text_offset":' .. array(offsets) .. "}"
end

-- The chat API's logprobs object: {"content": [{"token", "logprob", "bytes", "top_logprobs":
-- [{"token", "logprob", "bytes"}, ...]}, ...]}, one entry per token of `ids` (bytes: the
-- token's raw bytes, which a token cutting a character needs to be put back together). With
-- `with_ids`, each entry and alternative also has its token's "id" first (what a view whose
-- API names tokens by id reads: llama.cpp's completion_probabilities).
local function token_entry(id, logprob, with_ids)
    return (with_ids and ('{"id":' .. id .. ',"token":') or '{"token":') .. token_json_of(id) .. ',"logprob":' ..
        encode(json_logprob(logprob)) .. ',"bytes":' .. token_bytes_json_of(id)
end
local function chat_logprobs_json(ids, figures, with_ids)
    local entries = {}
    for i = 1, #ids do
        local alternatives = {}
        for j, alt in ipairs(figures[i].top or {}) do alternatives[j] = token_entry(alt.id, alt.logprob, with_ids) .. "}" end
        entries[i] = token_entry(ids[i], figures[i].logprob, with_ids) .. ',"top_logprobs":[' .. concat(alternatives, ",") .. "]}"
    end
    -- (OpenAI's object has its refusal's entries beside the content's: null, as OpenAI
    -- sends it; a view that reads tokens by id, llama.cpp's, has content's only)
    return '{"content":[' .. concat(entries, ",") .. "]" .. (with_ids and "}" or ',"refusal":null}')
end

-- Done with the engine request: exactly once per request, whether it finished, failed or
-- its client left. A running generation stops before its next step.
local drained = ffi_new("tl_engine_update") -- (release's: `update` may be a caller's still)
local function release(st, cancelled)
    if st.released then return end
    st.released = true
    local unfinished = st.phase ~= "finished"
    -- What it generated that nobody read (a blocking request reads its choices in turn: a later
    -- choice's tokens all sat in the engine), read before the cancel drops them.
    if unfinished and C.tl_engine_read(engine, st.id, drained) == 0 then
        st.n_tokens = st.n_tokens + drained.n_tokens
        -- (and what the pool gave its prompt as it started: another request's prefill of it, which
        -- it waited for, may have given more than it held at its creation)
        st.cached = math.max(st.cached, tonumber(drained.stats.prompt_tokens_reused))
    end
    C.tl_engine_cancel(engine, st.id)
    if st.phase == "queued" then metrics.gauge("queued", -1) elseif st.phase == "running" then metrics.gauge("active", -1) end
    -- (a choice that did not finish: the tokens it had generated and its prompt's share served
    -- from the prefix pool, counted nowhere else; a failed one's were counted as it failed,
    -- next_output)
    if unfinished then
        if cancelled then metrics.incr("cancelled") end
        if st.n_tokens > 0 then metrics.incr("tokens_out", st.n_tokens) end
        if st.cached > 0 then metrics.incr("tokens_cached", st.cached) end
    end
    st.phase = "released"
end

-- Blocks the request's coroutine (never the worker) until the engine has output.
-- -> 1 (output), -1 (gone).
local function wait(st)
    if conf.thread_pool then
        local ok, r = run_worker_thread(conf.thread_pool, "tinyloop.server.wait", "wait", wait_addr, engine_addr, st.id, conf.wait_ms)
        if ok then return r end
        pool_unavailable(r, "polling")
    end
    local delay, waited = 0.001, 0
    while true do
        local r = tonumber(C.tl_engine_wait(engine, st.id, 0))
        if r ~= 0 then return r end
        -- (after wait_ms, 0, as the pool's wait: the caller may have a sign of life to send)
        if waited >= conf.wait_ms / 1000 then return 0 end
        ngx.sleep(delay)
        waited = waited + delay
        delay = delay < 0.02 and delay * 2 or delay
    end
end

local function started_running(st)
    st.phase = "running"
    metrics.gauge("queued", -1)
    metrics.gauge("active", 1)
end

-- The next output of the request: text, token ids (a table), finished (boolean); or nil, err
-- (err "gone" when it was cancelled meanwhile), status (the engine's, where it failed).
-- on_idle(), when given, runs after each wait that found nothing (a stream's sign of life);
-- false from it: the client has gone.
local function next_output(st, ready, on_idle)
    while not ready do -- (ready: a poll found output already; no trip through the pool)
        local r = wait(st)
        if st.released or r < 0 then return nil, "gone" end
        if r > 0 then break end
        if on_idle and not on_idle() then return nil, "gone" end
    end
    if st.released then return nil, "gone" end
    C.tl_engine_read(engine, st.id, update)
    local u = update
    if st.phase == "queued" and u.state ~= QUEUED then started_running(st) end
    -- The request's other choices are read after this one: a poll (which reads nothing)
    -- tells which of them have run a step, so that the gauges count them as running now.
    for _, other in ipairs(st.siblings) do
        if other.phase == "queued" and not other.released and tonumber(C.tl_engine_wait(engine, other.id, 0)) == 1 then
            started_running(other)
        end
    end
    local n = u.n_tokens
    local ids = {}
    for i = 0, n - 1 do ids[i + 1] = u.tokens[i] end
    local figures -- the tokens' log-probabilities, when the request asked ({} for none this time)
    if st.logprobs then
        figures = {}
        local n_top = u.n_top
        for i = 0, n - 1 do
            figures[i + 1] = { logprob = u.logprobs[i], top = alternatives_of(u.top_ids, u.top_logprobs, i * n_top, n_top) }
        end
    end
    local text = ffi_string(u.text, u.text_len)
    if n > 0 then
        -- Latencies as the client sees them, from the first choice (read as it generates); a
        -- later choice's tokens may wait in the engine until its turn (a blocking answer reads
        -- the choices in order), so its per-token time comes from its stats below, and the
        -- request's first token is the first choice's.
        -- Each read's gap is spread over its tokens; the tokens that came with the first
        -- (a speculative run, a chunk) share the next read's, so that the observations are the
        -- tokens after the first and their sum the time from the first to the last: the mean is
        -- (last - first) / (tokens - 1), the usual time per output token.
        if st.index == 0 then
            local t = now()
            if not st.last_token_at then
                metrics.observe("ttft", t - arrival_time())
                st.gapless = n - 1
            else
                local shared = n + st.gapless
                metrics.observe("tpot", (t - st.last_token_at) / shared, shared)
                st.gapless = 0
            end
            st.last_token_at = t
        end
        st.n_tokens = st.n_tokens + n
    end
    if u.state ~= FINISHED then return text, ids, false, figures end
    st.phase = "finished"
    metrics.gauge("active", -1)
    if u.status ~= 0 then
        if st.n_tokens > 0 then metrics.incr("tokens_out", st.n_tokens) end -- (what it generated before it failed)
        return nil, "generation failed: " .. ffi_string(u.error), tonumber(u.status)
    end
    local s = u.stats
    if st.index == 0 and (st.gapless or 0) > 0 then -- (every token in the first read: no time after it)
        metrics.observe("tpot", 0, st.gapless)
        st.gapless = 0
    end
    if st.index > 0 and s.tokens_emitted > 1 then
        metrics.observe("tpot", s.decode_ms / 1000 / (s.tokens_emitted - 1), s.tokens_emitted - 1)
    end
    metrics.incr("completed")
    metrics.incr("tokens_out", s.tokens_emitted)
    metrics.incr("loops_sum", s.loops_used * s.tokens_emitted)
    metrics.incr("loops_count", s.tokens_emitted)
    if s.drafted > 0 then
        metrics.incr("drafted", s.drafted)
        metrics.incr("accepted", s.accepted)
    end
    local reason = tonumber(s.stop_reason)
    st.finish_reason = reason == STOP_MAX_TOKENS and "length" or "stop"
    st.stopped_by_sequence = reason == STOP_SEQUENCE
    st.usage = { prompt_tokens = st.prompt_tokens, completion_tokens = s.tokens_emitted,
                 total_tokens = st.prompt_tokens + s.tokens_emitted }
    st.cached_tokens = s.prompt_tokens_reused -- of its prompt, from the prefix pool
    if s.prompt_tokens_reused > 0 then metrics.incr("tokens_cached", s.prompt_tokens_reused) end
    st.tinyloop = {
        stop_reason = ffi_string(C.tl_stop_reason_name(reason)), loops_used = s.loops_used,
        prefill_ms = s.prefill_ms, first_token_ms = s.first_token_ms, decode_ms = s.decode_ms,
        drafted = s.drafted, accepted = s.accepted, acceptance_rate = s.acceptance_rate,
        mean_accepted = s.mean_accepted, verify_steps = s.verify_steps, probes = s.probes,
        prompt_tokens_reused = s.prompt_tokens_reused, -- (of this choice's prompt, from the prefix pool)
        prefill_tokens = s.prefill_tokens, -- (those the prefill computed: tl_stats_prefill_tokens_per_s)
    }
    return text, ids, true, figures
end

-- OpenAI leaves the stop string out of the text (tags.cut_at_stop). The engine shows a match
-- only once it is complete (it holds back any suffix that may still grow into one), so the
-- match lies in the text of the finishing read, and ends in what its last token, `last_id`,
-- shows under the choice's text_config (nothing, for a special token the text leaves out: a
-- stop token then ended it, not a string).
local function cut_at_stop(text, stops, last_id, text_config)
    local shown = #text -- (no token in the read, or one without text: the whole of its text)
    if last_id and C.tl_token_text(model.ptr, last_id, token_bytes, token_len) == 0 then
        shown = select(2, token_string(last_id, false, text_config))
    end
    return tags.cut_at_stop(text, stops, shown)
end

-- A choice's finishing read (`text`, whose last token is last_id): the text without the stop
-- string that ended it (with include_stop_str_in_output, vLLM's, up to its end: the rest of
-- the token that completed it goes), and st.stop_reason, vLLM's: that stop string, or the
-- request's stop token id that ended it (nil: the model's end, the token limit, the chat
-- template's turn end).
local function finish_read(st, text, last_id)
    if not st.stopped_by_sequence then return text end
    if last_id and st.stop_ids and st.stop_ids[last_id] then
        st.stop_reason = last_id
        -- (its text left out, as vLLM's detokenizer leaves a stop token's, unless
        -- include_stop_str_in_output: the id stays in token_ids; a special one, which ended
        -- the generation, is in no text: keep_special_text shows none of it)
        if st.include_stop or C.tl_token_is_special(model.ptr, last_id) ~= 0 then return text end
        return text:sub(1, math.max(0, #text - select(2, token_string(last_id, true)))) -- (its bytes, all shown; none: 0)
    end
    local stops = st.stops or st.stop_strings -- (cut at: the engine's; named: the client's own)
    if not stops then return text end
    local cut, stop = cut_at_stop(text, stops, last_id, st.text_config)
    local named = stop and st.stop_names and st.stop_names[stop]
    if named then st.stop_reason = stop end
    -- (the tools' end tag, the server's own stop string without parallel_tool_calls, stays:
    -- the calls' reader reads it, and a block that is no call is content whole)
    if st.stops then return (stop == tools.END and not named) and (cut .. stop) or cut end
    return named and (cut .. stop) or text
end


-- ------------------------------------------------------------------ answers of a request
-- A request `r` has choices (r.sts, one engine request each: #prompts x n); its answer is
-- OpenAI's: the choices by index, usage over them all, and TinyLoop's stats (top-level for
-- one choice, as always; in each choice for more).

-- One entry of a tool_calls list in OpenAI's shape: its index (in a stream's delta; nil in a
-- message), then its id, type and name (nil in a piece that carries arguments only), then its
-- arguments' text.
local function call_entry_json(index, id, name, arguments)
    return "{" .. (index and ('"index":' .. index .. ",") or "") ..
        (id and ('"id":' .. encode(id) .. ',"type":"function",') or "") .. '"function":{' ..
        (name and ('"name":' .. encode(name) .. ",") or "") .. '"arguments":' .. encode(arguments) .. "}}"
end

-- A chat choice's tool calls (tinyloop.tools.parse) as a tool_calls list's JSON text, from
-- call `from` (default 1) on; in a stream's delta (indexed) each has its index.
local function tool_calls_json(calls, indexed, from)
    local out = {}
    for k = from or 1, #calls do
        local call = calls[k]
        out[#out + 1] = call_entry_json(indexed and k - 1 or nil, call.id, call.name, call.arguments)
    end
    return "[" .. concat(out, ",") .. "]"
end

-- Call k's id, unique to the request.
local function call_id(r, st, k) return ("call_%s_%d_%d"):format(r.response_id:match("[^-]+-(.*)"), st.index, k) end

-- A forced call's pieces as they come (tinyloop.tools.call_stream's events), as a stream's
-- tool_calls delta: a call's first piece has its id, type and name, the others a piece of its
-- arguments (OpenAI's way; a client joins the pieces of each index). One entry per call in a
-- chunk: a client that copies the first delta's list as it is (openai-python's accumulator
-- does) would keep a second entry of the same index apart.
local function call_pieces_json(r, st, events)
    local entries = {}
    for _, e in ipairs(events) do
        local last = entries[#entries]
        if not last or last.call ~= e.call then
            last = { call = e.call, arguments = {} }
            entries[#entries + 1] = last
        end
        if e.name then last.name = e.name else last.arguments[#last.arguments + 1] = e.arguments end
    end
    local out = {}
    for i, e in ipairs(entries) do
        out[i] = call_entry_json(e.call - 1, e.name and call_id(r, st, e.call), e.name, concat(e.arguments))
    end
    return "[" .. concat(out, ",") .. "]"
end

-- A chat choice's finished text, with tools: its content (nil: none) and calls (nil: none),
-- each call with an id unique to the request (tinyloop.tools.parse). With calls, finish_reason
-- is "tool_calls" (OpenAI's), unless the token limit cut the generation: "length" says that
-- a call may be missing (the whole ones before the cut are kept).
local function read_calls(r, st, text)
    -- (cut: the token limit, or the request's own stop string or token, ended the text where
    -- it did, the model did not: a call it cut is left out, as the stream leaves it)
    local cut = st.finish_reason == "length" or st.stop_reason ~= nil
    local content, calls, cut_call = tools.parse(text, st.tools, function(k) return call_id(r, st, k) end, cut)
    -- (the call the cut took the end of, by name: tinyloop.cut_call, which Anthropic's answer
    -- shows as its stream does, a tool_use block under stop_reason max_tokens)
    if cut_call and st.tinyloop then st.tinyloop.cut_call = cut_call end
    if calls then
        -- (whole calls answer "tool_calls", though a stop string of the request's ended the text:
        -- agents loop on it; the token limit's "length" says one may be missing)
        if st.finish_reason ~= "length" then st.finish_reason = "tool_calls" end
        metrics.incr("tool_calls", #calls)
    end
    return content, calls
end

-- A streamed chat choice with tools: what its chunk shows now, given the text just read.
-- Content goes out as it comes; from a <tool_call> on the text is calls: under a grammar that
-- makes them whole (a forced choice, auto's lazy grammar) they go out piece by piece as they
-- come, else they are held and read at the finish; white space at the end of the content, and a possible beginning of a
-- <tool_call>, wait until the next text tells (white space before a call is not content, as
-- in a blocking answer). The engine's own hold-back (stop strings, UTF-8) ends generation at
-- its match; this marker must not, so it is held here. Every read costs its own length: the
-- held white space is kept in pieces, and only the new text is searched.
-- -> the text to show (nil: nothing to send yet), the ids and figures to send with it (the
-- held tokens' too), and the tool_calls JSON to send now, if any: a forced call's pieces as
-- they come (an auto call's too, under its lazy grammar), or at the finish the calls read
-- back whole.
local function tool_stream(r, st, text, ids, figures, finished)
    local tool = st.tool_stream
    if not tool then -- (a forced choice writes calls only: all of it is held from the start)
        tool = { blanks = {}, prefix = "", ids = {}, figures = figures and {} or nil,
                 calls_text = st.tools.forced and {} or nil, reader = st.tools.forced and tools.call_stream() or nil }
        st.tool_stream = tool
    end
    for i = 1, #ids do
        tool.ids[#tool.ids + 1] = ids[i]
        if figures then tool.figures[#tool.figures + 1] = figures[i] end
    end
    local show, pieces = "", nil
    if tool.calls_text then -- from the first call on: pieces, joined once at the finish
        tool.calls_text[#tool.calls_text + 1] = text
        -- a forced choice's calls, whose shape its grammar fixes, go out as they come
        local events = tool.reader and tool.reader:feed(text)
        if events and #events > 0 then pieces = call_pieces_json(r, st, events) end
    else
        local new = tool.prefix .. text -- (prefix: under the marker's length)
        local at = new:find(tools.START, 1, true)
        local body_end = at and at - 1 or (finished and #new or #new - tools.held(new))
        local blank = tools.blank_tail(new, body_end)
        if blank > 1 then -- words: the held white space before them is content after all
            show = concat(tool.blanks) .. new:sub(1, blank - 1)
            tool.blanks = {}
        end
        tool.blanks[#tool.blanks + 1] = new:sub(blank, body_end)
        if at then
            tool.calls_text, tool.prefix = { new:sub(at) }, ""
            -- under tool_choice auto's lazy grammar, what follows the tag is calls: they go out
            -- as they come, as a forced choice's do
            if st.tools.lazy then
                tool.reader = tools.call_stream()
                local events = tool.reader:feed(tool.calls_text[1])
                if #events > 0 then pieces = call_pieces_json(r, st, events) end
            end
        else
            tool.prefix = new:sub(body_end + 1)
        end
    end
    if finished then
        -- the calls part read as a blocking answer reads it: content (all of it, where the
        -- block is no call; none, where the end of the generation cut the call) and calls
        local calls_content, calls
        if tool.calls_text then calls_content, calls = read_calls(r, st, concat(tool.calls_text)) end
        -- no call after all: what parse makes content is content (a forced choice's never is,
        -- nor a call whose pieces went out already: under auto's lazy grammar, one the end of
        -- the generation cuts arrives cut, as a forced one does)
        if not calls and not st.tools.forced and not (tool.reader and tool.reader.call > 0) and
            (calls_content or not tool.calls_text) then
            show = show .. concat(tool.blanks) .. tool.prefix .. concat(tool.calls_text or {})
        end
        -- the calls read back whole, where they did not go out piece by piece (and, should a
        -- forced choice's reader have lost the shape, those whose names did not go out)
        if calls and not tool.reader then
            pieces = tool_calls_json(calls, true)
        elseif calls and tool.reader.state == "off" and #calls > tool.reader.call then
            pieces = tool_calls_json(calls, true, tool.reader.call + 1)
        end
    elseif show == "" and not pieces then
        return nil
    end
    local out_ids, out_figures = tool.ids, tool.figures
    tool.ids, tool.figures = {}, figures and {} or nil
    return show, out_ids, out_figures, pieces
end

local function release_all(r, cancelled)
    for _, st in ipairs(r.sts) do release(st, cancelled) end
end

-- What ends a choice of either API: finish_reason, token_ids and the stats, if given.
local function choice_tail(ids, finish_reason, stats, stop_reason)
    return ',"finish_reason":' .. (finish_reason and ('"' .. finish_reason .. '"') or "null") ..
        ',"stop_reason":' .. (stop_reason and encode(stop_reason) or "null") ..
        ',"token_ids":[' .. concat(ids, ",") .. "]" .. (stats and (',"tinyloop":' .. encode_sorted(stats)) or "") .. "}"
end

-- lp_ids: the tokens the logprobs are of (default ids; with echo, the prompt's first: n_prompt).
-- A chat choice (st.chat) holds a message, or in a stream (st.streaming) a delta, whose first
-- says the role; with tool calls (calls: their JSON text, tool_calls_json or call_pieces_json),
-- its content is the text before them (text, or nil: null) and its tool_calls follow; a
-- thinking model's reasoning (tinyloop.reasoning) is its reasoning_content (nil: none).
local function choice_json(st, text, ids, finish_reason, stats, figures, lp_ids, n_prompt, calls, reasoning_text)
    if st.chat then
        local content = text and encode(text) or "null"
        -- a thinking model's reasoning, under both names clients read: reasoning_content
        -- (DeepSeek's, llama.cpp's, older vLLM's) and reasoning (vLLM's now)
        local thought = ""
        if reasoning_text and st.reasoning and st.reasoning.shown and (not st.streaming or reasoning_text ~= "") then
            local json = encode(reasoning_text)
            thought = ',"reasoning_content":' .. json .. ',"reasoning":' .. json
        end
        local tool_calls = calls and (',"tool_calls":' .. calls) or ""
        -- (content null only beside calls or the reasoning shown, as OpenAI and vLLM answer: a
        -- forced call the token limit cut before it was whole, or a reply all reasoning with
        -- include_reasoning false, left a message whose content was null and had neither, which
        -- an agent's loop sends back and the chat request refuses, as OpenAI's does)
        if not calls and content == "null" and thought == "" and not st.streaming then content = '""' end
        local message
        if not st.streaming then
            -- (refusal: null, as OpenAI sends it, a member its spec requires: a client
            -- generated from the spec checks it is there)
            message = '"message":{"role":"assistant","content":' .. content .. ',"refusal":null' .. thought .. tool_calls .. "}"
        elseif not st.role_sent then
            st.role_sent = true
            message = '"delta":{"role":"assistant","content":' .. content .. ',"refusal":null' .. thought .. tool_calls .. "}"
        else -- a later delta: only what it carries
            local fields = ((text and text ~= "") and (',"content":' .. content) or "") .. thought .. tool_calls
            message = '"delta":{' .. fields:sub(2) .. "}"
        end
        return '{"index":' .. st.index .. "," .. message .. ',"logprobs":' ..
            (figures and chat_logprobs_json(ids, figures) or "null") .. choice_tail(ids, finish_reason, stats, finish_reason and st.stop_reason)
    end
    -- (a view that reads tokens by id, llama.cpp's, gets the chat API's entries with ids: for
    -- the generated tokens; an echoed prompt's, which no such view asks for, stay OpenAI's)
    local logprobs = not figures and "null" or (st.logprob_entries and not lp_ids) and chat_logprobs_json(ids, figures, true)
        or logprobs_json(st, lp_ids or ids, figures, n_prompt)
    return '{"index":' .. st.index .. ',"text":' .. encode(text) .. ',"logprobs":' .. logprobs ..
        choice_tail(ids, finish_reason, stats, finish_reason and st.stop_reason)
end

-- The response (or a chunk of a stream) around its choices' JSON, with `tail` (",usage..." or "").
local function response_json(r, choices, tail)
    local object = not r.chat and "text_completion" or r.stream and "chat.completion.chunk" or "chat.completion"
    return '{"id":"' .. r.response_id .. '","object":"' .. object .. '","created":' .. r.created ..
        ',"model":' .. encode(conf.model_id) .. ',"choices":[' .. choices .. "]" .. tail .. "}"
end

-- Usage over the request: each prompt counted once (n choices of a prompt share it), and
-- OpenAI's prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix pool
-- (per prompt, the least any of its choices reused: the n choices of a prompt compute it once,
-- the others taking it from the pool, which is no cache of an earlier request's).
local function usage_json(r)
    local completion, cached = 0, {}
    for _, st in ipairs(r.sts) do
        completion = completion + st.usage.completion_tokens
        cached[st.prompt] = math.min(cached[st.prompt] or math.huge, st.cached_tokens)
    end
    local cached_tokens = 0
    for _, n in pairs(cached) do cached_tokens = cached_tokens + n end
    -- (in OpenAI's order, whichever worker writes it: a Lua table's keys go in its hash order)
    return ('{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}')
        :format(r.prompt_tokens, completion, r.prompt_tokens + completion, cached_tokens)
end

-- best_of: of each prompt's best_of candidates (r.sts in prompt order, best_of a prompt), the
-- n whose completion tokens have the highest mean log-probability (OpenAI's "best"), in that
-- order, ties to the earlier sample; the choices renumbered 0, 1, ... Every candidate's
-- tokens count in the usage, as OpenAI bills them.
local function best_of(r, results)
    if r.best_of == r.n then return results end
    local chosen = {}
    for first = 1, #results, r.best_of do
        local group = {}
        for i = first, first + r.best_of - 1 do
            local res = results[i]
            res.sample, res.mean = i, #res.ids > 0 and res.logprob_sum / #res.ids or 0
            group[#group + 1] = res
        end
        table.sort(group, function(a, b)
            if a.mean ~= b.mean then return a.mean > b.mean end
            return a.sample < b.sample
        end)
        for j = 1, r.n do chosen[#chosen + 1] = group[j] end
    end
    for i, res in ipairs(chosen) do res.st.index = i - 1 end
    return chosen
end

-- ------------------------------------------------------------------ stored responses

-- A stored response (/v1/responses' store), one value (so that the store drops all of it or
-- none) under the public part of its id, the part its output items' ids hold (an
-- item_reference finds it so, and drops with it): its whole id, the id of the response it
-- continued ("" for none), its own messages (chat messages, JSON: its input's and its reply)
-- and its response object (JSON), NUL between them (JSON text has no raw NUL: cjson writes
-- \u0000). Each keeps only its own messages, not the whole conversation again: a chain of n
-- turns holds each turn once. The dict drops the least recently used first (a read
-- refreshes: a chain in use stays).
local function store_key(id) return "resp:" .. (responses.stored_key(id) or id) end
-- The stored value under `key` -> its whole id, previous id, messages, response | nil.
local function stored_value(key)
    local value = responses_store and responses_store:get(key)
    if not value then return nil end
    local first = value:find("\0", 1, true)
    local second = value:find("\0", first + 1, true)
    local third = value:find("\0", second + 1, true)
    return value:sub(1, first - 1), value:sub(first + 1, second - 1), value:sub(second + 1, third - 1), value:sub(third + 1)
end
-- The response of id `id` (its whole id: the secret part too) -> previous id, messages,
-- response | nil.
local function stored(id)
    if type(id) ~= "string" then return nil end
    local whole, previous, messages, response = stored_value(store_key(id))
    if whole ~= id then return nil end
    return previous, messages, response
end

-- The conversation a previous_response_id continues (responses.to_chat's lookup): the chain's
-- messages, oldest first; nil when a response of the chain is not stored.
local MAX_CHAIN = 100000 -- (a cycle cannot be stored, ids being new; this only bounds a walk)
local function stored_conversation(id)
    local parts = {}
    if id == "" then return nil end -- (no response has it: the end of a chain is its previous id)
    repeat
        local previous, messages = stored(id)
        if not previous then return nil end
        parts[#parts + 1] = messages
        id = previous
    until id == "" or #parts >= MAX_CHAIN
    local conversation = {}
    for i = #parts, 1, -1 do
        local messages = cjson.decode(parts[i])
        if type(messages) ~= "table" then return nil end
        for _, m in ipairs(messages) do conversation[#conversation + 1] = m end
    end
    return conversation
end

-- An output item of a stored response by the id it gave it (responses.to_chat's lookup_item: an
-- input's item_reference) -> the input item | nil. The item's id holds the public part of its
-- response's id ("msg_" .. 16 hex digits, 64 random bits), the key it is stored under: whoever
-- was sent the item may send it back, as OpenAI's store does within a project; the response
-- itself still takes its whole id to read.
local function stored_item(item_id)
    local key = responses.item_response_key(item_id)
    if not key then return nil end
    local _, _, messages = stored_value("resp:" .. key)
    if not messages then return nil end
    local list = cjson.decode(messages)
    return type(list) == "table" and responses.reply_item(list[#list], item_id) or nil
end

-- Keeps a Responses answer that asked to be stored (r.view:record), once it has ended, before
-- its end goes out (a client may send the next turn as soon as it reads it). -> false when it
-- could not be kept (the dict is full of entries it cannot drop: the answer then says
-- store: false), else true.
local MAX_STORE_TRIES = 10000 -- (30 dropped a try: a store of 300,000 responses emptied)
local function keep_response(r)
    if r.kept or not r.view.record or not responses_store then return true end -- (another API's view keeps nothing)
    local messages, response, previous = r.view:record()
    if not messages then return true end
    r.kept = true
    local key, value = store_key(r.public_id), r.public_id .. "\0" .. (previous or "") .. "\0" .. messages .. "\0" .. response
    local ok, err
    -- (one the whole store cannot hold: set would drop the least recently used, then fail; the
    -- zone's own pages and a value's slab rounding take room too, hence an eighth kept back)
    local capacity = responses_store.capacity and responses_store:capacity()
    if capacity and #key + #value > capacity - capacity / 8 then
        ok, err = false, "larger than the store (--responses-store-mb)"
    else
        -- (set drops at most 30 of the least recently used a try, then says "no memory": a
        -- large response dropped them and was not kept; each try drops more, until it fits)
        ok, err = responses_store:set(key, value)
        local tries = 1
        while not ok and err == "no memory" and tries < MAX_STORE_TRIES do
            ok, err = responses_store:set(key, value)
            tries = tries + 1
        end
    end
    if not ok then ngx_log(ngx.WARN, "tinyloop: response ", r.public_id, " is not stored: ", err) end
    return ok and true or false
end
-- The answer (or final event) text of a response that asked to be stored and could not be:
-- store false. (The first "store":true of the object is its member: every text in it before
-- is a JSON string, whose quotes are escaped.)
local function not_stored(text) return (text:gsub('"store":true', '"store":false', 1)) end

-- How a generation that failed (err, the engine's status) is answered: status, param, type. A
-- 500, but where the request's own grammar could not be followed (too costly or too ambiguous at
-- some token, which compiling it could not foresee): that is the request's, a 400 naming its
-- field, as a grammar that does not compile is (a 500 is retried by OpenAI's clients).
local function failure_answer(r, err, status)
    if status == C.TL_ERR_UNSUPPORTED and r.grammar_field and err:find("grammar", 1, true) then
        return 400, r.grammar_field, "invalid_request_error"
    end
    return 500, nil, "server_error"
end

local function run_blocking(r)
    local results = {}
    for _, st in ipairs(r.sts) do
        local texts, all_ids, all_figures = {}, {}, st.logprobs and {} or nil
        local logprob_sum = 0 -- of the completion's tokens (best_of's ranking)
        local lp_ids = st.prompt_figures and {} or nil -- echo with logprobs: the prompt's tokens first
        if lp_ids then
            for i = 1, #st.prompt_ids do lp_ids[i], all_figures[i] = st.prompt_ids[i], st.prompt_figures[i] end
        end
        while true do
            local text, ids, finished, figures = next_output(st)
            if not text then
                release_all(r, ids == "gone")
                if ids == "gone" then return ngx_exit(499) end
                local status, param, etype = failure_answer(r, ids, finished) -- (finished: the engine's status)
                return r.send_error(status, ids, param, etype)
            end
            -- (nginx reports no hang-up where bytes came after the request, a stray CRLF or a
            -- pipelined request: asked at each output, the request stops within a token)
            if client_left() then
                release_all(r, true)
                return ngx_exit(499)
            end
            texts[#texts + 1] = text
            for i = 1, #ids do
                all_ids[#all_ids + 1] = ids[i]
                if lp_ids then lp_ids[#lp_ids + 1] = ids[i] end
                if all_figures then all_figures[#all_figures + 1] = figures[i] end
                if figures then logprob_sum = logprob_sum + figures[i].logprob end
            end
            if finished then break end
        end
        release(st, false)
        local text = concat(texts)
        text = finish_read(st, text, all_ids[#all_ids])
        local calls, thought
        if st.reasoning then thought, text = reasoning.split(text, st.reasoning.inside) end -- (text nil: none)
        if st.tools and text then text, calls = read_calls(r, st, text) end -- (text nil: no content, null)
        results[#results + 1] = { st = st, text = text and (st.echo or "") .. text, ids = all_ids, logprob_sum = logprob_sum,
                                  figures = r.show_logprobs and all_figures or nil, lp_ids = lp_ids, calls = calls,
                                  reasoning = thought }
    end
    local chosen, choices = best_of(r, results), {}
    local single = #chosen == 1
    for _, res in ipairs(chosen) do
        local st = res.st
        choices[#choices + 1] = choice_json(st, res.text, res.ids, st.finish_reason,
                                            not single and st.tinyloop, res.figures, res.lp_ids, res.lp_ids and #st.prompt_ids,
                                            res.calls and tool_calls_json(res.calls, false), res.reasoning)
    end
    local answer = response_json(r, concat(choices, ","), ',"usage":' .. usage_json(r) ..
        (single and (',"tinyloop":' .. encode_sorted(chosen[1].st.tinyloop)) or ""))
    if r.view then
        answer = r.view:response(answer, r.public_id)
        if not keep_response(r) then answer = not_stored(answer) end
    end
    return send_json(200, answer)
end

-- A view's events as its stream writes them: Ollama's, one JSON object a line; llama.cpp's,
-- server-sent data events without a type; the others, server-sent events with a type.
local function framed(view, events)
    local text = {}
    for i, e in ipairs(events) do
        local data = valid_utf8(e[2])
        text[i] = view.FRAME == "ndjson" and (data .. "\n") or view.FRAME == "data" and ("data: " .. data .. "\n\n") or
                  ("event: " .. e[1] .. "\ndata: " .. data .. "\n\n")
    end
    return text
end

-- What was printed (ngx.print's ok, err) flushed -> true, or false when the client has gone
-- (then the request is released).
local buffering_warned -- (once a worker)
local function sent(r, ok, err)
    if ok then ok, err = ngx_flush(true) end
    -- HTTP/1.0 with lua_http10_buffering on (another nginx.conf than ours): the response is
    -- buffered whole and flush says so; the client is still there, and gets the stream at its
    -- end (a front's proxy_pass speaks HTTP/1.0 unless told proxy_http_version 1.1)
    if not ok and err == "buffering" then
        ok = true
        if not buffering_warned then
            buffering_warned = true
            ngx_log(ngx.WARN, "tinyloop: an HTTP/1.0 client gets its stream only when it ends: set lua_http10_buffering off ",
                    "(and proxy_http_version 1.1 in a front's proxy_pass)")
        end
    end
    if not ok then
        ngx_log(ngx.INFO, "tinyloop: client gone mid-stream (", err, "): cancelling request ", r.response_id)
        release_all(r, true)
        return false
    end
    return true
end

-- Writes one SSE event; false when the client has gone (then the request is released). A
-- stream of another API (r.view: OpenAI's Responses, Anthropic's Messages, Ollama's) reads each
-- chat chunk as the events (or, Ollama's, JSON lines) of its own that it makes.
local function sse(r, payload)
    local ok, err
    if r.view then
        local fed, events = pcall(r.view.feed, r.view, payload)
        if not fed then -- (a view's fault must not leave the engine generating for nobody)
            ngx_log(ngx.ERR, "tinyloop: ", r.response_id, ": the answer's view failed: ", tostring(events))
            release_all(r, false)
            return false
        end
        if #events == 0 then return true end
        -- (a stored response is kept before its end goes out)
        if r.view.final and not r.kept and not keep_response(r) then
            events[#events][2] = not_stored(events[#events][2])
        end
        ok, err = ngx_print(framed(r.view, events))
    else
        ok, err = ngx_print("data: ", valid_utf8(payload), "\n\n")
    end
    return sent(r, ok, err)
end

-- A stream's sign of life, when it has had nothing to send for keepalive_s: its view's own
-- (Anthropic's message_start, then ping events; Responses' response.created, then
-- response.in_progress), else an SSE comment, which event-stream parsers skip. False when the
-- client has gone.
local function keep_alive(r)
    local events = r.view and r.view.alive and r.view:alive() or {}
    if #events > 0 then return sent(r, ngx_print(framed(r.view, events))) end
    return sent(r, ngx_print(": keep-alive\n\n"))
end

-- Headers go with the first event, not before: a client's time to first byte is then its
-- time to first token, and a failure before any token still gets a real error status (but
-- a stream that waits keepalive_s for its first event starts without it: run_stream).
local function start_stream(r)
    ngx.status = 200
    ngx.header["Content-Type"] = r.view and r.view.CONTENT_TYPE or "text/event-stream"
    ngx.header["Cache-Control"] = "no-cache"
    ngx.header["X-Accel-Buffering"] = "no" -- a proxy in front must not buffer the stream
end

-- The choices stream side by side, OpenAI's way (chunks of several indices interleave). They
-- step together in the engine, so a wait for the first live choice's output finds the others'
-- ready as well: each is then read without a wait of its own. Each choice's last chunk has
-- its finish_reason and stats; usage goes in the very last chunk, or, with
-- stream_options.include_usage, in a chunk of its own with no choices (OpenAI's shape; every
-- other chunk then says "usage": null, or with vLLM's continuous_usage_stats its choice's
-- usage so far).
local function run_stream(r)
    local started = false
    local usage_null = r.include_usage and ',"usage":null' or ""
    -- vLLM's stream_options.continuous_usage_stats: each chunk the usage of its choice so far
    -- (n_tokens: those read so far, st.n_tokens by default)
    local function chunk_usage(st, n_tokens)
        if not r.continuous_usage then return usage_null end
        n_tokens = n_tokens or st.n_tokens
        return ',"usage":{"prompt_tokens":' .. st.prompt_tokens .. ',"completion_tokens":' .. n_tokens ..
            ',"total_tokens":' .. (st.prompt_tokens + n_tokens) .. "}"
    end
    -- The stream's headers, and a chat's first chunk of each choice: its role alone (content
    -- "", no tokens, no logprobs), as OpenAI and vLLM open a choice. (The role went with the
    -- first tokens and their logprobs: the OpenAI Node SDK's accumulator put that chunk's
    -- logprobs in its snapshot, then appended them again, finalChatCompletion() listing the
    -- first tokens twice.) False when the client left.
    local function begin()
        start_stream(r)
        started = true
        if not r.chat then return true end
        for _, st in ipairs(r.sts) do
            if not sse(r, response_json(r, choice_json(st, "", {}), chunk_usage(st, 0))) then return false end
        end
        return true
    end
    -- Nothing to send for keepalive_s (a long prompt's prefill, a queue): the stream starts
    -- and sends a sign of life, again each keepalive_s (Claude Code and Codex give up on a
    -- stream silent for 300 s and send the request again, whose prefill is as long).
    -- (idle_since: from the first wait that found nothing, which waited wait_ms; nil after an
    -- output: no clock read a token)
    local idle_since
    local function on_idle()
        -- (Ollama's lines have no sign of life, and its stream, not begun, keeps a real error status)
        if r.view and r.view.FRAME == "ndjson" then return true end
        local t = now()
        idle_since = idle_since or t - conf.wait_ms / 1000
        if t - idle_since < conf.keepalive_s then return true end
        idle_since = t
        if not started and not begin() then return false end
        return keep_alive(r)
    end
    local live = {}
    for k, st in ipairs(r.sts) do
        live[k] = st
        if st.echo then
            if not started and not begin() then return ngx_exit(499) end
            local echo_chunk = choice_json(st, st.echo, {}, nil, nil, st.prompt_figures, st.prompt_ids, #st.prompt_ids)
            if not sse(r, response_json(r, echo_chunk, chunk_usage(st))) then return ngx_exit(499) end
        end
    end
    while #live > 0 do
        local i = 1
        while i <= #live do
            local st = live[i]
            -- the first live choice is waited for; the others are read when a poll finds output
            local ready = i > 1 and tonumber(C.tl_engine_wait(engine, st.id, 0)) == 1
            local finished = false
            if i == 1 or ready then
                local text, ids, figures
                text, ids, finished, figures = next_output(st, ready, on_idle)
                idle_since = nil
                if not text then
                    local gone = ids == "gone"
                    release_all(r, gone)
                    if gone then return ngx_exit(499) end
                    local status, param, etype = failure_answer(r, ids, finished) -- (finished: the engine's status)
                    if not started then return r.send_error(status, ids, param, etype) end
                    -- Headers are sent: the error travels as an event, and the stream still ends.
                    sse(r, '{"error":{"message":' .. encode(ids) .. ',"type":"' .. etype .. '","param":' ..
                        (param and encode(param) or "null") .. '}}')
                    sse(r, "[DONE]")
                    return ngx_exit(ngx.OK)
                end
                local calls_json
                if finished then
                    release(st, false)
                    text = finish_read(st, text, ids[#ids])
                end
                -- a thinking model's reasoning: in the chunk of the read that made it, before any
                -- content (the content of a read goes with it)
                local thought = ""
                if st.reasoning then thought, text = st.reasoning.reader:feed(text, finished) end
                if st.tools then
                    text, ids, figures, calls_json = tool_stream(r, st, text, ids, figures, finished)
                    -- held: the role (begin's chunk), and the reasoning so far, go out at once all the same
                    if not text and (not started or thought ~= "") then
                        if not started and not begin() then return ngx_exit(499) end
                        if thought ~= "" and
                            not sse(r, response_json(r, choice_json(st, nil, {}, nil, nil, nil, nil, nil, nil, thought), chunk_usage(st))) then
                            return ngx_exit(499)
                        end
                        thought = ""
                    end
                end
                if not started and ((text and (finished or text ~= "" or #ids > 0)) or thought ~= "") and not begin() then
                    return ngx_exit(499)
                end
                local chunk
                if calls_json then -- the content before the calls, the calls, then the finish (OpenAI's chunks)
                    if (text ~= "" or thought ~= "") and
                        not sse(r, response_json(r, choice_json(st, text, {}, nil, nil, nil, nil, nil, nil, thought), chunk_usage(st))) then
                        return ngx_exit(499)
                    end
                    thought = ""
                    -- (a piece of a forced call carries the tokens read with it; the finish, the rest)
                    local with_ids = not finished
                    if not sse(r, response_json(r, choice_json(st, nil, with_ids and ids or {}, nil, nil, with_ids and figures or nil,
                                                               nil, nil, calls_json), chunk_usage(st))) then
                        return ngx_exit(499)
                    end
                    text = ""
                    if with_ids then ids, figures = {}, nil end
                end
                if finished then
                    local last = #live == 1 -- this choice ends the request's generation
                    local usage = (r.include_usage or not last) and chunk_usage(st) or (',"usage":' .. usage_json(r))
                    chunk = response_json(r, choice_json(st, text, ids, st.finish_reason, nil, figures, nil, nil, nil, thought),
                                          usage .. ',"tinyloop":' .. encode_sorted(st.tinyloop))
                elseif (text and (text ~= "" or #ids > 0)) or thought ~= "" then
                    chunk = response_json(r, choice_json(st, text or "", ids, nil, nil, figures, nil, nil, nil, thought), chunk_usage(st))
                end
                if chunk and not sse(r, chunk) then return ngx_exit(499) end
            end
            if finished then table.remove(live, i) else i = i + 1 end
        end
    end
    if r.include_usage and not sse(r, response_json(r, "", ',"usage":' .. usage_json(r))) then return ngx_exit(499) end
    sse(r, "[DONE]")
    return ngx_exit(ngx.OK)
end


-- A POST's body, once the model is ready and the body within the limit; nil when answered.
-- (its errors in the shape of the API the path is: send_uri_error)
local function post_body()
    arrival_time() -- (the clock read before the body's)
    if ngx.req.get_method() ~= "POST" then
        return send_uri_error(405, "method " .. ngx.req.get_method() .. " is not allowed here: use POST", nil, nil, { Allow = "POST" })
    end
    if not ready() then return end
    -- (a gzip body was read as JSON: "an unescaped control character (byte 31)", gzip's first)
    -- (every line of the header: repeated, they are one list, RFC 9110 §5.3; $http_ reads the
    -- first, and identity then gzip let a gzip body through)
    local encoding = ngx.var.http_content_encoding
    if encoding then
        local lines = ngx.req.get_headers(0)["content-encoding"] -- (0: all the lines, not the first 100)
        encoding = type(lines) == "table" and table.concat(lines, ", ") or lines or encoding
        for coding in encoding:gmatch("[^,]+") do
            local name = coding:match("^%s*(.-)%s*$"):lower()
            if name ~= "identity" and name ~= "" then
                return send_uri_error(415, ("the request body's Content-Encoding %s is not supported: send it uncompressed"):format(encoding))
            end
        end
    end
    local declared = tonumber(ngx.var.http_content_length)
    local too_large = ("the request body is over the %d-byte limit"):format(conf.max_body)
    if declared and declared > conf.max_body then return send_uri_error(413, too_large) end
    ngx.req.read_body()
    local body = ngx.req.get_body_data()
    local spilled = not body and ngx.req.get_body_file()
    if spilled then
        -- (a chunked body: nginx counts the body, not the framing, against client_max_body_size,
        -- but may spill one of legal size to a file, the framing filling the buffer: it was
        -- refused as too large)
        local f = io.open(spilled, "rb")
        body = f and f:read(conf.max_body + 1)
        if f then f:close() end
        if not body or #body > conf.max_body then return send_uri_error(413, too_large) end
    end
    return body or ""
end

-- llama.cpp's piece of a token: its text, or its bytes (numbers) where they are not valid
-- UTF-8, part of a character (U+FFFD in its place lost them); made once per worker too.
local function piece_json_of(id)
    local text, raw = token_text_of(id)
    return text == raw and token_json_of(id) or token_bytes_json_of(id)
end

-- POST /tokenize (vLLM's): the ids of a prompt or a conversation, as the completions
-- endpoints encode them: {"count", "max_model_len", "tokens", "token_strs"} (each token's
-- text, as logprobs show it, with return_token_strs; else null).
function _M.tokenize()
    local body = post_body()
    if not body then return end
    local req, err = request.parse_tokenize(body, model, conf.model_id, chat_prompts, chat_error)
    if not req then return send_request_error(err) end
    local point = require("tinyloop.pause").point -- (a megabyte's tokens' texts: it pauses)
    if req.llama then -- llama.cpp's answer: the ids, or each id with its text
        if not req.with_pieces then return send_json(200, '{"tokens":[' .. concat(req.ids, ",") .. "]}") end
        local pieces = {}
        for i, id in ipairs(req.ids) do
            point()
            pieces[i] = '{"id":' .. id .. ',"piece":' .. piece_json_of(id) .. "}"
        end
        return send_json(200, '{"tokens":[' .. concat(pieces, ",") .. "]}")
    end
    local strs = "null"
    if req.token_strs then
        local list = {}
        for i, id in ipairs(req.ids) do
            point()
            list[i] = token_json_of(id)
        end
        strs = "[" .. concat(list, ",") .. "]"
    end
    return send_json(200, '{"count":' .. #req.ids .. ',"max_model_len":' .. model.max_seq_len .. ',"tokens":[' ..
        concat(req.ids, ",") .. '],"token_strs":' .. strs .. "}")
end

-- POST /apply-template (llama.cpp's): {"messages", ...} -> {"prompt": the conversation as the
-- chat endpoint renders it with the model's template}.
function _M.apply_template()
    local body = post_body()
    if not body then return end
    local req, err = request.parse_apply_template(body, chat_prompts, chat_error)
    if not req then return send_llamacpp_error(err.status, err.message, nil, err.type) end
    return send_json(200, '{"prompt":' .. encode(req.prompt) .. "}")
end

-- POST /detokenize (vLLM's, and llama.cpp's): {"tokens": [...]} -> {"prompt": their text, "content": the same} (a token holding
-- part of a character shows U+FFFD, as JSON needs UTF-8).
function _M.detokenize()
    local body = post_body()
    if not body then return end
    local req, err = request.parse_detokenize(body, model, conf.model_id)
    if not req then return send_request_error(err) end
    -- (and as "content": llama.cpp's name of it)
    local text = encode(req.text)
    return send_json(200, '{"prompt":' .. text .. ',"content":' .. text .. "}")
end

-- POST /v1/completions (chat false) or /v1/chat/completions (chat true): the request's body.
-- view: another API's request (tinyloop.server.responses', anthropic's, ollama's), whose chat
-- (or completions) body `body` is; its answer, its stream's events and its errors are that
-- API's, and view.PARSE_OPTIONS that API's rules the parser takes (request.parse_chat's opts).
local function serve(chat, body, view)
    local parse_opts = view and view.PARSE_OPTIONS
    -- an error answer: the other API's field names, and shape, for its request
    local function send_error(status, message, param, etype, headers, code, err)
        if view then
            local e = view:error(err or { status = status, message = message, param = param, type = etype })
            if e.body then return send_json(e.status or status, e.body, headers) end
            message, param = e.message, e.param
        end
        return _M.send_error(status, message, param, etype, headers, code)
    end
    if chat and not chat_prompts then
        local e = request.template_unloaded(chat_error)
        return send_error(e.status, e.message, nil, e.type)
    end
    local req, err
    if chat then
        req, err = request.parse_chat(body, model, conf.model_id, conf.max_active, chat_prompts, parse_opts)
    else
        req, err = request.parse(body, model, conf.model_id, conf.max_active, parse_opts)
    end
    if not req then return send_request_error(err, send_error) end
    -- A thinking model under a grammar (structured outputs, a tool choice): its reasoning runs
    -- free and the grammar writes the answer after </think>, as vLLM does with a reasoning
    -- parser; where the prompt does not open the block, the model may write one first (unless
    -- a request's own grammar writes the block itself). One block, where the reply is read for
    -- it: a call inside a later one would be read as a call and never checked.
    local thinks = chat and reasoning_on and reasoning.opens(req.prompt_text)
    local own_block = false -- a request's own grammar writes the block itself
    if chat and reasoning_on and req.cfg.grammar then
        local wrapped, gerr = request.after_reasoning(req.cfg.grammar, thinks, req.grammar_field ~= "tools")
        if not wrapped then -- (the grammar's own size: the request's; memory: the server's)
            local too_large = tostring(gerr):find("too large", 1, true)
            return send_error(too_large and 400 or 500, "the grammar after the reasoning: " .. tostring(gerr),
                              too_large and req.grammar_field or nil, not too_large and "server_error" or nil)
        end
        own_block = wrapped == req.cfg.grammar
        req.cfg.grammar = wrapped
    end
    -- A thinking budget: the engine writes </think> for a block that holds that many tokens
    -- (the tags the replies are read by; the block open from the start where the prompt opened it)
    if req.thinking_budget and not reasoning_on and view and view.DROPS_BUDGET_WITHOUT_REASONING then req.thinking_budget = nil end
    if req.thinking_budget then
        if not reasoning_on then
            return send_error(400, "thinking_budget needs a thinking model: this server does not read replies for " ..
                              "<think> blocks (its chat template has none, or --reasoning-format none)", "thinking_budget")
        end
        if own_block then -- (the engine could force </think> where that grammar does not allow it)
            return send_error(400, "thinking_budget does not combine with a grammar that writes the <think> block itself (" ..
                              req.grammar_field .. ")", "thinking_budget")
        end
        req.cfg.reasoning_budget, req.cfg.reasoning_open = req.thinking_budget, thinks
        req.cfg.reasoning_start, req.cfg.reasoning_end = reasoning.START, reasoning.END
    end

    -- 1. Every choice's session, before anything runs: the engine checks every value here
    --    (its argument errors are raised, tinyloop's convention; runtime failures returned).
    local made = {} -- { ptr, prompt index } of each choice, not yet the engine's
    local r         -- the request, once its choices are the engine's (step 3)
    local function free_made(from)
        for i = from, #made do C.tl_session_free(made[i].ptr) end
        made = {}
    end
    -- A client that leaves (lua_check_client_abort on) cancels at once, even while this
    -- request's coroutine waits in the thread pool for output (every choice is released; the
    -- sessions not yet submitted are freed). But while step 2 scores the prompt in the pool it
    -- holds one of embed_slots' places, which is given back only once the scoring in hand is
    -- done (that work cannot be stopped; a place given back at once let clients that post and
    -- hang up run unbounded scorings): a client that leaves then is only noted, and step 2
    -- ends the request.
    local scoring, left_while_scoring = false, false
    local function leave()
        if r then
            release_all(r, true)
        else
            for _ = 1, #made do metrics.incr("cancelled") end
            free_made(1)
        end
        return ngx_exit(499)
    end
    local watching = ngx.on_abort(function() -- (nil where lua_check_client_abort is off)
        if scoring then left_while_scoring = true return end
        return leave()
    end)
    -- (before any session is made: a client that left while the request was read, its grammar
    -- compiled or its prompt encoded; counted as its sessions would be, one a choice, as the
    -- embeddings' leavers are: it ended uncounted)
    if watching and client_left() then
        metrics.incr("cancelled", #req.prompts * req.best_of)
        return ngx_exit(499)
    end
    for p, ids in ipairs(req.prompts) do
        for sample = 0, req.best_of - 1 do
            local cfg = req.cfg
            if req.best_of > 1 then -- the choices of a prompt are samples: seeds seed, seed + 1, ...
                cfg = {}
                for k, v in pairs(req.cfg) do cfg[k] = v end
                -- (in the engine's range, as the request's seed was read: -1, 2^53 - 1, then 0, 1, ...;
                -- past 2^53 two choices' seeds were one double, or refused)
                cfg.sample_seed = request.seed_in_range(req.cfg.sample_seed or 0, sample)
            end
            local ok, session, serr = pcall(model.session, model, ids, cfg)
            if not ok or not session then
                free_made(1)
                if ok then return send_error(500, "cannot create the session: " .. tostring(serr), nil, "server_error") end
                local msg, param = request.engine_message(raised_message(session))
                -- the engine says "grammar" whichever field the request used, and names
                -- llama.cpp's fields by what they became
                if param == "grammar" and req.grammar_field then param = req.grammar_field end
                local _, named = request.as_sent(body, nil, { message = msg, param = param })
                msg, param = named.message, named.param
                return send_error(400, msg, param)
            end
            -- (the prefix pool's share of its prompt is known from here: the cache is made)
            made[#made + 1] = { ptr = session:detach(), prompt = p, cached = 0 }
            made[#made].cached = C.tl_session_stats(made[#made].ptr).prompt_tokens_reused
        end
    end

    -- 2. echo with logprobs: the prompts' own figures, scored in the thread pool (forward
    --    passes, not on the event loop but where the pool cannot take them: in_pool), in one of the places embeddings take (conf.embed_jobs
    --    a worker): run before the engine's limit is checked, the scorings were unbounded, and
    --    past the pool's Lua VMs each one failed with a 500.
    local prompt_figures = {}
    if req.echo and req.logprobs then
        if not embed_slots:wait(conf.embed_wait_s) then
            free_made(1)
            metrics.incr("rejected")
            return send_error(503, ("every place that scores prompts is taken (%d a worker): retry later"):format(conf.embed_jobs),
                              nil, "overloaded_error", { ["Retry-After"] = "1" })
        end
        scoring = true
        local loops, top = req.cfg.loops or model.default_loops, req.logprobs
        for p, ids in ipairs(req.prompts) do
            local lps, top_ids, top_lps = in_pool("score", "scoring prompts on the event loop", score_addr,
                                                  last_error_addr, model_addr, ids, loops, top)
            if left_while_scoring or not lps then
                scoring = false
                embed_slots:post(1)
                if left_while_scoring then return leave() end
                free_made(1)
                return send_error(500, "scoring the prompt failed: " .. tostring(top_ids), nil, "server_error")
            end
            local figures = { {} } -- the first token has nothing before it
            for i = 1, #ids - 1 do
                figures[i + 1] = { logprob = lps[i], top = alternatives_of(top_ids, top_lps, (i - 1) * top + 1, top) }
            end
            prompt_figures[p] = figures
        end
        scoring = false
        embed_slots:post(1)
    end

    -- 3. To the engine, all or none.
    next_request = next_request + 1
    r = { sts = {}, prompt_tokens = req.prompt_tokens, include_usage = req.include_usage, created = ngx.time(),
          continuous_usage = req.continuous_usage,
                response_id = (view and view.ID_PREFIX .. "-" or chat and "chatcmpl-" or "cmpl-") .. worker_tag .. "-" ..
                    next_request,
                n = req.n, best_of = req.best_of, show_logprobs = req.logprobs ~= nil, chat = chat, stream = req.stream,
                view = view, send_error = send_error, grammar_field = req.grammar_field }
    if view then -- (its stream's usage and stats come with the finish, which closes the response)
        r.public_id, r.include_usage = r.response_id:gsub("-", "_"), false
        -- a stored response's id: 128 random bits, not a count (without them, it is not stored),
        -- after 64 more that its items' ids take (responses.item_key): an item's id, which a
        -- client shows and sends back, gave the whole response id away
        if view.store then
            local random = shapes.random_hex(8 + 16)
            if random then
                r.public_id = "resp_" .. random
            else
                view.store = false
                for _, m in ipairs(view.echo) do if m[1] == "store" then m[2] = "false" end end
            end
        end
        if req.stream then
            local cached = math.huge -- (the views serve one prompt: its tokens cached as usage counts them)
            for _, choice in ipairs(made) do cached = math.min(cached, choice.cached) end
            view:start_stream(r.public_id, r.created, conf.model_id, req.prompt_tokens, cached)
        end
    end
    -- (best_of ranks the candidates by their tokens' log-probabilities: asked for, if not shown)
    local ranked = req.best_of > req.n
    request_options.logprobs = req.logprobs or (ranked and 0) or -1
    C.tl_engine_get_counters(engine, counters)
    -- A choice the K/V budget can never hold would be refused by the submit: said first, as
    -- the request's fault, before any choice is submitted (the budget: the engine's own).
    local budget = tonumber(counters.kv_budget_bytes)
    if budget > 0 then
        for _, choice in ipairs(made) do
            local share = tonumber(C.tl_session_max_kv_bytes(choice.ptr))
            if share > budget then
                free_made(1)
                local cfg, field = req.cfg, req.max_tokens_field or "max_tokens"
                -- (the modes' own rows: every beam's tokens, a drafted tree's; else the sequence's)
                local rows, smaller = "", ""
                if (cfg.beam_size or 0) >= 2 then
                    rows, smaller = (", and every beam's (beam_size %d)"):format(cfg.beam_size), ", a smaller beam_size"
                elseif cfg.speculative == "tree" then
                    rows, smaller = ", and a drafted tree's (max_nodes)", ", fewer max_nodes"
                elseif cfg.speculative == "chain" then
                    rows = ", and the drafted ones (draft_ahead)"
                end
                return send_error(400, ("the request may hold %.1f MB of K/V (its prompt's and %s's rows, %d tokens%s, at %d loops), " ..
                    "more than this server's K/V budget of %.1f MB a worker (--kv-budget-mb): ask fewer tokens (%s)%s, or fewer loops")
                    :format(share / 1048576, field, #req.prompts[choice.prompt] + cfg.max_tokens, rows, cfg.loops or model.default_loops,
                            budget / 1048576, field, smaller), field)
            end
        end
    end
    -- Every choice gets a place, or none is asked for: a request whose choices did not all fit
    -- was submitted in part, its first choices counted as admitted (tokens in) and then as
    -- cancelled. The free places are counted as the engine's submit counts them (scheduler.c:
    -- held sessions against max_active + max_queued); only this event loop submits to this
    -- engine, so they can only grow before the submits below.
    local free = counters.max_active + counters.max_queued - counters.active - counters.queued
    local needed = #made
    if free < needed then
        free_made(1)
        metrics.incr("rejected")
        local why = needed == 1 and ("every session place is taken (%d running, %d queued)"):format(conf.max_active, conf.max_queued)
                    or ("the request's %d choices need %d session places, and %d of %d are free"):format(needed, needed, math.max(free, 0),
                                                                                                      conf.max_active + conf.max_queued)
        return send_error(503, why .. ": retry later", nil, "overloaded_error", { ["Retry-After"] = "1" })
    end
    for k, choice in ipairs(made) do
        local p, ids = choice.prompt, req.prompts[choice.prompt]
        if C.tl_engine_submit_with(engine, choice.ptr, request_options, id_out) ~= 0 then
            local msg = ffi_string(C.tl_last_error())
            free_made(k)
            release_all(r, false)
            return send_error(500, "cannot submit: " .. msg, nil, "server_error")
        end
        local id = tonumber(id_out[0])
        if id == 0 then
            free_made(k)
            release_all(r, false)
            metrics.incr("rejected")
            return send_error(503, ("every session place is taken (%d running, %d queued): retry later")
                :format(conf.max_active, conf.max_queued), nil, "overloaded_error", { ["Retry-After"] = "1" })
        end
        -- a thinking model's reply (req.prompt_text: the chat prompt, which may open the block;
        -- where it does not, a grammar writes the reply from its first token and a block
        -- counts only where the grammar writes one)
        local read_reasoning = chat and reasoning_on
        local inside = thinks
        r.sts[#r.sts + 1] = {
            siblings = r.sts, -- (itself included: its phase is no longer "queued" when polled)
            id = id, index = #r.sts, phase = "queued", released = false, n_tokens = 0, stops = req.stops,
            cached = choice.cached, -- (its prompt's tokens from the prefix pool)
            prompt_tokens = #ids, echo = req.echo and req.echo[p], logprobs = request_options.logprobs >= 0,
            stop_strings = req.stop_strings, stop_names = req.stop_names, stop_ids = req.stop_ids, include_stop = req.include_stop,
            prompt_ids = ids, prompt_figures = prompt_figures[p],
            offset = 0, -- bytes of the choice's text so far (logprobs' text_offset)
            text_config = text_config_of(req.cfg),
            chat = chat, streaming = req.stream, prompt = p, tools = req.tools,
            logprob_entries = view and view.LOGPROB_ENTRIES,
            reasoning = read_reasoning and { inside = inside, reader = req.stream and reasoning.stream(inside),
                                             shown = req.include_reasoning } or nil,
        }
        metrics.gauge("queued", 1)
        metrics.incr("tokens_in", #ids)
    end
    made = {} -- (every one is the engine's now, released through r)
    -- A Lua error past this point (a bug reading an answer back) must not leave the engine's
    -- requests running with nobody to read them, holding their places until they end and
    -- their entries forever: they are released, and the client gets a 500 if nothing was sent.
    local ok, err = xpcall(req.stream and run_stream or run_blocking, debug.traceback, r)
    if ok then return end
    release_all(r, false)
    ngx_log(ngx.ERR, "tinyloop: ", tostring(err))
    if ngx.headers_sent then return ngx_exit(ngx.ERROR) end
    return r.send_error(500, "internal error reading the answer back (the server's log says where)", nil, "server_error")
end

function _M.completions()
    local body = post_body()
    if body then return serve(false, body) end
end

function _M.chat_completions()
    local body = post_body()
    if body then return serve(true, body) end
end

-- POST /v1/responses (OpenAI's Responses API): the chat request it means, answered as output
-- items and semantic events (tinyloop.server.responses).
function _M.responses()
    local body = post_body()
    if not body then return end
    local chat_body, view = responses.to_chat(body, responses_store and stored_conversation, responses_store and stored_item)
    if not chat_body then return send_error(view.status, view.message, view.param, view.type, nil, view.code) end
    -- (usage's reasoning_tokens: the reasoning's text as the tokenizer encodes it)
    view.count_tokens = function(text)
        local ids = model:encode(text)
        return ids and #ids or 0
    end
    return serve(true, chat_body, view)
end

-- POST /v1/messages (Anthropic's Messages API): the chat request it means, answered as content
-- blocks and Anthropic's stream events, errors in its shape (tinyloop.server.anthropic).
function _M.messages()
    local id = anthropic_request_id()
    local body = post_body()
    if not body then return end
    local chat_body, view = anthropic.to_chat(body)
    if not chat_body then return send_json(view.status, anthropic.error_body(view.status, view.message, view.details, id)) end
    view.request_id = id
    return serve(true, chat_body, view)
end

-- POST /v1/messages/count_tokens (Anthropic's): {"input_tokens": the prompt's tokens, as
-- /v1/messages would send it}.
function _M.count_tokens()
    local id = anthropic_request_id()
    local body = post_body()
    if not body then return end
    if not chat_prompts then return send_anthropic_error(500, request.template_unloaded(chat_error).message) end
    local chat_body, view = anthropic.to_chat(body, true)
    if not chat_body then return send_json(view.status, anthropic.error_body(view.status, view.message, view.details, id)) end
    view.request_id = id
    local req, err = request.parse_chat(chat_body, model, conf.model_id, conf.max_active, chat_prompts,
                                        { counting = true, max_stops = view.PARSE_OPTIONS.max_stops })
    if not req then
        local e = view:error(err)
        return send_json(e.status, e.body)
    end
    return send_json(200, '{"input_tokens":' .. req.prompt_tokens .. "}")
end

-- ------------------------------------------------------------------ embeddings

-- The inputs' embeddings (tl_embed_batch, over `tokens` ids in all), the JSON text of their entries
-- joined by commas (`as`: "float" arrays or "base64" strings; `shape`: wait.embed's; "raw":
-- the vectors' float32 bytes instead), computed and written in the thread pool: forward
-- passes, and over half a million numbers' text for a full request, not on the event loop
-- (but where the pool cannot take them: in_pool).
-- A worker runs conf.embed_jobs requests at once (the thread pool's VMs are the generation
-- waits'; the cores, the engine's): the others wait for a place up to conf.embed_wait_s, then
-- 503. A client that leaves stops its request after the slice of EMBED_SLICE inputs in hand.
-- name_of(i) (or nil) names input i (from 0) as the request did, in an engine error; norm:
-- llama.cpp's embd_normalize (shape "llamacpp"); keep (or nil): Ollama's dimensions, each
-- vector's first `keep` numbers made a unit vector. -> text | nil (`send` has answered the error).
local EMBED_SLICE = 16
local function embed_text(inputs, tokens, loops, pooling, normalize, as, shape, send, name_of, norm, keep)
    -- A client that leaves: while it waits for a place, the request ends there (cancelled:
    -- counted); holding one, its place is given back once the slice in the thread pool is done
    -- (that work cannot be stopped; a place given back at once would let clients that post and
    -- hang up run more than embed_jobs at a time). (on_abort is nil where lua_check_client_abort
    -- is off; registered before the wait, or nginx ended a waiting request uncounted.)
    local held, gone, waiting = false, false, true
    local function give_back()
        if held then held = false; embed_slots:post(1) end
    end
    local function leave() -- (the client left: its place back, counted, the request ended)
        give_back()
        metrics.incr("cancelled")
        return ngx_exit(499)
    end
    if ngx.on_abort(function()
        gone = true
        if waiting then return leave() end
    end) then
        gone = client_left()
    end
    if gone then return leave() end
    if not embed_slots:wait(conf.embed_wait_s) then
        waiting = false
        metrics.incr("rejected")
        return send(503, ("every embedding place is taken (%d a worker): retry later"):format(conf.embed_jobs), nil,
                    "overloaded_error", { ["Retry-After"] = "1" })
    end
    waiting, held = false, true
    local parts = {}
    for from = 1, #inputs, EMBED_SLICE do
        if gone then return leave() end
        local slice = {}
        for i = from, math.min(from + EMBED_SLICE - 1, #inputs) do slice[#slice + 1] = inputs[i] end
        local text, err = in_pool("embed", "computing embeddings on the event loop", embed_addr, last_error_addr,
                                  model_addr, slice, model.d_model, loops, pooling, normalize, as, shape, from - 1,
                                  norm or 2, keep)
        if not text then
            give_back()
            local why = tostring(err)
            -- (wait.embed names inputs by their place in `inputs`, from 0: name_of says what the request called it)
            if name_of then why = why:gsub("input (%d+)", function(i) return name_of(tonumber(i)) end, 1) end
            return send(500, "embedding failed: " .. why, nil, "server_error")
        end
        if gone then return leave() end -- (the client left while the slice ran)
        parts[#parts + 1] = text
    end
    give_back()
    metrics.incr("tokens_embedded", tokens)
    return concat(parts, shape == "raw" and "" or ",")
end

-- A rerank or score request's (request.parse_rerank's, parse_score's) pair scores: each the
-- cosine of two inputs' unit vectors (embed_text's "raw" float32 bytes), a sum in double: a
-- few thousand dot products, microseconds each, on the event loop. -> scores | nil (`send`
-- has answered the error).
local function similarity(req, send)
    local raw = embed_text(req.inputs, req.tokens, req.loops, req.pooling, true, "float", "raw", send,
                           function(i) return req.names[i + 1] end)
    if not raw then return nil end
    local d, vectors, scores = model.d_model, ffi_cast("const float *", raw), {}
    for k, pair in ipairs(req.pairs) do
        local a, b, dot = vectors + (pair[1] - 1) * d, vectors + (pair[2] - 1) * d, 0
        for j = 0, d - 1 do dot = dot + a[j] * b[j] end
        -- (unit vectors to within float32's rounding: a text with itself gave 1.0000000008)
        scores[k] = math.max(-1, math.min(1, dot))
    end
    return scores
end

-- POST /v1/embeddings (OpenAI's): {"object": "list", "data": [{"object": "embedding", "index",
-- "embedding"}], "model", "usage"}.
function _M.embeddings()
    local body = post_body()
    if not body then return end
    local req, err = request.parse_embeddings(body, model, conf.model_id)
    if not req then return send_request_error(err) end
    local data = embed_text(req.inputs, req.tokens, req.loops, req.pooling, req.normalize, req.encoding, "openai", send_error)
    if not data then return end
    return send_json(200, '{"object":"list","data":[' .. data .. '],"model":' .. encode(conf.model_id) ..
        ',"usage":{"prompt_tokens":' .. req.tokens .. ',"total_tokens":' .. req.tokens .. "}}")
end

-- POST /v1/rerank (also /rerank, /v2/rerank, /reranking, /v1/reranking: vLLM's, Jina's, Cohere's
-- and llama.cpp's clients): the
-- documents by the cosine of their embedding with the query's, best first, the top_n of
-- them: {"id", "model", "usage": {"prompt_tokens", "total_tokens"}, "results": [{"index", "relevance_score",
-- "document": {"text"}}]}; sent `texts`, TEI's bare array [{"index", "score"[, "text"]}].
function _M.rerank()
    local body = post_body()
    if not body then return end
    local req, err = request.parse_rerank(body, model, conf.model_id)
    if not req then return send_request_error(err) end
    local scores = similarity(req, send_error)
    if not scores then return end
    local order = {}
    for i = 1, #req.texts do order[i] = i end
    table.sort(order, function(a, b) return scores[a] > scores[b] or (scores[a] == scores[b] and a < b) end)
    -- each result in its API's shape: TEI's where texts was sent (as llama.cpp gives it), else
    -- vLLM's, Jina's and Cohere's
    local results = {}
    for rank = 1, req.top_n do
        local i = order[rank]
        local score, text = encode(scores[i]), req.texts[i]
        results[rank] = req.tei and
            ('{"index":' .. (i - 1) .. ',"score":' .. score .. (req.return_text and (',"text":' .. encode(text)) or "") .. "}") or
            ('{"index":' .. (i - 1) .. ',"relevance_score":' .. score ..
             (req.return_documents and (',"document":{"text":' .. encode(text) .. "}") or "") .. "}")
    end
    if req.tei then return send_json(200, "[" .. concat(results, ",") .. "]") end
    next_request = next_request + 1
    return send_json(200, '{"id":"rerank-' .. worker_tag .. "-" .. next_request .. '","model":' .. encode(conf.model_id) ..
        ',"usage":{"prompt_tokens":' .. req.tokens .. ',"total_tokens":' .. req.tokens .. '},"results":[' .. concat(results, ",") .. "]}")
end

-- POST /v1/score (also /score: vLLM's): text_1 against text_2 (1:1, 1:N or N:N), each pair's
-- score the cosine of their embeddings: {"id", "object": "list", "created", "model", "data":
-- [{"index", "object": "score", "score"}], "usage"}.
function _M.score()
    local body = post_body()
    if not body then return end
    local req, err = request.parse_score(body, model, conf.model_id)
    if not req then return send_request_error(err) end
    local scores = similarity(req, send_error)
    if not scores then return end
    local data = {}
    for k, score in ipairs(scores) do
        data[k] = '{"index":' .. (k - 1) .. ',"object":"score","score":' .. encode(score) .. "}"
    end
    next_request = next_request + 1
    return send_json(200, '{"id":"score-' .. worker_tag .. "-" .. next_request .. '","object":"list","created":' .. ngx.time() ..
        ',"model":' .. encode(conf.model_id) .. ',"data":[' .. concat(data, ",") .. '],"usage":{"prompt_tokens":' .. req.tokens ..
        ',"total_tokens":' .. req.tokens .. ',"completion_tokens":0}}')
end

-- ------------------------------------------------------------------ llama.cpp's API

-- What llama.cpp tokenizes itself in a request (texts mixed into a prompt's ids, logit_bias by
-- text); plain: a special token's text read as text (llama.cpp's parse_special false).
local PLAIN_TEXT = { parse_special = false }
local function llamacpp_tokenize(text, plain) return request.encode_text(model, text, plain and PLAIN_TEXT or nil) end

-- POST /completion (llama.cpp's server's): the /v1/completions request it means, answered in
-- llama.cpp's shape, streamed as data events where asked (tinyloop.server.llamacpp).
function _M.llamacpp_completion()
    local body = post_body()
    if not body then return end
    local completions_body, view = llamacpp.to_completions(body, model.has_tokenizer and llamacpp_tokenize or nil, model.vocab_size,
                                                           model.max_seq_len)
    if not completions_body then return send_llamacpp_error(view.status, view.message, nil, view.type) end
    return serve(false, completions_body, view)
end

-- POST /embedding (or /embeddings: llama.cpp's own): [{"index", "embedding": [[...]]}], each the
-- input's mean-pooled vector at the model's depth, scaled by embd_normalize.
function _M.llamacpp_embedding()
    local body = post_body()
    if not body then return end
    local req, err = llamacpp.embedding_request(body, model.has_tokenizer and llamacpp_tokenize or nil, model.vocab_size)
    if not req then return send_llamacpp_error(err.status, err.message, nil, err.type) end
    local inputs, tokens = request.embedding_inputs(model, req.input, req.field)
    if not inputs then return send_llamacpp_error(tokens.status, tokens.message, nil, tokens.type) end
    local entries = embed_text(inputs, tokens, model.default_loops, "mean", req.norm == 2, "float", "llamacpp",
                               send_llamacpp_error,
                               function(i) return type(req.input) == "string" and req.field or ("%s[%d]"):format(req.field, i) end,
                               req.norm)
    if not entries then return end
    return send_json(200, "[" .. entries .. "]")
end

-- GET /props: what llama.cpp's clients read of the server (the context, the slots, the defaults).
function _M.llamacpp_props()
    if not only_get() or not ready() then return end
    -- (the server's slots: each worker runs max_active; a worker's own told a client of two
    -- workers half the generations it may run at once)
    return send_json(200, llamacpp.props({ model_path = conf.model, n_ctx = model.max_seq_len,
                                           total_slots = conf.max_active * ngx.worker.count(),
                                           chat_template = chat_prompts and chat_prompts.template_text, version = _M._VERSION }))
end

-- ------------------------------------------------------------------ Ollama's API

-- POST /api/chat, /api/generate: the chat (or, raw, completions) request it means
-- (tinyloop.server.ollama), answered as Ollama's objects, streamed unless stream is false.
local function ollama_serve(to_chat)
    local body = post_body()
    if not body then return end
    local chat_body, view, chat = to_chat(body, conf.model_id, reasoning_on)
    if not chat_body then return send_ollama_error(view.status, view.message) end
    if view.load then return send_json(200, view:load_answer(ngx.now())) end
    return serve(chat ~= false, chat_body, view)
end
function _M.ollama_chat() return ollama_serve(ollama.chat_to_chat) end
function _M.ollama_generate() return ollama_serve(ollama.generate_to_chat) end

-- POST /api/embed (older: /api/embeddings): the inputs' mean-pooled embeddings at the model's
-- depth, as Ollama answers them (tinyloop.server.ollama).
local function ollama_embed(older)
    local body = post_body()
    if not body then return end
    local req, err = ollama.embed_request(body, conf.model_id, older)
    if not req then return send_ollama_error(err.status, err.message) end
    -- dimensions, Ollama's way: a unit vector's first N numbers, made a unit vector again,
    -- where 0 < N < the model's width; any other N is no request to shorten (OpenAI's route
    -- refuses them: request.check_dimensions)
    local keep = req.dimensions
    if keep and (keep <= 0 or keep >= model.d_model) then keep = nil end
    local started, tokens, vectors = now(), 0, ""
    if #req.inputs > 0 then
        -- (a single text is named as sent: input, or /api/embeddings' prompt; a list's by index)
        local lists
        lists, tokens = request.embedding_inputs(model, req.single and req.inputs[1] or req.inputs, older and "prompt" or "input",
                                                 nil, req.truncate)
        if not lists then return send_ollama_error(tokens.status, tokens.message) end
        vectors = embed_text(lists, tokens, model.default_loops, "mean", req.normalize, "float", "ollama", send_ollama_error, nil, nil,
                             keep)
        if not vectors then return end
    end
    return send_json(200, ollama.embed_answer(req, vectors, tokens, (now() - started) * 1000))
end
function _M.ollama_embed() return ollama_embed(false) end
function _M.ollama_embeddings() return ollama_embed(true) end

-- The served model as Ollama's listings describe it (once per worker).
local ollama_info
local function ollama_model()
    if not ollama_info then
        local info = model:info()
        ollama_info = { id = conf.model_id, size = info.weight_bytes, created = created_at, weight_dtype = model_types.weight_dtype,
                        parameters = info.n_params, context = model.max_seq_len, tools = chat_prompts ~= nil,
                        template = chat_prompts and chat_prompts.template_text or nil, thinking = reasoning_on }
    end
    return ollama_info
end

-- GET /api/tags (the models there are), /api/ps (those loaded: the same one), /api/version.
function _M.ollama_tags()
    if not only_get() or not ready() then return end
    return send_json(200, '{"models":[' .. ollama.model_entry(ollama_model()) .. "]}")
end
function _M.ollama_ps()
    if not only_get() or not ready() then return end
    return send_json(200, '{"models":[' .. ollama.model_entry(ollama_model(), true) .. "]}")
end
function _M.ollama_version()
    if not only_get() then return end
    return send_json(200, '{"version":' .. encode(ollama.API_VERSION) .. ',"tinyloop":' .. encode(_M._VERSION) .. "}")
end

-- POST /api/show {"model"} (or Ollama's older "name"): the model's details, template and
-- capabilities.
function _M.ollama_show()
    local body = post_body()
    if not body then return end
    local t = json_text.decode(body)
    -- (an empty model is none: Go clients send "model": "" beside the older "name")
    local name = type(t) == "table" and ((type(t.model) == "string" and t.model ~= "") and t.model or t.name)
    if type(name) ~= "string" then return send_ollama_error(400, 'the body must be {"model": NAME}') end
    if not ollama.names_model(name, conf.model_id) then
        return send_ollama_error(404, ("model %s not found (this server runs %s:latest)"):format(encode(name), conf.model_id))
    end
    return send_json(200, ollama.show(ollama_model()))
end

-- GET / (Ollama's clients' liveness probe, and anyone's first look).
function _M.root()
    if not only_get() then return end
    ngx.header["Content-Type"] = "text/plain"
    ngx_say("TinyLoop is running: ", conf.model_id, " (OpenAI's API at /v1, Anthropic's at /v1/messages, Ollama's at /api)")
end

-- /v1/responses/{id}: a stored response, GET (retrieve) or DELETE, and GET .../input_items; the
-- rest under /v1/responses/ (a response's cancel, input_tokens, compact) is not served.
function _M.stored_response()
    -- (read from the path's end: an app may mount the handler under a prefix of its own)
    local method, id = ngx.req.get_method(), ngx.var.uri:match("/responses/(resp_[^/]+)$")
    local listed = ngx.var.uri:match("/responses/(resp_[^/]+)/input_items$")
    if listed then -- the input it was made from, as Responses items (OpenAI's list and its paging)
        if not only_get() or not ready() then return end
        local _, messages, response = stored(listed)
        if not messages then return send_error(404, ("Response with id '%s' not found"):format(listed), nil, "invalid_request_error") end
        local args = ngx.req.get_uri_args()
        -- (digits only: tonumber read limit=0x10 as 16)
        local limit = args.limit == nil and 20 or type(args.limit) == "string" and args.limit:match("^%d+$") and tonumber(args.limit)
        if not limit then return send_error(400, "limit must be an integer in [1, 100]", "limit") end
        local list, err, param = responses.input_items(messages, listed, args.order or "desc", limit,
                                                       type(args.after) == "string" and args.after or nil, response)
        if not list then return send_error(param and 400 or 500, err, param) end
        return send_json(200, list)
    end
    if id and (method == "GET" or method == "HEAD" or method == "DELETE") then
        if not ready() then return end
        local previous, _, response = stored(id)
        if not previous then
            return send_error(404, ("Response with id '%s' not found (responses made with store: false are not kept; the " ..
                              "oldest go when the store is full)"):format(id), nil, "invalid_request_error")
        end
        if method ~= "DELETE" then
            -- (?stream=true replays a background response's events, OpenAI's SDKs'
            -- retrieve(stream=True): the JSON a stream's reader got was no event)
            local args = ngx.req.get_uri_args()
            if args.stream == "true" or args.starting_after ~= nil then
                return send_error(400, "stream: a stored response's events are streamed while it runs in the background " ..
                                  "(background: true), which this server does not run: each is answered whole or " ..
                                  "streamed as it is made. GET it without stream for the response itself", "stream")
            end
            return send_json(200, response)
        end
        responses_store:delete(store_key(id))
        return send_json(200, '{"id":' .. encode(id) .. ',"object":"response","deleted":true}')
    end
    if id then
        return send_uri_error(405, "method " .. method .. " is not allowed here: use GET or DELETE", nil, nil,
                              { Allow = "GET, HEAD, DELETE" })
    end
    return send_error(404, ("%s %s is not served here: a stored response is GET or DELETE /v1/responses/{id}, and GET " ..
                      "/v1/responses/{id}/input_items (nothing runs in the background to cancel, nor is compacted)")
                      :format(method, ngx.var.uri), nil, "not_found_error", nil, "unknown_url")
end

return _M

-- The fleet ledger: fleet-wide admission for N gateway replicas, one atomic script per decision.
--
-- This is a port of the in-process core, the Scheduler of sidecar/scheduler/, which is the
-- specification: same reservation rule, same dispatch order, same victim choice, same
-- float arithmetic on times. tests/test_ledger_differential.py drives both with the same
-- random operations and requires identical decisions. Change the core first, then this.
--
-- A function library (FUNCTION LOAD once, then FCALL): its code and closures are built once
-- per server, not per call, which was most of a small operation's cost as an EVAL script.
-- sidecar/coordination/ledger.py loads it under a name carrying a digest of this text
-- (__LIBRARY__, __FUNCTION__ below), so replicas of different versions never share code.
--
-- Call: FCALL __FUNCTION__ 1 <prefix> <op> <now> <seen> <settle> <replica> <incarnation> args...
--   prefix  "pg:{<fleet>}": every key below is prefix..":<name>", so all share the {fleet}
--           hash tag and one Redis Cluster slot (the derived keys are not declared; they are in
--           the declared key's slot, which is what cluster mode checks).
--   now     "": the server's TIME, so replicas' clock skew cannot steal slots. A number is
--           refused, except by the test build (see clock() below), which tests drive with
--           a fake clock.
--   seen    the highest generation (P:gen) the caller has had acknowledged, 0 if none. Every
--           call increments P:gen; finding it below ``seen`` means the server holds an
--           older copy than one the caller already saw (an RDB/AOF restore, a failover to a
--           lagging replica, the key lost): the ledger lost writes. See lose().
--   settle  the caller's settling window (seconds), used if this call finds a loss.
--   replica, incarnation: the caller (replica id, and a random token per process); a
--           new incarnation of a live replica takes over its predecessor's admissions
--           (take_over()). Empty: a caller that is not a replica (a test's observer).
-- Every argument is checked before anything is read or written (check_call(): numbers finite
-- and within their field's range, names and ids well formed, an op's arity exact); a bad one
-- is refused with "ERR ledger: <field>: <why>" and changes nothing, so no caller, whatever
-- its credentials, can make later calls fail or freeze the fleet with one (a settle of inf,
-- a seen of 1e20, a class of 7, a batch of n = -1).
-- Reply: {generation, loss cause or "", taken over (groups: id cls first_byte tenant),
--         the operation's reply, live replicas}. The live replica count rides on every
--         reply (arrive included), so a replica's degraded share is never computed from a
--         count older than its last reply (see fleet_reply for which replicas may not have
--         heard of a newcomer yet).
-- Class numbers are sidecar.classes.PriorityClass values: 0 bulk, 1 default, 2 interactive,
-- 3 system. Times are seconds (float); they are stored with %.17g so they round-trip exactly.
--
-- Keys (P = prefix):
--   P:replicas  ZSET replica -> expiry         P:reports  HASH replica -> "cap r3 r2 r1 r0"
--   P:digests   HASH replica -> config digest  P:cfg      HASH class -> "floor share qsize
--   P:fleet     HASH cap, r0..r3 (derived from    timeout starve preempt"
--               the live replicas' reports)    P:inflight HASH class -> admissions in flight
--   P:adm       HASH id -> "replica cls admitted_at first_byte tenant"; first_byte "0"/"1",
--               or "2"/"3" for a record rebuilt after P:adm was lost whose class is a guess
--               (rebuild_admissions()): never a candidate until its owner's resync fixes it
--   P:pre:<c>   ZSET id -> mark sequence: class c's preemption candidates (owner has a stop
--               channel, no first byte yet), in the order they became candidates
--   P:q:<c>     ZSET id -> arrival sequence: class c's waiters, FIFO by arrival at the ledger
--   P:tcfg      HASH class -> "limit mode": the per-tenant queue limit in force ("-": none)
--               and the kind of class queue (ClassQueues in sidecar/scheduler/queues.py):
--               "f" one FIFO, "t" per-tenant FIFOs served by arrival (a limit, no fair
--               queuing), "w<sha1 of the weights>" fair queuing. Apart from P:cfg, whose
--               format older versions of this library read during a rolling upgrade.
--   P:wt:<c>    HASH tenant -> weight (fair queuing only; absent: 1)
--   A class whose mode is not "f" also keeps, as TenantQueue does:
--   P:flow:<c>  HASH tenant -> its turn's member in P:turn:<c> ("" without fair queuing):
--               the tenants with a waiter
--   P:tq:<c>:<t> ZSET id -> arrival sequence: tenant t's waiters (its FIFO)
--   P:turn:<c>  ZSET "<seq, 16 digits> <tenant>" -> tag (virtual finish time): one turn per
--               waiting tenant; the smallest tag goes next, ties to the smaller seq (the
--               turn tagged first), as the core's heap of (tag, seq, tenant)
--   P:vt        HASH class -> the fair queue's virtual time (absent: 0)
--   P:w         HASH id -> "replica cls enqueued_at deadline tenant"
--   P:dl        ZSET id -> deadline (queue timeouts, all classes)
--   P:own:<r>   SET of replica r's admissions and waiters (reclaimed when r expires)
--   P:ev:<r>    LIST of notifications for replica r (RPUSH here, blocking pop by the owner):
--               "grant <waited> <flags> <id>" (flags: "-", or letters s=starvation,
--               p=by preemption), "preempt <by_class> <id>", "expired <waited> <id>"
--   P:ended     HASH id -> why it ended; P:endq ZSET id -> when (forgotten after keep_ended s)
--   P:seq       counter for arrival and candidate order
--   P:returning SET of replicas registered by a call that found them unknown (settle > 0),
--               or live when a loss was found (lose()), until a resync of theirs finds the
--               fleet settled: their arrivals answer "unregistered" (a request pipelined
--               right behind that call must not be admitted against a ledger still missing
--               admissions), their heartbeats "new"
--   P:gen       generation: incremented by every call (see ``seen`` above)
--   P:server    run_id of the server process that last wrote the ledger (check_server())
--   P:inc       HASH replica -> incarnation of the process registered under that id
--   P:reg       HASH replica -> the generation of the call that registered it (it was not
--               live before that call)
--   P:heard     HASH replica -> the ``seen`` generation its last registering call carried:
--               every reply up to it reached that replica (with the live count)
--   P:lapsed    ZSET replica -> until when a replica whose registration lapsed still counts
--               as not having heard of the others (one ttl after it was reaped; see
--               unheard_by); removed when it registers again
--   P:retired   HASH replica -> the incarnations a newer process of that id took over (the
--               last few): a call from one is refused ("replica_id_in_use"): two live
--               processes share the id (see take_over())
--   P:order     HASH replica -> "<incarnation> <order>": the newest resync of that process
--               the ledger applied (each process numbers its resyncs): one it sent before
--               that runs only now changes nothing (stale_resync())
--   P:meta      HASH: a second copy of what P:fleet holds that no other key can give back
--               (ttl, keep, settle_secs, the settling window: settle, frozen) and of the class
--               settings as last stored (class0..3: encode_class's text), so that losing
--               P:fleet, P:cfg, P:tcfg or P:wt:<c> loses nothing (see "Keys lost" below)
--   P:tok:<t>   HASH, tenant t's token budgets (sidecar/tokens.py's TokenBook, fleet-wide):
--               r (tokens reserved by its running requests), w (its windows as last given,
--               "name secs;..." for a reaped reservation's charge), u:<name> (tokens settled
--               in the window's period), s:<name> (that period's start)
--   P:tokres    HASH id -> "replica amount tenant": an open reservation
--   P:tokown:<r> SET of replica r's open reservations: charged at their amount when r is
--               reaped (no final entry will settle them), as a pool's sweep does in process
--   P:tokgone   ZSET id -> until when: reservations cancelled before they were made (a
--               tok_reserve whose reply was lost, run after its caller's cancel): refused
--               if they come, for TOK_GONE_SECS
--   P:ghosts    ZSET id -> expiry: admissions the ledger knows it counted but whose ids were
--               lost (see rebuild_admissions()); held by the pseudo-owner GHOST, "{lost}",
--               which no replica id can be (no braces), in P:adm and P:own:{lost}
--
-- Keys lost (eviction, an operator's DEL): any single key, and keys lost one after another
-- with a call in between, are noticed by the next call, or the next heartbeat where only
-- fairness or liveness (never capacity) waits for it, and rebuilt from the keys that hold
-- the same facts, so that the ledger never counts fewer admissions than run:
--   P:adm       from the owners' sets (ids) and the counters (how many per class; P:pre:<c>
--               names a candidate's class): placeholders, class "unsure" until the owner's
--               next resync lists them; a remainder no set names is held by ghosts for one
--               settling window (every live replica resyncs within it, re-adding its own)
--   P:inflight  from the records (as before); both lost together: the owners' sets
--   P:replicas  from P:reports: each registered again for one ttl (a dead one is reaped then)
--   P:reports   the fleet's capacity is never raised by a missing report: a live replica
--               without one counts as the fleet's last capacity until it reports again
--   P:fleet     capacity from P:reports, the rest from P:meta (and P:meta from P:fleet)
--   P:gen       carried past any generation a replica can have seen (GEN_JUMP)
--   P:seq       continued after the highest sequence still queued or a candidate
--   P:dl        from the waiters' records; P:q:<c> from them at the next heartbeat
--   P:cfg, P:tcfg, P:wt:<c>  from P:meta; P:endq from P:ended; P:server rewritten
--   P:pre:<c>   the owner's next resync marks its listed candidates again
--   P:order     not rebuilt: each replica's next resync writes its entry again (until then a
--               resync of its that runs late, after a newer one, is applied as it would
--               have been before this key existed)
-- Each rebuild is reported as the reply's cause ("admissions_rebuilt", "state_rebuilt",
-- "counters_lost", "owners_lost"): none of them is a data loss, so nobody settles for it.

-- Set at the start of every call (run, at the end): the library's state outlives a call.
local P, now
local loss = ''  -- the cause of a loss (or a rebuild) this call found ('' none), for the reply
local taken = {} -- what this call took over from a predecessor (take_over), for the reply
local taken_ids = {}
local caller, caller_inc, caller_settle = '', '', 0
local caller_seen, gen = 0, 0
local lost = false -- lose() ran in this call
local caller_prev = false -- P:inc's incarnation for the caller (retired_caller(), take_over())

-- A rebuild this call made (see "Keys lost"): reported unless a loss or another rebuild
-- already is (lose() overrides it: a data loss is what the replicas must act on).
local function note(cause)
  if loss == '' then loss = cause end
end
local K_REPLICAS, K_REPORTS, K_DIGESTS, K_CFG, K_FLEET, K_INF, K_ADM, K_W, K_DL, K_ENDED,
  K_ENDQ, K_SEQ, K_RETURNING, K_GEN, K_INC, K_SERVER, K_TCFG, K_VT, K_REG, K_HEARD, K_LAPSED,
  K_RETIRED, K_META, K_GHOSTS, K_ORDER, K_TOKRES, K_TOKGONE

local function set_prefix(p)
  P = p
  K_REPLICAS = P .. ':replicas'
  K_REPORTS = P .. ':reports'
  K_DIGESTS = P .. ':digests'
  K_CFG = P .. ':cfg'
  K_FLEET = P .. ':fleet'
  K_INF = P .. ':inflight'
  K_ADM = P .. ':adm'
  K_W = P .. ':w'
  K_DL = P .. ':dl'
  K_ENDED = P .. ':ended'
  K_ENDQ = P .. ':endq'
  K_SEQ = P .. ':seq'
  K_RETURNING = P .. ':returning'
  K_GEN = P .. ':gen'
  K_SERVER = P .. ':server'
  K_INC = P .. ':inc'
  K_TCFG = P .. ':tcfg'
  K_VT = P .. ':vt'
  K_REG = P .. ':reg'
  K_HEARD = P .. ':heard'
  K_LAPSED = P .. ':lapsed'
  K_RETIRED = P .. ':retired'
  K_META = P .. ':meta'
  K_GHOSTS = P .. ':ghosts'
  K_ORDER = P .. ':order'
  K_TOKRES = P .. ':tokres'
  K_TOKGONE = P .. ':tokgone'
end
local function k_pre(c) return P .. ':pre:' .. c end
local function k_q(c) return P .. ':q:' .. c end
local function k_tq(c, t) return P .. ':tq:' .. c .. ':' .. t end
local function k_turn(c) return P .. ':turn:' .. c end
local function k_flow(c) return P .. ':flow:' .. c end
local function k_wt(c) return P .. ':wt:' .. c end
local function k_own(r) return P .. ':own:' .. r end
local function k_tok(t) return P .. ':tok:' .. t end
local function k_tokown(r) return P .. ':tokown:' .. r end
local function k_ev(r) return P .. ':ev:' .. r end

local REAPED = 'replica_expired'
-- The pseudo-owner of admissions whose ids were lost (rebuild_admissions()); braces make it
-- no replica's id.
local GHOST = '{lost}'

local function fmt(x) return string.format('%.17g', x) end
-- An integer as Redis stores one (redis.call would write a Lua number with %.14g).
local function int(x) return string.format('%.0f', x) end

-- Split on single spaces into n fields; the last field keeps the rest (tenants may hold spaces).
local function split(s, n)
  local out = {}
  local pos = 1
  for _ = 1, n - 1 do
    local i = string.find(s, ' ', pos, true)
    out[#out + 1] = string.sub(s, pos, i - 1)
    pos = i + 1
  end
  out[#out + 1] = string.sub(s, pos)
  return out
end

-- -------------------------------------------------------------------------- arguments
-- Every call's arguments are checked here, all of them, before the call reads or writes
-- anything (run()): a refused call changes nothing. The ranges are wide enough for any
-- configuration the sidecar accepts (ledger.py clamps what could exceed them) and narrow
-- enough that no value can break a later call: a generation stays an exact integer, a
-- time stays finite, a registration or a settling window ends within a day.

local MAX_SECS = 1e9            -- a time span: a queue timeout, a starvation threshold, an age
local MAX_TTL = 86400           -- a registration's ttl, a settling window, ended ids' memory
local MAX_COUNT = 2147483647    -- capacity, reservations, queue sizes, per-tenant limits
local MAX_GEN = 2 ^ 50          -- a generation a caller says it saw
local GEN_JUMP = 2 ^ 32         -- past any generation a replica can have seen (P:gen lost)
local MAX_NAME, MAX_ID, MAX_TENANT = 128, 256, 1024
local TEST_BUILD = false
--[[TEST_CLOCK
TEST_BUILD = true
TEST_CLOCK]]

-- ReleaseReason (sidecar/scheduler/lifecycle.py); a test checks they agree.
local REASONS = {completed = true, cancelled = true, preempted = true, lease_expired = true}
local BATCHABLE = {arrive = true, release = true, cancel = true, mark_preemptible = true,
                   mark_first_byte = true, tick = true}

local function finite(x) return x == x and x > -math.huge and x < math.huge end

-- A decimal number as ledger.py writes one (repr of a float, str of an int), finite.
local function num(s)
  if type(s) ~= 'string' or #s == 0 or #s > 40 then return nil end
  -- (the common case first: digits only)
  if not string.find(s, '^%d+$') and not string.find(s, '^[%-%+]?[%d%.]+[eE]?[%-%+]?%d*$') then
    return nil
  end
  local n = tonumber(s)
  if n == nil or not finite(n) then return nil end
  return n
end

local function fail(field, value, want)
  local shown = string.format('%q', string.sub(tostring(value), 1, 40))
  error(field .. ' ' .. shown .. ': ' .. want, 0)
end

local function a_num(field, s, lo, hi)
  local n = num(s)
  if n == nil or n < lo or n > hi then
    fail(field, s, 'must be a finite number in [' .. lo .. ', ' .. hi .. ']')
  end
  return n
end

local function a_pos(field, s, hi)
  local n = num(s)
  if n == nil or n <= 0 or n > hi then
    fail(field, s, 'must be a finite number in (0, ' .. hi .. ']')
  end
  return n
end

local function a_int(field, s, lo, hi)
  local n = num(s)
  if n == nil or n ~= math.floor(n) or n < lo or n > hi then
    fail(field, s, 'must be an integer in [' .. int(lo) .. ', ' .. int(hi) .. ']')
  end
  return n
end

local function a_flag(field, s)
  if s ~= '0' and s ~= '1' then fail(field, s, 'must be 0 or 1') end
end

local function a_name(field, s)
  if type(s) ~= 'string' or #s < 1 or #s > MAX_NAME or string.find(s, '[%s{}]') then
    fail(field, s, 'must be 1..' .. MAX_NAME .. ' characters without spaces or braces')
  end
end

-- (an id is only ever a hash field, a set member or the last word of a notification: any
-- character will do, and one a periodic access-log entry brought must not fail a call)
local function a_id(field, s)
  if type(s) ~= 'string' or #s < 1 or #s > MAX_ID then
    fail(field, s, 'must be 1..' .. MAX_ID .. ' bytes')
  end
end

local function a_tenant(field, s)
  if type(s) ~= 'string' or #s > MAX_TENANT then
    fail(field, s, 'must be at most ' .. MAX_TENANT .. ' bytes')
  end
end

local function a_arity(op, a, n)
  if #a ~= n then fail(op, #a, 'takes ' .. n .. ' arguments') end
end

-- A class as ledger.py encode_class writes it: "floor share qsize timeout starve preempt
-- fair limit", then under fair queuing "<weight> <bytes> <tenant>" per weighted tenant.
-- -> the first six fields (P:cfg), fair, limit, the weights' text, the weights {tenant, w...}.
-- Malformed (a missing field, a number out of range, a tenant running past the end): error.
local function parse_class(s)
  if type(s) ~= 'string' then fail('class', s, 'missing') end
  local f, pos = {}, 1
  for i = 1, 8 do
    local j = string.find(s, ' ', pos, true)
    if j == nil then
      if i < 8 then fail('class', s, 'must have 8 fields') end
      f[8] = string.sub(s, pos)
      pos = #s + 2
    else
      f[i] = string.sub(s, pos, j - 1)
      pos = j + 1
    end
  end
  a_int('class reserved_floor', f[1], 0, MAX_COUNT)
  a_num('class reserved_per_slot', f[2], 0, MAX_COUNT)
  a_int('class queue_size', f[3], 0, MAX_COUNT)
  a_num('class queue_timeout_secs', f[4], 0, MAX_SECS)
  a_num('class starvation_threshold_secs', f[5], 0, MAX_SECS)
  a_flag('class can_preempt', f[6])
  a_flag('class fair_queuing', f[7])
  if f[8] ~= '-' then a_int('class max_queued_per_tenant', f[8], 0, MAX_COUNT) end
  local rest = ''
  if pos <= #s then rest = string.sub(s, pos) end
  if f[7] ~= '1' and rest ~= '' then fail('class', s, 'tenant weights without fair queuing') end
  local weights = {}
  pos = 1
  while pos <= #rest do
    local k = string.find(rest, ' ', pos, true)
    local n = k and string.find(rest, ' ', k + 1, true)
    if n == nil then fail('class tenant weight', string.sub(rest, pos), 'malformed') end
    a_pos('class tenant weight', string.sub(rest, pos, k - 1), 1e300)
    local len = a_int('class tenant length', string.sub(rest, k + 1, n - 1), 0, MAX_TENANT)
    if n + len > #rest or (n + len < #rest and string.sub(rest, n + len + 1, n + len + 1) ~= ' ')
    then
      fail('class tenant', string.sub(rest, n + 1), 'runs past its length')
    end
    weights[#weights + 1] = string.sub(rest, n + 1, n + len)
    weights[#weights + 1] = string.sub(rest, pos, k - 1)
    pos = n + len + 2
  end
  return table.concat(f, ' ', 1, 6), f[7] == '1', f[8], rest, weights
end

-- heartbeat args: replica ttl report force cfg0 cfg1 cfg2 cfg3 digest keep_ended settle
local function check_heartbeat(a, who)
  if a[1] ~= who or who == '' then fail('replica', a[1], 'must be the calling replica') end
  a_pos('ttl', a[2], MAX_TTL)
  local r = {string.match(a[3] or '', '^(%d+) (%d+) (%d+) (%d+) (%d+)$')}
  if #r ~= 5 then fail('report', a[3], 'must be "capacity r3 r2 r1 r0", five integers') end
  for _, v in ipairs(r) do a_int('report', v, 0, MAX_COUNT) end
  a_flag('force', a[4])
  for c = 0, 3 do
    local ok, err = pcall(parse_class, a[5 + c])
    if not ok then error('class ' .. c .. ' ' .. err, 0) end
  end
  if type(a[9]) ~= 'string' or #a[9] < 1 or #a[9] > 256 or string.find(a[9], '%s') then
    fail('digest', a[9], 'must be 1..256 characters without spaces')
  end
  a_num('keep_ended', a[10], 0, MAX_TTL)
  a_num('settle', a[11], 0, MAX_TTL)
end

-- groups of (id cls first_byte preemptible tenant) from a[from]
local function check_holdings(a, from, lowest)
  if (#a - from + 1) % 5 ~= 0 then fail('holdings', #a - from + 1, 'come in groups of 5') end
  for i = from, #a, 5 do
    a_id('id', a[i])
    a_int('class', a[i + 1], lowest, 3)
    a_flag('first_byte', a[i + 2])
    a_flag('preemptible', a[i + 3])
    a_tenant('tenant', a[i + 4])
  end
end

local function check_ids(a)
  for _, id in ipairs(a) do a_id('id', id) end
end

local CHECK = {}
CHECK.heartbeat = function(a, who)
  a_arity('heartbeat', a, 11)
  check_heartbeat(a, who)
end
CHECK.reregister = function(a, who)
  if #a < 11 then fail('reregister', #a, 'takes 11 arguments and holdings') end
  check_heartbeat(a, who)
  check_holdings(a, 12, 0)
end
CHECK.adopt = CHECK.reregister
CHECK.resync = function(a, who)
  if #a < 13 then fail('resync', #a, 'takes 13 arguments and holdings') end
  check_heartbeat(a, who)
  a_num('min_age', a[12], 0, MAX_SECS)
  a_int('order', a[13], 1, MAX_GEN)
  check_holdings(a, 14, -2)
end
CHECK.arrive = function(a, who)
  a_arity('arrive', a, 4)
  -- (the caller's name is checked with the call's header)
  if a[1] ~= who or who == '' then fail('replica', a[1], 'must be the calling replica') end
  a_id('id', a[2])
  a_int('class', a[3], 0, 3)
  a_tenant('tenant', a[4])
end
CHECK.release = function(a)
  a_arity('release', a, 2)
  a_id('id', a[1])
  if not REASONS[a[2]] then
    fail('reason', a[2], 'must be completed, cancelled, preempted or lease_expired')
  end
end
CHECK.cancel = function(a)
  a_arity('cancel', a, 1)
  a_id('id', a[1])
end
CHECK.mark_preemptible = check_ids
CHECK.mark_first_byte = check_ids
-- Token budgets: windows as "name secs limit" triplets after their count (tokens.Window:
-- secs 0 is the calendar month).
local MAX_TOKENS = 1e12
local MAX_WINDOW = 31 * 86400
local function check_windows(a, from, op)
  local n = a_int('windows', a[from], 0, 8)
  if #a ~= from + 3 * n then fail(op, #a, 'takes ' .. (from + 3 * n) .. ' arguments') end
  for i = from + 1, from + 3 * n, 3 do
    if type(a[i]) ~= 'string' or not string.find(a[i], '^%w+$') or #a[i] > 16 then
      fail('window', a[i], 'must be 1..16 letters and digits')
    end
    local secs = a_int('window seconds', a[i + 1], 0, MAX_WINDOW)
    if secs ~= 0 and secs < 60 then fail('window seconds', a[i + 1], 'must be 0 or >= 60') end
    a_int('window tokens', a[i + 2], 0, MAX_TOKENS)
  end
end
CHECK.tok_reserve = function(a, who)
  if a[1] ~= who or who == '' then fail('replica', a[1], 'must be the calling replica') end
  a_id('id', a[2])
  a_tenant('tenant', a[3])
  a_int('tokens', a[4], 0, MAX_TOKENS)
  a_flag('enforce', a[5])
  a_flag('reserve', a[6])
  check_windows(a, 7, 'tok_reserve')
end
CHECK.tok_settle = function(a)
  a_id('id', a[1])
  a_int('tokens', a[2], 0, MAX_TOKENS)
  check_windows(a, 3, 'tok_settle')
end
CHECK.tok_cancel = function(a)
  a_arity('tok_cancel', a, 1)
  a_id('id', a[1])
end
CHECK.tok_view = function(a)
  if #a < 1 or #a > 64 then fail('tok_view', #a, 'takes 1..64 tenants') end
  for _, t in ipairs(a) do a_tenant('tenant', t) end
end
CHECK.tick = function(a) a_arity('tick', a, 0) end
CHECK.snapshot = function(a) a_arity('snapshot', a, 0) end
CHECK.multi = function(a, who)
  local i = 1
  while i <= #a do
    local n = a_int('multi count', a[i], 1, #a - i)
    local name = a[i + 1]
    if CHECK[name] == nil then
      error('unknown ledger op ' .. string.format('%q', string.sub(tostring(name), 1, 40)), 0)
    end
    if not BATCHABLE[name] then fail('multi op', name, 'cannot be batched') end
    local args = {}
    for j = i + 2, i + n do args[#args + 1] = a[j] end
    CHECK[name](args, who)
    i = i + n + 1
  end
end

-- Call headers (prefix, replica, incarnation, settle) that passed: the same few every call.
local good_callers, good_count = {}, 0

-- The whole call: FCALL fn 1 <prefix> <op> <now> <seen> <settle> <replica> <incarnation>
-- args. -> the op's arguments.
local function check_call(keys, argv)
  if #keys ~= 1 then fail('keys', #keys, 'must be one prefix') end
  local op = argv[1]
  if type(op) ~= 'string' or CHECK[op] == nil then
    error('unknown ledger op ' .. string.format('%q', string.sub(tostring(op), 1, 40)), 0)
  end
  if argv[2] ~= '' then
    if not TEST_BUILD then error('a caller clock is refused (test build only)', 0) end
    a_num('now', argv[2], 0, 1e18)
  end
  local who = tostring(keys[1]) .. ' ' .. tostring(argv[5]) .. ' ' .. tostring(argv[6]) .. ' '
    .. tostring(argv[4])
  if not good_callers[who] then
    if type(keys[1]) ~= 'string' or #keys[1] > 300
        or not (string.find(keys[1], '^pg:{[^%s{}]+}$')
                or string.find(keys[1], '^pg:{[^%s{}]+}:pool:[^%s{}]+$')) then
      fail('key', keys[1], 'must be one prefix pg:{<fleet>} or pg:{<fleet>}:pool:<pool>')
    end
    a_num('settle', argv[4], 0, MAX_TTL)
    if argv[5] ~= '' then a_name('caller', argv[5]) end
    local inc = argv[6]
    if type(inc) ~= 'string' or #inc > 64
        or (inc ~= '' and not string.find(inc, '^[%w_%-]+$')) then
      fail('incarnation', inc, 'must be up to 64 letters, digits, "_" or "-"')
    end
    if good_count >= 1000 then good_callers, good_count = {}, 0 end
    good_callers[who] = true
    good_count = good_count + 1
  end
  a_int('seen', argv[3], 0, MAX_GEN)
  local args = {}
  for i = 7, #argv do args[#args + 1] = argv[i] end
  CHECK[op](args, argv[5])
  return args
end

-- ------------------------------------------------------------------------------ records

local function get_adm(id)
  local s = redis.call('HGET', K_ADM, id)
  if not s then return nil end
  local f = split(s, 5)
  return {id = id, replica = f[1], cls = tonumber(f[2]), admitted_at = tonumber(f[3]),
          first_byte = f[4] == '1' or f[4] == '3', unsure = f[4] == '2' or f[4] == '3',
          tenant = f[5]}
end

local function put_adm(a)
  local fb = (a.first_byte and 1 or 0) + (a.unsure and 2 or 0)
  redis.call('HSET', K_ADM, a.id, a.replica .. ' ' .. a.cls .. ' ' .. fmt(a.admitted_at) .. ' '
             .. fb .. ' ' .. a.tenant)
end

local function get_waiter(id)
  local s = redis.call('HGET', K_W, id)
  if not s then return nil end
  local f = split(s, 5)
  return {id = id, replica = f[1], cls = tonumber(f[2]), enqueued_at = tonumber(f[3]),
          deadline = tonumber(f[4]), tenant = f[5]}
end

-- ------------------------------------------------------------------------ fleet state

-- Loaded once per call after reaping, then kept in step with every write.
local cap, res, inf, total = 0, {0, 0, 0, 0}, {}, 0
local keep = nil -- how long ended ids are remembered (seconds; from the last heartbeat)
local cfg = nil
-- P:fleet was there at the last load (cap is written by every registration), and until when
-- a settling window it holds runs (0: none).
local fleet_kept, window = true, 0
local store_cfg -- defined with the operations; load_cfg restores a lost configuration with it

local function load_state()
  local f = redis.call('HMGET', K_FLEET, 'cap', 'r0', 'r1', 'r2', 'r3', 'keep', 'settle',
                       'frozen')
  fleet_kept = f[1] ~= false
  cap = tonumber(f[1]) or 0
  for c = 0, 3 do res[c] = tonumber(f[c + 2]) or 0 end
  keep = tonumber(f[6])
  window = math.max(tonumber(f[7]) or 0, tonumber(f[8]) or 0)
  local n = redis.call('HMGET', K_INF, '0', '1', '2', '3')
  total = 0
  for c = 0, 3 do
    inf[c] = tonumber(n[c + 1]) or 0
    total = total + inf[c]
  end
end

-- P:fleet's fields that no other key gives back, copied to P:meta (see "Keys lost").
local META = {'ttl', 'keep', 'settle_secs', 'settle', 'frozen'}

-- Copies META's fields that ``from`` has into ``to`` (absent ones stay as they are).
local function copy_meta(from, to)
  local v = redis.call('HMGET', from, unpack(META))
  local out = {}
  for i, k in ipairs(META) do
    if v[i] then
      out[#out + 1] = k
      out[#out + 1] = v[i]
    end
  end
  if #out > 0 then redis.call('HSET', to, unpack(out)) end
end

local function mirror()
  copy_meta(K_FLEET, K_META)
end

-- The class settings as last stored (P:meta class0..3), for a configuration key lost
-- between two registrations. False when there is no copy (nothing was ever stored).
local function restore_cfg()
  local m = redis.call('HMGET', K_META, 'class0', 'class1', 'class2', 'class3')
  if not (m[1] and m[2] and m[3] and m[4]) then return false end
  for i = 1, 4 do
    if not pcall(parse_class, m[i]) then return false end -- not ours: no copy
  end
  store_cfg({[5] = m[1], [6] = m[2], [7] = m[3], [8] = m[4]})
  note('state_rebuilt')
  return true
end

-- ``stored_only``: what is stored, without restoring a lost key (store_cfg's "before").
local function load_cfg(stored_only)
  if cfg then return cfg end
  local raw = redis.call('HMGET', K_CFG, '0', '1', '2', '3')
  local tenants = redis.call('HMGET', K_TCFG, '0', '1', '2', '3')
  if not stored_only and (not raw[1] or not tenants[1]) and restore_cfg() then
    return load_cfg()
  end
  cfg = {}
  for c = 0, 3 do
    if raw[c + 1] then
      local f = split(raw[c + 1], 6)
      cfg[c] = {queue_size = tonumber(f[3]), timeout = tonumber(f[4]),
                starve = tonumber(f[5]), preempt = f[6] == '1'}
    else
      -- No configuration stored (data loss before any replica re-registered): queue nothing.
      cfg[c] = {queue_size = 0, timeout = 0, starve = 1e308, preempt = false}
    end
    local mode = 'f'
    if tenants[c + 1] then
      local t = split(tenants[c + 1], 2)
      cfg[c].limit = tonumber(t[1]) -- nil for "-"
      mode = t[2]
    end
    cfg[c].mode = mode
    cfg[c].tenant = mode ~= 'f' -- per-tenant FIFOs are kept
    cfg[c].fair = string.sub(mode, 1, 1) == 'w'
  end
  return cfg
end

-- Fleet capacity = the smallest report among live replicas; its reservations come with it
-- (computed by the replica with the Python spec, scaled_reservations). Ties: the smallest name.
-- A live replica without a report (P:reports was lost) is not known to measure more than
-- the fleet's capacity before: it counts as that row (0 if none is stored) until it reports
-- again, so a lost report never raises the fleet's capacity.
local function recompute_fleet()
  local all = redis.call('HGETALL', K_REPORTS)
  local best, best_name = nil, nil
  local reported = {}
  for i = 1, #all, 2 do
    local f = split(all[i + 1], 5)
    local c = tonumber(f[1])
    reported[all[i]] = true
    if best == nil or c < best[1] or (c == best[1] and all[i] < best_name) then
      best = {c, tonumber(f[5]), tonumber(f[4]), tonumber(f[3]), tonumber(f[2])}
      best_name = all[i]
    end
  end
  for _, r in ipairs(redis.call('ZRANGE', K_REPLICAS, 0, -1)) do
    if not reported[r] then
      local f = redis.call('HMGET', K_FLEET, 'cap', 'r0', 'r1', 'r2', 'r3')
      local row = {tonumber(f[1]) or 0, tonumber(f[2]) or 0, tonumber(f[3]) or 0,
                   tonumber(f[4]) or 0, tonumber(f[5]) or 0}
      if best == nil or row[1] < best[1] then best = row end
      break
    end
  end
  if best == nil then best = {0, 0, 0, 0, 0} end
  redis.call('HSET', K_FLEET, 'cap', best[1], 'r0', best[2], 'r1', best[3], 'r2', best[4],
             'r3', best[5])
end

-- P:fleet was lost: its capacity comes back from the reports, the rest from P:meta.
local function restore_fleet()
  if redis.call('HLEN', K_REPORTS) == 0 and redis.call('ZCARD', K_REPLICAS) == 0 then
    return -- nobody registered yet: there is nothing to restore
  end
  copy_meta(K_META, K_FLEET)
  recompute_fleet()
  note('state_rebuilt')
  load_state()
end

local function available(c)
  local held = 0
  for h = c + 1, 3 do
    local unused = res[h] - inf[h]
    if unused > 0 then held = held + unused end
  end
  return cap - total - held
end

-- Seconds until the fleet has settled after a loss (0: settled); see heartbeat().
local function settling()
  local left = (tonumber(redis.call('HGET', K_FLEET, 'settle')) or 0) - now
  if left < 0 then return 0 end
  return left
end

-- After a loss of the whole ledger's writes (lose()) nothing is admitted through it (no
-- arrival, no grant) until every replica alive has re-registered: the settling window.
local function frozen()
  return (tonumber(redis.call('HGET', K_FLEET, 'frozen')) or 0) > now
end

local function notify(replica, msg)
  redis.call('RPUSH', k_ev(replica), msg)
end

-- The next arrival / candidate / turn sequence. P:seq lost (it starts again at 1): carried
-- past the highest sequence still queued, a candidate or a turn, so that nothing new orders
-- before an older waiter or candidate.
local function next_seq()
  local s = redis.call('INCR', K_SEQ)
  if s ~= 1 then return s end
  local top = 0
  for c = 0, 3 do
    for _, k in ipairs({k_q(c), k_pre(c)}) do
      local t = redis.call('ZREVRANGE', k, 0, 0, 'WITHSCORES')
      if #t > 0 then top = math.max(top, tonumber(t[2])) end
    end
    for _, m in ipairs(redis.call('ZRANGE', k_turn(c), 0, -1)) do
      top = math.max(top, tonumber(string.sub(m, 1, 16)) or 0)
    end
  end
  if top >= s then
    s = top + 1
    redis.call('SET', K_SEQ, int(s))
    note('state_rebuilt')
  end
  return s
end

-- ------------------------------------------------------------------ state changes

local function admit(a)
  put_adm(a)
  redis.call('HINCRBY', K_INF, a.cls, 1)
  redis.call('SADD', k_own(a.replica), a.id)
  inf[a.cls] = inf[a.cls] + 1
  total = total + 1
end

-- Forget up to ``limit`` ids that ended more than ``keep`` seconds ago. Every end forgets
-- up to two, so the memory of ended ids stays bounded by the rate times ``keep``.
local function forget_ended(limit)
  if keep == nil then return end
  local old = redis.call('ZRANGEBYSCORE', K_ENDQ, '-inf', fmt(now - keep), 'LIMIT', 0, limit)
  if #old > 0 then
    redis.call('HDEL', K_ENDED, unpack(old))
    redis.call('ZREM', K_ENDQ, unpack(old))
  end
end

local function drop_adm(a, reason)
  redis.call('HDEL', K_ADM, a.id)
  redis.call('ZREM', k_pre(a.cls), a.id)
  redis.call('HINCRBY', K_INF, a.cls, -1)
  redis.call('SREM', k_own(a.replica), a.id)
  redis.call('HSET', K_ENDED, a.id, reason)
  redis.call('ZADD', K_ENDQ, fmt(now), a.id)
  forget_ended(2)
  inf[a.cls] = inf[a.cls] - 1
  total = total - 1
end

-- ---------------------------------------------------- fairness between tenants in a class
-- A port of TenantQueue (sidecar/scheduler/queues.py): self-clocked weighted fair queuing,
-- the same tags in the same float arithmetic (a turn costs 1 / weight; a tenant that starts
-- waiting is tagged virtual time + cost; serving moves the virtual time to the tag served
-- and the tenant's next turn on by its cost; the virtual time restarts from 0 when the
-- class queue empties). A class in mode "f" keeps none of this (one FIFO: P:q:<c>).

local function vtime(c) return tonumber(redis.call('HGET', K_VT, c)) or 0 end

local function cost(c, tenant)
  return 1.0 / (tonumber(redis.call('HGET', k_wt(c), tenant)) or 1.0)
end

-- A turn's member: its sequence, fixed width so equal tags order by it (the turn tagged
-- first goes first), then the tenant.
local function turn_member(tenant)
  return string.format('%016d', next_seq()) .. ' ' .. tenant
end

-- TenantQueue.add, for a waiter already in P:q:<c> with arrival sequence ``seq``.
local function join(c, cf, id, tenant, seq)
  redis.call('ZADD', k_tq(c, tenant), seq, id)
  if redis.call('HEXISTS', k_flow(c), tenant) == 1 then return end
  local m = ''
  if cf.fair then
    -- Joins at the current virtual time: no credit for having been idle.
    m = turn_member(tenant)
    redis.call('ZADD', k_turn(c), fmt(vtime(c) + cost(c, tenant)), m)
  end
  redis.call('HSET', k_flow(c), tenant, m)
end

-- TenantQueue._drop: after the waiter left P:q:<c>. Its tenant's next waiter inherits the
-- turn; a tenant without waiters loses its turn.
local function leave(c, id, tenant)
  redis.call('ZREM', k_tq(c, tenant), id)
  if redis.call('EXISTS', k_tq(c, tenant)) == 0 then
    local m = redis.call('HGET', k_flow(c), tenant)
    if m then
      redis.call('HDEL', k_flow(c), tenant)
      if m ~= '' then redis.call('ZREM', k_turn(c), m) end
    end
  end
  if redis.call('EXISTS', k_q(c)) == 0 then redis.call('HDEL', K_VT, c) end
end

local function drop_waiter(w)
  redis.call('HDEL', K_W, w.id)
  redis.call('ZREM', k_q(w.cls), w.id)
  redis.call('ZREM', K_DL, w.id)
  redis.call('SREM', k_own(w.replica), w.id)
  if load_cfg()[w.cls].tenant then leave(w.cls, w.id, w.tenant) end
end

-- A waiter whose record was lost (P:w): out of the deadlines and out of its owner's set
-- (whichever live replica's it is), so that nothing later takes its id for a lost admission
-- (reconcile()). Its replica answers the request at its own queue timeout.
local function forget_lost(id)
  redis.call('ZREM', K_DL, id)
  for _, r in ipairs(redis.call('ZRANGE', K_REPLICAS, 0, -1)) do
    redis.call('SREM', k_own(r), id)
  end
end

-- ClassQueues.configure for one class: the kind of queue changed (fair queuing switched, a
-- per-tenant limit started or stopped acting, or the weights changed): every waiter moves
-- to a new queue of the new kind in arrival order; none is lost, deadlines are untouched.
local function rebuild(c, cf)
  for _, t in ipairs(redis.call('HKEYS', k_flow(c))) do redis.call('DEL', k_tq(c, t)) end
  redis.call('DEL', k_flow(c), k_turn(c))
  redis.call('HDEL', K_VT, c)
  if not cf.tenant then return end
  local ids = redis.call('ZRANGE', k_q(c), 0, -1, 'WITHSCORES')
  for i = 1, #ids, 2 do
    local w = get_waiter(ids[i])
    if w ~= nil then
      join(c, cf, w.id, w.tenant, ids[i + 1])
    else
      redis.call('ZREM', k_q(c), ids[i]) -- its record was lost (see oldest())
      forget_lost(ids[i])
    end
  end
end

-- The class's oldest waiter (what starvation ages by; the head of a FIFO class).
local function oldest(c)
  while true do
    local ids = redis.call('ZRANGE', k_q(c), 0, 0)
    if #ids == 0 then return nil end
    local w = get_waiter(ids[1])
    if w ~= nil then return w end
    -- Queued without its record (the waiters' key was lost): forgotten.
    redis.call('ZREM', k_q(c), ids[1])
    forget_lost(ids[1])
  end
end

-- The waiter the class serves next: the oldest, or under fair queuing the oldest of the
-- tenant whose turn is next (w.turn: that turn's member).
local function head(c)
  local cf = load_cfg()[c]
  if not cf.fair then return oldest(c) end
  local rebuilt = false
  while true do
    local top = redis.call('ZRANGE', k_turn(c), 0, 0)
    if #top == 0 then
      -- No turn while waiters remain: the fair queue's keys were lost; rebuilt from the
      -- class queue (once), as a reload re-sorts it.
      if rebuilt or redis.call('EXISTS', k_q(c)) == 0 then return nil end
      rebuild(c, cf)
      rebuilt = true
    else
      local tenant = string.sub(top[1], 18)
      local ids = redis.call('ZRANGE', k_tq(c, tenant), 0, 0)
      if #ids == 0 then
        redis.call('ZREM', k_turn(c), top[1]) -- its waiters were lost
        redis.call('HDEL', k_flow(c), tenant)
      else
        local w = get_waiter(ids[1])
        if w ~= nil then
          w.turn = top[1]
          return w
        end
        redis.call('ZREM', k_tq(c, tenant), ids[1])
        redis.call('ZREM', k_q(c), ids[1])
        forget_lost(ids[1])
      end
    end
  end
end

-- TenantQueue.take_head under fair queuing: the head ``w`` leaves and its tenant's turn
-- moves on (or ends with its last waiter).
local function take_turn(c, w)
  local tag = tonumber(redis.call('ZSCORE', k_turn(c), w.turn))
  redis.call('HSET', K_VT, c, fmt(tag))
  redis.call('HDEL', K_W, w.id)
  redis.call('ZREM', k_q(c), w.id)
  redis.call('ZREM', K_DL, w.id)
  redis.call('SREM', k_own(w.replica), w.id)
  redis.call('ZREM', k_tq(c, w.tenant), w.id)
  redis.call('ZREM', k_turn(c), w.turn)
  if redis.call('EXISTS', k_tq(c, w.tenant)) == 1 then
    local m = turn_member(w.tenant)
    redis.call('ZADD', k_turn(c), fmt(tag + cost(c, w.tenant)), m)
    redis.call('HSET', k_flow(c), w.tenant, m)
  else
    redis.call('HDEL', k_flow(c), w.tenant)
    if redis.call('EXISTS', k_q(c)) == 0 then redis.call('HDEL', K_VT, c) end
  end
end

-- Lowest class first, then the most recent candidate (least work lost). With admitted_by,
-- only admissions made by then (a queued head may take what it could have preempted on
-- arrival, not a request admitted after it queued). Scheduler._pick_victim.
local function pick_victim(by, admitted_by)
  for c = 0, by - 1 do
    local ids = redis.call('ZREVRANGE', k_pre(c), 0, -1)
    for _, id in ipairs(ids) do
      local a = get_adm(id)
      if a == nil then
        redis.call('ZREM', k_pre(c), id) -- its record was lost: no candidate
      elseif admitted_by == nil or a.admitted_at <= admitted_by then
        return a
      end
    end
  end
  return nil
end

local function preempt(victim, by)
  drop_adm(victim, 'preempted')
  notify(victim.replica, 'preempt ' .. by .. ' ' .. victim.id)
end

-- ``w``: the class's head (head(c)).
local function admit_head(c, flags, w)
  if w.turn then take_turn(c, w) else drop_waiter(w) end
  admit({id = w.id, replica = w.replica, cls = c, admitted_at = now, first_byte = false,
         tenant = w.tenant})
  notify(w.replica, 'grant ' .. fmt(now - w.enqueued_at) .. ' ' .. flags .. ' ' .. w.id)
end

local function expire()
  local ids = redis.call('ZRANGEBYSCORE', K_DL, '-inf', fmt(now))
  for _, id in ipairs(ids) do
    local w = get_waiter(id)
    if w ~= nil then
      drop_waiter(w)
      notify(w.replica, 'expired ' .. fmt(now - w.enqueued_at) .. ' ' .. id)
    else
      forget_lost(id) -- its record was lost (see oldest())
    end
  end
end

-- Starvation override: lowest class first, system excluded, ignoring reservations but never
-- past capacity.
local function admit_starved()
  if total >= cap then return false end
  local cf = load_cfg()
  for c = 0, 2 do
    -- Aged by the oldest waiter; the head (who the queue serves next) goes.
    local o = oldest(c)
    if o ~= nil and now - o.enqueued_at >= cf[c].starve then
      admit_head(c, 's', head(c))
      return true
    end
  end
  return false
end

-- Strict priority: available() only shrinks going down the classes.
local function admit_by_priority()
  for c = 3, 0, -1 do
    local h = head(c)
    if h ~= nil then
      if available(c) < 1 then return false end
      admit_head(c, '-', h)
      return true
    end
  end
  return false
end

local function preempt_for_queued()
  local cf = load_cfg()
  for c = 3, 0, -1 do
    if cf[c].preempt and available(c) == 0 then
      local h = head(c)
      if h ~= nil then
        local victim = pick_victim(c, h.enqueued_at)
        if victim ~= nil then
          preempt(victim, c)
          admit_head(c, 'p', h)
          return true
        end
      end
    end
  end
  return false
end

-- P:dl lost while waiters remain (nothing would time out, and dispatch would think the
-- queues empty): each waiter's deadline comes back from its record.
local function rebuild_deadlines()
  local w = redis.call('HGETALL', K_W)
  for i = 1, #w, 2 do
    redis.call('ZADD', K_DL, split(w[i + 1], 5)[4], w[i])
  end
  note('state_rebuilt')
end

local function dispatch()
  if redis.call('ZCARD', K_DL) == 0 then
    if redis.call('HLEN', K_W) == 0 then return end -- nothing queued: the common case
    rebuild_deadlines()
  end
  expire()
  if redis.call('ZCARD', K_DL) == 0 then return end
  if frozen() then return end -- waiters keep their deadlines; grants wait for the settling
  while admit_starved() or admit_by_priority() or preempt_for_queued() do end
end

-- ------------------------------------------------------------------------ token budgets
-- A port of sidecar/tokens.py's TokenBook (tests/test_ledger_tokens.py drives both with the
-- same operations and requires the same answers): fixed windows on the server's clock, a
-- reservation per running request, settled by its usage.

-- Days since 1970-01-01 of a civil date, and back (Howard Hinnant's algorithms).
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

-- (start, end) of a window's period holding t (tokens.Window.period).
local function period(name, secs, t)
  if secs == 0 then
    local y, m = civil_from_days(math.floor(t / 86400))
    local ny, nm = y, m + 1
    if nm > 12 then ny, nm = y + 1, 1 end
    return days_from_civil(y, m, 1) * 86400, days_from_civil(ny, nm, 1) * 86400
  end
  local off = name == 'week' and 4 * 86400 or 0
  local start = math.floor((t - off) / secs) * secs + off
  return start, start + secs
end

-- The tenant's settled tokens in each window's current period (periods roll on read).
local function tok_used(t, windows)
  local key, out = k_tok(t), {}
  for i, w in ipairs(windows) do
    local start, stop = period(w.name, w.secs, now)
    local s = tonumber(redis.call('HGET', key, 's:' .. w.name))
    if s == nil or s ~= start then
      redis.call('HSET', key, 's:' .. w.name, fmt(start), 'u:' .. w.name, '0')
      out[i] = {used = 0, stop = stop}
    else
      out[i] = {used = tonumber(redis.call('HGET', key, 'u:' .. w.name)) or 0, stop = stop}
    end
  end
  return out
end

local function tok_windows(a, from)
  local windows = {}
  for i = from + 1, from + 3 * tonumber(a[from]), 3 do
    windows[#windows + 1] = {name = a[i], secs = tonumber(a[i + 1]), limit = tonumber(a[i + 2])}
  end
  return windows
end

local function encode_windows(windows)
  local parts = {}
  for _, w in ipairs(windows) do parts[#parts + 1] = w.name .. ' ' .. int(w.secs) end
  return table.concat(parts, ';')
end

local function decode_windows(s)
  local windows = {}
  if s == false or s == nil or s == '' then return windows end
  for part in string.gmatch(s, '[^;]+') do
    local name, secs = string.match(part, '^(%w+) (%d+)$')
    if name ~= nil then windows[#windows + 1] = {name = name, secs = tonumber(secs)} end
  end
  return windows
end

-- used tokens settled to the tenant in every window's current period.
local function tok_charge(t, used, windows)
  if #windows == 0 then return end
  tok_used(t, windows)
  for _, w in ipairs(windows) do redis.call('HINCRBY', k_tok(t), 'u:' .. w.name, int(used)) end
end

-- A cancel that found nothing may have overtaken its reservation (sent on a connection that
-- was dropped, run later): the id is refused for this long, then forgotten.
local TOK_GONE_SECS = 600
local function tok_forget_gone()
  local old = redis.call('ZRANGEBYSCORE', K_TOKGONE, '-inf', fmt(now), 'LIMIT', 0, 64)
  for _, id in ipairs(old) do redis.call('ZREM', K_TOKGONE, id) end
end

-- An open reservation out of the book: its tokens no longer reserved. -> the record.
local function tok_take(id)
  local rec = redis.call('HGET', K_TOKRES, id)
  if rec == false then return nil end
  local r, amount, tenant = string.match(rec, '^(%S+) (%d+) (.*)$')
  redis.call('HDEL', K_TOKRES, id)
  redis.call('SREM', k_tokown(r), id)
  if amount ~= '0' then redis.call('HINCRBY', k_tok(tenant), 'r', '-' .. amount) end
  return {replica = r, amount = tonumber(amount), tenant = tenant}
end

-- A reaped replica's reservations: no final entry will settle them; their estimate counts.
local function tok_drop_replica(r)
  for _, id in ipairs(redis.call('SMEMBERS', k_tokown(r))) do
    local rec = tok_take(id)
    if rec ~= nil then
      tok_charge(rec.tenant, rec.amount,
                 decode_windows(redis.call('HGET', k_tok(rec.tenant), 'w')))
    end
  end
  redis.call('DEL', k_tokown(r))
end

-- A replica whose heartbeat lapsed loses its admissions and waiters; its notifications go.
local function drop_replica(r)
  for _, id in ipairs(redis.call('SMEMBERS', k_own(r))) do
    local a = get_adm(id)
    if a ~= nil then
      drop_adm(a, REAPED)
    else
      local w = get_waiter(id)
      if w ~= nil then drop_waiter(w) end
    end
  end
  redis.call('DEL', k_own(r), k_ev(r))
  tok_drop_replica(r)
  redis.call('SREM', K_RETURNING, r)
  redis.call('HDEL', K_INC, r)
  redis.call('HDEL', K_RETIRED, r)
  redis.call('HDEL', K_REG, r)
  redis.call('HDEL', K_HEARD, r)
  redis.call('HDEL', K_REPORTS, r)
  redis.call('HDEL', K_DIGESTS, r)
  redis.call('HDEL', K_ORDER, r)
  redis.call('ZREM', K_REPLICAS, r)
end

-- The fleet's registration ttl as last given, for what registers on a replica's behalf.
local function fleet_ttl()
  return tonumber(redis.call('HGET', K_FLEET, 'ttl')) or tonumber(redis.call('HGET', K_META, 'ttl'))
    or 10
end

-- P:replicas lost (or a field of it): every replica that has a report (a live one always
-- has both; reaping drops both) is registered again for one ttl. Alive, it heartbeats on;
-- dead, it is reaped a ttl later, its slots counted until then (never given away early).
-- Run when a replica's call finds it unregistered (live()): every call of a replica asks
-- (take_over()), so the first one after the loss rebuilds it.
local function check_replicas()
  local n = redis.call('HLEN', K_REPORTS)
  if n == 0 or redis.call('ZCARD', K_REPLICAS) >= n then return end
  local until_ = fmt(now + fleet_ttl())
  local back = false
  for _, r in ipairs(redis.call('HKEYS', K_REPORTS)) do
    if redis.call('ZADD', K_REPLICAS, 'NX', until_, r) == 1 then back = true end
  end
  if back then note('state_rebuilt') end
end

-- Prefixes that may hold ghosts: set when this library instance made some or found some
-- (reconcile()), so that no call of a fleet without any pays for looking.
local haunted = {}

-- Admissions held by ghosts (rebuild_admissions()) end after their window: by then every
-- live replica has re-added what it holds.
local function expire_ghosts()
  if not haunted[P] then return end
  if redis.call('EXISTS', K_GHOSTS) == 0 then
    haunted[P] = nil
    return
  end
  local gone = redis.call('ZRANGEBYSCORE', K_GHOSTS, '-inf', fmt(now))
  for _, id in ipairs(gone) do
    local a = get_adm(id)
    if a ~= nil then drop_adm(a, REAPED) end
    redis.call('ZREM', K_GHOSTS, id)
  end
end

local function reap()
  expire_ghosts()
  local dead = redis.call('ZRANGEBYSCORE', K_REPLICAS, '-inf', fmt(now))
  if #dead == 0 then return end
  -- A lapsed replica may be alive (a server pause outlasted its registration, a
  -- partition) and still divide by a count without the replicas that joined since: it
  -- counts as unheard for one ttl, the time an alive one takes to register again.
  local ttl = tonumber(redis.call('HGET', K_FLEET, 'ttl')) or 0
  for _, r in ipairs(dead) do
    drop_replica(r)
    if ttl > 0 then redis.call('ZADD', K_LAPSED, fmt(now + ttl), r) end
  end
  recompute_fleet()
  load_state()
end

-- Registered and not expired. A replica found unregistered may be one whose registration
-- was lost with P:replicas: check_replicas() first (only then: nothing in steady state).
local function live(r)
  if redis.call('ZSCORE', K_REPLICAS, r) ~= false then return true end
  check_replicas()
  return redis.call('ZSCORE', K_REPLICAS, r) ~= false
end

-- -------------------------------------------------------------- losses, incarnations


-- The ledger lost writes that replicas saw acknowledged (an older copy): any replica's
-- admissions may be missing, and nothing says how many, so this is a data loss for the
-- whole fleet, handled as the server restarting empty is: every replica alive becomes
-- returning (it re-registers what it holds; its heartbeat answers "new"), and nothing is
-- admitted through the ledger (frozen) until the settling window is over. (A lost key is
-- no such loss: what it held comes back from the other keys, see "Keys lost".)
local function lose(cause)
  loss = cause
  lost = true
  local rs = redis.call('ZRANGE', K_REPLICAS, 0, -1)
  if #rs > 0 then redis.call('SADD', K_RETURNING, unpack(rs)) end
  -- A caller without a window of its own (not a replica: a monitoring client) still
  -- opens the fleet's, as its replicas last gave it.
  local settle = caller_settle
  if settle <= 0 then
    settle = tonumber(redis.call('HGET', K_FLEET, 'settle_secs'))
      or tonumber(redis.call('HGET', K_META, 'settle_secs')) or 0
  end
  local untl = now + settle
  if untl > (tonumber(redis.call('HGET', K_FLEET, 'settle')) or 0) then
    redis.call('HSET', K_FLEET, 'settle', fmt(untl))
  end
  if untl > (tonumber(redis.call('HGET', K_FLEET, 'frozen')) or 0) then
    redis.call('HSET', K_FLEET, 'frozen', fmt(untl))
  end
  mirror()
end

-- A ledger written by another server process than this one: the server restarted from
-- an RDB snapshot or AOF, or a replica was promoted (failover), so it may be an older copy
-- than what the replicas saw acknowledged, and nobody may be able to tell from the
-- generation yet (a replica that called only before the copy was taken sees nothing
-- wrong). Taken as a loss on the first call, whoever makes it. Checked once per prefix
-- per library instance: the library's Lua state is new in every server process (and on
-- every FUNCTION LOAD, when the check finds the same run_id and nothing happens).
local server_checked = {}
local server_id = nil
local function check_server()
  if server_checked[P] then return end
  server_id = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)')
  local stored = redis.call('GET', K_SERVER)
  if stored and stored ~= server_id then lose('server_changed') end
  redis.call('SET', K_SERVER, server_id)
  server_checked[P] = true
end

-- How long ghosts hold what the ledger could not name: the fleet's settling window (every
-- replica alive resyncs within it, re-adding what it holds), or a ttl if none was given.
local function ghost_window()
  local w = caller_settle
  if w <= 0 then
    w = tonumber(redis.call('HGET', K_FLEET, 'settle_secs'))
      or tonumber(redis.call('HGET', K_META, 'settle_secs')) or 0
  end
  if w <= 0 then w = fleet_ttl() end
  return w
end

-- Admission records lost (P:adm, alone or with P:inflight): ``orphans`` are the ids the
-- live replicas' own sets still name without any record ({replica, id}), ``deficit`` how
-- many of each class the counters hold beyond the records. Each orphan gets a placeholder
-- record: its owner from the set, its class from P:pre:<c> if it is a candidate there
-- (known), else a class the counters are still short of ("unsure": never a candidate,
-- and its owner's next resync, which lists it, gives the real class, first byte and
-- tenant), admitted now (a resync keeps an unlisted one as long as a fresh admission),
-- before its first byte (so a first-byte mark answers 1, never a false "preempted").
-- What no set names (the sets were lost too) is held by ghosts for one settling window:
-- the count never drops below what runs, and comes back to it as the replicas resync.
-- -> how many records were added per class.
local function rebuild_admissions(orphans, deficit)
  table.sort(orphans, function(x, y) return x[2] < y[2] end)
  local added = {[0] = 0, 0, 0, 0}
  local guessed = {}
  for _, o in ipairs(orphans) do
    local cls = nil
    for c = 0, 3 do
      if redis.call('ZSCORE', k_pre(c), o[2]) then cls = c break end
    end
    if cls == nil then
      guessed[#guessed + 1] = o
    else
      deficit[cls] = deficit[cls] - 1
      added[cls] = added[cls] + 1
      put_adm({id = o[2], replica = o[1], cls = cls, admitted_at = now, first_byte = false,
               unsure = false, tenant = ''})
    end
  end
  for _, o in ipairs(guessed) do
    local cls = 0
    for c = 0, 3 do
      if deficit[c] > 0 then cls = c break end
    end
    deficit[cls] = deficit[cls] - 1
    added[cls] = added[cls] + 1
    put_adm({id = o[2], replica = o[1], cls = cls, admitted_at = now, first_byte = false,
             unsure = true, tenant = ''})
  end
  local untl = fmt(now + ghost_window())
  for c = 0, 3 do
    while deficit[c] > 0 do
      local id = GHOST .. ':' .. next_seq()
      put_adm({id = id, replica = GHOST, cls = c, admitted_at = now, first_byte = true,
               unsure = true, tenant = ''})
      redis.call('SADD', k_own(GHOST), id)
      redis.call('ZADD', K_GHOSTS, untl, id)
      haunted[P] = true
      deficit[c] = deficit[c] - 1
      added[c] = added[c] + 1
    end
  end
  note('admissions_rebuilt')
  return added
end

-- The per-class counters against the admission records, the truth (each record is written
-- with its counter in one run). More records than counted: the counters were lost; the
-- records give them back exactly (counters_lost). Fewer: records were lost; they are
-- rebuilt (rebuild_admissions()). O(admissions): every heartbeat, and any call whose O(1)
-- check (the totals) disagrees.
-- Also each replica's own set against the records naming it: a lost set would leave its
-- admissions and waiters behind when it dies (reap() goes by the set); rebuilt. And every
-- ghost has its expiry (P:ghosts lost: from now). ``scan``: look for ids the own sets name
-- without a record even though the totals agree (both were lost together: see run()).
local function reconcile(scan)
  local counted = {[0] = 0, 0, 0, 0}
  local adm = redis.call('HGETALL', K_ADM)
  local waiting = redis.call('HGETALL', K_W)
  local owned = {} -- replica -> ids its records name
  local recorded = {}
  for i = 2, #adm, 2 do
    local r, c = string.match(adm[i], '^(%S+) (%d+)')
    c = tonumber(c)
    counted[c] = counted[c] + 1
    owned[r] = owned[r] or {}
    owned[r][#owned[r] + 1] = adm[i - 1]
    recorded[adm[i - 1]] = true
  end
  for i = 2, #waiting, 2 do
    local r = string.match(waiting[i], '^(%S+)')
    owned[r] = owned[r] or {}
    owned[r][#owned[r] + 1] = waiting[i - 1]
    recorded[waiting[i - 1]] = true
  end
  -- SADD of members already there changes nothing (and is not replicated); any it adds
  -- were missing.
  local added = 0
  for r, ids in pairs(owned) do
    for j = 1, #ids, 1000 do
      added = added + redis.call('SADD', k_own(r), unpack(ids, j, math.min(j + 999, #ids)))
    end
  end
  if added > 0 then note('owners_lost') end
  if owned[GHOST] then
    haunted[P] = true
    for _, id in ipairs(owned[GHOST]) do
      if not redis.call('ZSCORE', K_GHOSTS, id) then
        redis.call('ZADD', K_GHOSTS, fmt(now + ghost_window()), id)
      end
    end
  end
  local deficit, short = {}, false
  for c = 0, 3 do
    deficit[c] = math.max(0, inf[c] - counted[c])
    if deficit[c] > 0 then short = true end
  end
  if short or scan then
    local orphans = {}
    for _, r in ipairs(redis.call('ZRANGE', K_REPLICAS, 0, -1)) do
      for _, id in ipairs(redis.call('SMEMBERS', k_own(r))) do
        -- (a waiter whose record was lost still has its deadline: not an admission)
        if not recorded[id] and not redis.call('ZSCORE', K_DL, id) then
          orphans[#orphans + 1] = {r, id}
        end
      end
    end
    if short or #orphans > 0 then
      local more = rebuild_admissions(orphans, deficit)
      for c = 0, 3 do counted[c] = counted[c] + more[c] end
    end
  end
  local differ = false
  for c = 0, 3 do
    if counted[c] ~= inf[c] then differ = true end
  end
  if not differ then return end
  redis.call('HSET', K_INF, '0', counted[0], '1', counted[1], '2', counted[2], '3', counted[3])
  load_state()
  note('counters_lost')
end

-- Nothing admitted, as the records and the counters agree (run()'s O(1) check): unless the
-- two were lost together. The live replicas' own sets then still name the admissions, the
-- only members that are not waiters. Without waiters, a set that exists is enough to tell
-- (O(replicas)); with some, O(waiters), only while nothing is admitted.
local function owners_name_any()
  local rs = redis.call('ZRANGE', K_REPLICAS, 0, -1)
  if #rs == 0 then return false end
  local sets = {}
  for i, r in ipairs(rs) do sets[i] = k_own(r) end
  if redis.call('EXISTS', unpack(sets)) == 0 then return false end -- an idle fleet
  if redis.call('HLEN', K_W) == 0 then return true end
  for _, r in ipairs(rs) do
    for _, id in ipairs(redis.call('SMEMBERS', k_own(r))) do
      if redis.call('HEXISTS', K_W, id) == 0 then return true end
    end
  end
  return false
end

-- A live replica registered by another process (the container restarted, same replica
-- id): its predecessor's admissions are still running in Envoy, so they are kept and
-- handed to the new process (the reply's ``taken``), which holds them until Envoy shows
-- them (or its ack timeout ends them). Its waiters, stop channels (preemption candidates)
-- and notifications went with the old process, whose incarnation is retired: a call from
-- it later is refused (run()), so that two live processes sharing one id (two sidecars on
-- one host with the same default id) do not take each other's admissions back and forth,
-- unnoticed, and a late call of a dead process cannot take them back either.
local RETIRED_KEPT = 8
local function take_over()
  if caller == '' or caller_inc == '' or not live(caller) then return end
  local prev = caller_prev -- (read by retired_caller() at the start of this call)
  if prev == caller_inc then return end
  redis.call('HSET', K_INC, caller, caller_inc)
  if not prev then return end -- recorded by this call: nothing of another process's to take
  local retired = {prev}
  for old in string.gmatch(redis.call('HGET', K_RETIRED, caller) or '', '%S+') do
    if #retired < RETIRED_KEPT and old ~= caller_inc then retired[#retired + 1] = old end
  end
  redis.call('HSET', K_RETIRED, caller, table.concat(retired, ' '))
  for _, id in ipairs(redis.call('SMEMBERS', k_own(caller))) do
    local a = get_adm(id)
    if a ~= nil then
      redis.call('ZREM', k_pre(a.cls), id)
      taken[#taken + 1] = id
      taken[#taken + 1] = a.cls
      taken[#taken + 1] = a.first_byte and '1' or '0'
      taken[#taken + 1] = a.tenant
      taken_ids[id] = true
    else
      local w = get_waiter(id)
      if w ~= nil then drop_waiter(w) else redis.call('SREM', k_own(caller), id) end
    end
  end
  redis.call('DEL', k_ev(caller))
  -- The old process's token reservations: the new one cannot tell which request each was
  -- (its ids were the old process's own), so none will be settled: their estimates count.
  tok_drop_replica(caller)
end

-- A call from an incarnation a newer process of its replica id took over: refused before it
-- reads or writes anything (run()). -> the error text, or nil.
local function retired_caller()
  caller_prev = false
  if caller == '' or caller_inc == '' then return nil end
  local prev = redis.call('HGET', K_INC, caller)
  caller_prev = prev
  if not prev or prev == caller_inc then return nil end
  for old in string.gmatch(redis.call('HGET', K_RETIRED, caller) or '', '%S+') do
    if old == caller_inc then
      return 'ERR ledger: replica_id_in_use: replica id ' .. caller .. ' was taken over by '
        .. 'another process (incarnation ' .. prev .. '); this process (' .. caller_inc
        .. ') may not use it: give each sidecar its own --replica-id'
    end
  end
  return nil
end

-- When tick next has work: a queue timeout or a head turning starved (relative seconds).
local function next_in()
  local best = nil
  local d = redis.call('ZRANGE', K_DL, 0, 0, 'WITHSCORES')
  if #d > 0 then best = tonumber(d[2]) end
  local cf = load_cfg()
  for c = 0, 2 do
    local h = oldest(c)
    if h ~= nil then
      local at = h.enqueued_at + cf[c].starve
      if at > now and (best == nil or at < best) then best = at end
    end
  end
  if best == nil then return '' end
  return fmt(best - now)
end

-- How many admissions replica r holds as the ledger counts them (its own set also holds
-- its waiters). O(its admissions + waiters); run once per heartbeat.
local function held_by(r)
  local n = 0
  for _, id in ipairs(redis.call('SMEMBERS', k_own(r))) do
    n = n + redis.call('HEXISTS', K_ADM, id)
  end
  return n
end

-- How many other live replicas may not have heard of r yet: none of the replies they are
-- known to have read (P:heard, from their last registering call) was made after r
-- registered, so their live count may not include r. While any may not, r takes no
-- degraded share (sidecar/coordination/replica.py, "the remaining window"): the shares of
-- the replicas that all count one another then sum to at most capacity. Every other
-- replica counts, whenever it registered: one registered after r but by a call whose
-- reply it never read (a registration that lapsed in a server pause and was made again
-- by a late call) may still divide by a count without r (the deterministic simulation
-- found 7 + 3 of 7). A replica with no record counts as having heard nothing.
local function unheard_by(r)
  local mine = tonumber(redis.call('HGET', K_REG, r)) or 0
  local n = 0
  for _, o in ipairs(redis.call('ZRANGE', K_REPLICAS, 0, -1)) do
    if o ~= r and (tonumber(redis.call('HGET', K_HEARD, o)) or 0) < mine then
      n = n + 1
    end
  end
  -- And the replicas whose registration lapsed within a ttl (P:lapsed): alive, one may
  -- still admit on a share from before r registered.
  for _, o in ipairs(redis.call('ZRANGEBYSCORE', K_LAPSED, '-inf', '+inf')) do
    if o ~= r then
      if (tonumber(redis.call('ZSCORE', K_LAPSED, o)) or 0) > now then
        n = n + 1
      else
        redis.call('ZREM', K_LAPSED, o)
      end
    end
  end
  -- (After a loss the replicas alive are registered again one by one: those not back yet
  -- are in no count here. A replica takes no share from a status answered while the fleet
  -- settles: sidecar/coordination/replica.py, Replica._note.)
  return n
end

-- One consistent view for the degraded-mode limit (controller.degraded_limit): fleet
-- capacity, live replicas, fleet in flight, this replica's own admissions, the fleet's
-- in flight per class 0..3 (its gauges), the seconds until the fleet has settled, and how
-- many live replicas may not have heard of this one yet (unheard_by), all read in the
-- same atomic run.
local function fleet_reply(status, r)
  return {status, cap, redis.call('ZCARD', K_REPLICAS), total, held_by(r),
          inf[0], inf[1], inf[2], inf[3], fmt(settling()), unheard_by(r)}
end

-- ---------------------------------------------------------------------- operations

-- Store the class configuration a[5..8] (heartbeat args); a class whose kind of queue
-- changed is re-sorted (rebuild()), as Scheduler.update_config does. Its text is kept in
-- P:meta too (a lost P:cfg, P:tcfg or P:wt:<c> comes back from it: load_cfg()).
store_cfg = function(a)
  local before = load_cfg(true)
  local plain, tenants = {}, {}
  for c = 0, 3 do
    local text, fair, limit, wtext, weights = parse_class(a[5 + c])
    local mode = 'f'
    if fair then
      mode = 'w' .. redis.sha1hex(wtext)
    elseif limit ~= '-' then
      mode = 't'
    end
    plain[#plain + 1] = c
    plain[#plain + 1] = text
    tenants[#tenants + 1] = c
    tenants[#tenants + 1] = limit .. ' ' .. mode
    redis.call('DEL', k_wt(c))
    for i = 1, #weights, 1000 do
      redis.call('HSET', k_wt(c), unpack(weights, i, math.min(i + 999, #weights)))
    end
  end
  redis.call('HSET', K_CFG, unpack(plain))
  redis.call('HSET', K_TCFG, unpack(tenants))
  redis.call('HSET', K_META, 'class0', a[5], 'class1', a[6], 'class2', a[7], 'class3', a[8])
  cfg = nil
  local after = load_cfg()
  for c = 0, 3 do
    if after[c].mode ~= before[c].mode then rebuild(c, after[c]) end
  end
end

-- Each class's per-tenant FIFOs and turns against its queue, the truth, as reconcile()
-- checks the counters: a lost key (a tenant's FIFO, the flows, the turns) would strand
-- its waiters until their timeouts; the class is re-sorted by arrival instead.
-- O(waiting tenants), once per heartbeat.
local function check_tenants()
  local cf = load_cfg()
  for c = 0, 3 do
    if cf[c].tenant then
      local flows = redis.call('HKEYS', k_flow(c))
      local n = 0
      for _, t in ipairs(flows) do n = n + redis.call('ZCARD', k_tq(c, t)) end
      if n ~= redis.call('ZCARD', k_q(c))
          or (cf[c].fair and redis.call('ZCARD', k_turn(c)) ~= #flows) then
        rebuild(c, cf[c])
      end
    end
  end
end

-- Waiters that have a record but no place in their class queue (P:q:<c> lost: nobody
-- would grant them, and later arrivals would pass them): queued again by arrival time.
-- Before check_tenants(), which then re-sorts a per-tenant class from its queue.
local function check_queues()
  local n = redis.call('HLEN', K_W)
  if n == 0 then return end
  local queued = 0
  for c = 0, 3 do queued = queued + redis.call('ZCARD', k_q(c)) end
  if queued >= n then return end
  local back = {}
  local all = redis.call('HGETALL', K_W)
  for i = 1, #all, 2 do
    local f = split(all[i + 1], 5)
    if not redis.call('ZSCORE', k_q(f[2]), all[i]) then
      back[#back + 1] = {id = all[i], cls = f[2], at = tonumber(f[3])}
    end
  end
  table.sort(back, function(x, y) return x.at < y.at or (x.at == y.at and x.id < y.id) end)
  for _, w in ipairs(back) do redis.call('ZADD', k_q(w.cls), next_seq(), w.id) end
  if #back > 0 then note('state_rebuilt') end
end

-- A fair class whose tenant weights are gone (P:wt:<c> lost) while its settings have some.
local function weights_lost(a)
  local cf = load_cfg()
  for c = 0, 3 do
    if cf[c].fair and redis.call('EXISTS', k_wt(c)) == 0 then
      local _, _, _, wtext = parse_class(a[5 + c])
      if wtext ~= '' then return true end
    end
  end
  return false
end

-- Ended ids without their time (P:endq lost: never forgotten): forgotten from now on.
local function check_ended()
  if redis.call('HLEN', K_ENDED) <= redis.call('ZCARD', K_ENDQ) then return end
  for _, id in ipairs(redis.call('HKEYS', K_ENDED)) do
    redis.call('ZADD', K_ENDQ, 'NX', fmt(now), id)
  end
  note('state_rebuilt')
end

-- heartbeat replica ttl report force cfg0 cfg1 cfg2 cfg3 digest keep_ended settle
-- Registers or refreshes the replica and its capacity report. The class configuration is
-- written when force is 1 (start, reload) or when none is stored (after data loss).
-- settle > 0 (every call of a running replica; 0 only at its start): if the ledger does
-- not know the replica (the server lost its data, or its registration lapsed) and the
-- fleet is not settling already, the fleet settles for ``settle`` seconds from now: every
-- reply says how long is left, and no replica returns to admitting through the ledger, or
-- starts admitting, until it is over; each replica alive retries within that time, so all
-- have re-registered their holdings before anyone admits against them. A later unknown
-- replica within the window does not extend it. (A registration that merely lapsed opens
-- one too: only availability is lost, for the window.)
-- Reply: {"ok" | "new", fleet capacity, live replicas, fleet in flight, the replica's own
-- admissions, fleet in flight per class 0..3, seconds until settled, replicas that may
-- not have heard of it yet}; "new" means the
-- ledger did not know the replica (first start, its registration lapsed, or the server lost
-- its data), or it is returning until the fleet has settled (lose()): the replica must
-- reregister what it holds.
-- No dispatch here: the caller dispatches once its own changes are in. A resync that drops
-- what ended locally and dispatched before adding what replaced it would hand the freed
-- slots to waiters and then count the replacements on top: over capacity.
local function heartbeat(a)
  local r = a[1]
  local known = live(r)
  local settle = tonumber(a[11])
  if settle > 0 then redis.call('HSET', K_FLEET, 'settle_secs', a[11]) end
  if not known and settle > 0 then
    redis.call('SADD', K_RETURNING, r)
    if settling() == 0 then redis.call('HSET', K_FLEET, 'settle', fmt(now + settle)) end
  end
  redis.call('ZADD', K_REPLICAS, fmt(now + tonumber(a[2])), r)
  redis.call('ZREM', K_LAPSED, r)  -- registered again: counted by P:heard from now on
  redis.call('HSET', K_FLEET, 'ttl', a[2])  -- how long a lapsed one stays in P:lapsed
  if r == caller and caller_inc ~= '' then redis.call('HSET', K_INC, r, caller_inc) end
  -- Registered by this call (or its record was lost: stamped now, which only delays its
  -- share): the other replicas have not heard of it yet (unheard_by).
  if not known or redis.call('HEXISTS', K_REG, r) == 0 then
    redis.call('HSET', K_REG, r, int(gen))
  end
  if r == caller then redis.call('HSET', K_HEARD, r, int(caller_seen)) end
  redis.call('HSET', K_REPORTS, r, a[3])
  if a[4] == '1' or redis.call('EXISTS', K_CFG) == 0 or redis.call('EXISTS', K_TCFG) == 0
      or weights_lost(a) then
    store_cfg(a)
  end
  check_queues()
  check_tenants()
  check_ended()
  if server_id and redis.call('EXISTS', K_SERVER) == 0 then
    redis.call('SET', K_SERVER, server_id)
  end
  redis.call('HSET', K_DIGESTS, r, a[9])
  redis.call('HSET', K_FLEET, 'keep', a[10])
  recompute_fleet()
  load_state()
  reconcile(true) -- and ids the own sets name without a record (see reconcile())
  forget_ended(1000)
  mirror()
  if known and redis.call('SISMEMBER', K_RETURNING, r) == 0 then return 'ok' end
  return 'new'
end

local ops = {}

ops.heartbeat = function(a)
  local status = heartbeat(a)
  dispatch()
  return fleet_reply(status, a[1])
end

-- An admission its owner lists (a[i..i+4]: id cls first_byte preemptible tenant) that the
-- ledger already counts. A record rebuilt with a guessed class (rebuild_admissions()) takes
-- the listed class, first byte and tenant; a candidate the owner lists whose place in
-- P:pre:<c> was lost is a candidate again (as the most recent one).
local function relisted(cur, a, i)
  if cur.unsure then
    local c = tonumber(a[i + 1])
    if c ~= cur.cls then
      redis.call('ZREM', k_pre(cur.cls), cur.id)
      redis.call('HINCRBY', K_INF, cur.cls, -1)
      redis.call('HINCRBY', K_INF, c, 1)
      inf[cur.cls] = inf[cur.cls] - 1
      inf[c] = inf[c] + 1
      cur.cls = c
    end
    cur.unsure = false
    cur.first_byte = cur.first_byte or a[i + 2] == '1'
    cur.tenant = a[i + 4]
    put_adm(cur)
  end
  if a[i + 3] == '1' and not cur.first_byte
      and not redis.call('ZSCORE', k_pre(cur.cls), cur.id) then
    redis.call('ZADD', k_pre(cur.cls), next_seq(), cur.id)
  end
end

-- reregister <heartbeat args> then groups of (id cls first_byte preemptible tenant):
-- adds back what the replica holds after data loss or a lapsed registration. Idempotent:
-- an id already admitted is skipped, and so is one that ended for any reason other than its
-- replica's expiry (a late re-registration cannot resurrect a completed or preempted
-- request). Like Scheduler.adopt, this may exceed capacity: the slots are really in use.
-- Reply: fleet_reply + the refused ids.
local function reregister(a, force)
  local status = heartbeat(a)
  local refused = {}
  for i = 12, #a, 5 do
    local id = a[i]
    local ended = redis.call('HGET', K_ENDED, id)
    local w = get_waiter(id)
    if w ~= nil then
      -- Held by the replica, a waiter here: a copy from before its grant (a restore).
      drop_waiter(w)
    end
    local cur = get_adm(id)
    if cur ~= nil then
      -- Already counted. Adopted by another replica than the one it is recorded under:
      -- the Envoy that runs it is this replica's (its process restarted under a new id,
      -- and the old registration would free it when it lapses), so it moves here.
      if force and cur.replica ~= a[1] then
        redis.call('SREM', k_own(cur.replica), id)
        redis.call('SADD', k_own(a[1]), id)
        cur.replica = a[1]
        put_adm(cur)
      end
      if cur.replica == a[1] then relisted(cur, a, i) end
    elseif ended and ended ~= REAPED and not force then
      refused[#refused + 1] = id
    else
      if ended and ended ~= REAPED then refused[#refused + 1] = id end -- forced: reported
      local adm = {id = id, replica = a[1], cls = tonumber(a[i + 1]), admitted_at = now,
                   first_byte = a[i + 2] == '1', tenant = a[i + 4]}
      admit(adm)
      if a[i + 3] == '1' and not adm.first_byte then
        redis.call('ZADD', k_pre(adm.cls), 'NX', next_seq(), id)
      end
      redis.call('HDEL', K_ENDED, id)
      redis.call('ZREM', K_ENDQ, id)
    end
  end
  dispatch()
  local reply = fleet_reply(status, a[1])
  for _, id in ipairs(refused) do reply[#reply + 1] = id end
  return reply
end

ops.reregister = function(a) return reregister(a, false) end

-- adopt <as reregister>: the replica's Envoy reports these running now (periodic access-log
-- entries), so they are counted even if the ledger ended them (a resync that dropped
-- them, a preemption whose stop never reached the stream): their slots are in use. Reply:
-- fleet_reply + the ids it had ended (re-added all the same; the replica reports them).
ops.adopt = function(a) return reregister(a, true) end

-- A resync older than the newest one of its process the ledger applied (``order``: each
-- process numbers its resyncs, and sends one only after the one before was answered or
-- given up on). It can still run: its connection was given up on while the server was
-- paused, and what that connection had sent ran on resume, after the new connection's
-- newer resync (the deterministic fleet simulation found it: the late recovery resync,
-- min_age 0, dropped what the newer one had re-added, streams that were running, and
-- the fleet ran 7 of 6). Its list is older than what the ledger holds from the newer
-- one, and so are its capacity report and its caller's ``seen``: it changes nothing.
-- Otherwise its order is recorded. A new incarnation's numbers start again (P:order
-- keeps the incarnation); a reaped replica's entry goes with it (nothing of the
-- replica's is left for a late resync to drop).
local function stale_resync(r, order)
  local last = redis.call('HGET', K_ORDER, r)
  if last then
    local inc, n = string.match(last, '^(%S*) (%d+)$')
    if inc == caller_inc and tonumber(n) >= order then return true end
  end
  redis.call('HSET', K_ORDER, r, caller_inc .. ' ' .. int(order))
  return false
end

-- resync <heartbeat args> min_age order then groups like reregister (class -1: a waiter,
-- kept as is; class -2: see keep below): make the ledger's view of the
-- replica exactly what it holds. Adds back what it holds (as reregister) and drops every
-- admission or waiter the ledger has for it that it does not list and that is at least
-- min_age seconds old: released or cancelled while the server was away, or decided by a
-- call whose reply the replica never read (it timed out, or the server ran it late). After
-- an outage min_age is 0; in steady state it is larger than any call's time in flight, so
-- an admission whose reply is still on its way is not dropped. ``order``: see
-- stale_resync(); a stale one answers "stale" (nobody reads it: its caller gave up).
-- Reply: as reregister.
ops.resync = function(a)
  local min_age = tonumber(a[12])
  if stale_resync(a[1], tonumber(a[13])) then return fleet_reply('stale', a[1]) end
  if settling() == 0 and live(a[1]) then redis.call('SREM', K_RETURNING, a[1]) end
  local rest = {}
  for i = 1, 11 do rest[i] = a[i] end
  -- keep[id]: 'all' listed (held, or class -1: a waiter, kept as is, not re-added);
  -- 'admitted' (class -2: an arrival whose reply the replica still waits for, after an
  -- outage): kept if the ledger admitted it (the reply will make it held there), dropped
  -- if it is still queued (its requester has moved to the local queue).
  local keep = {}
  for id in pairs(taken_ids) do keep[id] = 'all' end -- taken over by this very call
  for i = 14, #a, 5 do
    local c = a[i + 1]
    if c == '-2' then
      keep[a[i]] = 'admitted'
    else
      keep[a[i]] = 'all'
      if c ~= '-1' then
        for j = 0, 4 do rest[#rest + 1] = a[i + j] end
      end
    end
  end
  for _, id in ipairs(redis.call('SMEMBERS', k_own(a[1]))) do
    if keep[id] ~= 'all' then
      local adm = get_adm(id)
      if adm ~= nil then
        if keep[id] == nil and now - adm.admitted_at >= min_age then
          drop_adm(adm, 'completed')
        end
      else
        local w = get_waiter(id)
        if w ~= nil then
          if now - w.enqueued_at >= min_age then drop_waiter(w) end
        else
          redis.call('SREM', k_own(a[1]), id)
        end
      end
    end
  end
  return ops.reregister(rest)
end

-- arrive replica id cls tenant
-- Reply: {"admitted"} | {"admitted", victim id, victim owner} | {"queued", timeout}
--      | {"rejected_queue_full"} | {"unregistered"} | {"duplicate"}
ops.arrive = function(a)
  local r, id, c, tenant = a[1], a[2], tonumber(a[3]), a[4]
  if not live(r) or redis.call('SISMEMBER', K_RETURNING, r) == 1 or frozen() then
    return {'unregistered'}
  end
  if redis.call('HEXISTS', K_ADM, id) == 1 or redis.call('HEXISTS', K_W, id) == 1 then
    return {'duplicate'}
  end
  dispatch()
  local cf = load_cfg()
  local queued = redis.call('ZCARD', k_q(c))
  local avail = available(c)
  local adm = {id = id, replica = r, cls = c, admitted_at = now, first_byte = false,
               tenant = tenant}
  if queued == 0 and avail >= 1 then
    admit(adm)
    return {'admitted'}
  end
  if queued == 0 and cf[c].preempt and avail == 0 then
    -- One victim frees exactly the one slot needed; over its share (avail < 0) it would not.
    local victim = pick_victim(c, nil)
    if victim ~= nil then
      preempt(victim, c)
      admit(adm)
      dispatch()
      return {'admitted', victim.id, victim.replica}
    end
  end
  if queued >= cf[c].queue_size or (cf[c].limit ~= nil and cf[c].tenant
      and redis.call('ZCARD', k_tq(c, tenant)) >= cf[c].limit) then
    return {'rejected_queue_full'}
  end
  local deadline = now + cf[c].timeout
  local seq = next_seq()
  redis.call('ZADD', k_q(c), seq, id)
  redis.call('HSET', K_W, id, r .. ' ' .. c .. ' ' .. fmt(now) .. ' ' .. fmt(deadline) .. ' '
             .. tenant)
  redis.call('ZADD', K_DL, fmt(deadline), id)
  redis.call('SADD', k_own(r), id)
  if cf[c].tenant then join(c, cf[c], id, tenant, seq) end
  -- As Scheduler.arrive: under fair queuing it may be the new head, free to take a victim
  -- the old head could not (one admitted after that head queued).
  if cf[c].preempt then dispatch() end
  return {'queued', fmt(cf[c].timeout)}
end

-- tok_reserve replica id tenant tokens enforce reserve n [name secs limit]*n
-- The Check of a request estimated at ``tokens`` (TokenBook.reserve): in every window,
-- settled + reserved + tokens <= limit, else refused. reserve 0: settle_only (nothing held
-- while it runs). enforce 0: a refusal is reported, the request reserved all the same.
-- Reply: {"ok", reserved, "name used"...} | {"refused"|"counted", window, retry_after, limit,
-- used, reserved, never} | {"unregistered"} | {"duplicate"} | {"gone"} (cancelled before)
ops.tok_reserve = function(a)
  local r, id, t, amount = a[1], a[2], a[3], tonumber(a[4])
  local enforce, reserve = a[5] == '1', a[6] == '1'
  local windows = tok_windows(a, 7)
  -- Only a live replica reserves: a call of one reaped (or run late, after its process was
  -- taken over) would hold tokens nobody charges; its Check is admitted unreserved.
  if not live(r) then return {'unregistered'} end
  tok_forget_gone()
  if redis.call('HEXISTS', K_TOKRES, id) == 1 then return {'duplicate'} end
  if redis.call('ZSCORE', K_TOKGONE, id) ~= false then return {'gone'} end
  local refusal = nil
  if #windows > 0 then
    local reserved = reserve and (tonumber(redis.call('HGET', k_tok(t), 'r')) or 0) or 0
    local used = tok_used(t, windows)
    for i, w in ipairs(windows) do
      local u = used[i].used
      if u + reserved + amount > w.limit then
        local wait, never
        if amount > w.limit then
          wait, never = used[i].stop - now, 1
        elseif u + amount > w.limit then
          wait, never = used[i].stop - now, 0
        else
          wait, never = 1.0, 0
        end
        if refusal == nil or wait > refusal.wait then
          refusal = {name = w.name, wait = math.max(1.0, wait), limit = w.limit, used = u,
                     reserved = reserved, never = never}
        end
      end
    end
    redis.call('HSET', k_tok(t), 'w', encode_windows(windows))
  end
  if refusal ~= nil and enforce then
    return {'refused', refusal.name, fmt(refusal.wait), int(refusal.limit), int(refusal.used),
            int(refusal.reserved), int(refusal.never)}
  end
  local held = (reserve and #windows > 0) and amount or 0
  redis.call('HSET', K_TOKRES, id, r .. ' ' .. int(held) .. ' ' .. t)
  redis.call('SADD', k_tokown(r), id)
  if held > 0 then redis.call('HINCRBY', k_tok(t), 'r', int(held)) end
  if refusal ~= nil then
    return {'counted', refusal.name, fmt(refusal.wait), int(refusal.limit), int(refusal.used),
            int(refusal.reserved), int(refusal.never)}
  end
  -- What the tenant has now (its reservation counted): for this replica's gauges.
  local view = {'ok', int(tonumber(redis.call('HGET', k_tok(t), 'r')) or 0)}
  if #windows > 0 then
    for _, w in ipairs(windows) do
      view[#view + 1] = w.name .. ' ' .. int(tonumber(redis.call('HGET', k_tok(t),
                                                                'u:' .. w.name)) or 0)
    end
  end
  return view
end

-- tok_settle id tokens n [name secs limit]*n: its usage replaces its reservation.
-- -> "settled" | "unknown" (never reserved, already settled, cancelled or charged)
ops.tok_settle = function(a)
  local rec = tok_take(a[1])
  if rec == nil then return 'unknown' end
  tok_charge(rec.tenant, tonumber(a[2]), tok_windows(a, 3))
  return 'settled'
end

-- tok_cancel id: the request never ran; its reservation is given back. -> "cancelled" |
-- "unknown" (then a tok_reserve of that id arriving later is refused: "gone")
ops.tok_cancel = function(a)
  tok_forget_gone()
  if tok_take(a[1]) == nil then
    redis.call('ZADD', K_TOKGONE, fmt(now + TOK_GONE_SECS), a[1])
    return 'unknown'
  end
  return 'cancelled'
end

-- tok_view tenant...: per tenant {reserved, "name used start"...} (periods as last rolled).
ops.tok_view = function(a)
  local out = {}
  for _, t in ipairs(a) do
    local key = k_tok(t)
    local row = {int(tonumber(redis.call('HGET', key, 'r')) or 0)}
    for _, w in ipairs(decode_windows(redis.call('HGET', key, 'w'))) do
      local s = tonumber(redis.call('HGET', key, 's:' .. w.name))
      local start = period(w.name, w.secs, now)
      local used = (s ~= nil and s == start) and (tonumber(redis.call('HGET', key,
                                                                         'u:' .. w.name)) or 0)
        or 0
      row[#row + 1] = w.name .. ' ' .. int(used)
    end
    out[#out + 1] = row
  end
  return out
end

-- release id reason -> "released" | "already_released" | "unknown"; exactly once fleet-wide.
ops.release = function(a)
  local adm = get_adm(a[1])
  if adm == nil then
    if redis.call('HEXISTS', K_ENDED, a[1]) == 1 then return 'already_released' end
    return 'unknown'
  end
  drop_adm(adm, a[2])
  dispatch()
  return 'released'
end

-- cancel id: the client left, or the owner's own queue timer fired.
-- -> "cancelled" (it was queued; now gone) | "admitted" (already granted: the owner must
--    treat it as admitted and release it) | "unknown" (expired, reaped or never seen)
ops.cancel = function(a)
  local w = get_waiter(a[1])
  if w ~= nil then
    drop_waiter(w)
    dispatch()
    return 'cancelled'
  end
  if redis.call('HEXISTS', K_ADM, a[1]) == 1 then return 'admitted' end
  dispatch()
  return 'unknown'
end

-- mark_preemptible id... : the owner has a stop channel (ext_proc stream) for these
-- admissions; they become preemption candidates (Scheduler.mark_preemptible). One call with
-- several ids decides as the same calls one by one would (a dispatch after each), so an
-- owner may batch them. -> how many were still admitted and before their first byte.
ops.mark_preemptible = function(a)
  local n = 0
  dispatch()
  for _, id in ipairs(a) do
    local adm = get_adm(id)
    if adm ~= nil and not adm.first_byte then
      n = n + 1
      -- (a record whose class is a guess is no candidate until its owner lists it)
      if not adm.unsure and redis.call('ZSCORE', k_pre(adm.cls), id) == false then
        redis.call('ZADD', k_pre(adm.cls), next_seq(), id)
      end
      dispatch()
    end
  end
  return n
end

-- mark_first_byte id... : the responses started; no longer preemptible. -> how many changed.
ops.mark_first_byte = function(a)
  local n = 0
  for _, id in ipairs(a) do
    local adm = get_adm(id)
    if adm ~= nil and not adm.first_byte then
      n = n + 1
      adm.first_byte = true
      put_adm(adm)
      redis.call('ZREM', k_pre(adm.cls), id)
    end
  end
  dispatch()
  return n
end

-- tick: time passed (timeouts, starvation). -> seconds until the next timer, or "".
ops.tick = function(_)
  dispatch()
  return next_in()
end

-- snapshot -> {cap, live replicas (list), in flight per class 0..3, queue depth 0..3,
--              reserved 0..3, distinct config digests (list), now}
ops.snapshot = function(_)
  local depth = {}
  for c = 0, 3 do depth[#depth + 1] = redis.call('ZCARD', k_q(c)) end
  local digests, seen = {}, {}
  for _, d in ipairs(redis.call('HVALS', K_DIGESTS)) do
    if not seen[d] then
      seen[d] = true
      digests[#digests + 1] = d
    end
  end
  table.sort(digests)
  return {cap, redis.call('ZRANGE', K_REPLICAS, 0, -1), {inf[0], inf[1], inf[2], inf[3]}, depth,
          {res[0], res[1], res[2], res[3]}, digests, fmt(now)}
end

-- The single-operation calls ---------------------------------------------------------

-- multi n1 op1 args1... n2 op2 args2... : several of the batchable operations in one
-- invocation (n = the op's own argument count), decided in order exactly as the same calls
-- one by one at the same instant would be. A replica sends what it has pending (arrivals,
-- releases, marks) as one multi call, so the per-call costs (the round trip, EVALSHA, loading
-- the fleet state, reaping) are paid once per batch. Reply: one reply per op, in order; an
-- op that failed answers {"!error", message} and the ops after it still run.
ops.multi = function(a)
  local replies = {}
  local i = 1
  while i <= #a do
    local n, name = tonumber(a[i]), a[i + 1]
    local args = {}
    for j = i + 2, i + n do args[#args + 1] = a[j] end
    i = i + n + 1
    local fn = BATCHABLE[name] and ops[name]
    if not fn then
      replies[#replies + 1] = {'!error', 'ERR unknown ledger op ' .. tostring(name)}
    else
      local ok, r = pcall(fn, args)
      if ok then
        replies[#replies + 1] = r
      else
        if type(r) == 'table' then r = r.err end
        replies[#replies + 1] = {'!error', tostring(r)}
      end
    end
  end
  return replies
end

-- The clock is the server's TIME. Only the test build (ledger.py TEST_LUA, a library of its
-- own name that no production replica loads or calls) takes a caller's clock: in this text
-- that branch is a comment, so whoever reaches the server cannot move time (a caller's
-- 1e18 would reap every replica and expire every waiter).
local function clock(arg)
  --[[TEST_CLOCK
  if arg ~= '' then return tonumber(arg) end
  TEST_CLOCK]]
  if arg ~= '' then error('ERR a caller clock is refused (test build only)') end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function run(keys, argv)
  local ok, args = pcall(check_call, keys, argv)
  if not ok then return redis.error_reply('ERR ledger: ' .. tostring(args)) end
  set_prefix(keys[1])
  now = clock(argv[2])
  cfg = nil
  loss, lost, taken, taken_ids = '', false, {}, {}
  caller_settle = tonumber(argv[4])
  caller, caller_inc = argv[5], argv[6]
  caller_seen = tonumber(argv[3])
  local retired = retired_caller()
  if retired then return redis.error_reply(retired) end
  load_state()
  if not fleet_kept then
    restore_fleet()
  elseif window > now and redis.call('EXISTS', K_META) == 0 then
    mirror() -- a settling window runs: its second copy must be there
  end
  check_server()
  gen = redis.call('INCR', K_GEN)
  if gen == 1 and redis.call('EXISTS', K_FLEET, K_REPLICAS, K_REPORTS, K_ADM, K_INF) > 0 then
    -- P:gen lost on its own (a new or wiped ledger has none of those keys): carried past
    -- any generation a replica can have seen, so that nobody takes this for an older copy.
    local top = caller_seen
    for _, k in ipairs({K_REG, K_HEARD}) do
      for _, v in ipairs(redis.call('HVALS', k)) do top = math.max(top, tonumber(v) or 0) end
    end
    gen = top + GEN_JUMP
    redis.call('SET', K_GEN, int(gen))
    note('state_rebuilt')
  end
  if caller_seen >= gen then
    -- Older than what the caller already saw acknowledged: carry the generation forward
    -- (so the loss is handled once) and treat it as data loss.
    gen = caller_seen + 1
    redis.call('SET', K_GEN, int(gen))
    if not lost then lose('stale_copy') end
  end
  reap()
  if redis.call('HLEN', K_ADM) ~= total then
    reconcile(false)
  elseif total == 0 and owners_name_any() then
    reconcile(true)
  end
  take_over()
  local reply = ops[argv[1]](args) -- first: it may find a loss too (reconcile() in heartbeat())
  return {gen, loss, taken, reply, redis.call('ZCARD', K_REPLICAS)}
end

redis.register_function('__FUNCTION__', run)

-- Submits to one home queue, batched (group commit): each stores a new state and enqueues its
-- message exactly as it would alone (idempotent on id; a later submit of the batch sees
-- the earlier ones), with the index writes of the batch merged into one ZADD per index.
-- KEYS[1] expiry zset, KEYS[2] SUBMITTED index (see lib.lua), KEYS[3] home queue stream,
-- KEYS[4] its event feed (see feed.rs), KEYS[5] its delayed set and KEYS[6] their payload hash
-- (baton_queue::keys::delayed / delayed_payloads: a scheduled command's message waits there as
-- the named member `c:<id>`, see baton-queue's schedule.lua, and is promoted into the stream by
-- the queue's reclaim tick when due), KEYS[7] the queue's ready entries hash
-- (baton_queue::keys::ready_entries: a message of a priority other than 0 sets its `~new` mark,
-- as baton-queue's caps.lua caps_add does), then per submit its state key and, when ARGV[2] is '1'
-- (standalone), its id -> queue lookup key (on Cluster the lookup is written before this
-- script, in its own slot).
-- ARGV[1] N, ARGV[2] '1' with lookup keys or '', ARGV[3] home queue, ARGV[4] state TTL ms,
-- ARGV[5] lookup key TTL ms, ARGV[6] the shortest lifetime a state of this store can have (min
-- of state TTL and retention, ms: the expiry score is now + that, a lower bound of every later
-- expiry), then 13 per submit: stored state (header and JSON, see lib.lua), its body sha1,
-- created ms, message JSON, id, the queue whose lookup it may take over ('' none: the
-- client found no state of the id there, so that lookup is stale; taking it over here, in the
-- same step as the create, means two racing submits cannot both create), the `submitted`
-- event to append to the feed when created ('' none: the feed is off), the feed's length, and
-- the due time (ms) of a scheduled command, or '' to enqueue at once (a due time not after
-- Redis's clock is enqueued at once too), and its state TTL and lookup key TTL (ms) when they
-- are not ARGV[4] and ARGV[5] ('' for those: a scheduled command lives longer by its delay), and
-- its concurrency key ('' none): the entry's field `k` (baton_queue::keys::KEY_FIELD; a
-- scheduled command's key waits beside its payload as `c:<id>:k`, see baton-queue's schedule.lua),
-- and its priority ('0' none): the entry's field `pr` (baton_queue::keys::PRIORITY_FIELD; a
-- scheduled command's waits as `c:<id>:pr`).
-- Returns N replies in order: {'created'}, {'existing', stored state}, {'conflict', stored
-- state} (the client checks the hash of older versions' canonical body against it) or
-- {'other_queue', its queue}.
local n = tonumber(ARGV[1])
local per = 1
if ARGV[2] == '1' then per = 2 end
local home, ttl, lookup_ttl, life = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local out, sub, exp = {}, {}, {}
for i = 1, n do
  local b = 7 + 13 * (i - 1)
  local k = 8 + per * (i - 1)
  local state, lookup = KEYS[k], nil
  if per == 2 then lookup = KEYS[k + 1] end
  local reply = nil
  local s_ttl, l_ttl = ttl, lookup_ttl
  if ARGV[b + 9] ~= '' then s_ttl, l_ttl = ARGV[b + 9], ARGV[b + 10] end
  -- One call: create unless present, else read what is there.
  local prior = redis.call('SET', state, ARGV[b], 'NX', 'GET', 'PX', s_ttl)
  if prior then
    local _, _, _, sha = header(prior)
    if sha == ARGV[b + 1] then reply = { 'existing', prior } else reply = { 'conflict', prior } end
  elseif lookup then
    -- One call: claim the lookup key unless it names another queue.
    local q = redis.call('SET', lookup, home, 'NX', 'GET', 'PX', l_ttl)
    if q then
      if q ~= home and q ~= ARGV[b + 5] then
        redis.call('DEL', state)
        reply = { 'other_queue', q }
      else
        -- A lookup left by an expired state of this queue (refreshed), or a stale one of the
        -- queue this submit may take over.
        redis.call('SET', lookup, home, 'PX', l_ttl)
      end
    end
  end
  if not reply then
    local id = ARGV[b + 4]
    local pr = tonumber(ARGV[b + 12]) or 0
    local now
    local due = tonumber(ARGV[b + 8])
    if due then
      now = now_ms()
      if due <= now then due = nil end
    end
    if due then
      -- Scheduled: waits in the delayed set, never in the stream (nor pending) before it is due.
      local name = 'c:' .. id
      if redis.call('ZADD', KEYS[5], due, name) == 1 then redis.call('HINCRBY', KEYS[6], '~scheduled', 1) end
      redis.call('HSET', KEYS[6], name, ARGV[b + 3])
      if ARGV[b + 11] ~= '' then redis.call('HSET', KEYS[6], name .. ':k', ARGV[b + 11]) end
      if pr ~= 0 then redis.call('HSET', KEYS[6], name .. ':pr', pr) end
    else
      -- 'p': the work queue's payload field (baton_queue::keys::PAYLOAD_FIELD; a test checks it).
      local f = {'p', ARGV[b + 3]}
      if ARGV[b + 11] ~= '' then
        f[3] = 'k'
        f[4] = ARGV[b + 11]
      end
      if pr ~= 0 then
        f[#f + 1] = 'pr'
        f[#f + 1] = tostring(pr)
        redis.call('HSET', KEYS[7], '~new', '1')
      end
      local mid = redis.call('XADD', KEYS[3], '*', unpack(f))
      -- The entry id's milliseconds are the server's clock (never behind the stream's last entry).
      now = tonumber(string.match(mid, '^(%d+)'))
    end
    if ARGV[b + 6] ~= '' then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[b + 7], '*', 'i', id, 'e', ARGV[b + 6])
    end
    sub[#sub + 1] = ARGV[b + 2]
    sub[#sub + 1] = id
    exp[#exp + 1] = now + life
    exp[#exp + 1] = id
    reply = { 'created' }
  end
  out[i] = reply
end
if #sub > 0 then
  redis.call('ZADD', KEYS[2], unpack(sub))
  redis.call('ZADD', KEYS[1], unpack(exp))
end
return out

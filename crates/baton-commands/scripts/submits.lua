-- Submits to one home queue, batched (group commit): each stores a new state and enqueues its
-- message exactly as it would alone (idempotent on id; a later submit of the batch sees
-- the earlier ones), with the index writes of the batch merged into one ZADD per index.
-- KEYS[1] expiry zset, KEYS[2] SUBMITTED index (see lib.lua), KEYS[3] home queue stream,
-- KEYS[4] its event feed (see feed.rs), then per submit its state key and, when ARGV[2] is '1'
-- (standalone), its id -> queue lookup key (on Cluster the lookup is written before this
-- script, in its own slot).
-- ARGV[1] N, ARGV[2] '1' with lookup keys or '', ARGV[3] home queue, ARGV[4] state TTL ms,
-- ARGV[5] lookup key TTL ms, ARGV[6] the shortest lifetime a state of this store can have (min
-- of state TTL and retention, ms: the expiry score is now + that, a lower bound of every later
-- expiry), then 8 per submit: stored state (header and JSON, see lib.lua), its body sha1,
-- created ms, message JSON, id, the queue whose lookup it may take over ('' none: the
-- client found no state of the id there, so that lookup is stale; taking it over here, in the
-- same step as the create, means two racing submits cannot both create), the `submitted`
-- event to append to the feed when created ('' none: the feed is off) and the feed's length.
-- Returns N replies in order: {'created'}, {'existing', stored state}, {'conflict', stored
-- state} (the client checks the hash of older versions' canonical body against it) or
-- {'other_queue', its queue}.
local n = tonumber(ARGV[1])
local per = 1
if ARGV[2] == '1' then per = 2 end
local home, ttl, lookup_ttl, life = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local out, sub, exp = {}, {}, {}
for i = 1, n do
  local b = 7 + 8 * (i - 1)
  local k = 5 + per * (i - 1)
  local state, lookup = KEYS[k], nil
  if per == 2 then lookup = KEYS[k + 1] end
  local reply = nil
  -- One call: create unless present, else read what is there.
  local prior = redis.call('SET', state, ARGV[b], 'NX', 'GET', 'PX', ttl)
  if prior then
    local _, _, _, sha = header(prior)
    if sha == ARGV[b + 1] then reply = { 'existing', prior } else reply = { 'conflict', prior } end
  elseif lookup then
    -- One call: claim the lookup key unless it names another queue.
    local q = redis.call('SET', lookup, home, 'NX', 'GET', 'PX', lookup_ttl)
    if q then
      if q ~= home and q ~= ARGV[b + 5] then
        redis.call('DEL', state)
        reply = { 'other_queue', q }
      else
        -- A lookup left by an expired state of this queue (refreshed), or a stale one of the
        -- queue this submit may take over.
        redis.call('SET', lookup, home, 'PX', lookup_ttl)
      end
    end
  end
  if not reply then
    local id = ARGV[b + 4]
    -- 'p': the work queue's payload field (baton_queue::keys::PAYLOAD_FIELD; a test checks it).
    local mid = redis.call('XADD', KEYS[3], '*', 'p', ARGV[b + 3])
    -- The entry id's milliseconds are the server's clock (never behind the stream's last entry).
    local now = tonumber(string.match(mid, '^(%d+)'))
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

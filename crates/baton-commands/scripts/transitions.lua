-- Transitions of one home queue, batched (group commit): N compare-and-sets on their versions,
-- each decided exactly as transition.lua would decide it alone (the first terminal write wins),
-- with the index, expiry, ack and announcement writes of the batch merged into one call each.
-- Used for every transition without a hand-off enqueue whose delivery to ack (if any) is on the
-- home queue's own stream; the others go through transition.lua.
-- KEYS[1] expiry zset, KEYS[2..6] the status indexes (see lib.lua), KEYS[7] the home queue's
-- stream (the deliveries to ack), KEYS[8] its fence hash (baton_queue::keys::fences), KEYS[9] its
-- event feed (see feed.rs), KEYS[10] its completion hook delivery stream (see hooks.rs),
-- KEYS[11] its per-minute aggregates (see src/minutes.rs), KEYS[11 + i] the state key of
-- transition i, then its 8 concurrency-cap and priority keys (baton_queue::keys::caps, in the order of
-- baton-queue's caps.lua, prepended: acked entries free their concurrency slots).
-- ARGV[1] N, ARGV[2] pub/sub channel, ARGV[3] consumer group, then 16 per transition: expected
-- header start `<version> <OLD STATUS> `, new stored state (header and JSON), TTL ms, id, index
-- of the old status (2..6 in KEYS), index of the new status, the delivery's entry id or '', the
-- announcement to publish or '' (only terminal writes are announced), the consumer that must own
-- the delivery for the write to happen or '' (as in transition.lua), '1' to ack the delivery, the
-- delivery's fence or '' (checked with the owner, as in transition.lua), the event to append to
-- the feed with a successful write or '' (none), the feed's length (XADD MAXLEN ~), the
-- completion hook body to XADD to KEYS[10] with a successful write or '' (none), the
-- per-minute counter a successful write adds one to ('s', 'f', 'c', 'r'; '' none) and the start
-- (ms) of the handler call whose outcome it is ('' none; as in transition.lua).
-- Events are appended in the order of the batch, each right after its write.
-- Returns N replies in order: {'ok', acked 0/1}, {'missing'}, {'conflict', current state} or
-- {'lost'} (the owner check failed; nothing written).
-- Acks: one XACK (no owner check, as in transition.lua) and one XDEL for the batch; `acked` is 1
-- for every acked transition when XACK acknowledged them all, else 0 for all (the callers then
-- ack their deliveries themselves: acking twice is harmless).
local n = tonumber(ARGV[1])
local out = {}
-- Index KEYS position -> {id = true} to ZREM / {id = score} to ZADD. Two transitions of one id
-- in a batch (A -> B, then B -> C) leave it in C only: the second takes back the first's ZADD.
local rem, add = {}, {}
local exp = {}                -- TTL ms, id pairs
local acks, acked_at = {}, {} -- entry ids; positions of their replies
local ann = {}
local mins = {}               -- per-minute aggregates: counter field -> increment, or
                              -- { start ms, ... } under [1] (durations to bucket at `now`)
local b = 4
for i = 1, n do
  local key = KEYS[11 + i]
  local owner, lost = ARGV[b + 8], false
  if owner ~= '' then
    local p = redis.call('XPENDING', KEYS[7], ARGV[3], ARGV[b + 6], ARGV[b + 6], 1)
    lost = not p[1] or p[1][2] ~= owner
    local fence = ARGV[b + 10]
    if not lost and fence ~= '' then lost = (redis.call('HGET', KEYS[8], ARGV[b + 6]) or '0') ~= fence end
  end
  local head = lost or redis.call('GETRANGE', key, 0, HEAD_MAX)
  if lost then
    out[i] = { 'lost' }
  elseif head == '' then
    out[i] = { 'missing' }
  else
    local _, s, c = string.match(head, '^(%d+) (%u+) (%d+) ')
    if string.sub(head, 1, #ARGV[b]) ~= ARGV[b] or TERMINAL[s] then
      out[i] = { 'conflict', redis.call('GET', key) }
    else
      local id = ARGV[b + 3]
      redis.call('SET', key, ARGV[b + 1], 'PX', ARGV[b + 2])
      local o, w = tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
      if o ~= w then
        if add[o] and add[o][id] then
          add[o][id] = nil
        else
          rem[o] = rem[o] or {}
          rem[o][id] = true
        end
        add[w] = add[w] or {}
        add[w][id] = c
      end
      exp[#exp + 1] = tonumber(ARGV[b + 2])
      exp[#exp + 1] = id
      if ARGV[b + 9] == '1' then
        acks[#acks + 1] = ARGV[b + 6]
        acked_at[#acked_at + 1] = i
      end
      if ARGV[b + 7] ~= '' then ann[#ann + 1] = ARGV[b + 7] end
      if ARGV[b + 11] ~= '' then
        redis.call('XADD', KEYS[9], 'MAXLEN', '~', ARGV[b + 12], '*', 'i', id, 'e', ARGV[b + 11])
      end
      if ARGV[b + 13] ~= '' then redis.call('XADD', KEYS[10], '*', 'p', ARGV[b + 13]) end
      if ARGV[b + 14] ~= '' then
        mins[ARGV[b + 14]] = (mins[ARGV[b + 14]] or 0) + 1
        if ARGV[b + 15] ~= '' then
          mins[1] = mins[1] or {}
          mins[1][#mins[1] + 1] = ARGV[b + 15]
        end
      end
      out[i] = { 'ok', 0 }
    end
  end
  b = b + 16
end
for k = 2, 6 do
  if rem[k] then
    local ids = {}
    for id in pairs(rem[k]) do ids[#ids + 1] = id end
    if #ids > 0 then redis.call('ZREM', KEYS[k], unpack(ids)) end
  end
end
for k = 2, 6 do
  if add[k] then
    local z = {}
    for id, c in pairs(add[k]) do
      z[#z + 1] = c
      z[#z + 1] = id
    end
    if #z > 0 then redis.call('ZADD', KEYS[k], unpack(z)) end
  end
end
if #exp > 0 then
  -- The expiry scores stay lower bounds (see transition.lua): only ever lowered.
  local now = now_ms()
  local z = { 'LT' }
  for j = 1, #exp, 2 do
    z[#z + 1] = now + exp[j]
    z[#z + 1] = exp[j + 1]
  end
  redis.call('ZADD', KEYS[1], unpack(z))
end
if #acks > 0 then
  local a = redis.call('XACK', KEYS[7], ARGV[3], unpack(acks))
  redis.call('XDEL', KEYS[7], unpack(acks))
  redis.call('HDEL', KEYS[8], unpack(acks))
  if a == #acks then
    for _, i in ipairs(acked_at) do out[i][2] = 1 end
  end
  local C = caps_keys(#KEYS - 7)
  if redis.call('EXISTS', C.ids) == 1 then
    for _, id in ipairs(acks) do caps_release(C, KEYS[7], id) end
  end
  caps_wake(C)
end
-- Per-minute aggregates (src/minutes.rs): one HINCRBY per distinct field, in this minute's slot.
if next(mins) then
  local now = now_ms()
  local p = minute_slot(KEYS[11], now)
  local starts = mins[1] or {}
  mins[1] = nil
  for _, st in ipairs(starts) do
    local d = minute_bucket(st, now)
    mins[d] = (mins[d] or 0) + 1
  end
  for f, c in pairs(mins) do redis.call('HINCRBY', KEYS[11], p .. f, c) end
end
-- One message for the batch: announcements separated by '\n' (ids hold no whitespace).
if #ann > 0 then redis.call('PUBLISH', ARGV[2], table.concat(ann, '\n')) end
return out

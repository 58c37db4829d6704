-- Submit: store a new state and enqueue its message, atomically; idempotent on id.
-- KEYS[1..6] indexes (see lib.lua), KEYS[7] state key, KEYS[8] home queue stream,
-- KEYS[9] id -> queue lookup key (standalone only; on Cluster it is written before this script)
-- ARGV[1] state JSON, ARGV[2] canonical body, ARGV[3] created ms, ARGV[4] state TTL ms,
-- ARGV[5] message JSON, ARGV[6] id, ARGV[7] home queue, ARGV[8] lookup key TTL ms,
-- ARGV[9] the shortest lifetime a state of this store can have (min of state TTL and
-- retention, ms): its expiry score is now + that, a lower bound of every later expiry,
-- ARGV[10] '1' to also prune expired index entries (the store asks every few submits, so the
-- indexes stay bounded without a cost on every call).
-- Returns {'created'}, {'existing', state JSON}, {'conflict'} or {'other_queue', its queue}.
local sha = redis.sha1hex(ARGV[2])
-- One call: create unless present, else read what is there.
local prior = redis.call('SET', KEYS[7], '1 SUBMITTED ' .. ARGV[3] .. ' ' .. sha .. ' ' .. ARGV[1],
  'NX', 'GET', 'PX', ARGV[4])
if prior then
  local _, _, _, b, at = header(prior)
  if b == sha then return { 'existing', string.sub(prior, at) } end
  return { 'conflict' }
end
if KEYS[9] then
  -- One call: claim the lookup key unless it names another queue.
  local home = redis.call('SET', KEYS[9], ARGV[7], 'NX', 'GET', 'PX', ARGV[8])
  if home then
    if home ~= ARGV[7] then
      redis.call('DEL', KEYS[7])
      return { 'other_queue', home }
    end
    -- A lookup left by an expired state of this queue: refresh it.
    redis.call('SET', KEYS[9], ARGV[7], 'PX', ARGV[8])
  end
end
local id = ARGV[6]
local mid = redis.call('XADD', KEYS[8], '*', 'p', ARGV[5])
-- The entry id's milliseconds are the server's clock (never behind the stream's last entry).
local now = tonumber(string.match(mid, '^(%d+)'))
redis.call('ZADD', KEYS[2], ARGV[3], id)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[9]), id)
if ARGV[10] == '1' then prune(now, 300) end
return { 'created' }

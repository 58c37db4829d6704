-- Shared prelude of the command scripts (prepended to each one).
-- Index keys, all in the home queue's hash slot (list, counts and prune get all six as
-- KEYS[1..6]; submit and transition only the ones they touch, to keep each call small):
--   the expiry zset `p:cmd:{q}:exp` (id -> a LOWER BOUND of its state's expiry, ms), then the
--   per-status indexes SUBMITTED, RUNNING, SUCCEEDED, FAILED, CANCELLED (id -> created ms).
--   Listing every status merges the five.
-- A state key `p:cmd:{q}:id:<id>` (KEYS[1] without its `exp` suffix, `id:`, then the id; the
-- `id:` keeps an id such as `exp` or `s:RUNNING` off the index keys) is a string:
--   `<version> <STATUS> <created ms> <sha1 of the canonical submit body> <state JSON>`,
-- built by the client, so a compare-and-set reads the header alone (GETRANGE) and writes the
-- value, with its TTL, with one SET. (Redis's Lua hashes every byte of every string it makes,
-- so the scripts avoid handling the JSON more than once.)
local HEAD_MAX = 99 -- last header byte GETRANGE reads: 20 + 9 + 14 + 40 digits, 4 spaces
local TERMINAL = { SUCCEEDED = true, FAILED = true, CANCELLED = true }

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The header of a stored state: version, status, created ms, body sha1 (strings), and the
-- position where its JSON starts.
local function header(raw)
  return string.match(raw, '^(%d+) (%u+) (%d+) (%x+) ()')
end

-- Removes index entries of states that have expired, visiting at most `max` candidates.
-- Every write keeps the expiry score at or below the state's real expiry (submit scores
-- now + the store's shortest lifetime; every later write lowers it to its own expiry with
-- `ZADD LT`), so
-- a state whose score is still in the future is certainly live. A candidate (score in the past)
-- is checked: gone -> removed from every index; still there -> re-scored to its real expiry
-- (PEXPIRETIME, Redis 7.0), a valid bound again.
local function prune(now, max)
  local prefix = string.sub(KEYS[1], 1, #KEYS[1] - 3) .. 'id:'
  local n = 0
  while n < max do
    local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, 100)
    if #ids == 0 then break end
    local gone = {}
    for i = 1, #ids do
      local at = redis.call('PEXPIRETIME', prefix .. ids[i])
      if at == -2 then
        gone[#gone + 1] = ids[i]
      else
        -- -1 (no expiry) cannot happen for a state; look again in a day.
        if at < now then at = now + 86400000 end
        redis.call('ZADD', KEYS[1], 'XX', at, ids[i])
      end
    end
    if #gone > 0 then
      for k = 1, 6 do redis.call('ZREM', KEYS[k], unpack(gone)) end
    end
    n = n + #ids
  end
end

-- Per-minute aggregates (see src/minutes.rs): a ring of MIN_SLOTS minutes in one hash per home
-- queue, fields `<slot>:<name>`. MIN_BOUNDS: the duration buckets' upper bounds (ms, exclusive).
local MIN_SLOTS = 120
local MIN_BOUNDS = { 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000, 1000000, 2000000, 5000000 }

-- The field prefix of minute slot of `now` in hash `key`, cleared first if it held another
-- minute (then the hash lives for the ring's span from now).
local function minute_slot(key, now)
  local m = math.floor(now / 60000)
  local p = (m % MIN_SLOTS) .. ':'
  if redis.call('HGET', key, p .. 'm') ~= tostring(m) then
    local f = { p .. 'm', p .. 's', p .. 'f', p .. 'c', p .. 'r', p .. 'q', p .. 'a' }
    for i = 0, #MIN_BOUNDS do f[#f + 1] = p .. 'd' .. i end
    redis.call('HDEL', key, unpack(f))
    redis.call('HSET', key, p .. 'm', tostring(m))
    redis.call('PEXPIRE', key, (MIN_SLOTS + 1) * 60000)
  end
  return p
end

-- The duration bucket field of a handler call started at `start` (ms, '' for none) and ended
-- `now`, or nil.
local function minute_bucket(start, now)
  if start == '' then return nil end
  local d = now - tonumber(start)
  if d < 0 then d = 0 end
  for i = 1, #MIN_BOUNDS do
    if d < MIN_BOUNDS[i] then return 'd' .. (i - 1) end
  end
  return 'd' .. #MIN_BOUNDS
end

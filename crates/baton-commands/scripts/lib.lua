-- Shared prelude of the command scripts (prepended to each one).
-- Index keys, always KEYS[1..7] and all in the home queue's hash slot:
--   KEYS[1] expiry zset (id -> state expiry ms), KEYS[2] all-statuses index,
--   KEYS[3..7] per-status indexes SUBMITTED, RUNNING, SUCCEEDED, FAILED, CANCELLED (id -> created ms).
local STATUS_KEY = { SUBMITTED = 3, RUNNING = 4, SUCCEEDED = 5, FAILED = 6, CANCELLED = 7 }
local TERMINAL = { SUCCEEDED = true, FAILED = true, CANCELLED = true }

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Removes index entries of states that have expired (expiry strictly before now), at most `max`.
-- The expiry zset's score is set by the same script call that sets the state key's PEXPIRE, from
-- the same clock, so a score in the past means the key is gone.
local function prune(now, max)
  local n = 0
  while n < max do
    local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, 100)
    if #ids == 0 then break end
    for k = 2, 7 do redis.call('ZREM', KEYS[k], unpack(ids)) end
    redis.call('ZREM', KEYS[1], unpack(ids))
    n = n + #ids
  end
end

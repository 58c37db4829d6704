-- The gated read of new entries: checks the queue's gates and takes up to `count` never-delivered
-- entries in one atomic step, without blocking (XREADGROUP without BLOCK), so nothing new is
-- taken while a gate is shut. This is THE place where decisions about taking NEW work go (pause,
-- back-off and rate limit today; concurrency caps and priorities later): reclaims and
-- redeliveries of already-started work do not pass here.
-- KEYS[1] queue stream, KEYS[2] pause flag (string, ms since paused), KEYS[3] control stream
-- (one entry per resume), KEYS[4] rate limit state (string: GCRA theoretical arrival time, µs,
-- Redis time), KEYS[5] back-off (string; its time to live is the back-off left)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] count, ARGV[4] the group's doorbell group,
-- ARGV[5] the rate limit's emission interval (µs, may have a fraction; '' for no rate limit),
-- ARGV[6] its burst tolerance (µs)
-- Returns {1, control id} when paused: wait on the control stream after that id (a resume
-- appends to it); {2, ms} when backing off, {3, ms} when over the rate limit: the gate opens by
-- itself in ms (a timed wait, nothing to watch); {0, ''} when nothing is new: wait with
-- `XREADGROUP … NOACK BLOCK` on the doorbell group, which this script has set to where the group
-- stands (every entry up to it has been delivered), so that each later entry wakes exactly one
-- waiter (XREAD BLOCK would wake every waiter for each entry); {0, '', entries} when entries were
-- taken (the XREADGROUP entry list).
if redis.call('EXISTS', KEYS[2]) == 1 then
  local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
  if last[1] then return {1, last[1][1]} end
  return {1, '0-0'}
end
local count = tonumber(ARGV[3])
-- Back-off and rate limit (timed gates) ------------------------------------------------------
local backoff = redis.call('PTTL', KEYS[5])
if backoff > 0 then return {2, backoff} end
-- GCRA: entry i (1-based) of this read conforms when tat + (i - 1)·T − now ≤ τ, tat being the
-- theoretical arrival time (at least now); grant as many as conform, at most `count`, and move
-- tat on by the entries actually taken (below).
local rate_t, tat, now = tonumber(ARGV[5]), nil, nil
if rate_t then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local tau = tonumber(ARGV[6])
  tat = math.max(tonumber(redis.call('GET', KEYS[4]) or '0') or 0, now)
  local k = math.floor((now + tau - tat) / rate_t) + 1
  if k < 1 then return {3, math.max(1, math.ceil((tat - tau - now) / 1000))} end
  if k < count then count = k end
end
-- ---------------------------------------------------------------------------------------------
local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', KEYS[1], '>')
if r and r[1] and #r[1][2] > 0 then
  -- Rate limit: tat moves on by the entries taken (the key lives until tat has passed).
  if rate_t then
    tat = tat + #r[1][2] * rate_t
    redis.call('SET', KEYS[4], string.format('%.3f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
  end
  return {0, '', r[1][2]}
end
-- Nothing new: the doorbell group to where the group stands (written only when it differs).
local at, bell = nil, nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local m = {}
  for i = 1, #g, 2 do m[g[i]] = g[i + 1] end
  if m['name'] == ARGV[1] then at = m['last-delivered-id'] end
  if m['name'] == ARGV[4] then bell = m['last-delivered-id'] end
end
if not bell then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[4], at)
elseif bell ~= at then
  redis.call('XGROUP', 'SETID', KEYS[1], ARGV[4], at)
end
return {0, ''}

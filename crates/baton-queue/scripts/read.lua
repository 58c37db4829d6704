-- The gated read of new entries: checks the queue's gates and takes up to `count` never-delivered
-- entries in one atomic step, without blocking (XREADGROUP without BLOCK), so nothing new is
-- taken while a gate is shut. This is THE place where decisions about taking NEW work go (pause
-- today; concurrency caps, priorities and rate limits later): reclaims and redeliveries of
-- already-started work do not pass here.
-- KEYS[1] queue stream, KEYS[2] pause flag (string, ms since paused), KEYS[3] control stream
-- (one entry per resume)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] count, ARGV[4] the group's doorbell group
-- Returns {1, control id} when paused: wait on the control stream after that id (a resume
-- appends to it); {0, ''} when nothing is new: wait with `XREADGROUP … NOACK BLOCK` on the
-- doorbell group, which this script has set to where the group stands (every entry up to it has
-- been delivered), so that each later entry wakes exactly one waiter (XREAD BLOCK would wake
-- every waiter for each entry); {0, '', entries} when entries were taken (the XREADGROUP entry
-- list).
if redis.call('EXISTS', KEYS[2]) == 1 then
  local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
  if last[1] then return {1, last[1][1]} end
  return {1, '0-0'}
end
local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
if r and r[1] and #r[1][2] > 0 then
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

-- The gated read of new entries: checks the queue's gates and takes up to `count` never-delivered
-- entries in one atomic step, without blocking (XREADGROUP without BLOCK), so nothing new is
-- taken while a gate is shut. This is THE place where decisions about taking NEW work go (pause
-- today; concurrency caps, priorities and rate limits later): reclaims and redeliveries of
-- already-started work do not pass here.
-- KEYS[1] queue stream, KEYS[2] pause flag (string, ms since paused), KEYS[3] control stream
-- (one entry per resume)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] count
-- Returns {1, control id} when paused: wait on the control stream after that id (a resume
-- appends to it); {0, stream id} when nothing is new: wait on the queue stream after that id
-- (its last entry: every entry still in the stream has been delivered, so any entry after it is
-- new); {0, '', entries} when entries were taken (the XREADGROUP entry list).
local function last_id(key)
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if last[1] then return last[1][1] end
  return '0-0'
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {1, last_id(KEYS[3])}
end
local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
if r and r[1] and #r[1][2] > 0 then
  return {0, '', r[1][2]}
end
return {0, last_id(KEYS[1])}

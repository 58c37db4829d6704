-- Pauses or resumes a queue (the gate of read.lua).
-- KEYS[1] pause flag (string: ms since paused, Redis time), KEYS[2] control stream
-- ARGV[1] '1' pause, '0' resume
-- Pause sets the flag if unset; resume deletes it and appends an entry to the control stream
-- (trimmed to that one entry), which wakes the consumers waiting on it.
-- Returns 1 when the state changed, 0 when the queue already was in it.
if ARGV[1] == '1' then
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  if redis.call('SET', KEYS[1], now, 'NX') then return 1 end
  return 0
end
if redis.call('DEL', KEYS[1]) == 1 then
  redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', 'op', 'resume')
  return 1
end
return 0

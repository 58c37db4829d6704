-- Reschedule of a scheduled command (CommandStore::reschedule): a compare-and-set of its state
-- that moves its message in the home queue's delayed set, only while the message still waits
-- there (named `c:<id>`, see submits.lua).
-- KEYS[1] expiry zset (lib.lua), KEYS[2] the state key, KEYS[3] the delayed set
-- (baton_queue::keys::delayed), KEYS[4] the event feed (feed.rs)
-- ARGV[1] expected header start `<version> SUBMITTED `, ARGV[2] new stored state (header and
-- JSON), ARGV[3] its TTL ms, ARGV[4] id, ARGV[5] the new due time (ms), ARGV[6] the
-- `rescheduled` event or '' (none), ARGV[7] the feed's length.
-- Returns {'ok'}, {'missing'}, {'conflict', current state} or {'not_waiting', current state}.
local head = redis.call('GETRANGE', KEYS[2], 0, HEAD_MAX)
if head == '' then return { 'missing' } end
if string.sub(head, 1, #ARGV[1]) ~= ARGV[1] then return { 'conflict', redis.call('GET', KEYS[2]) } end
local name = 'c:' .. ARGV[4]
if not redis.call('ZSCORE', KEYS[3], name) then return { 'not_waiting', redis.call('GET', KEYS[2]) } end
redis.call('ZADD', KEYS[3], 'XX', ARGV[5], name)
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[1], 'LT', now_ms() + tonumber(ARGV[3]), ARGV[4])
if ARGV[6] ~= '' then
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'i', ARGV[4], 'e', ARGV[6])
end
return { 'ok' }

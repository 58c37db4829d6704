-- Compare-and-set of one cron schedule's record (see schedules.rs): the one atomic step that
-- decides a fire (or a skip, or a missed due time) across every process.
-- KEYS[1] the record. ARGV[1] the record JSON the caller read ('' = absent), ARGV[2] the new one.
-- Returns 1 when written, 0 when the record is not what the caller read (another process decided).
local cur = redis.call('GET', KEYS[1]) or ''
if cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1

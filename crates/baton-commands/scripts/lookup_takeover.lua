-- Takes over an id -> queue lookup key that names a queue where the command does not exist (its
-- state expired, or a submit crashed between the lookup write and its script): a compare-and-set,
-- so that of several submits racing for the same stale lookup exactly one wins.
-- KEYS[1] the lookup key. ARGV[1] the queue it must still name, ARGV[2] the new queue, ARGV[3]
-- its TTL ms.
-- Returns 1 when taken over, else 0 (it names another queue by now, or it is gone).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0

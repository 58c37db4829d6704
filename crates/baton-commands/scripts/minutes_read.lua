-- Reads a queue's per-minute aggregates (src/minutes.rs) with the clock they were written by.
-- KEYS[1] the per-minute aggregates hash. Returns {now ms, HGETALL's flat field/value list}.
return { now_ms(), redis.call('HGETALL', KEYS[1]) }

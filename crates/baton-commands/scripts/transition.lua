-- Transition: compare-and-set of a state on its version; the first terminal write wins.
-- KEYS[1] expiry zset, KEYS[2] index of the old status, KEYS[3] index of the new status (see
-- lib.lua), KEYS[4] state key, KEYS[5] the home queue's event feed (see feed.rs), KEYS[6] the
-- home queue's completion hook delivery stream (see hooks.rs), KEYS[7] its per-minute aggregates
-- (see src/minutes.rs), KEYS[8] target queue stream (only with ARGV[6]: an atomic hand-off, same
-- slot), KEYS[#KEYS - 9] the
-- stream of the delivery, KEYS[#KEYS - 8] its fence hash (baton_queue::keys::fences) and
-- KEYS[#KEYS - 7 .. #KEYS] its 8 concurrency-cap and priority keys (baton_queue::keys::caps, in the order of
-- baton-queue's caps.lua, prepended: an acked entry frees its concurrency slots; all only with
-- ARGV[7]).
-- ARGV[1] expected header start `<version> <OLD STATUS> `, ARGV[2] new stored state (header
-- and JSON, see lib.lua), ARGV[3] TTL ms, ARGV[4] pub/sub channel, ARGV[5] id, ARGV[6] message
-- JSON for KEYS[8] or '', ARGV[7] the delivery's entry id or '', ARGV[8] its group, ARGV[9] the
-- announcement to publish ('' for none: only terminal writes are announced), ARGV[10] the
-- consumer that must own the delivery for the write to happen ('' for no check), ARGV[11] '1'
-- to ack the delivery with a successful write, ARGV[12] the delivery's fence ('' for none; with
-- ARGV[10], the entry's fence must be this one: a later delivery of the same entry to the same
-- consumer is not this writer's, see baton-queue's reclaim.lua), ARGV[13] the event to append
-- to the feed with a successful write ('' none), ARGV[14] the feed's length (XADD MAXLEN ~),
-- ARGV[15] '1' for a re-run: the expected (old) status may be terminal (only then; every other
-- write to a terminal state is a conflict), ARGV[16] the completion hook body to XADD to KEYS[6]
-- with a successful write ('' none), ARGV[17] the per-minute counter this write adds one to ('s',
-- 'f', 'c', 'r'; '' none), ARGV[18] the start (ms) of the handler call whose outcome it is, for the
-- duration histogram ('' none).
-- The owner check makes "the writer still holds its lease" and the write one atomic step (a
-- remote worker's settle: a takeover between a separate check and the write would let a worker
-- whose lease is gone write its outcome).
-- The ack needs no owner check of its own: the version compare-and-set already decided that
-- this write is the command's next step, and dispatch reads the state, so a delivery of this
-- message held by another consumer has nothing left to do.
-- Returns {'ok', acked 0/1}, {'missing'}, {'conflict', current stored state} or {'lost'} (the
-- owner check failed; nothing written).
if ARGV[10] ~= '' then
  local p = redis.call('XPENDING', KEYS[#KEYS - 9], ARGV[8], ARGV[7], ARGV[7], 1)
  if not p[1] or p[1][2] ~= ARGV[10] then return { 'lost' } end
  if ARGV[12] ~= '' and (redis.call('HGET', KEYS[#KEYS - 8], ARGV[7]) or '0') ~= ARGV[12] then return { 'lost' } end
end
local head = redis.call('GETRANGE', KEYS[4], 0, HEAD_MAX)
if head == '' then return { 'missing' } end
local _, s, c = string.match(head, '^(%d+) (%u+) (%d+) ')
if string.sub(head, 1, #ARGV[1]) ~= ARGV[1] or (TERMINAL[s] and ARGV[15] ~= '1') then
  return { 'conflict', redis.call('GET', KEYS[4]) }
end
local id = ARGV[5]
redis.call('SET', KEYS[4], ARGV[2], 'PX', ARGV[3])
if KEYS[2] ~= KEYS[3] then
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZADD', KEYS[3], c, id)
end
-- Keep the expiry score a lower bound (see lib.lua): only ever lowered. On every write: the
-- score may be above this write's expiry even when its TTL is the store's shortest (a prune
-- re-scored a live entry to its then expiry, or another store with longer lifetimes submitted).
redis.call('ZADD', KEYS[1], 'LT', now_ms() + tonumber(ARGV[3]), id)
-- 'p': the work queue's payload field (baton_queue::keys::PAYLOAD_FIELD; a test checks it).
if ARGV[6] ~= '' then redis.call('XADD', KEYS[8], '*', 'p', ARGV[6]) end
if ARGV[16] ~= '' then redis.call('XADD', KEYS[6], '*', 'p', ARGV[16]) end
if ARGV[13] ~= '' then redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[14], '*', 'i', id, 'e', ARGV[13]) end
-- Per-minute aggregates (src/minutes.rs): one to counter ARGV[17] and to the duration bucket
-- of a handler call started at ARGV[18], in this minute's slot of KEYS[7].
if ARGV[17] ~= '' then
  local now = now_ms()
  local p = minute_slot(KEYS[7], now)
  redis.call('HINCRBY', KEYS[7], p .. ARGV[17], 1)
  local d = minute_bucket(ARGV[18], now)
  if d then redis.call('HINCRBY', KEYS[7], p .. d, 1) end
end
local acked = 0
if ARGV[11] == '1' then
  local stream, mid = KEYS[#KEYS - 9], ARGV[7]
  acked = redis.call('XACK', stream, ARGV[8], mid)
  if acked == 1 then
    redis.call('XDEL', stream, mid)
    redis.call('HDEL', KEYS[#KEYS - 8], mid)
    local C = caps_keys(#KEYS - 7)
    caps_release(C, stream, mid)
    caps_wake(C)
  end
end
if ARGV[9] ~= '' then redis.call('PUBLISH', ARGV[4], ARGV[9]) end
return { 'ok', acked }

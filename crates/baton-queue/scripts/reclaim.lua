-- Reclaim tick: promote due delayed entries, then take over idle pending entries.
-- KEYS[1] queue stream, KEYS[2] dead-letter stream, KEYS[3] delayed zset (member = original id,
-- score = due ms), KEYS[4] delayed payload hash (<id> -> payload, <id>:dc -> prior deliveries)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] claim timeout (min idle, ms), ARGV[4] XAUTOCLAIM
-- cursor, ARGV[5] count (0 = promote only), ARGV[6] max deliveries (0 = unlimited), ARGV[7] now
-- (ms since epoch), ARGV[8] max entries to promote, ARGV[9..] ids to exclude: entries whose
-- handler still runs in this consumer after its lease was released (max processing time). They
-- are handed straight back (idle = claim timeout, delivery count restored with RETRYCOUNT) so
-- that a peer, not the same consumer, takes them.
-- XAUTOCLAIM (Redis 7.0+) pages with its cursor and removes entries deleted from the stream from
-- the pending list itself, returning their ids as the third element (Redis docs, XAUTOCLAIM).
-- Returns {next cursor, {{id, payload or false, deliveries}, …}, dead-lettered, deleted, promoted}.
local stream, dead, zdelayed, hdelayed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, me = ARGV[1], ARGV[2]
local count, maxd, now = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]

local promoted = 0
local due = redis.call('ZRANGEBYSCORE', zdelayed, '-inf', now, 'LIMIT', 0, tonumber(ARGV[8]))
for _, id in ipairs(due) do
  local payload = redis.call('HGET', hdelayed, id)
  local prior = redis.call('HGET', hdelayed, id .. ':dc') or '0'
  if payload then
    redis.call('XADD', stream, '*', 'p', payload, 'dc', prior)
    promoted = promoted + 1
  end
  redis.call('ZREM', zdelayed, id)
  redis.call('HDEL', hdelayed, id, id .. ':dc')
end

local exclude = {}
for i = 9, #ARGV do exclude[ARGV[i]] = true end

local cursor, out, ndead, ndeleted = ARGV[4], {}, 0, 0
if count > 0 then
  local r = redis.call('XAUTOCLAIM', stream, group, me, ARGV[3], cursor, 'COUNT', count)
  cursor = r[1]
  if r[3] then ndeleted = #r[3] end
  for _, e in ipairs(r[2]) do
    local id, fields = e[1], e[2]
    local payload, prior = false, 0
    for i = 1, #fields, 2 do
      if fields[i] == 'p' then payload = fields[i + 1]
      elseif fields[i] == 'dc' then prior = tonumber(fields[i + 1]) or 0 end
    end
    local info = redis.call('XPENDING', stream, group, id, id, 1)
    local count_now = (info[1] and info[1][4]) or 1
    local total = prior + count_now
    if exclude[id] then
      redis.call('XCLAIM', stream, group, me, 0, id, 'IDLE', ARGV[3], 'RETRYCOUNT', count_now - 1, 'JUSTID')
    elseif payload == false or (maxd > 0 and total > maxd) then
      local reason = 'max deliveries exceeded'
      if payload == false then reason = 'malformed entry: no payload field' end
      redis.call('XADD', dead, '*', 'id', id, 'p', payload or '', 'dc', total - 1, 'reason', reason, 'at', now)
      redis.call('XACK', stream, group, id)
      redis.call('XDEL', stream, id)
      ndead = ndead + 1
    else
      out[#out + 1] = {id, payload, total}
    end
  end
end
return {cursor, out, ndead, ndeleted, promoted}

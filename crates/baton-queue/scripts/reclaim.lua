-- Reclaim tick: promote due delayed entries, then take over reclaimable entries.
-- KEYS[1] queue stream, KEYS[2] dead-letter stream, KEYS[3] delayed zset (member = original id,
-- or the name of a scheduled entry (schedule.lua), score = due ms, server time), KEYS[4] delayed
-- payload hash (<id or name> -> payload, <id>:dc -> prior
-- deliveries), KEYS[5] liveness hash (consumer -> ms of its last heartbeat, server time),
-- KEYS[6] fence hash (id -> fence of its latest delivery, see below), KEYS[7..14] as caps.lua
-- (prepended): entries dead-lettered or found deleted free their concurrency slots; a delayed
-- entry's key and priority (`<id>:k`, `<id>:pr`) go back on it when promoted, and its mark
-- `<id>:kr` (delayed by the per-key rate limit, read.lua: its key's head, charged when taken;
-- `h`: holding a slot of its key, under its id in keys:ids, which moves to the new entry) as the
-- fields `kr` (and `kh`)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] the parked owner, ARGV[4] claim timeout (ms),
-- ARGV[5] count (0 = promote, and tell whether reclaimable entries exist), ARGV[6] max
-- deliveries (0 = unlimited), ARGV[7] max entries to promote, ARGV[8] outage gap (ms),
-- ARGV[9..] ids to exclude: entries whose handler still runs in this process after its lease was
-- lost or released.
-- Reclaimable: idle at least the claim timeout, owned by the parked owner or by a consumer whose
-- liveness record is at least the claim timeout old (or missing; see below for mixed claim
-- timeouts). Never this consumer's own
-- entries: everything it owns is a lease it holds. Candidates are found per owner with
-- XPENDING … IDLE (Redis 6.2+), which walks only that owner's pending entries: the live
-- consumers' (renewed) entries are never scanned. XCLAIM re-checks the idle time and, on Redis
-- 7.0+, drops pending entries whose stream entry was deleted (they are not returned).
-- Outages: every heartbeat and reclaim of the queue stamps the liveness hash's `~clock` field.
-- When Redis sees no stamp for the outage gap (Redis paused, restarted or failed over, or every
-- consumer gone), idle times and liveness records say nothing about who is alive: reclaims hold
-- off for one claim timeout (`~hold`), in which every live consumer renews its leases.
-- Fences: every entry delivered by this reclaim gets a new fence (its field in KEYS[6] raised by
-- one; a first delivery, by a read, has fence 0 and no field), so that this delivery can be told
-- from an earlier one of the same entry, which may have been this very consumer's (its orphan
-- parked by its heartbeat, a re-poll, or taken by a peer that died since). The fields of entries
-- dead-lettered or found deleted here are removed.
-- Concurrency caps backstop: while entries wait for a key slot, once per claim timeout up to 200
-- slot holders (`keys:ids`, walked with HSCAN from a cursor kept in the waiting entries' hash,
-- fields `~cursor` and `~checked`) are checked: one neither pending nor in the stream nor in the
-- delayed set (waiting for its key's rate, read.lua) lost its
-- release (its pending entry was removed by something else than the queue's scripts), and its
-- slot is released now (caps.lua), so no key waits forever.
-- Returns {{{id, payload or false, deliveries, fence}, …}, dead-lettered, deleted, promoted,
-- more (0/1), ms until the next delayed entry is due (-1: none)}.
local stream, dead, zdelayed, hdelayed, live, fences = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local C = caps_keys(7)
local group, me, parked = ARGV[1], ARGV[2], ARGV[3]
local claim_ms, count, maxd = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local clock = redis.call('HGET', live, '~clock')
redis.call('HSET', live, '~clock', now)
if clock and now - tonumber(clock) >= tonumber(ARGV[8]) then redis.call('HSET', live, '~hold', now + claim_ms) end
local hold = tonumber(redis.call('HGET', live, '~hold') or '0')

local promoted, named = 0, 0
local due = redis.call('ZRANGEBYSCORE', zdelayed, '-inf', now, 'LIMIT', 0, tonumber(ARGV[7]))
if #due > 0 then
  local fields = {}
  for _, id in ipairs(due) do
    local payload = redis.call('HGET', hdelayed, id)
    local prior, key, pr, kr = '0', false, false, false
    -- A named (scheduled) member (schedule.lua) holds a ':'; it has no prior deliveries.
    if string.find(id, ':', 1, true) then
      named = named + 1
    else
      prior = redis.call('HGET', hdelayed, id .. ':dc') or '0'
      fields[#fields + 1] = id .. ':dc'
    end
    key = redis.call('HGET', hdelayed, id .. ':k')
    pr = redis.call('HGET', hdelayed, id .. ':pr')
    kr = redis.call('HGET', hdelayed, id .. ':kr')
    fields[#fields + 1] = id .. ':k'
    fields[#fields + 1] = id .. ':pr'
    fields[#fields + 1] = id .. ':kr'
    if payload then
      local f = {'p', payload, 'dc', prior}
      if key then
        f[5] = 'k'
        f[6] = key
      end
      -- Delayed for its key's rate: its head; holding its key slot (if it still does), the
      -- holder id moves to its new entry.
      local holds = key and kr == 'h' and redis.call('HDEL', C.ids, id) == 1
      if key and kr then
        f[#f + 1] = 'kr'
        f[#f + 1] = '1'
      end
      if holds then
        f[#f + 1] = 'kh'
        f[#f + 1] = '1'
      end
      local nid = caps_add(C, stream, f, pr)
      if holds then redis.call('HSET', C.ids, nid, key) end
      promoted = promoted + 1
    end
    fields[#fields + 1] = id
  end
  redis.call('ZREM', zdelayed, unpack(due))
  redis.call('HDEL', hdelayed, unpack(fields))
  if named > 0 then redis.call('HINCRBY', hdelayed, '~scheduled', -named) end
end
local next_due = -1
-- Entries parked in a key's rate line (read.lua: score CAPS_PARK, never due) are not waited for.
local first = redis.call('ZRANGEBYSCORE', zdelayed, '-inf', string.format('(%d', CAPS_PARK), 'WITHSCORES', 'LIMIT', 0, 1)
if first[2] then next_due = math.max(0, tonumber(first[2]) - now) end

if now < hold then return {{}, 0, 0, promoted, 0, next_due} end

local exclude, nexclude = {}, 0
for i = 9, #ARGV do exclude[ARGV[i]] = true; nexclude = nexclude + 1 end

-- Owners whose entries may be reclaimable: the parked owner first, then stale consumers. A
-- liveness record is `<ms>:<its claim timeout ms>`: an owner is stale, and its entries
-- reclaimable, only past the longer of the two claim timeouts, so that processes configured with
-- different claim timeouts never take each other's live work. `0:…` marks a consumer that
-- stopped while still owning entries: it is removed from the group once they are taken.
local owners, wait, stopped = {}, {}, {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', stream, group)) do
  local m = {}
  for i = 1, #c, 2 do m[c[i]] = c[i + 1] end
  local name = m['name']
  if name ~= me and tonumber(m['pending']) > 0 then
    if name == parked then
      table.insert(owners, 1, name)
      wait[name] = claim_ms
    else
      local rec = redis.call('HGET', live, name)
      local seen, theirs = 0, claim_ms
      if rec then
        local a, b = string.match(rec, '^(%d+):?(%d*)$')
        seen = tonumber(a) or 0
        if b and b ~= '' then theirs = math.max(claim_ms, tonumber(b)) end
      end
      if now - seen >= theirs then
        owners[#owners + 1] = name
        wait[name] = theirs
        if rec and seen == 0 then stopped[name] = true end
      end
    end
  end
end

local want = math.max(count, 1)
local ids, more = {}, false
for _, owner in ipairs(owners) do
  if #ids >= want then more = true; break end
  local pel = redis.call('XPENDING', stream, group, 'IDLE', wait[owner], '-', '+', want - #ids + nexclude + 1, owner)
  for _, e in ipairs(pel) do
    if not exclude[e[1]] then
      if #ids < want then ids[#ids + 1] = e[1] else more = true end
    end
  end
end

local out, ndead, ndeleted = {}, 0, 0
if count == 0 then
  return {out, 0, 0, promoted, (#ids > 0 or more) and 1 or 0, next_due}
end
if #ids > 0 then
  local args = {'XCLAIM', stream, group, me, 0}
  for _, id in ipairs(ids) do args[#args + 1] = id end
  local claimed = redis.call(unpack(args))
  ndeleted = #ids - #claimed
  if ndeleted > 0 then
    local got = {}
    for _, e in ipairs(claimed) do got[e[1]] = true end
    for _, id in ipairs(ids) do
      if not got[id] then
        redis.call('HDEL', fences, id)
        caps_release(C, stream, id)
      end
    end
  end
  -- A stopped consumer whose last entries were just taken leaves the group now.
  for name in pairs(stopped) do
    if #redis.call('XPENDING', stream, group, '-', '+', 1, name) == 0 then
      redis.call('XGROUP', 'DELCONSUMER', stream, group, name)
      redis.call('HDEL', live, name)
    end
  end
  for _, e in ipairs(claimed) do
    local id, fields = e[1], e[2]
    local payload, prior, extra = false, 0, {}
    for i = 1, #fields, 2 do
      if fields[i] == 'p' then payload = fields[i + 1]
      elseif fields[i] == 'dc' then prior = tonumber(fields[i + 1]) or 0
      elseif fields[i] == 'k' or fields[i] == 'pr' then
        extra[#extra + 1] = fields[i]
        extra[#extra + 1] = fields[i + 1]
      end
    end
    local info = redis.call('XPENDING', stream, group, id, id, 1)
    local total = prior + ((info[1] and info[1][4]) or 1)
    if payload == false or (maxd > 0 and total > maxd) then
      local reason = 'max deliveries exceeded'
      if payload == false then reason = 'malformed entry: no payload field' end
      redis.call('XADD', dead, '*', 'id', id, 'p', payload or '', 'dc', total - 1, 'reason', reason, 'at', now, unpack(extra))
      redis.call('XACK', stream, group, id)
      redis.call('XDEL', stream, id)
      redis.call('HDEL', fences, id)
      caps_release(C, stream, id)
      ndead = ndead + 1
    else
      out[#out + 1] = {id, payload, total, redis.call('HINCRBY', fences, id, 1)}
    end
  end
end
local lost = 0
if redis.call('EXISTS', C.wait) == 1 then
  local checked = tonumber(redis.call('HGET', C.waitp, '~checked') or '0')
  if now - checked >= claim_ms then
    local scan = redis.call('HSCAN', C.ids, redis.call('HGET', C.waitp, '~cursor') or '0', 'COUNT', 200)
    redis.call('HSET', C.waitp, '~checked', now, '~cursor', scan[1])
    for i = 1, #scan[2], 2 do
      local id = scan[2][i]
      if #redis.call('XPENDING', stream, group, id, id, 1) == 0 and #redis.call('XRANGE', stream, id, id) == 0
        and not redis.call('ZSCORE', zdelayed, id) then
        caps_release(C, stream, id)
        lost = lost + 1
      end
    end
  end
end
if ndead + ndeleted + lost > 0 then caps_wake(C) end
return {out, ndead, ndeleted, promoted, more and 1 or 0, next_due}

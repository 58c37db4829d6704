-- Heartbeat of one consumer, atomically, in one call per tick whatever the number of leases.
-- KEYS[1] queue stream, KEYS[2] liveness hash (consumer -> ms of its last heartbeat), KEYS[3]
-- fence hash (reclaim.lua)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] the parked owner, ARGV[4] claim timeout (ms),
-- ARGV[5] orphan idle (ms), ARGV[6] how many of this consumer's pending entries to look at,
-- ARGV[7] outage gap (ms; see reclaim.lua), ARGV[8] r = number of ids to renew, then the r ids;
-- then f = 0 or r, then f fences (of the ids to renew, in order: an id whose entry has another
-- fence is a later delivery's, so stale: not renewed, not held); then q = number of quiet ids,
-- then the q ids; then the ids to release.
-- 1. The liveness record `<now ms>:<claim timeout ms>`, in server time (the reaper and the
--    reclaim tick of every process read it; no clock of a client is involved), and the queue's
--    `~clock` stamp (reclaim.lua).
-- 2. Renew = XCLAIM to ourselves with min-idle 0 and JUSTID: idle reset, delivery count kept
--    (Redis docs, XCLAIM). Only entries this consumer owns are renewed (checked one by one past
--    the window of its pending entries looked at): a lease another consumer took is never taken
--    back. Ids to renew or quiet ids (settlements in flight) that are not ours are reported:
--    owned by another consumer (lost), or by the parked owner or not pending (gone).
-- 3. Release = hand to the parked owner with idle = claim timeout: reclaimable at once.
-- 4. Orphans: every other entry this consumer owns, idle at least the orphan idle, is handed to
--    the parked owner with its idle time kept, so that an entry it does not hold can never stay
--    pending forever under a live consumer.
-- Returns {lost ids, gone ids, orphans parked, stale: positions (1-based) in the renew list of
-- the ids whose fence is not their entry's}.
local stream, group, me, parked = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local claim_ms, orphan_ms, limit = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local clock = redis.call('HGET', KEYS[2], '~clock')
if clock and now - tonumber(clock) >= tonumber(ARGV[7]) then redis.call('HSET', KEYS[2], '~hold', now + tonumber(claim_ms)) end
redis.call('HSET', KEYS[2], me, now .. ':' .. claim_ms, '~clock', now)

local owned = {}
for _, e in ipairs(redis.call('XPENDING', stream, group, '-', '+', limit, me)) do owned[e[1]] = e[3] end

local function xclaim(ids, to, extra)
  for i = 1, #ids, 1000 do
    local args = {'XCLAIM', stream, group, to, '0'}
    for j = i, math.min(i + 999, #ids) do args[#args + 1] = ids[j] end
    for _, x in ipairs(extra) do args[#args + 1] = x end
    args[#args + 1] = 'JUSTID'
    redis.call(unpack(args))
  end
end

-- Who owns `id`: this consumer (window or a direct look past it), another consumer, nobody.
local function owner_of(id)
  if owned[id] then return me end
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if p[1] then return p[1][2] end
  return nil
end

-- Renew and quiet ids alike: ours → renewed; another consumer's → lost; the parked owner's or
-- not pending → gone (settled, handed back or deleted: nothing to renew, nobody took it).
local held, mine, lost, gone, stale = {}, {}, {}, {}, {}
local r = tonumber(ARGV[8])
local fpos = 9 + r
local f = tonumber(ARGV[fpos])
local qpos = fpos + f + 1
local q = tonumber(ARGV[qpos])
local function classify(i, fence)
  local id = ARGV[i]
  local o = owner_of(id)
  if o == me and fence and (redis.call('HGET', KEYS[3], id) or '0') ~= fence then
    stale[#stale + 1] = i - 8
    return
  end
  held[id] = true
  if o == me then
    mine[#mine + 1] = id
  elseif o and o ~= parked then
    lost[#lost + 1] = id
  else
    gone[#gone + 1] = id
  end
end
for i = 9, 8 + r do
  local fence = nil
  if f > 0 then fence = ARGV[fpos + i - 8] end
  classify(i, fence)
end
for i = qpos + 1, qpos + q do classify(i, nil) end
xclaim(mine, me, {})

local release = {}
for i = qpos + q + 1, #ARGV do
  local id = ARGV[i]
  held[id] = true
  if owner_of(id) == me then release[#release + 1] = id end
end
xclaim(release, parked, {'IDLE', claim_ms})

local orphans = 0
for id, idle in pairs(owned) do
  if not held[id] and idle >= orphan_ms then
    redis.call('XCLAIM', stream, group, parked, 0, id, 'IDLE', idle, 'JUSTID')
    orphans = orphans + 1
  end
end
return {lost, gone, orphans, stale}

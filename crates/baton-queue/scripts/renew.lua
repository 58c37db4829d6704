-- Heartbeat: renew the leases this consumer still owns, release expired ones, in one call.
-- KEYS[1] queue stream
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] claim timeout (ms), ARGV[4] n = number of ids to renew,
-- ARGV[5 .. 4+n] ids to renew, sorted ascending; ARGV[5+n ..] ids to release.
-- Renewing = XCLAIM to ourselves with min-idle 0 and JUSTID: resets the idle time, does not bump
-- the delivery count (Redis docs, XCLAIM). Ownership is checked first, so a lease another consumer
-- took is never taken back. Releasing = XCLAIM … IDLE <claim timeout> JUSTID: reclaimable at once.
-- Returns the ids of ARGV[5 .. 4+n] that are lost (not pending for this consumer, or deleted).
local stream, group, me = KEYS[1], ARGV[1], ARGV[2]
local claim_ms = ARGV[3]
local n = tonumber(ARGV[4])
local lost = {}

local function xclaim(ids, extra)
  local claimed = {}
  for i = 1, #ids, 1000 do
    local args = {'XCLAIM', stream, group, me, '0'}
    for j = i, math.min(i + 999, #ids) do args[#args + 1] = ids[j] end
    for _, x in ipairs(extra) do args[#args + 1] = x end
    args[#args + 1] = 'JUSTID'
    for _, id in ipairs(redis.call(unpack(args))) do claimed[id] = true end
  end
  return claimed
end

if n > 0 then
  -- This consumer's pending entries between the lowest and highest id to renew.
  local owned = {}
  local pel = redis.call('XPENDING', stream, group, ARGV[5], ARGV[4 + n], 2147483647, me)
  for _, e in ipairs(pel) do owned[e[1]] = true end
  local mine = {}
  for i = 5, 4 + n do
    if owned[ARGV[i]] then mine[#mine + 1] = ARGV[i] else lost[#lost + 1] = ARGV[i] end
  end
  local claimed = xclaim(mine, {})
  for _, id in ipairs(mine) do
    if not claimed[id] then lost[#lost + 1] = id end
  end
end

local release = {}
for i = 5 + n, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if p[1] and p[1][2] == me then release[#release + 1] = id end
end
if #release > 0 then xclaim(release, {'IDLE', claim_ms}) end
return lost

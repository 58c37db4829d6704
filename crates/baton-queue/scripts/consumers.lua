-- The consumers of a queue's group with their liveness records and their oldest leases.
-- KEYS[1] queue stream, KEYS[2] liveness hash (consumer -> `<last heartbeat ms>:<claim timeout
-- ms>`, written by heartbeat.lua in server time); ARGV[1] group, ARGV[2] the parked owner (not a
-- consumer: left out), ARGV[3] how many of each consumer's leases to return (its oldest).
-- Returns {now ms, then per consumer: name, pending, record or '', n, then n times (entry id,
-- idle ms, deliveries, payload or '' when the entry is gone)}.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local out = { now }
if redis.call('EXISTS', KEYS[1]) == 0 then return out end
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if not ok then return out end -- no group yet
local max = tonumber(ARGV[3])
for _, c in ipairs(consumers) do
  local m = {}
  for i = 1, #c, 2 do m[c[i]] = c[i + 1] end
  local name = m['name']
  if name ~= ARGV[2] then
    out[#out + 1] = name
    out[#out + 1] = m['pending']
    out[#out + 1] = redis.call('HGET', KEYS[2], name) or ''
    local leases = {}
    if max > 0 and m['pending'] > 0 then
      leases = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', max, name)
    end
    out[#out + 1] = #leases
    for _, p in ipairs(leases) do
      local e = redis.call('XRANGE', KEYS[1], p[1], p[1])
      local payload = ''
      if e[1] then
        local f = e[1][2]
        for i = 1, #f, 2 do
          if f[i] == 'p' then payload = f[i + 1] end
        end
      end
      out[#out + 1] = p[1]
      out[#out + 1] = p[3]
      out[#out + 1] = p[4]
      out[#out + 1] = payload
    end
  end
end
return out

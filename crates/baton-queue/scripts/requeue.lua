-- Requeue: entries this consumer was assigned but will not run (they arrived while it stopped)
-- go back to the tail of the stream as new entries, so that any consumer's read takes them at once
-- (a consumer blocked in XREADGROUP is served by the XADD). The delivery that did not run is not
-- counted: the copy carries the deliveries made before it (`dc`). Atomic per call.
-- An entry holding a concurrency slot of its key (caps.lua, prepended) hands it to its copy
-- (marked `kh`), so no entry of the key overtakes it. The copy keeps the entry's priority. A copy
-- of an entry with a key is marked `kc`: the read that took it charged its key's rate limit
-- (read.lua), and, the key's next entry having become its head then, the copy must not go behind
-- the key's rate line nor be charged twice: the next read takes it past the per-key rate gate.
-- KEYS[1] queue stream, KEYS[2] fence hash (reclaim.lua), KEYS[3..10] as caps.lua; ARGV[1] group, ARGV[2] consumer,
-- ARGV[3..] pairs (id, fence of the delivery or '' for any this consumer owns)
-- Returns how many were requeued (ids no longer owned by this consumer, or by a later delivery
-- of it, are left alone). The old entries' fences are removed.
local stream, group, me = KEYS[1], ARGV[1], ARGV[2]
local n = 0
local C = caps_keys(3)
for i = 3, #ARGV, 2 do
  local id, fence = ARGV[i], ARGV[i + 1]
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if p[1] and p[1][2] == me and (fence == '' or (redis.call('HGET', KEYS[2], id) or '0') == fence) then
    local e = redis.call('XRANGE', stream, id, id)
    if e[1] then
      local fields, payload, prior, key = e[1][2], nil, 0, nil
      for j = 1, #fields, 2 do
        if fields[j] == 'p' then payload = fields[j + 1]
        elseif fields[j] == 'dc' then prior = tonumber(fields[j + 1]) or 0
        elseif fields[j] == 'k' then key = fields[j + 1] end
      end
      local holds = key and redis.call('HGET', C.ids, id)
      if payload then
        local copy = {'p', payload, 'dc', prior + p[1][4] - 1}
        if key then
          copy[5] = 'k'
          copy[6] = key
        end
        if key then
          copy[#copy + 1] = 'kc'
          copy[#copy + 1] = '1'
        end
        if holds then
          copy[#copy + 1] = 'kh'
          copy[#copy + 1] = '1'
        end
        local nid = caps_add(C, stream, copy, caps_priority(fields))
        if holds then
          redis.call('HDEL', C.ids, id)
          redis.call('HSET', C.ids, nid, key)
        end
      elseif holds then
        caps_release(C, stream, id)
      end
    end
    redis.call('XACK', stream, group, id)
    redis.call('XDEL', stream, id)
    redis.call('HDEL', KEYS[2], id)
    n = n + 1
  end
end
if n > 0 then caps_wake(C) end
return n

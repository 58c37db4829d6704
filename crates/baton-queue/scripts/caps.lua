-- Concurrency caps and priorities: the shared part of every script that takes entries out of the
-- pending list or appends entries (prepended to them at build time). Keys, in this order at
-- KEYS[n..n+7] of the including script
-- (`caps_keys(n)`): the control stream, the slot-waiter flag (string: present while a gated read
-- found `max_concurrency` reached), the key hold counts (hash key -> entries holding one of the
-- key's slots), the key holders (hash entry id -> key, for entries holding a key slot: pending,
-- or promoted and not read yet), the key waiting line (zset, score 0, member
-- `<key>\0<16-digit seq>`: ZRANGEBYLEX finds a key's head in O(log n)) and the waiting entries
-- (hash member -> `<prior deliveries>:<payload>`, or `<prior deliveries>/<priority>:<payload>`
-- for an entry of a priority other than 0; field `~seq` the last seq), then the priorities' two
-- keys: the ready set (zset, score -priority, member the entry's arrival id padded to
-- `<16-digit ms>-<16-digit seq>`: see read.lua) and the ready entries (hash member -> the entry's
-- stream fields packed with cmsgpack; field `~new` present while the stream may hold unread
-- entries of a priority other than 0).
local function caps_keys(n)
  return {control = KEYS[n], waiter = KEYS[n + 1], held = KEYS[n + 2], ids = KEYS[n + 3],
    wait = KEYS[n + 4], waitp = KEYS[n + 5], ready = KEYS[n + 6], readyp = KEYS[n + 7]}
end

-- The delayed-set score of an entry parked in its key's rate line (read.lua): never due (about
-- 285,000 years from the Unix epoch in ms), so reclaim.lua neither promotes nor waits for it.
local CAPS_PARK = 9000000000000000

-- Appends an entry to the queue stream `stream` and returns its id: `fields` its field list
-- (`p`, `dc`, `k`, `kh` as it has them), `pr` its priority (nil or 0: none). An entry of another
-- priority gets the field `pr` and marks the queue (`~new`), so that the next gated read orders
-- the new entries by priority (read.lua); an entry of priority 0 is appended exactly as before.
local function caps_add(C, stream, fields, pr)
  pr = tonumber(pr) or 0
  if pr ~= 0 then
    fields[#fields + 1] = 'pr'
    fields[#fields + 1] = tostring(pr)
    redis.call('HSET', C.readyp, '~new', '1')
  end
  return redis.call('XADD', stream, '*', unpack(fields))
end

-- The priority of an entry's field list (field `pr`; 0 without one).
local function caps_priority(fields)
  for i = 1, #fields, 2 do
    if fields[i] == 'pr' then return tonumber(fields[i + 1]) or 0 end
  end
  return 0
end

-- The head of key k's waiting line (its member) or nil.
local function caps_head(C, k)
  local h = redis.call('ZRANGEBYLEX', C.wait, '[' .. k .. '\0', '(' .. k .. '\1', 'LIMIT', 0, 1)
  return h[1]
end

-- Entry `id` leaves the pending list (ack, dead letter, long retry, deleted): if it held a slot
-- of its key, the slot goes to the key's oldest waiter, appended to the stream as an entry marked
-- `kh` (it holds the slot already, so no newer entry of the key overtakes it), or is freed.
-- `stream` is the queue stream. Returns the key or nil.
local function caps_release(C, stream, id)
  local k = redis.call('HGET', C.ids, id)
  if not k then return nil end
  redis.call('HDEL', C.ids, id)
  local head = caps_head(C, k)
  if head then
    local v = redis.call('HGET', C.waitp, head) or '0:'
    redis.call('ZREM', C.wait, head)
    redis.call('HDEL', C.waitp, head)
    local sep = string.find(v, ':', 1, true)
    local dc, pr = string.match(string.sub(v, 1, sep - 1), '^([^/]*)/?(.*)$')
    local nid = caps_add(C, stream, {'p', string.sub(v, sep + 1), 'dc', dc, 'k', k, 'kh', '1'}, pr)
    redis.call('HSET', C.ids, nid, k)
  elseif redis.call('HINCRBY', C.held, k, -1) <= 0 then
    redis.call('HDEL', C.held, k)
  end
  return k
end

-- Called once by a script that took entries out of the pending list: wakes the gated reads
-- waiting for a `max_concurrency` slot (they XREAD BLOCK on the control stream), if any.
local function caps_wake(C)
  if redis.call('DEL', C.waiter) == 1 then
    redis.call('XADD', C.control, 'MAXLEN', '1', '*', 'op', 'slot')
  end
end

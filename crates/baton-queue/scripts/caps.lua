-- Concurrency caps: the shared part of every script that takes entries out of the pending list
-- (prepended to them at build time). Keys, in this order at KEYS[n..n+5] of the including script
-- (`caps_keys(n)`): the control stream, the slot-waiter flag (string: present while a gated read
-- found `max_concurrency` reached), the key hold counts (hash key -> entries holding one of the
-- key's slots), the key holders (hash entry id -> key, for entries holding a key slot: pending,
-- or promoted and not read yet), the key waiting line (zset, score 0, member
-- `<key>\0<16-digit seq>`: ZRANGEBYLEX finds a key's head in O(log n)) and the waiting entries
-- (hash member -> `<prior deliveries>:<payload>`, field `~seq` the last seq).
local function caps_keys(n)
  return {control = KEYS[n], waiter = KEYS[n + 1], held = KEYS[n + 2], ids = KEYS[n + 3],
    wait = KEYS[n + 4], waitp = KEYS[n + 5]}
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
    local nid = redis.call('XADD', stream, '*', 'p', string.sub(v, sep + 1), 'dc', string.sub(v, 1, sep - 1), 'k', k, 'kh', '1')
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

-- The gated read of new entries: checks the queue's gates and takes up to `count` never-delivered
-- entries in one atomic step, without blocking (XREADGROUP without BLOCK), so nothing new is
-- taken while a gate is shut. This is THE place where decisions about taking NEW work go (pause,
-- back-off, concurrency caps, rate limit and priorities): reclaims and
-- redeliveries of already-started work do not pass here. (caps.lua is prepended.)
-- KEYS[1] queue stream, KEYS[2] pause flag (string, ms since paused), KEYS[3] control stream
-- (one entry per resume or freed slot; KEYS[3..10] as caps.lua's caps_keys(3), with the
-- priorities' ready set and entries), KEYS[11] rate
-- limit state (string: GCRA theoretical arrival time, µs, Redis time), KEYS[12] back-off
-- (string; its time to live is the back-off left)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] count, ARGV[4] the group's doorbell group,
-- ARGV[5] max_concurrency (0: none), ARGV[6] concurrency_per_key (0: none), ARGV[7] the rate
-- limit's emission interval (µs, may have a fraction; '' for no rate limit), ARGV[8] its burst
-- tolerance (µs); appended for the per-key rate limit: KEYS[13] delayed zset, KEYS[14] delayed
-- payload hash (reclaim.lua), KEYS[15] per-key rate state (hash key -> `<tat µs>:<delayed
-- entries not read back yet>:<due µs of the key's latest delayed entry>`; field `\0n`: the sum
-- of those counts, no key has a control character; field `\0s`: the last line sequence), KEYS[16]
-- its cleanup zset (key -> ms after which its field may be stale), KEYS[17] the keys' rate lines
-- (zset, score 0, member `<key>\0<16-digit seq>\0<entry id>`), ARGV[9] the per-key rate limit's
-- emission interval (µs; '' for none), ARGV[10] its burst tolerance (µs)
-- The gates, in order: pause, back-off, max_concurrency, rate limit, then per key
-- (concurrency_per_key, then the per-key rate limit); the gates decide how many entries are
-- taken, the priorities (below) which ones.
-- max_concurrency: the entries pending in the group (running, handed back waiting for a reclaim,
-- short re-polls) hold its slots; at most `max - pending` are taken. When none is free, the slot
-- waiter flag is set (the scripts that take entries out of the pending list then append `op=slot`
-- to the control stream, caps.lua) and the reply says to wait on the control stream.
-- concurrency_per_key: an entry with a key (field `k`) is taken only while fewer than the cap of
-- the key's entries hold a slot and none waits; otherwise it is moved out of the stream (XACK +
-- XDEL) to the end of the key's waiting line, never pending while it waits. An entry marked `kh`
-- (promoted from the line by a freed slot, caps.lua) already holds its slot.
-- rate_limit_per_key, after concurrency_per_key (so that an entry is charged when it may start,
-- not while it waits in its key's line: a key's starts keep its rate): GCRA per key (state in
-- KEYS[15]), charged when an entry is taken, so that it spaces starts. An entry with a key that
-- does not conform is moved out of the stream (XACK + XDEL) into the delayed set: the first one
-- (the key's head) due when its key's bucket admits it, the ones behind it parked (score CAPS_PARK,
-- never due) in the key's rate line (KEYS[17]), in offer order. Promoted back, the head carries
-- `kr`: when it is taken it is charged (the key's tat moves on) and the next of the line becomes
-- the head, due when the bucket admits it again; a head that still does not conform (its start
-- came late, and another entry of its key started since) goes back to the delayed set as the head.
-- So a key's entries start in offer order and never faster than its rate, however long they sat
-- in the stream before being read. Each keeps its key slot (its holder id, in keys:ids, stays its
-- id: its delayed member) and its priority (`<id>:pr`). Without a per-key rate limit, a read
-- releases the parked entries (due at once; a limit removed from the settings strands nothing).
-- Up to 8 stale fields of KEYS[15] (tat past, nothing delayed) are removed per read.
-- Returns {1, control id} when a gate is shut (paused, or max_concurrency reached): wait on the
-- control stream after that id; {2, ms} when backing off, {3, ms} when over the rate limit: the
-- gate opens by itself in ms (a timed wait, nothing to watch); {0, ''} when nothing is new: wait
-- with `XREADGROUP … NOACK BLOCK` on the doorbell group, which this script has set to where the
-- group stands (every entry up to it has been delivered), so that each later entry wakes exactly
-- one waiter (XREAD BLOCK would wake every waiter for each entry); {0, '', entries} when entries
-- were taken (the XREADGROUP entry list); {4, ''} when nothing was taken but new entries are left
-- to look at (moving unread entries to the ready set, or all taken entries went to waiting
-- lines): read again at once. With the per-key rate limit set, a reply with code 0 or 4 has a
-- 4th element: ms until the earliest entry this read moved to the delayed set is due (-1: none),
-- so that the consumer promotes it on time.
local function control_tail()
  local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
  if last[1] then return {1, last[1][1]} end
  return {1, '0-0'}
end
if redis.call('EXISTS', KEYS[2]) == 1 then return control_tail() end
local C = caps_keys(3)
local count = tonumber(ARGV[3])
-- Back-off (a timed gate) ---------------------------------------------------------------------
local backoff = redis.call('PTTL', KEYS[12])
if backoff > 0 then return {2, backoff} end
-- max_concurrency -----------------------------------------------------------------------------
local maxc, perkey = tonumber(ARGV[5]), tonumber(ARGV[6])
if maxc > 0 then
  local held = redis.call('XPENDING', KEYS[1], ARGV[1])[1]
  if held >= maxc then
    redis.call('SET', C.waiter, '1')
    return control_tail()
  end
  count = math.min(count, maxc - held)
end
-- Rate limit (a timed gate) -------------------------------------------------------------------
-- GCRA: entry i (1-based) of this read conforms when tat + (i - 1)·T − now ≤ τ, tat being the
-- theoretical arrival time (at least now); grant as many as conform, at most `count`, and move
-- tat on by the entries actually taken (`taken` below).
local rate_t, tat, now = tonumber(ARGV[7]), nil, nil
if rate_t then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local tau = tonumber(ARGV[8])
  tat = math.max(tonumber(redis.call('GET', KEYS[11]) or '0') or 0, now)
  local k = math.floor((now + tau - tat) / rate_t) + 1
  if k < 1 then return {3, math.max(1, math.ceil((tat - tau - now) / 1000))} end
  if k < count then count = k end
end
local function taken(entries)
  -- Rate limit: tat moves on by the entries taken (the key lives until tat has passed).
  if rate_t then
    tat = tat + #entries * rate_t
    redis.call('SET', KEYS[11], string.format('%.3f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
  end
  return {0, '', entries}
end
-- Per-key rate limit state --------------------------------------------------------------------
local krate_t, ktau = tonumber(ARGV[9]), tonumber(ARGV[10] or '')
local kdue, know = -1, nil
if krate_t then
  local t = redis.call('TIME')
  know = tonumber(t[1]) * 1000000 + tonumber(t[2])
  -- Cleanup: fields whose tat has passed and that have nothing delayed go.
  for _, k in ipairs(redis.call('ZRANGEBYSCORE', KEYS[16], '-inf', math.floor(know / 1000), 'LIMIT', 0, 8)) do
    local v = redis.call('HGET', KEYS[15], k)
    local ktat, n = 0, 0
    if v then
      local a, b = string.match(v, '^([^:]+):(%d+):')
      ktat, n = tonumber(a) or 0, tonumber(b) or 0
    end
    if n == 0 and ktat <= know then
      redis.call('HDEL', KEYS[15], k)
      redis.call('ZREM', KEYS[16], k)
    else
      redis.call('ZADD', KEYS[16], math.floor(math.max(ktat, know) / 1000) + 60000, k)
    end
  end
end
-- One EXISTS covers the keys that are seldom there (the priorities' ready set and, without a
-- per-key rate limit, the keys' rate lines and states), so an unthrottled read pays one call.
-- Without a per-key rate limit, entries parked in the keys' rate lines are released (due now),
-- up to 256 per read; with the lines gone, so are the keys' rate states (as in memory), also
-- when no line is left but a key's head still counts as delayed: that head is read back by
-- consumers that do not count it, so its count would stay and park the key's later entries
-- (once the limit is back) behind a head that is gone.
local seldom
if krate_t then seldom = redis.call('EXISTS', C.ready) else seldom = redis.call('EXISTS', C.ready, KEYS[17], KEYS[15]) end
if not krate_t and seldom > 0 and (redis.call('EXISTS', KEYS[17]) == 1 or redis.call('EXISTS', KEYS[15]) == 1) then
  local line = redis.call('ZRANGE', KEYS[17], 0, 255)
  if #line > 0 then
    local t = redis.call('TIME')
    local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    for _, h in ipairs(line) do
      local id = string.match(h, '^[^%z]*%z%d+%z(.*)$')
      if id then redis.call('ZADD', KEYS[13], 'XX', ms, id) end
    end
    redis.call('ZREM', KEYS[17], unpack(line))
  end
  if redis.call('EXISTS', KEYS[17]) == 0 then redis.call('DEL', KEYS[15], KEYS[16]) end
end
-- The per-key rate state of key k: tat (µs), entries waiting for the rate (head and line), the
-- head's due time (µs).
local function kstate(k)
  local v = redis.call('HGET', KEYS[15], k)
  if not v then return 0, 0, 0 end
  local a, b, c = string.match(v, '^([^:]+):(%d+):([^:]+)$')
  return tonumber(a) or 0, tonumber(b) or 0, tonumber(c) or 0
end
local function kput(k, ktat, n, hdue)
  redis.call('HSET', KEYS[15], k, string.format('%.3f:%d:%.3f', ktat, n, hdue))
  redis.call('ZADD', KEYS[16], math.floor(math.max(ktat, know or 0) / 1000) + 1, k)
end
-- A reply of code 0 or 4, with the promotion hint when the per-key rate limit is set.
local function reply(r)
  if krate_t then
    if not r[3] then r[3] = {} end
    r[4] = kdue
  end
  return r
end
-- Moves entry e of key k out of the stream into the delayed set (keeping its key slot, `kh`, and
-- its priority): due at `due` (µs), or parked in the key's rate line when `due` is nil.
local function krate_delay(e, k, kh, payload, dc, pr, due)
  if due then
    redis.call('ZADD', KEYS[13], string.format('%.3f', due / 1000), e[1])
    local ms = math.ceil((due - know) / 1000)
    if kdue < 0 or ms < kdue then kdue = ms end
  else
    local seq = redis.call('HINCRBY', KEYS[15], '\0s', 1)
    redis.call('ZADD', KEYS[17], 0, k .. '\0' .. string.format('%016d', seq) .. '\0' .. e[1])
    redis.call('ZADD', KEYS[13], string.format('%d', CAPS_PARK), e[1])
  end
  redis.call('HSET', KEYS[14], e[1], payload, e[1] .. ':dc', dc, e[1] .. ':k', k, e[1] .. ':kr', kh and 'h' or '1')
  if pr then redis.call('HSET', KEYS[14], e[1] .. ':pr', pr) end
  redis.call('XACK', KEYS[1], ARGV[1], e[1])
  redis.call('XDEL', KEYS[1], e[1])
end
-- The next entry of key k's rate line becomes its head, due at `due` (µs). Returns whether one
-- did, and how many line entries were found gone from the delayed set (skipped).
local function krate_next(k, due)
  local gone = 0
  for _ = 1, 16 do
    local h = redis.call('ZRANGEBYLEX', KEYS[17], '[' .. k .. '\0', '(' .. k .. '\1', 'LIMIT', 0, 1)[1]
    if not h then return false, gone end
    redis.call('ZREM', KEYS[17], h)
    local id = string.sub(h, #k + 19)
    if redis.call('ZADD', KEYS[13], 'XX', 'CH', string.format('%.3f', due / 1000), id) == 1 then
      local ms = math.ceil((due - know) / 1000)
      if kdue < 0 or ms < kdue then kdue = ms end
      return true, gone
    end
    gone = gone + 1
  end
  return false, gone
end
-- The read (and per key) ------------------------------------------------------------------------
-- take(n): reads up to n unread entries of the stream ('>') and keeps those that pass the per-key
-- gate (all of them without one); the others move to their key's waiting line.
local function take(n, out)
  local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n, 'STREAMS', KEYS[1], '>')
  if not (r and r[1] and #r[1][2] > 0) then return 0 end
  if perkey == 0 and not krate_t then
    for _, e in ipairs(r[1][2]) do out[#out + 1] = e end
    return #r[1][2]
  end
  for _, e in ipairs(r[1][2]) do
    local f, k, kh, kr, kc, payload, dc, pr = e[2], nil, false, false, false, '', '0', nil
    for i = 1, #f, 2 do
      if f[i] == 'k' then k = f[i + 1]
      elseif f[i] == 'kh' then kh = true
      elseif f[i] == 'kr' then kr = true
      elseif f[i] == 'kc' then kc = true
      elseif f[i] == 'p' then payload = f[i + 1]
      elseif f[i] == 'dc' then dc = f[i + 1]
      elseif f[i] == 'pr' then pr = f[i + 1] end
    end
    local go = true
    -- concurrency_per_key first: a slot of its key, or the end of the key's waiting line.
    if k and not kh and perkey > 0 then
      if tonumber(redis.call('HGET', C.held, k) or '0') < perkey and not caps_head(C, k) then
        redis.call('HINCRBY', C.held, k, 1)
        redis.call('HSET', C.ids, e[1], k)
        kh = true
      else
        local seq = redis.call('HINCRBY', C.waitp, '~seq', 1)
        local member = k .. '\0' .. string.format('%016d', seq)
        redis.call('ZADD', C.wait, 0, member)
        local wdc = dc
        if pr then wdc = dc .. '/' .. pr end
        redis.call('HSET', C.waitp, member, wdc .. ':' .. payload)
        redis.call('XACK', KEYS[1], ARGV[1], e[1])
        redis.call('XDEL', KEYS[1], e[1])
        go = false
      end
    end
    -- Then the key's rate (not for a requeued copy, `kc`: charged when first taken).
    if go and k and krate_t and not kc then
      local ktat, n, hdue = kstate(k)
      -- The head, read back: one of the key's waiting entries fewer for now (unless the key's
      -- state was lost: nothing to take back then).
      local back = 0
      if kr and n > 0 then n, back = n - 1, 1 end
      local base = math.max(ktat, know)
      if base - ktau <= know and (kr or n == 0) then
        -- Starts: charged; the next of the key's line (if any) becomes its head.
        ktat = base + krate_t
        local gone = 0
        if n > 0 then
          local due, found = math.max(ktat - ktau, know), false
          found, gone = krate_next(k, due)
          if found then hdue = due else gone = n end
        end
        kput(k, ktat, n - gone, hdue)
        if gone + back > 0 then redis.call('HINCRBY', KEYS[15], '\0n', -(gone + back)) end
      else
        if kr or n == 0 then
          -- The key's head: due when the key's bucket admits it.
          hdue = math.max(base - ktau, know)
          krate_delay(e, k, kh, payload, dc, pr, hdue)
        else
          -- Behind the key's head: parked in the key's line.
          krate_delay(e, k, kh, payload, dc, pr, nil)
        end
        if back == 0 then redis.call('HINCRBY', KEYS[15], '\0n', 1) end
        kput(k, ktat, n + 1, hdue)
        go = false
      end
    end
    if go then out[#out + 1] = e end
  end
  return #r[1][2]
end
-- Priorities. While no entry of a priority other than 0 is new (the ready set is empty and
-- `~new` is absent), the stream is read as it is (above). Otherwise new entries are taken by
-- priority, then arrival: every unread stream entry first moves to the ready set (XREADGROUP,
-- then XACK + XDEL; score -priority, member its id padded so that members order as ids do), at
-- most MOVE per call ({4, ''}: call again at once); then the best ones are popped, appended to
-- the stream again with their fields (now the only unread entries: a new id each) and taken
-- through the same per-key gate. An entry holding its key slot (`kh`) keeps it under its new id.
local MOVE = 256
local function pad(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return string.rep('0', 16 - #ms) .. ms .. '-' .. string.rep('0', 16 - #seq) .. seq
end
local function to_ready()
  local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', MOVE, 'STREAMS', KEYS[1], '>')
  local entries = (r and r[1] and r[1][2]) or {}
  for _, e in ipairs(entries) do
    local m = pad(e[1])
    redis.call('ZADD', C.ready, -caps_priority(e[2]), m)
    redis.call('HSET', C.readyp, m, cmsgpack.pack(e[2]))
    for i = 1, #e[2], 2 do
      if e[2][i] == 'kh' then redis.call('HDEL', C.ids, e[1]) end
    end
    redis.call('XACK', KEYS[1], ARGV[1], e[1])
    redis.call('XDEL', KEYS[1], e[1])
  end
  return #entries < MOVE
end
local function from_ready(n)
  local popped = redis.call('ZPOPMIN', C.ready, n)
  for i = 1, #popped, 2 do
    local packed = redis.call('HGET', C.readyp, popped[i])
    redis.call('HDEL', C.readyp, popped[i])
    if packed then
      local f = cmsgpack.unpack(packed)
      local nid = redis.call('XADD', KEYS[1], '*', unpack(f))
      local k, kh = nil, false
      for j = 1, #f, 2 do
        if f[j] == 'k' then k = f[j + 1] elseif f[j] == 'kh' then kh = true end
      end
      if k and kh then redis.call('HSET', C.ids, nid, k) end
    end
  end
end
local out = {}
if (seldom > 0 and redis.call('EXISTS', C.ready) == 1) or redis.call('HEXISTS', C.readyp, '~new') == 1 then
  if not to_ready() then return reply({4, ''}) end
  redis.call('HDEL', C.readyp, '~new')
  -- Bounded: entries that all go to waiting lines leave the rest for the next read ({4, ''}).
  for _ = 1, 16 do
    from_ready(count - #out)
    take(count - #out, out)
    if #out >= count or redis.call('EXISTS', C.ready) == 0 then break end
  end
  if #out > 0 then return reply(taken(out)) end
  if redis.call('EXISTS', C.ready) == 1 then return reply({4, ''}) end
elseif perkey == 0 and not krate_t then
  take(count, out)
  if #out > 0 then return taken(out) end
else
  -- Bounded: entries that all go to waiting lines leave the rest for the next read (the
  -- doorbell wakes it at once, since the group then stands before them).
  for _ = 1, 16 do
    if take(count - #out, out) == 0 or #out >= count then break end
  end
  if #out > 0 then return reply(taken(out)) end
end
-- Nothing new: the doorbell group to where the group stands (written only when it differs).
local at, bell = nil, nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local m = {}
  for i = 1, #g, 2 do m[g[i]] = g[i + 1] end
  if m['name'] == ARGV[1] then at = m['last-delivered-id'] end
  if m['name'] == ARGV[4] then bell = m['last-delivered-id'] end
end
if not bell then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[4], at)
elseif bell ~= at then
  redis.call('XGROUP', 'SETID', KEYS[1], ARGV[4], at)
end
return reply({0, ''})

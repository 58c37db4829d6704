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
-- tolerance (µs)
-- The gates, in order: pause, back-off, max_concurrency, rate limit, then per key; the gates
-- decide how many entries are taken, the priorities (below) which ones.
-- max_concurrency: the entries pending in the group (running, handed back waiting for a reclaim,
-- short re-polls) hold its slots; at most `max - pending` are taken. When none is free, the slot
-- waiter flag is set (the scripts that take entries out of the pending list then append `op=slot`
-- to the control stream, caps.lua) and the reply says to wait on the control stream.
-- concurrency_per_key: an entry with a key (field `k`) is taken only while fewer than the cap of
-- the key's entries hold a slot and none waits; otherwise it is moved out of the stream (XACK +
-- XDEL) to the end of the key's waiting line, never pending while it waits. An entry marked `kh`
-- (promoted from the line by a freed slot, caps.lua) already holds its slot.
-- Returns {1, control id} when a gate is shut (paused, or max_concurrency reached): wait on the
-- control stream after that id; {2, ms} when backing off, {3, ms} when over the rate limit: the
-- gate opens by itself in ms (a timed wait, nothing to watch); {0, ''} when nothing is new: wait
-- with `XREADGROUP … NOACK BLOCK` on the doorbell group, which this script has set to where the
-- group stands (every entry up to it has been delivered), so that each later entry wakes exactly
-- one waiter (XREAD BLOCK would wake every waiter for each entry); {0, '', entries} when entries
-- were taken (the XREADGROUP entry list); {4, ''} when nothing was taken but new entries are left
-- to look at (moving unread entries to the ready set, or all taken entries went to waiting
-- lines): read again at once.
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
-- The read (and per key) ------------------------------------------------------------------------
-- take(n): reads up to n unread entries of the stream ('>') and keeps those that pass the per-key
-- gate (all of them without one); the others move to their key's waiting line.
local function take(n, out)
  local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n, 'STREAMS', KEYS[1], '>')
  if not (r and r[1] and #r[1][2] > 0) then return 0 end
  if perkey == 0 then
    for _, e in ipairs(r[1][2]) do out[#out + 1] = e end
    return #r[1][2]
  end
  for _, e in ipairs(r[1][2]) do
    local f, k, kh, payload, dc, pr = e[2], nil, false, '', '0', nil
    for i = 1, #f, 2 do
      if f[i] == 'k' then k = f[i + 1]
      elseif f[i] == 'kh' then kh = true
      elseif f[i] == 'p' then payload = f[i + 1]
      elseif f[i] == 'dc' then dc = f[i + 1]
      elseif f[i] == 'pr' then pr = f[i + 1] end
    end
    if not k or kh then
      out[#out + 1] = e
    elseif tonumber(redis.call('HGET', C.held, k) or '0') < perkey and not caps_head(C, k) then
      redis.call('HINCRBY', C.held, k, 1)
      redis.call('HSET', C.ids, e[1], k)
      out[#out + 1] = e
    else
      local seq = redis.call('HINCRBY', C.waitp, '~seq', 1)
      local member = k .. '\0' .. string.format('%016d', seq)
      redis.call('ZADD', C.wait, 0, member)
      if pr then dc = dc .. '/' .. pr end
      redis.call('HSET', C.waitp, member, dc .. ':' .. payload)
      redis.call('XACK', KEYS[1], ARGV[1], e[1])
      redis.call('XDEL', KEYS[1], e[1])
    end
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
if redis.call('EXISTS', C.ready) == 1 or redis.call('HEXISTS', C.readyp, '~new') == 1 then
  if not to_ready() then return {4, ''} end
  redis.call('HDEL', C.readyp, '~new')
  -- Bounded: entries that all go to waiting lines leave the rest for the next read ({4, ''}).
  for _ = 1, 16 do
    from_ready(count - #out)
    take(count - #out, out)
    if #out >= count or redis.call('EXISTS', C.ready) == 0 then break end
  end
  if #out > 0 then return taken(out) end
  if redis.call('EXISTS', C.ready) == 1 then return {4, ''} end
elseif perkey == 0 then
  take(count, out)
  if #out > 0 then return taken(out) end
else
  -- Bounded: entries that all go to waiting lines leave the rest for the next read (the
  -- doorbell wakes it at once, since the group then stands before them).
  for _ = 1, 16 do
    if take(count - #out, out) == 0 or #out >= count then break end
  end
  if #out > 0 then return taken(out) end
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
return {0, ''}

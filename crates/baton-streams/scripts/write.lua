-- append / append-and-close / close, batched (group commit; PROTOCOL.md 5.2, 5.2.1, 5.3; run
-- finish/cancel/producer_lost). R requests are applied one after the other, exactly as R separate
-- calls would be (each sees the effects of the ones before it); the metadata is read once and
-- written once per call, so the per-request cost is a few comparisons plus one XADD per record.
-- ARGV: 1 R, then per request: inc (expected, '' any), ctn ('' = binary body, refused by JSON
--       streams), stream seq, producer id, epoch, seq, close reason (''), n, then n x (data, msgs).
--       A seq of 'f' makes the producer id and epoch a fence instead of a stamp (an end fenced
--       to a producer's epoch): the request is refused ('fenced') unless that producer's current
--       epoch is the one given ('' = none claimed), checked right after the end; it writes no
--       producer state, and its entry is not counted against max_len (part of the end).
-- Reply: R arrays, in request order: {status, ...} (see the returns of one() below); an accepted
-- request that did not end the stream gets the short {'ok', tail}. When the stream exists, one
-- more array follows: {incarnation, the tail before this call} (the engine hands the new records
-- to this process's live readers when they directly follow what those have read).
local R = tonumber(ARGV[1])
-- One HMGET for the hot fields plus the state of every producer of the batch; the rest of the
-- metadata is loaded only on the rare paths that need it (full()). Missing fields are false.
local PS = {}      -- producer id -> state table, or false (none); written back when dirty
local extra = {}
do
  local b = 2
  for i = 1, R do
    local pid = ARGV[b + 3]
    if pid ~= '' and PS[pid] == nil then
      PS[pid] = false
      extra[#extra + 1] = 'p:' .. pid
    end
    b = b + 8 + 2 * tonumber(ARGV[b + 7])
  end
end
-- With the re-send guard (write_guard.lua), its field comes last.
if RG then extra[#extra + 1] = RG end
local v = redis.call('HMGET', KM, 'inc', 'ctn', 'tail', 'cnt', 'lw', 'sil', 'ml', 'mlw', 'ttl', 'ta', 'dl', 'sq',
  'end', 'del', unpack(extra))
if RG then extra[#extra] = nil end
local out = {}
if not v[1] or v[14] then
  local st = 'nf'
  if v[1] then st = 'gone' end
  for i = 1, R do out[i] = {st} end
  return out
end
if RG then
  local rg = v[15 + #extra]
  if rg then
    local nl = string.find(rg, '\n', 1, true)
    local last, token = tonumber(string.sub(rg, 1, nl - 1)), tonumber(RT)
    if last == token then
      -- A re-sent copy: the first copy's reply, with the incarnation (write_guard.lua).
      local kind, body = string.sub(rg, nl + 1, nl + 1), string.sub(rg, nl + 2)
      local inc = v[1]
      if kind ~= string.lower(kind) then
        -- Carried from the stream deleted here last (bury.lua, create.lua): its call ran on that
        -- one, whose incarnation the one field 'r~' holds.
        inc = redis.call('HGET', KM, 'r~') or ''
        kind = string.lower(kind)
      end
      if kind == 'f' then return inc .. ' ' .. body end
      if kind == 'k' then
        body = redis.call('GET', KEYS[3])
        if not body then
          return redis.error_reply('BATON_STALE_RESEND a copy re-sent after its reply expired: not applied')
        end
      end
      local r = cmsgpack.unpack(body)
      r[#r][1] = inc
      return r
    elseif last > token then
      return redis.error_reply('BATON_STALE_RESEND a late copy of an earlier call: not applied')
    end
  elseif redis.call('HLEN', KM) > 48 then
    -- This writer's first call on the stream, and the hash is large: the fields of writers
    -- idle for twice the re-send window are dropped (a token / 2^20 is the Unix time in
    -- seconds of its call, by the writer's clock; the margin allows up to 300 s of skew between
    -- a writer's clock and the server's: a writer further behind may lose its field early).
    local t = redis.call('TIME')
    local cutoff = tonumber(t[1]) - 2 * RW / 1000
    local all = redis.call('HGETALL', KM)
    local drop = {}
    for i = 1, #all, 2 do
      if string.sub(all[i], 1, 2) == 'r:' then
        local tok = tonumber(string.match(all[i + 1], '^%d+'))
        if tok and math.floor(tok / 1048576) < cutoff then drop[#drop + 1] = all[i] end
        if #drop == 1000 then redis.call('HDEL', KM, unpack(drop)); drop = {} end
      end
    end
    if #drop > 0 then redis.call('HDEL', KM, unpack(drop)) end
  end
end
local prev_tail = v[3] or ''
local m = {inc = v[1], ctn = v[2], tail = v[3], cnt = v[4], lw = v[5], sil = v[6], ml = v[7], mlw = v[8],
  ttl = v[9], ta = v[10], dl = v[11], sq = v[12], ['end'] = v[13]}
for i = 1, #extra do
  local raw = v[14 + i]
  if raw then
    -- The count may be empty (no mlw: see producer_state).
    local e, l, c, o = string.match(raw, '^(%d+):(-?%d+):(%d*):(.*)$')
    PS[string.sub(extra[i], 3)] = {epoch = tonumber(e), last = tonumber(l), count = tonumber(c) or 0, off = o}
  end
end
local is_full = false
local function full()
  if is_full then return end
  is_full = true
  local f = load_meta()
  local hot = {inc = 1, ctn = 1, tail = 1, cnt = 1, lw = 1, sil = 1, ml = 1, mlw = 1, ttl = 1, ta = 1, dl = 1, sq = 1}
  hot['end'] = 1
  for _, k in ipairs(FIELDS) do if not hot[k] then m[k] = f[k] end end
end
-- The clock. An accepted append takes it from its first entry's id (XADD '*' uses the server
-- time, or the last id's if later), which saves a TIME call on the hot path; every other outcome
-- (an error, a close without data) reads TIME first. Either way the silence check runs before
-- anything is decided, as in every script.
local now, now_s = nil, nil
local function silence()
  if not m['end'] and m.sil and now - num(m.lw) > num(m.sil) then
    full()
    check_silence(m, now)
    return true
  end
  return false
end
local function need_now()
  if now then return end
  now = now_ms(); now_s = s(now)
  silence()
end
if m['end'] then full() end
local fresh = (m.cnt or '0') == '0' -- the stream key may not exist yet (needs its expiry)
-- messages (what max_len counts: a JSON record's messages, else 1 per record), kept as a number
-- until written back
local cnt_n = tonumber(m.cnt or '0')
local dirty = {}   -- producer ids to write back
local wrote = false
local ended_here = false

-- Checks of one request, in the protocol's precedence; returns an error reply, or nil and the
-- producer's count before this request.
local function validate(b, n, units)
  local ctn, sseq, pid = ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  local fence = nil
  if ARGV[b + 5] == 'f' then fence = pid; pid = '' end
  local epoch, seq, p = 0, 0, nil
  if pid ~= '' then
    epoch = tonumber(ARGV[b + 4]); seq = tonumber(ARGV[b + 5])
    p = PS[pid]
    if p then
      if epoch < p.epoch then return {'fenced', s(p.epoch)} end
      if epoch == p.epoch and seq <= p.last then
        return {'dup', s(p.epoch), s(p.last), p.off, m.tail, m['end'] or '', m.fin or ''}
      end
    end
  end
  if m['end'] then
    full()
    if pid ~= '' and m.cb == pid .. '\0' .. s(epoch) .. '\0' .. s(seq) then
      return {'dup', s(epoch), s(seq), m.fin, m.tail, m['end'] or '', m.fin or ''}
    end
    m.cnt = s(cnt_n)
    return {'closed', info(m)}
  end
  if fence then
    local f = PS[fence]
    local have = ''
    if f then have = s(f.epoch) end
    if have ~= ARGV[b + 4] then
      if have == '' then have = '0' end
      return {'fenced', have}
    end
  end
  if n > 0 and ((ctn ~= '' and ctn ~= m.ctn) or (ctn == '' and m.ctn == 'application/json')) then
    full()
    return {'ct', m.ct}
  end
  local count = 0
  if pid ~= '' then
    if p then
      count = p.count
      if epoch > p.epoch then
        if seq ~= 0 then return {'epoch0', s(seq)} end
      elseif seq ~= p.last + 1 then
        return {'gap', s(p.last + 1), s(seq)}
      end
    elseif seq ~= 0 then
      return {'gap', '0', s(seq)}
    end
  end
  if sseq ~= '' and m.sq and bytes_le(sseq, m.sq) then return {'sseq', m.sq} end
  -- A fenced end's entry is part of the end, which max_len never counts.
  if n > 0 and not fence then
    if m.ml and cnt_n + units > tonumber(m.ml) then return {'toolong', 'stream', m.ml} end
    if pid ~= '' and m.mlw and count + units > tonumber(m.mlw) then return {'toolong', 'writer', m.mlw} end
  end
  return nil, count
end

local function xadd(data, msgs)
  if msgs ~= '0' then return redis.call('XADD', KS, '*', 'd', data, 'n', msgs) end
  return redis.call('XADD', KS, '*', 'd', data)
end

local function one(b)
  local inc, sseq, pid, close = ARGV[b], ARGV[b + 2], ARGV[b + 3], ARGV[b + 6]
  if ARGV[b + 5] == 'f' then pid = '' end -- a fence: no producer state written
  local n = tonumber(ARGV[b + 7])
  if inc ~= '' and inc ~= m.inc then return {'nf'} end
  local units = 0
  for i = 0, n - 1 do
    local u = tonumber(ARGV[b + 9 + 2 * i])
    if u < 1 then u = 1 end
    units = units + u
  end
  local err, count = validate(b, n, units)
  if (err or n == 0) and not now then
    need_now()
    err, count = validate(b, n, units)
  end
  if err then return err end
  local first = 0
  if not now then
    -- Accepted so far, clock unknown: the first entry's id gives it.
    local id = xadd(ARGV[b + 8], ARGV[b + 9])
    now = tonumber(string.match(id, '^(%d+)')); now_s = s(now)
    if silence() then
      redis.call('XDEL', KS, id) -- never visible: the stream ended before this append
      return (validate(b, n, units))
    end
    m.tail = id
    first = 1
  end
  wrote = true
  m.lw = now_s; m.ta = now_s
  for i = first, n - 1 do
    m.tail = xadd(ARGV[b + 8 + 2 * i], ARGV[b + 9 + 2 * i])
  end
  cnt_n = cnt_n + units
  if sseq ~= '' then m.sq = sseq end
  if pid ~= '' then
    local epoch, seq = tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
    local p = PS[pid]
    if p then
      p.epoch = epoch; p.last = seq; p.count = count + units; p.off = m.tail
    else
      PS[pid] = {epoch = epoch, last = seq, count = count + units, off = m.tail}
    end
    dirty[pid] = true
  end
  local ended = 0
  if close ~= '' then
    local tuple = nil
    if pid ~= '' then tuple = pid .. '\0' .. s(tonumber(ARGV[b + 4])) .. '\0' .. s(tonumber(ARGV[b + 5])) end
    full()
    m.cnt = s(cnt_n)
    do_end(m, now, close, tuple)
    ended = 1
    ended_here = true
  end
  if ended == 0 then return {'ok', m.tail} end
  return {'ok', ARGV[b + 4], ARGV[b + 5], m.tail, ended, m['end'] or '', m.fin or ''}
end

local b = 2
for i = 1, R do
  local n = tonumber(ARGV[b + 7])
  out[i] = one(b)
  b = b + 8 + 2 * n
end
out[R + 1] = {m.inc, prev_tail}
-- The guard's value for this reply (write_guard.lua): kind 'm', or 'k' when too long for a
-- listpack value; the incarnation is blanked (a re-sent copy takes it from the hash).
local function guard_value()
  local last = out[R + 1]
  last[1] = ''
  local packed = cmsgpack.pack(out)
  last[1] = m.inc
  local g = RT .. '\nm' .. packed
  if #g > 64 then
    redis.call('SET', KEYS[3], packed, 'PX', RW)
    g = RT .. '\nk'
  end
  return g
end
if wrote then
  m.cnt = s(cnt_n)
  local h = {'lw', m.lw, 'tail', m.tail, 'cnt', m.cnt}
  if m.ttl then table.insert(h, 'ta'); table.insert(h, m.ta) end
  if m.sq then table.insert(h, 'sq'); table.insert(h, m.sq) end
  for pid, _ in pairs(dirty) do
    local p = PS[pid]
    table.insert(h, 'p:' .. pid)
    table.insert(h, s(p.epoch) .. ':' .. s(p.last) .. ':' .. (m.mlw and s(p.count) or '') .. ':' .. p.off)
  end
  if RG then table.insert(h, RG); table.insert(h, guard_value()) end
  redis.call('HSET', KM, unpack(h))
elseif RG then
  redis.call('HSET', KM, RG, guard_value())
end
-- The expiry only moves with a sliding TTL or an end; a first write creates the stream key.
if ended_here or (wrote and (m.ttl or fresh)) then apply_expiry(m) end
return out

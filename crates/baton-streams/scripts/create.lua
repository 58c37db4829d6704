-- create (PROTOCOL.md 5.1, 4.2; run open). Idempotent: same config => 'exists'.
-- KEYS[3]: the stream's tombstone (bury.lua), read and deleted by a create of a new stream.
-- ARGV: 1 inc, 2 ct, 3 ctn, 4 ttl_ms, 5 exp_ms, 6 closed, 7 sil, 8 mr, 9 dttl, 10 ml, 11 mlw,
--       12 fsrc, 13 foff, 14 fsub, 15 base id, 16 claim producer id, 17 n, then n x (id|'*', data, msgs)
local now = now_ms()
local m = load_meta()
local claim = ARGV[16]

local function do_claim()
  if claim == '' then return '' end
  local p = producer_state(claim)
  local epoch, count, off = 0, 0, ''
  if p then epoch = p.epoch + 1; count = p.count; off = p.off end
  redis.call('HSET', KM, 'p:' .. claim, s(epoch) .. ':-1:' .. s(count) .. ':' .. off, 'lw', s(now))
  m.lw = s(now)
  -- A silence timeout kept aside until the first producer's open (silence_from_open) is armed.
  if m.sil0 then
    redis.call('HSET', KM, 'sil', m.sil0)
    redis.call('HDEL', KM, 'sil0')
    m.sil = m.sil0; m.sil0 = nil
  end
  return s(epoch)
end

if m then
  if m.del then return {'softdel'} end
  check_silence(m, now)
  if claim ~= '' and m['end'] then return {'closed', info(m)} end
  local want_closed = ARGV[6] == '1'
  local reason = nil
  if m.ctn ~= ARGV[3] then reason = "content type differs from the existing stream's (" .. (m.ct or m.ctn) .. ')'
  elseif (m.ttl or '') ~= ARGV[4] or (m.exp or '') ~= ARGV[5] then reason = 'TTL or expiry differs'
  elseif (m['end'] ~= nil) ~= want_closed then reason = 'closed state differs'
  elseif (m.fsrc or '') ~= ARGV[12] or (m.foff or '') ~= ARGV[13] or (m.fsub or '') ~= ARGV[14] then
    reason = 'fork origin differs'
  end
  if reason then return {'conflict', reason} end
  if claim ~= '' then
    local e = do_claim()
    apply_expiry(m)
    return {'exists', info(m), e}
  end
  return {'exists', info(m), ''}
end

-- A new stream. The fields the append fast path reads (write_fast.lua) come first in the hash: a
-- small hash is a listpack, searched from its start.
m = {inc = ARGV[1], ct = ARGV[2], ctn = ARGV[3], ca = s(now), lw = s(now), ta = s(now), cnt = '0'}
local rest = {'ct', m.ct, 'ca', m.ca, 'ta', m.ta}
local function opt(f, v, hot)
  if v ~= '' then
    m[f] = v
    if not hot then table.insert(rest, f); table.insert(rest, v) end
  end
end
local sil_arg, sil_later = ARGV[7], ''
if string.sub(sil_arg, 1, 1) == 'o' then sil_later = string.sub(sil_arg, 2); sil_arg = '' end
opt('ttl', ARGV[4]); opt('exp', ARGV[5]); opt('sil', sil_arg, true); opt('sil0', sil_later); opt('mr', ARGV[8])
opt('dttl', ARGV[9])
opt('ml', ARGV[10], true); opt('mlw', ARGV[11], true); opt('fsrc', ARGV[12]); opt('foff', ARGV[13])
opt('fsub', ARGV[14])
local dl = nil
if m.exp then dl = tonumber(m.exp) end
if m.mr and (dl == nil or now + tonumber(m.mr) < dl) then dl = now + tonumber(m.mr) end
if dl then m.dl = s(dl); table.insert(rest, 'dl'); table.insert(rest, m.dl) end

local base = ARGV[15]
local tail = '0-0'
local wrote = false
local based = (base == '0-0')
local function ensure_base()
  if based then return end
  based = true
  if tail == base then return end
  if wrote then
    redis.call('XSETID', KS, base)
  else
    redis.call('XADD', KS, base, 'd', '')
    redis.call('XDEL', KS, base)
  end
  tail = base
end
local n = tonumber(ARGV[17])
local cnt = 0
for i = 0, n - 1 do
  local id, data, msgs = ARGV[18 + 3 * i], ARGV[19 + 3 * i], ARGV[20 + 3 * i]
  if id == '*' then ensure_base() end
  if msgs ~= '0' then
    tail = redis.call('XADD', KS, id, 'd', data, 'n', msgs)
  else
    tail = redis.call('XADD', KS, id, 'd', data)
  end
  wrote = true
  -- cnt counts messages (what max_len limits): a JSON record's messages, else 1 per record.
  local units = tonumber(msgs)
  if units < 1 then units = 1 end
  cnt = cnt + units
end
ensure_base()
m.tail = tail; m.cnt = s(cnt)
local h = {'inc', m.inc, 'ctn', m.ctn, 'cnt', m.cnt, 'lw', m.lw, 'tail', tail}
for _, f in ipairs({'sil', 'ml', 'mlw'}) do
  if m[f] then table.insert(h, f); table.insert(h, m[f]) end
end
-- A run open claims epoch 0 (a new stream has no producer state yet), as do_claim() would.
local e = ''
if claim ~= '' then
  e = '0'
  table.insert(h, 'p:' .. claim); table.insert(h, '0:-1:0:')
end
for _, x in ipairs(rest) do table.insert(h, x) end
redis.call('HSET', KM, unpack(h))
-- A stream deleted here within the re-send window left its re-send guard in its tombstone
-- (KEYS[3], bury.lua): carried into the new hash (after the fields above), so that a copy of a
-- call to the deleted stream re-sent now is answered as the first copy was, not written here.
local carried = redis.call('HGETALL', KEYS[3])
if #carried > 0 then
  for i = 1, #carried, 1000 do redis.call('HSET', KM, unpack(carried, i, math.min(i + 999, #carried))) end
  redis.call('DEL', KEYS[3])
end
if ARGV[6] == '1' then do_end(m, now, 'finished', nil) end
apply_expiry(m)
return {'created', info(m), e}

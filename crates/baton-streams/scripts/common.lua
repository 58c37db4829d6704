-- Shared prelude of every Baton stream script (prepended with concat!).
-- KEYS[1] = stream key (entries), KEYS[2] = metadata hash; both carry the same {hash tag}.
local KS, KM = KEYS[1], KEYS[2]
local FIELDS = {'inc','ct','ctn','ttl','exp','dl','sil','dttl','ml','mlw','tail','first','cnt','lw',
  'end','fin','ea','cb','sq','refs','del','ta','ca','mr','fsrc','foff','fsub','sil0'}

local function s(x) return string.format('%.0f', x) end
local function num(v) if v then return tonumber(v) end return nil end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function load_meta()
  local vals = redis.call('HMGET', KM, unpack(FIELDS))
  if not vals[1] then return nil end
  local m = {}
  for i, f in ipairs(FIELDS) do if vals[i] then m[f] = vals[i] end end
  return m
end

-- Redis entry id comparison ("ms-seq").
local function parse_id(id)
  local a, b = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(a), tonumber(b)
end
local function id_lt(x, y)
  local xa, xb = parse_id(x)
  local ya, yb = parse_id(y)
  if xa ~= ya then return xa < ya end
  return xb < yb
end

-- Bytewise a <= b (Stream-Seq, PROTOCOL.md 5.2); Lua's own < uses the locale.
local function bytes_le(a, b)
  local la, lb = #a, #b
  for i = 1, math.min(la, lb) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return la <= lb
end

-- Absolute deadline (ms) or nil: hard deadline, sliding TTL, done_ttl after the end.
local function deadline(m)
  local d = nil
  local function low(x) if x and x > 0 and (d == nil or x < d) then d = x end end
  low(num(m.dl))
  if m.ttl then low(num(m.ta) + num(m.ttl)) end
  if m['end'] and m.dttl then low(num(m.ea) + num(m.dttl)) end
  return d
end

local function apply_expiry(m)
  local d = deadline(m)
  if d then
    redis.call('PEXPIREAT', KM, s(d))
    redis.call('PEXPIREAT', KS, s(d))
  end
end

-- Ends the stream: one hidden end entry (wakes blocked XREADs) and the end fields.
local function do_end(m, now, reason, closer)
  redis.call('XADD', KS, '*', 'e', reason)
  m['end'] = reason; m.fin = m.tail; m.ea = s(now)
  if closer then
    m.cb = closer
    redis.call('HSET', KM, 'end', reason, 'fin', m.tail, 'ea', m.ea, 'cb', closer)
  else
    redis.call('HSET', KM, 'end', reason, 'fin', m.tail, 'ea', m.ea)
  end
end

-- silence_timeout: no append nor keepalive for that long => ended as producer_lost.
local function check_silence(m, now)
  if not m['end'] and m.sil and now - num(m.lw) > num(m.sil) then
    do_end(m, now, 'producer_lost', nil)
    apply_expiry(m)
    return true
  end
  return false
end

local function info(m)
  local d = deadline(m)
  return {m.inc, m.ct, m.tail, m['end'] or '', m.fin or '', m.ttl or '', m.exp or '', m.first or '0-0',
    m.cnt or '0', m.ca or '0', m.lw or '0', m.sil or '', m.mr or '', m.dttl or '', m.ml or '',
    m.mlw or '', d and s(d) or '', m.fsrc or '', m.foff or '', m.fsub or '', m.ea or ''}
end

-- Producer state "epoch:last:count:offset" (last = -1 after a claim, before any write). The
-- count (records written) is only kept when the stream has a per-writer max length (mlw, fixed
-- at creation); otherwise it may be empty (write_fast.lua leaves it out), read as 0.
local function producer_state(pid)
  local raw = redis.call('HGET', KM, 'p:' .. pid)
  if not raw then return nil end
  local e, l, c, o = string.match(raw, '^(%d+):(-?%d+):(%d*):(.*)$')
  return {epoch = tonumber(e), last = tonumber(l), count = tonumber(c) or 0, off = o}
end

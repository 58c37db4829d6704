-- read / head / fork snapshot (PROTOCOL.md 5.5, 5.6, 4.2).
-- ARGV: 1 mode ('start'|'now'|'at'|'snap'), 2 id, 3 count (0 = metadata only), 4 max bytes,
--       5 touch ('1' restarts a sliding TTL), 6 expected inc ('' any)
local m = load_meta()
if not m then return {'nf'} end
if m.del then return {'gone'} end
if ARGV[6] ~= '' and ARGV[6] ~= m.inc then return {'nf'} end
local now = now_ms()
check_silence(m, now)
if ARGV[5] == '1' and m.ttl then
  m.ta = s(now)
  redis.call('HSET', KM, 'ta', m.ta)
  apply_expiry(m)
end
local mode, tail, first = ARGV[1], m.tail, m.first or '0-0'
local from = first
if mode == 'now' then from = tail
elseif mode == 'at' or mode == 'snap' then
  from = ARGV[2]
  if from == '' then from = tail end
  if id_lt(tail, from) then return {'ahead', tail} end
  if id_lt(from, first) then return {'trimmed', first} end
end
local count = tonumber(ARGV[3])

local function flat(entries)
  local out = {}
  for _, e in ipairs(entries) do
    local f = e[2]
    local data, msgs = '', '0'
    for j = 1, #f, 2 do
      if f[j] == 'd' then data = f[j + 1] elseif f[j] == 'n' then msgs = f[j + 1] end
    end
    table.insert(out, e[1]); table.insert(out, data); table.insert(out, msgs)
  end
  return out
end

if mode == 'snap' then
  local inherited = redis.call('XRANGE', KS, '(' .. first, from)
  local nxt = {}
  if from ~= tail then nxt = redis.call('XRANGE', KS, '(' .. from, tail, 'COUNT', 1) end
  return {'ok', info(m), flat(inherited), flat(nxt), from}
end
if count == 0 or from == tail then
  return {'ok', info(m), {}, from}
end
local entries = redis.call('XRANGE', KS, '(' .. from, tail, 'COUNT', count)
local maxb = tonumber(ARGV[4])
local bytes, keep = 0, 0
for i, e in ipairs(entries) do
  local f = e[2]
  local size = 0
  for j = 1, #f, 2 do if f[j] == 'd' then size = #f[j + 1] end end
  if keep > 0 and bytes + size > maxb then break end
  bytes = bytes + size
  keep = i
end
while #entries > keep do table.remove(entries) end
local next_id = from
if keep > 0 then next_id = entries[keep][1] end
return {'ok', info(m), flat(entries), next_id}

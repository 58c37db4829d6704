-- append / append-and-close / close (PROTOCOL.md 5.2, 5.2.1, 5.3; run finish/cancel/producer_lost).
-- ARGV: 1 expected inc ('' any), 2 ctn ('' = binary body, refused by JSON streams), 3 stream seq, 4 producer id, 5 epoch, 6 seq,
--       7 close reason (''), 8 n, then n x (data, msgs)
local m = load_meta()
if not m then return {'nf'} end
if m.del then return {'gone'} end
if ARGV[1] ~= '' and ARGV[1] ~= m.inc then return {'nf'} end
local now = now_ms()
check_silence(m, now)

local pid = ARGV[4]
local n = tonumber(ARGV[8])
local epoch, seq, p = 0, 0, nil
if pid ~= '' then
  epoch = tonumber(ARGV[5]); seq = tonumber(ARGV[6])
  p = producer_state(pid)
  if p then
    if epoch < p.epoch then return {'fenced', s(p.epoch)} end
    if epoch == p.epoch and seq <= p.last then return {'dup', s(p.epoch), s(p.last), p.off, m.tail, m['end'] or '', m.fin or ''} end
  end
end
local tuple = nil
if pid ~= '' then tuple = pid .. '\0' .. s(epoch) .. '\0' .. s(seq) end
if m['end'] then
  if tuple and m.cb == tuple then return {'dup', s(epoch), s(seq), m.fin, m.tail, m['end'] or '', m.fin or ''} end
  return {'closed', info(m)}
end
if n > 0 and ((ARGV[2] ~= '' and ARGV[2] ~= m.ctn) or (ARGV[2] == '' and m.ctn == 'application/json')) then
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
local sseq = ARGV[3]
if sseq ~= '' and m.sq and bytes_le(sseq, m.sq) then return {'sseq', m.sq} end
local cnt = tonumber(m.cnt or '0')
if n > 0 then
  if m.ml and cnt + n > tonumber(m.ml) then return {'toolong', 'stream', m.ml} end
  if pid ~= '' and m.mlw and count + n > tonumber(m.mlw) then return {'toolong', 'writer', m.mlw} end
end

local h = {'lw', s(now), 'ta', s(now)}
m.lw = s(now); m.ta = s(now)
for i = 0, n - 1 do
  local data, msgs = ARGV[9 + 2 * i], ARGV[10 + 2 * i]
  if msgs ~= '0' then
    m.tail = redis.call('XADD', KS, '*', 'd', data, 'n', msgs)
  else
    m.tail = redis.call('XADD', KS, '*', 'd', data)
  end
end
if n > 0 then
  m.cnt = s(cnt + n)
  table.insert(h, 'tail'); table.insert(h, m.tail); table.insert(h, 'cnt'); table.insert(h, m.cnt)
end
if sseq ~= '' then m.sq = sseq; table.insert(h, 'sq'); table.insert(h, sseq) end
if pid ~= '' then
  table.insert(h, 'p:' .. pid)
  table.insert(h, s(epoch) .. ':' .. s(seq) .. ':' .. s(count + n) .. ':' .. m.tail)
end
redis.call('HSET', KM, unpack(h))
local ended = 0
if ARGV[7] ~= '' then do_end(m, now, ARGV[7], tuple); ended = 1 end
apply_expiry(m)
return {'ok', s(epoch), s(seq), m.tail, ended, m['end'] or '', m.fin or ''}

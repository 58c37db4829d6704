-- keepalive (run semantics): refreshes the silence clock; invisible to readers.
-- ARGV: 1 expected inc ('' any), 2 producer id (''), 3 epoch
local m = load_meta()
if not m then return {'nf'} end
if m.del then return {'gone'} end
if ARGV[1] ~= '' and ARGV[1] ~= m.inc then return {'nf'} end
local now = now_ms()
check_silence(m, now)
if ARGV[2] ~= '' then
  local p = producer_state(ARGV[2])
  if p and tonumber(ARGV[3]) < p.epoch then return {'fenced', s(p.epoch)} end
end
if m['end'] then return {'closed', info(m)} end
m.lw = s(now); m.ta = s(now)
redis.call('HSET', KM, 'lw', m.lw, 'ta', m.ta)
apply_expiry(m)
return {'ok', info(m)}

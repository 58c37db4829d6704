-- retention trim (PROTOCOL.md 4 "Retention"): drops entries up to and including ARGV[1];
-- reads from earlier offsets then get 410. ARGV: 1 through id, 2 the id right after it.
local m = load_meta()
if not m then return {'nf'} end
if m.del then return {'gone'} end
if id_lt(m.tail, ARGV[1]) then return {'ahead', m.tail} end
local first = m.first or '0-0'
if id_lt(first, ARGV[1]) then
  redis.call('XTRIM', KS, 'MINID', ARGV[2])
  redis.call('HSET', KM, 'first', ARGV[1])
  first = ARGV[1]
end
return {'ok', first}

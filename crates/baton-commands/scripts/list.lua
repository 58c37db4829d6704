-- List: ids of an index newest first (score = created ms desc, then id desc), after a cursor.
-- KEYS[1..7] indexes (see lib.lua)
-- ARGV[1] index position in KEYS (2 = all, 3..7 a status), ARGV[2] how many,
-- ARGV[3] cursor score ('' for the first page), ARGV[4] cursor id
-- Returns {id, score, id, score, ...}.
-- Byte order (not strcoll, which follows the server's locale), as Redis orders equal scores.
local function bytes_less(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
prune(now_ms(), 1000)
local key, want = KEYS[tonumber(ARGV[1])], tonumber(ARGV[2])
if ARGV[3] == '' then
  return redis.call('ZREVRANGEBYSCORE', key, '+inf', '-inf', 'WITHSCORES', 'LIMIT', 0, want)
end
local cs, cid = tonumber(ARGV[3]), ARGV[4]
local out, off = {}, 0
while #out < 2 * want do
  local batch = redis.call('ZREVRANGEBYSCORE', key, ARGV[3], '-inf', 'WITHSCORES', 'LIMIT', off, 200)
  if #batch == 0 then break end
  for i = 1, #batch, 2 do
    local m, s = batch[i], batch[i + 1]
    if tonumber(s) < cs or bytes_less(m, cid) then
      out[#out + 1] = m
      out[#out + 1] = s
      if #out >= 2 * want then break end
    end
  end
  off = off + 200
end
return out

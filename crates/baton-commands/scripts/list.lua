-- List: ids newest first (score = created ms desc, then id desc), after a cursor.
-- KEYS[1..6] indexes (see lib.lua)
-- ARGV[1] index position in KEYS (2..6 a status; 0 = every status: the five merged),
-- ARGV[2] how many, ARGV[3] cursor score ('' for the first page), ARGV[4] cursor id ('' with a
-- score: every id of that score is after it), ARGV[5] the lowest score (created ms) listed
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
local want = tonumber(ARGV[2])

-- Up to `want` entries of one index after the cursor, as {id, score} pairs.
local function page(key)
  local out = {}
  if ARGV[3] == '' then
    local flat = redis.call('ZREVRANGEBYSCORE', key, '+inf', ARGV[5], 'WITHSCORES', 'LIMIT', 0, want)
    for i = 1, #flat, 2 do out[#out + 1] = { flat[i], tonumber(flat[i + 1]) } end
    return out
  end
  local cs, cid = tonumber(ARGV[3]), ARGV[4]
  local off = 0
  while #out < want do
    local batch = redis.call('ZREVRANGEBYSCORE', key, ARGV[3], ARGV[5], 'WITHSCORES', 'LIMIT', off, 200)
    if #batch == 0 then break end
    for i = 1, #batch, 2 do
      local m, s = batch[i], tonumber(batch[i + 1])
      if s < cs or bytes_less(m, cid) then
        out[#out + 1] = { m, s }
        if #out >= want then break end
      end
    end
    off = off + 200
  end
  return out
end

local rows
local which = tonumber(ARGV[1])
if which ~= 0 then
  rows = page(KEYS[which])
else
  rows = {}
  for k = 2, 6 do
    for _, r in ipairs(page(KEYS[k])) do rows[#rows + 1] = r end
  end
  table.sort(rows, function(x, y)
    if x[2] ~= y[2] then return x[2] > y[2] end
    return bytes_less(y[1], x[1])
  end)
end
local out = {}
for i = 1, math.min(want, #rows) do
  out[#out + 1] = rows[i][1]
  out[#out + 1] = string.format('%.0f', rows[i][2])
end
return out

-- A read of a queue's event feed (see feed.rs): the entries after ARGV[1] (a stream entry id;
-- '-' for the start), oldest first; with ARGV[2] (a command id; '' for every command) only
-- that command's (field `i`); at most ARGV[3] events, looking at most at ARGV[4] entries.
-- KEYS[1] the feed (a stream of entries `i <command id> e <event JSON>`).
-- Returns {last entry id looked at ('' none), 1 when the read reached the tail else 0, then
-- entry id, event JSON, ... for each event}.
local limit, scan = tonumber(ARGV[3]), tonumber(ARGV[4])
local id = ARGV[2]
local start = ARGV[1]
if start ~= '-' then start = '(' .. start end
local out = { '', 0 }
local looked, found = 0, 0
while true do
  local want = scan - looked
  if want > 500 then want = 500 end
  -- One more than needed: whether the tail was reached is known without another call.
  local entries = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', want + 1)
  local n = #entries
  for j = 1, n do
    if found >= limit or looked >= scan then return out end
    local e = entries[j]
    local f = e[2]
    looked = looked + 1
    out[1] = e[1]
    -- Fields: i <id> e <json>.
    if id == '' or f[2] == id then
      out[#out + 1] = e[1]
      out[#out + 1] = f[4]
      found = found + 1
    end
  end
  if n <= want then
    out[2] = 1
    return out
  end
  -- n = want + 1: the last one was read here as well; go on after it.
  start = '(' .. out[1]
end

-- Offer of entries of a priority other than 0 (caps.lua prepended): each is appended to the
-- stream with its field `pr` and the queue is marked (caps_add), so that the gated read takes new
-- entries by priority (read.lua). Entries of priority 0 are offered with a pipelined XADD instead,
-- exactly as before priorities existed.
-- KEYS[1] queue stream, KEYS[2..9] as caps.lua's caps_keys(2)
-- ARGV[1] priority, ARGV[2] concurrency key ('' none), ARGV[3..] payloads
-- Returns the new ids, in order.
local C = caps_keys(2)
local ids = {}
for i = 3, #ARGV do
  local f = {'p', ARGV[i]}
  if ARGV[2] ~= '' then
    f[3] = 'k'
    f[4] = ARGV[2]
  end
  ids[#ids + 1] = caps_add(C, KEYS[1], f, ARGV[1])
end
return ids

-- Offer of a batch of offers in one call, on Redis Cluster only (caps.lua prepended, and run
-- under the re-send guard of baton_redis::resend, which adds its own key and two arguments after
-- these and takes them off before this text runs). The offers of one queue that this process
-- queued while its previous call was in flight (the backend's group commit) are appended one
-- after the other, each exactly as its unbatched path does: an offer of priority 0 as the
-- pipelined `XADD <stream> * p <payload> [k <key>]`, one of another priority as offer.lua
-- (caps_add: field `pr`, and the queue marked for the gated read). Standalone and Sentinel
-- deployments offer without it (no re-sent calls there).
-- KEYS[1] queue stream, KEYS[2..9] as caps.lua's caps_keys(2)
-- ARGV[1] number of offers, then per offer: priority, concurrency key ('' none), number of
-- payloads n, then its n payloads
-- Returns the new ids of all offers, in order (the caller splits them by each offer's n).
local C = caps_keys(2)
local ids = {}
local i = 2
for _ = 1, tonumber(ARGV[1]) do
  local pr, key, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  i = i + 3
  for j = i, i + n - 1 do
    local f = {'p', ARGV[j]}
    if key ~= '' then
      f[3] = 'k'
      f[4] = key
    end
    ids[#ids + 1] = caps_add(C, KEYS[1], f, pr)
  end
  i = i + n
end
return ids

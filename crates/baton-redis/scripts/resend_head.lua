-- Re-send guard, head (baton_redis::resend; joined before a script's own text, with
-- resend_tail.lua after it). A Redis Cluster client re-sends a call whose connection dropped
-- after it was sent, so a call may arrive twice; the second copy must not apply again. The
-- caller added this writer's guard key for the script's hash tag as the last key, and the call's
-- token (a number that grows with every call of this writer on these keys; one call in flight
-- per writer and keys) and the guard's lifetime in ms as the last two arguments. Both are taken
-- off KEYS and ARGV here, so the script below sees exactly what it would unguarded. The key
-- holds the token of this writer's latest call that ran, and its reply:
-- * the same token: this is a re-sent copy of that call; it gets the first copy's reply and
--   changes nothing;
-- * a greater token: this is a late copy of an earlier call whose caller has had its answer (an
--   error: its call was given up) and whose writer has moved on; it changes nothing and gets an
--   error reply (whether its first copy ran or not, the caller was told the outcome is unknown).
local resend_ms = table.remove(ARGV)
local resend_token = table.remove(ARGV)
local resend_key = table.remove(KEYS)
do
  local seen = redis.call('GET', resend_key)
  if seen then
    local nl = string.find(seen, '\n', 1, true)
    local last, token = tonumber(string.sub(seen, 1, nl - 1)), tonumber(resend_token)
    if last == token then
      return cmsgpack.unpack(string.sub(seen, nl + 1))
    elseif last > token then
      return redis.error_reply('BATON_STALE_RESEND a late copy of an earlier call: not applied')
    end
  end
end
local function resend_body()

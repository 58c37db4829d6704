-- Re-send guard, head (baton_redis::resend; joined before a script's own text, with
-- resend_tail.lua after it). A Redis Cluster client re-sends a call whose connection dropped
-- after it was sent, so a call may arrive twice; the second copy must not apply again. The
-- caller added this writer's guard key for the script's hash tag as the last key, and the call's
-- token (a number that grows with every call of this writer on these keys; one call in flight
-- per writer and keys) and the guard's lifetime in ms as the last two arguments. Both are taken
-- off KEYS and ARGV here, so the script below sees exactly what it would unguarded. A call whose
-- token the key already holds is a re-sent copy: it gets the first copy's reply and changes
-- nothing.
local resend_ms = table.remove(ARGV)
local resend_token = table.remove(ARGV) .. '\n'
local resend_key = table.remove(KEYS)
do
  local seen = redis.call('GET', resend_key)
  if seen and string.sub(seen, 1, #resend_token) == resend_token then
    return cmsgpack.unpack(string.sub(seen, #resend_token + 1))
  end
end
local function resend_body()

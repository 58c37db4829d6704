
end
-- Re-send guard, tail (see resend_head.lua): the reply is kept with the token, for a re-sent copy.
-- A call that raises an error keeps nothing, so its re-sent copy runs again: the guarded scripts
-- raise no errors of their own, but a Redis command failing mid-script (e.g. out of memory) may
-- leave the writes made before it, as any script would.
local resend_reply = resend_body()
redis.call('SET', resend_key, resend_token .. '\n' .. cmsgpack.pack(resend_reply), 'PX', resend_ms)
return resend_reply

-- Re-send guard of write.lua on Redis Cluster (joined before write_fast.lua; standalone and
-- Sentinel send write_guard_off.lua instead). A Cluster client re-sends a call whose connection
-- dropped after it was sent, so a call may arrive twice; the second copy must not apply again
-- and must get the first copy's reply. Unlike baton_redis::resend (a guard key per writer, one
-- GET and one SET per call), the guard lives in the stream's metadata hash, read by the HMGET
-- and written by the HSET each path makes anyway: field 'r:<writer id>' (one per writing process
-- and stream), value "<token>\n<kind><reply>":
--   kind 'f': a fast-path reply without its incarnation, "<previous tail> <new entry id>";
--   kind 'm': cmsgpack of a general-path reply whose last array has its incarnation blanked;
--   kind 'k': the same packed reply, kept in the writer's overflow key (below) instead:
--             a value longer than 64 bytes (Redis's hash-max-listpack-value) would turn the
--             hash from a listpack into a hashtable, so a long reply (a batch) goes there.
-- The incarnation comes back from the hash itself. A field lives and dies with its stream's hash,
-- except that a delete keeps the fields of recent calls in the stream's tombstone for RW ms
-- (bury.lua) and a create within that time carries them into the new hash, marked by an
-- upper-cased kind ('F', 'M', 'K'), with the deleted stream's incarnation in the one field 'r~'
-- (shared by all fields carried by that delete): a copy of a call to the deleted stream re-sent
-- after the create gets the first copy's reply, with that incarnation (one HGET, only for such a
-- copy), and writes nothing to the new stream. A field is carried across one delete only (the
-- next delete drops it, bury.lua): a copy re-sent across two deletes and creates within its
-- re-send window is written to the newest stream.
-- The caller added KEYS[3], the writer's overflow key (KS .. ':resend:' .. <writer id>,
-- ResendGuard::key: the stream's hash tag, so its slot), touched only for a long reply, and two
-- last ARGV: the field and the call's token (ResendGuard::next_token: grows with every call of
-- this writer; one call per writer and stream in flight). The ARGV are taken off here, so the
-- scripts below see their usual layout (KEYS[1] and KEYS[2] as unguarded). The overflow key
-- lives RW ms (CLUSTER_RESEND_WINDOW, checked by a test). A stored token equal to this call's
-- means a re-sent copy (answered from the field, nothing changed); a greater one a late copy of
-- an earlier call whose caller has had an error (nothing changed, error BATON_STALE_RESEND).
-- write_fast.lua leaves both, and a writer's first call on a stream (no field yet), to
-- write.lua, which answers them and stores the reply of every outcome on a live stream (a
-- stream that does not exist or is deleted changes nothing and stores nothing).
local RW = 300000
local RG, RT
do
  local n = #ARGV
  RG, RT = ARGV[n - 1], ARGV[n]
  ARGV[n] = nil
  ARGV[n - 1] = nil
end

-- Prune: remove index entries of expired states (see lib.lua); the store runs it every few
-- submits, so the indexes stay bounded even when nobody lists or counts.
-- KEYS[1..6] indexes (see lib.lua). ARGV[1] most candidates to visit. Returns nothing.
prune(now_ms(), tonumber(ARGV[1]))
return 0

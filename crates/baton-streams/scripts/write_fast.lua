-- Fast path of write.lua (run before the common prelude, so a plain append pays for none of it).
-- The engine sends a lone request with one record, no close and no Stream-Seq in a compact
-- layout (Redis copies every argument into a Lua table before the script runs, so fewer
-- arguments cost less):
--   ARGV: 1 'a' (no producer) or 'p' (producer), 2 inc (expected, '' any), 3 ctn ('' = binary
--         body), 4 data, 5 JSON message count ('' or '0': none), then for 'p': 6 producer id,
--         7 epoch, 8 seq.
-- It handles the common case: a live stream with no sliding TTL that already has data, passing
-- every check of write.lua (exists, not deleted, incarnation, not ended, content type, producer
-- in sequence, max_len, max_len per writer) and not silent. The reply is then the new entry id
-- alone (a bulk string, not the usual array). Anything else falls through to the full script
-- below, with nothing changed and ARGV rewritten to the general layout (R = 1). The clock comes
-- from the entry's id; if that shows the stream fell silent, the entry is deleted again (never
-- visible) and the full script ends the stream. Numbers are compared as numbers (strings coerced
-- by arithmetic: cheaper than tonumber) except the producer epoch, compared as the decimal string
-- both sides write (a mismatch only means the full script decides). 'del' is not read: a
-- soft-deleted stream has no stream key, and XADD NOMKSTREAM then adds nothing and the full script
-- answers.
local ARGV = ARGV
local mode = ARGV[1]
if mode == 'a' or mode == 'p' then
  local v
  if mode == 'a' then
    v = redis.call('HMGET', KEYS[2], 'inc', 'ctn', 'cnt', 'lw', 'sil', 'ml', 'ttl', 'end')
  else
    v = redis.call('HMGET', KEYS[2], 'inc', 'ctn', 'cnt', 'lw', 'sil', 'ml', 'ttl', 'end', 'mlw', 'p:' .. ARGV[6])
  end
  local inc, ctn = ARGV[2], ARGV[3]
  local cnt = v[1] and not v[8] and not v[7] and (inc == '' or inc == v[1])
    and ((ctn ~= '' and ctn == v[2]) or (ctn == '' and v[2] ~= 'application/json'))
    and (v[3] or '0') + 0
  if cnt and cnt > 0 and not (v[6] and cnt + 1 > v[6] + 0) then
    local ok, state = true, nil
    if mode == 'p' then
      -- Producer state "epoch:last:count:offset": same epoch, seq = last + 1, or a first write.
      local raw, count = v[10], 0
      if raw then
        local e, l, c = string.match(raw, '^(%d+):(-?%d+):(%d+):')
        ok = e == ARGV[7] and ARGV[8] + 0 == l + 1
        count = c + 0
      else
        ok = ARGV[8] + 0 == 0
      end
      ok = ok and not (v[9] and count + 1 > v[9] + 0)
      if ok then state = ARGV[7] .. ':' .. ARGV[8] .. ':' .. string.format('%d', count + 1) .. ':' end
    end
    local id = false
    if ok then
      local msgs = ARGV[5]
      if msgs and msgs ~= '' and msgs ~= '0' then
        id = redis.call('XADD', KEYS[1], 'NOMKSTREAM', '*', 'd', ARGV[4], 'n', msgs)
      else
        id = redis.call('XADD', KEYS[1], 'NOMKSTREAM', '*', 'd', ARGV[4])
      end
    end
    if id then
      local now = string.match(id, '^%d+')
      if v[5] and now - v[4] > v[5] + 0 then
        redis.call('XDEL', KEYS[1], id)
      else
        if state then
          redis.call('HSET', KEYS[2], 'lw', now, 'tail', id, 'cnt', string.format('%d', cnt + 1),
            'p:' .. ARGV[6], state .. id)
        else
          redis.call('HSET', KEYS[2], 'lw', now, 'tail', id, 'cnt', string.format('%d', cnt + 1))
        end
        return id
      end
    end
  end
  local msgs = ARGV[5]
  if msgs == nil or msgs == '' then msgs = '0' end
  ARGV = {'1', ARGV[2], ARGV[3], '', ARGV[6] or '', ARGV[7] or '', ARGV[8] or '', '', '1', ARGV[4], msgs}
end

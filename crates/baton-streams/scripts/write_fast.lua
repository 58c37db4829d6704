-- Fast path of write.lua (run before the common prelude, so a plain append pays for none of it).
-- Handles the one common case: a single request appending records, no close, no Stream-Seq, on a
-- live stream with no sliding TTL that already has data, passing every check of write.lua (same
-- precedence: exists, not deleted, incarnation, not ended, content type, producer in sequence,
-- max_len). Anything else falls through to the full script below, with nothing changed. The
-- clock comes from the first entry's id; if that shows the stream fell silent, the entry is
-- deleted again (never visible) and the full script ends the stream.
if ARGV[1] == '1' and ARGV[4] == '' and ARGV[8] == '' and ARGV[9] ~= '0' then
  local pid = ARGV[5]
  local v
  if pid == '' then
    v = redis.call('HMGET', KEYS[2], 'inc', 'ctn', 'tail', 'cnt', 'lw', 'sil', 'ml', 'mlw', 'ttl', 'end', 'del')
  else
    v = redis.call('HMGET', KEYS[2], 'inc', 'ctn', 'tail', 'cnt', 'lw', 'sil', 'ml', 'mlw', 'ttl', 'end', 'del', 'p:' .. pid)
  end
  local ctn, n = ARGV[3], tonumber(ARGV[9])
  local cnt = tonumber(v[4] or '0')
  local ok = v[1] and not v[11] and not v[10] and not v[9] and cnt > 0
    and (ARGV[2] == '' or ARGV[2] == v[1])
    and ((ctn ~= '' and ctn == v[2]) or (ctn == '' and v[2] ~= 'application/json'))
    and not (v[7] and cnt + n > tonumber(v[7]))
  local epoch, seq, count = nil, nil, 0
  if ok and pid ~= '' then
    epoch, seq = tonumber(ARGV[6]), tonumber(ARGV[7])
    local raw = v[12]
    if raw then
      local e, l, c = string.match(raw, '^(%d+):(-?%d+):(%d+):')
      count = tonumber(c)
      ok = epoch == tonumber(e) and seq == tonumber(l) + 1
    else
      ok = seq == 0
    end
    ok = ok and not (v[8] and count + n > tonumber(v[8]))
  end
  if ok then
    local function xadd(i)
      local msgs = ARGV[11 + 2 * i]
      if msgs ~= '0' then return redis.call('XADD', KEYS[1], '*', 'd', ARGV[10 + 2 * i], 'n', msgs) end
      return redis.call('XADD', KEYS[1], '*', 'd', ARGV[10 + 2 * i])
    end
    local id = xadd(0)
    local now = tonumber(string.match(id, '^(%d+)'))
    if v[6] and now - tonumber(v[5]) > tonumber(v[6]) then
      redis.call('XDEL', KEYS[1], id)
    else
      for i = 1, n - 1 do id = xadd(i) end
      local now_s = string.format('%.0f', now)
      if pid == '' then
        redis.call('HSET', KEYS[2], 'lw', now_s, 'tail', id, 'cnt', string.format('%.0f', cnt + n))
      else
        redis.call('HSET', KEYS[2], 'lw', now_s, 'tail', id, 'cnt', string.format('%.0f', cnt + n),
          'p:' .. pid, ARGV[6] .. ':' .. ARGV[7] .. ':' .. string.format('%.0f', count + n) .. ':' .. id)
      end
      return {{'ok', id}}
    end
  end
end

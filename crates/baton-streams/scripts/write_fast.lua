-- Fast path of write.lua (run before the common prelude, so a plain append pays for none of it).
-- The engine sends a lone request with one record, no close and no Stream-Seq in a compact
-- layout (Redis copies every argument into a Lua table before the script runs, so fewer
-- arguments cost less):
--   ARGV: 1 inc (expected, '' any), 2 ctn ('' = binary body), 3 data, 4 JSON message count
--         ('' or '0': none; may be left out without a producer), then with a producer: 5 'p:' ..
--         producer id (its state's field), 6 the state prefix this request continues,
--         "<epoch>:<seq - 1>:" (so "<epoch>:-1:" for seq 0), 7 the new state without its offset
--         and count, "<epoch>:<seq>::" (canonical decimals, built by the engine from checked
--         integers ≤ 2^53-1).
-- The general layout has at least 9 arguments, so 3 to 7 mean this one (no mode argument).
-- It handles the common case: a live stream with no sliding TTL that already has data, passing
-- every check of write.lua (exists, not deleted, incarnation, not ended, content type, producer
-- in sequence, max_len, max_len per writer) and not silent. The reply is then one bulk string
-- (not the usual array): "<incarnation> <previous tail id> <new entry id>" (the engine hands the
-- record to this process's live readers when it directly follows what they have read). Anything else falls through to the full script
-- below, with nothing changed and ARGV rewritten to the general layout (R = 1). The clock comes
-- from the entry's id; if that shows the stream fell silent, the entry is deleted again (never
-- visible) and the full script ends the stream. Numbers are compared as numbers (strings coerced
-- by arithmetic: cheaper than tonumber) except the producer state, whose "epoch:last:" prefix is
-- compared as the decimal string every script writes (a mismatch only means the full script
-- decides; the producer is in sequence exactly when the stored prefix is the one sent, or there
-- is no state and seq is 0). The producer's record count is only kept when the stream has a
-- per-writer max length (mlw, fixed at creation); without it the state is "epoch:last::offset".
-- So a state with an empty count needs no mlw check (the absent field would cost a scan of the
-- whole hash); a state with a count (mlw, or written by a claim) or none reads mlw first.
-- 'del' is not read: a soft-deleted stream has no stream key, and XADD NOMKSTREAM then adds
-- nothing and the full script answers.
local ARGV = ARGV
local nargs = #ARGV
if nargs < 9 then
  local stamped = nargs == 7
  local v
  -- With the re-send guard (RG: write_guard.lua), its field comes last.
  if not stamped then
    if RG then
      v = redis.call('HMGET', KEYS[2], 'inc', 'ctn', 'cnt', 'lw', 'sil', 'ml', 'ttl', 'end', 'tail', RG)
    else
      v = redis.call('HMGET', KEYS[2], 'inc', 'ctn', 'cnt', 'lw', 'sil', 'ml', 'ttl', 'end', 'tail')
    end
  elseif RG then
    v = redis.call('HMGET', KEYS[2], 'inc', 'ctn', 'cnt', 'lw', 'sil', 'ml', 'ttl', 'end', 'tail', ARGV[5], RG)
  else
    v = redis.call('HMGET', KEYS[2], 'inc', 'ctn', 'cnt', 'lw', 'sil', 'ml', 'ttl', 'end', 'tail', ARGV[5])
  end
  local inc, ctn = ARGV[1], ARGV[2]
  -- Guarded, only a call whose token is greater than the stored one is taken here: a re-sent or
  -- late copy, or a writer's first call on the stream, goes to write.lua.
  local rg = v[#v]
  local cnt = v[1] and not v[8] and not v[7] and (inc == '' or inc == v[1])
    and ((ctn ~= '' and ctn == v[2]) or (ctn == '' and v[2] ~= 'application/json'))
    and (not RG or (rg and string.match(rg, '^%d+') + 0 < RT + 0))
    and (v[3] or '0') + 0
  -- max_len counts messages: the record's JSON messages, else 1.
  local units = 1
  local msgs = ARGV[4]
  if msgs and msgs ~= '' and msgs ~= '0' then units = msgs + 0 end
  if cnt and cnt > 0 and not (v[6] and cnt + units > v[6] + 0) then
    local ok, state = true, nil
    if stamped then
      local raw, pre = v[10], ARGV[6]
      local n = #pre
      if raw then
        ok = string.find(raw, pre, 1, true) == 1
      else
        ok = string.find(pre, '-', 1, true) ~= nil -- seq 0: a first write
      end
      if ok then
        if raw and string.byte(raw, n + 1) == 58 then -- ':': no count kept, so no mlw
          state = ARGV[7]
        else
          local mlw = redis.call('HGET', KEYS[2], 'mlw')
          if mlw then
            local c = raw and string.match(raw, '^%d+', n + 1)
            local count = units
            if c then count = c + units end
            ok = not (count > mlw + 0)
            state = string.sub(ARGV[7], 1, -2) .. string.format('%d', count) .. ':'
          else
            state = ARGV[7]
          end
        end
      end
    end
    local id = false
    if ok then
      if msgs and msgs ~= '' and msgs ~= '0' then
        id = redis.call('XADD', KEYS[1], 'NOMKSTREAM', '*', 'd', ARGV[3], 'n', msgs)
      else
        id = redis.call('XADD', KEYS[1], 'NOMKSTREAM', '*', 'd', ARGV[3])
      end
    end
    if id then
      local now = string.match(id, '^%d+')
      if v[5] and now - v[4] > v[5] + 0 then
        redis.call('XDEL', KEYS[1], id)
      else
        if RG then
          -- The guard's value: the reply without its incarnation (kind 'f', write_guard.lua).
          local g = RT .. '\nf' .. (v[9] or '') .. ' ' .. id
          if state then
            redis.call('HSET', KEYS[2], 'lw', now, 'tail', id, 'cnt', string.format('%d', cnt + units),
              ARGV[5], state .. id, RG, g)
          else
            redis.call('HSET', KEYS[2], 'lw', now, 'tail', id, 'cnt', string.format('%d', cnt + units), RG, g)
          end
        elseif state then
          redis.call('HSET', KEYS[2], 'lw', now, 'tail', id, 'cnt', string.format('%d', cnt + units),
            ARGV[5], state .. id)
        else
          redis.call('HSET', KEYS[2], 'lw', now, 'tail', id, 'cnt', string.format('%d', cnt + units))
        end
        return v[1] .. ' ' .. (v[9] or '') .. ' ' .. id
      end
    end
  end
  if msgs == nil or msgs == '' then msgs = '0' end
  local pid, epoch, seq = '', '', ''
  if stamped then
    pid = string.sub(ARGV[5], 3)
    epoch, seq = string.match(ARGV[7], '^(%d+):(%d+):')
  end
  ARGV = {'1', ARGV[1], ARGV[2], '', pid, epoch, seq, '', '1', ARGV[3], msgs}
end

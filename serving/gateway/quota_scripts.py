"""The Redis quota store's Lua scripts (quota_redis.py runs them): admission, admission with the request's
send to its replica's channel, lease renewal and release. Each runs atomically on the Redis server, so
every gateway process shares one exact count."""

from __future__ import annotations

from serving.transport.channel_layers import SEND_FUNCTIONS

# admit(tenant hash, refusal counts, has_room, rps, tokens/min, max concurrent, tokens asked, hash expiry
# (s), tenant id, ticket id, lease (s), room for: how many such requests must fit for this one to be
# admitted (serving.gateway.quota.refusal)). A refusal is counted in the same script: no second round trip per
# 429. has_room: nil, or a function called only once the quota admits the request; false from it admits
# nothing (no charge, no lease, no refusal counted) and returns {-1}. Returns {admitted (0/1),
# request_tokens, token_tokens, in_flight} as strings (Lua numbers would be truncated to integers on the
# way out).
#
# The tenant hash holds both buckets (rt, tt, refilled at ts) and one field per request in flight,
# 'l:<ticket id>' = its lease's deadline on Redis's clock. A lease that was never released (its gateway
# died, or the release could not reach Redis) stops counting at its deadline; a count that only expired
# with an idle key never cleared for a tenant that kept sending. 'lx': no lease expires before it, so
# until then the count is HLEN less the other fields, and only a lease past its deadline costs a scan.
# Leases live in the tenant hash rather than a key of their own so each script keeps its keys.
#
# An idle hash expires only once both its buckets are full again, as the in-memory store (which never
# forgets) would have them: at least the hash expiry argument (which outlives the leases), and at least
# the time both buckets need to refill from their levels, plus a second. A bucket below full whose rate is
# zero never refills: its hash never expires.
EXPIRY_FUNCTIONS = """
local function refill_s(level, cap, per_s) -- a bucket's seconds to full; nil: never
  if level >= cap then return 0 end
  if per_s <= 0 then return nil end
  return (cap - level) / per_s
end
local function time_to_full(rt, burst, rps, tt, tpm)
  local r, t = refill_s(rt, burst, rps), refill_s(tt, tpm, tpm / 60)
  if r == nil or t == nil then return nil end
  return math.max(r, t)
end
local function expire_after(key, s)
  if s == nil or s > 1e9 then redis.call('PERSIST', key)
  else redis.call('EXPIRE', key, string.format('%d', math.ceil(s))) end
end
local function live_at_least(key, s)
  if s == nil or s > 1e9 then redis.call('PERSIST', key) return end
  local ms = redis.call('PTTL', key)
  if ms >= 0 and ms < math.ceil(s) * 1000 then expire_after(key, s) end
end
"""
ADMIT_FUNCTION = (
    EXPIRY_FUNCTIONS
    + """
local function live_leases(key, now)
  local n, first = 0, nil
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'l:' then
      local deadline = tonumber(fields[i + 1])
      if deadline <= now then redis.call('HDEL', key, fields[i])
      else
        n = n + 1
        if first == nil or deadline < first then first = deadline end
      end
    end
  end
  return n, first
end
local function admit(key, refused_key, has_room, rps, tpm, max_c, tokens, ttl, tenant_id, ticket, lease,
                      room)
  rps = tonumber(rps); tpm = tonumber(tpm); max_c = tonumber(max_c)
  tokens = tonumber(tokens); ttl = tonumber(ttl); lease = tonumber(lease); room = tonumber(room)
  local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  local burst = math.max(1, rps)
  local s = redis.call('HMGET', key, 'rt', 'tt', 'ts', 'lx', 'n')
  local rt = tonumber(s[1]) or burst; local tt = tonumber(s[2]) or tpm
  local ts = tonumber(s[3]) or now; local lx = tonumber(s[4])
  local n
  if s[5] then redis.call('HDEL', key, 'n') end -- the count kept before leases: dropped, leaks and all
  if lx == nil or now < lx then
    n = redis.call('HLEN', key)
    for i = 1, 4 do if s[i] then n = n - 1 end end
  else
    n, lx = live_leases(key, now)
  end
  local el = math.max(0, now - ts)
  rt = math.min(burst, rt + el * rps); tt = math.min(tpm, tt + el * tpm / 60)
  local ok = rps > 0 and n + room <= max_c and rt >= room and tokens <= tpm and tt >= tokens * room
  -- A full channel (has_room) is seen only once the quota admits: an over-quota request is a 429 whatever
  -- its replica's queue holds.
  if ok and has_room and not has_room() then return {-1} end
  local out_rt, out_tt, out_n = rt, tt, n
  if ok then
    rt = rt - 1; tt = tt - tokens
    local deadline = now + lease
    redis.call('HSET', key, 'l:' .. ticket, tostring(deadline))
    if lx == nil or deadline < lx then lx = deadline end
  else redis.call('HINCRBY', refused_key, tenant_id, 1) end
  redis.call('HSET', key, 'rt', tostring(rt), 'tt', tostring(tt), 'ts', tostring(now))
  if lx then redis.call('HSET', key, 'lx', tostring(lx)) else redis.call('HDEL', key, 'lx') end
  local full_in = time_to_full(rt, burst, rps, tt, tpm)
  expire_after(key, full_in and math.max(ttl, full_in + 1))
  return {ok and 1 or 0, tostring(out_rt), tostring(out_tt), tostring(out_n)}
end
"""
)
# KEYS[1] tenant hash, KEYS[2] the refusal counts; ARGV as admit() takes them after its two keys.
ADMIT = ADMIT_FUNCTION + "return admit(KEYS[1], KEYS[2], nil, unpack(ARGV))"
# The same, then KEYS[3] the replica's channel and ARGV[10..14] the send's
# (serving.transport.channel_layers). The quota
# decides first: over quota is the refusal ({0, ...}) whatever the channel holds; a request the quota admits
# to a full channel is not admitted ({-1}, nothing charged); an admitted request is on its replica's channel
# when the reply arrives.
ADMIT_AND_SEND = (
    ADMIT_FUNCTION
    + SEND_FUNCTIONS
    + """
local function has_room() return channel_has_room(KEYS[3], ARGV[10], ARGV[11]) end
local result = admit(KEYS[1], KEYS[2], has_room, unpack(ARGV, 1, 9))
if result[1] == 1 then channel_add(KEYS[3], ARGV[12], ARGV[13], ARGV[14]) end
return result
"""
)

# KEYS: tenant hashes; ARGV[1] the lease (s), ARGV[2] the hashes' expiry (s), ARGV[2 + i] the ticket ids
# (comma-separated) of KEYS[i] to renew. A lease already released (or expired and dropped) stays gone. A
# hash's expiry is extended, never shortened: a slow bucket or a debt may need it longer.
RENEW = (
    EXPIRY_FUNCTIONS
    + """
local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local deadline = tostring(now + tonumber(ARGV[1]))
local renewed = 0
for i, key in ipairs(KEYS) do
  for ticket in string.gmatch(ARGV[i + 2], '[^,]+') do
    if redis.call('HEXISTS', key, 'l:' .. ticket) == 1 then
      redis.call('HSET', key, 'l:' .. ticket, deadline)
      renewed = renewed + 1
    end
  end
  live_at_least(key, tonumber(ARGV[2]))
end
return renewed
"""
)

# KEYS[1] tenant hash; ARGV: tokens to give back (charged less used), ticket id, '1' to settle only a
# lease still held. A lease that already expired is gone: its release frees no one else's slot, but still
# settles the tokens its request used. Only if held: an admission whose outcome is unknown (its reply
# lost) is given back only if the script ran and admitted it; otherwise it was never charged. A request that
# used more than its estimate leaves the token bucket further below full (in debt, below zero): the hash
# then lives at least until the bucket is full again, as admission has it (EXPIRY_FUNCTIONS).
RELEASE = (
    EXPIRY_FUNCTIONS
    + """
local key = KEYS[1]
local held = redis.call('HDEL', key, 'l:' .. ARGV[2]) == 1
if not held and (ARGV[3] == '1' or redis.call('EXISTS', key) == 0) then return 0 end
local tt = tonumber(redis.call('HINCRBYFLOAT', key, 'tt', ARGV[1]))
local ts, tpm = tonumber(redis.call('HGET', key, 'ts')), tonumber(ARGV[4])
if ts and tt < tpm then
  local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  local full_in = refill_s(tt, tpm, tpm / 60)
  if full_in == nil then live_at_least(key, nil)
  elseif full_in - (now - ts) > 0 then live_at_least(key, full_in - (now - ts) + 1) end
end
return 1
"""
)

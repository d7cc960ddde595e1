"""A per-token rate limit kept in Redis, so that it holds across API processes and hosts."""

from __future__ import annotations

import logging
import secrets

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

# A sliding-window log, atomic in Redis: one sorted-set member per admitted request, scored by the time Redis
# gives (not the caller's clock, which differs between API hosts). It answers 0 when the request is admitted,
# else the whole seconds until the oldest admitted request leaves the window. Refused requests are not
# recorded, so a client that keeps knocking is not locked out for longer.
SLIDING_WINDOW = """
local now = redis.call('TIME')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local window_us = tonumber(ARGV[1]) * 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_us - window_us)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('ZADD', KEYS[1], now_us, ARGV[3])
    redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 1000)
    return 0
end
local oldest = tonumber(redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2])
return math.max(1, math.ceil((oldest + window_us - now_us) / 1000000))
"""


class RateLimiter:
    """At most ``limit`` requests per key in any ``window_s`` seconds.

    Fails open: when Redis does not answer, requests are admitted (and a warning logged). Only holders of a
    valid token reach the limiter, a submission needs Redis to be enqueued anyway (it is refused with 503
    without it), and a cancel must still work while Redis is being repaired.
    """

    def __init__(self, redis_url: str, limit: int, window_s: int) -> None:
        self.limit = limit
        self.window_s = window_s
        # Short timeouts and no retries: a Redis that is down costs a request half a second, not redis-py's
        # default of several retries with backoff.
        self._client = redis.Redis.from_url(
            redis_url, socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
        self._script = self._client.register_script(SLIDING_WINDOW)

    def wait_s(self, key: str) -> int:
        """Count one request of ``key``: 0 when it is admitted, else the seconds until one would be."""
        try:
            return int(
                self._script(keys=[f"supportmatrix:rate:{key}"], args=[self.window_s, self.limit, secrets.token_hex(8)])
            )
        except (redis.RedisError, OSError) as exc:
            log.warning("rate limit not enforced, Redis does not answer: %s", exc.__class__.__name__)
            return 0

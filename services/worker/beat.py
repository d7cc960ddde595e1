"""Celery beat with exactly one active scheduler per Redis: `celery -A services.worker.celery_app:app beat
--scheduler services.worker.beat:LockedScheduler`.

Any number of beat processes may run; each tick, only the holder of a Redis lock (TTL LOCK_TTL_S,
refreshed every tick) sends due tasks. When the holder dies its lock expires and a standby takes over
within LOCK_TTL_S + one tick — well under a minute. A double fire in a hand-over is harmless anyway:
a scheduled sweep claims its schedule slot in SQL.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

import redis
from celery.beat import PersistentScheduler

from shared.settings import get_settings

LOCK_KEY = "supportmatrix:beat-lock"
LOCK_TTL_S = 15.0
TICK_S = 5.0

# Take the lock if free, or extend it if it is ours; atomic, so two schedulers never both hold it.
_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


class RedisLock:
    def __init__(self, url: str, key: str = LOCK_KEY, ttl_s: float = LOCK_TTL_S) -> None:
        self.client = redis.Redis.from_url(url)
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._acquire = self.client.register_script(_ACQUIRE)

    def hold(self) -> bool:
        """Take or extend the lock; False when another scheduler holds it (or Redis is unreachable)."""
        try:
            return bool(self._acquire(keys=[self.key], args=[self.owner, self.ttl_ms]))
        except redis.RedisError:
            return False

    def release(self) -> None:
        try:
            if self.client.get(self.key) == self.owner.encode():
                self.client.delete(self.key)
        except redis.RedisError:
            pass


class LockedScheduler(PersistentScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.lock = RedisLock(get_settings().redis_url)
        super().__init__(*args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if not self.lock.hold():
            return TICK_S  # a standby: check again next tick
        return min(super().tick(*args, **kwargs), TICK_S)

    def close(self) -> None:
        self.lock.release()
        super().close()

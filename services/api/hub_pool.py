"""A bounded pool for request work that waits on the Hub, apart from the pool every other route runs in."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


class PoolBusy(Exception):
    pass


class HubPool:
    """Runs blocking calls in at most ``size`` threads of its own, so a slow Hub holds ``size`` threads and
    never the server's shared thread pool, which every sync route and dependency needs. A call waits for a
    free slot without holding a thread, at most ``wait_s`` seconds, then is refused (``PoolBusy``)."""

    def __init__(self, size: int, wait_s: float) -> None:
        self.wait_s = wait_s
        # The semaphore admits (with a deadline); the limiter, of the same size, gives the admitted call a
        # thread outside the shared pool. One object cannot do both: a deadline that expires while the thread
        # runs must not turn finished work into a refusal.
        self._slots = anyio.Semaphore(size)
        self._threads = anyio.CapacityLimiter(size)

    async def run(self, call: Callable[[], T]) -> T:
        try:
            with anyio.fail_after(self.wait_s):
                await self._slots.acquire()
        except TimeoutError as exc:
            raise PoolBusy(f"all {self._threads.total_tokens:.0f} slots stayed busy for {self.wait_s:g} s") from exc
        try:
            return await anyio.to_thread.run_sync(call, limiter=self._threads)
        finally:
            self._slots.release()

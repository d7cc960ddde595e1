"""The Celery configuration both sides use: the API as a producer, the worker as a consumer.

Redis only delivers job ids; whether a job runs is decided by its lease in SQL (shared.jobs.lease). So a
redelivery (visibility timeout, a worker lost mid-job, the reconciler) is harmless: a delivery that finds
the job finished does nothing, one that finds it under a live lease ends too (if that owner dies, its lease
lapses and the reconciler sends the job again), and one that finds a dead owner's lease takes the job over.
Every job message carries a stable task id (``job-<id>``, ``verdict-<id>``), so the reconciler can see which
jobs still have a message in Redis (``deliveries``) and send again only those that have none.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError
from kombu.transport.redis import PRIORITY_STEPS, Channel
from redis.exceptions import RedisError

from shared.jobs.queues import (
    CONTROL_QUEUE,
    EXPORT_TASK,
    JUDGE_JOB_TASK,
    RECONCILE_TASK,
    RUN_JOB_TASK,
    SWEEP_TASK,
    Deliveries,
    celery_task_id,
    verdict_task_id,
)
from shared.settings import Settings, get_settings

# How a broker that is down or unreachable shows itself to a producer.
BROKER_ERRORS = (OperationalError, RedisError, OSError)

# Results finishing within this long of each other share one export run (and one Hub commit).
EXPORT_WINDOW_S = 1.0
PENDING_EXPORTS_KEY = "supportmatrix:export:pending"  # ids of finished jobs whose files are not yet exported
EXPORT_SCHEDULED_KEY = "supportmatrix:export:scheduled"  # an export task is on its way
# A flag whose task never ran (lost with a broker) stops holding back new requests after this long.
EXPORT_SCHEDULED_TTL_S = 60
EXPORT_LOCK_KEY = "supportmatrix:export:lock"
EXPORT_LOCK_TTL_S = 30.0  # kept alive while the export runs; a dead collector's lock lapses after this


def celery_config(settings: Settings) -> dict[str, Any]:
    return {
        "broker_url": settings.redis_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            # Redis restores a message that was taken but never acknowledged after this long. It is only a
            # backstop — the reconciler re-sends a lost job after its lease lapses — so it is longer than the
            # longest job: a healthy long run's message then comes back at most once, and that delivery
            # finds the live lease and waits its turn instead of running the job again.
            "visibility_timeout": int(
                settings.visibility_timeout_s or settings.stage_limit_s(compiles=True) + 10 * settings.lease_timeout_s
            ),
        },
        "task_acks_late": True,  # a job's message survives the worker that took it
        "task_reject_on_worker_lost": True,  # ... even when the pool process is killed
        "worker_prefetch_multiplier": 1,  # one job at a time per process: jobs are long
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "task_ignore_result": True,  # results live in SQL
        # A submission waits at most ~1 s for a broker that is down, then answers 503 and keeps nothing.
        "task_publish_retry_policy": {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.3},
        "task_routes": {task: {"queue": CONTROL_QUEUE} for task in (EXPORT_TASK, SWEEP_TASK, RECONCILE_TASK)},
        "task_default_queue": CONTROL_QUEUE,
        "worker_hijack_root_logger": False,
    }


def make_celery(settings: Settings, main: str = "supportmatrix") -> Celery:
    app = Celery(main)
    app.conf.update(celery_config(settings))
    return app


@lru_cache
def get_producer() -> Celery:
    return make_celery(get_settings(), "supportmatrix-producer")


def enqueue_job(producer: Celery, job_id: int, queue: str) -> None:
    producer.send_task(RUN_JOB_TASK, args=[job_id], queue=queue, task_id=celery_task_id(job_id))


def enqueue_verdict(producer: Celery, job_id: int, queue: str) -> None:
    producer.send_task(JUDGE_JOB_TASK, args=[job_id], queue=queue, task_id=verdict_task_id(job_id))


def revoke_job(producer: Celery, job_id: int) -> None:
    """Tell live workers to drop the job's message; the SQL state is what really stops it."""
    producer.control.revoke(celery_task_id(job_id))


@lru_cache
def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)  # one connection pool per process and URL


def deliveries(broker_url: str, queues: Collection[str]) -> Deliveries:
    """The task ids of the messages Redis holds for ``queues``: waiting in each one's lists (kombu's Redis
    transport keeps one list per priority step), and taken by a worker but not yet acknowledged (its
    ``unacked`` hash, with when each was taken in ``unacked_index``). One round trip; O(messages) to parse."""
    client = _redis(broker_url)
    lists = [queue if step == 0 else f"{queue}{Channel.sep}{step}" for queue in queues for step in PRIORITY_STEPS]
    with client.pipeline(transaction=False) as step:
        for key in lists:
            step.lrange(key, 0, -1)
        step.hgetall(Channel.unacked_key)
        step.zrange(Channel.unacked_index_key, 0, -1, withscores=True)
        *waiting, unacked, taken_at = step.execute()
    now = time.time()
    when = dict(taken_at)
    taken = {}
    for tag, value in unacked.items():
        message, _exchange, _routing_key = json.loads(value)
        taken[_task_id(message)] = now - when.get(tag, now)
    return Deliveries(waiting=frozenset(_task_id(json.loads(m)) for raw in waiting for m in raw), taken_s_ago=taken)


def _task_id(message: dict[str, Any]) -> str:
    return str(message.get("headers", {}).get("id", ""))


def request_export(producer: Celery, job_ids: Collection[int]) -> None:
    """Ask the collector to export the files of these finished jobs. Requests within ``EXPORT_WINDOW_S`` of
    each other share one export: each adds its jobs to a set in the broker's Redis, and only the one that
    finds no export scheduled sends the task, which waits out the window before it takes the set, so that
    the others join it. The task carries no countdown: a delayed message sits unacknowledged in the
    collector, and kombu's Redis transport crashes the worker when it restores such a message on a lost
    connection (seen in tests/test_faults.py's Redis restarts: 'Unrecoverable error: AttributeError')."""
    client = _redis(producer.conf.broker_url)
    with client.pipeline() as step:  # MULTI/EXEC: the jobs are in the set before the flag is looked at
        if job_ids:
            step.sadd(PENDING_EXPORTS_KEY, *job_ids)
        step.set(EXPORT_SCHEDULED_KEY, 1, nx=True, ex=EXPORT_SCHEDULED_TTL_S)
        *_, scheduled = step.execute()
    if not scheduled:
        return
    try:
        producer.send_task(EXPORT_TASK, queue=CONTROL_QUEUE)
    except BROKER_ERRORS:
        client.delete(EXPORT_SCHEDULED_KEY)  # the next request sends it; the jobs wait in the set
        raise


class PendingExports:
    """The collector's side of ``request_export``. Under ``exclusive()`` (one export at a time, so that an
    older read of SQL never replaces a newer file), ``take()`` lowers the flag *before* reading the set: a
    request that comes after the read finds no flag and schedules the next export. The jobs leave the set
    only when their export is done (``done``), so an export that fails or dies loses none of them."""

    def __init__(self, broker_url: str) -> None:
        self.client = _redis(broker_url)

    @contextmanager
    def exclusive(self, wait: bool) -> Iterator[bool]:
        """Hold the export lock (True), or yield False at once when another export holds it and not ``wait``.
        A thread keeps the lock alive while the export runs; if this process dies, it lapses within the TTL."""
        lock = self.client.lock(EXPORT_LOCK_KEY, timeout=EXPORT_LOCK_TTL_S, thread_local=False)
        if not lock.acquire(blocking=wait):
            yield False
            return
        stop = threading.Event()

        def keep_alive() -> None:
            while not stop.wait(EXPORT_LOCK_TTL_S / 3):
                lock.reacquire()

        keeper = threading.Thread(target=keep_alive, name="export-lock", daemon=True)
        keeper.start()
        try:
            yield True
        finally:
            stop.set()
            keeper.join()
            lock.release()

    def take(self) -> set[int]:
        """The jobs waiting for an export; lowers the flag first (see the class)."""
        with self.client.pipeline() as step:
            step.delete(EXPORT_SCHEDULED_KEY)
            step.smembers(PENDING_EXPORTS_KEY)
            _, members = step.execute()
        return {int(member) for member in members}

    def done(self, job_ids: Collection[int]) -> None:
        if job_ids:
            self.client.srem(PENDING_EXPORTS_KEY, *job_ids)

    def waiting(self) -> bool:
        """Jobs wait for an export (one that failed, or found another running, left them in the set)."""
        return bool(self.client.scard(PENDING_EXPORTS_KEY))


def request_sweep(producer: Celery, sweep_id: int) -> None:
    producer.send_task(SWEEP_TASK, args=[sweep_id], queue=CONTROL_QUEUE)

"""The Celery configuration both sides use: the API as a producer, the worker as a consumer.

Redis only delivers job ids; whether a job runs is decided by its lease in SQL (shared.jobs.rules). So a
redelivery (visibility timeout, a worker lost mid-job, the reconciler) is harmless: a delivery that finds
the job finished does nothing, one that finds it under a live lease is retried later (the owner may die),
and one that finds a dead owner's lease takes the job over.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from shared.jobs.queues import (
    CONTROL_QUEUE,
    EXPORT_TASK,
    JUDGE_JOB_TASK,
    RECONCILE_TASK,
    RUN_JOB_TASK,
    SWEEP_TASK,
    celery_task_id,
)
from shared.settings import Settings, get_settings

# How a broker that is down or unreachable shows itself to a producer.
BROKER_ERRORS = (OperationalError, RedisError, OSError)


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
                settings.visibility_timeout_s or settings.job_timeout_s + 10 * settings.lease_timeout_s
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
    producer.send_task(JUDGE_JOB_TASK, args=[job_id], queue=queue)


def revoke_job(producer: Celery, job_id: int) -> None:
    """Tell live workers to drop the job's message; the SQL state is what really stops it."""
    producer.control.revoke(celery_task_id(job_id))


def request_export(producer: Celery) -> None:
    producer.send_task(EXPORT_TASK, queue=CONTROL_QUEUE)


def request_sweep(producer: Celery, sweep_id: int) -> None:
    producer.send_task(SWEEP_TASK, args=[sweep_id], queue=CONTROL_QUEUE)

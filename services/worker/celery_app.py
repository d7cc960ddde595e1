"""The Celery app of the worker: `celery -A services.worker.celery_app:app worker`.

Job workers are started with `python -m services.worker`, which learns what this machine serves, consumes
the queue for it and registers in the `workers` table; a collector is a plain Celery worker on the export
queue (`celery -A services.worker.celery_app:app worker -Q supportmatrix.control`).
"""

from __future__ import annotations

from typing import Any

from celery.signals import worker_process_init, worker_ready, worker_shutdown

from services.worker import registry
from shared.db.engine import get_engine
from shared.jobs.broker import make_celery
from shared.jobs.queues import RECONCILE_TASK, SWEEP_TASK
from shared.settings import get_settings

settings = get_settings()
app = make_celery(settings, "supportmatrix-worker")
app.conf.include = ["services.worker.tasks"]
# Run beat with services.worker.beat:LockedScheduler so that only one scheduler sends these.
app.conf.beat_schedule = {"reconcile": {"task": RECONCILE_TASK, "schedule": settings.reconcile_every_s}}
if settings.sweep_every_s:
    app.conf.beat_schedule["sweep"] = {"task": SWEEP_TASK, "schedule": settings.sweep_every_s}


@worker_process_init.connect
def _own_connections(**_: Any) -> None:
    """A pool child forked from the main process must not share its database connections (the registry's
    heartbeat opened them): two processes on one socket corrupt each other's statements. SQLAlchemy's recipe
    for forked processes: drop the inherited pool without closing it under the parent."""
    get_engine().dispose(close=False)


@worker_ready.connect
def _register(sender: Any, **_: Any) -> None:
    registry.start(sender.hostname)


@worker_shutdown.connect
def _deregister(**_: Any) -> None:
    registry.stop()

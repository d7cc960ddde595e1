"""A worker's presence: its row in `workers` (core-group workers), its queue marked live, a heartbeat.

The API reads live worker rows to know which compiler versions are served; the reconciler reads when each
queue last had a live worker (``queues_seen``), to end the jobs of a queue nobody serves. Only workers
started by `python -m services.worker` take part (``configure`` is called there); a collector does not.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from shared.contracts.run import RuntimeInfo
from shared.cores import CoreGroup
from shared.db.engine import session_scope
from shared.db.models import Worker, utcnow
from shared.jobs.reconcile import mark_queue_live
from shared.settings import get_settings


@dataclass
class Identity:
    queue: str
    runtime: RuntimeInfo | None = None  # a core-group worker: what it serves, registered in `workers`
    group: CoreGroup | None = None


_identity: Identity | None = None
_stop = threading.Event()
_thread: threading.Thread | None = None


def configure(identity: Identity) -> None:
    global _identity
    _identity = identity


def served() -> Identity | None:
    """What this worker serves: its queue and, for a core-group worker, its runtime (None outside a worker)."""
    return _identity


def core_group() -> CoreGroup:
    """The cores this worker owns; one core (core 0) for a worker started without a core group."""
    return _identity.group if _identity and _identity.group else CoreGroup(0, 1)


def start(name: str) -> None:
    global _thread
    if _identity is None:
        return
    identity = _identity
    with session_scope() as session:
        if identity.runtime is not None and identity.group is not None:
            session.merge(
                Worker(
                    name=name,
                    host=get_settings().host_name,
                    pid=os.getpid(),
                    **identity.runtime.model_dump(),
                    cores=str(identity.group),
                    core_count=identity.group.size,
                    queue=identity.queue,
                    started_at=utcnow(),
                    heartbeat_at=utcnow(),
                )
            )
        mark_queue_live(session, identity.queue, runtime=identity.runtime)
    _stop.clear()
    _thread = threading.Thread(target=_beat, args=(name, identity.queue), name="worker-heartbeat", daemon=True)
    _thread.start()


def _beat(name: str, queue: str) -> None:
    interval = get_settings().heartbeat_interval_s
    while not _stop.wait(interval):
        try:
            with session_scope() as session:
                session.execute(sa.update(Worker).where(Worker.name == name).values(heartbeat_at=utcnow()))
                mark_queue_live(session, queue)
        except SQLAlchemyError:  # a database blip must not kill the heartbeat; the next beat retries
            continue


def stop() -> None:
    _stop.set()
    if _thread is None or _identity is None:
        return
    _thread.join(timeout=5)
    with session_scope() as session:
        session.execute(sa.delete(Worker).where(Worker.pid == os.getpid(), Worker.host == get_settings().host_name))

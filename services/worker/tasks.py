"""Celery tasks: run one job (lease → runner child → result), export results, sweep the Hub."""

from __future__ import annotations

import os
import shutil
import socket
import time
from typing import Any

from services.worker import registry
from services.worker.celery_app import app
from services.worker.collector import export_once
from services.worker.supervise import supervise
from shared.db.engine import session_scope
from shared.db.models import Sweep
from shared.enums import ErrorClass
from shared.hub.client import HubUnavailable
from shared.jobs.broker import enqueue_job, request_export
from shared.jobs.queues import EXPORT_TASK, RUN_JOB_TASK, SWEEP_TASK
from shared.jobs.rules import acquire_lease, finish, heartbeat
from shared.jobs.sweeps import open_sweep, run_sweep
from shared.settings import get_settings

SWEEP_RETRIES = 4  # 2 + 4 + 8 + 16 s of backoff before a sweep gives up on the Hub


def lease_owner(hostname: str | None) -> str:
    return f"{hostname or socket.gethostname()}:{os.getpid()}"


@app.task(name=RUN_JOB_TASK, bind=True)
def run_job(self: Any, job_id: int) -> str:
    settings = get_settings()
    owner = lease_owner(self.request.hostname)
    with session_scope() as session:
        job = acquire_lease(session, job_id, owner, settings)
    if job is None:
        return "not ours: finished, cancelled or leased elsewhere"

    def keep_lease() -> bool:
        with session_scope() as session:
            return heartbeat(session, job_id, owner)

    workdir = settings.data_dir / "runs" / f"job-{job_id}-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = supervise(job, settings, workdir, keep_lease, registry.core_group())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if report is None:
        return "lease lost: cancelled or taken over; nothing written"
    with session_scope() as session:
        written = finish(session, job_id, owner, report)
    if written:
        request_export(app)
    return f"{report.verdict.value} {report.error_class or ''}".strip()


@app.task(name=EXPORT_TASK)
def export() -> str:
    return export_once()


@app.task(name=SWEEP_TASK, bind=True, max_retries=SWEEP_RETRIES)
def sweep(self: Any, sweep_id: int | None = None) -> str:
    """Run a sweep: the one the API opened (``sweep_id``), or the schedule's current slot."""
    settings = get_settings()
    with session_scope() as session:
        if sweep_id is None:
            slot = f"every-{settings.sweep_every_s:g}s-{int(time.time() // max(settings.sweep_every_s, 1))}"
            opened = open_sweep(session, settings, "schedule", slot)
            if opened is None:
                return f"slot {slot} already swept"
            sweep_id = opened.id
    try:
        with session_scope() as session:
            record = session.get(Sweep, sweep_id)
            if record is None or record.state == "done":
                return "nothing to do"
            to_enqueue = run_sweep(session, settings, record)
    except HubUnavailable as exc:
        if self.request.retries < SWEEP_RETRIES:
            raise self.retry(countdown=2 ** (self.request.retries + 1), exc=exc) from exc
        with session_scope() as session:
            failed = session.get(Sweep, sweep_id)
            assert failed is not None
            failed.state, failed.error = "failed", f"{ErrorClass.hub_unavailable.value}: {exc}"
        return "failed: the Hub did not answer"
    for s in to_enqueue:
        enqueue_job(app, s.job.id, s.job.queue)
    return f"{len(to_enqueue)} jobs enqueued"

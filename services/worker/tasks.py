"""Celery tasks: run one job (lease → runner child → result) and export results to Parquet."""

from __future__ import annotations

import os
import shutil
import socket
from typing import Any

from services.worker import registry
from services.worker.celery_app import app
from services.worker.collector import export_once
from services.worker.supervise import supervise
from shared.broker import request_export
from shared.db import session_scope
from shared.jobs import acquire_lease, finish, heartbeat
from shared.queues import EXPORT_TASK, RUN_JOB_TASK
from shared.settings import get_settings


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

"""Celery tasks: a job's two stages (lease → runner child → result), export results, sweep the Hub.

A job runs as the **accelerator stage** on a pinned core group (``run_job``), which ends by releasing
the cores and sending the **verdict stage** (``judge_job``) to this host's verdict queue, where CPU workers
take it: the stored reference (looked up here, handed over as a file), the reference run if needed,
scoring, the judge, the verdict. Both stages hold the job's SQL lease while they run; a delivery that finds
the lease held by a live owner is delivered again later, never dropped.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import psutil

from services.worker import registry
from services.worker.celery_app import app
from services.worker.collector import export_once
from services.worker.supervise import supervise
from shared.contracts import AcceleratorOutput, Artifacts, RunReport, RunRequest, VerdictOutput, write_model
from shared.db.engine import new_session, session_scope
from shared.db.models import Job, Sweep
from shared.enums import ErrorClass, Stage, SweepState, Verdict
from shared.hub.client import HubUnavailable
from shared.jobs.broker import enqueue_verdict, request_export
from shared.jobs.dispatch import QueueUnavailable, commit_and_enqueue
from shared.jobs.queues import EXPORT_TASK, JUDGE_JOB_TASK, RUN_JOB_TASK, SWEEP_TASK, verdict_queue
from shared.jobs.rules import Claim, acquire_lease, finish, heartbeat, job_report, release_for_verdict
from shared.jobs.sweeps import open_sweep, run_sweep
from shared.results import references
from shared.settings import Settings, get_settings, hub_token

SWEEP_RETRIES = 4  # 2 + 4 + 8 + 16 s of backoff before a sweep gives up on the Hub


def lease_owner(hostname: str | None, settings: Settings) -> str:
    """``<worker name>@<host>:<pid>``: who holds a lease, and enough to tell on this host whether it lives."""
    name = (hostname or "worker").split("@")[0]
    return f"{name}@{settings.host_name}:{os.getpid()}"


def dead_local_owner(job: Job | None, settings: Settings) -> str | None:
    """The job's lease owner when it is a process of this host that no longer exists (a killed pool child):
    its lease may be taken over at once instead of after the lease timeout."""
    owner = job.lease_owner if job else None
    if not owner:
        return None
    where, _, pid = owner.rpartition(":")
    if where.rpartition("@")[2] != settings.host_name or not pid.isdigit():
        return None
    return None if psutil.pid_exists(int(pid)) else owner


def claim(task: Any, job_id: int, owner: str, settings: Settings, stage: Stage) -> Job | None:
    """The job, if this delivery takes the stage's lease; None when the message is spent. A lease held
    by a live owner is retried later (the owner may die: then its lease lapses and a retry takes over)."""
    with session_scope() as session:
        outcome, job = acquire_lease(session, job_id, owner, settings, stage)
        if outcome == Claim.held and (dead := dead_local_owner(job, settings)):
            outcome, job = acquire_lease(session, job_id, owner, settings, stage, dead_owner=dead)
    if outcome == Claim.held:
        raise task.retry(countdown=max(2 * settings.heartbeat_interval_s, 1.0), max_retries=None)
    return job if outcome == Claim.taken else None


def artifact_dir(settings: Settings, job_id: int) -> Path:
    return settings.data_dir / "artifacts" / f"job-{job_id}"


def _lease_keeper(job_id: int, owner: str) -> Any:
    def keep_lease() -> bool:
        with session_scope() as session:
            return heartbeat(session, job_id, owner)

    return keep_lease


def _stage_request(job: Job, stage: Stage, artifacts: Artifacts, core_range: str | None = None) -> RunRequest:
    return RunRequest(
        model_id=job.model_id,
        revision=job.sha,
        backend=job.backend,
        task=job.task,
        cores=job.cores,
        core_range=core_range,
        stage=stage,
        artifacts=artifacts.root,
        report=artifacts.root / f"{stage.value}-report.json",
    )


@app.task(name=RUN_JOB_TASK, bind=True)
def run_job(self: Any, job_id: int) -> str:
    """The accelerator stage, on this worker's core group."""
    settings = get_settings()
    owner = lease_owner(self.request.hostname, settings)
    job = claim(self, job_id, owner, settings, Stage.accelerator)
    if job is None:
        return "not ours: finished, cancelled or past this stage"
    group = registry.core_group()
    artifacts = Artifacts(artifact_dir(settings, job_id))
    shutil.rmtree(artifacts.root, ignore_errors=True)  # a previous, lost attempt's files
    artifacts.root.mkdir(parents=True)
    token = hub_token()
    secrets = {"HF_TOKEN": token} if job.gated and token else None
    request = _stage_request(job, Stage.accelerator, artifacts, core_range=str(group))
    report = supervise(request, job, settings, _lease_keeper(job_id, owner), group, secrets)
    if report is None:
        shutil.rmtree(artifacts.root, ignore_errors=True)
        return "lease lost: cancelled or taken over; nothing written"
    if report.verdict is not None:  # it ended here: ERROR, or SKIPPED as too large
        return _write_result(job_id, owner, report, artifacts, settings)
    queue = verdict_queue(settings.host_name)
    with session_scope() as session:
        released = release_for_verdict(session, job_id, owner, queue, report.torch_version or "")
    if not released:
        shutil.rmtree(artifacts.root, ignore_errors=True)
        return "lease lost after the accelerator stage; nothing written"
    enqueue_verdict(app, job_id, queue)
    return f"accelerator stage done; verdict stage on {queue}"


@app.task(name=JUDGE_JOB_TASK, bind=True)
def judge_job(self: Any, job_id: int) -> str:
    """The verdict stage, on this host's CPUs, from the accelerator stage's artifacts (never rerunning it)."""
    settings = get_settings()
    owner = lease_owner(self.request.hostname, settings)
    job = claim(self, job_id, owner, settings, Stage.verdict)
    if job is None:
        return "not ours: finished, cancelled or judged elsewhere"
    artifacts = Artifacts(artifact_dir(settings, job_id))
    if not artifacts.accelerator.exists():
        message = f"the accelerator stage's artifacts are missing from {artifacts.root} on {settings.host_name}"
        report = job_report(job, Verdict.ERROR, ErrorClass.internal, message)
        return _write_result(job_id, owner, report, artifacts, settings)
    _hand_over_stored_reference(artifacts)
    keep_lease = _lease_keeper(job_id, owner)
    report = supervise(_stage_request(job, Stage.verdict, artifacts), job, settings, keep_lease, None)
    output = VerdictOutput.model_validate_json(artifacts.verdict.read_text()) if artifacts.verdict.exists() else None
    if output is not None and output.new_reference is not None:
        blob = artifacts.reference_prefill.read_bytes() if artifacts.reference_prefill.exists() else None
        with session_scope() as session:
            references.store(session, output.new_reference, blob)
    if report is not None and output is not None and output.judge_needed and report.verdict != Verdict.ERROR:
        # The judge's token goes to this process alone: it loads no tested checkpoint.
        secrets = {"SUPPORTMATRIX_JUDGE_TOKEN": settings.judge_token} if settings.judge_token else None
        request = _stage_request(job, Stage.judge, artifacts)
        report = supervise(request, job, settings, keep_lease, None, secrets)
    if report is None:
        shutil.rmtree(artifacts.root, ignore_errors=True)
        return "lease lost: cancelled or taken over; nothing written"
    return _write_result(job_id, owner, report, artifacts, settings)


def _hand_over_stored_reference(artifacts: Artifacts) -> None:
    """Put the stored reference this run can reuse (if any) where the verdict stage looks for it."""
    key = AcceleratorOutput.model_validate_json(artifacts.accelerator.read_text()).reference_key
    with session_scope() as session:
        stored = references.load(session, key)
    if stored is not None:
        reference, blob = stored
        write_model(artifacts.stored_reference, reference)
        if blob is not None:
            artifacts.reference_prefill.write_bytes(blob)


def _write_result(job_id: int, owner: str, report: RunReport, artifacts: Artifacts, settings: Settings) -> str:
    with session_scope() as session:
        written = finish(session, job_id, owner, report)
    if written:
        request_export(app)
    _retire_artifacts(artifacts, keep=written and report.verdict == Verdict.FAIL, settings=settings)
    return f"{report.verdict} {report.error_class or ''}".strip() if written else "lease lost; nothing written"


def _retire_artifacts(artifacts: Artifacts, keep: bool, settings: Settings) -> None:
    """Remove a finished job's artifacts — a FAIL's are kept for inspection — and those kept past retention."""
    if not keep:
        shutil.rmtree(artifacts.root, ignore_errors=True)
    cutoff = time.time() - settings.artifact_retention_s
    for kept in artifacts.root.parent.glob("job-*"):
        if kept != artifacts.root and (kept / "verdict.json").exists() and kept.stat().st_mtime < cutoff:
            shutil.rmtree(kept, ignore_errors=True)


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
        with new_session() as session:  # committed by commit_and_enqueue; a Hub failure keeps nothing
            record = session.get(Sweep, sweep_id)
            if record is None or record.state == SweepState.done:
                return "nothing to do"
            submitted = run_sweep(session, settings, record)
            commit_and_enqueue(session, app, submitted)
    except QueueUnavailable as exc:
        with session_scope() as session:
            failed = session.get(Sweep, sweep_id)
            assert failed is not None
            failed.state, failed.error = SweepState.failed, f"the job queue is unavailable: {exc}"
        return "failed: the job queue is unavailable"
    except HubUnavailable as exc:
        if self.request.retries < SWEEP_RETRIES:
            # The retry keeps the sweep's id: a scheduled sweep's slot is already taken by it.
            raise self.retry(args=[sweep_id], countdown=2 ** (self.request.retries + 1), exc=exc) from exc
        with session_scope() as session:
            failed = session.get(Sweep, sweep_id)
            assert failed is not None
            failed.state, failed.error = SweepState.failed, f"{ErrorClass.hub_unavailable.value}: {exc}"
        return "failed: the Hub did not answer"
    return f"{sum(s.enqueue for s in submitted)} jobs enqueued"

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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import psutil
from celery.utils.log import get_task_logger
from pydantic import ValidationError
from sqlalchemy.orm import Session

from services.worker import registry
from services.worker.celery_app import app
from services.worker.collector import export_requested
from services.worker.supervise import supervise
from shared.contracts.enums import ErrorClass, Stage, SweepState, Verdict
from shared.contracts.handoffs import (
    AcceleratorOutput,
    Artifacts,
    VerdictOutput,
    read_regular,
    write_atomically,
    write_model,
)
from shared.contracts.report import RunReport
from shared.contracts.run import RunRequest
from shared.db.engine import DB_ERRORS, new_session, session_scope
from shared.db.models import Job, Sweep, utcnow
from shared.hub.client import HubUnavailable
from shared.isolation import RunAs, Sandbox, give, isolation, make_private
from shared.jobs.broker import (
    EXPORT_WINDOW_S,
    PendingExports,
    deliveries,
    enqueue_job,
    enqueue_verdict,
    request_export,
    request_sweep,
)
from shared.jobs.dispatch import QueueUnavailable, commit_and_enqueue
from shared.jobs.lease import (
    Claim,
    LeaseOwner,
    acquire_lease,
    heartbeat,
    refuse_other_stack,
    refuse_other_test,
    release_for_verdict,
)
from shared.jobs.outcomes import finish, job_report
from shared.jobs.queues import EXPORT_TASK, JUDGE_JOB_TASK, RECONCILE_TASK, RUN_JOB_TASK, SWEEP_TASK, verdict_queue
from shared.jobs.reconcile import claim_sweep
from shared.jobs.reconcile import reconcile as reconcile_jobs
from shared.jobs.sweeps import open_sweep, run_sweep
from shared.results import references
from shared.settings import Settings, get_settings, hub_token

logger = get_task_logger(__name__)
Result = TypeVar("Result")


def lease_owner(hostname: str | None, settings: Settings) -> str:
    """This process as a lease's owner (``LeaseOwner``)."""
    return str(LeaseOwner((hostname or "worker").split("@")[0], settings.host_name, os.getpid()))


def dead_local_owner(job: Job | None, settings: Settings) -> str | None:
    """The job's lease owner when it is a process of this host that no longer exists (a killed pool child):
    its lease may be taken over at once instead of after the lease timeout."""
    owner = job.lease_owner if job else None
    holder = LeaseOwner.parse(owner) if owner else None
    if holder is None or holder.host != settings.host_name:
        return None
    try:  # a reused pid is not our worker: only a live worker process keeps the lease
        alive = "services.worker" in " ".join(psutil.Process(holder.pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        alive = False
    return None if alive else owner


def durably(settings: Settings, work: Callable[[Session], Result]) -> Result:
    """Run ``work`` in a transaction, retrying database errors for up to the lease timeout: a blip shorter
    than that loses nothing; a longer outage raises, the lease lapses, and the reconciler re-sends the job."""
    deadline = time.monotonic() + settings.lease_timeout_s
    pause = 0.5
    while True:
        try:
            with session_scope() as session:
                return work(session)
        except DB_ERRORS:
            if time.monotonic() + pause > deadline:
                raise
            logger.warning("database unavailable; retrying in %.1f s", pause)
            time.sleep(pause)
            pause = min(pause * 2, settings.heartbeat_interval_s)


def claim(task: Any, job_id: int, owner: str, settings: Settings, stage: Stage) -> tuple[Job | None, str]:
    """The job, if this delivery takes the stage's lease; else None and why the message is spent. A copy that
    meets a lease held by a live owner ends (a redelivery, a resend): looping on retries would multiply the
    messages of a long run; if that owner dies, its lease lapses and the reconciler sends the job again. A
    database that does not answer is retried later, so a message is never dropped unread."""
    try:
        with session_scope() as session:
            outcome, job = acquire_lease(session, job_id, owner, settings, stage)
            if outcome == Claim.held and (dead := dead_local_owner(job, settings)):
                outcome, job = acquire_lease(session, job_id, owner, settings, stage, dead_owner=dead)
            holder = job.lease_owner if job is not None else None
    except DB_ERRORS as exc:
        raise task.retry(countdown=max(2 * settings.heartbeat_interval_s, 1.0), exc=exc) from exc
    if outcome == Claim.taken:
        return job, ""
    if outcome == Claim.held:
        return None, f"a copy: {holder} holds the live lease of the {stage.value} stage; this delivery ends"
    return None, f"not ours: finished, cancelled or past the {stage.value} stage"


def refuse_other_stack_here(task: Any, job_id: int, settings: Settings) -> str | None:
    """Why this worker does not run the job, when it is planned for another stack than this worker's
    (``shared.jobs.lease.refuse_other_stack``), after sending its message to the job's own queue; None when it
    may claim it. Checked before the lease, so that nothing of the job changes here. A database that does not
    answer is retried later, as the claim is."""
    identity = registry.served()
    if identity is None or identity.runtime is None:  # not a core-group worker: nothing to compare with
        return None
    served = identity.runtime.stack()
    try:
        with session_scope() as session:
            refusal = refuse_other_stack(session, job_id, served, identity.queue, settings)
    except DB_ERRORS as exc:
        raise task.retry(countdown=max(2 * settings.heartbeat_interval_s, 1.0), exc=exc) from exc
    if refusal is None:
        return None
    if refusal.resend_to is not None:
        # Sent before this delivery is acknowledged: a broker that refuses fails the task, and the reconciler
        # re-sends the still-queued job to its own queue.
        enqueue_job(app, job_id, refusal.resend_to)
    logger.warning("refused: %s", refusal.said)
    return f"refused: {refusal.said}"


def artifact_dir(settings: Settings, job_id: int) -> Path:
    return settings.data_dir / "artifacts" / f"job-{job_id}"


def _lease_keeper(job_id: int, owner: str, settings: Settings) -> Callable[[], bool]:
    """Extends the lease; False when it is no longer ours. A database that does not answer is waited out
    while the lease cannot have lapsed — past that, someone else may take the job over, so we stop."""
    last_held = time.monotonic()

    def keep_lease() -> bool:
        nonlocal last_held
        try:
            with session_scope() as session:
                held = heartbeat(session, job_id, owner)
        except DB_ERRORS:
            return time.monotonic() - last_held < settings.lease_timeout_s - settings.heartbeat_interval_s
        last_held = time.monotonic()
        return held

    return keep_lease


def accelerator_secrets(job: Job, settings: Settings, hub_read_token: str | None) -> dict[str, str]:
    """The only secrets an accelerator stage's runner gets: the Hub token for a gated model, and the compile
    cache's write token for its rank 0 to push — never to a run of a repo's own code, which could poison
    the shared cache."""
    secrets = {"HF_TOKEN": hub_read_token} if job.gated and hub_read_token else {}
    if settings.compile_cache_token and not job.trust_remote_code:
        secrets["SUPPORTMATRIX_COMPILE_CACHE_TOKEN"] = settings.compile_cache_token
    return secrets


def stage_user(
    job: Job, artifacts: Artifacts, settings: Settings, runs_repo_code: bool
) -> tuple[RunAs | None, dict[str, str]]:
    """Who runs a stage, and what it is given instead of the shared directories. A stage that runs the repo's own
    code (both stages of a trust_remote_code job; never the judge) runs as the job's own sandbox uid, with a compile
    cache, Hub cache and home of its job's own (shared.isolation.Sandbox). The job's artifacts are given to the stage's
    user, 0700: no other job's runs reach them."""
    users = isolation(settings)
    user = users.user_for(runs_repo_code, job.id) if users else None
    sandbox = Sandbox(artifacts.root / "sandbox")
    if runs_repo_code:
        sandbox.create(user)
    if user is not None:
        give(artifacts.root, user)
        make_private(artifacts.root)  # the stage's user's alone: no other job's runs list it
    return user, sandbox.environment(user) if runs_repo_code else {}


def _stage_request(job: Job, stage: Stage, artifacts: Artifacts, core_range: str | None = None) -> RunRequest:
    """What a stage's runner is asked: the test the job names (its columns of the request's reproducible fields),
    at the commit it was sized at, and where this stage's files go."""
    test = {name: getattr(job, name) for name in RunRequest.REPRODUCIBLE - {"revision", "local_dir"}}
    where = {"artifacts": artifacts.root, "report": artifacts.root / f"{stage.value}-report.json"}
    return RunRequest(**test, revision=job.sha, core_range=core_range, stage=stage, **where)


# max_retries=None: a delivery that meets a live lease (or a silent database) is retried until the job leaves
# the stage — Celery's default would drop it after three tries.
@app.task(name=RUN_JOB_TASK, bind=True, max_retries=None)
def run_job(self: Any, job_id: int) -> str:
    """The accelerator stage, on this worker's core group."""
    settings = get_settings()
    refused = refuse_other_stack_here(self, job_id, settings)
    if refused is not None:
        return refused
    owner = lease_owner(self.request.hostname, settings)
    job, spent = claim(self, job_id, owner, settings, Stage.accelerator)
    if job is None:
        return spent
    group = registry.core_group()
    artifacts = Artifacts(artifact_dir(settings, job_id))
    shutil.rmtree(artifacts.root, ignore_errors=True)  # a previous, lost attempt's files
    artifacts.root.mkdir(parents=True)
    if (other_test := refuse_other_test(job, settings)) is not None:
        return _write_result(job_id, owner, job_report(job, Verdict.ERROR, ErrorClass.internal, other_test), artifacts,
                             settings)  # fmt: skip
    request = _stage_request(job, Stage.accelerator, artifacts, core_range=str(group))
    secrets = accelerator_secrets(job, settings, hub_token())
    user, private = stage_user(job, artifacts, settings, runs_repo_code=job.trust_remote_code)
    keep_lease = _lease_keeper(job_id, owner, settings)
    report = supervise(request, job, settings, keep_lease, group, secrets, user, private)
    if report is None:
        shutil.rmtree(artifacts.root, ignore_errors=True)
        return "lease lost: cancelled or taken over; nothing written"
    if report.verdict is not None:  # it ended here: ERROR, or SKIPPED as too large
        return _write_result(job_id, owner, report, artifacts, settings)
    queue = verdict_queue(settings.host_name)
    released = durably(settings, lambda s: release_for_verdict(s, job_id, owner, queue))
    if not released:
        shutil.rmtree(artifacts.root, ignore_errors=True)
        return "lease lost after the accelerator stage; nothing written"
    enqueue_verdict(app, job_id, queue)
    return f"accelerator stage done; verdict stage on {queue}"


@app.task(name=JUDGE_JOB_TASK, bind=True, max_retries=None)
def judge_job(self: Any, job_id: int) -> str:
    """The verdict stage, on this host's CPUs, from the accelerator stage's artifacts (never rerunning it)."""
    settings = get_settings()
    owner = lease_owner(self.request.hostname, settings)
    job, spent = claim(self, job_id, owner, settings, Stage.verdict)
    if job is None:
        return spent
    artifacts = Artifacts(artifact_dir(settings, job_id))
    missing = f"the accelerator stage's artifacts are missing from {artifacts.root} on {settings.host_name}"
    if unrunnable := refuse_other_test(job, settings) or (None if artifacts.accelerator.exists() else missing):
        return _write_result(job_id, owner, job_report(job, Verdict.ERROR, ErrorClass.internal, unrunnable), artifacts,
                             settings)  # fmt: skip
    artifacts.verdict.unlink(missing_ok=True)  # a lost attempt's output is not this attempt's
    # Stored references are shared by every run under their keys, and a repo's own code writes its stage's files, the
    # key included: it could read any model's reference, or stand its own in for one. So only a run of transformers'
    # code is handed one, or stores one.
    shares_references = not job.trust_remote_code
    if shares_references:
        _hand_over_stored_reference(artifacts, settings)
    keep_lease = _lease_keeper(job_id, owner, settings)
    user, private = stage_user(job, artifacts, settings, runs_repo_code=job.trust_remote_code)
    report = supervise(
        _stage_request(job, Stage.verdict, artifacts), job, settings, keep_lease, None, None, user, private
    )
    output = _verdict_output(artifacts)
    if isinstance(output, str):  # the stage left what no verdict can be read from: no row may rest on its report
        if report is not None and report.verdict != Verdict.ERROR:
            report = job_report(job, Verdict.ERROR, ErrorClass.internal, output)
        output = None
    if output is not None and output.new_reference is not None and shares_references:
        blob = _read_if_there(artifacts.reference_prefill)
        reference = output.new_reference
        durably(settings, lambda s: references.store(s, reference, blob))
    if report is not None and output is not None and output.judge_needed and report.verdict != Verdict.ERROR:
        # The judge's token goes to this process alone: it loads no tested checkpoint.
        secrets = {"SUPPORTMATRIX_JUDGE_TOKEN": settings.judge_token} if settings.judge_token else None
        request = _stage_request(job, Stage.judge, artifacts)
        user, _ = stage_user(job, artifacts, settings, runs_repo_code=False)  # the judge's model is no repo's code
        report = supervise(request, job, settings, keep_lease, None, secrets, user)
    if report is None:
        shutil.rmtree(artifacts.root, ignore_errors=True)
        return "lease lost: cancelled or taken over; nothing written"
    return _write_result(job_id, owner, report, artifacts, settings)


def _read_if_there(path: Path) -> bytes | None:
    """A file of the job's directory, read without following a link planted there (``read_regular``); None when
    there is none, or none that is a regular file."""
    try:
        return read_regular(path)
    except OSError:
        return None


def _verdict_output(artifacts: Artifacts) -> VerdictOutput | str | None:
    """What the verdict stage left: None when it left nothing (its own report says why), and why, when what it left
    is no regular file or does not parse."""
    if not os.path.lexists(artifacts.verdict):
        return None
    try:
        return VerdictOutput.model_validate_json(read_regular(artifacts.verdict))
    except (OSError, ValidationError) as exc:
        return f"the verdict stage's output {artifacts.verdict} could not be read: {str(exc).splitlines()[0][:300]}"


def _hand_over_stored_reference(artifacts: Artifacts, settings: Settings) -> None:
    """Put the stored reference this run can reuse (if any) where the verdict stage looks for it (written through no
    link planted in the job's directory: ``write_atomically``)."""
    data = _read_if_there(artifacts.accelerator)
    try:
        key = AcceleratorOutput.model_validate_json(data or b"").reference_key
    except ValidationError:
        return  # none to look up: the verdict stage, reading the same file, says what is wrong with it
    stored = durably(settings, lambda s: references.load(s, key))
    if stored is not None:
        reference, blob = stored
        write_model(artifacts.stored_reference, reference)
        if blob is not None:
            write_atomically(artifacts.reference_prefill, blob)


def _write_result(job_id: int, owner: str, report: RunReport, artifacts: Artifacts, settings: Settings) -> str:
    shutil.rmtree(artifacts.root / "sandbox", ignore_errors=True)  # a repo-code run's caches: read by no other run
    written = durably(settings, lambda s: finish(s, job_id, owner, report))
    if written:
        request_export(app, [job_id])
    _retire_artifacts(artifacts, keep=written and report.verdict == Verdict.FAIL, settings=settings)
    said = f"{report.verdict} {report.failure.error_class or ''}".strip()
    return said if written else "lease lost; nothing written"


def _retire_artifacts(artifacts: Artifacts, keep: bool, settings: Settings) -> None:
    """Remove a finished job's artifacts — a FAIL's are kept for inspection — and those kept past retention."""
    if not keep:
        shutil.rmtree(artifacts.root, ignore_errors=True)
    cutoff = time.time() - settings.artifact_retention_s
    for kept in artifacts.root.parent.glob("job-*"):
        if kept != artifacts.root and (kept / "verdict.json").exists() and kept.stat().st_mtime < cutoff:
            shutil.rmtree(kept, ignore_errors=True)


# Acknowledged when it starts, and never retried with a countdown: a message held unacknowledged across a lost
# broker connection crashes the collector (see request_export). Jobs a run could not export stay in the set,
# and the reconciler asks again (``reconcile`` below).
@app.task(name=EXPORT_TASK, acks_late=False)
def export() -> str:
    """Export what the workers asked for since the last run (requests within a window share one run)."""
    time.sleep(EXPORT_WINDOW_S)  # the window: requests made meanwhile join this run
    said = export_requested()
    return "another export is running; these jobs wait for the next" if said is None else said


@app.task(name=SWEEP_TASK, bind=True, max_retries=None)  # retries are counted in SQL (Sweep.attempts)
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
        if not claim_sweep(session, sweep_id, settings):
            return "nothing to do: running elsewhere, finished, or gone"
    try:
        with new_session() as session:  # committed by commit_and_enqueue; a Hub failure keeps nothing
            record = session.get(Sweep, sweep_id)
            assert record is not None
            submitted = run_sweep(session, settings, record)
            commit_and_enqueue(session, app, submitted, keep_on_broker_failure=True)
    except QueueUnavailable:
        return "jobs committed; the reconciler sends them once the queue answers again"
    except HubUnavailable as exc:
        delays = settings.sweep_retry_delays_s
        with session_scope() as session:
            record = session.get(Sweep, sweep_id)
            assert record is not None
            retry_in = delays[record.attempts - 1] if record.attempts <= len(delays) else None
            if retry_in is None:
                record.state, record.error = SweepState.failed, f"{ErrorClass.hub_unavailable.value}: {exc}"
            else:  # handed back for the retry to claim; the reconciler waits a grace period from now
                record.state, record.claimed_at = SweepState.queued, utcnow()
        if retry_in is None:
            return f"failed: the Hub did not answer {len(delays) + 1} times"
        # The retry keeps the sweep's id: a scheduled sweep's slot is already taken by it.
        raise self.retry(args=[sweep_id], countdown=retry_in, exc=exc) from exc
    return f"{sum(s.enqueue for s in submitted)} jobs enqueued"


@app.task(name=RECONCILE_TASK)
def reconcile() -> str:
    """Re-send what no message will move; end what no worker will take (see shared.jobs.reconcile)."""
    settings = get_settings()
    with session_scope() as session:
        found = reconcile_jobs(session, settings, partial(deliveries, settings.redis_url))
    for resend in found.resend:
        if resend.stage == Stage.verdict:
            enqueue_verdict(app, resend.job_id, resend.queue)
        else:
            enqueue_job(app, resend.job_id, resend.queue)
    for sweep_id in found.sweeps:
        request_sweep(app, sweep_id)
    if found.no_worker or PendingExports(settings.redis_url).waiting():
        request_export(app, found.no_worker)
    summary = found.summary()
    logger.info("reconciler: %s", summary)
    return summary

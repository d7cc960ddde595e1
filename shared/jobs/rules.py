"""Job rules shared by the API and the worker: submission with de-duplication, cancel, the lease, results.

Job state lives here, in SQL; the broker only delivers job ids. Single execution is a SQL invariant:
a worker runs a job only after an UPDATE that moves it from queued (or a stale running lease) to
running under its own name, so a second delivery of a running or finished job does nothing.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.contracts import LIBRARY, RunReport, RuntimeInfo, cpu_compiler, installed_version
from shared.db.models import Job, Result, Worker, utcnow
from shared.enums import ACTIVE_STATES, FINISHED_STATES, CompilerName, ErrorClass, JobState, Stage, Task, Verdict
from shared.hub.client import ResolvedModel
from shared.jobs.queues import job_queue
from shared.results.signatures import error_signature, fail_signature
from shared.settings import Settings
from shared.testconfig import config_hash

# The report fields a result row keeps (the rest, like model_id, live on the job).
RESULT_FIELDS = {c.key for c in Result.__table__.columns} & set(RunReport.model_fields)


class UnknownCompiler(ValueError):
    pass


class NoRuntime(RuntimeError):
    pass


class JobNotFound(LookupError):
    pass


class JobFinished(RuntimeError):
    pass


# --- what is served -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseOwner:
    """Who holds a lease, written ``<worker name>@<host>:<pid>``: enough to tell on its host whether it lives."""

    worker: str
    host: str
    pid: int

    def __str__(self) -> str:
        return f"{self.worker}@{self.host}:{self.pid}"

    @classmethod
    def parse(cls, owner: str) -> LeaseOwner | None:
        """The owner a lease names, or None when it is not one a worker wrote."""
        where, _, pid = owner.rpartition(":")
        worker, at, host = where.rpartition("@")
        return cls(worker, host, int(pid)) if at and pid.isdigit() else None


def live_since(settings: Settings, now: dt.datetime | None = None) -> dt.datetime:
    """A worker whose last heartbeat is older than this is not live."""
    return (now or utcnow()) - dt.timedelta(seconds=settings.worker_stale_s)


def live_workers(session: Session, settings: Settings, now: dt.datetime | None = None) -> Sequence[Worker]:
    since = live_since(settings, now)
    return session.scalars(sa.select(Worker).where(Worker.heartbeat_at >= since).order_by(Worker.name)).all()


# The columns of a worker that make up its RuntimeInfo.
RUNTIME_COLUMNS = [getattr(Worker, name) for name in RuntimeInfo.model_fields]


def served_runtimes(session: Session, settings: Settings) -> list[RuntimeInfo]:
    """Distinct runtimes of live workers, or the configured default when none is live.

    A (compiler version, library version) is served by the runtime of its first live worker by name, in that
    order. Read as the distinct runtime columns (with the first worker name of each), not as worker rows: a
    fleet has hundreds of workers and a handful of runtimes, and every submission asks.
    """
    first_worker = sa.func.min(Worker.name)
    distinct = (
        sa.select(first_worker, *RUNTIME_COLUMNS)
        .where(Worker.heartbeat_at >= live_since(settings))
        .group_by(*RUNTIME_COLUMNS)
        .order_by(first_worker)
    )
    seen: dict[tuple[str, str], RuntimeInfo] = {}
    for _, *columns in session.execute(distinct):
        runtime = RuntimeInfo(**dict(zip(RuntimeInfo.model_fields, columns, strict=True)))
        seen.setdefault((runtime.compiler_version, runtime.library_version), runtime)
    if seen:
        return list(seen.values())
    default = default_runtime(settings)
    return [default] if default else []


def default_runtime(settings: Settings) -> RuntimeInfo | None:
    """The runtime a job is planned for when no live worker says what it serves.

    Read from package metadata so that the API never imports torch; None when it cannot be known here.
    """
    torch_version = installed_version("torch")
    library_version = installed_version(LIBRARY)
    if settings.backend == "neuron":
        compiler_name = CompilerName.neuronx_cc.value
        compiler_version = settings.default_compiler or installed_version("neuronx-cc")
    elif settings.backend == "cpu" and torch_version and not settings.default_compiler:
        # what this host's cpu workers will serve (a job planned for another compiler would find no worker)
        compiler_name, compiler_version = cpu_compiler(settings.cpu_compile_backend, torch_version, settings.cpu_dtype)
    else:
        compiler_name = CompilerName.inductor.value
        compiler_version = settings.default_compiler or (torch_version and f"inductor-{torch_version}")
    if not (compiler_version and library_version):
        return None
    return RuntimeInfo(
        backend=settings.backend,
        compiler_name=compiler_name,
        compiler_version=compiler_version,
        library_version=library_version,
        torch_version=torch_version or "unknown",
    )


def plan_runtimes(session: Session, settings: Settings, compilers: list[str] | None) -> list[RuntimeInfo]:
    served = served_runtimes(session, settings)
    if not served:
        raise NoRuntime(
            "no live worker serves a compiler and no default is configured (SUPPORTMATRIX_DEFAULT_COMPILER)"
        )
    if compilers is None:
        return served
    planned = []
    for version in dict.fromkeys(compilers):
        matches = [r for r in served if r.compiler_version == version]
        if not matches:
            raise UnknownCompiler(
                f"compiler {version!r} is not served; served: {sorted({r.compiler_version for r in served})}"
            )
        planned.extend(matches)
    return planned


# --- submission ----------------------------------------------------------------------------------------


@dataclass
class Submitted:
    job: Job
    created: bool
    enqueue: bool = False  # created and waiting for a worker (not settled at submission)


def _identity(model: ResolvedModel, runtime: RuntimeInfo, task: str, cores: int) -> sa.ColumnElement[bool]:
    return sa.and_(
        Job.model_id == model.model_id,
        Job.sha == model.sha,
        Job.compiler_version == runtime.compiler_version,
        Job.library_version == runtime.library_version,
        Job.task == task,
        Job.config_hash == config_hash(task),
        Job.cores == cores,
    )


def _existing(session: Session, identity: sa.ColumnElement[bool], force: bool) -> Job | None:
    states = ACTIVE_STATES if force else (*ACTIVE_STATES, JobState.done)
    return session.scalars(
        sa.select(Job).where(identity, Job.state.in_(states)).order_by(Job.id.desc()).limit(1)
    ).first()


def submit(
    session: Session,
    model: ResolvedModel,
    revision: str | None,
    runtimes: list[RuntimeInfo],
    *,
    force: bool = False,
    task: str = Task.text_generation.value,
    cores: int = 1,
) -> list[Submitted]:
    """One job per runtime; an identical queued, running or done job is returned instead of a new one.

    ``force`` reruns finished jobs but never doubles a queued or running one. The caller commits, then
    enqueues the created jobs: a message must never reach a worker before its row does.
    """
    out: list[Submitted] = []
    for runtime in runtimes:
        identity = _identity(model, runtime, task, cores)
        existing = _existing(session, identity, force)
        if existing is not None:
            out.append(Submitted(existing, created=False))
            continue
        job = Job(
            model_id=model.model_id,
            revision=revision,
            sha=model.sha,
            task=task,
            config_hash=config_hash(task),
            gated=model.gated,
            trust_remote_code=model.needs_remote_code,
            **runtime.model_dump(),
            cores=cores,
            queue=job_queue(runtime.backend, runtime.compiler_version, cores),
            state=JobState.queued,
        )
        try:
            with session.begin_nested():
                session.add(job)
                session.flush()
        except IntegrityError:
            # A concurrent submission inserted the same active job first: return that one.
            raced = _existing(session, identity, force=True)
            if raced is None:
                raise
            out.append(Submitted(raced, created=False))
            continue
        out.append(Submitted(job, created=True, enqueue=True))
    return out


def cancel(session: Session, job_id: int) -> Job:
    """Queued or running → cancelled. The worker that holds a running job sees it and kills its runner."""
    job = session.get(Job, job_id, with_for_update=True)
    if job is None:
        raise JobNotFound(f"job {job_id} does not exist")
    if job.state == JobState.cancelled:
        return job
    if job.state in FINISHED_STATES:
        raise JobFinished(f"job {job_id} already finished ({job.state.value})")
    job.state = JobState.cancelled
    job.finished_at = utcnow()
    _end_attempts(job, "cancelled")
    return job


def job_report(job: Job, verdict: Verdict, error_class: ErrorClass, message: str, **extra: Any) -> RunReport:
    """The report of a job that ended without a runner's report: settled, timed out, crashed, lost."""
    return RunReport(
        model_id=job.model_id,
        sha=job.sha,
        revision=job.revision,
        task=job.task,
        **job.runtime().model_dump(exclude={"torch_version"} if not job.torch_version else set()),
        verdict=verdict,
        error_class=error_class,
        error_message=message,
        cores=job.cores,
        **extra,
    )


# --- the lease -----------------------------------------------------------------------------------------


class Claim(StrEnum):
    """What a delivery of a job's message found."""

    taken = "taken"  # ours now: run the stage
    gone = "gone"  # finished, cancelled, or not at this stage: the message is spent
    held = "held"  # another owner holds a fresh lease: deliver again later, never drop it


@dataclass(frozen=True)
class StageRules:
    """Where a stage's lease lives: the state it runs in, the state it is taken from, its delivery counter."""

    stage: Stage
    running: JobState
    waiting: JobState
    attempts: sa.orm.InstrumentedAttribute[int]


STAGE_RULES = {
    Stage.accelerator: StageRules(Stage.accelerator, JobState.running, JobState.queued, Job.attempts),
    Stage.verdict: StageRules(Stage.verdict, JobState.judging, JobState.judging, Job.verdict_attempts),
}


class Attempt(BaseModel):
    """One delivery that took a job's lease, as the job's ``attempt_log`` keeps it."""

    stage: Stage
    owner: str
    started_at: dt.datetime
    ended: str | None = None  # how it ended; None while it runs


def attempts(job: Job) -> list[Attempt]:
    return [Attempt.model_validate(a) for a in job.attempt_log or []]


def _end_attempts(job: Job, how: str, new: Attempt | None = None) -> list[Attempt]:
    """Close the job's open attempt with ``how`` (and open ``new``); returns the whole log."""
    log = attempts(job)
    for attempt in log:
        if attempt.ended is None:
            attempt.ended = how
    log += [new] if new else []
    job.attempt_log = [a.model_dump(mode="json") for a in log]
    return log


def acquire_lease(
    session: Session,
    job_id: int,
    owner: str,
    settings: Settings,
    stage: Stage = Stage.accelerator,
    dead_owner: str | None = None,
) -> tuple[Claim, Job | None]:
    """Take the job's ``stage`` for ``owner``.

    The accelerator stage is taken from ``queued``; the verdict stage from ``judging`` with no owner (the
    accelerator stage releases its lease with its cores). Either may be taken over from an owner whose
    heartbeat is older than the lease timeout, or from ``dead_owner`` (a lease holder the caller knows is
    dead: a process of this host that no longer exists), up to ``max_attempts`` deliveries, after which
    the job ends ERROR(worker_lost).
    """
    rules = STAGE_RULES[stage]
    now = utcnow()
    previous = session.scalar(sa.select(Job.lease_owner).where(Job.id == job_id))
    lost = "lost: its process died" if previous and previous == dead_owner else "lost: its lease lapsed"
    stale = now - dt.timedelta(seconds=settings.lease_timeout_s)
    lapsed = sa.or_(Job.heartbeat_at < stale, Job.lease_owner == dead_owner) if dead_owner else Job.heartbeat_at < stale
    fresh_start = Job.state == rules.waiting
    if rules.waiting == rules.running:
        fresh_start = sa.and_(fresh_start, Job.lease_owner.is_(None))
    takeable = sa.or_(fresh_start, sa.and_(Job.state == rules.running, Job.lease_owner.is_not(None), lapsed))
    exhausted = session.scalars(
        sa.select(Job)
        .where(Job.id == job_id, takeable, rules.attempts >= settings.max_attempts)
        .execution_options(populate_existing=True)  # bulk updates above bypassed the session's copy
    ).first()
    if exhausted is not None:
        log = _end_attempts(exhausted, lost)
        listed = "; ".join(f"{a.owner} ({a.stage.value}, {a.started_at:%Y-%m-%d %H:%M:%S}): {a.ended}" for a in log)
        message = (
            f"the {stage.value} stage was delivered {settings.max_attempts} times without finishing; "
            f"the workers running it were lost. Attempts: {listed}"
        )
        close_unattended(session, exhausted, job_report(exhausted, Verdict.ERROR, ErrorClass.worker_lost, message))
        return Claim.gone, None
    started = {"started_at": now} if stage == Stage.accelerator else {}
    taken = session.execute(
        sa.update(Job)
        .where(Job.id == job_id, takeable)
        .values(
            state=rules.running,
            lease_owner=owner,
            heartbeat_at=now,
            **{rules.attempts.key: rules.attempts + 1},
            **started,
        )
        .execution_options(synchronize_session=False)
    ).rowcount
    job = session.get(Job, job_id, populate_existing=True)
    if taken:
        assert job is not None
        _end_attempts(job, lost, Attempt(stage=stage, owner=owner, started_at=now))
        session.flush()
        return Claim.taken, job
    held = job is not None and job.state == rules.running and job.lease_owner is not None
    return (Claim.held if held else Claim.gone), job


def heartbeat(session: Session, job_id: int, owner: str) -> bool:
    """Extend the lease of either stage; False when it is no longer ours (cancelled, or taken over)."""
    return bool(
        session.execute(
            sa.update(Job)
            .where(Job.id == job_id, Job.lease_owner == owner, Job.state.in_((JobState.running, JobState.judging)))
            .values(heartbeat_at=utcnow())
            .execution_options(synchronize_session=False)
        ).rowcount
    )


def release_for_verdict(session: Session, job_id: int, owner: str, verdict_queue: str, torch_version: str) -> bool:
    """The accelerator stage is done: running → judging, the lease and the cores released; the verdict stage
    will be taken from ``verdict_queue`` (the queue of the host that holds the artifacts)."""
    now = utcnow()
    released = bool(
        session.execute(
            sa.update(Job)
            .where(Job.id == job_id, Job.lease_owner == owner, Job.state == JobState.running)
            .values(
                state=JobState.judging,
                lease_owner=None,
                heartbeat_at=now,
                judging_at=now,
                enqueued_at=now,
                verdict_queue=verdict_queue,
                torch_version=torch_version,
            )
            .execution_options(synchronize_session=False)
        ).rowcount
    )
    if released:
        _end_job_attempt(session, job_id, "done: released its cores for the verdict stage")
    return released


def _end_job_attempt(session: Session, job_id: int, how: str) -> None:
    job = session.get(Job, job_id, populate_existing=True)
    assert job is not None
    _end_attempts(job, how)
    session.flush()


def finish(session: Session, job_id: int, owner: str, report: RunReport) -> bool:
    """Write the result of a job we hold; False (nothing written) when the lease is no longer ours."""
    held = sa.and_(Job.lease_owner == owner, Job.state.in_(ACTIVE_STATES))
    written = _close(session, job_id, held, report)
    if written:
        _end_job_attempt(session, job_id, f"done: wrote the result ({report.verdict})")
    return written


def settle(session: Session, job: Job, verdict: Verdict, error_class: ErrorClass, reason: str) -> None:
    """Finish a just-created, still queued job without running it (refused at submission)."""
    settled = job.state == JobState.queued and close_unattended(
        session, job, job_report(job, verdict, error_class, reason)
    )
    assert settled, f"job {job.id} was no longer queued"
    session.refresh(job)


def close_unattended(session: Session, job: Job, report: RunReport) -> bool:
    """End a job that nobody holds (or whose holder is gone) as it was read: False when it moved meanwhile —
    taken, heartbeated or finished — so that a live worker's job is never closed under it."""
    unchanged = sa.and_(
        Job.state == job.state,
        Job.lease_owner.is_(None) if job.lease_owner is None else Job.lease_owner == job.lease_owner,
        Job.heartbeat_at.is_(None) if job.heartbeat_at is None else Job.heartbeat_at == job.heartbeat_at,
    )
    closed = _close(session, job.id, unchanged, report)
    if closed:
        _end_job_attempt(session, job.id, f"ended {report.error_class or report.verdict} while unattended")
    return closed


def _close(session: Session, job_id: int, condition: sa.ColumnElement[bool], report: RunReport) -> bool:
    """The one way a job ends with a result: its final state and its result row, in the caller's transaction."""
    assert report.verdict is not None, "a result needs a verdict"
    state = JobState.failed if report.verdict == Verdict.ERROR else JobState.done
    now = utcnow()
    moved = session.execute(
        sa.update(Job)
        .where(Job.id == job_id, condition)
        .values(
            state=state,
            finished_at=now,
            heartbeat_at=now,
            error_class=report.error_class,
            error_message=report.error_message,
        )
        .execution_options(synchronize_session=False)
    ).rowcount
    if not moved:
        return False
    session.add(Result(job_id=job_id, **_with_signature(report).model_dump(include=RESULT_FIELDS)))
    return True


def _with_signature(report: RunReport) -> RunReport:
    """``report`` with its failure signature: an ERROR or FAIL keeps the runner's (which saw the traceback),
    else gets one from its message or verdict reason — a job the worker ended (timeout, crash, lost, no
    worker, refused at submission) or a FAIL, whose reason names the rule that failed it."""
    if report.signature_id is not None or report.verdict not in (Verdict.ERROR, Verdict.FAIL):
        return report
    if report.verdict == Verdict.FAIL:
        signature = fail_signature(report.verdict_reason, report.model_id)
    else:
        signature = error_signature(report.error_class, report.error_message, model_id=report.model_id)
    return report.model_copy(update={"failure_signature": signature.text, "signature_id": signature.id})


def list_jobs(
    session: Session,
    *,
    state: JobState | None = None,
    model_id: str | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> list[Job]:
    """Newest first; ``before_id`` is the cursor (the last id of the previous page)."""
    stmt = sa.select(Job).order_by(Job.id.desc()).limit(limit)
    if state is not None:
        stmt = stmt.where(Job.state == state)
    if model_id is not None:
        stmt = stmt.where(Job.model_id == model_id)
    if before_id is not None:
        stmt = stmt.where(Job.id < before_id)
    return list(session.scalars(stmt))


def withdraw(session: Session, job_ids: list[int]) -> None:
    """Remove the jobs (and any result settled at submission) of a submission that could not be enqueued."""
    if job_ids:
        session.execute(sa.delete(Result).where(Result.job_id.in_(job_ids)))
        session.execute(sa.delete(Job).where(Job.id.in_(job_ids)))

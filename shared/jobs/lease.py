"""The lease of a job's two stages: single execution as a SQL invariant.

A worker runs a stage only after an UPDATE that moves the job from the stage's waiting state (or a stale lease)
to its running state under the worker's own name, so a second delivery of a running or finished job does nothing.
The lease is kept by heartbeats; a lapsed one may be taken over, up to ``max_attempts`` deliveries. Before any of
that, a worker refuses a job planned for a software stack other than its own (``refuse_other_stack``), and once it
holds the lease, one planned as another test than its settings run (``refuse_other_test``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, JobState, Stage, Verdict
from shared.contracts.run import Stack, stack_of
from shared.db.engine import rows_changed
from shared.db.models import Job, utcnow
from shared.jobs.attempts import Attempt, end_attempts, end_job_attempt
from shared.jobs.outcomes import close_unattended, job_report
from shared.settings import VERDICT_SETTINGS, Settings
from shared.testconfig import planned_config_hash


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
        log = end_attempts(exhausted, lost)
        listed = "; ".join(f"{a.owner} ({a.stage.value}, {a.started_at:%Y-%m-%d %H:%M:%S}): {a.ended}" for a in log)
        message = (
            f"the {stage.value} stage was delivered {settings.max_attempts} times without finishing; "
            f"the workers running it were lost. Attempts: {listed}"
        )
        close_unattended(session, exhausted, job_report(exhausted, Verdict.ERROR, ErrorClass.worker_lost, message))
        return Claim.gone, None
    started = {"started_at": now} if stage == Stage.accelerator else {}
    taken = rows_changed(
        session,
        sa.update(Job)
        .where(Job.id == job_id, takeable)
        .values(
            state=rules.running,
            lease_owner=owner,
            heartbeat_at=now,
            **{rules.attempts.key: rules.attempts + 1},
            **started,
        )
        .execution_options(synchronize_session=False),
    )
    job = session.get(Job, job_id, populate_existing=True)
    if taken:
        assert job is not None
        end_attempts(job, lost, Attempt(stage=stage, owner=owner, started_at=now))
        session.flush()
        return Claim.taken, job
    held = job is not None and job.state == rules.running and job.lease_owner is not None
    return (Claim.held if held else Claim.gone), job


def heartbeat(session: Session, job_id: int, owner: str) -> bool:
    """Extend the lease of either stage; False when it is no longer ours (cancelled, or taken over)."""
    return bool(
        rows_changed(
            session,
            sa.update(Job)
            .where(Job.id == job_id, Job.lease_owner == owner, Job.state.in_((JobState.running, JobState.judging)))
            .values(heartbeat_at=utcnow())
            .execution_options(synchronize_session=False),
        )
    )


def release_for_verdict(session: Session, job_id: int, owner: str, verdict_queue: str) -> bool:
    """The accelerator stage is done: running → judging, the lease and the cores released; the verdict stage
    will be taken from ``verdict_queue`` (the queue of the host that holds the artifacts). The job keeps the stack
    it was planned for: only a worker of that stack took it (``refuse_other_stack``)."""
    now = utcnow()
    released = bool(
        rows_changed(
            session,
            sa.update(Job)
            .where(Job.id == job_id, Job.lease_owner == owner, Job.state == JobState.running)
            .values(
                state=JobState.judging,
                lease_owner=None,
                heartbeat_at=now,
                judging_at=now,
                enqueued_at=now,
                verdict_queue=verdict_queue,
            )
            .execution_options(synchronize_session=False),
        )
    )
    if released:
        end_job_attempt(session, job_id, "done: released its cores for the verdict stage")
    return released


class Refusal(NamedTuple):
    """Why a worker does not take a job planned for another stack, and where its message goes instead."""

    said: str
    resend_to: str | None = None  # the job's own queue: send its message there (None: nothing to send)


def refuse_other_stack(session: Session, job_id: int, served: Stack, queue: str, settings: Settings) -> Refusal | None:
    """None when the job is planned for ``served``, the stack of the worker consuming ``queue`` (or is past its
    accelerator stage, or gone: the claim says so); else why that worker must not run it, and what becomes of
    it: never a silent drop, never a stuck job.

    A job that still waits for a stage and has a queue of its own elsewhere is sent there: the delivery that met the
    wrong worker ends, and its queue's workers take it. One planned for another stack whose own queue is this one (a
    stack whose digest collides, or a row a migration did not rename) can never be served by it: while queued and
    unleased, or running under a lease that lapsed (its holder is gone, and every delivery would meet this refusal
    again, its attempts never growing), it ends now ERROR(no_worker), saying which stack it was planned for and
    which the queue serves. Only a live lease is left to its holder.
    """
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or job.state not in (JobState.queued, JobState.running):  # past the accelerator stage, or gone
        return None
    planned = stack_of(job)
    if planned == served:
        return None
    mismatch = f"job {job_id} is planned for {planned.label()}; {queue} serves {served.label()}"
    if job.queue != queue:
        return Refusal(f"{mismatch}: sent to its own queue {job.queue}", resend_to=job.queue)
    stale = utcnow() - dt.timedelta(seconds=settings.lease_timeout_s)
    unleased = job.state == JobState.queued and job.lease_owner is None
    lapsed = job.state == JobState.running and (job.heartbeat_at is None or job.heartbeat_at < stale)
    if unleased or lapsed:
        message = f"{mismatch}, and it is the job's own queue: no worker there runs its stack"
        close_unattended(session, job, job_report(job, Verdict.ERROR, ErrorClass.no_worker, message))
        return Refusal(f"{mismatch}: ended ERROR({ErrorClass.no_worker.value})")
    return Refusal(f"{mismatch}: left to its lease holder {job.lease_owner}")


def refuse_other_test(job: Job, settings: Settings) -> str | None:
    """Why a worker whose settings are ``settings`` must not run a stage of ``job``, or None: the settings that decide
    its verdict (the judge, the MoE split: ``shared.settings.VERDICT_SETTINGS``) or its test config hash to another test
    than the one the API planned, so that the row would say one test and hold another's verdict. Every worker of a
    queue reads one configuration with the API (a ConfigMap, compose's environment), so this is a deployment out of
    step, which a retry elsewhere would not mend: the caller ends the job ERROR(internal) with this reason."""
    runs = planned_config_hash(job.task, job.cores, settings)
    if runs == job.config_hash:
        return None
    values = ", ".join(f"{name}={getattr(settings, name)}" for name in VERDICT_SETTINGS)
    return (
        f"the service is configured out of step: job {job.id} was planned as test {job.config_hash}, and this worker's "
        f"settings ({values}, with this code's test config) make it test {runs}; the API and every worker must share "
        "the settings that decide a verdict"
    )

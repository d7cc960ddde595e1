"""The lease of a job's two stages: single execution as a SQL invariant.

A worker runs a stage only after an UPDATE that moves the job from the stage's waiting state (or a stale lease)
to its running state under the worker's own name, so a second delivery of a running or finished job does nothing.
The lease is kept by heartbeats; a lapsed one may be taken over, up to ``max_attempts`` deliveries.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from enum import StrEnum

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, JobState, Stage, Verdict
from shared.db.models import Job, utcnow
from shared.jobs.attempts import Attempt, end_attempts, end_job_attempt
from shared.jobs.outcomes import close_unattended, job_report
from shared.settings import Settings


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
        end_attempts(job, lost, Attempt(stage=stage, owner=owner, started_at=now))
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
        end_job_attempt(session, job_id, "done: released its cores for the verdict stage")
    return released

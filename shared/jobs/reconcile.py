"""The reconciler's rules: SQL is the truth, the broker only a delivery.

A message can be lost (Redis restarted without persistence, a worker killed outright, an enqueue that failed
after its commit) or never consumed (a queue nobody serves). The reconciler — one instance, run on the locked
beat scheduler every ``reconcile_every_s`` — finds the jobs and sweeps that no message will ever move and
says what to re-send. A duplicate would be harmless (the lease decides who runs), but during a long backlog
re-sending every waiting job each period would grow the queues by the backlog every period: so a job is sent
again only when the broker holds no message of it (``Deliveries``) — none waiting, and none taken by a live
worker (one taken longer ago than the lease timeout and still unacknowledged was taken by a worker that died).
A job whose lease lapsed is sent again unless a copy is already waiting: its own message is the dead owner's.
What no worker will ever take ends ERROR(no_worker) with the queue's name.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, JobState, Stage, SweepState, Verdict
from shared.contracts.run import RuntimeInfo
from shared.db.engine import rows_changed
from shared.db.models import Job, QueueSeen, Sweep, utcnow
from shared.jobs.outcomes import close_unattended, job_report
from shared.jobs.queues import Deliveries, celery_task_id, verdict_task_id
from shared.settings import Settings


@dataclass(frozen=True)
class Resend:
    job_id: int
    queue: str
    stage: Stage


@dataclass
class Reconciled:
    resend: list[Resend] = field(default_factory=list)
    no_worker: list[int] = field(default_factory=list)  # jobs ended ERROR(no_worker)
    sweeps: list[int] = field(default_factory=list)  # sweeps to send again

    def summary(self) -> str:
        stages = [r.stage.value for r in self.resend]
        return (
            f"re-sent {stages.count('accelerator')} accelerator and {stages.count('verdict')} verdict stages, "
            f"{len(self.sweeps)} sweeps; {len(self.no_worker)} jobs ended ERROR(no_worker)"
        )


def mark_queue_live(
    session: Session, queue: str, now: dt.datetime | None = None, runtime: RuntimeInfo | None = None
) -> None:
    """A live worker consumes ``queue`` (called from every worker's heartbeat); a core-group worker says, as it
    starts, the runtime it serves there (``shared.jobs.runtimes.last_served_runtimes`` plans for it once no worker
    is live)."""
    now = now or utcnow()
    served = {"runtime": runtime.model_dump(mode="json")} if runtime is not None else {}
    seen = sa.update(QueueSeen).where(QueueSeen.queue == queue).values(last_live_at=now, **served)
    if not rows_changed(session, seen):
        session.merge(QueueSeen(queue=queue, last_live_at=now, **served))


def reconcile(
    session: Session,
    settings: Settings,
    deliveries: Callable[[Collection[str]], Deliveries] | None = None,
    now: dt.datetime | None = None,
) -> Reconciled:
    """What to re-send, and the jobs no worker will take (ended here, in the caller's transaction).
    ``deliveries`` reads what the broker holds for some queues; without it, every job found is re-sent."""
    now = now or utcnow()
    stale = now - dt.timedelta(seconds=settings.lease_timeout_s)
    grace = now - dt.timedelta(seconds=settings.queue_grace_s)
    out = Reconciled()
    seen = dict(session.execute(sa.select(QueueSeen.queue, QueueSeen.last_live_at)).tuples().all())
    lapsed = sa.and_(Job.lease_owner.is_not(None), Job.heartbeat_at < stale)
    last_sent = sa.func.coalesce(Job.enqueued_at, Job.judging_at, Job.created_at)
    waiting = sa.or_(
        sa.and_(Job.state == JobState.queued, last_sent < grace),
        sa.and_(Job.state == JobState.running, lapsed),
        sa.and_(Job.state == JobState.judging, Job.lease_owner.is_(None), last_sent < grace),
        sa.and_(Job.state == JobState.judging, lapsed),
    )
    candidates: list[tuple[Resend, bool]] = []  # and whether its lease lapsed
    for job in session.scalars(sa.select(Job).where(waiting).order_by(Job.id)):
        stage = Stage.verdict if job.state == JobState.judging else Stage.accelerator
        queue = job.verdict_queue if stage == Stage.verdict else job.queue
        assert queue is not None
        # A job cannot go unserved before it (or its verdict stage) existed: a queue last live long ago — a fleet
        # scaled to zero, whose next node KEDA is starting — counts from the job's own start, not from then.
        began = (job.judging_at if stage == Stage.verdict else None) or job.created_at
        since = max(seen.get(queue) or began, began)
        unserved = (now - since).total_seconds()
        if unserved > settings.no_worker_after_s:
            reason = (
                f"no live worker has served {queue} for {unserved:.0f} s (SUPPORTMATRIX_NO_WORKER_AFTER_S="
                f"{settings.no_worker_after_s:g}); the {stage.value} stage was never taken"
            )
            if close_unattended(session, job, job_report(job, Verdict.ERROR, ErrorClass.no_worker, reason)):
                out.no_worker.append(job.id)
            continue
        candidates.append((Resend(job.id, queue, stage), job.lease_owner is not None))
    held = deliveries({r.queue for r, _ in candidates}) if deliveries and candidates else Deliveries()
    for resend, owner_lapsed in candidates:
        task_id = (verdict_task_id if resend.stage == Stage.verdict else celery_task_id)(resend.job_id)
        if task_id in held.waiting or (not owner_lapsed and held.holds(task_id, settings.lease_timeout_s)):
            continue
        out.resend.append(resend)
    if out.resend:
        resent = sa.update(Job).where(Job.id.in_([r.job_id for r in out.resend]))
        session.execute(resent.values(enqueued_at=now, resends=Job.resends + 1))
    sweep_stale = now - dt.timedelta(seconds=settings.sweep_lease_s)
    handed_back = sa.func.coalesce(Sweep.claimed_at, Sweep.created_at)  # a retry's hand-back counts from then
    out.sweeps = list(
        session.scalars(
            sa.select(Sweep.id).where(
                sa.or_(
                    sa.and_(Sweep.state == SweepState.queued, handed_back < grace),
                    sa.and_(Sweep.state == SweepState.running, Sweep.claimed_at < sweep_stale),
                )
            )
        )
    )
    return out


def claim_sweep(session: Session, sweep_id: int, settings: Settings) -> bool:
    """Take a sweep to run it: a queued one, or a running one whose claim is older than the sweep lease.
    Every claim counts, whoever delivered it (a retry, the reconciler), so the retries of a sweep are capped
    in SQL."""
    now = utcnow()
    stale = now - dt.timedelta(seconds=settings.sweep_lease_s)
    takeable = sa.or_(
        Sweep.state == SweepState.queued, sa.and_(Sweep.state == SweepState.running, Sweep.claimed_at < stale)
    )
    return bool(
        rows_changed(
            session,
            sa.update(Sweep)
            .where(Sweep.id == sweep_id, takeable)
            .values(state=SweepState.running, claimed_at=now, attempts=Sweep.attempts + 1)
            .execution_options(synchronize_session=False),
        )
    )

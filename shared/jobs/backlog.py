"""What the host launcher plans from, read from SQL in one session: the queued jobs per group size, the running
jobs and their lease owners, the hosts with a live worker, and how long recent accelerator stages took."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import JobState
from shared.db.models import Job, Worker


@dataclass(frozen=True)
class Queued:
    cores: int
    jobs: int
    oldest: dt.datetime  # the oldest queued job's submission


@dataclass(frozen=True)
class BacklogFacts:
    queued: list[Queued]  # per group size, all hosts
    running: list[tuple[int, str | None]]  # (cores, lease owner) of every running job
    live_hosts: set[str]
    stage_seconds: list[tuple[int, float]]  # (cores, accelerator-stage seconds) of the most recent jobs, newest first


def backlog_facts(session: Session, backend: str, live_since: dt.datetime, recent: int) -> BacklogFacts:
    """The facts of ``backend``'s backlog: four queries, each over the jobs index of its state."""
    queued = session.execute(
        sa.select(Job.cores, sa.func.count(), sa.func.min(Job.created_at))
        .where(Job.backend == backend, Job.state == JobState.queued)
        .group_by(Job.cores)
    ).all()
    running = session.execute(
        sa.select(Job.cores, Job.lease_owner).where(Job.backend == backend, Job.state == JobState.running)
    ).all()
    live = set(session.scalars(sa.select(Worker.host).where(Worker.heartbeat_at >= live_since).distinct()).all())
    # Rows with both times: the WHERE leaves neither NULL.
    stages = cast(
        Sequence[tuple[int, dt.datetime, dt.datetime]],
        session.execute(
            sa.select(Job.cores, Job.started_at, Job.judging_at)
            .where(
                Job.backend == backend,
                Job.state.in_((JobState.judging, JobState.done, JobState.failed)),
                Job.started_at.is_not(None),
                Job.judging_at.is_not(None),
            )
            .order_by(Job.id.desc())
            .limit(recent)
        ).all(),
    )
    return BacklogFacts(
        queued=[Queued(int(cores), int(n), oldest) for cores, n, oldest in queued],
        running=[(int(cores), owner) for cores, owner in running],
        live_hosts=live,
        stage_seconds=[(int(cores), (judging - started).total_seconds()) for cores, started, judging in stages],
    )

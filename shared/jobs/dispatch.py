"""Commit, then send, then undo if the broker fails: one unit of work for the API, sweeps and reruns.

A message must never reach a worker before its row does, so rows are committed first; and nothing is kept
that no worker will ever be told about, so a broker that refuses the messages takes the rows back out.
"""

from __future__ import annotations

import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from shared.db.models import Job, Result, Sweep
from shared.jobs.broker import BROKER_ERRORS, enqueue_job, request_sweep
from shared.jobs.submission import Submitted


class QueueUnavailable(RuntimeError):
    """The broker refused a message; what the message was about was taken back. The text says why."""


def commit_and_enqueue(
    session: Session, producer: Celery, submitted: list[Submitted], *, keep_on_broker_failure: bool = False
) -> None:
    """Commit the submission, then enqueue each job that waits for a worker.

    When the broker fails, the jobs this submission created (settled ones included) are withdrawn and
    committed, and QueueUnavailable is raised: the submission keeps nothing, and its caller (a person at the
    API) can try again. Jobs that already existed stay. A sweep keeps them instead
    (``keep_on_broker_failure``): nobody waits on it, and the reconciler sends queued jobs that no message
    moves once the broker is back.
    """
    session.commit()
    try:
        for s in submitted:
            if s.enqueue:
                enqueue_job(producer, s.job.id, s.job.queue)
    except BROKER_ERRORS as exc:
        if not keep_on_broker_failure:
            withdraw(session, [s.job.id for s in submitted if s.created])
            session.commit()
        raise QueueUnavailable(str(exc)) from exc


def commit_and_request_sweep(session: Session, producer: Celery, sweep: Sweep) -> None:
    """Commit the opened sweep, then ask a control worker to run it; a sweep no worker will run is deleted."""
    session.commit()
    try:
        request_sweep(producer, sweep.id)
    except BROKER_ERRORS as exc:
        session.delete(sweep)
        session.commit()
        raise QueueUnavailable(str(exc)) from exc


def withdraw(session: Session, job_ids: list[int]) -> None:
    """Remove the jobs (and any result settled at submission) of a submission that could not be enqueued."""
    if job_ids:
        session.execute(sa.delete(Result).where(Result.job_id.in_(job_ids)))
        session.execute(sa.delete(Job).where(Job.id.in_(job_ids)))

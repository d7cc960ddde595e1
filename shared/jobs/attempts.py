"""A job's attempt log: every delivery that took its lease, and how each ended (what ERROR(worker_lost) lists)."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel
from sqlalchemy.orm import Session

from shared.contracts.enums import Stage
from shared.db.models import Job


class Attempt(BaseModel):
    """One delivery that took a job's lease, as the job's ``attempt_log`` keeps it."""

    stage: Stage
    owner: str
    started_at: dt.datetime
    ended: str | None = None  # how it ended; None while it runs


def attempts(job: Job) -> list[Attempt]:
    return [Attempt.model_validate(a) for a in job.attempt_log or []]


def end_attempts(job: Job, how: str, new: Attempt | None = None) -> list[Attempt]:
    """Close the job's open attempt with ``how`` (and open ``new``); returns the whole log."""
    log = attempts(job)
    for attempt in log:
        if attempt.ended is None:
            attempt.ended = how
    log += [new] if new else []
    job.attempt_log = [a.model_dump(mode="json") for a in log]
    return log


def end_job_attempt(session: Session, job_id: int, how: str) -> None:
    job = session.get(Job, job_id, populate_existing=True)
    assert job is not None
    end_attempts(job, how)
    session.flush()

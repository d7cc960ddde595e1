"""/jobs: submit a model, follow its jobs, cancel one."""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Annotated

from celery import Celery
from fastapi import APIRouter, HTTPException, Query, Response, status
from sqlalchemy.orm import Session

from services.api.deps import HubPoolDep, ProducerDep, SessionDep, SettingsDep, SubmitterDep
from services.api.errors import forbidden, unavailable
from services.api.hub_pool import PoolBusy
from services.api.schemas import (
    Cursor,
    JobCreate,
    JobOut,
    JobPage,
    JobsSubmitted,
    ModelId,
    RowId,
    SubmittedJob,
    error_responses,
)
from shared.contracts.enums import JobState, Scope
from shared.db.models import Job
from shared.hub.client import HubUnavailable, ModelNotFound, RevisionNotFound
from shared.jobs import listing
from shared.jobs.broker import revoke_job
from shared.jobs.dispatch import BROKER_ERRORS, QueueUnavailable, commit_and_enqueue
from shared.jobs.outcomes import JobFinished, JobNotFound, NotYourJob, cancel
from shared.jobs.runtimes import NoRuntime, UnknownCompiler
from shared.jobs.submission import Request, UnsupportedTask, submit_model
from shared.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.post(
    "",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobsSubmitted,
    responses={
        200: {"model": JobsSubmitted, "description": "Identical jobs already existed; nothing was enqueued"},
        **error_responses(400, 401, 403, 404, 413, 422, 429, 503),
    },
)
async def submit_jobs(
    body: JobCreate,
    caller: SubmitterDep,
    session: SessionDep,
    settings: SettingsDep,
    producer: ProducerDep,
    pool: HubPoolDep,
    response: Response,
) -> JobsSubmitted:
    """One job per compiler version: 202 when any was created, 200 when all already existed. Needs a token of
    scope submit; `force` needs admin."""
    if body.force and not caller.may(Scope.admin):
        raise forbidden(Scope.admin, "force")
    # The submission asks the Hub (up to three calls): it runs in the Hub pool, never in the shared threads.
    try:
        request = Request(**body.model_dump(), submitted_by=caller.name)
        submitted = await pool.run(partial(_submit, session, settings, producer, request))
    except PoolBusy as exc:
        raise unavailable(f"too many submissions are waiting on the Hub ({exc}); retry later") from exc
    if not any(job.created for job in submitted.jobs):
        response.status_code = status.HTTP_200_OK
    return submitted


def _submit(session: Session, settings: Settings, producer: Celery, request: Request) -> JobsSubmitted:
    """The blocking part of a submission, database included, so that none of it runs on the event loop."""
    try:
        submitted = submit_model(session, settings, request)
    except (ModelNotFound, RevisionNotFound) as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
    except (UnknownCompiler, UnsupportedTask) as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    except (HubUnavailable, NoRuntime) as exc:
        raise unavailable(str(exc)) from exc
    try:
        commit_and_enqueue(session, producer, submitted)
    except QueueUnavailable as exc:
        log.warning("submission refused, the job queue is unavailable: %s", exc)
        raise unavailable("the job queue is unavailable, nothing was submitted") from exc
    return JobsSubmitted(
        jobs=[SubmittedJob(**JobOut.model_validate(s.job).model_dump(), created=s.created) for s in submitted]
    )


@router.get("", response_model=JobPage, responses=error_responses(422, 503))
def list_jobs(
    session: SessionDep,
    settings: SettingsDep,
    state: JobState | None = None,
    model_id: Annotated[ModelId | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Cursor = None,
) -> JobPage:
    """Newest first."""
    limit = min(limit, settings.page_limit_max)
    items = listing.list_jobs(session, state=state, model_id=model_id, before_id=cursor, limit=limit)
    next_cursor = str(items[-1].id) if len(items) == limit else None
    return JobPage(items=[JobOut.model_validate(j) for j in items], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut, responses=error_responses(404, 422, 503))
def get_job(job_id: RowId, session: SessionDep) -> JobOut:
    job = session.get(Job, job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} does not exist")
    return JobOut.model_validate(job)


@router.delete("/{job_id}", response_model=JobOut, responses=error_responses(401, 403, 404, 409, 422, 429, 503))
def cancel_job(job_id: RowId, caller: SubmitterDep, session: SessionDep, producer: ProducerDep) -> JobOut:
    """Cancel a queued job, or stop a running one: its worker kills the runner within a heartbeat. A token of
    scope submit cancels the jobs it submitted (403 for another's); one of scope admin cancels any."""
    try:
        job = cancel(session, job_id, by=caller.name, any_job=caller.may(Scope.admin))
    except JobNotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
    except NotYourJob as exc:
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from exc
    except JobFinished as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    session.commit()
    # Best effort: the SQL state already stops it, since a delivered message finds the job cancelled.
    with contextlib.suppress(*BROKER_ERRORS):
        revoke_job(producer, job_id)
    return JobOut.model_validate(job)

"""/sweeps: start a sweep of the Hub now, and follow it."""

from __future__ import annotations

import logging

from fastapi import APIRouter, HTTPException, status

from services.api.deps import AdminDep, ProducerDep, SessionDep, SettingsDep
from services.api.errors import unavailable
from services.api.schemas import RowId, error_responses
from shared.db.models import Sweep
from shared.jobs.dispatch import QueueUnavailable, commit_and_request_sweep
from shared.jobs.sweeps import SweepOut, open_sweep, progress

log = logging.getLogger(__name__)
router = APIRouter(prefix="/sweeps", tags=["sweeps"])


@router.post(
    "",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=SweepOut,
    responses=error_responses(401, 403, 429, 503),
)
def start_sweep(caller: AdminDep, session: SessionDep, settings: SettingsDep, producer: ProducerDep) -> SweepOut:
    """Sweep now: per configured task, the trending and most-downloaded models and the pinned selection. Needs a
    token of scope admin."""
    sweep = open_sweep(session, settings, "api", submitted_by=caller.name)
    assert sweep is not None  # only scheduled sweeps have a slot that can collide
    try:
        commit_and_request_sweep(session, producer, sweep)
    except QueueUnavailable as exc:
        log.warning("sweep refused, the job queue is unavailable: %s", exc)
        raise unavailable("the job queue is unavailable, no sweep was started") from exc
    return progress(session, sweep)


@router.get("/{sweep_id}", response_model=SweepOut, responses=error_responses(404, 422, 503))
def get_sweep(sweep_id: RowId, session: SessionDep) -> SweepOut:
    """Progress: entries (model, task, view, rank, job), and the jobs by state and verdict."""
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"sweep {sweep_id} does not exist")
    return progress(session, sweep)

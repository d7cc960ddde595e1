"""/sweeps: start a sweep of the Hub now, and follow it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, status
from kombu.exceptions import OperationalError as BrokerError
from redis.exceptions import RedisError

from services.api.deps import ProducerDep, SessionDep, SettingsDep
from services.api.schemas import error_responses
from shared.db.models import Sweep
from shared.jobs.queues import CONTROL_QUEUE, SWEEP_TASK
from shared.jobs.sweeps import open_sweep, progress

router = APIRouter(prefix="/sweeps", tags=["sweeps"])


@router.post("", status_code=status.HTTP_202_ACCEPTED, responses=error_responses(503))
def start_sweep(session: SessionDep, settings: SettingsDep, producer: ProducerDep) -> dict[str, Any]:
    """Sweep now: per configured task, the trending and most-downloaded models and the pinned selection."""
    sweep = open_sweep(session, settings, "api")
    assert sweep is not None  # only scheduled sweeps have a slot that can collide
    session.commit()
    try:
        producer.send_task(SWEEP_TASK, args=[sweep.id], queue=CONTROL_QUEUE)
    except (BrokerError, RedisError, OSError) as exc:
        session.delete(sweep)
        session.commit()
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the job queue is unavailable: {exc}") from exc
    return progress(session, sweep)


@router.get("/{sweep_id}", responses=error_responses(404, 422, 503))
def get_sweep(sweep_id: int, session: SessionDep) -> dict[str, Any]:
    """Progress: entries (model, task, view, rank, job), and the jobs by state and verdict."""
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"sweep {sweep_id} does not exist")
    return progress(session, sweep)

"""/workers: the live workers, and so the compiler versions this service can test with now."""

from __future__ import annotations

from fastapi import APIRouter

from services.api.deps import SessionDep, SettingsDep
from services.api.schemas import WorkerOut, error_responses
from shared.jobs.runtimes import live_workers

router = APIRouter(prefix="/workers", tags=["workers"])


@router.get("", response_model=list[WorkerOut], responses=error_responses(503))
def list_workers(session: SessionDep, settings: SettingsDep) -> list[WorkerOut]:
    """Workers whose heartbeat is recent, by name."""
    return [WorkerOut.model_validate(w) for w in live_workers(session, settings)]

"""/healthz: is the database reachable, is Redis reachable."""

from __future__ import annotations

import redis
import sqlalchemy as sa
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from services.api.deps import SessionDep, SettingsDep

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    responses={
        200: {"description": "Database and Redis answer", "content": {"application/json": {}}},
        503: {"description": "One of them does not; the body says which, and the class of its error"},
    },
)
def healthz(session: SessionDep, settings: SettingsDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        session.execute(sa.text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = _failure(exc)
    try:
        client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
        client.ping()
        client.close()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = _failure(exc)
    healthy = all(v == "ok" for v in checks.values())
    return JSONResponse(checks, status_code=200 if healthy else 503)


def _failure(exc: Exception) -> str:
    # The class only: the error's text names hosts, users and databases, which a public route must not tell.
    return f"unavailable ({type(exc).__name__})"

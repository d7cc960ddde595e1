"""Jobs as the API lists them."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import JobState
from shared.db.models import Job


def list_jobs(
    session: Session,
    *,
    state: JobState | None = None,
    model_id: str | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> list[Job]:
    """Newest first; ``before_id`` is the cursor (the last id of the previous page)."""
    stmt = sa.select(Job).order_by(Job.id.desc()).limit(limit)
    if state is not None:
        stmt = stmt.where(Job.state == state)
    if model_id is not None:
        stmt = stmt.where(Job.model_id == model_id)
    if before_id is not None:
        stmt = stmt.where(Job.id < before_id)
    return list(session.scalars(stmt))

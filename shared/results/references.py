"""The CPU reference computed once: stored in SQL, reused across compiler versions and reruns.

The worker looks a job's reference up before its verdict stage and hands it to the runner as a file; it
stores the one a verdict stage computed. The runner never opens the database.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.contracts.handoffs import StoredReference
from shared.db.models import ReferenceRun
from shared.testconfig import config_hash


def load(session: Session, key: str) -> tuple[StoredReference, bytes | None] | None:
    """The stored reference and its prefill logits (a .npy file's bytes), or None."""
    row = session.get(ReferenceRun, key)
    if row is None:
        return None
    return StoredReference.model_validate(row, from_attributes=True), row.blob


def store(session: Session, reference: StoredReference, blob: bytes | None) -> None:
    """Keep a reference; a concurrent run that stored the same one first wins (they are equal)."""
    try:
        with session.begin_nested():
            session.add(ReferenceRun(**reference.model_dump(), config_hash=config_hash(reference.task), blob=blob))
    except IntegrityError:
        pass


def count(session: Session, model_id: str | None = None) -> int:
    stmt = sa.select(sa.func.count()).select_from(ReferenceRun)
    if model_id is not None:
        stmt = stmt.where(ReferenceRun.model_id == model_id)
    return int(session.scalar(stmt) or 0)

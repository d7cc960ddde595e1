"""The CPU reference computed once: stored in SQL, reused across compiler versions and reruns.

The worker looks a job's reference up before its verdict stage and hands it to the runner as a file; it
stores the one a verdict stage computed. The runner never opens the database.
"""

from __future__ import annotations

from typing import Any

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


def same_run(stored: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether two references' data are the same run's: the same 32 tokens, and the same long tokens where both have
    them. Only then may one complete the other: a reference whose tokens differ (another runner's, a nondeterministic
    kernel's) is another run, and its data beside the stored prefill logits would describe neither."""
    if stored.get("token_ids") != new.get("token_ids"):
        return False
    long = stored.get("long_token_ids"), new.get("long_token_ids")
    return None in long or long[0] == long[1]


def store(session: Session, reference: StoredReference, blob: bytes | None) -> None:
    """Keep a reference; a concurrent run that stored the same one first wins (they are equal). One stored without
    something this one holds (the long generation's tokens and log-probs, from a run with the tiers off; a MoE's
    routing, from an older runner) takes what it lacks from this one, where both are the same run (``same_run``):
    the same reference, more of it, so that the next run reuses it instead of running the model again for what it
    lacks. What the stored one holds stays as it is, beside its own prefill logits."""
    try:
        with session.begin_nested():
            session.add(ReferenceRun(**reference.model_dump(), config_hash=config_hash(reference.task), blob=blob))
    except IntegrityError:
        row = session.get(ReferenceRun, reference.key, with_for_update=True)
        if row is None or not same_run(row.data, reference.data):
            return
        if any(v is not None and row.data.get(k) is None for k, v in reference.data.items()):
            missing = {k: v for k, v in reference.data.items() if row.data.get(k) is None}
            row.data = {**row.data, **missing}


def count(session: Session, model_id: str | None = None) -> int:
    stmt = sa.select(sa.func.count()).select_from(ReferenceRun)
    if model_id is not None:
        stmt = stmt.where(ReferenceRun.model_id == model_id)
    return int(session.scalar(stmt) or 0)

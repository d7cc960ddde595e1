"""The CPU reference computed once: stored in SQL, reused across compiler versions and reruns."""

from __future__ import annotations

import hashlib
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.db.models import ReferenceRun
from shared.testconfig import config_hash


def reference_key(model_id: str, sha: str, task: str, dtype: str, library_version: str, torch_version: str) -> str:
    parts = [model_id, sha, task, config_hash(task), dtype, library_version, torch_version]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def load(session: Session, key: str) -> ReferenceRun | None:
    return session.get(ReferenceRun, key)


def store(session: Session, key: str, identity: dict[str, str], data: dict[str, Any], blob: bytes | None) -> None:
    """Keep a reference; a concurrent run that stored the same one first wins (they are equal)."""
    try:
        with session.begin_nested():
            session.add(ReferenceRun(key=key, config_hash=config_hash(identity["task"]), data=data, blob=blob,
                                     **identity))  # fmt: skip
    except IntegrityError:
        pass


def count(session: Session, model_id: str | None = None) -> int:
    stmt = sa.select(sa.func.count()).select_from(ReferenceRun)
    if model_id is not None:
        stmt = stmt.where(ReferenceRun.model_id == model_id)
    return int(session.scalar(stmt) or 0)

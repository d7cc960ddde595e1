"""Failure groups: ERROR and FAIL rows grouped by their failure signature, so that one cause reads as one line.

Forty models failing for one reason are one group: how often, since when, under which compiler versions,
a few of the models, and whether the cause is new in a compiler version. Signatures are computed when a
row is written (``shared/results/signatures.py``); this reads them with two grouped queries on the
indexed ``results.signature_id``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, Task, Verdict
from shared.db.models import Job, Result
from shared.results.cells import version_key

EXAMPLES = 3  # models shown per group


class FailureGroup(BaseModel):
    """The rows that failed of one cause."""

    signature_id: str = Field(description="A digest of the signature; rows are grouped by it.")
    signature: str = Field(
        description="`ERROR(class): Type: message @ module:function` or `FAIL: reason`, with the model's id, "
        "numbers, addresses, ids and paths replaced by placeholders."
    )
    verdict: Verdict
    error_class: ErrorClass | None
    count: int = Field(description="Rows with this signature (under the compiler asked for, if any).")
    first_seen: dt.datetime
    last_seen: dt.datetime
    compiler_versions: list[str] = Field(description="Every compiler version it failed under, oldest first.")
    example_models: list[str] = Field(description=f"Up to {EXAMPLES} of its models, the latest first.")
    new_in: str = Field(description="The oldest compiler version it failed under.")
    new: bool | None = Field(
        description="With `compiler`: it fails under that version and under no older one. Null without it."
    )


def failure_groups(session: Session, compiler: str | None, task: Task | None) -> list[FailureGroup]:
    """One group per signature, from one row per (signature, compiler version) and a few example models."""
    signed: list[sa.ColumnElement[bool]] = [Result.signature_id.is_not(None)]
    if task is not None:
        signed.append(Job.task == task.value)
    per_version = session.execute(
        sa.select(
            Result.signature_id.label("id"),
            Job.compiler_version.label("version"),
            sa.func.count().label("count"),
            sa.func.min(Result.created_at).label("first"),
            sa.func.max(Result.created_at).label("last"),
            sa.func.min(Result.failure_signature).label("text"),
            sa.func.min(Result.verdict).label("verdict"),
            sa.func.min(Result.error_class).label("error_class"),
        )
        .join(Job, Job.id == Result.job_id)
        .where(*signed)
        .group_by(Result.signature_id, Job.compiler_version)
    ).all()
    by_signature: dict[str, list[sa.Row[*tuple[Any, ...]]]] = {}
    for row in per_version:
        by_signature.setdefault(row.id, []).append(row)
    examples = _example_models(session, signed, compiler)
    groups = []
    for signature_id, rows in by_signature.items():
        versions = sorted({r.version for r in rows}, key=version_key)
        counted = [r for r in rows if compiler is None or r.version == compiler]
        if not counted:
            continue
        groups.append(
            FailureGroup(
                signature_id=signature_id,
                signature=rows[0].text,
                verdict=rows[0].verdict,
                error_class=rows[0].error_class,
                count=sum(r.count for r in counted),
                first_seen=min(r.first for r in counted),
                last_seen=max(r.last for r in counted),
                compiler_versions=versions,
                example_models=examples.get(signature_id, []),
                new_in=versions[0],
                new=None if compiler is None else versions[0] == compiler,
            )
        )
    groups.sort(key=lambda g: g.signature_id)
    groups.sort(key=lambda g: g.last_seen, reverse=True)
    groups.sort(key=lambda g: g.count, reverse=True)  # stable: most rows first, then the latest seen
    return groups


def _example_models(
    session: Session, signed: Sequence[sa.ColumnElement[bool]], compiler: str | None
) -> dict[str, list[str]]:
    """Up to EXAMPLES distinct models per signature, the latest failure first."""
    where = [*signed, *([Job.compiler_version == compiler] if compiler is not None else [])]
    latest = (
        sa.select(Result.signature_id, Job.model_id, sa.func.max(Result.created_at).label("at"))
        .join(Job, Job.id == Result.job_id)
        .where(*where)
        .group_by(Result.signature_id, Job.model_id)
        .subquery()
    )
    rank = sa.func.row_number().over(
        partition_by=latest.c.signature_id, order_by=(latest.c.at.desc(), latest.c.model_id)
    )
    ranked = sa.select(latest.c.signature_id, latest.c.model_id, rank.label("n")).subquery()
    out: dict[str, list[str]] = {}
    query = sa.select(ranked.c.signature_id, ranked.c.model_id).where(ranked.c.n <= EXAMPLES).order_by(ranked.c.n)
    for signature_id, model_id in session.execute(query):
        out.setdefault(signature_id, []).append(model_id)
    return out

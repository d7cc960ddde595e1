"""Cells of the support matrix and how they change between versions.

A cell is one model and task under one compiler version and one library version. Its status comes from
all finished runs of the model's newest tested commit in that cell: the runs' common verdict, or FLAKY
when repeated runs disagree (a PASS and a FAIL of the same code is not a PASS). Runs settled at
submission (SKIPPED) count like any other.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise
from typing import Literal

import sqlalchemy as sa
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from shared.db.models import Job, Result


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Orders versions by their numbers: ``2.9.1`` before ``2.21.0``, ``inductor-2.13.0`` by 2, 13, 0."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", version) if p)


class CellStatus(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    ERROR = "ERROR"
    SKIPPED = "SKIPPED"
    FLAKY = "FLAKY"


GOOD = {CellStatus.PASS}
BAD = {CellStatus.FAIL, CellStatus.ERROR}


def cell_status(verdicts: Iterable[str]) -> CellStatus:
    seen = set(verdicts)
    if not seen:
        raise ValueError("a cell needs at least one run")
    return CellStatus(seen.pop()) if len(seen) == 1 else CellStatus.FLAKY


def flips(verdicts: Sequence[str]) -> int:
    """How many times consecutive runs (oldest first) changed verdict: the sweep's rerun criterion."""
    return sum(1 for a, b in pairwise(verdicts) if a != b)


@dataclass(frozen=True)
class Cell:
    model_id: str
    task: str
    compiler_version: str
    library_version: str
    sha: str
    status: CellStatus
    runs: int
    flips: int
    tokens_per_s: float | None = None  # the median decode rate of its PASS runs (the performance tier)


def cells(session: Session, *, compiler: str | None = None, library_version: str | None = None) -> list[Cell]:
    stmt = (
        sa.select(
            Job.model_id,
            Job.task,
            Job.compiler_version,
            Job.library_version,
            Job.sha,
            Result.verdict,
            Result.decode_tokens_per_s,
        )
        .join(Result, Result.job_id == Job.id)
        .order_by(Job.id)
    )
    if compiler is not None:
        stmt = stmt.where(Job.compiler_version == compiler)
    if library_version is not None:
        stmt = stmt.where(Job.library_version == library_version)
    runs: dict[tuple[str, str, str, str], tuple[str, list[str], list[float]]] = {}
    for model_id, task, comp, lib, sha, verdict, rate in session.execute(stmt):
        key = (model_id, task, comp, lib)
        current = runs.get(key)
        if current is None or current[0] != sha:  # a newer commit starts the cell afresh
            current = runs[key] = (sha, [], [])
        current[1].append(verdict.value)
        if rate is not None:
            current[2].append(rate)
    return [
        Cell(
            *key,
            sha=sha,
            status=cell_status(verdicts),
            runs=len(verdicts),
            flips=flips(verdicts),
            tokens_per_s=statistics.median(rates) if rates else None,
        )
        for key, (sha, verdicts, rates) in sorted(runs.items())
    ]


class CellChange(BaseModel):
    """A cell whose status differs between the two versions of a diff."""

    model_id: str
    task: str
    from_status: CellStatus = Field(serialization_alias="from")
    to_status: CellStatus = Field(serialization_alias="to")
    from_sha: str
    to_sha: str


class SpeedChange(BaseModel):
    """A cell that decodes slower under the newer version, past the noise band."""

    model_id: str
    task: str
    from_tokens_per_s: float
    to_tokens_per_s: float
    ratio: float = Field(description="The newer rate over the older one.")


# A cell whose decode rate falls by more than this fraction between two versions regressed in speed. Repeated timed
# runs of one model on one machine spread by less (bench/tiers.py measures it); a trn2 fleet's rows may say more.
THROUGHPUT_NOISE_BAND = 0.15

# What a diff compares: compiler versions, or library (transformers) versions.
Axis = Literal["compiler", "library"]


class CellDiff(BaseModel):
    axis: Axis
    from_version: str = Field(serialization_alias="from", description="The older version.")
    to_version: str = Field(serialization_alias="to", description="The newer version.")
    regressed: list[CellChange] = Field(default_factory=list, description="PASS, then FAIL or ERROR")
    fixed: list[CellChange] = Field(default_factory=list, description="FAIL or ERROR, then PASS")
    flaky: list[CellChange] = Field(default_factory=list, description="FLAKY on either side")
    changed: list[CellChange] = Field(default_factory=list, description="any other change, e.g. SKIPPED to FAIL")
    slower: list[SpeedChange] = Field(
        default_factory=list,
        description=f"decodes more than {THROUGHPUT_NOISE_BAND:.0%} slower (PASS runs' median tokens per second)",
    )


def diff(session: Session, axis: Axis, from_version: str, to_version: str) -> CellDiff:
    """Models that regressed or were fixed between two compiler (or library) versions, and flaky ones.

    Cells are matched on everything but the axis that changes.
    """
    by = "compiler" if axis == "compiler" else "library_version"

    def key(c: Cell) -> tuple[str, ...]:
        other = c.library_version if axis == "compiler" else c.compiler_version
        return (c.model_id, c.task, other)

    old = {key(c): c for c in cells(session, **{by: from_version})}
    out = CellDiff(axis=axis, from_version=from_version, to_version=to_version)
    for cell in cells(session, **{by: to_version}):
        was = old.get(key(cell))
        if was is None:
            continue
        change = CellChange(model_id=cell.model_id, task=cell.task, from_status=was.status, to_status=cell.status,
                            from_sha=was.sha, to_sha=cell.sha)  # fmt: skip
        if CellStatus.FLAKY in (was.status, cell.status):
            out.flaky.append(change)
        elif was.status in GOOD and cell.status in BAD:
            out.regressed.append(change)
        elif was.status in BAD and cell.status in GOOD:
            out.fixed.append(change)
        elif was.status != cell.status:
            out.changed.append(change)
        if (
            was.tokens_per_s
            and cell.tokens_per_s
            and cell.tokens_per_s < was.tokens_per_s * (1 - THROUGHPUT_NOISE_BAND)
        ):
            out.slower.append(SpeedChange(model_id=cell.model_id, task=cell.task, from_tokens_per_s=was.tokens_per_s,
                                          to_tokens_per_s=cell.tokens_per_s,
                                          ratio=cell.tokens_per_s / was.tokens_per_s))  # fmt: skip
    return out

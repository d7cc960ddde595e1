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
from shared.hub.client import MODEL_ID_PATTERN


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


# A cell of one version, as a diff pages through them: model, task, and the version of the other axis.
DiffKey = tuple[str, str, str]


def cells(
    session: Session,
    *,
    compiler: str | None = None,
    library_version: str | None = None,
    after: DiffKey | None = None,
    through: DiffKey | None = None,
) -> list[Cell]:
    """The cells, of one compiler or library version when given. ``after`` and ``through`` bound the cells of
    one version's ``DiffKey`` (exclusive, inclusive): the range one page of a diff reads."""
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
    if after is not None or through is not None:
        assert (compiler is None) != (library_version is None), "a key range is over one version's cells"
        key = _diff_key_columns("library" if compiler is None else "compiler")
        stmt = stmt.where(key > after) if after is not None else stmt
        stmt = stmt.where(key <= through) if through is not None else stmt
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
    """One page of a diff: the changes among the newer version's cells in this page's key range (model, task,
    the other axis's version), in that order; ``next_cursor`` asks for the next range."""

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
    cells_compared: int = Field(0, description="the newer version's cells this page read")
    next_cursor: str | None = Field(None, description="Pass as `cursor` for the next page; null on the last.")


def _diff_key_columns(axis: Axis) -> sa.Tuple:
    other = Job.library_version if axis == "compiler" else Job.compiler_version
    return sa.tuple_(Job.model_id, Job.task, other)


# A diff page's cursor: the page's last key, readable — ``model,task,version`` (none of them holds a comma).
DIFF_CURSOR_PATTERN = rf"^{MODEL_ID_PATTERN.strip('^$')},[a-z-]{{1,64}},[A-Za-z0-9][A-Za-z0-9._+-]{{0,99}}$"


def encode_cursor(key: DiffKey) -> str:
    return ",".join(key)


def decode_cursor(cursor: str) -> DiffKey:
    """A diff's cursor back to its key; ValueError for anything ``encode_cursor`` cannot have written."""
    if not re.fullmatch(DIFF_CURSOR_PATTERN, cursor):
        raise ValueError(f"cursor {cursor[:60]!r} is not a diff cursor (model,task,version): pass next_cursor as given")
    model_id, task, version = cursor.split(",")
    return model_id, task, version


def diff(
    session: Session, axis: Axis, from_version: str, to_version: str, after: DiffKey | None = None, limit: int = 500
) -> CellDiff:
    """Models that regressed or were fixed between two compiler (or library) versions, and flaky ones: one page,
    of at most ``limit`` cells of the newer version after the key ``after``.

    Cells are matched on everything but the axis that changes. A page reads the page's keys, then the rows of
    both versions in that key range (indexes on each version and key: ix_jobs_diff_compiler, ix_jobs_diff_library),
    so its cost follows ``limit``, not the size of either version.
    """
    by = "compiler" if axis == "compiler" else "library_version"
    version = Job.compiler_version if axis == "compiler" else Job.library_version
    columns = _diff_key_columns(axis)
    keys_query = (
        sa.select(*columns.clauses).join(Result, Result.job_id == Job.id).where(version == to_version)
        .distinct().order_by(*columns.clauses).limit(limit + 1)
    )  # fmt: skip
    if after is not None:
        keys_query = keys_query.where(columns > after)
    keys: list[DiffKey] = [(k[0], k[1], k[2]) for k in session.execute(keys_query)]
    through = keys[limit - 1] if len(keys) > limit else None  # the last page reads to the end
    page = {"after": after, "through": through}

    def key(c: Cell) -> tuple[str, ...]:
        other = c.library_version if axis == "compiler" else c.compiler_version
        return (c.model_id, c.task, other)

    old = {key(c): c for c in cells(session, **{by: from_version}, **page)}
    newer = cells(session, **{by: to_version}, **page)
    out = CellDiff(
        axis=axis, from_version=from_version, to_version=to_version, cells_compared=len(newer),
        next_cursor=encode_cursor(through) if through is not None else None,
    )  # fmt: skip
    for cell in newer:
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

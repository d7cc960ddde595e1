"""What the results page reads: one row per model at chosen versions, in a sweep view's rank order, filtered,
sorted and paged in SQL; the versions to choose from; a model's history per version; a sweep's cost.

A row is a cell's newest run: the newest finished job of (model, task) under one compiler version and one
library version. A view (``selected``, ``trending``, ``downloads``) is the newest finished sweep's list for the
task, ranked as the Hub ranked it; a model the view lists without a run at the chosen versions keeps its rank
with an empty row. The cost of a run is its core-seconds (wall time, compilation included, times its cores)
at the configured price per core-hour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import JobState, SweepState, Verdict
from shared.db.models import Job, Result, Sweep, SweepEntry
from shared.hub.sizing import GIB
from shared.results.cells import version_key
from shared.results.records import ResultRecord

View = Literal["all", "selected", "trending", "downloads"]
VIEWS: tuple[View, ...] = ("all", "selected", "trending", "downloads")
Sort = Literal["rank", "model", "result", "cores", "wall", "compile", "memory", "cache", "throughput", "cost"]
SORTS: tuple[Sort, ...] = ("rank", "model", "result", "cores", "wall", "compile", "memory", "cache", "cost")
Direction = Literal["asc", "desc"]
# A job in these states has its result row (both are written in one transaction, shared.jobs.outcomes._close):
# filtering on the state spares a join with results where only the job's columns are read.
WITH_RESULT = (JobState.done, JobState.failed)


def core_seconds_usd(core_seconds: float, price_per_core_hour: float) -> float:
    return core_seconds / 3600 * price_per_core_hour


def cost_usd(wall_s: float | None, cores: int | None, price_per_core_hour: float) -> float | None:
    """Dollars of one run: wall time (compilation included) times cores, at the price of one core-hour."""
    if wall_s is None or cores is None:
        return None
    return core_seconds_usd(wall_s * cores, price_per_core_hour)


def per_pass_usd(cost: float, passes: int) -> float | None:
    return cost / passes if passes else None


def compiler_versions(session: Session) -> list[str]:
    """Compiler versions with results, newest (highest) first."""
    stmt = sa.select(Job.compiler_version).where(Job.state.in_(WITH_RESULT)).distinct()
    return sorted(session.scalars(stmt), key=version_key, reverse=True)


def library_versions(session: Session, compiler: str | None) -> list[str]:
    """Library versions with results under ``compiler`` (all, when None), newest (highest) first."""
    stmt = sa.select(Job.library_version).where(Job.state.in_(WITH_RESULT)).distinct()
    if compiler is not None:
        stmt = stmt.where(Job.compiler_version == compiler)
    return sorted(session.scalars(stmt), key=version_key, reverse=True)


def newest_sweep_id(session: Session, view: str, task: str) -> int | None:
    """The newest finished sweep that lists ``view`` for ``task``."""
    return session.scalar(
        sa.select(Sweep.id)
        .where(
            Sweep.state == SweepState.done,
            sa.exists().where(SweepEntry.sweep_id == Sweep.id, SweepEntry.view == view, SweepEntry.task == task),
        )
        .order_by(Sweep.id.desc())
        .limit(1)
    )


@dataclass(frozen=True)
class Row:
    rank: int | None
    model_id: str
    job_id: int | None  # None: the view lists the model, but it has no run at these versions
    result: str | None
    error_class: str | None
    cores: int | None
    wall_s: float | None
    compile_s: float | None
    peak_memory_bytes: int | None
    compile_cache: str | None
    decode_tokens_per_s: float | None  # a PASS's decode rate at batch 1 (the performance tier)
    cost_usd: float | None

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_memory_bytes is None else self.peak_memory_bytes / GIB


@dataclass(frozen=True)
class Totals:
    """Over every row the filters select, not only the page shown."""

    rows: int
    runs: int
    passes: int
    core_seconds: float
    cost_usd: float

    @property
    def cost_per_pass_usd(self) -> float | None:
        return per_pass_usd(self.cost_usd, self.passes)


@dataclass(frozen=True)
class TablePage:
    rows: list[Row]
    totals: Totals
    offset: int
    limit: int
    sweep_id: int | None  # the sweep whose ranks order a view


def table_page(
    session: Session,
    *,
    task: str,
    compiler: str,
    library_version: str,
    price_per_core_hour: float,
    view: View = "all",
    search: str = "",
    verdict: Verdict | None = None,
    sort: Sort = "rank",
    direction: Direction = "asc",
    offset: int = 0,
    limit: int = 100,
) -> TablePage:
    """One page of the results table; ``search`` matches a part of the model id, case-insensitively."""
    newest = (
        sa.select(Job.model_id, sa.func.max(Job.id).label("job_id"))
        .where(
            Job.state.in_(WITH_RESULT),
            Job.task == task,
            Job.compiler_version == compiler,
            Job.library_version == library_version,
        )
        .group_by(Job.model_id)
        .subquery("newest")
    )
    sweep_id = None
    if view == "all":
        model_id = newest.c.model_id
        rank: Any = sa.null()
        first_entry: Any = None
        stmt = sa.select().select_from(newest).join(Result, Result.job_id == newest.c.job_id)
    else:
        sweep_id = newest_sweep_id(session, view, task)
        ranks = (
            sa.select(
                SweepEntry.model_id,
                sa.func.min(SweepEntry.rank).label("rank"),
                sa.func.min(SweepEntry.id).label("first_entry"),
            )
            .where(SweepEntry.sweep_id == sweep_id, SweepEntry.view == view, SweepEntry.task == task)
            .group_by(SweepEntry.model_id)
            .subquery("ranks")
        )
        model_id, rank, first_entry = ranks.c.model_id, ranks.c.rank, ranks.c.first_entry
        stmt = (
            sa.select()
            .select_from(ranks)
            .outerjoin(newest, newest.c.model_id == ranks.c.model_id)
            .outerjoin(Result, Result.job_id == newest.c.job_id)
        )
    if search:
        stmt = stmt.where(sa.func.lower(model_id).contains(search.lower(), autoescape=True))
    if verdict is not None:
        stmt = stmt.where(Result.verdict == verdict)

    core_seconds = Result.wall_s * Result.cores
    totals = session.execute(
        stmt.with_only_columns(
            sa.func.count(),
            sa.func.count(Result.id),
            sa.func.count(Result.id).filter(Result.verdict == Verdict.PASS),
            sa.func.coalesce(sa.func.sum(core_seconds), 0.0),
        )
    ).one()
    order_by: dict[Sort, Any] = {
        "rank": rank if view != "all" else model_id,
        "model": model_id,
        "result": Result.verdict,
        "cores": Result.cores,
        "wall": Result.wall_s,
        "compile": Result.compile_s,
        "memory": Result.peak_memory_bytes,
        "cache": Result.compile_cache,
        "throughput": Result.decode_tokens_per_s,
        "cost": core_seconds,
    }
    key = order_by[sort]
    key = (key.desc() if direction == "desc" else key.asc()).nulls_last()
    tie_breaks = [model_id] if view == "all" else [first_entry, model_id]
    page = stmt.with_only_columns(
        rank,
        model_id,
        Result.job_id,
        Result.verdict,
        Result.error_class,
        Result.cores,
        Result.wall_s,
        Result.compile_s,
        Result.peak_memory_bytes,
        Result.compile_cache,
        Result.decode_tokens_per_s,
    ).order_by(key, *tie_breaks)
    rows = [
        Row(rank_, model, job_id, _code(result), _code(error), cores, wall, compile_s, peak, cache, rate,
            cost_usd=cost_usd(wall, cores, price_per_core_hour))
        for rank_, model, job_id, result, error, cores, wall, compile_s, peak, cache, rate in session.execute(
            page.offset(offset).limit(limit)
        )
    ]  # fmt: skip
    seconds = float(totals[3])
    return TablePage(
        rows=rows,
        totals=Totals(
            rows=totals[0],
            runs=totals[1],
            passes=totals[2],
            core_seconds=seconds,
            cost_usd=core_seconds_usd(seconds, price_per_core_hour),
        ),
        offset=offset,
        limit=limit,
        sweep_id=sweep_id,
    )


def _code(value: Any) -> str | None:
    """An enum's stored code (its value), as the API and the export spell it."""
    return None if value is None else str(getattr(value, "value", value))


def evidence(session: Session, job_id: int) -> dict[str, Any]:
    """A run's evidence beyond its record (text-generation: the divergent steps with their gap and rank)."""
    return session.scalar(sa.select(Result.evidence).where(Result.job_id == job_id)) or {}


@dataclass(frozen=True)
class VersionPoint:
    compiler: str
    library_version: str
    result: str
    wall_s: float | None
    peak_gib: float | None
    job_id: int
    decode_tokens_per_s: float | None = None
    long_generation: str | None = None
    long_agreement: list[float] | None = None  # per window of the long generation: tokens equal to the reference's


def version_history(records: Sequence[ResultRecord], task: str) -> list[VersionPoint]:
    """The newest run of ``task`` per (compiler version, library version), oldest version first."""
    newest: dict[tuple[str, str], ResultRecord] = {}
    for r in sorted((r for r in records if r.task == task), key=lambda r: r.job_id):
        newest[(r.neuronx_cc, r.library_version)] = r
    return [
        VersionPoint(
            compiler=r.neuronx_cc,
            library_version=r.library_version,
            result=str(r.result),
            wall_s=r.wall_s,
            peak_gib=None if r.peak_memory_bytes is None else r.peak_memory_bytes / GIB,
            job_id=r.job_id,
            decode_tokens_per_s=r.decode_tokens_per_s,
            long_generation=None if r.long_generation is None else str(r.long_generation),
            long_agreement=r.long_agreement,
        )
        for r in sorted(newest.values(), key=lambda r: r.job_id)
    ]


@dataclass(frozen=True)
class SweepRow:
    view: str
    task: str
    rank: int
    model_id: str
    job_id: int | None
    note: str | None
    compiler: str | None
    result: str | None
    cores: int | None
    wall_s: float | None
    cost_usd: float | None


@dataclass(frozen=True)
class SweepCost:
    jobs: int
    finished: int
    passes: int
    cost_usd: float

    @property
    def cost_per_pass_usd(self) -> float | None:
        return per_pass_usd(self.cost_usd, self.passes)


def sweep_rows(session: Session, sweep_id: int, price_per_core_hour: float) -> tuple[list[SweepRow], SweepCost]:
    """A sweep's entries with their runs, and what its distinct jobs cost: in all, and per PASS."""
    stmt = (
        sa.select(
            SweepEntry.view,
            SweepEntry.task,
            SweepEntry.rank,
            SweepEntry.model_id,
            SweepEntry.job_id,
            SweepEntry.note,
            Job.compiler_version,
            Result.verdict,
            Result.cores,
            Result.wall_s,
        )
        .outerjoin(Job, Job.id == SweepEntry.job_id)
        .outerjoin(Result, Result.job_id == SweepEntry.job_id)
        .where(SweepEntry.sweep_id == sweep_id)
        .order_by(SweepEntry.task, SweepEntry.view, SweepEntry.rank, SweepEntry.id)
    )
    rows = [
        SweepRow(view, task, rank, model, job_id, note, compiler, _code(result), cores, wall,
                 cost_usd(wall, cores, price_per_core_hour))
        for view, task, rank, model, job_id, note, compiler, result, cores, wall in session.execute(stmt)
    ]  # fmt: skip
    runs = {r.job_id: r for r in rows if r.job_id is not None}  # a job listed in two views is paid once
    cost = SweepCost(
        jobs=len(runs),
        finished=sum(1 for r in runs.values() if r.result is not None),
        passes=sum(1 for r in runs.values() if r.result == Verdict.PASS.value),
        cost_usd=sum(r.cost_usd or 0.0 for r in runs.values()),
    )
    return rows, cost

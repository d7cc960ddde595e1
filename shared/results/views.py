"""What the results page reads: one row per model at chosen versions, in a sweep view's rank order, filtered,
sorted and paged in SQL; the versions to choose from; a model's history per version; a sweep's cost.

A row is a cell's newest run: the newest finished job of (model, task) under one compiler version and one
library version. A view (a ``SweepView``) is the API's: the newest finished sweep that lists it for the task
(``shared.results.records.view_sweeps``), ranked as the Hub ranked it; a model the view lists without a run at the
chosen versions keeps its rank with an empty row. The cost
of a run is its core-seconds (wall time, compilation included, times its cores) at the configured price per
core-hour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from shared.contracts.enums import JobState, SweepView, Verdict
from shared.db.models import Job, Result, SweepEntry
from shared.hub.sizing import GIB
from shared.results.cells import version_key
from shared.results.records import ResultRecord, record_columns, record_part, view_sweeps

# The page's views: every model with a run ("all"), or one of the newest sweep's lists.
View = Literal["all"] | SweepView
VIEWS: tuple[View, ...] = ("all", *SweepView)
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
    """The sweep that is ``view`` for ``task`` (``view_sweeps``)."""
    return session.scalar(sa.select(view_sweeps(view, task).c.sweep_id))


class _PageRow(BaseModel):
    """What the results page adds to the record's columns of a run (``PAGE_COLUMNS``)."""

    model_config = ConfigDict(frozen=True)

    rank: int | None
    model_id: str
    job_id: int | None  # None: the view lists the model, but it has no run at these versions
    cost_usd: float | None


# The page's columns of a run: the record's own (``record_part``), read from the run's result row.
PAGE_COLUMNS = ("result", "error_class", "neuron_cores", "wall_s", "compile_s", "peak_memory_bytes", "compile_cache",
                "decode_tokens_per_s")  # fmt: skip
Row = record_part("Row", PAGE_COLUMNS, _PageRow)


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
    rows: list[BaseModel]  # of Row
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
        sweep_id = newest_sweep_id(session, view, task)  # read once: the page's rows and its sweep are one sweep's
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
        rank.label("rank"), model_id.label("model_id"), Result.job_id.label("job_id"), *record_columns(PAGE_COLUMNS)
    ).order_by(key, *tie_breaks)
    rows = [
        Row(**run, cost_usd=cost_usd(run["wall_s"], run["neuron_cores"], price_per_core_hour))
        for run in session.execute(page.offset(offset).limit(limit)).mappings()
    ]
    seconds = float(cast(float, totals[3]))  # coalesced: never NULL
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


class _SweepEntryRow(BaseModel):
    """A sweep's entry on its page, beside the record's columns of its run (``SWEEP_COLUMNS``)."""

    model_config = ConfigDict(frozen=True)

    view: str
    task: str
    rank: int
    model_id: str
    job_id: int | None
    note: str | None  # why there is no job
    cost_usd: float | None


SWEEP_COLUMNS = ("neuronx_cc", "result", "neuron_cores", "wall_s")
SweepRow = record_part("SweepRow", SWEEP_COLUMNS, _SweepEntryRow)


@dataclass(frozen=True)
class SweepCost:
    jobs: int
    finished: int
    passes: int
    cost_usd: float

    @property
    def cost_per_pass_usd(self) -> float | None:
        return per_pass_usd(self.cost_usd, self.passes)


def sweep_rows(session: Session, sweep_id: int, price_per_core_hour: float) -> tuple[list[BaseModel], SweepCost]:
    """A sweep's entries with their runs (``SweepRow``s), and what its distinct jobs cost: in all, and per PASS."""
    stmt = (
        sa.select(
            SweepEntry.view,
            SweepEntry.task,
            SweepEntry.rank,
            SweepEntry.model_id,
            SweepEntry.job_id,
            SweepEntry.note,
            *record_columns(SWEEP_COLUMNS),
        )
        .outerjoin(Job, Job.id == SweepEntry.job_id)
        .outerjoin(Result, Result.job_id == SweepEntry.job_id)
        .where(SweepEntry.sweep_id == sweep_id)
        .order_by(SweepEntry.task, SweepEntry.view, SweepEntry.rank, SweepEntry.id)
    )
    entries = [
        (e, cost_usd(e["wall_s"], e["neuron_cores"], price_per_core_hour)) for e in session.execute(stmt).mappings()
    ]
    rows = [SweepRow(**entry, cost_usd=cost) for entry, cost in entries]
    # a job listed in two views is paid once
    runs = {entry["job_id"]: (entry["result"], cost) for entry, cost in entries if entry["job_id"] is not None}
    cost = SweepCost(
        jobs=len(runs),
        finished=sum(1 for result, _ in runs.values() if result is not None),
        passes=sum(1 for result, _ in runs.values() if result == Verdict.PASS),
        cost_usd=sum(cost or 0.0 for _, cost in runs.values()),
    )
    return rows, cost

"""The fleet in numbers, read from SQL: what /metrics publishes (``services/api/metrics.py`` turns these into
Prometheus families). Each function is one query (the host figures two, both over small sets); the indexes they
rely on are named beside the models, and ``bench/metrics_scrape.py`` measures them over 1 M result rows.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, cast

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, JobState, Stage, SweepState, Verdict
from shared.contracts.run import IDENTITY_VERSIONS, Stack
from shared.db.models import Job, QueueSeen, Result, Sweep, SweepEntry, Worker
from shared.results.cells import version_key

# Seconds; the slowest runner is bounded by SUPPORTMATRIX_JOB_TIMEOUT_S (1 h by default), the buckets go to 2 h.
DURATION_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 2700.0, 3600.0, 5400.0, 7200.0)


def seconds_between(start: Any, end: Any, dialect: str) -> sa.ColumnElement[float]:
    """``end - start`` in seconds, on PostgreSQL and SQLite alike."""
    if dialect == "postgresql":  # date_part is float8; EXTRACT is numeric, several times slower over 1 M rows
        return sa.func.date_part("epoch", end - start, type_=sa.Float)
    return (sa.func.julianday(end) - sa.func.julianday(start)) * 86400.0


def _text(value: str) -> sa.ColumnElement[str]:
    """A constant column, inlined (a bound parameter in a UNION leaves PostgreSQL guessing its type)."""
    return sa.literal_column(f"'{value}'", sa.String)


def bounds_at_or_above(value: sa.SQLColumnExpression[float | None], dialect: str) -> sa.ColumnElement[int]:
    """How many bucket bounds are >= ``value`` (NULL for NULL): the row's bucket, as one number per row, so that a
    GROUP BY on it counts each bucket in one pass. PostgreSQL: ``width_bucket`` over the negated bounds, which
    evaluates ``value`` once; elsewhere a CASE chain."""
    if dialect == "postgresql":
        negated: sa.ColumnClause[Any] = sa.literal_column(
            "ARRAY[" + ",".join(f"{-b}" for b in reversed(DURATION_BUCKETS)) + "]::float8[]"
        )
        return sa.func.width_bucket(-value, negated)
    n = len(DURATION_BUCKETS)
    return sa.case(
        (value.is_(None), sa.null()),
        *((value <= bound, n - i) for i, bound in enumerate(DURATION_BUCKETS)),
        else_=0,
    )


# --- jobs and queues ------------------------------------------------------------------------------------------


def jobs_by_state(session: Session) -> dict[JobState, int]:
    return dict(session.execute(sa.select(Job.state, sa.func.count()).group_by(Job.state)).tuples().all())


class QueueWait(NamedTuple):
    stage: str  # "" for a queue a live worker once served, with nothing waiting
    queue: str
    waiting: int
    oldest: dt.datetime | None


def queue_waits(session: Session) -> list[QueueWait]:
    """Jobs waiting per queue and stage, counted in SQL (Redis's LLEN reads 0 while every worker holds a message),
    with the oldest's submission (or the end of its accelerator stage); and every queue a worker ever served."""
    accelerator = (
        sa.select(_text(Stage.accelerator.value), Job.queue, sa.func.count(), sa.func.min(Job.created_at))
        .where(Job.state == JobState.queued)
        .group_by(Job.queue)
    )
    verdict = (
        sa.select(_text(Stage.verdict.value), Job.verdict_queue, sa.func.count(), sa.func.min(Job.judging_at))
        .where(Job.state == JobState.judging, Job.lease_owner.is_(None))
        .group_by(Job.verdict_queue)
    )
    known: sa.Select[str, str, Any, None] = sa.select(_text(""), QueueSeen.queue, sa.literal_column("0"), sa.null())
    waits: sa.CompoundSelect[*tuple[Any, ...]] = sa.union_all(accelerator, verdict, known)
    return [QueueWait(*row) for row in session.execute(waits).tuples()]


# --- results --------------------------------------------------------------------------------------------------


class ResultCount(NamedTuple):
    compiler_version: str | None
    verdict: Verdict
    error_class: ErrorClass | None
    compile_cache: str | None
    rows: int


def result_counts(session: Session) -> list[ResultCount]:
    """Result rows per compiler version, verdict, error class and compile-cache outcome (ix_results_metrics)."""
    columns = (Result.compiler_version, Result.verdict, Result.error_class, Result.compile_cache)
    rows = session.execute(sa.select(*columns, sa.func.count()).group_by(*columns)).tuples()
    return [ResultCount(*row) for row in rows]


def served_compilers(session: Session, since: dt.datetime) -> set[str]:
    """The compiler versions of workers that beat since ``since``."""
    return set(session.scalars(sa.select(Worker.compiler_version).where(Worker.heartbeat_at >= since).distinct()))


def last_result_at(session: Session) -> dt.datetime | None:
    return session.scalar(sa.select(Result.created_at).order_by(Result.id.desc()).limit(1))


# The labels of a throughput cell: what stays fixed while its software stack moves from version to version.
CELL_LABELS = ("model_id", "task", "backend", "compiler", "cores")


class VersionSpeed(NamedTuple):
    stack: Stack  # the whole stack the cell's rows ran on: two TorchNeuron releases on one neuronx-cc are two
    tokens_per_s: float  # the mean over the cell's PASS rows on that stack
    results: int


class CellSpeed(NamedTuple):
    labels: tuple[str, ...]  # CELL_LABELS' values
    newest: VersionSpeed
    previous: VersionSpeed | None  # the stack before the newest, when the cell ran on one


def _stack_order(stack: Stack) -> tuple[tuple[tuple[int, int | str], ...], ...]:
    """Stacks by their versions' numbers, the compiler's first, then torch, TorchNeuron, the runtime, the library."""
    return tuple(version_key(getattr(stack, name)) for name in IDENTITY_VERSIONS)


def cell_speeds(session: Session) -> list[CellSpeed]:
    """Each throughput cell's mean decode rate on its newest software stack and on the one before — the newest and
    the one before *among the stacks with a PASS rate of the cell*: a stack whose runs of it all failed (or were not
    run) is skipped — stacks ordered by their versions' numbers (``version_key``, the compiler's first, as /changes
    orders them: an rc after its release, ``2.28.0rc1`` after ``2.28.0``). Rows of two stacks are never averaged
    together, so a TorchNeuron or transformers release under one neuronx-cc is a version of the cell too. One grouped
    pass over the PASS rows with a decode rate (at most one per PASS with its performance tier), the rest in Python
    over one row per cell and stack."""
    stack_columns = [getattr(Job, name) for name in IDENTITY_VERSIONS]
    cell_columns = (Job.model_id, Job.task, Job.backend, Job.compiler_name, Result.cores)
    rows = session.execute(
        sa.select(*cell_columns, *stack_columns, sa.func.avg(Result.decode_tokens_per_s), sa.func.count())
        .join(Job, Job.id == Result.job_id)
        .where(Result.decode_tokens_per_s.is_not(None), Result.verdict == Verdict.PASS)
        .group_by(*cell_columns, *stack_columns)
    ).tuples()
    versions: dict[tuple[str, ...], list[VersionSpeed]] = defaultdict(list)
    for model_id, task, backend, compiler, cores, *stack, mean, n in rows:
        cell: tuple[str, ...] = (model_id, task, backend, compiler, str(cores))
        ran_on = Stack(**{name: version or "" for name, version in zip(IDENTITY_VERSIONS, stack, strict=True)})
        versions[cell].append(VersionSpeed(ran_on, float(mean), int(n)))
    out = []
    for cell, speeds in sorted(versions.items()):
        speeds.sort(key=lambda speed: _stack_order(speed.stack))
        out.append(CellSpeed(cell, speeds[-1], speeds[-2] if len(speeds) > 1 else None))
    return out


class StageBuckets(NamedTuple):
    compiler_version: str
    accelerator_bucket: int | None  # bounds_at_or_above of the stage's seconds
    verdict_bucket: int | None
    jobs: int
    accelerator_s: float | None  # the sums of the jobs' seconds
    verdict_s: float | None


def stage_duration_buckets(session: Session, dialect: str) -> list[StageBuckets]:
    """Both stages in one pass over the judging and finished jobs (ix_jobs_stage_times): the accelerator stage
    from its lease to the release of its cores (or the job's end), the verdict stage from then to the end."""
    accelerator = seconds_between(Job.started_at, sa.func.coalesce(Job.judging_at, Job.finished_at), dialect)
    verdict = seconds_between(Job.judging_at, Job.finished_at, dialect)
    inner = (
        sa.select(Job.compiler_version.label("version"), accelerator.label("a"), verdict.label("v"))
        .where(Job.state.in_((JobState.judging, JobState.done, JobState.failed)), Job.started_at.is_not(None))
        .subquery()
    )
    a_bucket = bounds_at_or_above(inner.c.a, dialect)
    v_bucket = bounds_at_or_above(inner.c.v, dialect)
    rows = session.execute(
        sa.select(
            inner.c.version, a_bucket, v_bucket, sa.func.count(), sa.func.sum(inner.c.a), sa.func.sum(inner.c.v)
        ).group_by(inner.c.version, a_bucket, v_bucket)
    ).tuples()
    return [StageBuckets(*row) for row in rows]


class CompileBuckets(NamedTuple):
    compiler_version: str | None
    bucket: int
    results: int
    compile_s: float


def compile_duration_buckets(session: Session, dialect: str) -> list[CompileBuckets]:
    """Compile seconds of the results that have them, bucketed per compiler version (ix_results_compile_s)."""
    bucket = bounds_at_or_above(Result.compile_s, dialect)
    rows = session.execute(
        sa.select(Result.compiler_version, bucket, sa.func.count(), sa.func.sum(Result.compile_s))
        .where(Result.compile_s.is_not(None))
        .group_by(Result.compiler_version, bucket)
    ).tuples()
    # a bucket's sum is of seconds the WHERE left: never NULL
    return [CompileBuckets(*row) for row in cast(Iterable[tuple[str | None, int, int, float]], rows)]


class SlowResult(NamedTuple):
    model_id: str
    compiler_version: str | None
    cores: int
    wall_s: float


def slowest_results(session: Session, limit: int) -> list[SlowResult]:
    """The ``limit`` results of the longest wall time (ix_results_wall_s)."""
    rows = session.execute(
        sa.select(Job.model_id, Result.compiler_version, Result.cores, Result.wall_s)
        .join(Job, Job.id == Result.job_id)
        .where(Result.wall_s.is_not(None))
        .order_by(Result.wall_s.desc())
        .limit(limit)
    ).tuples()
    return [SlowResult(*row) for row in cast(Iterable[tuple[str, str | None, int, float]], rows)]  # no NULL wall_s


class Deliveries(NamedTuple):
    accelerator_redeliveries: int  # a stage taken again after its first delivery: a lost worker's job taken over
    verdict_redeliveries: int
    accelerator_resent_jobs: int  # active jobs riding on a message the reconciler re-sent
    verdict_resent_jobs: int
    resends: int  # messages the reconciler sent again (jobs.resends)


def deliveries(session: Session) -> Deliveries:
    """One query over the partial index of jobs with a redelivery or a re-send (ix_jobs_redelivered)."""
    again = sa.func.sum(sa.case((Job.attempts > 1, Job.attempts - 1), else_=0))
    verdict_again = sa.func.sum(sa.case((Job.verdict_attempts > 1, Job.verdict_attempts - 1), else_=0))
    resent = Job.resends > 0
    accelerator_resent = sa.and_(resent, Job.state.in_((JobState.queued, JobState.running)))
    verdict_resent = sa.and_(resent, Job.state == JobState.judging, Job.enqueued_at > Job.judging_at)
    row = session.execute(
        sa.select(
            again,
            verdict_again,
            sa.func.sum(sa.case((accelerator_resent, 1), else_=0)),
            sa.func.sum(sa.case((verdict_resent, 1), else_=0)),
            sa.func.sum(Job.resends),
        ).where(sa.or_(Job.attempts > 1, Job.verdict_attempts > 1, resent))
    ).one()
    return Deliveries(*(int(n or 0) for n in row))


# --- hosts and workers ------------------------------------------------------------------------------------------


class WorkerBeat(NamedTuple):
    name: str
    host: str
    cores: str  # the core range it owns
    compiler_version: str
    heartbeat_at: dt.datetime


def worker_beats(session: Session) -> list[WorkerBeat]:
    rows = session.execute(
        sa.select(Worker.name, Worker.host, Worker.cores, Worker.compiler_version, Worker.heartbeat_at)
    ).tuples()
    return [WorkerBeat(*row) for row in rows]


def running_lease_owners(session: Session) -> Sequence[str | None]:
    """The lease owners of the jobs whose accelerator stage runs: which workers are busy."""
    return session.scalars(sa.select(Job.lease_owner).where(Job.state == JobState.running)).all()


# --- sweeps ------------------------------------------------------------------------------------------------------


def sweeps_by_state(session: Session) -> dict[SweepState, int]:
    return dict(session.execute(sa.select(Sweep.state, sa.func.count()).group_by(Sweep.state)).tuples().all())


class SweepProgress(NamedTuple):
    sweep_id: int
    job_state: JobState | None  # None: the entry got no job (e.g. a model refused before sizing)
    entries: int


def sweep_progress(session: Session) -> list[SweepProgress]:
    """The entries of the unfinished sweeps and of the newest, by the state of the job each got."""
    current = sa.union(
        sa.select(Sweep.id).where(Sweep.state.in_((SweepState.queued, SweepState.running))),
        sa.select(sa.func.max(Sweep.id)),
    )
    rows = session.execute(
        sa.select(SweepEntry.sweep_id, Job.state, sa.func.count())
        .outerjoin(Job, Job.id == SweepEntry.job_id)
        .where(SweepEntry.sweep_id.in_(sa.select(current.subquery().c[0])))
        .group_by(SweepEntry.sweep_id, Job.state)
    ).tuples()
    return [SweepProgress(*row) for row in rows]

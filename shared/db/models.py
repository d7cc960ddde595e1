"""The SQL schema: jobs, their results, and the workers that run them."""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from pydantic.fields import FieldInfo
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from shared.contracts.enums import ACTIVE_STATES, ErrorClass, JobState, Scope, SweepState, Verdict
from shared.contracts.fields import FieldShape, shape_of
from shared.contracts.report import row_fields
from shared.contracts.run import IDENTITY_VERSIONS, LIBRARY, LIBRARY_FIELDS, STACK_DIGEST_LENGTH, RuntimeInfo, stack_of


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UTCDateTime(sa.TypeDecorator[dt.datetime]):
    """Aware UTC datetimes on every database (SQLite drops the zone; we put it back)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    @property
    def python_type(self) -> type:  # a decorator's own is object: a record derived from the column reads this
        return dt.datetime

    def process_bind_param(self, value: dt.datetime | None, dialect: sa.Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect: sa.Dialect) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


def enum_column(enum: type[StrEnum], length: int | None = None) -> sa.Enum:
    return sa.Enum(
        enum,
        native_enum=False,
        length=length or max(len(m.value) for m in enum) + 4,
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
        name=enum.__name__.lower(),
    )


class Base(DeclarativeBase):
    type_annotation_map: dict[Any, Any] = {dt.datetime: UTCDateTime()}


def sql_type(shape: FieldShape) -> sa.types.TypeEngine[Any]:
    """The column type of a record field (``shared.contracts.fields``): its width where it declares one."""
    if isinstance(shape.kind, type) and issubclass(shape.kind, StrEnum):
        return enum_column(shape.kind, shape.max_length)
    if shape.kind in (list, dict):
        return sa.JSON()
    if shape.kind is str:
        return sa.String(shape.max_length) if shape.max_length else sa.Text()
    if shape.kind is int:
        return sa.Integer() if shape.int32 else sa.BigInteger()
    scalars: dict[type, sa.types.TypeEngine[Any]] = {bool: sa.Boolean(), float: sa.Double()}
    return scalars[shape.kind]


def columns_mixin(name: str, fields: dict[str, tuple[FieldInfo, bool]], **server_defaults: str) -> type:
    """A mixin with a column per record field, typed from its annotation (``sql_type``): the field is declared
    once, in ``shared.contracts``. ``fields`` maps each column to its field and whether it may be NULL. A static
    checker sees its columns in the stub ``shared/db/derived_columns.pyi``, generated from the same fields."""
    columns = {
        column: mapped_column(
            sql_type(shape_of(info)),
            nullable=nullable,
            default=None if info.is_required() else info.default,
            server_default=server_defaults.get(column),
        )
        for column, (info, nullable) in fields.items()
    }
    return type(name, (), columns)


TOKEN_NAME_WIDTH = 64  # an API token's name, and the columns that record which token did something

# The library and torch a row ran with (a stored reference depends on these, not on the compiler): NOT NULL, as a
# job's and a worker's identity (a job settled before any runner said has an empty torch version).
_RUNTIME = {name: (info, False) for name, info in RuntimeInfo.model_fields.items()}
LIBRARY_COLUMNS = {n: _RUNTIME[n] for n in LIBRARY_FIELDS}
RUNTIME_COLUMNS = {n: f for n, f in _RUNTIME.items() if n not in LIBRARY_FIELDS}
# A result row's column per field of its report's parts (``RunReport``, declared there once).
REPORT_COLUMNS = {f.name: (f.info, f.optional) for f in row_fields()}

if TYPE_CHECKING:
    # The mixins' columns as a type checker sees them: generated from the maps above (shared/results/type_stubs.py)
    from shared.db.derived_columns import LibraryIdentity, ReportColumns, RuntimeColumns
else:
    LibraryIdentity = columns_mixin("LibraryIdentity", LIBRARY_COLUMNS, library=LIBRARY, torch_version="")
    RuntimeColumns = columns_mixin(
        "RuntimeColumns", RUNTIME_COLUMNS, torch_neuronx_version="", neuron_runtime_version="", compiler_build=""
    )
    ReportColumns = columns_mixin("ReportColumns", REPORT_COLUMNS)


class RuntimeIdentity(RuntimeColumns, LibraryIdentity):
    """The fields that say what runs a job, equal to ``RuntimeInfo``'s: one home for jobs and workers."""

    def runtime(self) -> RuntimeInfo:
        return RuntimeInfo.model_validate(self, from_attributes=True)


def _stack_digest_of_row(context: Any) -> str:
    """A new job row's stack digest (``Stack.digest``), from the stack's columns it is inserted with: stored so that
    the stack axis of a diff reads through an index (ix_jobs_diff_stack) rather than every row's five versions."""
    values = context.get_current_parameters()
    return stack_of(SimpleNamespace(**{name: values.get(name) for name in IDENTITY_VERSIONS})).digest


class Job(RuntimeIdentity, Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[str] = mapped_column(sa.String(200), index=True)
    revision: Mapped[str | None] = mapped_column(sa.String(200), doc="the revision asked for (default: main)")
    sha: Mapped[str] = mapped_column(sa.String(40), doc="the commit it resolved to on the Hub: what was tested")
    task: Mapped[str] = mapped_column(sa.String(64))
    config_hash: Mapped[str] = mapped_column(sa.String(16), server_default="")  # shared.testconfig: what it runs
    gated: Mapped[bool] = mapped_column(default=False, server_default=sa.false())  # the runner gets HF_TOKEN
    # The repo's own code runs (an allow-listed org's custom_code repo), pinned to the commit it was sized at.
    trust_remote_code: Mapped[bool] = mapped_column(default=False, server_default=sa.false())
    # The token's name: names are never reused. A submit token cancels only its own jobs.
    submitted_by: Mapped[str | None] = mapped_column(
        sa.String(TOKEN_NAME_WIDTH), doc="the API token that submitted it (or its sweep); null: scheduled"
    )
    cores: Mapped[int] = mapped_column(default=1)
    # The digest of its stack (``Stack.digest``): written as the row is inserted, never changed (a job keeps its stack)
    stack_digest: Mapped[str] = mapped_column(
        sa.String(STACK_DIGEST_LENGTH), default=_stack_digest_of_row, server_default=""
    )
    queue: Mapped[str] = mapped_column(sa.String(200))
    state: Mapped[JobState] = mapped_column(enum_column(JobState), default=JobState.queued, index=True)
    attempts: Mapped[int] = mapped_column(default=0, doc="deliveries of the accelerator stage")
    # The verdict stage runs on the host that holds the accelerator stage's artifacts: that host's queue.
    verdict_queue: Mapped[str | None] = mapped_column(
        sa.String(200), doc="the verdict queue of the host that ran the accelerator stage"
    )
    verdict_attempts: Mapped[int] = mapped_column(default=0, server_default="0", doc="deliveries of the verdict stage")
    judging_at: Mapped[dt.datetime | None] = mapped_column(
        doc="when the accelerator stage ended and released its cores"
    )
    enqueued_at: Mapped[dt.datetime | None]  # the last time a message was sent for it (the reconciler re-sends)
    resends: Mapped[int] = mapped_column(default=0, server_default="0")  # messages the reconciler sent again
    # Every delivery that took the lease: owner, stage, start, and how it ended — what ERROR(worker_lost) lists.
    attempt_log: Mapped[list[dict[str, Any]]] = mapped_column(sa.JSON, default=list, server_default="[]")
    lease_owner: Mapped[str | None] = mapped_column(sa.String(200))
    heartbeat_at: Mapped[dt.datetime | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    error_class: Mapped[ErrorClass | None] = mapped_column(enum_column(ErrorClass))
    error_message: Mapped[str | None] = mapped_column(sa.Text)

    result: Mapped[Result | None] = relationship(back_populates="job", uselist=False)

    __table_args__ = (
        # One export file's runs (compiler version, library, library version), newest first, and every other
        # read of a compiler version's rows (tests/test_query_plans.py checks the plans that use it).
        sa.Index("ix_jobs_export_key", "compiler_version", "library", "library_version", "id"),
        # A diff's page: one version's cells in key order (shared.results.cells.diff), for each axis.
        sa.Index("ix_jobs_diff_compiler", "compiler_version", "model_id", "task", "library_version"),
        sa.Index("ix_jobs_diff_library", "library_version", "model_id", "task", "compiler_version"),
        sa.Index("ix_jobs_diff_stack", "stack_digest", "model_id", "task"),
        # What /metrics reads at every scrape (bench/metrics_scrape.py measures them at 1 M rows): stage
        # durations of jobs past their accelerator stage, redeliveries and re-sends.
        sa.Index(
            "ix_jobs_stage_times",
            "compiler_version",
            "started_at",
            "judging_at",
            "finished_at",
            sqlite_where=sa.text("state IN ('judging', 'done', 'failed') AND started_at IS NOT NULL"),
            postgresql_where=sa.text("state IN ('judging', 'done', 'failed') AND started_at IS NOT NULL"),
        ),
        sa.Index(
            "ix_jobs_redelivered",
            "id",
            sqlite_where=sa.text("attempts > 1 OR verdict_attempts > 1 OR resends > 0"),
            postgresql_where=sa.text("attempts > 1 OR verdict_attempts > 1 OR resends > 0"),
        ),
        # At most one queued or running job per identity: concurrent duplicate submissions
        # cannot both insert. Finished jobs stay out of it so `force` can rerun them.
        sa.Index(
            "uq_jobs_active_identity",
            "model_id",
            "sha",
            *IDENTITY_VERSIONS,
            "task",
            "config_hash",
            "cores",
            unique=True,
            sqlite_where=sa.text(f"state IN {tuple(s.value for s in ACTIVE_STATES)}"),
            postgresql_where=sa.text(f"state IN {tuple(s.value for s in ACTIVE_STATES)}"),
        ),
    )


class Result(ReportColumns, Base):
    """A finished test: its verdict, and a column per field of its report's parts (``RunReport``, declared there
    once; ``columns_mixin`` types them)."""

    __tablename__ = "results"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.ForeignKey("jobs.id", ondelete="CASCADE"), unique=True)
    verdict: Mapped[Verdict] = mapped_column(enum_column(Verdict), index=True)  # a row is a finished test
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    job: Mapped[Job] = relationship(back_populates="result")

    __table_args__ = (
        # /metrics' families over every finished row (bench/metrics_scrape.py): verdicts and cache outcomes per
        # compiler version, compile-time histograms, the slowest models.
        sa.Index("ix_results_metrics", "compiler_version", "verdict", "error_class", "compile_cache"),
        sa.Index("ix_results_signature_id", "signature_id"),  # GET /failures groups by it
        sa.Index(
            "ix_results_compile_s", "compiler_version", "compile_s",
            sqlite_where=sa.text("compile_s IS NOT NULL"), postgresql_where=sa.text("compile_s IS NOT NULL"),
        ),
        sa.Index(  # the decode rate per compiler version (/metrics)
            "ix_results_throughput", "compiler_version", "decode_tokens_per_s",
            sqlite_where=sa.text("decode_tokens_per_s IS NOT NULL"),
            postgresql_where=sa.text("decode_tokens_per_s IS NOT NULL"),
        ),
        sa.Index(
            "ix_results_wall_s", "wall_s",
            sqlite_where=sa.text("wall_s IS NOT NULL"), postgresql_where=sa.text("wall_s IS NOT NULL"),
        ),
    )  # fmt: skip


class ResultsVersion(Base):
    """One row (id 1): a number that every transaction inserting, changing or deleting results raises as it commits,
    to at least the time in microseconds (migration 0015's triggers, so that no writer can forget it; the time, so
    that a database restored from a backup goes on above the numbers it held). Two reads of records that found the
    same number, and the same newest finished sweep, answer alike: the API keeps its answers by them
    (``services/api/answers.py``)."""

    __tablename__ = "results_version"

    id: Mapped[int] = mapped_column(primary_key=True)
    version: Mapped[int] = mapped_column(sa.BigInteger)


class Worker(RuntimeIdentity, Base):
    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    host: Mapped[str] = mapped_column(sa.String(200))
    pid: Mapped[int]
    cores: Mapped[str] = mapped_column(sa.String(32))  # the core range it owns, e.g. "0-3"
    core_count: Mapped[int]
    queue: Mapped[str] = mapped_column(sa.String(200))
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class QueueSeen(Base):
    """When each job queue last had a live worker: a queue nobody has served for too long ends its jobs
    ERROR(no_worker) instead of letting them wait forever. A job queue's row keeps the runtime its workers serve, so
    that a fleet scaled to zero is planned for the stacks it served last (``shared.jobs.runtimes``)."""

    __tablename__ = "queues_seen"

    queue: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    last_live_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    # A RuntimeInfo as JSON (read back through it); None for a verdict queue, or a row older than migration 0016.
    runtime: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)


class Sweep(Base):
    """One pass over what people use: trending and most-downloaded models per task, and a pinned list."""

    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(primary_key=True)
    # The schedule slot a scheduled sweep belongs to: unique, so a schedule that fires twice adds nothing.
    slot: Mapped[str | None] = mapped_column(sa.String(64), unique=True)
    trigger: Mapped[str] = mapped_column(sa.String(16))  # "schedule" or "api"
    submitted_by: Mapped[str | None] = mapped_column(sa.String(TOKEN_NAME_WIDTH))  # the API token; None: scheduled
    state: Mapped[SweepState] = mapped_column(enum_column(SweepState, length=16), default=SweepState.queued)
    config: Mapped[dict[str, Any]] = mapped_column(sa.JSON, default=dict)
    error: Mapped[str | None] = mapped_column(sa.Text)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    claimed_at: Mapped[dt.datetime | None]  # when a control worker took it (or handed it back to retry)
    attempts: Mapped[int] = mapped_column(default=0, server_default="0")  # claims: retries are counted here
    finished_at: Mapped[dt.datetime | None]

    entries: Mapped[list[SweepEntry]] = relationship(back_populates="sweep", order_by="SweepEntry.id")


class SweepEntry(Base):
    """A model a sweep considered, the view and rank that brought it, and the job it got (if any)."""

    __tablename__ = "sweep_entries"

    id: Mapped[int] = mapped_column(primary_key=True)
    sweep_id: Mapped[int] = mapped_column(sa.ForeignKey("sweeps.id", ondelete="CASCADE"), index=True)
    model_id: Mapped[str] = mapped_column(sa.String(200))
    task: Mapped[str] = mapped_column(sa.String(64))
    view: Mapped[str] = mapped_column(sa.String(16))  # a SweepView, or "rerun" (shared.jobs.sweeps.Candidate)
    rank: Mapped[int]
    job_id: Mapped[int | None] = mapped_column(sa.ForeignKey("jobs.id", ondelete="SET NULL"))
    created: Mapped[bool] = mapped_column(default=False)  # a new job, rather than an existing one
    note: Mapped[str | None] = mapped_column(sa.Text)  # why there is no job

    sweep: Mapped[Sweep] = relationship(back_populates="entries")


class ReferenceRun(LibraryIdentity, Base):
    """A CPU reference run, kept so that every compiler version and rerun of the same model reuses it.

    Keyed by what determines its output: the model's commit, the task and its test config, the dtype,
    and the transformers and torch versions.
    """

    __tablename__ = "reference_runs"

    key: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    model_id: Mapped[str] = mapped_column(sa.String(200), index=True)
    sha: Mapped[str] = mapped_column(sa.String(40))
    task: Mapped[str] = mapped_column(sa.String(64))
    config_hash: Mapped[str] = mapped_column(sa.String(16))
    dtype: Mapped[str] = mapped_column(sa.String(16))
    data: Mapped[dict[str, Any]] = mapped_column(sa.JSON)  # tokens, text, log-likelihood, embeddings, timings
    blob: Mapped[bytes | None] = mapped_column(sa.LargeBinary)  # the prefill logits (float32 .npy)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class ApiToken(Base):
    """A bearer token of the API's write routes. Only its SHA-256 is stored; the token is shown once, when
    it is created (``supportmatrix tokens create``). A revoked token keeps its row and its name."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(TOKEN_NAME_WIDTH), unique=True)
    scope: Mapped[Scope] = mapped_column(enum_column(Scope))
    token_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[dt.datetime | None]
    revoked_at: Mapped[dt.datetime | None]

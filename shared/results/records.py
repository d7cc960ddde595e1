"""Results as flat records: one shape for the API (JSON, CSV, Parquet) and the dataset export.

``ResultRecord`` is that shape's one home, and it is derived: the job's identity (``RecordHead``: the public
dataset's six columns first, aws-neuron/torch-neuronx-model-support, with its names), then every column a result
row keeps of a report (``shared.contracts.report.row_fields``, declared once in the report's parts) but those it
publishes under the public names and those kept in SQL only, then the job's id and end. The Parquet schema is
derived from the record, and ``RECORD_SELECT`` reads it straight from SQL. Field order is column order.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, Optional, TypedDict, Unpack

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import sqlalchemy as sa
from pydantic import BaseModel, Field, create_model
from pydantic.fields import FieldInfo
from sqlalchemy.orm import Session

from shared.contracts.enums import SweepState, Verdict
from shared.contracts.fields import FieldShape, Int32, shape_of
from shared.contracts.report import row_fields
from shared.contracts.run import IDENTITY_VERSIONS, RuntimeInfo
from shared.db.models import Job, Result, ResultsVersion, Sweep, SweepEntry
from shared.results.cells import CellStatus

# 2: failure signatures, graphs compiled, predicted peak memory per core; 3: columns by part; 4: runtime versions,
# compile path, cache lookups, rank cores, routing margin, performance, long generation; 5: the task's pipeline,
# embedding and image columns; 6: the stack's versions are the job's (the stack it was planned for and ran on), and
# a file holds one stack
SCHEMA_VERSION = 6


class RecordHead(BaseModel):
    """What a record is of: the job's identity, under the public dataset's names."""

    model_id: str
    neuronx_cc: str = Field(description="The compiler version that ran: neuronx-cc's, or inductor-<torch>.")
    library: str
    library_version: str
    neuron_cores: Int32
    result: Verdict | CellStatus = Field(description="The run's verdict; in the export, the cell's status.")
    schema_version: Int32
    revision: str = Field(description="The commit sha that was tested.")
    task: str
    backend: str
    compiler: str


# Record fields taken from the job (what was asked), by the job attribute each comes from. The result row
# repeats a few identity columns only as a runner reported them, empty on rows settled without one: where a
# result column shares a head field's name, the record publishes the job's. So with the stack (``Stack``): a row
# states the one stack it was planned for, which is the stack that ran it (a worker runs only its own stack's jobs),
# never a mix of the planned compiler and the reported torch.
FROM_JOB = {
    **{version: version for version in IDENTITY_VERSIONS if version != "compiler_version"},  # it is neuronx_cc
    "model_id": "model_id",
    "neuronx_cc": "compiler_version",
    "library": "library",
    "revision": "sha",
    "task": "task",
    "backend": "backend",
    "compiler": "compiler_name",
    "job_id": "id",
}
# Result columns published under the public dataset's names.
RENAMED_RESULT_COLUMNS = {"neuron_cores": "cores", "result": "verdict"}


def _published_result_fields() -> dict[str, tuple[Any, FieldInfo]]:
    """The result columns the record publishes under their own names, as optional record fields."""
    # the head names the job's compiler version (neuronx_cc): the row's, as a runner reported it, is the same
    taken = set(RecordHead.model_fields) | set(RENAMED_RESULT_COLUMNS.values()) | {"compiler_version"}
    fields: dict[str, tuple[Any, FieldInfo]] = {}
    for column in row_fields():
        if column.name in taken or shape_of(column.info).sql_only:
            continue
        declared: Any = column.info.annotation
        annotation: Any = declared | None
        if column.info.metadata:  # its widths: Parquet's int32, the strings' bounds
            annotation = Annotated[annotation, *column.info.metadata]
        fields[column.name] = (annotation, FieldInfo.from_field(None, description=column.info.description))
    return fields


# The result columns published under their own names.
SAME_NAMED_RESULT_COLUMNS = _published_result_fields()
if TYPE_CHECKING:
    # The record's fields as a type checker sees them: generated from the model below (shared/results/type_stubs.py)
    from shared.results.derived_record import ResultRecord
else:
    ResultRecord = create_model(
        "ResultRecord",
        __base__=RecordHead,
        __doc__="One finished test as a flat row.",
        **SAME_NAMED_RESULT_COLUMNS,
        job_id=(int, ...),
        finished_at=(dt.datetime, ...),
    )


# The job's columns a client reads (``GET /jobs``), past what runs it (``RuntimeInfo``): how it was asked for, where it
# is, how it ended. Its identity hash, stack digest, attempt log and re-sends stay in SQL.
JOB_RECORD_COLUMNS = (
    "id", "model_id", "revision", "sha", "task", "cores", "queue", "submitted_by", "state", "attempts",
    "verdict_queue", "verdict_attempts", "judging_at", "lease_owner", "heartbeat_at", "created_at", "started_at",
    "finished_at", "error_class", "error_message",
)  # fmt: skip


def _job_record_fields() -> dict[str, tuple[Any, FieldInfo]]:
    """Each of the job's published columns as a record field: typed as the column holds it (None where it may be
    NULL), described by its ``doc``, required — a job always has every one."""
    fields: dict[str, tuple[Any, FieldInfo]] = {}
    for name in JOB_RECORD_COLUMNS:
        column = Job.__table__.c[name]
        held: Any = column.type.python_type
        fields[name] = (held | None if column.nullable else held, FieldInfo.from_field(..., description=column.doc))
    return fields


if TYPE_CHECKING:
    from shared.results.derived_record import JobRecord
else:
    JobRecord = create_model(
        "JobRecord",
        __base__=RuntimeInfo,
        **_job_record_fields(),
    )


def record_part(name: str, columns: Sequence[str], base: type[BaseModel]) -> type[BaseModel]:
    """A reader's row that shows some of the record's ``columns``, each typed and described as the record declares
    it (None where the reader has no run), on ``base``: what the reader adds (a rank, a cost). Its values are read
    by ``record_columns``."""
    fields: dict[str, Any] = {}
    for column in columns:
        declared = ResultRecord.model_fields[column]
        optional: Any = Optional[declared.annotation]  # noqa: UP045 (a type built at run time)
        fields[column] = (optional, FieldInfo.from_field(None, description=declared.description))
    return create_model(name, __base__=base, **fields)


_ARROW_TYPES: list[tuple[type, pa.DataType]] = [
    (bool, pa.bool_()),  # before int: bool is an int
    (float, pa.float64()),
    (str, pa.string()),  # enums too: they are StrEnums
    (dt.datetime, pa.timestamp("us", tz="UTC")),
]


def arrow_type(shape: FieldShape) -> pa.DataType:
    """The Parquet type of a record field: a width given beside its type, else its type's own."""
    if shape.kind is list:
        assert shape.item is not None
        return pa.list_(arrow_type(FieldShape(kind=shape.item, optional=False)))
    if shape.kind is int:
        return pa.int32() if shape.int32 else pa.int64()
    for python_type, arrow in _ARROW_TYPES:
        if isinstance(shape.kind, type) and issubclass(shape.kind, python_type):
            return arrow
    raise TypeError(f"no Parquet type for {shape}")


RESULT_SCHEMA = pa.schema([(name, arrow_type(shape_of(f))) for name, f in ResultRecord.model_fields.items()])
COLUMNS = RESULT_SCHEMA.names


def _record_sources() -> dict[str, sa.ColumnElement[Any]]:
    """Each record field as the SQL expression it is read from, in ``COLUMNS`` order."""
    source: dict[str, sa.ColumnElement[Any]] = {
        **{name: getattr(Result, column) for name, column in RENAMED_RESULT_COLUMNS.items()},
        **{name: getattr(Result, name) for name in SAME_NAMED_RESULT_COLUMNS},
        **{name: getattr(Job, attribute) for name, attribute in FROM_JOB.items()},  # the job's, over the result's
        "schema_version": sa.literal(SCHEMA_VERSION),
        "finished_at": sa.func.coalesce(Job.finished_at, Result.created_at),
    }
    return {name: source[name] for name in COLUMNS}


RECORD_SOURCES = _record_sources()
# Records are read as plain rows of these columns: building a Job and a Result object per row (the ORM's
# identity map, its instrumented attributes) cost more than the query itself (bench/api_scale.py). They are read
# through Core (``_records``), which hands the rows over as they come, not through the ORM's result handling.
RECORD_SELECT = (
    sa.select(*(expression.label(name) for name, expression in RECORD_SOURCES.items()))
    .select_from(Result)
    .join(Job, Result.job_id == Job.id)
)


class RecordFilters(TypedDict, total=False):
    """The filters a read of records may combine; None is no filter."""

    model_id: str | None
    compiler: str | None
    library_version: str | None
    verdict: Verdict | None


# Each filter's column, compared with the value given.
FILTER_COLUMNS: dict[str, sa.SQLColumnExpression[Any]] = {
    "model_id": Job.model_id,
    "compiler": Job.compiler_version,
    "library_version": Job.library_version,
    "verdict": Result.verdict,
}


if FILTER_COLUMNS.keys() != RecordFilters.__annotations__.keys():
    raise TypeError("every record filter has its column, and only they")


def _given(filters: RecordFilters) -> dict[str, Any]:
    return {name: value for name, value in filters.items() if value is not None}


def _filtered(stmt: sa.Select[Any], names: tuple[str, ...]) -> sa.Select[Any]:
    return stmt.where(*(FILTER_COLUMNS[name] == sa.bindparam(name) for name in names))


# The newest finished sweep: the one whose entries a view's pages list.
_NEWEST_SWEEP = sa.select(sa.func.max(Sweep.id)).where(Sweep.state == SweepState.done).scalar_subquery()
# What every read of records depends on (``RecordsVersion``), as two columns: read alone, or beside each record row
# (each computed once per statement), so that the records and their version come from the same snapshot.
_VERSION_COLUMNS = (sa.select(ResultsVersion.version).where(ResultsVersion.id == 1).scalar_subquery(), _NEWEST_SWEEP)
_VERSION = sa.select(*_VERSION_COLUMNS)
_VERSIONED_SELECT = RECORD_SELECT.add_columns(*_VERSION_COLUMNS)


def record_columns(columns: Sequence[str]) -> list[sa.ColumnElement[Any]]:
    """The SQL of some of the record's columns, labelled with their names (``record_part``)."""
    return [RECORD_SOURCES[column].label(column) for column in columns]


# The reads below are built once per shape (which filters, whether a cursor or a limit is given) with their values
# as bound parameters, and kept: SQLAlchemy then finds a kept statement's compiled SQL by a cache key it has already
# computed, where a statement built anew per request would have its key (a walk of ~100 labelled columns) computed
# on every call: in a cProfile of model lookups at 1 M rows, 0.5 ms a request, where PostgreSQL ran the query in 0.2.
@lru_cache(maxsize=128)
def _newest_first(names: tuple[str, ...], before: bool, limited: bool) -> sa.Select[Any]:
    stmt = _filtered(_VERSIONED_SELECT, names)
    if before:
        stmt = stmt.where(Job.id < sa.bindparam("before_id"))
    stmt = stmt.order_by(Job.id.desc())
    return stmt.limit(sa.bindparam("limit", type_=sa.Integer)) if limited else stmt


def view_sweeps(view: Any, task: Any | None) -> sa.Subquery:
    """Which sweep a view is, for the API and the page alike: for each task (or ``task`` alone), the newest finished
    sweep that lists ``view`` for it. A sweep that swept other tasks only leaves a task's view as it was. ``view``
    and ``task``: values or bound parameters."""
    listed = (
        sa.select(SweepEntry.task, sa.func.max(SweepEntry.sweep_id).label("sweep_id"))
        .join(Sweep, Sweep.id == SweepEntry.sweep_id)
        .where(Sweep.state == SweepState.done, SweepEntry.view == view)
        .group_by(SweepEntry.task)
    )
    if task is not None:
        listed = listed.where(SweepEntry.task == task)
    return listed.subquery("listed")


def view_entries(view: Any, task: Any | None) -> sa.Select[Any]:
    """A view's entries (``view_sweeps``): each model at its rank, with the job the sweep gave it (if any)."""
    listed = view_sweeps(view, task)
    return (
        sa.select(SweepEntry)
        .join(listed, sa.and_(SweepEntry.sweep_id == listed.c.sweep_id, SweepEntry.task == listed.c.task))
        .where(SweepEntry.view == view)
    )


@lru_cache(maxsize=128)
def _in_view(names: tuple[str, ...], by_task: bool) -> sa.Select[Any]:
    """The records of a view (``view_entries``), in its rank order, each job once (at its first rank)."""
    entries = view_entries(sa.bindparam("view"), sa.bindparam("task") if by_task else None).where(
        SweepEntry.job_id.is_not(None)
    )
    first = sa.func.row_number().over(partition_by=SweepEntry.job_id, order_by=(SweepEntry.rank, SweepEntry.id))
    ranked = entries.with_only_columns(SweepEntry.job_id, SweepEntry.rank, SweepEntry.id, first.label("nth")).subquery(
        "ranked"
    )
    # The page is chosen from narrow rows (rank, job id, the filtered columns): only its own rows are read whole.
    page = (
        _filtered(
            sa.select(ranked.c.job_id, ranked.c.rank, ranked.c.id)
            .join(Job, Job.id == ranked.c.job_id)
            .join(Result, Result.job_id == Job.id)
            .where(ranked.c.nth == 1),
            names,
        )
        .order_by(ranked.c.rank, ranked.c.id)
        .offset(sa.bindparam("offset", type_=sa.Integer))
        .limit(sa.bindparam("limit", type_=sa.Integer))
        .subquery("page")
    )
    return _VERSIONED_SELECT.join(page, page.c.job_id == Job.id).order_by(page.c.rank, page.c.id)


class RecordsVersion(NamedTuple):
    """What every read of records depends on: the results' version (``ResultsVersion``: any change to results raises
    it as it commits) and the newest finished sweep (whose entries a view's pages list; they are written before it
    finishes). A job's columns in a record are written with its result. Reads that find the same version answer
    alike."""

    results: int
    newest_sweep: int | None


def records_version(session: Session) -> RecordsVersion:
    """The version the records are at now."""
    results, newest_sweep = session.connection().execute(_VERSION).one()
    return RecordsVersion(results, newest_sweep)


@dataclass(frozen=True)
class RecordsRead:
    """Records as one statement read them, and the version they were read at (None when it found none: the version
    comes beside the rows)."""

    records: list[ResultRecord]
    version: RecordsVersion | None
    more: bool = False  # a view's page: whether more rows follow it


def _records(
    session: Session, stmt: sa.Select[Any], parameters: dict[str, Any], page_size: int | None = None
) -> RecordsRead:
    """The rows of ``stmt`` as records (at most ``page_size``: a row past them says more follow), and the version
    beside them."""
    rows = session.connection().execute(stmt, parameters).all()  # one fetch for all of them, not one per row
    width = len(COLUMNS)  # the version's two columns follow the record's
    records = [ResultRecord.model_validate(dict(zip(COLUMNS, row[:width], strict=True))) for row in rows[:page_size]]
    version = RecordsVersion(*rows[0][width:]) if rows else None
    return RecordsRead(records, version, more=page_size is not None and len(rows) > page_size)


def _task(task: str | None) -> dict[str, str]:
    return {} if task is None else {"task": task}


def query_results(
    session: Session, *, before_id: int | None = None, limit: int | None = None, **filters: Unpack[RecordFilters]
) -> RecordsRead:
    """Newest first, passing ``filters``, ``before_id`` the cursor (the last job id of the previous page)."""
    given = _given(filters)
    stmt = _newest_first(tuple(sorted(given)), before_id is not None, limit is not None)
    bounds = {"before_id": before_id, "limit": limit}
    return _records(session, stmt, given | {name: value for name, value in bounds.items() if value is not None})


def query_view(
    session: Session, view: str, task: str | None, *, offset: int, limit: int, **filters: Unpack[RecordFilters]
) -> RecordsRead:
    """A page of ``view`` (``view_sweeps``: of one ``task``, or of each), in rank order: its rows passing
    ``filters`` from position ``offset`` (0-based), at most ``limit`` of them, and whether more follow. One
    statement: the ranks, the filters and the page are found in SQL."""
    given = _given(filters)
    stmt = _in_view(tuple(sorted(given)), task is not None)
    parameters = given | {"view": view, "offset": offset, "limit": limit + 1} | _task(task)
    return _records(session, stmt, parameters, page_size=limit)


def table_from_rows(rows: Sequence[Sequence[Any]]) -> pa.Table:
    """Rows of values in ``COLUMNS`` order as a table of ``RESULT_SCHEMA``, one Arrow array per column, with no
    record or dict per row: the export builds its files this way straight from SQL rows (enums as their
    values, datetimes naive UTC or aware, lists as Python lists or as the JSON text SQL keeps them in)."""
    columns = list(zip(*rows, strict=True)) or [()] * len(COLUMNS)
    arrays = [_column(values, field.type) for values, field in zip(columns, RESULT_SCHEMA, strict=True)]
    return pa.Table.from_arrays(arrays, schema=RESULT_SCHEMA)


def _column(values: Sequence[Any], arrow: pa.DataType) -> pa.Array:
    if pa.types.is_list(arrow) and any(isinstance(value, str) for value in values):
        # JSON text: parsed in one pass by Arrow's JSON reader, a few times faster than json.loads per value.
        lines = b"\n".join(b'{"v":%s}' % (b"null" if v is None else v.encode()) for v in values)
        only = pa.schema([("v", arrow)])
        return pa_json.read_json(io.BytesIO(lines), parse_options=pa_json.ParseOptions(explicit_schema=only))["v"]
    return pa.array(values, type=arrow)


def to_table(records: Sequence[ResultRecord]) -> pa.Table:
    return table_from_rows([[getattr(r, name) for name in COLUMNS] for r in records])


def to_parquet_bytes(records: Sequence[ResultRecord]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(to_table(records), sink)
    return sink.getvalue()


def to_csv(records: Sequence[ResultRecord]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS)
    writer.writeheader()
    for rec in records:
        writer.writerow({k: _csv_cell(v) for k, v in rec.model_dump().items()})
    return out.getvalue()


def _csv_cell(value: Any) -> Any:
    if isinstance(value, list):
        return json.dumps(value)
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return value

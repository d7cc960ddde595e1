"""The collector's export: Parquet files readers of the public dataset can load unchanged.

One file per software stack (compiler, torch, TorchNeuron, Neuron runtime and library versions) under
``<export dir>/data/``, holding one row per (model, task) for that stack: its newest run, with the cell's status
as ``result``. A file is replaced atomically (temp + rename) and only when its rows changed, so readers never
see half a file and unchanged files keep their mtime.

Two ways to get there. ``export_results`` rebuilds every file from SQL. ``export_jobs`` — what the collector
runs after results arrive — rewrites only the files of the given jobs' keys, and in each only the rows of
the cells those jobs belong to: it reads those cells' runs from SQL and keeps every other row of the file as
it is, so its cost does not grow with the results table. Results nobody asked an export for (a job refused at
submission, one ended as lost) are found by their id: ``.exported`` beside the files holds the highest result
id the files cover, and each export also takes every result above it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import Verdict
from shared.contracts.run import LIBRARY, Stack, safe_name, stack_of
from shared.db.models import Job, Result, UTCDateTime
from shared.results.cells import STACK_COLUMNS, CellStatus
from shared.results.records import COLUMNS, RECORD_SOURCES, RESULT_SCHEMA, SCHEMA_VERSION, table_from_rows

EXPORTED_MARKER = ".exported"  # the highest result id the files cover, and the schema version they were written in
# A file with more changed cells than this is rebuilt from SQL instead of patched cell by cell.
PATCH_AT_MOST = 1000
# Ids per IN (...) list: well below SQLite's bound on parameters.
IDS_PER_QUERY = 500

Cell = tuple[str, str]  # (model id, task)
SORT_ORDER = [("model_id", "ascending"), ("task", "ascending")]


class ExportKey(NamedTuple):
    """What one file holds: the runs of one library under one software stack (``Stack``)."""

    library: str
    stack: Stack

    @classmethod
    def of(cls, stack: Stack, library: str = LIBRARY) -> ExportKey:
        return cls(library, stack)

    @classmethod
    def of_row(cls, row: Any) -> ExportKey:
        """The key of a SQL row holding ``KEY_COLUMNS``."""
        return cls(row.library, stack_of(row))

    @property
    def order(self) -> tuple[str, ...]:
        """Files in the order their names sort: compiler version, library and its version, then the stack's rest."""
        stack = self.stack
        rest = (stack.torch_version, stack.torch_neuronx_version, stack.neuron_runtime_version)
        return (stack.compiler_version, self.library, stack.library_version, *rest)

    @property
    def file_name(self) -> str:
        return file_name(self.library, self.stack)


# The job columns a key is read from: the library, and the stack's (``STACK_COLUMNS``).
KEY_COLUMNS = (Job.library, *STACK_COLUMNS)


@dataclass
class ExportSummary:
    data_dir: Path
    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)  # files of no key with results (a full export's)


def file_name(library: str, stack: Stack) -> str:
    """``<compiler version>--<library>-<library version>--stack-<digest>.parquet``: the versions people look for,
    then the stack's name (``Stack.name``), so that two stacks on one compiler are two files."""

    versions = f"{safe_name(stack.compiler_version)}--{safe_name(library)}-{safe_name(stack.library_version)}"
    return f"{versions}--{stack.name}.parquet"


def _as_stored(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """The column as the database keeps it, without a Python conversion per value: enums stay their values, UTC
    times skip the conversion into aware datetimes (Arrow reads a naive time as UTC), JSON stays text (Arrow
    parses it in bulk). Those conversions, per value, doubled the cost of reading the rows."""
    if isinstance(column.type, sa.Enum):
        return sa.type_coerce(column, sa.String())
    if isinstance(column.type, UTCDateTime):
        return sa.type_coerce(column, UTCDateTime.impl)
    if isinstance(column.type, sa.JSON):
        return sa.cast(column, sa.Text())
    return column


# The record's columns as the export reads them: the API's expressions (``RECORD_SOURCES``), as stored.
RECORD_COLUMNS = [_as_stored(expression).label(name) for name, expression in RECORD_SOURCES.items()]
RECORD_WIDTH, RESULT_COLUMN = len(COLUMNS), COLUMNS.index("result")


def _key_filter(key: ExportKey) -> sa.ColumnElement[bool]:
    of_stack = (column == getattr(key.stack, column.key) for column in STACK_COLUMNS)
    return sa.and_(Job.library == key.library, *of_stack)


def _key_runs(key: ExportKey) -> sa.Select[int, str, str, str, Verdict]:
    """The key's runs as narrow rows: what SQL picks each cell's newest run from."""
    runs = sa.select(Job.id, Job.model_id, Job.task, Job.sha, Result.verdict).join(Result, Result.job_id == Job.id)
    return runs.where(_key_filter(key))


def key_cells(session: Session, key: ExportKey, models: Collection[str] | None = None) -> list[sa.Row[Any]]:
    """One row per cell (model, task) of the key, of all its models or of ``models``: the record of the cell's
    newest run, then the least and the greatest verdict among the runs of that run's commit (``_statuses``
    makes the cell's status of them). SQL picks the newest runs from narrow rows, so that only those are read
    whole; through the Core connection, as the ORM's row loading would double the cost of a large key."""
    runs = _key_runs(key)
    connection = session.connection()
    if models is None:
        return list(connection.execute(_newest_runs(runs)).all())
    listed = sorted(models)
    batches = (
        runs.where(Job.model_id.in_(listed[i : i + IDS_PER_QUERY])) for i in range(0, len(listed), IDS_PER_QUERY)
    )
    return [cell for batch in batches for cell in connection.execute(_newest_runs(batch)).all()]


def _newest_runs(of: sa.Select[int, str, str, str, Verdict]) -> sa.Select[Any]:
    runs = of.subquery()
    cell = (runs.c.model_id, runs.c.task)
    verdict = sa.type_coerce(runs.c.verdict, sa.String())
    ranked = sa.select(
        runs.c.id,
        sa.func.row_number().over(partition_by=cell, order_by=runs.c.id.desc()).label("newer"),
        sa.func.min(verdict).over(partition_by=(*cell, runs.c.sha)).label("least"),
        sa.func.max(verdict).over(partition_by=(*cell, runs.c.sha)).label("greatest"),
    ).subquery()
    stmt = sa.select(*RECORD_COLUMNS, ranked.c.least, ranked.c.greatest).join(Job, Result.job_id == Job.id)
    return stmt.join(ranked, ranked.c.id == Job.id).where(ranked.c.newer == 1)


def key_cells_sql(dialect: sa.Dialect, key: ExportKey) -> str:
    """``key_cells``' query for all the key's models, compiled with its values inline (the key's versions, quoted by
    SQLAlchemy): ADBC's driver copies out only a query without parameters."""
    return str(_newest_runs(_key_runs(key)).compile(dialect=dialect, compile_kwargs={"literal_binds": True}))


def key_cells_arrow(connection: Any, dialect: sa.Dialect, key: ExportKey) -> pa.Table:
    """``key_cells_sql`` read through an ADBC PostgreSQL connection: the driver reads the result as COPY BINARY
    straight into Arrow columns, as PostgreSQL types them (enums and JSON as text, int4 as int32), with no Python
    object per value."""
    with connection.cursor() as cursor:
        cursor.execute(key_cells_sql(dialect, key))
        return cursor.fetch_arrow_table()


def _statuses(least: pa.Array | pa.ChunkedArray, greatest: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    """Each cell's status from the least and the greatest verdict of its commit's runs: their common verdict, or
    FLAKY when they disagree (``shared.results.cells.cell_status``, in bulk)."""
    return pc.if_else(pc.equal(least, greatest), least, CellStatus.FLAKY.value)


def _file_table(records: pa.Table, least: pa.Array | pa.ChunkedArray, greatest: pa.Array | pa.ChunkedArray) -> pa.Table:
    """The file's table: the cells' records with their status as ``result``, sorted by model and task."""
    return records.set_column(RESULT_COLUMN, "result", _statuses(least, greatest)).sort_by(SORT_ORDER)


def _table(cells: Sequence[sa.Row[Any]]) -> pa.Table:
    """The file's table from ``key_cells`` rows."""
    least, greatest = (pa.array([cell[i] for cell in cells], pa.string()) for i in (RECORD_WIDTH, RECORD_WIDTH + 1))
    return _file_table(table_from_rows([cell[:RECORD_WIDTH] for cell in cells]), least, greatest)


def _arrow_table(read: pa.Table) -> pa.Table:
    """The file's table from ``key_cells_arrow``'s: each column cast to its ``RESULT_SCHEMA`` type, the JSON list
    columns parsed from their text."""
    arrays = [
        _number_lists(read[f.name], f.type) if isinstance(f.type, pa.ListType) else read[f.name].cast(f.type)
        for f in RESULT_SCHEMA
    ]
    return _file_table(pa.Table.from_arrays(arrays, schema=RESULT_SCHEMA), read["least"], read["greatest"])


def _number_lists(column: pa.ChunkedArray, arrow: pa.ListType) -> pa.Array:
    """A column of JSON lists of numbers as text (or NULL, or JSON's null) as Arrow lists, parsed by Arrow's
    kernels with no Python object per value: the text between the brackets split at its commas, each item cast
    to the item type (a JSON number reads as Arrow's cast reads a number). The lists ``table_from_rows`` makes of
    the same text, at a third of the cost of Arrow's JSON reader, which reads any JSON. Text that is not a flat
    list of numbers fails the cast."""
    text = pc.utf8_trim_whitespace(column.combine_chunks())
    missing = pc.or_kleene(pc.is_null(text), pc.equal(text, "null"))
    inner = pc.utf8_trim_whitespace(
        pc.utf8_slice_codeunits(pc.if_else(missing, pa.scalar(None, pa.string()), text), 1, -1)
    )
    items = pc.split_pattern(inner, ",")
    flat = pc.utf8_trim_whitespace(items.flatten())
    # "[]" splits into one empty item: it has none
    lengths = pc.if_else(pc.equal(inner, ""), 0, pc.list_value_length(items))
    offsets = pa.concat_arrays(
        [pa.array([0], pa.int32()), pc.cumulative_sum(pc.fill_null(lengths, 0)).cast(pa.int32())]
    )
    values = flat.filter(pc.not_equal(flat, "")).cast(arrow.value_type)
    return pa.ListArray.from_arrays(offsets, values, type=arrow, mask=pc.fill_null(missing, True))


# On PostgreSQL, files are read this many at a time, each by a connection and thread of its own: the server runs
# one file's query while the client converts another's columns and the export writes a third.
READERS = 2


class FileTables:
    """Whole files' tables, from the session's rows (SQLite)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def table(self, key: ExportKey) -> pa.Table:
        return _table(key_cells(self.session, key))

    def tables(self, keys: Iterable[ExportKey]) -> Iterator[tuple[ExportKey, pa.Table]]:
        """Each key with its file's table, in the keys' order."""
        for key in keys:
            yield key, self.table(key)

    def close(self) -> None:
        pass


class ColumnarFileTables(FileTables):
    """Whole files' tables read from PostgreSQL by ADBC's columnar driver (``key_cells_arrow``), on connections of
    their own, opened by the first read (one per reading thread) and closed with the reader: they see what is
    committed, not what the session holds uncommitted."""

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        bind = session.get_bind()
        # libpq's URI: SQLAlchemy's without its driver's name (postgresql+psycopg), its query (search_path) kept
        self.uri = bind.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self.dialect = bind.dialect
        self.local = threading.local()
        self.connections: list[Any] = []
        self.lock = threading.Lock()

    def connection(self) -> Any:
        connection = getattr(self.local, "connection", None)
        if connection is None:
            import adbc_driver_postgresql.dbapi

            connection = self.local.connection = adbc_driver_postgresql.dbapi.connect(self.uri, autocommit=True)
            with self.lock:
                self.connections.append(connection)
        return connection

    def table(self, key: ExportKey) -> pa.Table:
        return _arrow_table(key_cells_arrow(self.connection(), self.dialect, key))

    def tables(self, keys: Iterable[ExportKey]) -> Iterator[tuple[ExportKey, pa.Table]]:
        """Each key with its file's table, in the keys' order, READERS read ahead: at most READERS + 1 tables held."""
        with ThreadPoolExecutor(READERS, thread_name_prefix="export-read") as pool:
            reading: deque[tuple[ExportKey, Future[pa.Table]]] = deque()
            for key in keys:
                reading.append((key, pool.submit(self.table, key)))
                if len(reading) > READERS:
                    done, table = reading.popleft()
                    yield done, table.result()
            while reading:
                done, table = reading.popleft()
                yield done, table.result()

    def close(self) -> None:
        for connection in self.connections:
            connection.close()


@contextlib.contextmanager
def file_tables(session: Session) -> Iterator[FileTables]:
    """How the export reads whole files: on PostgreSQL through ADBC's columnar driver, straight into Arrow;
    elsewhere (SQLite) from the session's rows. The same SELECT, the same tables."""
    reader = ColumnarFileTables(session) if session.get_bind().dialect.name == "postgresql" else FileTables(session)
    try:
        yield reader
    finally:
        reader.close()


def _current(path: Path) -> pa.Table | None:
    """The file's rows when it can be patched: written with this schema (and schema version)."""
    if not path.exists():
        return None
    table = pq.read_table(path)
    if not table.schema.equals(RESULT_SCHEMA) or not pc.all(pc.equal(table["schema_version"], SCHEMA_VERSION)).as_py():
        return None
    return table


def _patched(current: pa.Table, fresh: pa.Table, cells: Collection[Cell]) -> pa.Table:
    """``current`` with the rows of ``cells`` replaced by ``fresh`` (a cell left with no runs goes away)."""
    models, tasks = current["model_id"].to_pylist(), current["task"].to_pylist()
    kept = pa.array([(model, task) not in cells for model, task in zip(models, tasks, strict=True)], pa.bool_())
    return pa.concat_tables([current.filter(kept), fresh]).sort_by(SORT_ORDER)


def replace_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` with what ``write`` writes, so that whoever opens ``path`` gets the old bytes or the new,
    whole. The temp file is the writer's own (``mkstemp``: no two writers, threads or processes, ever share one)
    and starts with a dot, which keeps it out of a directory read (``pd.read_parquet(data_dir)``); it reaches the
    disk before the rename, so a crash leaves the old file or the new one, never an empty one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the files from readers of a shared volume
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _write(path: Path, table: pa.Table, current: pa.Table | None, summary: ExportSummary) -> None:
    """Replace the file with ``table`` when its rows changed. No rows leaves the file alone, as the full export
    always has for a key without results."""
    if table.num_rows == 0:
        return
    if current is not None and current.equals(table):
        summary.unchanged.append(path)
        return
    replace_atomically(path, lambda file: pq.write_table(table, file))
    summary.written.append(path)


def _last_result_id(session: Session) -> int:
    return session.scalar(sa.select(sa.func.max(Result.id))) or 0


def _covered(export_dir: Path) -> int | None:
    """The highest result id the files cover; None when there are no files yet, or when they were written in
    another schema version: then every file is rebuilt, so that no reader of the directory meets two schemas."""
    marker = export_dir / EXPORTED_MARKER
    if not marker.exists():
        return None
    result_id, _, schema = marker.read_text().partition(" ")
    return int(result_id) if schema == str(SCHEMA_VERSION) else None


def _mark_covered(export_dir: Path, result_id: int) -> None:
    replace_atomically(export_dir / EXPORTED_MARKER, lambda file: file.write(f"{result_id} {SCHEMA_VERSION}".encode()))


def _data_dir(export_dir: Path) -> Path:
    data_dir = export_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    return data_dir


def export_keys(session: Session) -> list[ExportKey]:
    """Every key with results: one file each."""
    keys = sa.select(*KEY_COLUMNS).join(Result, Result.job_id == Job.id)
    return sorted((ExportKey.of_row(row) for row in session.execute(keys.distinct())), key=lambda k: k.order)


def export_results(session: Session, export_dir: Path) -> ExportSummary:
    """Rebuild every file from SQL, and remove the files of no key with results: a file named as an older schema
    named its key, or one whose results are all gone, would hold rows no cell has any more (and the Hub dataset,
    which mirrors the directory, would serve them beside the new)."""
    summary = ExportSummary(data_dir=_data_dir(export_dir))
    covered = _last_result_id(session)  # before the rows: a result after it is taken again next time
    with file_tables(session) as files:
        for key, table in files.tables(export_keys(session)):
            path = summary.data_dir / key.file_name
            _write(path, table, _current(path), summary)
    kept = {*summary.written, *summary.unchanged}
    for path in sorted(summary.data_dir.glob("*.parquet")):
        if path not in kept:
            path.unlink()
            summary.removed.append(path)
    _mark_covered(export_dir, covered)
    return summary


def export_jobs(session: Session, export_dir: Path, job_ids: Collection[int]) -> ExportSummary:
    """Bring the files up to date after ``job_ids`` finished: the cells of those jobs and of every result
    past ``.exported`` (the full export when there is none yet, or the files are of an older schema)."""
    covered = _covered(export_dir)
    if covered is None:
        return export_results(session, export_dir)
    summary = ExportSummary(data_dir=_data_dir(export_dir))
    upto = _last_result_id(session)
    cells = sa.select(Job.model_id, Job.task, *KEY_COLUMNS).join(Result, Result.job_id == Job.id)
    ids = sorted(job_ids)
    touched: dict[ExportKey, set[Cell]] = {}
    # Both, because neither is enough: a result committed after a later-numbered one was exported has an id
    # below the mark; a result nobody asked for is only found by its id.
    for where in [
        Result.id > covered,
        *(Job.id.in_(ids[i : i + IDS_PER_QUERY]) for i in range(0, len(ids), IDS_PER_QUERY)),
    ]:
        for row in session.execute(cells.where(where)):
            touched.setdefault(ExportKey.of_row(row), set()).add((row.model_id, row.task))
    with file_tables(session) as files:
        for key, changed in sorted(touched.items(), key=lambda item: item[0].order):
            path = summary.data_dir / key.file_name
            current = _current(path)
            if current is not None and len(changed) <= PATCH_AT_MOST:
                read = key_cells(session, key, {model for model, _ in changed})  # a model's other tasks too
                fresh = _table([cell for cell in read if (cell.model_id, cell.task) in changed])
                table = _patched(current, fresh, changed)
            else:  # a new file, one of another schema, or too many changes to patch
                table = files.table(key)
            _write(path, table, current, summary)
    _mark_covered(export_dir, upto)
    return summary

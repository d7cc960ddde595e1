"""P6 — the export at scale: the full export of 1 M result rows beside a raw Parquet write of the same rows, the
export after one job at 10 k and at 1 M rows, and the Hub commits of a window of results.

    .venv/bin/python -m bench --only export --no-write

In scratch PostgreSQL schemas (dropped at the end) the rows come from ``testing.bulk_rows`` (server-side
``INSERT … SELECT … generate_series``: 50,000 models each run once per round over 20 rounds, a round on the stack of
its time, its compiler, torch and library versions): 11 files of 50,000 rows at 1 M, one per stack. Then:

- full export (``export_results``, what ``supportmatrix export`` runs) into an empty directory, against
  ``pyarrow.parquet.write_table`` of the very tables it wrote, already in memory; and, to show where the time
  goes, the part of the export spent in its SQL read (ADBC's columnar driver), the same reads one file at a time,
  the rows they return copied out of tables holding just them (what copying them out costs alone), and the same
  tables read as rows;
- the export after one job (``export_jobs`` for one new result, what the collector runs after a window), the
  median of three jobs, at 10 k and at 1 M rows;
- one window of results: results written, then each one's worker asks for an export at once (eight threads),
  then the one export the collector runs for them (``export_requested``, in a process of its own configured
  like the collector); against one export per result, as every result asked before (the same functions, run
  after each request). Hub commits are counted by the Hub stand-in.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
import sqlalchemy as sa
from sqlalchemy.orm import Session

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import Goal, Measure, Section  # noqa: E402

if TYPE_CHECKING:
    from shared.results.export import ExportKey
    from testing.bulk_rows import History

POSTGRES = os.environ.get("SUPPORTMATRIX_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
LARGE, SMALL = 1_000_000, 10_000
REPEAT = 3  # jobs whose export after them is timed, at each size
WINDOW = 20  # results in the window of (c)
REPO = "supportmatrix/bench-export"
HUB_TOKEN = "hf_bench_write_token"


@contextlib.contextmanager
def scratch_schema(rows: int) -> Iterator[tuple[sa.Engine, History]]:
    """A migrated schema of its own holding a history of ``rows`` finished jobs with their results; dropped after."""
    from shared.db.engine import make_engine
    from testing.bulk_rows import scratch_history

    with scratch_history(POSTGRES, rows, "bench_export") as scratch:
        engine = make_engine(scratch.url)
        try:
            yield engine, scratch.history
        finally:
            engine.dispose()


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def newest_key(history: History) -> ExportKey:
    """The file of the round in progress (its stack's): where a job finishing now lands."""
    from shared.results.export import ExportKey

    return ExportKey.of(history.newest_stack)


def one_more_job(session: Session, model_id: str, key: ExportKey) -> int:
    """A job of ``model_id`` (a new commit of it) finished on ``key``'s stack, written through the job rules as a
    worker writes it; its id."""
    from shared.contracts.enums import Verdict
    from shared.contracts.run import RuntimeInfo
    from shared.db.models import Job
    from testing.bulk_rows import BACKEND, COMPILER_NAME
    from tests.history import record

    runtime = RuntimeInfo(backend=BACKEND, compiler_name=COMPILER_NAME, library=key.library, **key.stack.model_dump())
    record(session, model_id, runtime, Verdict.PASS)
    job_id = session.scalar(sa.select(sa.func.max(Job.id)).where(Job.model_id == model_id))
    assert job_id is not None
    return job_id


def export_after_one_job(session: Session, export_dir: Path, history: History) -> list[float]:
    """Seconds of the export after each of REPEAT jobs (the files are already there): reruns of text-generation
    models the round in progress already holds, so each changes a row of that round's file."""
    from shared.results.export import export_jobs

    key = newest_key(history)
    seconds = []
    for model in range(1, REPEAT + 1):
        job_id = one_more_job(session, history.model_id(model), key)
        started = time.perf_counter()
        summary = export_jobs(session, export_dir, [job_id])
        seconds.append(time.perf_counter() - started)
        if [p.name for p in summary.written] != [key.file_name]:
            raise RuntimeError(f"the export after job {job_id} wrote {summary.written}, not {key.file_name}")
    return seconds


def has_key_index(session: Session) -> bool:
    """Whether jobs has an index leading with the file's key (a migration adds it)."""
    found = session.scalar(
        sa.text(
            "SELECT count(*) FROM pg_indexes WHERE tablename = 'jobs' AND schemaname = current_schema() "
            "AND indexdef LIKE '%(compiler_version, library, library_version%'"
        )
    )
    return bool(found)


@contextlib.contextmanager
def reads_timed() -> Iterator[list[float]]:
    """The seconds the export spends in its SQL reads of whole files (``key_cells_arrow``, ADBC's columnar read),
    summed over its reader threads while in the block: the read is wrapped where the export looks it up, and hands
    on the very table it read."""
    from shared.results import export

    read = export.key_cells_arrow
    seconds = [0.0]
    lock = threading.Lock()

    def key_cells_arrow(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        table = read(*args, **kwargs)
        with lock:
            seconds[0] += time.perf_counter() - started
        return table

    export.key_cells_arrow = key_cells_arrow
    try:
        yield seconds
    finally:
        export.key_cells_arrow = read


def full_export(session: Session, work: Path) -> dict[str, float]:
    from shared.results.export import FileTables, export_keys, export_results

    with reads_timed() as sql:
        started = time.perf_counter()
        summary = export_results(session, work / "full")
        out = {"ours": time.perf_counter() - started, "sql": sql[0]}
    tables = [pq.read_table(path) for path in summary.written]
    (work / "raw").mkdir()
    out["raw"] = timed(lambda: [pq.write_table(t, work / "raw" / f"{i}.parquet") for i, t in enumerate(tables)])
    out["rows"] = sum(t.num_rows for t in tables)
    out["files"] = len(tables)
    # the same files' tables from the rows the driver hands over one Python tuple at a time (SQLite's path, and
    # PostgreSQL's before the columnar read)
    out["row_path"] = timed(lambda: list(FileTables(session).tables(export_keys(session))))
    out["sequential_sql"], out["copy_out"] = copy_out(session)
    out["server_alone"], out["sent_bytes"] = server_alone(session)
    return out


def server_alone(session: Session) -> tuple[float, int]:
    """Seconds PostgreSQL takes to run the export's queries and send their rows, READERS at a time as the export
    reads them, while the client drops the bytes it receives (psycopg's ``COPY … TO STDOUT``: no conversion, no
    Python object per row): the server's share of the read, which no client-side driver goes below; and the bytes
    sent."""
    import psycopg

    from shared.results.export import READERS, ColumnarFileTables, export_keys, key_cells_sql

    uri, dialect = ColumnarFileTables(session).uri, session.get_bind().dialect

    def sent(key: ExportKey) -> int:
        copied = f"COPY ({key_cells_sql(dialect, key)}) TO STDOUT (FORMAT binary)"
        with (
            psycopg.connect(uri, autocommit=True) as connection,
            connection.cursor() as cursor,
            cursor.copy(copied) as copy,
        ):
            return sum(len(block) for block in copy)

    started = time.perf_counter()
    with ThreadPoolExecutor(READERS) as pool:
        sizes = list(pool.map(sent, export_keys(session)))
    return time.perf_counter() - started, sum(sizes)


def copy_out(session: Session) -> tuple[float, float]:
    """Seconds, summed over the files read one at a time: the export's SQL read (``key_cells_arrow``), and reading
    the very rows it returns out of a temporary table that holds just them (``SELECT *`` by ADBC): what copying the
    rows out of PostgreSQL into Arrow costs with no run to choose."""
    from shared.results.export import ColumnarFileTables, export_keys, key_cells_arrow, key_cells_sql

    reader = ColumnarFileTables(session)
    connection = reader.connection()

    def execute(sql: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute(sql)

    def copied() -> object:
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM copied_rows")
            return cursor.fetch_arrow_table()

    read_s = copy_s = 0.0
    try:
        for key in export_keys(session):
            read_s += timed(partial(key_cells_arrow, connection, reader.dialect, key))
            execute(f"CREATE TEMPORARY TABLE copied_rows AS {key_cells_sql(reader.dialect, key)}")
            copy_s += timed(copied)
            execute("DROP TABLE copied_rows")
    finally:
        reader.close()
    return read_s, copy_s


def record_path(session: Session) -> float:
    """What the export built its files from before: the API's records of every run (``query_results``, a pydantic
    record each), turned into a table."""
    from shared.results.records import query_results, to_table

    return timed(lambda: to_table(query_results(session).records))


def window(engine: sa.Engine, history: History, work: Path) -> dict[str, dict[str, int]]:
    """Commits and export runs of WINDOW results, in a window and one export per result."""
    from shared.processes import free_port
    from testing.hub_standin import HubStandin
    from testing.redis_server import RedisServer

    broker = RedisServer().start()
    hub = HubStandin(port=free_port(), token=HUB_TOKEN, upload_dir=work / "hub").start()
    env = {
        **os.environ,
        "SUPPORTMATRIX_DATABASE_URL": engine.url.render_as_string(hide_password=False),
        "SUPPORTMATRIX_REDIS_URL": broker.url(),
        "SUPPORTMATRIX_DATA_DIR": str(work / "data"),
        "SUPPORTMATRIX_EXPORT_DIR": str(work / "published"),
        "SUPPORTMATRIX_PUBLISH_REPO": REPO,
        "SUPPORTMATRIX_PUBLISH_TOKEN": HUB_TOKEN,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(work / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    out = {}
    try:
        for mode in ("window", "per-result"):
            before = len(hub.commits)
            stack = newest_key(history).stack.model_dump_json()  # the whole stack: every version keys the file
            command = [sys.executable, "-m", "bench.export_scale", mode, stack]
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"bench.export_scale {mode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
            out[mode] = {**json.loads(done.stdout.splitlines()[-1]), "commits": len(hub.commits) - before}
    finally:
        hub.stop()
        broker.stop()
    return out


def run_window(mode: str, key: ExportKey) -> dict[str, int]:
    """In a process configured like the collector: WINDOW results under ``key``, and the exports they ask for."""
    import redis

    from services.worker.collector import export_requested
    from shared.db.engine import new_session
    from shared.jobs.broker import get_producer, request_export
    from shared.jobs.queues import CONTROL_QUEUE
    from shared.settings import get_settings

    producer = get_producer()
    queue = redis.Redis.from_url(get_settings().redis_url)
    queued = int(queue.llen(CONTROL_QUEUE))  # nobody consumes the control queue here: its length counts the tasks
    runs = 0
    if mode == "window":  # written together, asked for together: the one task that was sent runs after the window
        with new_session() as session:
            job_ids = [one_more_job(session, f"bench/window-{i}", key) for i in range(WINDOW)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda job_id: request_export(producer, [job_id]), job_ids))
        runs = int(export_requested() is not None)
    else:  # each result's export runs before the next result: one run per result
        for i in range(WINDOW):
            with new_session() as session:
                job_id = one_more_job(session, f"bench/per-result-{i}", key)
            request_export(producer, [job_id])
            runs += int(export_requested() is not None)
    return {"results": WINDOW, "tasks": int(queue.llen(CONTROL_QUEUE)) - queued, "runs": runs}


def run(work: Path) -> Section:
    from shared.results.export import export_results

    with scratch_schema(SMALL) as (small, history), Session(small) as session:
        export_results(session, work / "warm")  # once first, each: imports and caches are not what is measured
        export_small = timed(lambda: export_results(session, work / "small"))
        record_path(session)
        records_small = record_path(session)
        after_small = export_after_one_job(session, work / "small", history)
        published = window(small, history, work)
    generated = time.perf_counter()
    with scratch_schema(LARGE) as (large, history), Session(large) as session:
        generate_s = time.perf_counter() - generated
        indexed = has_key_index(session)
        full = full_export(session, work)
        after_large = export_after_one_job(session, work / "full", history)
    # What in the export after one job grows with the table: its file's Parquet read and write.
    changed = work / "full" / "data" / newest_key(history).file_name
    rewrite = statistics.median(
        timed(lambda: pq.write_table(pq.read_table(changed), work / "rewritten.parquet")) for _ in range(REPEAT)
    )
    one_job = OneJob(after_small, after_large, pq.read_metadata(changed).num_rows, rewrite)
    return report(full, export_small, records_small, one_job, published, indexed, history, generate_s)


@dataclass(frozen=True)
class OneJob:
    small: list[float]  # seconds of the export after each job, at SMALL rows
    large: list[float]  # ... at LARGE rows
    file_rows: int  # rows of the file those jobs changed, at LARGE rows
    rewrite: float  # seconds to read that file and write it again


def report(
    full: dict[str, float],
    export_small: float,
    records_small: float,
    one_job: OneJob,
    published: dict[str, dict[str, int]],
    indexed: bool,
    history: History,
    generate_s: float,
) -> Section:
    from shared.results.export import READERS

    full_goal = Goal(on="ratio", at_most=3.0)
    ratio = full["ours"] / full["raw"]
    full_note = ""
    if not full_goal.met(ratio):
        full_note = (
            f"{ratio / 3.0:.1f}x over the goal: its reads of the files out of PostgreSQL sum to {full['sql']:.1f} s "
            f"over its {READERS} reader threads ({full['sql'] / full['raw']:.1f}x the raw write, which starts from "
            f"tables in memory); read one at a time they take {full['sequential_sql']:.1f} s, and copying the very "
            f"rows they return out of tables holding exactly them takes {full['copy_out']:.1f} s "
            f"({full['copy_out'] / full['raw']:.1f}x the raw write): what bringing these rows out costs on its own; "
            f"PostgreSQL alone, running the export's queries {READERS} at a time and sending their "
            f"{full['sent_bytes'] / 1e6:,.0f} MB to a client that drops them, takes {full['server_alone']:.1f} s "
            f"({full['server_alone'] / full['raw']:.1f}x the raw write) before any client-side work"
        )
    large, small = statistics.median(one_job.large), statistics.median(one_job.small)
    one_job_note = (
        f"{LARGE:,} / {SMALL:,} results = {large / small:.1f}x: the SQL read is the job's cell; what grows is its "
        f"file, read and written whole ({one_job.file_rows:,} rows: {one_job.rewrite:.2f} s of Parquet I/O alone)"
    )
    ours, each = published["window"], published["per-result"]
    measures = [
        Measure(measure=f"full export, {LARGE:,} results ({full['rows']:,.0f} rows in {full['files']:.0f} files)",
                unit="s", ours=full["ours"], baseline=full["raw"],
                baseline_name="pyarrow write_table of the same tables", goal=full_goal, note=full_note),
        Measure(measure=f"full export, {SMALL:,} results", unit="s", ours=export_small, baseline=records_small,
                baseline_name="the API's record path: a pydantic record per run, then to_table",
                note="the records the export built its files from before (then from ORM rows too)"),
        Measure(measure=f"export after one job, {LARGE:,} results", unit="s", ours=large, baseline=small,
                baseline_name=f"the same at {SMALL:,} results", goal=Goal(on="ours", at_most=1.0),
                note=one_job_note),
        Measure(measure=f"Hub commits for {ours['results']} results in one window", unit="commits",
                ours=ours["commits"], baseline=each["commits"], baseline_name="one export per result",
                goal=Goal(on="ours", at_most=1.0),
                note=f"export tasks sent: {ours['tasks']} (one export per result: {each['tasks']})"),
    ]  # fmt: skip
    details = f"""The results are a fleet's history generated server-side by `testing.bulk_rows` in scratch PostgreSQL
schemas: {LARGE:,} finished jobs ({history.models:,} models, each run once per round over {history.rounds} rounds, a
round on the stack of its time: its compiler, torch and library versions) and {SMALL:,}; the first took
{generate_s:.0f} s. An index on jobs (compiler_version, library, library_version, id):
{"present" if indexed else "absent"}. A file holds one stack's runs, one row per (model, task): the newest of its runs.

| full export, {LARGE:,} results | seconds |
|---|---:|
| ours (`export_results`, into an empty directory) | {full["ours"]:.1f} |
| its SQL reads (`key_cells_arrow`, by ADBC into Arrow), summed over its {READERS} threads | {full["sql"]:.1f} |
| the same reads, one file at a time | {full["sequential_sql"]:.1f} |
| the rows those reads return, copied from tables holding just them, one at a time | {full["copy_out"]:.1f} |
| PostgreSQL alone: the same queries, {READERS} at a time, their {full["sent_bytes"] / 1e6:,.0f} MB sent and dropped \
by the client | {full["server_alone"]:.1f} |
| raw `pyarrow.parquet.write_table` of the same {full["files"]:.0f} tables, already in memory | {full["raw"]:.2f} |
| the same tables read as rows (`FileTables`: Python tuples, then Arrow; SQLite's path) | {full["row_path"]:.1f} |

The raw write starts where the export ends, with the rows already in Arrow; the export has to read them out of the
database first. On PostgreSQL it reads each file's query through ADBC's PostgreSQL driver (`adbc-driver-postgresql`),
which copies the result out as COPY BINARY straight into Arrow columns: no Python object per value, where the row
path above spends {full["row_path"] / full["raw"]:.1f}x the raw write. The files are read {READERS} at a time, each on a
connection of its own, so that the server runs one file's query while the client converts another's. SQL still picks
each cell's newest run from narrow rows (window functions) and only those are read whole; the token id lists are
parsed from their JSON text by Arrow's kernels. The copy-out row above reads the files' rows alone, already chosen,
from temporary tables, one file at a time: what bringing them out of PostgreSQL into Arrow costs here before any
choosing, conversion or write. The PostgreSQL-alone row is the floor under any client, columnar or not: the server
choosing each cell's run (the window functions), fetching those rows whole and sending them, with the client dropping
the bytes; {full["server_alone"] / full["raw"]:.1f}x the raw write here. Taking the choice out of the read would mean
keeping the files' rows in SQL in their final form, written with each result: a second copy of every published row,
which the export does not keep; and rows already in that form, copied out one file at a time (the copy-out row), take
{full["copy_out"] / full["raw"]:.1f}x the raw write themselves.

Export after one job (seconds, each of {REPEAT} reruns of a model in the round in progress): at {SMALL:,} results
{", ".join(f"{s:.3f}" for s in one_job.small)}; at {LARGE:,}: {", ".join(f"{s:.3f}" for s in one_job.large)}. It reads
from SQL only the new result's cell (by model id, which jobs index) and patches that one row of its file; the file is
read and written whole, by Arrow ({one_job.rewrite:.3f} s for its {one_job.file_rows:,} rows at {LARGE:,} results).

A window of {WINDOW} results: {ours["tasks"]} export task sent, {ours["runs"]} run, {ours["commits"]} commit. One
export per result: {each["runs"]} runs, {each["commits"]} commits.
"""
    return Section(name="export", title="P6 — export: full, incremental, publish", measures=measures, details=details)


def main() -> int:
    from shared.contracts.run import Stack
    from shared.results.export import ExportKey

    parser = argparse.ArgumentParser(description="(internal) the window part of bench/export_scale.py")
    parser.add_argument("mode", choices=["window", "per-result"])
    parser.add_argument("stack", type=Stack.model_validate_json, help="the results' stack, as a Stack's JSON")
    args = parser.parse_args()
    print(json.dumps(run_window(args.mode, ExportKey.of(args.stack))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

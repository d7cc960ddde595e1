"""The export after results come in: only their files and cells are rewritten, requests within a window share one
export run (and one Hub commit), and nothing is left out when many workers finish at once."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import datasets
import duckdb
import pandas as pd
import pyarrow.parquet as pq
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import Verdict
from shared.contracts.run import RuntimeInfo
from shared.db.models import Job, Result
from shared.jobs.broker import (
    EXPORT_SCHEDULED_KEY,
    PENDING_EXPORTS_KEY,
    PendingExports,
    make_celery,
    request_export,
)
from shared.jobs.queues import CONTROL_QUEUE
from shared.results.cells import CellStatus
from shared.results.export import export_jobs, export_results, file_name
from shared.results.records import ResultRecord, query_results, to_table
from shared.settings import Settings
from testing.hub_standin import HubStandin
from testing.redis_server import RedisServer
from tests.conftest import HUB_TOKEN, ROOT, RUN_DIR, fresh_database
from tests.history import record, runtime

A, B = runtime("2.21.0+x", "5.24.0"), runtime("2.21.0+x", "5.25.0")
REPO = "supportmatrix/incremental-export"


def finished(session: Session, model: str, rt: RuntimeInfo, verdict: Verdict, **kw: Any) -> int:
    """One finished run, as a worker writes it; its job id."""
    record(session, model, rt, verdict, **kw)
    job_id = session.scalar(sa.select(sa.func.max(Job.id)).where(Job.model_id == model))
    assert job_id is not None
    return job_id


def data_file(export: Path, rt: RuntimeInfo) -> Path:
    return export / "data" / file_name("transformers", rt.stack())


def results_by_model(path: Path) -> dict[str, str]:
    table = pq.read_table(path, columns=["model_id", "result"])
    return dict(zip(table["model_id"].to_pylist(), table["result"].to_pylist(), strict=True))


def test_a_finished_job_rewrites_only_its_file_and_cells_as_a_full_export_would(
    session: Session, tmp_path: Path
) -> None:
    for model in ("org/one", "org/two", "org/three"):
        finished(session, model, A, Verdict.PASS)
    finished(session, "org/one", B, Verdict.PASS)
    export = tmp_path / "export"
    export_results(session, export)
    untouched = data_file(export, B).stat().st_mtime_ns

    rerun = finished(session, "org/two", A, Verdict.FAIL, force=True)  # a rerun of the same commit that disagrees
    newer = finished(session, "org/three", A, Verdict.FAIL, sha="c" * 40)  # a new commit starts the cell afresh
    summary = export_jobs(session, export, [rerun, newer])
    assert summary.written == [data_file(export, A)] and summary.unchanged == []  # B's file is not even read
    assert data_file(export, B).stat().st_mtime_ns == untouched
    assert results_by_model(data_file(export, A)) == {"org/one": "PASS", "org/two": "FLAKY", "org/three": "FAIL"}

    rebuilt = export_results(session, tmp_path / "rebuilt")
    for path in rebuilt.written:
        assert pq.read_table(export / "data" / path.name).equals(pq.read_table(path)), path.name
    assert export_jobs(session, export, [rerun]).unchanged == [data_file(export, A)]  # nothing new: not rewritten


def test_a_full_export_removes_the_files_of_no_key_with_results(session: Session, tmp_path: Path) -> None:
    export = tmp_path / "export"
    finished(session, "org/kept", A, Verdict.PASS)
    gone = finished(session, "org/gone", B, Verdict.PASS)
    export_results(session, export)
    older = export / "data" / "2.21.0+x--transformers-5.24.0.parquet"  # the same key, as schema 5 named its file
    shutil.copy(data_file(export, A), older)
    session.execute(sa.delete(Result).where(Result.job_id == gone))  # B's only result: B's key has none left
    session.commit()
    summary = export_results(session, export)
    assert summary.removed == sorted([older, data_file(export, B)]) and summary.unchanged == [data_file(export, A)]
    assert sorted((export / "data").iterdir()) == [data_file(export, A)]


def test_a_result_nobody_asked_an_export_for_goes_out_with_the_next_export(session: Session, tmp_path: Path) -> None:
    export = tmp_path / "export"
    first = finished(session, "org/first", A, Verdict.PASS)
    assert export_jobs(session, export, [first]).written == [data_file(export, A)]  # no export yet: a full one
    finished(session, "org/refused", B, Verdict.SKIPPED)  # written without a worker, as a refusal at submission is
    asked = finished(session, "org/asked", A, Verdict.PASS)
    export_jobs(session, export, [asked])
    assert set(results_by_model(data_file(export, A))) == {"org/first", "org/asked"}
    assert results_by_model(data_file(export, B)) == {"org/refused": "SKIPPED"}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_exported_rows_are_the_records_the_api_serves(kind: str, tmp_path: Path) -> None:
    """The export reads SQL rows straight into Arrow columns; the API builds records. Same bytes in the file."""
    with fresh_database(kind, tmp_path) as engine, Session(engine, expire_on_commit=False) as session:
        passes = finished(session, "org/passes", A, Verdict.PASS)
        finished(session, "org/breaks", A, Verdict.ERROR)  # an error class, a failure signature
        diverges = finished(session, "org/diverges", A, Verdict.FAIL)
        for job_id, generated in ((passes, [791, 6722, 374]), (diverges, [791, 6722, 13])):  # JSON columns
            tokens = {"generated_token_ids": generated, "reference_token_ids": [791, 6722, 374]}
            session.execute(sa.update(Result).where(Result.job_id == job_id).values(tokens))
        session.commit()
        finished(session, "org/passes", A, Verdict.FAIL, force=True)  # a rerun that disagrees: FLAKY
        export_results(session, tmp_path / "export")
        newest: dict[tuple[str, str], ResultRecord] = {}
        for rec in query_results(session).records:  # newest first
            newest.setdefault((rec.model_id, rec.task), rec)
        flaky = {"result": CellStatus.FLAKY}
        expected = [r.model_copy(update=flaky) if r.model_id == "org/passes" else r for _, r in sorted(newest.items())]
        assert pq.read_table(data_file(tmp_path / "export", A)).equals(to_table(expected))


def read_open_file(path: Path, read: Callable[[Any], Any]) -> Any:
    with path.open("rb") as file:
        return read(file)


def duckdb_rows(file: Any) -> Any:
    return duckdb.connect().read_parquet(file).fetch_arrow_table()


READS_OF_A_WHOLE_FILE: dict[str, Callable[[Path], Any]] = {
    # Each takes a file's footer and its pages from one open. pq.read_table(path), pd.read_parquet(path) and
    # DuckDB's read_parquet(path) of one file do not: they open it again after reading its footer
    # (apache/arrow#35894), and a file replaced in between pairs the old footer with the new pages - "Page was
    # smaller than expected", whatever the writer does (bench/torn_reads.py counts them). docs/index.md says which
    # reads to use.
    "pq.ParquetFile": lambda path: pq.ParquetFile(path).read(),
    "pq.read_table of an open file": lambda path: read_open_file(path, pq.read_table),
    "pd.read_parquet of an open file": lambda path: read_open_file(path, pd.read_parquet),
    "pd.read_parquet of the directory": lambda path: pd.read_parquet(path.parent),
    "DuckDB's read_parquet of an open file": lambda path: read_open_file(path, duckdb_rows),
    "datasets' Dataset.from_parquet": lambda path: datasets.Dataset.from_parquet(str(path), keep_in_memory=True),
}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_readers_never_see_a_partial_file_while_bursts_of_full_and_incremental_exports_replace_them(
    kind: str, tmp_path: Path
) -> None:
    """Every file read back whole, again and again, while exports rewrite it: the incremental one and the full one
    (on PostgreSQL the full export reads with its pool of reader threads, on SQLite with one connection)."""
    export, models = tmp_path / "export", [f"org/model-{i}" for i in range(24)]
    with fresh_database(kind, tmp_path) as engine, Session(engine, expire_on_commit=False) as session:
        for i, model in enumerate(models):
            finished(session, model, (A, B)[i % 2], Verdict.PASS)
        export_results(session, export)
        files = sorted((export / "data").glob("*.parquet"))
        stop, failures, reads = threading.Event(), list[str](), Counter[str]()

        def read_continuously(how: str) -> None:
            read = READS_OF_A_WHOLE_FILE[how]
            while not stop.is_set():
                for path in files:
                    try:
                        table = read(path)
                    except Exception as error:  # a torn file shows as any error of the reader's
                        failures.append(f"{how} {path.name}: {error!r}")
                        continue
                    if len(table) != (len(models) if how.endswith("directory") else len(models) // 2):
                        failures.append(f"{how} {path.name}: {len(table)} rows")
                    reads[how] += 1

        readers = [threading.Thread(target=read_continuously, args=(how,)) for how in READS_OF_A_WHOLE_FILE]
        for reader in readers:
            reader.start()
        replaced = 0
        try:
            for burst in range(12):  # each burst: a rerun of three models that flips their cells, then its export
                jobs = [
                    finished(session, model, (A, B)[i % 2], (Verdict.FAIL, Verdict.PASS)[burst % 2], force=True)
                    for i, model in enumerate(models)
                    if i % 8 == burst % 8
                ]
                summary = export_results(session, export) if burst % 3 == 2 else export_jobs(session, export, jobs)
                replaced += len(summary.written)
        finally:
            stop.set()
            for reader in readers:
                reader.join()
    assert failures == []
    assert replaced >= 12 and min(reads[how] for how in READS_OF_A_WHOLE_FILE) >= 12, (replaced, reads)
    assert [p.name for p in (export / "data").iterdir()] == [p.name for p in files]  # no temp file left behind


# --- coalescing, through a real broker and a real collector ------------------------------------------------


@pytest.fixture
def broker() -> Iterator[str]:
    """A Redis of this test's own: its control queue and export set hold only what the test puts there."""
    server = RedisServer().start()
    yield server.url()
    server.stop()


def queued_tasks(url: str) -> int:
    return int(redis.Redis.from_url(url).llen(CONTROL_QUEUE))


def test_requests_within_a_window_send_one_export_task_and_keep_every_job(broker: str) -> None:
    producer = make_celery(Settings(redis_url=broker))
    with ThreadPoolExecutor(8) as pool:  # eight workers finishing at once
        list(pool.map(lambda job_id: request_export(producer, [job_id]), range(1, 41)))
    assert queued_tasks(broker) == 1

    pending = PendingExports(broker)
    with pending.exclusive(wait=False) as held:
        assert held
        with PendingExports(broker).exclusive(wait=False) as second:
            assert not second  # one export at a time
        assert pending.take() == set(range(1, 41))
        request_export(producer, [41])  # after the take: it schedules the next export itself
        assert queued_tasks(broker) == 2
        pending.done(range(1, 41))
    assert pending.take() == {41}


class Collector:
    """The control worker, as deployed (a Celery worker on the control queue), on a database, broker and Hub of
    the test's own."""

    def __init__(self, env: dict[str, str], name: str) -> None:
        self.log = RUN_DIR / f"{name}.log"
        command = [sys.executable, "-m", "celery", "-A", "services.worker.celery_app:app", "worker",
                   "-Q", CONTROL_QUEUE, "--pool", "solo", "--hostname", f"{name}@%h", "--loglevel", "INFO"]  # fmt: skip
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.wait_for(lambda: " ready." in self.text(), "ready")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, done: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"collector: not {what}:\n{self.text()[-3000:]}")
            time.sleep(0.2)

    def export_runs(self) -> list[tuple[int, int]]:
        """(jobs, files written) of each export run that found jobs."""
        runs = re.findall(
            r"supportmatrix\.export\[[^]]+\] succeeded in [\d.]+s: '(\d+) jobs: [^:]*: (\d+) written", self.text()
        )
        return [(int(jobs), int(written)) for jobs, written in runs]

    def idle(self) -> bool:
        """Every export task received has ended (its log line written)."""
        events = re.findall(r"supportmatrix\.export\[[^]]+\] (received|succeeded|retry:|raised)", self.text())
        received = events.count("received")
        return received == len(events) - received

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(30)


@pytest.mark.slow
def test_results_finishing_together_are_all_exported_by_few_runs_of_one_commit_each(
    broker: str, tmp_path: Path
) -> None:
    export = tmp_path / "export"
    hub = HubStandin(token=HUB_TOKEN, upload_dir=tmp_path / "hub").start()
    with fresh_database("postgresql", tmp_path) as engine:
        env = {
            "SUPPORTMATRIX_DATABASE_URL": engine.url.render_as_string(hide_password=False),
            "SUPPORTMATRIX_REDIS_URL": broker,
            "SUPPORTMATRIX_EXPORT_DIR": str(export),
            "SUPPORTMATRIX_PUBLISH_REPO": REPO,
            "SUPPORTMATRIX_PUBLISH_TOKEN": HUB_TOKEN,
            "HF_ENDPOINT": hub.url,
        }
        collector = Collector(env, "collector-incremental")
        producer = make_celery(Settings(redis_url=broker))
        client = redis.Redis.from_url(broker)

        def settled(expected: set[int]) -> Callable[[], bool]:
            def done() -> bool:
                exported = {
                    j
                    for p in (export / "data").glob("*.parquet")
                    for j in pq.ParquetFile(p).read(["job_id"])["job_id"].to_pylist()
                }
                waiting = client.exists(PENDING_EXPORTS_KEY, EXPORT_SCHEDULED_KEY) or queued_tasks(broker)
                return exported >= expected and not waiting and collector.idle()

            return done

        def finish(i: int, prefix: str) -> int:
            with Session(engine, expire_on_commit=False) as own:  # each worker its own connection
                return finished(own, f"org/{prefix}-{i}", (A, B)[i % 2], Verdict.PASS)

        try:
            # Ten jobs written, then their ten workers ask at once: one export run, one commit.
            with ThreadPoolExecutor(10) as pool:
                burst = list(pool.map(lambda i: finish(i, "burst"), range(10)))
                list(pool.map(lambda job_id: request_export(producer, [job_id]), burst))
            collector.wait_for(settled(set(burst)), "done with the burst")
            assert len(collector.export_runs()) == 1 and len(hub.commits) == 1, collector.export_runs()

            # Six workers each finishing eight short jobs, asking for an export after each: over a few windows,
            # so that some requests come while an export runs.
            def worker(w: int) -> list[int]:
                done = []
                for i in range(8):
                    time.sleep(0.2)
                    done.append(finish(i, f"w{w}"))
                    request_export(producer, done[-1:])
                return done

            with ThreadPoolExecutor(6) as pool:
                jobs = [job_id for done in pool.map(worker, range(6)) for job_id in done]
            collector.wait_for(settled(set(burst) | set(jobs)), "done with every job")
        finally:
            collector.stop()
            hub.stop()
    runs = collector.export_runs()[1:]
    assert 1 <= len(runs) <= len(jobs) // 4, runs  # 48 results: a few runs, each one commit
    assert sum(taken for taken, _ in runs) == len(jobs) and all(written <= 2 for _, written in runs)
    assert len(hub.commits) == 1 + len(runs)

"""Migrations up and down on SQLite and PostgreSQL, no drift between the models and the migrations, and the
results' version that migration 0015's triggers keep."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from alembic import command
from sqlalchemy.orm import Session

from shared.contracts.enums import Verdict
from shared.db.engine import make_engine
from shared.db.migrate import alembic_config, downgrade, upgrade
from shared.db.models import Job, Result
from shared.hub.client import ResolvedModel
from shared.jobs.dispatch import withdraw
from shared.jobs.lease import acquire_lease
from shared.jobs.outcomes import finish
from shared.jobs.submission import submit
from shared.results.records import records_version
from shared.settings import Settings
from tests.conftest import PG_BASE, fresh_database, pg_url
from tests.history import report_of, runtime

TABLES = {
    "jobs", "results", "results_version", "workers", "sweeps", "sweep_entries", "reference_runs", "queues_seen",
    "api_tokens",
}  # fmt: skip


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'schema.db'}"
        return
    schema = f"migr_{uuid.uuid4().hex[:10]}"
    plain = PG_BASE.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield pg_url(schema)
    finally:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_migrations_go_up_and_down_and_match_the_models(empty_database: str) -> None:
    upgrade(empty_database)
    assert tables(empty_database) == TABLES
    command.check(alembic_config(empty_database))  # raises when models and migrations differ
    downgrade(empty_database)
    assert tables(empty_database) == set()
    upgrade(empty_database)
    assert tables(empty_database) == TABLES


# --- the results' version (migration 0015): what lets the API keep its answers ---------------------------------


def _leased_jobs(session: Session, prefix: str, count: int) -> list[int]:
    """``count`` queued jobs, each leased by the worker ``w`` (committed)."""
    rt = runtime("2.21.0+version", "5.24.0")
    ids = []
    for i in range(count):
        model = ResolvedModel(model_id=f"{prefix}/m{i}", sha=f"{i:040d}", gated=False, pipeline_tag=None)
        [sub] = submit(session, model, None, [rt])
        session.flush()
        acquire_lease(session, sub.job.id, "w", Settings())
        ids.append(sub.job.id)
    session.commit()
    return ids


def _finish(session: Session, job_id: int) -> None:
    assert finish(
        session, job_id, "w", report_of(model_id="v/m", task="text-generation", backend="neuron", verdict=Verdict.PASS)
    )


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_every_write_of_results_raises_their_version_as_it_commits(kind: str, tmp_path: Path) -> None:
    """Inserting, changing and deleting results (a withdrawn submission's, or with their job), and truncating them,
    each raise the version as they commit, and only then; to at least the time in microseconds, so that a database
    migrated or restored anew goes on above every number it held."""
    started_us = time.time_ns() // 1000
    with fresh_database(kind, tmp_path) as engine, Session(engine) as session:

        def version() -> int:  # as another connection sees it: what is committed
            with Session(engine) as reader:
                return records_version(reader).results

        seen = [version()]

        def raised() -> bool:
            seen.append(version())
            return seen[-1] > seen[-2]

        assert seen[0] >= started_us - 1000  # SQLite's clock is read to the millisecond
        first, second, third = _leased_jobs(session, "v", 3)
        assert not raised(), "jobs are not results"
        _finish(session, first)
        _finish(session, second)
        assert not raised(), "not before they commit"
        session.commit()
        assert raised()
        session.execute(sa.update(Result).where(Result.job_id == first).values(verdict_reason="changed"))
        session.commit()
        assert raised()
        _finish(session, third)
        session.commit()
        assert raised()
        withdraw(session, [third])
        session.commit()
        assert raised()
        session.execute(sa.delete(Job).where(Job.id == second))  # its result goes with it
        session.commit()
        assert raised() and session.scalar(sa.select(sa.func.count()).select_from(Result)) == 1
        if kind == "postgresql":
            session.execute(sa.text("TRUNCATE results"))
            session.commit()
            assert raised()
        assert seen[-1] >= time.time_ns() // 1000 - 60_000_000, "raised to the time, not by one"


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "immediate"])
def test_two_writers_of_results_never_deadlock_over_the_version(deferred: bool, tmp_path: Path) -> None:
    """A writes a result, then waits for a job row B holds; B then writes a result. Raised as each commits, the
    version's row is the last lock either takes, and both commit. Raised at once (the counterfactual: each writer's
    transaction sets the trigger IMMEDIATE), A holds it while waiting for B, and B waits for it: PostgreSQL aborts
    one."""
    with fresh_database("postgresql", tmp_path) as engine, Session(engine) as a, Session(engine) as b:
        job_a, job_b = _leased_jobs(a, "deadlock", 2)
        if not deferred:
            for writer in (a, b):
                writer.execute(sa.text("SET CONSTRAINTS results_version_raise IMMEDIATE"))
        b.execute(sa.update(Job).where(Job.id == job_b).values(heartbeat_at=sa.func.now()))  # B holds job B's row
        _finish(a, job_a)
        a.flush()
        a_pid = a.connection().exec_driver_sql("SELECT pg_backend_pid()").scalar_one()

        def a_goes_on() -> None:
            a.execute(sa.update(Job).where(Job.id == job_b).values(heartbeat_at=sa.func.now()))  # waits for B
            a.commit()

        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(a_goes_on)
            deadline = time.monotonic() + 30
            with engine.connect() as watch:  # until A waits for B's lock
                while not watch.execute(
                    sa.text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"), {"pid": a_pid}
                ).scalar_one():
                    assert time.monotonic() < deadline, "A never waited for job B's row"
                    time.sleep(0.05)
            deadlocked = []
            for writer, goes_on in ((b, lambda: (_finish(b, job_b), b.commit())), (a, lambda: waiting.result(30))):
                try:
                    goes_on()
                except sa.exc.OperationalError as exc:
                    deadlocked.append(str(exc.orig))
                    writer.rollback()
        if deferred:
            assert deadlocked == [] and b.scalar(sa.select(sa.func.count()).select_from(Result)) == 2
        else:
            assert len(deadlocked) == 1 and "deadlock detected" in deadlocked[0]

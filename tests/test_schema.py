"""Migrations up and down on SQLite and PostgreSQL, no drift between the models and the migrations, the
results' version that migration 0015's triggers keep, and the queues migration 0016 renames by stack."""

from __future__ import annotations

import datetime as dt
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
from shared.contracts.run import RuntimeInfo, Stack
from shared.db.engine import make_engine
from shared.db.migrate import alembic_config, downgrade, upgrade
from shared.db.models import Job, QueueSeen, Result, Worker
from shared.hub.client import ResolvedModel
from shared.jobs.dispatch import withdraw
from shared.jobs.lease import acquire_lease
from shared.jobs.outcomes import finish
from shared.jobs.queues import job_queue
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


# --- the whole stack is the identity (migration 0016) ----------------------------------------------------------

# The jobs table as revision 0015 has it (no stack digest yet), for rows planted before the upgrade.
JOBS_0015 = sa.table("jobs", *(sa.column(c.key) for c in Job.__table__.columns if c.key != "stack_digest"))


def test_migration_0016_renames_the_queues_of_jobs_still_to_run_by_their_stack(empty_database: str) -> None:
    """Up: each active job gets the queue its stack is served on now (``job_queue``, so that the reconciler re-sends
    it there), its new queue is marked live as its old one was (no early ERROR(no_worker)), a finished job keeps its
    queue, and two active jobs that differ only in torch are two tests. Down: the compiler's queue names again."""
    upgrade(empty_database, "0015")
    engine = make_engine(empty_database)
    old_queue = "supportmatrix.jobs.neuron.2.28.7631.0.c2"
    base = {"sha": "a" * 40, "task": "text-generation", "config_hash": "h", "backend": "neuron",
            "compiler_name": "neuronx-cc", "compiler_version": "2.28.7631.0", "library": "transformers",
            "library_version": "5.24.0", "torch_neuronx_version": "2.13.3.0.1", "neuron_runtime_version": "2.30",
            "cores": 2, "queue": old_queue, "attempts": 0, "gated": False, "trust_remote_code": False,
            "attempt_log": "[]"}  # fmt: skip
    rows = [("org/queued", "queued", "2.13.0"), ("org/running", "running", "2.13.0"), ("org/done", "done", "2.13.0")]
    seen_at = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    with engine.begin() as conn:
        for model_id, state, torch in rows:
            values = {**base, "model_id": model_id, "state": state, "torch_version": torch, "created_at": seen_at}
            conn.execute(sa.insert(JOBS_0015).values(values))
        conn.execute(sa.insert(QueueSeen.__table__).values(queue=old_queue, last_live_at=seen_at))
    upgrade(empty_database)
    stack = Stack(compiler_version="2.28.7631.0", torch_version="2.13.0", torch_neuronx_version="2.13.3.0.1",
                  neuron_runtime_version="2.30", library_version="5.24.0")  # fmt: skip
    new_queue = job_queue("neuron", stack, 2)
    with engine.begin() as conn:
        queues = dict(conn.execute(sa.select(Job.model_id, Job.queue)).tuples().all())
        digests = dict(conn.execute(sa.select(Job.model_id, Job.stack_digest)).tuples().all())
        seen = dict(conn.execute(sa.select(QueueSeen.queue, QueueSeen.last_live_at)).tuples().all())
        # the same test on another torch, active beside the first: the index takes torch's version now
        other = {**base, "model_id": "org/queued", "state": "queued", "torch_version": "2.13.1", "queue": "q"}
        conn.execute(sa.insert(Job.__table__).values(other))
    assert queues == {"org/queued": new_queue, "org/running": new_queue, "org/done": old_queue}
    assert set(digests.values()) == {stack.digest}  # every job's, finished or not: what the stack axis reads
    assert new_queue.startswith("supportmatrix.jobs.neuron.2.28.7631.0.stack-") and new_queue.endswith(".c2")
    assert set(seen) == {old_queue, new_queue} and seen[new_queue].replace(tzinfo=dt.UTC) == seen_at
    with engine.begin() as conn:
        conn.execute(sa.delete(Job.__table__).where(Job.queue == "q"))  # down, they would be one test again
    downgrade(empty_database, "0015")
    with engine.begin() as conn:
        queues = dict(conn.execute(sa.text("SELECT model_id, queue FROM jobs")).tuples().all())
    assert queues == {"org/queued": old_queue, "org/running": old_queue, "org/done": old_queue}
    engine.dispose()


def test_migration_0016_says_the_stacks_served_last_and_the_versions_finished_jobs_ran(empty_database: str) -> None:
    """Up: each stack's new queue keeps the runtime its workers' newest row says (planned for once no worker is live),
    as live as their old queue was; a finished job takes the torch, TorchNeuron and runtime versions its result
    reported where they differ, and keeps its own where the result said none. Down leaves what ran."""
    upgrade(empty_database, "0015")
    engine = make_engine(empty_database)
    old_queue = "supportmatrix.jobs.neuron.2.28.7631.0.c1"
    served = {"backend": "neuron", "compiler_name": "neuronx-cc", "compiler_version": "2.28.7631.0",
              "compiler_build": "2.28.7631.0+abc", "library": "transformers", "library_version": "5.24.0",
              "torch_version": "2.13.0", "torch_neuronx_version": "2.13.3.0.1",
              "neuron_runtime_version": "2.30"}  # fmt: skip
    seen_at = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    planned = {"torch_version": "2.13.0", "torch_neuronx_version": "2.13.3.0.0", "neuron_runtime_version": "2.29"}
    reported = {  # per job: what its result said ("" and None: said nothing)
        "org/ran-other": {"torch_version": "2.13.0", "torch_neuronx_version": "2.13.3.0.1",
                          "neuron_runtime_version": "2.30"},
        "org/said-nothing": {"torch_version": "", "torch_neuronx_version": None, "neuron_runtime_version": ""},
    }  # fmt: skip
    job = {"sha": "a" * 40, "task": "text-generation", "config_hash": "h", "backend": "neuron",
           "compiler_name": "neuronx-cc", "compiler_version": "2.28.7631.0", "library": "transformers",
           "library_version": "5.24.0", "cores": 1, "queue": old_queue, "attempts": 1, "gated": False,
           "trust_remote_code": False, "attempt_log": "[]", "created_at": seen_at, **planned}  # fmt: skip
    with engine.begin() as conn:
        for name, beat in (("w-old", seen_at - dt.timedelta(hours=1)), ("w-new", seen_at)):
            older = {"torch_neuronx_version": "2.13.3.0.0"} if name == "w-old" else {}  # another stack, earlier
            conn.execute(sa.insert(Worker.__table__).values(
                name=name, host="h", pid=1, cores="0", core_count=1, queue=old_queue, started_at=beat,
                heartbeat_at=beat, **{**served, **older}))  # fmt: skip
        conn.execute(sa.insert(QueueSeen.__table__).values(queue=old_queue, last_live_at=seen_at))
        for model_id, versions in reported.items():
            job_id = conn.execute(sa.insert(JOBS_0015).values(
                **job, model_id=model_id, state="done").returning(JOBS_0015.c.id)).scalar_one()  # fmt: skip
            conn.execute(sa.insert(Result.__table__).values(job_id=job_id, verdict="PASS", created_at=seen_at,
                                                            **versions))  # fmt: skip
    upgrade(empty_database)
    stack = Stack(compiler_version="2.28.7631.0", torch_version="2.13.0", torch_neuronx_version="2.13.3.0.1",
                  neuron_runtime_version="2.30", library_version="5.24.0")  # fmt: skip
    earlier = stack.model_copy(update={"torch_neuronx_version": "2.13.3.0.0"})
    with engine.begin() as conn:
        seen = {q: (at, rt) for q, at, rt in conn.execute(sa.select(QueueSeen.queue, QueueSeen.last_live_at,
                                                                       QueueSeen.runtime))}  # fmt: skip
        versions = {row.model_id: {n: getattr(row, n) for n in planned} for row in conn.execute(sa.select(Job))}
        digests = {row.model_id: row.stack_digest for row in conn.execute(sa.select(Job))}
    new_queue, earlier_queue = job_queue("neuron", stack, 1), job_queue("neuron", earlier, 1)
    assert set(seen) == {old_queue, new_queue, earlier_queue}
    at, runtime = seen[new_queue]
    assert at.replace(tzinfo=dt.UTC) == seen_at and RuntimeInfo.model_validate(runtime) == RuntimeInfo(**served)
    assert RuntimeInfo.model_validate(seen[earlier_queue][1]).stack() == earlier
    assert seen[earlier_queue][0].replace(tzinfo=dt.UTC) == seen_at - dt.timedelta(hours=1)  # its worker's last beat
    assert seen[old_queue][1] is None
    assert versions == {"org/ran-other": reported["org/ran-other"], "org/said-nothing": planned}
    assert digests == {"org/ran-other": stack.digest, "org/said-nothing": stack.model_copy(update=planned).digest}
    downgrade(empty_database, "0015")
    with engine.begin() as conn:
        kept = {row.model_id: row.torch_neuronx_version for row in conn.execute(sa.text("SELECT * FROM jobs"))}
    assert kept == {"org/ran-other": "2.13.3.0.1", "org/said-nothing": "2.13.3.0.0"}
    engine.dispose()

"""Faults with real processes: each ends with exactly one result row per job and every job in its final state,
found and sent again within the lease timeout plus two reconciler periods.

The module runs a stack of its own, so that it can break it: a redis-server it kills and restarts, a
PostgreSQL schema of its own reached through a proxy it cuts, the reconciler on the locked beat scheduler, a
control worker and a verdict worker — all with short timeouts. Accelerator workers are started per test, since
every test breaks them differently. The suite's workers never see these jobs (another Redis, another schema),
and this module's reconciler never sees theirs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import FINISHED_STATES, ErrorClass, JobState, Stage, SweepState
from shared.db.models import Job, Result, Sweep, SweepEntry, utcnow
from shared.jobs.attempts import Attempt, attempts
from shared.jobs.broker import make_celery, request_sweep
from shared.jobs.dispatch import commit_and_enqueue
from shared.jobs.submission import Request, submit_model
from shared.jobs.sweeps import open_sweep
from shared.processes import free_port
from shared.settings import Settings
from testing.netns import NetnsHost
from testing.redis_server import RedisServer
from testing.services import port_answers, short_leases
from testing.tcp_proxy import Cut, TcpProxy
from tests.conftest import PG_BASE, ROOT, RUN_DIR, stage_runner
from tests.machine_speed import bound
from tests.test_stages import frozen, runner_starts

LEASE_S, HEARTBEAT_S, RECONCILE_S, GRACE_S, STALE_S = 6, 1, 2, 4, 5
RECLAIM_S = LEASE_S + 2 * RECONCILE_S  # a lost job is running again within this of its loss
# A loaded 2-CPU machine's delay in starting the next attempt, on top of RECLAIM_S: the suite runs two test
# processes at once (pytest-xdist), so another test's runners compete for the CPUs (9.8 s seen in CI while the
# other process started zygotes, each importing torch); and a reconcile task may queue behind an export, which
# holds the control worker for its window (EXPORT_WINDOW_S, 1 s). Tuned on the suite's 2-CPU machine (12 s), and
# scaled by this machine's measured speed (tests/machine_speed.py), as is the next.
STARTUP_S = bound(12)
RUN_S = bound(90)  # one job's two stages, start to end, on a loaded 2-CPU machine
COMPILER = "eager-2.13.0+cpu"  # SUPPORTMATRIX_CPU_COMPILE_BACKEND=eager: no compile, no other module's queue
# The stack's logs (each process's output); set SUPPORTMATRIX_TEST_FAULT_LOGS to keep them after the run.
LOGS = Path(os.environ.get("SUPPORTMATRIX_TEST_FAULT_LOGS", RUN_DIR / "faults-logs"))
ORG = "faults"
HOST = "faults"  # this stack's host: its verdict queue is supportmatrix.verdict.faults
# A Redis restart's cases: with persistence, the lonely case (one running job, nothing else queued); without,
# issue 8's reproduction (one job running, one waiting behind it).
SWEEPS = {"aof": ["tiny-gpt2"], "volatile": ["tiny-gpt2", "tiny-qwen3"]}
SWEPT = [f"{ORG}/swept-{case}-{i}" for case, models in SWEEPS.items() for i in range(1, len(models) + 1)]
SHORT = {
    **short_leases(LEASE_S, HEARTBEAT_S, RECONCILE_S, GRACE_S, STALE_S),
    "SUPPORTMATRIX_CPU_COMPILE_BACKEND": "eager",
    "SUPPORTMATRIX_HOST_NAME": HOST,
    "SUPPORTMATRIX_REMOTE_CODE_ORGS": json.dumps([ORG]),
    # A sweep here is its pinned selection only: the models of both Redis restart cases (see that test).
    "SUPPORTMATRIX_SWEEP_TASKS": "[]",
    "SUPPORTMATRIX_SWEEP_SELECTED": json.dumps(SWEPT),
}


# --- processes ---------------------------------------------------------------------------------------------


class Proc:
    """A process of the stack in its own process group, its output in a log (``log``, read by the helpers of
    tests.test_stages); ``prefix`` runs it elsewhere (inside a network namespace)."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], prefix: Sequence[str] = ()) -> None:
        self.name = name
        self.log = LOGS / f"{name}.log"
        self.proc = subprocess.Popen(
            [*prefix, *argv],
            cwd=ROOT,
            env=env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.text()[-3000:]}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: {what} not within {timeout:.0f} s:\n{self.text()[-3000:]}")

    def wait_logged(self, text: str, timeout: float = 90) -> None:
        self.wait_for(lambda: text in self.text(), repr(text), timeout)

    def kill(self) -> None:
        """SIGKILL to the whole process group: the worker and its pool, as an OOM kill or a lost machine."""
        if self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        stop_all([self])


def stop_all(procs: Sequence[Proc], timeout: float = 20) -> None:
    """SIGTERM to each (a warm shutdown: workers deregister), all at once; SIGKILL to what outlives ``timeout``."""
    for proc in procs:
        if proc.proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()


CELERY = [sys.executable, "-m", "celery", "-A", "services.worker.celery_app:app"]


def worker_argv(name: str, cores: str | None) -> list[str]:
    role = ["--cores", cores] if cores is not None else ["--verdict"]
    return [sys.executable, "-m", "services.worker", "--name", name, *role, "--loglevel", "INFO"]


# --- the stack ---------------------------------------------------------------------------------------------


@dataclass
class Stack:
    redis: RedisServer
    db: TcpProxy  # every process of the stack reaches PostgreSQL through it; the test reads it directly
    env: dict[str, str]
    settings: Settings  # the submitter's (this test process): the stack's URLs and short timeouts
    engine: sa.Engine
    procs: list[Proc] = field(default_factory=list)
    verdicts: Proc | None = None  # this host's verdict worker

    @functools.cached_property
    def producer(self) -> Any:
        return make_celery(self.settings, "faults-producer")

    def session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def submit(self, model_id: str) -> int:
        """One job for our compiler on one core, as POST /jobs makes it: committed, then enqueued."""
        with self.session() as session:
            request = Request(model_id, compilers=[COMPILER], cores=1, force=True)
            [submitted] = submit_model(session, self.settings, request)
            assert submitted.created and submitted.enqueue, f"{model_id}: an existing or settled job"
            commit_and_enqueue(session, self.producer, [submitted])
            return submitted.job.id

    def job(self, job_id: int) -> Job:
        with self.session() as session:
            job = session.get(Job, job_id)
            assert job is not None
            return job

    def rows(self, job_id: int) -> int:
        with self.session() as session:
            return int(session.scalar(sa.select(sa.func.count()).select_from(Result).where(Result.job_id == job_id)))

    def wait_state(self, job_ids: Sequence[int], states: Sequence[JobState], timeout: float) -> list[Job]:
        deadline = time.monotonic() + timeout
        while True:
            jobs = [self.job(i) for i in job_ids]
            if all(j.state in states for j in jobs):
                return jobs
            if time.monotonic() > deadline:
                seen = {j.id: (j.state.value, j.lease_owner, j.attempt_log) for j in jobs}
                wanted = [s.value for s in states]
                raise AssertionError(f"not all of {list(job_ids)} in {wanted} after {timeout} s: {seen}")
            time.sleep(0.3)

    def wait_final(self, job_ids: Sequence[int], timeout: float = RECLAIM_S + RUN_S) -> list[Job]:
        return self.wait_state(job_ids, FINISHED_STATES, timeout)

    def start_worker(self, name: str, cores: str | None = "0", prefix: Sequence[str] = (), **env: str) -> Proc:
        proc = Proc(name, worker_argv(name, cores), {**self.env, **env}, prefix)
        self.procs.append(proc)
        return proc

    def wait_serving(self, *workers: Proc) -> None:
        """Each accelerator worker registered (it consumes its queue), each verdict worker ready."""
        from shared.db.models import Worker

        def registered(proc: Proc) -> bool:
            with self.session() as session:
                return session.scalar(sa.select(Worker.name).where(Worker.name.startswith(f"{proc.name}@"))) is not None

        for proc in workers:
            if "--verdict" in proc.proc.args:
                proc.wait_logged(" ready.")
            else:
                proc.wait_for(functools.partial(registered, proc), "registration")


def _schema_url(base: str, schema: str) -> str:
    return f"{base}?options=-csearch_path%3D{schema}"


@pytest.fixture(scope="module")
def stack(hub: Any, tiny_models: Path) -> Iterator[Stack]:
    import psycopg

    from shared.db.engine import make_engine
    from shared.db.migrate import upgrade

    hub.add_dir(tiny_models, org=ORG)
    LOGS.mkdir(parents=True, exist_ok=True)
    schema = f"faults_{uuid.uuid4().hex[:10]}"
    admin = PG_BASE.replace("postgresql+psycopg", "postgresql")
    pg = urlsplit(PG_BASE)
    with contextlib.ExitStack() as cleanup:  # undone in reverse, whatever happens
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")

        def drop_schema() -> None:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")

        cleanup.callback(drop_schema)
        direct = _schema_url(PG_BASE, schema)
        upgrade(direct)
        db = TcpProxy((pg.hostname or "127.0.0.1", pg.port or 5432)).start()
        cleanup.callback(db.stop)
        redis = RedisServer().start()
        cleanup.callback(redis.stop)
        proxied = _schema_url(PG_BASE.replace(pg.netloc, f"{pg.username}@{db.address}"), schema)
        data = RUN_DIR / "faults-data"
        env = {**os.environ, **SHORT, "SUPPORTMATRIX_DATABASE_URL": proxied, "SUPPORTMATRIX_REDIS_URL": redis.url(),
               "SUPPORTMATRIX_DATA_DIR": str(data)}  # fmt: skip
        settings = Settings(database_url=direct, redis_url=redis.url(), data_dir=data, worker_stale_s=STALE_S,
                            remote_code_orgs=[ORG])  # fmt: skip
        built = Stack(redis, db, env, settings, make_engine(direct))
        cleanup.callback(built.engine.dispose)
        cleanup.callback(lambda: stop_all(built.procs))
        beat = Proc("beat", [*CELERY, "beat", "--scheduler", "services.worker.beat:LockedScheduler",
                             "--schedule", str(LOGS / "beat-schedule"), "--loglevel", "INFO"], env)  # fmt: skip
        control = Proc("control", [*CELERY, "worker", "--queues", "supportmatrix.control", "--pool", "solo",
                                   "--hostname", "control-faults@%h", "--without-gossip", "--without-mingle",
                                   "--loglevel", "INFO"], env)  # fmt: skip
        built.procs += [beat, control]
        built.verdicts = built.start_worker("v-faults", None)
        control.wait_logged(" ready.")
        built.wait_serving(built.verdicts)
        yield built


@pytest.fixture
def workers(stack: Stack) -> Iterator[Callable[..., Proc]]:
    """Start accelerator workers (``cores``) or verdict workers (``cores=None``) for one test; stopped after it."""
    mine: list[Proc] = []

    def start(name: str, cores: str | None = "0", **env: str) -> Proc:
        proc = stack.start_worker(name, cores, **env)
        mine.append(proc)
        return proc

    yield start
    stop_all(mine)
    for proc in mine:
        stack.procs.remove(proc)


# --- what the tests read -------------------------------------------------------------------------------------


def accelerator_attempts(job: Job) -> list[Attempt]:
    return [a for a in attempts(job) if a.stage == Stage.accelerator]


def assert_ended_once(stack: Stack, job: Job, state: JobState = JobState.done) -> None:
    assert job.state == state, (job.state, job.error_class, job.error_message)
    assert stack.rows(job.id) == 1
    assert all(a.ended is not None for a in attempts(job)), attempts(job)  # no attempt is left open


def assert_reclaimed_in_time(job: Job, lost_at: dt.datetime, others: Sequence[Job] = ()) -> None:
    """The job's next accelerator attempt began within the lease timeout and two reconciler periods of its loss, and,
    when one of ``others`` (jobs of the same worker's one core) took the core first, within STARTUP_S of that job
    freeing it (its accelerator stage ending: judging_at, or finished_at for a job that ended there). A job that
    waited with its message lost is sent again once the queue grace has passed since it was last sent, which with
    this stack's timeouts (GRACE_S below LEASE_S) comes before a running one's lease lapses: it can run first."""
    later = [a for a in accelerator_attempts(job) if a.started_at > lost_at]
    assert later, f"no attempt began after the loss at {lost_at}: {attempts(job)}"
    retaken = later[0].started_at
    overtook = [other for other in others if any(lost_at < a.started_at < retaken for a in accelerator_attempts(other))]
    freed = [other.judging_at or other.finished_at for other in overtook]
    assert all(at is not None for at in freed), [attempts(other) for other in overtook]
    sent_again_by = lost_at + dt.timedelta(seconds=RECLAIM_S)
    free_at = max([sent_again_by, *(at for at in freed if at is not None)])
    late = (retaken - free_at).total_seconds()
    assert late <= STARTUP_S, (
        f"taken again {(retaken - lost_at).total_seconds():.1f} s after the loss, {late:.1f} s after "
        f"{'the reconciler had to send it again' if free_at == sent_again_by else 'its core was free'}: "
        f"{attempts(job)}"
    )


def gone(pid: int, timeout: float = 10) -> bool:
    """The process group ``pid`` leads has no process left (zombies aside)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in psutil.process_iter(["pid", "status"]) if _in_group(p, pid)]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _in_group(process: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False


# --- the tests -----------------------------------------------------------------------------------------------


def test_the_timing_bounds_scale_with_the_machines_measured_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twice the tuned machine's import time doubles every bound; a faster machine keeps the tuned ones."""
    from tests import machine_speed

    for measured, expected in ((machine_speed.TUNED_IMPORT_S * 2, 24.0), (machine_speed.TUNED_IMPORT_S / 2, 12.0)):
        monkeypatch.setenv(machine_speed.ENVIRONMENT, str(measured))
        machine_speed.slowdown.cache_clear()
        assert bound(12) == pytest.approx(expected)
    machine_speed.slowdown.cache_clear()


def test_a_pool_child_killed_mid_run_is_taken_over_at_once_and_ends_once(stack: Stack, workers: Any) -> None:
    """The lonely case of issue 8: one job, nothing else queued, the worker's pool child SIGKILLed mid-run."""
    worker = workers("f-poolkill")
    stack.wait_serving(worker)
    job_id = stack.submit(f"{ORG}/tiny-gpt2")
    runner = stage_runner(worker, job_id, "accelerator")
    pool_child = runner.parent()
    assert pool_child is not None and pool_child.pid != worker.pid
    lost_at = utcnow()
    pool_child.kill()
    assert gone(runner.pid), "the runner outlived its worker"  # the parent-death signal took its whole group
    [job] = stack.wait_final([job_id])
    assert_ended_once(stack, job)
    assert job.attempts == 2 and job.verdict_attempts == 1
    first, second = accelerator_attempts(job)
    assert first.ended == "lost: its process died" and (second.ended or "").startswith("done"), attempts(job)
    assert_reclaimed_in_time(job, lost_at)
    assert runner_starts(worker, job_id, "accelerator") == 2
    assert worker.proc.poll() is None  # the worker itself lives on, with a new pool child


def test_a_worker_killed_whole_is_reclaimed_by_another_after_its_lease_lapses(stack: Stack, workers: Any) -> None:
    """SIGKILL of the worker's whole process group: its message stays unacknowledged in Redis (for the
    visibility timeout), so only the reconciler, once the lease lapsed, sends the job to the other worker."""
    first = workers("f-whole-1")
    stack.wait_serving(first)
    job_id = stack.submit(f"{ORG}/tiny-gpt2")
    runner = stage_runner(first, job_id, "accelerator")
    replacement = workers("f-whole-2")  # on the same queue; idle, since prefetch is one message per process
    stack.wait_serving(replacement)
    assert stack.job(job_id).state == JobState.running
    lost_at = utcnow()
    first.kill()
    assert gone(runner.pid), "the runner outlived its worker"
    [job] = stack.wait_final([job_id])
    assert_ended_once(stack, job)
    assert job.attempts == 2 and job.verdict_attempts == 1
    lost, taken = accelerator_attempts(job)
    assert lost.owner.startswith("f-whole-1@") and lost.ended and lost.ended.startswith("lost")
    assert taken.owner.startswith("f-whole-2@")
    assert_reclaimed_in_time(job, lost_at)
    assert runner_starts(first, job_id, "accelerator") == 1 and runner_starts(replacement, job_id, "accelerator") == 1
    assert stack.verdicts is not None and runner_starts(stack.verdicts, job_id, "verdict") == 1


@pytest.mark.parametrize("persistent", [True, False], ids=["aof", "no-persistence"])
def test_a_redis_restart_mid_sweep_loses_no_job(
    stack: Stack, workers: Any, hub: Any, tiny_models: Path, persistent: bool
) -> None:
    """Redis killed and started again while a sweep's first job runs (and, without persistence, its second waits
    in the queue): with an append-only file the messages survive; without, they are lost and the reconciler
    sends the jobs again."""
    case = "aof" if persistent else "volatile"
    stack.redis.kill()
    stack.redis.forget()
    stack.redis.start(persistent)  # this case's Redis, before the sweep; the stack reconnects
    swept = [f"{ORG}/swept-{case}-{i}" for i in range(1, len(SWEEPS[case]) + 1)]
    for repo, model in zip(swept, SWEEPS[case], strict=True):
        hub.add(repo, tiny_models / model)  # only this case's models are on the Hub: the others get no job
    try:
        sweep_through_a_redis_restart(stack, workers, case, swept)
    finally:
        for repo in swept:
            hub.repos.pop(repo, None)


def sweep_through_a_redis_restart(stack: Stack, workers: Any, case: str, swept: list[str]) -> None:
    persistent = case == "aof"
    worker = workers(f"f-redis-{case}")
    stack.wait_serving(worker)
    with stack.session() as session:
        sweep = open_sweep(session, stack.settings, "api")
        assert sweep is not None
        session.commit()
        sweep_id = sweep.id
    request_sweep(stack.producer, sweep_id)
    job_ids = wait_sweep_jobs(stack, sweep_id, swept)
    stage_runner(worker, job_ids[0], "accelerator")  # the first runs; any other waits behind it
    assert all(stack.job(i).state == JobState.queued for i in job_ids[1:])
    stack.redis.kill()
    if not persistent:
        stack.redis.forget()
    lost_at = utcnow()
    stack.redis.start(persistent)
    first, *behind = stack.wait_final(job_ids, timeout=RECLAIM_S + len(job_ids) * RUN_S)
    for job in (first, *behind):
        assert_ended_once(stack, job)
    # The running one may be run again (a worker cancels its running tasks when the broker goes away);
    # one that waited runs once, whether its message survived or the reconciler sent it again, and may run first
    # on the worker's one core (here the queue grace is shorter than the lease).
    assert first.attempts <= 2 and all(j.attempts == 1 for j in behind), [attempts(j) for j in (first, *behind)]
    if first.attempts == 2:
        assert_reclaimed_in_time(first, lost_at, behind)
    with stack.session() as session:
        record = session.get(Sweep, sweep_id)
        assert record is not None and record.state == SweepState.done


def wait_sweep_jobs(stack: Stack, sweep_id: int, models: list[str], timeout: float = 60) -> list[int]:
    """The sweep's jobs of ``models``, in that order, once it made them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with stack.session() as session:
            columns = (SweepEntry.model_id, SweepEntry.job_id, SweepEntry.created)
            entries = session.execute(sa.select(*columns).where(SweepEntry.sweep_id == sweep_id)).all()
        made = {model: job_id for model, job_id, created in entries if job_id is not None and created}
        if all(m in made for m in models):
            assert len(made) == len(models), entries  # the other case's models got no job
            return [made[m] for m in models]
        time.sleep(0.3)
    raise AssertionError(f"sweep {sweep_id} made no jobs for {models} within {timeout} s")


@pytest.fixture
def api_on_proxy(stack: Stack) -> Iterator[str]:
    """An API process whose database is reached through the stack's proxy."""
    port = free_port()
    api = Proc("api", [sys.executable, "-m", "uvicorn", "services.api.main:app", "--host", "127.0.0.1",
                       "--port", str(port), "--log-level", "warning"], stack.env)  # fmt: skip
    try:
        api.wait_for(lambda: port_answers("127.0.0.1", port), "listening")
        yield f"http://127.0.0.1:{port}"
    finally:
        api.stop()


@pytest.mark.parametrize("outage_s", [3 * HEARTBEAT_S, LEASE_S + 2 * HEARTBEAT_S], ids=["blip", "past-the-lease"])
def test_postgres_unreachable_mid_run_ends_the_job_once(
    stack: Stack, workers: Any, api_on_proxy: str, outage_s: float
) -> None:
    """PostgreSQL cut off from every process of the stack for longer than two heartbeats while a runner runs.
    A blip shorter than the lease is waited out (one attempt); past the lease, the worker kills its runner and
    writes nothing, and the reconciler sends the job again once the database answers."""
    worker = workers(f"f-pg-{outage_s:g}")
    stack.wait_serving(worker)
    job_id = stack.submit(f"{ORG}/tiny-gpt2")
    runner = stage_runner(worker, job_id, "accelerator")
    with frozen(runner):  # the job is mid-run for the whole outage
        stack.db.cut(Cut.refuse)
        try:
            during = httpx.get(f"{api_on_proxy}/jobs/{job_id}", timeout=30)
            assert during.status_code == 503 and during.headers["Retry-After"], during.text
            time.sleep(outage_s)
        finally:
            stack.db.restore()
        restored_at = utcnow()  # nothing can take the job over while nothing reaches the database
    [job] = stack.wait_final([job_id])
    assert_ended_once(stack, job)
    after = httpx.get(f"{api_on_proxy}/jobs/{job_id}", timeout=30)
    assert after.status_code == 200 and after.json()["state"] == "done"
    if outage_s < LEASE_S - HEARTBEAT_S:
        assert job.attempts == 1, attempts(job)  # the lease was kept through the blip
        assert runner_starts(worker, job_id, "accelerator") == 1
    else:
        assert job.attempts == 2, attempts(job)  # given up at the lease's end, taken again after the outage
        assert gone(runner.pid)
        assert_reclaimed_in_time(job, restored_at)
        assert runner_starts(worker, job_id, "accelerator") == 2


def test_a_job_longer_than_the_visibility_timeout_runs_once(stack: Stack, workers: Any) -> None:
    """Redis restores a message unacknowledged for longer than the visibility timeout (3 s here); the second
    worker on the queue that gets it meets a live lease and waits its turn: one runner ever, one row."""
    short = {"SUPPORTMATRIX_VISIBILITY_TIMEOUT_S": "3"}
    first = workers("f-vis-1", **short)
    stack.wait_serving(first)
    job_id = stack.submit(f"{ORG}/tiny-gpt2")
    runner = stage_runner(first, job_id, "accelerator")
    with frozen(runner):
        time.sleep(3.5)  # unacknowledged past the visibility timeout
        # kombu restores visible messages when a consumer starts polling (then every 100 s): this one does
        second = workers("f-vis-2", **short)
        stack.wait_serving(second)
        second.wait_logged(f"supportmatrix.run_job[job-{job_id}] received", timeout=30)
        # it met the live lease and ended there: no retry, no new message
        second.wait_logged(f"supportmatrix.run_job[job-{job_id}] succeeded", timeout=30)
    [job] = stack.wait_final([job_id])
    assert_ended_once(stack, job)
    assert job.attempts == 1 and accelerator_attempts(job)[0].owner.startswith("f-vis-1@")
    assert runner_starts(first, job_id, "accelerator") + runner_starts(second, job_id, "accelerator") == 1
    task = f"supportmatrix.run_job[job-{job_id}]"
    lines = [line for line in second.text().splitlines() if task in line]
    assert not [line for line in lines if " retry" in line or " raised" in line], lines
    assert any("holds the live lease of the accelerator stage; this delivery ends" in line for line in lines), lines


def test_a_backlog_behind_a_busy_worker_holds_one_message_per_job(stack: Stack, workers: Any) -> None:
    """1,000 jobs wait behind one busy worker for several reconciler periods: Redis holds one message per job,
    however long they wait; when the waiting messages are lost, each job is sent again exactly once."""
    from shared.jobs.broker import deliveries, enqueue_job

    worker = workers("f-backlog")
    stack.wait_serving(worker)
    first = stack.submit(f"{ORG}/tiny-gpt2")
    runner = stage_runner(worker, first, "accelerator")
    client = redis.Redis.from_url(stack.settings.redis_url)
    with frozen(runner):  # the worker is busy; its heartbeats keep the lease live
        with stack.session() as session:
            busy = session.get(Job, first)
            assert busy is not None
            same = {c: getattr(busy, c) for c in ("sha", "task", "config_hash", "cores", "queue")}
            rows = [{"model_id": f"{ORG}/backlog-{i}", "state": JobState.queued, "created_at": utcnow(), **same,
                     **busy.runtime().model_dump()} for i in range(999)]  # fmt: skip
            backlog = list(session.scalars(sa.insert(Job).returning(Job.id), rows))
            queue = busy.queue
            # Sent before the rows are committed (the one worker is busy: none is taken): sent one by one, as
            # commit_and_enqueue sends them, the 999 can take longer than this stack's queue grace on two loaded
            # CPUs, and the reconciler would send the last of them again before the loop did.
            for job_id in backlog:
                enqueue_job(stack.producer, job_id, queue)
            session.commit()
        ours = {f"job-{i}" for i in backlog}

        def held() -> tuple[int, set[str], set[str]]:
            found = deliveries(stack.settings.redis_url, [queue])
            return client.llen(queue), set(found.waiting), set(found.taken_s_ago) & (ours | {f"job-{first}"})

        def resends() -> list[int]:
            with stack.session() as session:
                return list(session.scalars(sa.select(Job.resends).where(Job.id.in_(backlog))))

        for _ in range(3):  # three reconciler periods past the queue grace, counted each period
            time.sleep(RECONCILE_S)
        time.sleep(GRACE_S)
        for _ in range(3):
            assert held() == (999, ours, {f"job-{first}"})  # one message per job: the running one's is taken
            time.sleep(RECONCILE_S)
        assert set(resends()) == {0}
        client.delete(queue)  # the waiting messages are lost
        deadline = time.monotonic() + GRACE_S + 2 * RECONCILE_S + STARTUP_S
        while client.llen(queue) < 999 and time.monotonic() < deadline:
            time.sleep(0.2)
        for _ in range(3):  # sent again once, and only once
            time.sleep(RECONCILE_S)
            assert held() == (999, ours, {f"job-{first}"})
        assert set(resends()) == {1}
        with stack.session() as session:  # the backlog is withdrawn before the worker is free again
            session.execute(sa.update(Job).where(Job.id.in_(backlog)).values(state=JobState.cancelled))
            session.commit()
        client.delete(queue)
    [job] = stack.wait_final([first])
    assert_ended_once(stack, job)
    with stack.session() as session:
        states = set(session.scalars(sa.select(Job.state).where(Job.id.in_(backlog))))
        written = session.scalar(sa.select(sa.func.count()).select_from(Result).where(Result.job_id.in_(backlog)))
    assert states == {JobState.cancelled} and written == 0


@pytest.mark.parametrize("behind", [False, True], ids=["alone", "with-a-job-behind"])
def test_a_poison_model_that_kills_its_worker_ends_capped_and_the_queue_moves_on(
    stack: Stack, workers: Any, behind: bool
) -> None:
    """Loading faults/tiny-poison (trust_remote_code) SIGKILLs the worker's pool child every time: after
    max_attempts deliveries it ends ERROR(worker_lost) listing each attempt, and a job behind it runs."""
    worker = workers(f"f-poison-{int(behind)}", SUPPORTMATRIX_MAX_ATTEMPTS="2")
    stack.wait_serving(worker)
    job_ids = [stack.submit(f"{ORG}/tiny-poison"), *([stack.submit(f"{ORG}/tiny-gpt2")] if behind else [])]
    poison, *after = stack.wait_final(job_ids, timeout=RECLAIM_S + len(job_ids) * RUN_S)
    assert_ended_once(stack, poison, JobState.failed)
    assert poison.error_class == ErrorClass.worker_lost and poison.attempts == 2
    tried = accelerator_attempts(poison)
    # taken over from the dead pool child at once, or after its lease lapsed (when a job behind it ran first)
    assert len(tried) == 2 and all(a.ended and a.ended.startswith("lost") for a in tried), tried
    message = poison.error_message or ""
    assert "delivered 2 times" in message and all(f"{a.owner} (accelerator" in message for a in tried), message
    assert runner_starts(worker, poison.id, "accelerator") == 2
    for job in after:
        assert_ended_once(stack, job)
        assert job.attempts == 1, attempts(job)  # the job behind it is not hurt by its worker's deaths
    assert worker.proc.poll() is None


# --- two hosts -------------------------------------------------------------------------------------------------


@dataclass
class Host:
    """A machine of its own: a network namespace whose processes reach Redis, PostgreSQL and the Hub only
    through proxies on its gateway, with its own name, data directory and Hub cache."""

    name: str
    netns: NetnsHost
    proxies: list[TcpProxy]
    env: dict[str, str]
    accelerators: Proc | None = None
    verdicts: Proc | None = None


@pytest.fixture
def two_hosts(stack: Stack, hub: Any) -> Iterator[list[Host]]:
    hosts: list[Host] = []
    try:
        for index, label in enumerate("ab", start=1):
            name = f"faults-{label}"
            netns = NetnsHost(label, index=200 + index)
            hosts.append(Host(name, netns, [], {}))
            netns.create()
            redis_proxy, db_proxy, hub_proxy = (
                TcpProxy(("127.0.0.1", port), listen_host=netns.gateway).start()
                for port in (stack.redis.port, stack.db.port, urlsplit(hub.url).port)
            )
            hosts[-1].proxies = [redis_proxy, db_proxy, hub_proxy]
            root = RUN_DIR / name
            hosts[-1].env = {
                "SUPPORTMATRIX_HOST_NAME": name,
                "SUPPORTMATRIX_DATA_DIR": str(root / "data"),
                "HF_HOME": str(root / "hf-home"),
                "HF_ENDPOINT": f"http://{hub_proxy.address}",
                "SUPPORTMATRIX_REDIS_URL": f"redis://{redis_proxy.address}/0",
                "SUPPORTMATRIX_DATABASE_URL": stack.env["SUPPORTMATRIX_DATABASE_URL"].replace(
                    stack.db.address, db_proxy.address
                ),
            }
        for host in hosts:
            prefix = host.netns.command([])
            host.accelerators = stack.start_worker(f"w-{host.name}", "0", prefix, **host.env)
            host.verdicts = stack.start_worker(f"v-{host.name}", None, prefix, **host.env)
        stack.wait_serving(*(p for h in hosts for p in (h.accelerators, h.verdicts) if p))
        yield hosts
    finally:
        started = [p for h in hosts for p in (h.accelerators, h.verdicts) if p is not None]
        stop_all(started, timeout=5)  # a host cut off may hang in its shutdown: it is no longer worth waiting for
        for proc in started:
            stack.procs.remove(proc)
        for host in hosts:
            for proxy in host.proxies:
                proxy.stop()
            host.netns.remove()


def test_a_host_cut_off_mid_job_is_reclaimed_by_the_other_host(stack: Stack, two_hosts: list[Host]) -> None:
    """Two hosts, each with an accelerator and a verdict worker on the same Redis and PostgreSQL; the one
    running the job loses its network. The other takes the job once the lease lapses, runs both stages at
    home, and writes the one row; the cut host, back on the network, writes nothing."""
    job_id = stack.submit(f"{ORG}/tiny-gpt2")
    running, other = wait_running_host(two_hosts, job_id)
    assert running.accelerators is not None and other.accelerators is not None and other.verdicts is not None
    cut_runner = stage_runner(running.accelerators, job_id, "accelerator", timeout=10)
    running.netns.cut()
    lost_at = utcnow()
    # Still cut off, the host learns within its lease that it can no longer hold it, and frees its cores.
    assert gone(cut_runner.pid, timeout=LEASE_S + 5), "the cut host kept its runner past its lease"
    [job] = stack.wait_final([job_id])
    assert_ended_once(stack, job)
    lost, taken = accelerator_attempts(job)
    assert f"@{running.name}:" in lost.owner and f"@{other.name}:" in taken.owner, attempts(job)
    assert job.verdict_queue == f"supportmatrix.verdict.{other.name}"  # judged where its artifacts are
    assert job.lease_owner and job.lease_owner.startswith(f"v-{other.name}@")
    assert_reclaimed_in_time(job, lost_at)
    assert runner_starts(other.accelerators, job_id, "accelerator") == 1
    assert runner_starts(other.verdicts, job_id, "verdict") == 1
    running.netns.restore()
    # Back on the network, the cut host learns its lease is gone; it writes nothing and starts no verdict stage.
    running.accelerators.wait_logged("lease lost", timeout=60)
    assert stack.rows(job_id) == 1 and stack.job(job_id).state == JobState.done
    assert running.verdicts is not None and runner_starts(running.verdicts, job_id, "verdict") == 0


def wait_running_host(hosts: list[Host], job_id: int, timeout: float = 60) -> tuple[Host, Host]:
    """The host whose accelerator worker runs the job, and the other one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for host in hosts:
            assert host.accelerators is not None
            if runner_starts(host.accelerators, job_id, "accelerator"):
                stage_runner(host.accelerators, job_id, "accelerator", timeout=10)
                return host, next(h for h in hosts if h is not host)
        time.sleep(0.2)
    raise AssertionError(f"no host started job {job_id} within {timeout} s")

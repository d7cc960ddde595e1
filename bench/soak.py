"""Issue 23 — the soak: the real stack under waves of tiny jobs for a long while, with faults on a seeded schedule.

    .venv/bin/python -m bench --only soak                                 # 20 minutes of load (not in the suite)
    SUPPORTMATRIX_SOAK_MINUTES=3 .venv/bin/python -m bench --only soak    # a short try
    SUPPORTMATRIX_SOAK_SEED=7 ...                                         # another fault schedule and waves

The stack is built as tests/test_faults.py builds one to break it: PostgreSQL in a schema of its own, which every
process of the stack reaches through a proxy that can cut it (testing/tcp_proxy.py), while this process reads it
directly; a redis-server of its own without persistence (testing/redis_server.py); the Hub stand-in, serving a new
repo id for every submission (each one a new job), all of them copies of three tiny checkpoints; the API under
uvicorn, with a Hub cache of its own; the control worker and beat (the reconciler, on the locked scheduler); and the
host launcher on ``HOST_CORES`` cores of the cpu backend (``aot_eager``), with its core-group workers, its verdict
worker and its zygote. Lease, heartbeat and reconciler periods are short, so that what a fault loses is found within
seconds; the tiers past the verdict are off (tiny jobs). Each process runs in its own process group and is kept as
compose's restart policy keeps a container: one that exits on its own is counted, the rest of its group ends with
it, and it starts again.

For ``SUPPORTMATRIX_SOAK_MINUTES`` it submits waves of jobs through ``POST /jobs`` with an admin token made by
``supportmatrix tokens create``, ``SUBMITTERS`` requests at a time (a tenth of them on 2 cores, so that the launcher
re-plans its groups), trying a refused one again (503 while Redis or PostgreSQL is away, 429) as a client would; a
wave waits while more than ``BACKLOG_CAP`` jobs are unfinished, but Redis or PostgreSQL going away starts one at once,
so that submissions meet the outage. A reader pages ``GET /results`` meanwhile. Every
request's latency is kept. At seeded random times in the middle of the run: SIGKILLs of pool children that hold a
job's lease (a stage mid-run), one SIGKILL of the host launcher's whole process group and a new launcher a few
seconds later (what of its tree outlived the kill is followed until it ends), one Redis restart without persistence
(every waiting message lost: the reconciler must send them again), one PostgreSQL cut (connections refused) of a few
seconds up to past the lease. Then it waits for every job to end (at most ``DRAIN_CAP_S``) and counts from SQL: jobs
by state, result rows, jobs with more than one row, finished jobs without one, jobs left unfinished (stranded). The
goal: exactly one row per job, none stranded, no process of the stack dying on its own. When it is missed the schema
is kept for inspection; the logs are in ``<work>/logs``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import sqlalchemy as sa
from sqlalchemy.orm import Session

from bench.report import Goal, Measure, Section
from services.api.schemas import JobCreate, JobsSubmitted
from services.worker.planner import SPARE_GROUPS
from shared.contracts.enums import ACTIVE_STATES, FINISHED_STATES, JobState, Stage
from shared.db.models import Job, Result, utcnow
from shared.jobs.attempts import attempts
from shared.jobs.lease import LeaseOwner
from shared.jobs.queues import verdict_queue
from shared.processes import free_port
from testing.compose import NativeService
from testing.hub_standin import HubStandin, use_hub_standin
from testing.redis_server import RedisServer
from testing.services import ROOT, Started, admin_token, ensure_postgres, short_leases, wait_until
from testing.tcp_proxy import Cut, TcpProxy

MINUTES_ENV = "SUPPORTMATRIX_SOAK_MINUTES"
SEED_ENV = "SUPPORTMATRIX_SOAK_SEED"
POSTGRES = os.environ.get("SUPPORTMATRIX_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
HOST = "soak"  # the stack's host name: its verdict queue and its lease owners
HOST_CORES = 2
ORG = "soak"
CHECKPOINTS = ("tiny-llama", "tiny-gpt2", "tiny-qwen3")
TWO_CORE_SHARE = 0.1  # of the submissions: the launcher re-plans its groups for them
SHARDED = ("tiny-llama", "tiny-qwen3")  # the checkpoints with a tensor-parallel plan (GPT-2 has none)
# Short enough that a lost job is found within seconds, long enough that a loaded 2-CPU machine keeps its leases
# (the suite's faults use 6 s for one job at a time; here a backlog of processes shares the CPUs for minutes).
LEASE_S, HEARTBEAT_S, RECONCILE_S, GRACE_S, STALE_S = 10, 1, 3, 6, 8
SHORT = {
    **short_leases(LEASE_S, HEARTBEAT_S, RECONCILE_S, GRACE_S, STALE_S),
    "SUPPORTMATRIX_CPU_COMPILE_BACKEND": "aot_eager",
    "SUPPORTMATRIX_PERF_ITERATIONS": "0",
    "SUPPORTMATRIX_LONG_GENERATION": "false",
    "SUPPORTMATRIX_HOST_NAME": HOST,
    "SUPPORTMATRIX_HOST_CORES": str(HOST_CORES),
}
WAVE_JOBS = (6, 18)  # jobs in a wave, drawn uniformly
WAVE_GAP_S = (30.0, 75.0)  # from one wave's end to the next one's start
# A wave waits while more jobs than this are unfinished: the stack stays busy, and what the drain must clear is
# bounded (the one verdict worker, not the cores, is what a 2-CPU host runs out of first).
BACKLOG_CAP = 20
SUBMITTERS = 4  # POST /jobs at once within a wave
SUBMIT_PATIENCE_S = 180.0  # a submission refused for longer than this is given up (and reported)
READ_EVERY_S = 0.5
CLIENT_TIMEOUT_S = 30.0  # a request not answered within this counts as unanswered, at this latency
FAULT_WINDOW = (0.1, 0.85)  # the part of the load phase the faults fall in
LAUNCHER_AWAY_S = (3.0, 10.0)
SURVIVOR_WAIT_S = 3.0  # after a launcher is killed: parent-death signals and the zygote's reaping have acted
REDIS_AWAY_S = (1.0, 5.0)
POSTGRES_CUT_S = (3.0, 2.0 * LEASE_S)  # a blip or past the lease, as the draw falls
VICTIM_WAIT_S = 30.0  # a pool-child kill waits this long for some stage to be running
DRAIN_CAP_S = 900.0
CELERY = [sys.executable, "-m", "celery", "-A", "services.worker.celery_app:app"]
LAUNCHER = "host"  # the host launcher's role
LAUNCHER_ARGV = [sys.executable, "-m", "services.worker.host", "--cores", str(HOST_CORES)]
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")  # a traceback's last line


class FaultKind(StrEnum):
    pool_child = "pool child SIGKILLed"
    launcher = "host launcher SIGKILLed"
    redis = "Redis restarted empty"
    postgres = "PostgreSQL cut"


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    at_s: float  # since the first wave
    target: str  # what was hit, in words
    away_s: float = 0.0  # how long the dependency or the launcher was gone
    jobs: tuple[int, ...] = ()  # the jobs it hit: a killed stage's, those queued or held when a service went away


@dataclass(frozen=True)
class Sample:
    route: str
    at_s: float  # since the first wave
    seconds: float
    status: int | None  # None: no answer (timed out, or the connection failed)


@dataclass(frozen=True)
class Submission:
    model_id: str
    cores: int
    job_id: int | None  # None: never accepted
    tries: int
    created: bool = True  # False: a retry found the job its lost first answer had made
    refused: str = ""  # the last answer to one never accepted


@dataclass(frozen=True)
class JobEnd:
    """A job as SQL has it at the end."""

    id: int
    model_id: str
    state: JobState
    error: str
    attempts: int
    verdict_attempts: int
    resends: int
    rows: int
    open_attempts: int  # attempts the log still shows running
    detail: str  # lease owner, last heartbeat and the attempt log: the evidence for one that went wrong


@dataclass
class Orphan:
    """A process of a killed launcher's tree still alive ``SURVIVOR_WAIT_S`` after the kill."""

    process: psutil.Process
    output: str  # where its output goes: a runner's log names its job and stage
    killed_at: float  # monotonic
    gone_after_s: float | None = None  # since the kill; None while it lives

    def describe(self) -> str:
        lived = "still alive at the end" if self.gone_after_s is None else f"gone {self.gone_after_s:.0f} s after"
        return f"pid {self.process.pid} ({self.output}): {lived}"


def watch(orphans: list[Orphan]) -> None:
    """Note when each orphan ends (in a daemon thread: the ones alive at the end are killed with the stack)."""
    while any(o.gone_after_s is None for o in orphans):
        for orphan in orphans:
            if orphan.gone_after_s is None and not alive(orphan.process):
                orphan.gone_after_s = time.monotonic() - orphan.killed_at
        time.sleep(0.5)


@dataclass
class Latencies:
    started: float = field(default_factory=time.monotonic)
    samples: list[Sample] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def request(
        self,
        client: httpx.Client,
        route: str,
        url: str,
        params: dict[str, str | int] | None = None,
        body: dict[str, object] | None = None,
    ) -> httpx.Response | None:
        """``route``'s request (a POST when it has a body), timed; None when no answer came."""
        began = time.monotonic()
        try:
            response = client.post(url, json=body) if body is not None else client.get(url, params=params)
        except httpx.HTTPError:
            response = None
        status = None if response is None else response.status_code
        sample = Sample(route, began - self.started, time.monotonic() - began, status)
        with self._lock:
            self.samples.append(sample)
        return response


# --- the stack ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Role:
    """A process of the stack, as its supervisor knows it."""

    name: str
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class Crash:
    """A process of the stack that exited on its own."""

    role: str
    at_s: float  # since the first wave (noticed within a second)
    log: Path
    returncode: int
    error: str  # the last exception its output names

    def describe(self) -> str:
        return f"{self.role} ({self.log.name}) at {self.at_s:.0f} s, exit {self.returncode}: {self.error or '-'}"


def last_error(log: Path) -> str:
    errors = [line for line in log.read_text(errors="replace").splitlines() if EXCEPTION_LINE.match(line)]
    return errors[-1][:300] if errors else ""


@dataclass
class Stack:
    logs: Path
    env: dict[str, str]
    redis: RedisServer
    db: TcpProxy  # every process of the stack reaches PostgreSQL through it; this process reads it directly
    engine: sa.Engine
    hub: HubStandin
    api: str
    token: str
    roles: dict[str, Role] = field(default_factory=dict)
    current: dict[str, NativeService] = field(default_factory=dict)  # each role's process now
    started: list[NativeService] = field(default_factory=list)  # every process started, each in its own group
    crashes: list[Crash] = field(default_factory=list)
    orphans: list[Orphan] = field(default_factory=list)  # outlived their killed launcher
    # Held while the soak itself kills a process and starts it again: the supervisor leaves it alone meanwhile.
    lock: threading.Lock = field(default_factory=threading.Lock)
    outage: threading.Event = field(default_factory=threading.Event)  # Redis or PostgreSQL just went away
    keep_schema: bool = False

    def add(self, role: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.roles[role] = Role(role, argv, self.env | (env or {}))
        self.launch(role)

    def launch(self, role: str) -> None:
        """Start ``role`` (again): ``<role>-<n>.log`` is the n-th one's output."""
        n = sum(s.name.startswith(f"{role}-") for s in self.started) + 1
        spec = self.roles[role]
        service = NativeService(f"{role}-{n}", spec.argv, spec.env, None, ROOT, self.logs / f"{role}-{n}.log")
        service.start()
        self.started.append(service)
        self.current[role] = service

    @property
    def launcher(self) -> NativeService:
        return self.current[LAUNCHER]

    def launcher_tree(self) -> list[psutil.Process]:
        assert self.launcher.proc is not None
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.launcher.proc.pid)
            return [root, *root.children(recursive=True)]
        return []

    def supervise(self, started: float, stop: threading.Event) -> None:
        """As compose's ``restart: unless-stopped`` keeps a container: a process that exits on its own is noted, the
        rest of its process group ends with it (a container's processes end with its main one), and it starts again."""
        while not stop.wait(1.0):
            with self.lock:
                for role, service in list(self.current.items()):
                    assert service.proc is not None
                    if service.proc.poll() is None:
                        continue
                    self.crashes.append(Crash(role, time.monotonic() - started, service.log, service.proc.returncode,
                                              last_error(service.log)))  # fmt: skip
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(service.proc.pid, signal.SIGKILL)
                    self.launch(role)

    def session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def job_ids(self, *states: JobState) -> list[int]:
        with self.session() as session:
            return list(session.scalars(sa.select(Job.id).where(Job.state.in_(states)).order_by(Job.id)))

    def lease_holders(self) -> list[tuple[int, Stage, LeaseOwner]]:
        """The jobs whose stage a process of this host holds now."""
        held = sa.select(Job.id, Job.state, Job.lease_owner).where(
            Job.state.in_([JobState.running, JobState.judging]), Job.lease_owner.is_not(None)
        )
        with self.session() as session:
            rows = session.execute(held).all()
        stage = {JobState.running: Stage.accelerator, JobState.judging: Stage.verdict}
        owners = [(job_id, stage[state], LeaseOwner.parse(owner or "")) for job_id, state, owner in rows]
        return [(job_id, s, owner) for job_id, s, owner in owners if owner is not None and owner.host == HOST]

    def messages(self) -> tuple[int, int]:
        """Job and verdict messages Redis holds: waiting in a queue, and taken but not acknowledged."""
        from shared.jobs.broker import deliveries

        with self.session() as session:
            queues = set(session.scalars(sa.select(Job.queue).distinct())) | {verdict_queue(HOST)}
        found = deliveries(self.redis.url(), queues)
        return len(found.waiting), len(found.taken_s_ago)

    def stop(self) -> None:
        # the launchers first, warm (their workers finish what they hold), then the rest
        for service in sorted(self.started, key=lambda s: not s.name.startswith(f"{LAUNCHER}-")):
            service.stop(timeout=60)
        for orphan in self.orphans:
            with contextlib.suppress(psutil.NoSuchProcess):
                orphan.process.kill()


@contextlib.contextmanager
def soak_schema() -> Iterator[tuple[str, str, Callable[[], None]]]:
    """A migrated PostgreSQL schema of its own: its direct URL, its name, and how to drop it."""
    import psycopg

    from shared.db.migrate import upgrade

    ensure_postgres(POSTGRES, started := Started())
    admin = POSTGRES.replace("postgresql+psycopg", "postgresql")
    schema = f"soak_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")

    try:
        url = f"{POSTGRES}?options=-csearch_path%3D{schema}"
        upgrade(url)
        yield url, schema, drop
    finally:
        started.stop()


def build_stack(work: Path, cleanup: contextlib.ExitStack) -> tuple[Stack, str]:
    """Start every part (stopped by ``cleanup``, in reverse); returns the stack and its schema's name."""
    from shared.db.engine import make_engine
    from shared.settings import get_settings
    from testing.tiny_models import build

    direct, schema, drop = cleanup.enter_context(soak_schema())
    pg = urlsplit(POSTGRES)
    db = TcpProxy((pg.hostname or "127.0.0.1", pg.port or 5432)).start()
    cleanup.callback(db.stop)
    redis = RedisServer().start(persistent=False)
    cleanup.callback(redis.stop)
    proxied = direct.replace(pg.netloc, f"{pg.username}@{db.address}")
    hub_port, api_port = free_port(), free_port()
    os.environ.update(
        {
            **SHORT,
            "SUPPORTMATRIX_DATA_DIR": str(work / "data"),
            "SUPPORTMATRIX_DATABASE_URL": proxied,
            "SUPPORTMATRIX_REDIS_URL": redis.url(),
        }
    )
    use_hub_standin(f"http://127.0.0.1:{hub_port}", work / "hf-home")
    get_settings.cache_clear()
    build(work / "models", list(CHECKPOINTS))
    hub = HubStandin(port=hub_port).start()
    cleanup.callback(hub.stop)
    engine = make_engine(direct)
    cleanup.callback(engine.dispose)
    logs = work / "logs"
    logs.mkdir()
    stack = Stack(logs, dict(os.environ), redis, db, engine, hub, f"http://127.0.0.1:{api_port}", admin_token("soak"))
    cleanup.callback(lambda: None if stack.keep_schema else drop())
    cleanup.callback(stack.stop)
    # One Hub cache for every process, as compose's hf-home volume is: the runners keep theirs in a directory of
    # their own in it (Settings.runner_hub_home), where the API's and the workers' downloads (as root) are not.
    stack.add("api", [sys.executable, "-m", "uvicorn", "services.api.main:app", "--host", "127.0.0.1",
                      "--port", str(api_port), "--log-level", "warning"])  # fmt: skip
    stack.add("control", [*CELERY, "worker", "--queues", "supportmatrix.control", "--pool", "solo",
                          "--hostname", f"control-{HOST}@%h", "--without-gossip", "--without-mingle",
                          "--loglevel", "INFO"])  # fmt: skip
    stack.add("beat", [*CELERY, "beat", "--scheduler", "services.worker.beat:LockedScheduler",
                       "--schedule", str(logs / "beat-schedule"), "--loglevel", "INFO"])  # fmt: skip
    stack.add(LAUNCHER, LAUNCHER_ARGV)
    with httpx.Client(base_url=stack.api, timeout=CLIENT_TIMEOUT_S) as client:

        def serving() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                response = client.get("/workers")
                return response.status_code == 200 and len(response.json()) >= SPARE_GROUPS
            return False

        wait_until(serving, 300, "the host's spare 1-core workers")
    return stack, schema


# --- the load ----------------------------------------------------------------------------------------------


def submit(client: httpx.Client, latencies: Latencies, model_id: str, cores: int) -> Submission:
    """POST /jobs until it is accepted, as a client does: again after a 503 or 429 (its Retry-After) or no answer."""
    body = JobCreate(model_id=model_id, cores=cores).model_dump(mode="json", exclude_none=True)
    deadline = time.monotonic() + SUBMIT_PATIENCE_S
    tries = 0
    while True:
        tries += 1
        response = latencies.request(client, "POST /jobs", "/jobs", body=body)
        if response is not None and response.status_code in (200, 202):
            [job] = JobsSubmitted.model_validate_json(response.content).jobs
            return Submission(model_id, cores, job.id, tries, created=job.created)
        answer = "no answer" if response is None else f"{response.status_code} {response.text[:200]}"
        if (response is not None and response.status_code not in (429, 503)) or time.monotonic() > deadline:
            return Submission(model_id, cores, None, tries, refused=answer)
        time.sleep(min(float(response.headers.get("Retry-After", 1)) if response is not None else 1.0, 5.0))


@dataclass
class Waves:
    """Waves of new jobs until ``until`` (monotonic), each a new repo id on the Hub stand-in."""

    stack: Stack
    latencies: Latencies
    rng: random.Random
    until: float
    checkpoints: list[Path]
    submissions: list[Submission] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.stack.token}"}
        with httpx.Client(base_url=self.stack.api, headers=headers, timeout=CLIENT_TIMEOUT_S) as client:
            while time.monotonic() < self.until:
                # a dependency going away starts a wave at once, whatever the backlog: submissions meet the outage
                if not self.stack.outage.is_set() and len(self.stack.job_ids(*ACTIVE_STATES)) > BACKLOG_CAP:
                    self.stack.outage.wait(2)
                    continue
                self.stack.outage.clear()
                wave = [self.new_model() for _ in range(self.rng.randint(*WAVE_JOBS))]
                with ThreadPoolExecutor(SUBMITTERS) as pool:
                    done = pool.map(lambda w: submit(client, self.latencies, *w), wave)
                    self.submissions += list(done)
                self.sizes.append(len(wave))
                gap = self.rng.uniform(*WAVE_GAP_S)
                self.stack.outage.wait(max(0.0, min(gap, self.until - time.monotonic())))

    def new_model(self) -> tuple[str, int]:
        cores = 2 if self.rng.random() < TWO_CORE_SHARE else 1
        checkpoint = self.rng.choice([c for c in self.checkpoints if cores == 1 or c.name in SHARDED])
        model_id = f"{ORG}/{checkpoint.name}-{next(self.numbers):04d}"
        self.stack.hub.add(model_id, checkpoint)
        return model_id, cores

    def accepted_models(self) -> list[str]:
        return [s.model_id for s in self.submissions if s.job_id is not None]


def read_results(stack: Stack, latencies: Latencies, waves: Waves, rng: random.Random, stop: threading.Event) -> None:
    """GET /results all along: the newest page, or one submitted model's rows."""
    with httpx.Client(base_url=stack.api, timeout=CLIENT_TIMEOUT_S) as client:
        while not stop.wait(READ_EVERY_S):
            models = waves.accepted_models()
            params: dict[str, str | int] = {"limit": 100}
            if models and rng.random() < 0.5:
                params = {"model_id": rng.choice(models)}
            latencies.request(client, "GET /results", "/results", params=params)


# --- the faults --------------------------------------------------------------------------------------------


def fault_schedule(rng: random.Random, load_s: float, pool_kills: int) -> list[tuple[float, FaultKind]]:
    """Each fault at a random moment of its own slot of the fault window, in a random order: no two overlap."""
    kinds = [FaultKind.pool_child] * pool_kills + [FaultKind.launcher, FaultKind.redis, FaultKind.postgres]
    rng.shuffle(kinds)
    start, end = (share * load_s for share in FAULT_WINDOW)
    slot = (end - start) / len(kinds)
    return [(start + i * slot + rng.uniform(0, slot / 2), kind) for i, kind in enumerate(kinds)]


def kill_pool_child(stack: Stack, rng: random.Random, at_s: float) -> Fault:
    """SIGKILL the pool child of one of the launcher's workers while it holds a stage's lease."""
    deadline = time.monotonic() + VICTIM_WAIT_S
    while time.monotonic() < deadline:
        ours = {p.pid for p in stack.launcher_tree()}
        held = [(job_id, stage, owner) for job_id, stage, owner in stack.lease_holders() if owner.pid in ours]
        if held:
            job_id, stage, owner = rng.choice(held)
            os.kill(owner.pid, signal.SIGKILL)
            return Fault(FaultKind.pool_child, at_s, f"{owner.worker} (pid {owner.pid}), {stage.value} stage",
                         jobs=(job_id,))  # fmt: skip
        time.sleep(0.5)
    return Fault(FaultKind.pool_child, at_s, f"none: no stage ran within {VICTIM_WAIT_S:.0f} s")


def kill_launcher(stack: Stack, rng: random.Random, at_s: float) -> Fault:
    """SIGKILL the launcher's process group (its workers, their pool children, its zygote); a new one after a pause."""
    with stack.lock:
        launcher = stack.launcher.proc
        assert launcher is not None
        tree = stack.launcher_tree()
        ours = {p.pid for p in tree}
        held = tuple(job_id for job_id, _, owner in stack.lease_holders() if owner.pid in ours)
        pid = launcher.pid
        os.killpg(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        launcher.wait(10)
        away = rng.uniform(*LAUNCHER_AWAY_S)
        time.sleep(SURVIVOR_WAIT_S)
        orphans = [Orphan(p, output_of(p), killed_at) for p in tree if alive(p)]
        stack.orphans += orphans
        threading.Thread(target=watch, args=(orphans,), name="orphans", daemon=True).start()
        time.sleep(max(0.0, away - SURVIVOR_WAIT_S))
        stack.launch(LAUNCHER)
    target = f"pid {pid} and the {len(tree) - 1} processes under it; {len(orphans)} alive {SURVIVOR_WAIT_S:g} s after"
    return Fault(FaultKind.launcher, at_s, target, away, held)


def restart_redis(stack: Stack, rng: random.Random, at_s: float) -> Fault:
    waiting, taken = stack.messages()
    hit = tuple(stack.job_ids(*ACTIVE_STATES))
    away = rng.uniform(*REDIS_AWAY_S)
    stack.redis.kill()
    stack.redis.forget()
    stack.outage.set()
    time.sleep(away)
    stack.redis.start(persistent=False)
    target = f"{waiting} waiting and {taken} unacknowledged messages lost"
    return Fault(FaultKind.redis, at_s, target, away, hit)


def cut_postgres(stack: Stack, rng: random.Random, at_s: float) -> Fault:
    hit = tuple(stack.job_ids(*ACTIVE_STATES))
    away = rng.uniform(*POSTGRES_CUT_S)
    stack.db.cut(Cut.refuse)
    stack.outage.set()
    try:
        time.sleep(away)
    finally:
        stack.db.restore()
    target = f"every process of the stack; {'past' if away > LEASE_S else 'within'} the {LEASE_S} s lease"
    return Fault(FaultKind.postgres, at_s, target, away, hit)


APPLY: dict[FaultKind, Callable[[Stack, random.Random, float], Fault]] = {
    FaultKind.pool_child: kill_pool_child,
    FaultKind.launcher: kill_launcher,
    FaultKind.redis: restart_redis,
    FaultKind.postgres: cut_postgres,
}


def alive(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def output_of(process: psutil.Process) -> str:
    """Where its standard output goes: a forked runner's command line is its zygote's, its log names its job."""
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{process.pid}/fd/1")
    return "(gone)"


# --- the run -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Soak:
    minutes: float
    seed: int
    load_s: float
    drain_s: float
    drained: bool
    waves: list[int]
    submissions: list[Submission]
    samples: list[Sample]
    faults: list[Fault]
    ends: list[JobEnd]
    messages_left: tuple[int, int]
    orphans: list[Orphan]
    crashes: list[Crash]
    schema: str


def run(work: Path) -> Section:
    minutes = float(os.environ.get(MINUTES_ENV, "20"))
    seed = int(os.environ.get(SEED_ENV, "23"))
    with contextlib.ExitStack() as cleanup:
        stack, schema = build_stack(work, cleanup)
        soak = load_and_break(stack, work, minutes, seed, schema)
        stack.keep_schema = False in (m.met for m in measures(soak))
    return report(soak, stack.keep_schema)


def load_and_break(stack: Stack, work: Path, minutes: float, seed: int, schema: str) -> Soak:
    load_s = minutes * 60
    latencies = Latencies()
    until = latencies.started + load_s
    checkpoints = [work / "models" / name for name in CHECKPOINTS]
    waves = Waves(stack, latencies, random.Random(f"{seed}-waves"), until, checkpoints)
    stop_reading, stop_supervising = threading.Event(), threading.Event()
    reads = random.Random(f"{seed}-reads")
    supervisor = threading.Thread(target=stack.supervise, args=(latencies.started, stop_supervising), name="supervisor")
    wave_thread = threading.Thread(target=waves.run, name="waves")
    reader = threading.Thread(target=read_results, args=(stack, latencies, waves, reads, stop_reading), name="reads")
    for thread in (supervisor, wave_thread, reader):
        thread.start()
    rng = random.Random(f"{seed}-faults")
    faults: list[Fault] = []
    try:
        for at_s, kind in fault_schedule(rng, load_s, pool_kills=max(3, round(minutes / 3))):
            time.sleep(max(0.0, latencies.started + at_s - time.monotonic()))
            faults.append(APPLY[kind](stack, rng, time.monotonic() - latencies.started))
            print(f"soak: {faults[-1].at_s:.0f} s: {kind.value}: {faults[-1].target}", flush=True)
        wave_thread.join()
        stop_reading.set()
        reader.join()
        drain_started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not stack.job_ids(*ACTIVE_STATES), DRAIN_CAP_S, "every job to end")
        drain_s = time.monotonic() - drain_started
        ends, messages_left = job_ends(stack), stack.messages()
    finally:
        waves.until = 0.0  # a fault that failed ends the waves at once
        stack.outage.set()
        stop_reading.set()
        stop_supervising.set()
        for thread in (wave_thread, reader, supervisor):
            thread.join()
    return Soak(
        minutes=minutes,
        seed=seed,
        load_s=drain_started - latencies.started,
        drain_s=drain_s,
        drained=not stack.job_ids(*ACTIVE_STATES),
        waves=waves.sizes,
        submissions=waves.submissions,
        samples=list(latencies.samples),
        faults=faults,
        ends=ends,
        messages_left=messages_left,
        orphans=stack.orphans,
        crashes=stack.crashes,
        schema=schema,
    )


def job_ends(stack: Stack) -> list[JobEnd]:
    rows = sa.select(Result.job_id, sa.func.count()).group_by(Result.job_id)
    with stack.session() as session:
        written = dict(session.execute(rows).tuples().all())
        jobs = list(session.scalars(sa.select(Job).order_by(Job.id)))
    now = utcnow()
    ends = []
    for job in jobs:
        log = attempts(job)
        beat = f"{(now - job.heartbeat_at).total_seconds():.0f} s ago" if job.heartbeat_at else "never"
        trail = "; ".join(f"{a.stage.value} by {a.owner}: {a.ended or 'running'}" for a in log)
        detail = f"lease {job.lease_owner or '-'}, heartbeat {beat}, {job.resends} re-sends; attempts: {trail or '-'}"
        error = job.error_class.value if job.error_class else ""
        open_attempts = sum(a.ended is None for a in log)
        counts = (job.attempts, job.verdict_attempts, job.resends, written.get(job.id, 0), open_attempts)
        ends.append(JobEnd(job.id, job.model_id, job.state, error, *counts, detail))
    return ends


# --- the report --------------------------------------------------------------------------------------------


def duplicated(soak: Soak) -> list[JobEnd]:
    return [e for e in soak.ends if e.rows > 1]


def rowless(soak: Soak) -> list[JobEnd]:
    return [e for e in soak.ends if e.state in FINISHED_STATES and e.rows == 0]


def stranded(soak: Soak) -> list[JobEnd]:
    return [e for e in soak.ends if e.state not in FINISHED_STATES]


def quantile(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method), or the one value there is."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def latency_measure(soak: Soak, route: str) -> Measure:
    samples = [s for s in soak.samples if s.route == route]
    ms = [s.seconds * 1000 for s in samples]
    statuses = Counter("no answer" if s.status is None else str(s.status) for s in samples)
    return Measure(measure=f"{route} p99 latency under the load and the faults", unit="ms", ours=quantile(ms, 99),
                   note=f"{len(samples)} requests, p50 {quantile(ms, 50):.0f} ms, max {max(ms, default=0):.0f} ms; "
                   "answers " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())))  # fmt: skip


def measures(soak: Soak) -> list[Measure]:
    accepted = [s for s in soak.submissions if s.job_id is not None]
    rows = sum(e.rows for e in soak.ends)
    none = Goal(on="ours", at_most=0)
    return [
        Measure(measure="result rows written, per job", unit="", ours=rows, baseline=len(soak.ends),
                baseline_name="jobs in SQL", goal=Goal(on="ratio", at_least=1, at_most=1),
                note=f"{len(accepted)} submissions accepted by POST /jobs, {len(soak.ends)} jobs in SQL"),
        Measure(measure="jobs with more than one result row (duplicates)", unit="", ours=len(duplicated(soak)),
                goal=none),
        Measure(measure="finished jobs without a result row", unit="", ours=len(rowless(soak)), goal=none),
        Measure(measure="jobs left unfinished at the end (stranded)", unit="", ours=len(stranded(soak)), goal=none,
                note=f"after a drain of {soak.drain_s:.0f} s (at most {DRAIN_CAP_S:.0f} s) from the last wave"),
        Measure(measure="stack processes that exited on their own (started again, as a supervisor does)", unit="",
                ours=len(soak.crashes), goal=none,
                note=", ".join(f"{role} x{n}: {error}" for (role, error), n in
                               Counter((c.role, c.error.split(":")[0]) for c in soak.crashes).items())),
        latency_measure(soak, "POST /jobs"),
        latency_measure(soak, "GET /results"),
    ]  # fmt: skip


def report(soak: Soak, kept_schema: bool) -> Section:
    by_id = {e.id: e for e in soak.ends}
    accepted = {s.job_id for s in soak.submissions if s.job_id is not None}
    refused = [s for s in soak.submissions if s.job_id is None]
    states = Counter(e.state.value + (f" ({e.error})" if e.error else "") for e in soak.ends)
    retried = Counter(s.tries for s in soak.submissions)

    def outcome(fault: Fault) -> str:
        hit = [by_id[i] for i in fault.jobs if i in by_id]
        wrong = [e for e in hit if e.rows != 1 or e.state not in FINISHED_STATES]
        ended = Counter(e.state.value for e in hit)
        text = ", ".join(f"{n} {state}" for state, n in sorted(ended.items())) or "-"
        return text + (f"; **not one row**: {', '.join(str(e.id) for e in wrong)}" if wrong else "")

    def named(fault: Fault) -> str:
        return ", ".join(map(str, fault.jobs)) if len(fault.jobs) <= 3 else f"{len(fault.jobs)} jobs"

    schedule = "\n".join(
        f"| {f.at_s:.0f} | {f.kind.value} | {f.target} | {f.away_s:.1f} | {named(f)} | {outcome(f)} |"
        for f in soak.faults
    )
    wrong = duplicated(soak) + rowless(soak) + stranded(soak)
    evidence = "\n".join(
        f"- job {e.id} ({e.model_id}): {e.state.value}{f' {e.error}' if e.error else ''}, {e.rows} row(s); {e.detail}"
        for e in wrong
    )
    taken_over = sum(e.attempts > 1 or e.verdict_attempts > 1 for e in soak.ends)
    open_attempts = [e.id for e in soak.ends if e.state in FINISHED_STATES and e.open_attempts]
    details = (
        f"{soak.minutes:g} minutes of load (seed {soak.seed}; `{MINUTES_ENV}`, `{SEED_ENV}`): {len(soak.waves)} waves "
        f"of {', '.join(map(str, soak.waves)) or '-'} submissions, {len(accepted)} accepted "
        f"({sum(not s.created for s in soak.submissions if s.job_id)} of them answered 200 by a retry whose first "
        f"answer was lost), {len(refused)} given up after {SUBMIT_PATIENCE_S:.0f} s of refusals; tries per submission "
        f"{dict(sorted(retried.items()))}; {len(soak.ends) / (soak.load_s / 60):.1f} jobs a minute. The last wave "
        f"ended {soak.load_s:.0f} s after the first began; every job ended {soak.drain_s:.0f} s later"
        + ("" if soak.drained else f" — **not all did** within {DRAIN_CAP_S:.0f} s")
        + f". Host: {HOST_CORES} cores of the cpu backend (aot_eager, tiers off), lease {LEASE_S} s, heartbeat "
        f"{HEARTBEAT_S} s, reconciler every {RECONCILE_S} s, queue grace {GRACE_S} s; checkpoints "
        f"{', '.join(CHECKPOINTS)}, {TWO_CORE_SHARE:.0%} of submissions on 2 cores.\n\n"
        f"Jobs in SQL at the end, by state: {', '.join(f'{k}: {v}' for k, v in sorted(states.items()))}; "
        f"{taken_over} taken over after a lost attempt, {sum(e.resends for e in soak.ends)} messages re-sent by the "
        f"reconciler; finished jobs with an attempt left open: {open_attempts or 'none'}; jobs in SQL that no answer "
        f"of POST /jobs named: {sorted(set(by_id) - accepted) or 'none'}; accepted jobs missing from SQL: "
        f"{sorted(accepted - set(by_id)) or 'none'}. Messages Redis still held after the drain: "
        f"{soak.messages_left[0]} waiting, {soak.messages_left[1]} unacknowledged.\n\n"
        "The faults as applied (seconds since the first wave; the jobs each hit: a killed stage's, or those queued, "
        "running or judging when a service went away, and how they ended):\n\n"
        "| s | fault | target | away (s) | jobs hit | how they ended |\n|---:|---|---|---:|---|---|\n" + schedule + "\n"
    )
    if soak.crashes:
        details += (
            "\nProcesses of the stack that exited on their own (each started again, as compose's restart policy "
            "would):\n\n" + "\n".join(f"- {c.describe()}" for c in soak.crashes) + "\n"
        )
    if soak.orphans:
        details += (
            "\nProcesses of the killed launcher's tree that outlived its SIGKILL (a runner's own process group, or "
            "its children; its output names the job):\n\n" + "\n".join(f"- {o.describe()}" for o in soak.orphans) + "\n"
        )
    if wrong:
        details += "\nJobs that missed the goal (the evidence; logs in `.data/bench/soak/logs`):\n\n" + evidence + "\n"
    if refused:
        details += "\nSubmissions given up: " + "; ".join(f"{s.model_id}: {s.refused}" for s in refused[:10]) + "\n"
    if kept_schema:
        details += f"\nThe goal was missed: schema `{soak.schema}` is kept for inspection.\n"
    return Section(name="soak", title="Soak — the real stack under waves of jobs and faults (issue 23)",
                   measures=measures(soak), details=details)  # fmt: skip

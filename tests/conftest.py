"""Real services for the suite: Redis (its own db number), PostgreSQL (its own schema), the Hub stand-in,
tiny checkpoints, and a real worker process. Started here when they do not answer, stopped after.

The environment is set before anything imports huggingface_hub (it reads HF_ENDPOINT at import) or
reads the settings.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from shared.processes import free_port
from testing.services import Started, ensure_postgres, ensure_redis


def runner_paths() -> list[Path]:
    """The runner's modules: services/runner and each task's torch half (tasks/<name>/ but its declaration, the
    package's __init__)."""
    halves = [p for p in (ROOT / "tasks").glob("*/*.py") if p.name != "__init__.py"]
    return sorted([*(ROOT / "services" / "runner").rglob("*.py"), *halves])


ROOT = Path(__file__).resolve().parent.parent
RUN_DIR = Path(tempfile.mkdtemp(prefix="supportmatrix-tests-"))
RUN_DIR.chmod(0o711)  # the runner users of tests/test_isolation.py pass through to its directories, and list nothing
HUB_PORT = free_port()
SCHEMA = f"test_{uuid.uuid4().hex[:12]}"
PG_BASE = os.environ.get("SUPPORTMATRIX_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_BASE = os.environ.get("SUPPORTMATRIX_TEST_REDIS", "redis://127.0.0.1:6379")
HUB_TOKEN = "hf_stand_in_write_token"  # reads gated repos and writes datasets on the stand-in
COMPILE_BACKEND = "aot_eager"  # 5-7 s instead of 40-60 s for inductor; one test runs inductor


def pg_url(schema: str) -> str:
    return f"{PG_BASE}?options=-csearch_path%3D{schema}"


for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
    os.environ.pop(name, None)
os.environ.update(
    {
        "HF_ENDPOINT": f"http://127.0.0.1:{HUB_PORT}",
        "HF_HOME": str(RUN_DIR / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_XET": "1",
        "SUPPORTMATRIX_DATA_DIR": str(RUN_DIR / "data"),
        "SUPPORTMATRIX_DATABASE_URL": pg_url(SCHEMA),
        "SUPPORTMATRIX_CPU_COMPILE_BACKEND": COMPILE_BACKEND,
        "SUPPORTMATRIX_HEARTBEAT_INTERVAL_S": "1",
        "SUPPORTMATRIX_LEASE_TIMEOUT_S": "30",
        "SUPPORTMATRIX_WORKER_STALE_S": "15",
        "SUPPORTMATRIX_JOB_TIMEOUT_S": "600",
        # The tiers past the verdict cost seconds a run: on for the tests that check them (tests/test_tiers.py,
        # the compose stack's job), off elsewhere.
        "SUPPORTMATRIX_PERF_ITERATIONS": "0",
        "SUPPORTMATRIX_LONG_GENERATION": "false",
        # Runners run as the test process's user (root), in directories every test shares; tests/test_isolation.py
        # runs a stack of its own with the runner users on, as a worker started as root does by default.
        "SUPPORTMATRIX_RUNNER_USER": "",
    }
)

_started = Started()


def _pick_redis_db() -> str:
    import redis

    for db in range(15, 0, -1):
        client = redis.Redis.from_url(f"{REDIS_BASE}/{db}")
        # SET NX claims the db for this run; an empty db with our claim is ours alone.
        if client.dbsize() == 0 and client.set("supportmatrix:test-claim", str(os.getpid()), nx=True):
            return f"{REDIS_BASE}/{db}"
    raise RuntimeError("no free Redis db number in 1..15")


def pytest_configure(config: pytest.Config) -> None:
    ensure_redis(f"{REDIS_BASE}/0", _started)
    ensure_postgres(PG_BASE, _started)
    os.environ["SUPPORTMATRIX_REDIS_URL"] = _pick_redis_db()
    import psycopg

    with psycopg.connect(PG_BASE.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {SCHEMA}")
    from shared.db.migrate import upgrade

    upgrade()


# What makes a test slow here: a fixture that builds checkpoints, serves the Hub, starts the API, workers, a stack,
# pods, a browser or a big database. A test that asks for none of them and is not marked ``slow`` (a test that runs a
# model of its own) is ``quick``: ``pytest -m quick`` is the inner loop (docs/tests.md).
HEAVY_FIXTURES = frozenset({
    "tiny_models", "pipelines", "hub", "api", "verdict_worker", "worker", "start_worker", "stack", "workers",
    "two_hosts", "pods", "server", "browser", "page", "big", "big_schema", "client", "api_url", "seeded", "llama",
    "isolated", "isolated_backends", "fresh_api", "trusting_api", "kind_repos", "odd_repos", "sweep_repos",
    "pipeline_repos", "control_worker", "zygote", "host_zygote", "cli_org", "passing_submission", "api_on_proxy",
    "silent_hub",
})  # fmt: skip


# The files whose tests take longest, slowest first (`--durations`, docs/tests.md): they are collected first.
# pytest-xdist's ``--dist loadfile`` hands out files in collection order, each process two ahead, so a heavy file
# collected last would run alone on one process at the end while the other sits idle.
SLOWEST_FILES = (
    "test_faults.py", "test_isolation.py", "test_kubernetes.py", "test_deploy.py", "test_tiers.py",
    "test_task_pipelines.py", "test_references.py", "test_runner.py", "test_cores_and_tasks.py", "test_pipeline.py",
    "test_sweeps.py", "test_speech_recognition.py", "test_sharding.py", "test_stages.py", "test_metrics.py",
)  # fmt: skip

assert all((ROOT / "tests" / name).is_file() for name in SLOWEST_FILES), "a file of SLOWEST_FILES is gone"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the ``quick`` tests (``HEAVY_FIXTURES``). Each test schemathesis generates (tests/test_fuzz.py: one per
    API operation) gets a node id of its own. The plugin names them by operation (``test[GET /jobs]``), but pytest 9
    builds an item's id from its callspec, which they have none of, so all of them got their function's id;
    pytest-xdist's ``--dist loadfile`` (scripts/test.sh) keys its schedule by node id and so ran one of them: the
    other operations went unfuzzed, unreported. Under pytest 8 their ids already carry the bracket and nothing is
    changed. The slowest files go first (``SLOWEST_FILES``)."""
    from schemathesis.pytest.plugin import SchemathesisFunction

    for item in items:
        heavy = HEAVY_FIXTURES & set(getattr(item, "fixturenames", ()))
        if not heavy and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)
        if isinstance(item, SchemathesisFunction) and item.name.endswith("]") and "[" not in item.nodeid:
            params = item.name[item.name.index("[") + 1 : -1]
            item._id = item._id.with_params(params)
    items.sort(
        key=lambda item: SLOWEST_FILES.index(item.path.name) if item.path.name in SLOWEST_FILES else len(SLOWEST_FILES)
    )
    shared = [nodeid for nodeid, count in Counter(item.nodeid for item in items).items() if count > 1]
    if shared:
        raise pytest.UsageError(f"tests sharing a node id, which pytest-xdist would run once: {shared[:5]}")


def pytest_unconfigure(config: pytest.Config) -> None:
    import psycopg
    import redis

    from shared.db.engine import get_engine

    get_engine().dispose()
    with psycopg.connect(PG_BASE.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    redis.Redis.from_url(os.environ["SUPPORTMATRIX_REDIS_URL"]).flushdb()
    _started.stop()
    shutil.rmtree(RUN_DIR, ignore_errors=True)


@contextmanager
def fresh_database(kind: str, tmp_path: Path) -> Iterator[Any]:
    """A migrated database of the caller's own — a SQLite file, or a PostgreSQL schema dropped after — so that
    what it reads sees only the rows planted there. Yields its engine."""
    import psycopg

    from shared.db.engine import make_engine
    from shared.db.migrate import upgrade

    admin = PG_BASE.replace("postgresql+psycopg", "postgresql")
    schema = f"fresh_{uuid.uuid4().hex[:12]}"
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'fresh.db'}"
    else:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        url = pg_url(schema)
    upgrade(url)
    engine = make_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()
        if kind == "postgresql":
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Any]:
    """A migrated SQLite database of this test's own, for rules that need no services."""
    from sqlalchemy.orm import Session

    from shared.db.engine import make_engine
    from shared.db.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'rules.db'}"
    upgrade(url)
    engine = make_engine(url)
    with Session(engine, expire_on_commit=False) as s:
        yield s
    engine.dispose()


# --- checkpoints and the Hub ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    from testing.tiny_models import build

    out = RUN_DIR / "models"
    build(out)
    broken = out / "tiny-broken"
    shutil.copytree(out / "tiny-llama", broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)  # not a safetensors file: load fails
    return out


@pytest.fixture(scope="session")
def pipelines() -> Path:
    """The tiny sentence-transformers and diffusers repos (testing/tiny_pipelines.py)."""
    from testing.tiny_pipelines import build

    out = RUN_DIR / "pipelines"
    build(out)
    return out


@pytest.fixture(scope="session")
def hub(tiny_models: Path) -> Iterator[Any]:
    from testing.hub_standin import HubStandin

    standin = HubStandin(port=HUB_PORT, token=HUB_TOKEN, upload_dir=RUN_DIR / "hub-uploads")
    # One org per test module that submits jobs, so that de-duplication never links two modules' jobs.
    for org in ("org", "pin", "host", "refs", "stage", "auth"):
        standin.add_dir(tiny_models, org=org)
    standin.start()
    yield standin
    standin.stop()


@pytest.fixture(scope="session")
def api(hub: Any) -> Iterator[Any]:
    """The API, as a client holding an admin token (made by the token rules, in the test database)."""
    from fastapi.testclient import TestClient

    from services.api.main import app
    from shared.auth.tokens import create_token
    from shared.contracts.enums import Scope
    from shared.db.engine import session_scope

    with session_scope() as session:
        token = create_token(session, f"suite-{uuid.uuid4().hex[:8]}", Scope.admin)
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
        yield client


# --- a real worker process -----------------------------------------------------------------------------


class WorkerProcess:
    """A real worker: of the accelerator stage on a core group, or (``cores=None``) of the verdict stage."""

    def __init__(self, name: str, env: dict[str, str], cores: str | None = "0") -> None:
        self.name = name
        self.log = RUN_DIR / f"{name}.log"
        role = ["--cores", cores] if cores is not None else ["--verdict"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.worker", "--name", name, *role, "--loglevel", "INFO"],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if cores is None:
            self.wait_ready()
        else:
            self.wait_registered()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log.read_text()[-3000:]}")
            if " ready." in self.log.read_text(errors="replace"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"worker {self.name} did not become ready:\n{self.log.read_text()[-3000:]}")

    def wait_registered(self, timeout: float = 120) -> None:
        import sqlalchemy as sa

        from shared.db.engine import new_session
        from shared.db.models import Worker

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log.read_text()[-3000:]}")
            with new_session() as session:
                if session.scalar(sa.select(Worker).where(Worker.name.startswith(f"{self.name}@"))):
                    return
            time.sleep(0.5)
        raise RuntimeError(f"worker {self.name} did not register:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_zygote(address: str, log: Path) -> subprocess.Popen[bytes]:
    """A zygote (services/runner/zygote_server.py) at ``address`` with the runners' environment, as a host launcher
    starts one; returned once it is ready."""
    from shared.settings import child_environment, get_settings
    from shared.zygote_client import ZYGOTE_ENVIRONMENT

    proc = subprocess.Popen(
        [sys.executable, "-m", "services.runner.zygote_server", address],
        env=child_environment(get_settings(), ZYGOTE_ENVIRONMENT), cwd=ROOT, stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while "ready in" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc


@pytest.fixture(scope="session")
def host_zygote() -> Iterator[Path]:
    """This host's zygote, as its launcher keeps one (services/worker/host.py): the session's workers fork their
    runners from it, as a fleet's do, instead of starting each as a fresh interpreter that imports torch and
    transformers first (2 to 4 s, twice a stage). A worker whose runners' environment is not the zygote's (a planted
    fault, another compiler) is refused and starts them afresh; a test's launcher takes a host name of its own. Its
    log is yielded."""
    from shared.settings import get_settings
    from shared.zygote_client import zygote_address

    settings = get_settings()
    log = RUN_DIR / "host-zygote.log"
    proc = start_zygote(zygote_address(settings.data_dir, settings.host_name), log)
    yield log
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def verdict_worker(hub: Any, host_zygote: Path) -> Iterator[WorkerProcess]:
    """This host's verdict-stage worker: every job's verdict stage runs here, after its cores are free."""
    proc = WorkerProcess("v-main", {}, cores=None)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def worker(hub: Any, verdict_worker: WorkerProcess) -> Iterator[WorkerProcess]:
    proc = WorkerProcess("w-main", {})
    yield proc
    proc.stop()


@pytest.fixture
def planned_with(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set this process's settings — what the in-process API plans jobs under — for one test: ``planned_with(
    SUPPORTMATRIX_JUDGE_KIND="openai")``; a value of None unsets it."""
    from shared.settings import get_settings

    def plan_with(**env: str | None) -> None:
        for name, value in env.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        get_settings.cache_clear()

    yield plan_with
    get_settings.cache_clear()


@pytest.fixture
def start_worker(hub: Any, host_zygote: Path) -> Iterator[Any]:
    """Start extra workers for one test; they are stopped (and deregistered) when it ends."""
    started: list[WorkerProcess] = []

    def start(name: str, cores: str | None = "0", **env: str) -> WorkerProcess:
        proc = WorkerProcess(name, env, cores)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def started_runners(log: str, job_id: int, stage: str = r"\w+") -> list[int]:
    """The pids of the runners a worker started for a job (for one ``stage`` of it), in order, from its log: a runner
    forked by the host's zygote is the zygote's child, not the worker's."""
    return [int(pid) for pid in re.findall(rf"starting runner: job {job_id}, {stage} stage: .*? \(pid (\d+),", log)]


def stage_runner(worker: Any, job_id: int, stage: str, timeout: float = 120) -> Any:
    """The runner process (psutil's) a worker started for one stage of a job, once the worker has logged its start (a
    worker killed between the runner's start and its log line would leave a start the log does not count)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if started := started_runners(worker.log.read_text(errors="replace"), job_id, stage):
            return psutil.Process(started[-1])
        time.sleep(0.1)
    raise AssertionError(f"no {stage} runner for job {job_id}")


def wait_for_job(api: Any, job_id: int, states: set[str], timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = api.get(f"/jobs/{job_id}").json()
        if job["state"] in states:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not in {states} after {timeout} s: {job}")

"""Trust boundaries that hold: runners under users of their own, a repo's own code in a sandbox of its own.

A stack of its own — the embedded SQLite database, a Redis, an accelerator worker and a verdict worker, as root
with runner users on (``shared.isolation``) — runs three jobs in turn: a model of transformers' code, an
allow-listed org's ``trust_remote_code`` repo whose code probes what it can reach, and another model with the
compile cache pushed to a remote. The repo's code runs in each process that imports it (the accelerator run, the
CPU reference) and records what it tried: every other user's ``/proc/<pid>/environ`` (the workers', this
process's, which holds the suite's API), signals to them, the database file, a service's secrets file, and
writes into the shared compile cache, the runners' Hub cache and the data dir. It also plants a poisoned
entry in its own compile cache; the next run neither loads nor pushes it.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import FINISHED_STATES, JobState
from shared.db.engine import make_engine
from shared.db.migrate import upgrade
from shared.db.models import Job, Result, Worker
from shared.jobs.broker import make_celery
from shared.jobs.dispatch import commit_and_enqueue
from shared.jobs.submission import Request, submit_model
from shared.settings import Settings
from shared.zygote_client import zygote_address
from testing.redis_server import RedisServer
from testing.tiny_models import CUSTOM_MODELING_CODE
from tests.conftest import RUN_DIR
from tests.test_faults import LOGS, Proc, stop_all, worker_argv

ORG = "iso"
RUNNER, SANDBOX = "supportmatrix-runner", "supportmatrix-sandbox"
MARKER = "supportmatrix-poisoned-cache-entry-ran"
ZYGOTE_AS_THE_LAUNCHER_STARTS_IT = """\
import os, sys
from shared.settings import child_environment, get_settings
from shared.zygote_client import ZYGOTE_ENVIRONMENT
argv = [sys.executable, "-m", "services.runner.zygote_server", sys.argv[1]]
os.execve(sys.executable, argv, child_environment(get_settings(), ZYGOTE_ENVIRONMENT))
"""
# Runs when a process imports the repo's modeling code (a Llama's, under another name); every probe is caught, so
# the model itself loads and runs: the row is written whatever the code could or could not do.
SPY = """\
import json as _json
import os as _os
import pathlib as _pathlib

_TARGETS = _json.loads({targets!r})
_POISON = "open({marker_path!r}, 'w').close()  # {marker}\\n"


def _supportmatrix_probe():
    found = {{"uid": _os.getuid(), "environment": sorted(_os.environ), "environ": {{}}, "signal": {{}},
             "read": {{}}, "write": {{}}}}
    for name in ("SUPPORTMATRIX_CACHE_DIR", "HF_HOME", "HOME"):
        found[name] = _os.environ.get(name)
    for entry in _pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            owner = int((entry / "status").read_text().split("Uid:")[1].split()[0])
            (entry / "environ").read_bytes()
            outcome = "read"
        except PermissionError:
            outcome = "denied"
        except OSError:
            continue  # gone
        found["environ"][entry.name] = [owner, outcome]
        try:
            _os.kill(int(entry.name), 0)
            found["signal"][entry.name] = "allowed"
        except PermissionError:
            found["signal"][entry.name] = "denied"
        except OSError:
            pass
    for path in _TARGETS["read"]:
        try:
            open(path, "rb").read(1)
            found["read"][path] = "read"
        except OSError as exc:
            found["read"][path] = "denied" if isinstance(exc, PermissionError) else type(exc).__name__
    for path in _TARGETS["write"]:
        try:
            _pathlib.Path(path).write_text(_POISON)
            found["write"][path] = "wrote"
        except OSError as exc:
            found["write"][path] = "denied" if isinstance(exc, PermissionError) else type(exc).__name__
    private = _pathlib.Path(_os.environ["SUPPORTMATRIX_CACHE_DIR"]) / "inductor" / "fxgraph" / "poison" / "entry.py"
    private.parent.mkdir(parents=True, exist_ok=True)
    private.write_text(_POISON)
    found["private"] = str(private)
    (_pathlib.Path({probes!r}) / f"{{_os.getpid()}}.json").write_text(_json.dumps(found))


_supportmatrix_probe()
"""


@dataclass
class Isolated:
    root: Path
    data: Path
    probes: Path
    remote: Path
    engine: sa.Engine
    settings: Settings
    workers: list[Proc]

    def run(self, model: str) -> Job:
        """Submit one job of ``model`` as POST /jobs does, and wait for it to end."""
        producer = make_celery(self.settings, "isolated-producer")
        with Session(self.engine, expire_on_commit=False) as session:
            [submitted] = submit_model(session, self.settings, Request(model, cores=1))
            assert submitted.created and submitted.enqueue, model
            commit_and_enqueue(session, producer, [submitted])
            job_id = submitted.job.id
        deadline = time.monotonic() + 240
        while True:
            with Session(self.engine) as session:
                job = session.get(Job, job_id)
                assert job is not None
                if job.state in FINISHED_STATES:
                    return job
            logs = "\n".join(w.text()[-2000:] for w in self.workers)
            assert time.monotonic() < deadline, f"job {job_id} of {model} still {job.state}:\n{logs}"
            time.sleep(0.5)

    def rows(self, job_id: int) -> list[Result]:
        with Session(self.engine) as session:
            return list(session.scalars(sa.select(Result).where(Result.job_id == job_id)))

    def worker_pids(self) -> set[int]:
        """The workers' processes (each Celery main process and its pool) and the zygote's."""
        pids = set()
        for worker in self.workers:
            pids.add(worker.pid)
            pids |= {
                child.pid for child in psutil.Process(worker.pid).children(recursive=True) if child.uids().real == 0
            }
        return pids


@pytest.fixture(scope="module")
def isolated(hub: Any, tiny_models: Path) -> Iterator[Isolated]:
    root = RUN_DIR / "isolated"
    data, probes, remote, models = root / "data", root / "probes", root / "remote", root / "models"
    for path in (data, probes, remote, models, LOGS):
        path.mkdir(parents=True, exist_ok=True)
    probes.chmod(0o777)  # where the repo's code reports what it saw
    runner = pwd.getpwnam(RUNNER)
    os.chown(remote, runner.pw_uid, runner.pw_gid)  # the compile cache's remote, written by trusted runs
    (data / "service.env").write_text("SUPPORTMATRIX_DATABASE_URL=postgresql://svc:secret@db/prod\n")
    (data / "service.env").chmod(0o600)  # a service's secrets, as an operator keeps them
    targets = {
        "read": [str(data / "supportmatrix.db"), str(data / "service.env")],
        "write": [str(data / "cache" / "inductor" / "poison.py"), str(root / "hf-home" / "poison.py"),
                  str(data / "poison.py"), str(data / "artifacts" / "poison.py")],
    }  # fmt: skip
    spy = models / "tiny-spy"
    shutil.rmtree(spy, ignore_errors=True)
    shutil.copytree(tiny_models / "tiny-custom", spy)
    code = SPY.format(targets=json.dumps(targets), marker_path=str(root / MARKER), marker=MARKER, probes=str(probes))
    (spy / "modeling_custom.py").write_text(code + CUSTOM_MODELING_CODE)
    hub.add(f"{ORG}/tiny-spy", spy)
    for name in ("tiny-llama", "tiny-gpt2"):
        hub.add(f"{ORG}/{name}", tiny_models / name)

    url = f"sqlite:///{data / 'supportmatrix.db'}"
    upgrade(url)
    engine = make_engine(url)
    redis = RedisServer().start()
    settings = Settings(data_dir=data, database_url=url, redis_url=redis.url(), remote_code_orgs=[ORG])
    env = {
        **os.environ,
        "SUPPORTMATRIX_RUNNER_USER": RUNNER,
        "SUPPORTMATRIX_SANDBOX_USER": SANDBOX,
        "SUPPORTMATRIX_DATA_DIR": str(data),
        "SUPPORTMATRIX_DATABASE_URL": url,
        "SUPPORTMATRIX_REDIS_URL": redis.url(),
        "SUPPORTMATRIX_HOST_NAME": "isolated",
        "HF_HOME": str(root / "hf-home"),
        "SUPPORTMATRIX_COMPILE_CACHE_REMOTE": f"file://{remote}",
        "SUPPORTMATRIX_COMPILE_CACHE_PUSH": "true",
        "SUPPORTMATRIX_COMPILE_CACHE_TOKEN": "a-compile-cache-write-token",
    }
    # The accelerator worker's runners fork from a zygote, started as the host launcher starts it (root, the
    # runners' environment); the verdict worker's start as fresh interpreters: both ways of taking a user.
    zygote_argv = [sys.executable, "-c", ZYGOTE_AS_THE_LAUNCHER_STARTS_IT, zygote_address(data, "isolated")]
    zygote = Proc("iso-zygote", zygote_argv, env)
    zygote.wait_logged("ready in")
    workers = [
        zygote,
        Proc("iso-acc", worker_argv("iso-acc", "0"), env),
        Proc("iso-v", worker_argv("iso-v", None), env | {"SUPPORTMATRIX_ZYGOTE": "false"}),
    ]
    try:

        def registered() -> bool:
            with Session(engine) as session:
                return session.scalar(sa.select(Worker.name).where(Worker.name.startswith("iso-acc@"))) is not None

        workers[1].wait_for(registered, "registration", timeout=120)
        workers[2].wait_logged(" ready.")
        yield Isolated(root, data, probes, remote, engine, settings, workers)
    finally:
        stop_all(workers)
        redis.stop()
        engine.dispose()


def test_repo_code_runs_as_the_sandbox_user_reaches_no_secret_and_poisons_no_later_run(isolated: Isolated) -> None:
    sandbox_uid = pwd.getpwnam(SANDBOX).pw_uid
    trusted = isolated.run(f"{ORG}/tiny-llama")
    spied = isolated.run(f"{ORG}/tiny-spy")
    for job in (trusted, spied):  # one row each; the repo's probing did not keep its row from being written
        [row] = isolated.rows(job.id)
        assert job.state == JobState.done and row.verdict == "PASS", (job.error_class, job.error_message)
    zygote, acc, verdict = (w.text() for w in isolated.workers)
    assert f"job {trusted.id}, accelerator stage" in acc and f"forked by the zygote, as {RUNNER})" in acc
    # The runner user's runner asked the root zygote for its CPU reference child: it got one (as its own user).
    assert re.search(rf"fork \d+: services.runner.child \S+/job-{trusted.id}/", zygote), zygote
    # The repo's code never forks from the zygote: its private directories are not those the zygote imported
    # torch and huggingface_hub with (both read them at import), so it starts as a fresh interpreter.
    assert f"job {spied.id}, accelerator stage" in acc
    assert "the zygote refused: environment differs from the zygote's in HF_HOME, HOME, SUPPORTMATRIX_CACHE_DIR" in acc
    assert f"as {SANDBOX})" in acc and f"a fresh interpreter, as {SANDBOX})" in verdict

    probes = [json.loads(p.read_text()) for p in isolated.probes.glob("*.json")]
    assert len(probes) >= 2, "the accelerator run and the CPU reference each import the repo's code"
    sandbox = isolated.data / "artifacts" / f"job-{spied.id}" / "sandbox"
    services = isolated.worker_pids() | {os.getpid()}  # the workers, and this process (it holds the suite's API)
    for probe in probes:
        assert probe["uid"] == sandbox_uid
        secrets = {"SUPPORTMATRIX_DATABASE_URL", "SUPPORTMATRIX_REDIS_URL", "SUPPORTMATRIX_COMPILE_CACHE_TOKEN",
                   "HF_TOKEN", "SUPPORTMATRIX_PUBLISH_TOKEN", "SUPPORTMATRIX_JUDGE_TOKEN"}  # fmt: skip
        assert not secrets & set(probe["environment"])
        read = {pid: owner for pid, (owner, outcome) in probe["environ"].items() if outcome == "read"}
        assert set(read.values()) == {sandbox_uid}, read  # only its own user's processes
        for pid in services:
            assert probe["environ"][str(pid)] == [0, "denied"] and probe["signal"][str(pid)] == "denied"
        assert set(probe["read"].values()) == {"denied"}, probe["read"]  # the database file, the secrets file
        assert set(probe["write"].values()) == {"denied"}, probe["write"]  # shared cache, Hub cache, data dir
        # its caches and home were its job's own
        assert (probe["SUPPORTMATRIX_CACHE_DIR"], probe["HF_HOME"], probe["HOME"]) == (
            str(sandbox / "cache"), str(sandbox / "hf-home"), str(sandbox / "home"),
        )  # fmt: skip
        assert probe["private"].startswith(str(sandbox / "cache"))
    assert not sandbox.exists()  # removed with its job's row: no later run can read it
    assert (isolated.data / "supportmatrix.db").stat().st_mode & 0o777 == 0o600
    for journal in isolated.data.glob("supportmatrix.db-*"):  # SQLite gives its -wal and -shm the file's mode
        assert journal.stat().st_mode & 0o777 == 0o600, journal

    # A trusted run after it pushes the shared cache — an entry a trusted run left there — and nothing else.
    benign = isolated.data / "cache" / "inductor" / "fxgraph" / "benign" / "entry.py"
    benign.parent.mkdir(parents=True, exist_ok=True)
    benign.write_text("# an entry a trusted run compiled\n")
    after = isolated.run(f"{ORG}/tiny-gpt2")
    [row] = isolated.rows(after.id)
    assert after.state == JobState.done and row.verdict == "PASS", (after.error_class, after.error_message)
    pushed = [p for p in isolated.remote.rglob("*") if p.is_file()]
    assert any(p.as_posix().endswith("fxgraph/benign/entry.py") for p in pushed), pushed
    shared = [p for p in (isolated.data / "cache").rglob("*") if p.is_file()]
    for path in pushed + shared:
        assert "poison" not in path.as_posix() and MARKER not in path.read_text(errors="replace"), path
    assert not (isolated.root / MARKER).exists()  # the poisoned entry never ran

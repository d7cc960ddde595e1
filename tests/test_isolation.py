"""Trust boundaries that hold: runners under users of their own, a repo's own code in a sandbox of its own.

A stack of its own — the embedded SQLite database, a Redis, an accelerator worker and a verdict worker, as root
with runner users on (``shared.isolation``) — runs three jobs in turn: a model of transformers' code, an
allow-listed org's ``trust_remote_code`` repo whose code probes what it can reach, and another model with the
compile cache pushed to a remote. The repo's code runs in each process that imports it (the accelerator run, the
CPU reference) and records what it tried: every other user's ``/proc/<pid>/environ`` (the workers', this
process's, which holds the suite's API), signals to them, the database file, a service's secrets file, and
writes into the shared compile cache, the runners' Hub cache and the data dir. It also plants a poisoned
entry in its own compile cache, which the next run neither loads nor pushes, and a link at the name of its job's
next log, to a file only root writes, which the worker replaces instead of writing through; its CPU reference is
not stored for other runs to reuse.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import re
import shutil
import stat
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.orm import Session

from services.worker.supervise import Prefetched, crashed, keeps_work_directory, prefetch, read_report, supervise
from services.worker.tasks import _verdict_output
from shared.contracts.enums import FINISHED_STATES, ErrorClass, JobState, Stage, Verdict
from shared.contracts.handoffs import Artifacts, read_regular, write_atomically
from shared.contracts.report import RunReport
from shared.contracts.run import RunRequest, RuntimeInfo
from shared.db.engine import make_engine
from shared.db.migrate import upgrade
from shared.db.models import Job, ReferenceRun, Result, Worker
from shared.isolation import Isolation, RunAs, Sandbox, WorkDir, give
from shared.jobs.broker import make_celery
from shared.jobs.dispatch import commit_and_enqueue
from shared.jobs.outcomes import job_report
from shared.jobs.submission import Request, submit_model
from shared.settings import Settings
from shared.zygote_client import zygote_address
from testing.redis_server import RedisServer
from testing.tiny_models import CUSTOM_MODELING_CODE
from tests.conftest import HUB_TOKEN, ROOT, RUN_DIR
from tests.test_faults import LOGS, Proc, stop_all, worker_argv

ORG = "iso"
RUNNER = "supportmatrix-runner"


def sandbox_of(job_id: int) -> RunAs:
    """The user job ``job_id``'s repo code runs as, under the default SUPPORTMATRIX_SANDBOX_UIDS."""
    return Isolation(RunAs.named(RUNNER), Settings().sandbox_uid_range).sandbox_for(job_id)


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
import tempfile as _tempfile

_TARGETS = _json.loads({targets!r})
_POISON = "open({marker_path!r}, 'w').close()  # {marker}\\n"


def _supportmatrix_probe():
    found = {{"uid": _os.getuid(), "environment": sorted(_os.environ), "values": dict(_os.environ), "environ": {{}},
             "environ_text": {{}}, "signal": {{}}, "read": {{}}, "write": {{}}, "token_files": {{}}}}
    for name in ("SUPPORTMATRIX_CACHE_DIR", "HF_HOME", "HOME", "TMPDIR", "TORCH_NEURONX_DEBUG_DIR", "HF_HUB_OFFLINE"):
        found[name] = _os.environ.get(name)
    work = _os.stat(_os.path.dirname(_os.environ["TORCH_NEURONX_DEBUG_DIR"]))
    found["work"] = {{"uid": work.st_uid, "mode": work.st_mode & 0o777}}
    found["tempfile"] = _tempfile.gettempdir()
    found["no_new_privs"] = _pathlib.Path("/proc/self/status").read_text().split("NoNewPrivs:")[1].split()[0]
    found["capability_bound"] = _pathlib.Path("/proc/self/status").read_text().split("CapBnd:")[1].split()[0]
    hub_home = _pathlib.Path(_os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    home_login = _pathlib.Path("~/.cache/huggingface/token").expanduser()
    token_path = _pathlib.Path(_os.environ.get("HF_TOKEN_PATH", "/nonexistent"))
    for path in (hub_home / "token", hub_home / "stored_tokens", home_login, token_path):
        try:
            found["token_files"][str(path)] = path.read_text()
        except OSError as exc:
            found["token_files"][str(path)] = type(exc).__name__
    for entry in _pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            owner = int((entry / "status").read_text().split("Uid:")[1].split()[0])
            found["environ_text"][entry.name] = (entry / "environ").read_bytes().decode(errors="replace")
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
    # Everything of its job it can read (its sandbox, the download's log and report, the runners' logs) is copied
    # out for the test to search; the worker's download staging it must not even list.
    job_dir = _pathlib.Path(_os.environ["HF_HOME"]).parent.parent
    tree = _pathlib.Path({probes!r}) / f"{{_os.getpid()}}-tree"
    found["pid"], found["copied"] = _os.getpid(), {{}}
    for path in sorted(job_dir.rglob("*")):
        if not path.is_file():  # a snapshot's links are read through: the blobs they name
            continue
        try:
            data = path.read_bytes()
        except OSError as exc:
            found["copied"][str(path.relative_to(job_dir))] = type(exc).__name__
            continue
        copy = tree / path.relative_to(job_dir)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(data)
        found["copied"][str(path.relative_to(job_dir))] = "copied"
    # Links at names the worker (root) opens next, to a file only root may write: the verdict stage's log, which
    # the worker makes when it starts that stage's fresh interpreter.
    for name, target in _TARGETS["plant"].items():
        if not _os.path.lexists(job_dir / name):
            _os.symlink(target, job_dir / name)
    try:
        found["staging"] = sorted(_os.listdir(job_dir.parent / ".downloads"))
    except OSError as exc:
        found["staging"] = type(exc).__name__
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

    def probes_of(self, job: Job) -> list[dict[str, Any]]:
        """What the repo's code saw in each process of ``job`` that imported it."""
        probes = [json.loads(p.read_text()) for p in self.probes.glob("*.json")]
        return [probe for probe in probes if f"/job-{job.id}/" in probe["TORCH_NEURONX_DEBUG_DIR"]]

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


def trn2_launcher_capabilities() -> list[str]:
    """The capabilities the trn2 launcher's container adds to none (deploy/kubernetes/components/trn2/launcher.yaml)."""
    [patch] = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "components" / "trn2" / "launcher.yaml").read_text())
    [box] = patch["spec"]["template"]["spec"]["containers"]
    capabilities = box["securityContext"]["capabilities"]
    assert capabilities["drop"] == ["ALL"] and box["securityContext"]["allowPrivilegeEscalation"] is False
    return capabilities["add"]


def as_the_trn2_pod_runs_it(argv: list[str]) -> list[str]:
    """``argv`` with only the trn2 launcher's capabilities in its bounding set (so in what root holds at its exec) and
    no_new_privs, as the container runtime starts the pod's process (setpriv, util-linux)."""
    keep = ",".join(f"+{name.lower()}" for name in trn2_launcher_capabilities())
    return ["setpriv", "--no-new-privs", "--bounding-set", f"-all,{keep}", "--", *argv]


def capability_mask(names: list[str]) -> int:
    """/proc/<pid>/status's CapBnd of exactly these capabilities (linux/capability.h's numbers)."""
    numbers = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "KILL": 5, "SETGID": 6, "SETUID": 7, "IPC_LOCK": 14}
    return sum(1 << numbers[name] for name in names)


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
    (root / "hf-home").mkdir(exist_ok=True)
    service_token = root / "hf-home" / "token"  # the service's own Hub login, 0600 as `hf auth login` leaves it
    service_token.write_text(HUB_TOKEN)
    service_token.chmod(0o600)
    canary = root / "root-only.txt"  # what a link the repo's code plants points at
    canary.write_text("root's own")
    canary.chmod(0o600)
    targets = {
        "plant": {"verdict-runner.log": str(canary)},
        "read": [str(data / "supportmatrix.db"), str(data / "service.env"), str(service_token)],
        "write": [str(data / "cache" / "inductor" / "poison.py"), str(root / "hf-home" / "poison.py"),
                  str(data / "poison.py"), str(data / "artifacts" / "poison.py")],
    }  # fmt: skip
    spy = models / "tiny-spy"
    shutil.rmtree(spy, ignore_errors=True)
    shutil.copytree(tiny_models / "tiny-custom", spy)
    code = SPY.format(targets=json.dumps(targets), marker_path=str(root / MARKER), marker=MARKER, probes=str(probes))
    (spy / "modeling_custom.py").write_text(code + CUSTOM_MODELING_CODE)
    hub.add(f"{ORG}/tiny-spy", spy)
    hub.add(f"{ORG}/tiny-gated-spy", spy, gated="manual")  # readable with the stand-in's one token only
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
        "SUPPORTMATRIX_DATA_DIR": str(data),
        "SUPPORTMATRIX_DATABASE_URL": url,
        "SUPPORTMATRIX_REDIS_URL": redis.url(),
        "SUPPORTMATRIX_HOST_NAME": "isolated",
        "HF_HOME": str(root / "hf-home"),
        "SUPPORTMATRIX_COMPILE_CACHE_REMOTE": f"file://{remote}",
        "SUPPORTMATRIX_COMPILE_CACHE_PUSH": "true",
        "SUPPORTMATRIX_COMPILE_CACHE_TOKEN": "a-compile-cache-write-token",
        "HF_TOKEN": HUB_TOKEN,  # the service's Hub token: gated repos' files need it
    }
    # The accelerator worker's runners fork from a zygote, started as the host launcher starts it (root, the
    # runners' environment); the verdict worker's start as fresh interpreters: both ways of taking a user.
    # Every one of them as the trn2 pod runs its launcher: root with the capabilities the manifest adds and no other,
    # and no_new_privs (allowPrivilegeEscalation: false); the tests below pass only if that is all stages take.
    zygote_argv = [sys.executable, "-c", ZYGOTE_AS_THE_LAUNCHER_STARTS_IT, zygote_address(data, "isolated")]
    zygote = Proc("iso-zygote", as_the_trn2_pod_runs_it(zygote_argv), env)
    zygote.wait_logged("ready in")
    workers = [
        zygote,
        Proc("iso-acc", as_the_trn2_pod_runs_it(worker_argv("iso-acc", "0")), env),
        Proc("iso-v", as_the_trn2_pod_runs_it(worker_argv("iso-v", None)), env | {"SUPPORTMATRIX_ZYGOTE": "false"}),
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
    trusted = isolated.run(f"{ORG}/tiny-llama")
    spied = isolated.run(f"{ORG}/tiny-spy")
    sandbox = sandbox_of(spied.id)  # a uid of its job's own, no account's
    sandbox_uid = sandbox.uid
    with pytest.raises(KeyError):
        pwd.getpwuid(sandbox_uid)
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
    differs = "HF_HOME, HOME, LOGNAME, SUPPORTMATRIX_CACHE_DIR"  # its sandbox's directories, its uid's name
    assert f"the zygote refused: environment differs from the zygote's in {differs}" in acc
    assert f"as {sandbox.name})" in acc and f"a fresh interpreter, as {sandbox.name})" in verdict

    probes = isolated.probes_of(spied)
    assert len(probes) >= 2, "the accelerator run and the CPU reference each import the repo's code"
    # The link it planted at the verdict stage's log was replaced, not written through; and the reference its run
    # computed (its files, key included, written by its code) was not stored for any later run to reuse.
    assert (isolated.root / "root-only.txt").read_text() == "root's own"
    with Session(isolated.engine) as session:
        stored = set(session.scalars(sa.select(ReferenceRun.model_id)))
    assert stored == {f"{ORG}/tiny-llama"}, stored
    artifacts = isolated.data / "artifacts" / f"job-{spied.id}"
    sandbox = artifacts / "sandbox"
    # each stage worked in a directory of its own, 0700, the sandbox user's: TorchNeuron's is there, and TMPDIR
    # (but the CPU backend's accelerator run's, inductor's scratch in the sandbox's own compile cache)
    work = {stage: str(artifacts / f"work-{stage}") for stage in ("accelerator", "verdict")}
    assert {probe["TORCH_NEURONX_DEBUG_DIR"] for probe in probes} == {f"{w}/neuron_backend" for w in work.values()}
    for probe in probes:
        assert probe["work"] == {"uid": sandbox_uid, "mode": 0o700}
        stage_work = probe["TORCH_NEURONX_DEBUG_DIR"].removesuffix("/neuron_backend")
        scratch = str(sandbox / "cache" / "inductor" / "tmp") if stage_work == work["accelerator"] else stage_work
        assert probe["TMPDIR"] == probe["tempfile"] == scratch
    services = isolated.worker_pids() | {os.getpid()}  # the workers, and this process (it holds the suite's API)
    for probe in probes:
        assert probe["uid"] == sandbox_uid
        assert probe["no_new_privs"] == "1"  # no setuid binary or file capability gives it more than its uid
        # its launcher's capabilities bound it: the trn2 manifest's, under which every stage ran
        assert int(probe["capability_bound"], 16) == capability_mask(trn2_launcher_capabilities())
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


def test_a_gated_repo_with_its_own_code_is_downloaded_by_the_worker_and_its_code_never_sees_the_token(
    isolated: Isolated, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spy repo, gated: the worker holds the Hub token, downloads the repo (its code from the pinned commit)
    into a staging directory of its own, hands it to the sandbox user when the download has ended, and the runner
    of the repo's code runs offline on those files without the token. The row is a PASS; the code, in each process
    that imported it, found the token in no variable, no /proc/<pid>/environ it could read, no token file (its Hub
    cache's, its home's, HF_TOKEN_PATH, the service's own login), and no file of its job it could read — its whole
    sandbox, the download's log, the runners' logs — and could not list the worker's download staging."""
    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)  # the API's: sizing a gated repo reads its config
    job = isolated.run(f"{ORG}/tiny-gated-spy")
    [row] = isolated.rows(job.id)
    assert job.state == JobState.done and row.verdict == "PASS", (job.error_class, job.error_message)
    assert job.gated and job.trust_remote_code
    acc = isolated.workers[1].text()
    assert f"job {job.id}: the worker downloads gated {ORG}/tiny-gated-spy for its code's sandbox" in acc
    probes = isolated.probes_of(job)
    assert len(probes) >= 2, "the accelerator run and the CPU reference each import the repo's code"
    sandbox_uid = sandbox_of(job.id).uid
    token = HUB_TOKEN.encode()
    for probe in probes:
        assert probe["uid"] == sandbox_uid and "HF_TOKEN" not in probe["environment"]
        assert probe["environ_text"], "it read the environments of its own user's processes"
        assert HUB_TOKEN not in json.dumps(probe), [k for k, v in probe.items() if HUB_TOKEN in json.dumps(v)]
        assert set(probe["read"].values()) == {"denied"}, probe["read"]  # the service's token file among them
        assert probe["staging"] == "PermissionError"
        copied = {path for path, outcome in probe["copied"].items() if outcome == "copied"}
        snapshot = [path for path in copied if path.startswith("sandbox/hf-home/hub/models--")]
        assert "download.log" in copied and "accelerator-runner.log" in copied, sorted(probe["copied"].items())
        assert {Path(path).name for path in snapshot} >= {"config.json", "modeling_custom.py"}, snapshot
        for copy in (isolated.probes / f"{probe['pid']}-tree").rglob("*"):
            assert copy.is_dir() or token not in copy.read_bytes(), copy
    # the accelerator run read the worker's download offline; the files came from the commit it was sized at
    accelerator = [probe for probe in probes if "/work-accelerator/" in probe["TORCH_NEURONX_DEBUG_DIR"]]
    assert accelerator and {probe["HF_HUB_OFFLINE"] for probe in accelerator} == {"1"}
    assert not (isolated.data / "artifacts" / f"job-{job.id}").exists()
    assert list((isolated.data / "artifacts" / ".downloads").iterdir()) == []  # the staging went with its download


WORK_PROBE = """\
import json, os, pathlib, sys
found = {}
for path in sys.argv[1:]:
    try:
        found[path] = sorted(os.listdir(path))
    except OSError as exc:
        found[path] = type(exc).__name__
print(json.dumps(found))
"""


def as_user(who: str | RunAs, script: str, *args: str, env: dict[str, str] | None = None) -> Any:
    """``script`` run by ``python -c`` as the user ``who`` (an account's name, or a sandbox uid): its JSON answer."""
    import subprocess

    user = RunAs.named(who) if isinstance(who, str) else who
    done = subprocess.run([sys.executable, "-c", script, *args], user=user.uid, group=user.gid, extra_groups=[],
                          env=env, capture_output=True, text=True, check=True, cwd="/", timeout=60)  # fmt: skip
    return json.loads(done.stdout)


def stage_job(name: str, job_id: int, *, gated: bool = False, trust_remote_code: bool = False) -> Job:
    """A job row as the worker holds it when it supervises a stage (not stored: supervise reads its columns)."""
    runtime = RuntimeInfo(backend="cpu", compiler_name="inductor", compiler_version="2.9", library_version="4")
    return Job(id=job_id, model_id=name, sha="c" * 40, task="text-generation", cores=1, gated=gated,
               trust_remote_code=trust_remote_code, **runtime.model_dump())  # fmt: skip


def lease_held() -> bool:
    return True


def test_each_job_s_runs_get_directories_no_other_job_s_user_can_read() -> None:
    """Three real runs, supervised as the worker supervises a stage, their users and directories given by the
    worker's own ``stage_user``: a trusted job's (the runner user) and two sandboxed jobs' (each its job's own uid, no
    account's), each a judge stage with nothing to judge, so each ends ERROR and keeps its work directory (as an
    ERROR's and a FAIL's are kept). Each got a work directory of its own, 0700, its run's user's, in a job directory
    that is 0700 and that user's too. Each user writes TorchNeuron's directory in its own; none of them can list
    another's job directory, work directory or TorchNeuron's — the two sandboxed jobs included — nor can a third
    user."""
    from services.worker.tasks import stage_user

    base = RUN_DIR / "workdirs" / uuid.uuid4().hex[:8]
    artifacts = base / "artifacts"
    artifacts.mkdir(parents=True)
    for directory in (base, artifacts):
        directory.chmod(0o755)
    settings = Settings(data_dir=base, zygote=False, runner_user=RUNNER)  # the suite's own workers isolate nothing
    users: dict[int, RunAs] = {}
    works: dict[int, WorkDir] = {}
    for job_id, repo_code in {1: False, 2: True, 3: True}.items():
        job = stage_job("iso/nothing-to-judge", job_id, trust_remote_code=repo_code)
        job_dir = Artifacts(artifacts / f"job-{job_id}")
        job_dir.root.mkdir()
        user, private = stage_user(job, job_dir, settings, runs_repo_code=repo_code)
        assert user is not None
        request = RunRequest(model_id="iso/nothing-to-judge", stage=Stage.judge, artifacts=job_dir.root,
                             report=job_dir.root / "judge-report.json")  # fmt: skip
        report = supervise(request, job, settings, lease_held, None, None, user, private)
        assert report is not None and report.verdict == "ERROR", report
        users[job_id], works[job_id] = user, WorkDir.of_stage(job_dir.root, Stage.judge.value)
    assert users[1] == RunAs.named(RUNNER) and users[2] == sandbox_of(2) and users[3] == sandbox_of(3)
    assert len({user.uid for user in users.values()}) == 3
    for job_id, work in works.items():
        for directory in (work.path, work.path.parent):
            held = directory.lstat()
            assert stat.S_ISDIR(held.st_mode) and (held.st_uid, held.st_mode & 0o777) == (users[job_id].uid, 0o700)
    write = (
        "import os, pathlib; d = pathlib.Path(os.environ['TORCH_NEURONX_DEBUG_DIR']); d.mkdir(); "
        "(d / 'graph.hlo').write_text('g'); print(1)"
    )
    for job_id, work in works.items():
        assert as_user(users[job_id], write, env={"PATH": os.environ["PATH"], **work.environment()}) == 1
        assert as_user(users[job_id], WORK_PROBE, str(work.neuron_debug)) == {str(work.neuron_debug): ["graph.hlo"]}
    readers = {**users, 0: RunAs.named("nobody")}
    for reader_id, reader in readers.items():
        for job_id, theirs in works.items():
            if job_id == reader_id:
                continue
            paths = [str(theirs.path.parent), str(theirs.path), str(theirs.neuron_debug)]
            found = as_user(reader, WORK_PROBE, *paths)
            assert set(found.values()) == {"PermissionError"}, (reader.name, job_id, found)
    shutil.rmtree(base)


def test_a_work_directory_is_kept_while_its_row_may_be_a_fail_and_for_a_fail_or_an_error() -> None:
    """The accelerator stage's (verdict None: the verdict stage decides next), a FAIL's and an ERROR's are kept
    with the artifacts, which the worker's retention rule then keeps for a FAIL; a PASS's, a SKIPPED's and a
    cancelled stage's go when the stage ends."""
    kept = {verdict: keeps_work_directory(RunReport.model_validate(SKELETON | {"verdict": verdict}))
            for verdict in (None, *Verdict)}  # fmt: skip
    assert kept == {None: True, Verdict.FAIL: True, Verdict.ERROR: True, Verdict.PASS: False, Verdict.SKIPPED: False}
    assert keeps_work_directory(None) is False


SKELETON: dict[str, Any] = {"subject": {"model_id": "iso/m", "task": "text-generation", "backend": "cpu"}}


def test_a_link_or_file_planted_at_a_work_directory_is_removed_never_followed(tmp_path: Path) -> None:
    """A process of the job's user can plant a link (or a file) where the next stage's work directory goes, before
    the worker (root) makes it: the link is removed, its target keeps its files, owner and mode, and the work
    directory is a fresh, real directory, 0700, the run's user's."""
    sandbox = sandbox_of(1)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    (victim / "kept").write_text("root's")
    for planted in ("link", "file"):
        job_dir = tmp_path / f"job-{planted}"
        job_dir.mkdir()
        work = WorkDir.of_stage(job_dir, "accelerator")
        if planted == "link":
            work.path.symlink_to(victim, target_is_directory=True)
        else:
            work.path.write_text("planted")
        work.create(sandbox)
        held = work.path.lstat()
        assert stat.S_ISDIR(held.st_mode) and (held.st_uid, held.st_mode & 0o777) == (sandbox.uid, 0o700)
        assert list(work.path.iterdir()) == []
    victim_held = victim.stat()
    assert (victim_held.st_uid, victim_held.st_mode & 0o777) == (0, 0o755)
    assert [p.name for p in victim.iterdir()] == ["kept"] and (victim / "kept").read_text() == "root's"


def test_the_workers_reads_and_writes_in_a_job_directory_follow_no_link_planted_there(tmp_path: Path) -> None:
    """What the worker (root) opens in a job's directory — a stage's report and log, a phase, the verdict stage's
    output, the stored reference it hands over — a process of the job's user can have replaced with a link to a
    file only root reads (or a hard link to it, or a FIFO that would block the worker): none is followed. A read
    refuses it (a report or a phase reads as none; a log's tail names the refusal, never the secret), and a write
    replaces the link, leaving its target as it was."""
    secret = tmp_path / "root-only"
    secret.write_text('{"phase": "supportmatrix-root-secret", "since": 1.0}')  # a phase's shape, were it read
    secret.chmod(0o600)
    job_dir = tmp_path / "job-1"
    job_dir.mkdir()
    artifacts = Artifacts(job_dir)
    (job_dir / "accelerator-report.json").symlink_to(secret)
    (job_dir / "accelerator-runner.log").symlink_to(secret)
    os.link(secret, job_dir / "verdict-runner.log")
    os.mkfifo(job_dir / "verdict-report.json")
    (job_dir / "rank0.phase").symlink_to(secret)
    for name in ("accelerator-report.json", "verdict-report.json"):
        assert read_report(job_dir / name) is None
    assert artifacts.latest_phase() is None
    for name in ("accelerator-runner.log", "verdict-runner.log"):
        tail = crashed("runner", 1, job_dir / name)
        assert "supportmatrix-root-secret" not in tail and "could not be read" in tail, tail
    with pytest.raises(OSError):
        read_regular(job_dir / "verdict-runner.log")  # a hard link: two names

    # the stored reference and its prefill logits, handed over by the worker: links at their names and at their
    # temporary files' names are replaced, their target untouched
    for path in (artifacts.stored_reference, artifacts.reference_prefill):
        path.symlink_to(secret)
        path.with_name(f".{path.name}.{os.getpid()}.tmp").symlink_to(secret)
        write_atomically(path, b"handed over")
        assert not path.is_symlink() and read_regular(path) == b"handed over"
    assert "supportmatrix-root-secret" in secret.read_text() and secret.stat().st_nlink == 2

    # the verdict stage's output: none is None; a link there, or what does not parse, is said, never read through
    assert _verdict_output(artifacts) is None
    artifacts.verdict.symlink_to(secret)
    assert "could not be read" in str(_verdict_output(artifacts))
    artifacts.verdict.unlink()
    artifacts.verdict.write_text("{not json")
    assert "could not be read" in str(_verdict_output(artifacts))

    # the sandbox the worker makes for a repo's code between its stages: a link planted at its name, or at one of
    # its directories' names, is removed; the directories are made there, none at the links' target
    victim = tmp_path / "victim"
    victim.mkdir()
    sandbox = Sandbox.of_job(job_dir)
    sandbox.root.symlink_to(victim, target_is_directory=True)
    sandbox.create(None)
    sandbox.cache.rmdir()
    sandbox.cache.symlink_to(victim, target_is_directory=True)
    sandbox.create(sandbox_of(1))
    for path in (sandbox.root, sandbox.cache, sandbox.hub_home, sandbox.home):
        held = path.lstat()
        assert stat.S_ISDIR(held.st_mode) and held.st_uid == sandbox_of(1).uid, path
    assert list(victim.iterdir()) == []


def test_a_work_directory_that_cannot_be_made_is_the_stages_error_internal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (or an entry the worker cannot remove) where the stage's work directory goes: supervise writes
    the stage's ERROR(internal) report naming it, and starts no runner."""

    def disk_full(self: WorkDir, user: RunAs | None) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(WorkDir, "create", disk_full)
    job_dir = tmp_path / "job-7"
    job_dir.mkdir()
    request = RunRequest(model_id="iso/m", stage=Stage.accelerator, artifacts=job_dir,
                         report=job_dir / "accelerator-report.json")  # fmt: skip
    report = supervise(request, stage_job("iso/m", 7), Settings(data_dir=tmp_path), lease_held, None)
    assert report is not None and (report.verdict, report.failure.error_class) == ("ERROR", "internal")
    assert str(job_dir / "work-accelerator") in (report.failure.error_message or "")
    assert "No space left on device" in (report.failure.error_message or "")
    assert list(job_dir.iterdir()) == []  # no runner started: no log


PLANT_LINKS = """import json, os, pathlib, sys
job, victim = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(job / "sandbox" / "hf-home" / "hub").symlink_to(victim / "hub", target_is_directory=True)
for name in ("download.log", "download-report.json"):
    (job / name).symlink_to(victim / name)
print(json.dumps(sorted(str(p.relative_to(job)) for p in job.rglob("*"))))
"""


def test_the_workers_download_writes_nothing_through_links_a_sandbox_process_planted(
    hub: Any, tiny_models: Path
) -> None:
    """The job's own repo code (its accelerator stage's, before the verdict stage downloads again) runs as the job's
    sandbox uid and can write the job's directory and its sandbox Hub cache (the worker gave them to that uid): it
    plants links there, to a directory only root may write, before the worker (root, holding the token) downloads a
    gated repo with code. The download goes into a staging
    directory no sandbox process can list, is handed over (owned by the sandbox user, no link followed) only when
    it has ended, and replaces the planted links: nothing is written through them. A failed download (a commit
    that does not exist) writes nothing through them either, and its report holds no token."""
    from huggingface_hub import HfApi

    hub.add(f"{ORG}/planted-gated", tiny_models / "tiny-custom", gated="manual")
    sha = HfApi(token=HUB_TOKEN).model_info(f"{ORG}/planted-gated").sha
    base = RUN_DIR / "planted" / uuid.uuid4().hex[:8]  # the runner users pass through RUN_DIR
    data, victim = base / "data", base / "victim"  # the victim: root's, where the links point
    artifacts = data / "artifacts"
    for directory in (base, data, artifacts, victim):
        directory.mkdir(parents=True)
        directory.chmod(0o755)
    settings = Settings(data_dir=data, zygote=False)
    outcomes = {}
    for job_id, revision in ((1, sha), (2, "f" * 40)):
        job_dir, sandbox_user = artifacts / f"job-{job_id}", sandbox_of(job_id)
        job_dir.mkdir()
        Sandbox.of_job(job_dir).create(sandbox_user)  # as the worker's stage_user makes it, then gives it
        give(job_dir, sandbox_user)
        planted = as_user(sandbox_user, PLANT_LINKS, str(job_dir), str(victim))
        assert {"sandbox/hf-home/hub", "download.log", "download-report.json"} <= set(planted)
        request = RunRequest(model_id=f"{ORG}/planted-gated", revision=revision, trust_remote_code=True,
                             stage=Stage.accelerator, artifacts=job_dir,
                             report=job_dir / "accelerator-report.json")  # fmt: skip
        job = stage_job(f"{ORG}/planted-gated", job_id, gated=True, trust_remote_code=True)

        def failed(error_class: ErrorClass, message: str, job: Job = job) -> RunReport:
            return job_report(job, Verdict.ERROR, error_class, message)

        outcomes[job_id] = prefetch(request, job, settings, lease_held, HUB_TOKEN, sandbox_user, failed)
        assert list(victim.iterdir()) == [], f"written through a planted link: {list(victim.rglob('*'))}"
    assert outcomes[1] is Prefetched.done, outcomes[1]
    hub_home = Sandbox.of_job(artifacts / "job-1").hub_home
    assert not hub_home.is_symlink() and not (hub_home / "hub").is_symlink()
    for entry in (hub_home, *hub_home.rglob("*")):
        assert entry.lstat().st_uid == sandbox_of(1).uid, entry  # handed over: the job's sandbox uid
    [snapshot] = (hub_home / "hub" / f"models--{ORG}--planted-gated" / "snapshots").iterdir()
    assert snapshot.name == sha and {"config.json", "model.safetensors", "modeling_custom.py"} <= {
        p.name for p in snapshot.iterdir()
    }
    log = artifacts / "job-1" / "download.log"
    assert not log.is_symlink() and log.is_file() and log.lstat().st_uid == sandbox_of(1).uid
    failure = outcomes[2]
    assert isinstance(failure, RunReport) and failure.failure.error_class == "not_found", failure
    assert HUB_TOKEN not in failure.model_dump_json()
    assert list((artifacts / ".downloads").iterdir()) == []  # each staging went with its download
    held = (artifacts / ".downloads").lstat()
    assert (held.st_uid, held.st_mode & 0o777) == (0, 0o700)
    assert as_user(sandbox_of(1), WORK_PROBE, str(artifacts / ".downloads")) == {
        str(artifacts / ".downloads"): "PermissionError"
    }


def test_giving_a_tree_to_a_runner_user_follows_no_link_in_it(tmp_path: Path) -> None:
    """``give`` (the worker, root, handing a job's directory to its stage's user) changes the owner of every entry
    of the tree, links themselves included, and of nothing a link points to: a link planted in the tree, or given
    as the tree itself, leaves its root-owned target as it was."""
    sandbox = sandbox_of(1)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "secret").write_text("root's")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "file").write_text("job's")
    (tree / "sub" / "to-dir").symlink_to(victim, target_is_directory=True)
    (tree / "to-file").symlink_to(victim / "secret")
    give(tree, sandbox)
    for entry in (tree, *tree.rglob("*")):
        assert entry.lstat().st_uid == sandbox.uid, entry
    (tmp_path / "tree-link").symlink_to(victim, target_is_directory=True)
    give(tmp_path / "tree-link", sandbox)
    for entry in (victim, victim / "secret"):
        assert entry.stat().st_uid == 0, entry

"""The host launcher re-plans a host's workers as the backlog changes, draining before reassigning cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from services.worker.host import HostLauncher, IdleClock, work_left
from shared.contracts.enums import JobState
from shared.contracts.run import RuntimeInfo
from shared.cores import CoreGroup, cpu_set, format_cpus
from shared.db.engine import new_session
from shared.db.models import Worker
from shared.hub.client import ResolvedModel
from shared.jobs import submission
from shared.jobs.queues import job_queue, verdict_queue
from shared.settings import get_settings
from tests.conftest import wait_for_job
from tests.test_pipeline import FINISHED, accelerator_owner, submit


def registered_names() -> set[str]:
    with new_session() as session:
        return set(session.scalars(sa.select(Worker.name).where(Worker.name.startswith("cores-"))))


def registered(prefix: str = "cores-") -> set[str]:
    with new_session() as session:
        names = session.scalars(sa.select(Worker.cores).where(Worker.name.startswith(prefix))).all()
    return set(names)


def step_until(launcher: HostLauncher, done: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        launcher.step()
        if done():
            return
        time.sleep(0.5)
    raise AssertionError(f"host launcher: {what} not reached; workers {set(launcher.workers)}")


# The replanning host's own name: its verdict stages then go to its own queue, which the session's verdict worker
# (this machine's host name) does not serve, so each runs in the launcher's zygote-forked verdict worker. "-" sorts
# before any real host name: of the live hosts (this one and the session's), this host's share of the one queued
# job is the whole of it.
REPLANNING_HOST = "-replanning"


def test_the_host_replans_when_a_two_core_job_arrives_and_after_it_is_done(
    api: Any, worker: Any, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUPPORTMATRIX_HOST_NAME", REPLANNING_HOST)  # the launcher's workers read it
    launcher = HostLauncher(get_settings().model_copy(update={"host_name": REPLANNING_HOST}), total_cores=2)
    output = ""
    try:
        step_until(launcher, lambda: registered() == {"0", "1"}, "two 1-core workers")
        # the host's zygote: runners fork from it once it has imported torch and transformers
        assert launcher.zygote is not None

        def zygote_ready() -> bool:
            nonlocal output
            output += "".join(capfd.readouterr())
            return "zygote: ready in" in output

        step_until(launcher, zygote_ready, "the zygote")
        # beside the core groups, the host's verdict-stage workers (SUPPORTMATRIX_VERDICT_WORKERS, default 1)
        assert len(launcher.verdict_workers) == 1 and launcher.verdict_workers[0].poll() is None
        [job] = submit(api, "host/tiny-qwen3", cores=2)
        # the 1-core workers drain (warm shutdown) before their cores form the 2-core group
        step_until(launcher, lambda: registered() == {"0-1"}, "one 2-core worker")
        assert set(launcher.workers) == {CoreGroup(0, 2)}
        step_until(launcher, lambda: api.get(f"/jobs/{job['id']}").json()["state"] in FINISHED, "the job's end")
        done = wait_for_job(api, job["id"], FINISHED)
        assert accelerator_owner(done["id"]).startswith(f"cores-0-1@{REPLANNING_HOST}:")
        step_until(launcher, lambda: registered() == {"0", "1"}, "back to two 1-core workers")
    finally:
        launcher.stop()
    assert registered() == set() and all(p.poll() is not None for p in launcher.verdict_workers)
    assert launcher.zygote.poll() is not None
    output += "".join(capfd.readouterr())  # the launcher's and zygote's lines, the workers' log
    # each stage's runner and its children (the job's two ranks, the CPU reference) forked from the zygote
    forks = re.findall(r"zygote: fork \d+: (services\.runner(?:\.child)?) .*?(--stage \w+|\S+spec\.json)", output)
    stages = [what for module, what in forks if module == "services.runner"]
    assert stages[:2] == ["--stage accelerator", "--stage verdict"]
    children = [what.rsplit("/", 1)[1] for module, what in forks if module == "services.runner.child"]
    assert children == ["accelerator.rank0.spec.json", "accelerator.rank1.spec.json", "reference.spec.json"]
    assert re.search(rf"starting runner: job {job['id']}, accelerator stage: .*forked by the zygote", output)


def test_the_launcher_process_forks_its_workers_and_stops_them(api: Any, tmp_path: Path) -> None:
    """`python -m services.worker.host` forks its workers from itself (it has imported what they import): they
    register, run a job to its end — its runner and child forked from the zygote, the child pinned to the
    job's core as a fresh one would be — and leave with the launcher. A second launcher on the same machine under
    another host name (another compiler version, as a user testing two on one machine starts them) registers workers
    of its own beside the first's, each named after its host: neither takes the other's registration. (The first is
    named too: this machine's own host name has the session's zygote, tests/conftest.py's ``host_zygote``.)"""
    log, other_log = tmp_path / "host.log", tmp_path / "other-host.log"

    def start(log: Path, **env: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "services.worker.host", "--cores", "1", "--poll", "0.2"],
            cwd=Path(__file__).resolve().parent.parent, stdout=log.open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )  # fmt: skip

    # eager: a compiler version of its own, so that the session's 1-core worker (aot_eager) takes none of its jobs
    launcher = start(log, SUPPORTMATRIX_CPU_COMPILE_BACKEND="eager", SUPPORTMATRIX_HOST_NAME="this-host")
    other = start(other_log, SUPPORTMATRIX_CPU_COMPILE_BACKEND="aot_eager_decomp_partition",
                  SUPPORTMATRIX_HOST_NAME="other-host")  # fmt: skip
    host = "this-host"
    try:
        deadline = time.monotonic() + 120
        while registered_names() != {f"cores-0@{host}", "cores-0@other-host"} or "zygote: ready" not in log.read_text():
            assert launcher.poll() is None and other.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, (registered_names(), log.read_text()[-3000:])
            time.sleep(0.3)
        other.terminate()
        other.wait(120)
        assert registered_names() == {f"cores-0@{host}"}  # the other host's left; this one's stays
        [job] = submit(api, "host/tiny-llama", cores=1, compilers=["eager-2.13.0+cpu"])
        done = wait_for_job(api, job["id"], FINISHED)
        assert done["state"] == "done" and accelerator_owner(done["id"]).startswith("cores-0@")
        rows = api.get("/results", params={"model_id": "host/tiny-llama"}).json()["items"]
        [row] = [r for r in rows if r["job_id"] == job["id"]]
        assert row["visible_cores"] == format_cpus(cpu_set(CoreGroup(0, 1)))
    finally:
        for process in (launcher, other):
            process.terminate()
            process.wait(120)
    text = log.read_text()
    assert re.search(rf"zygote: fork \d+: services\.runner\.child \S+/job-{job['id']}/accelerator\.spec\.json", text)
    [started] = re.findall(r"start: worker on cores 0 \(pid (\d+), forked\)", text)
    assert not Path(f"/proc/{started}").exists() and registered() == set()  # gone, and deregistered


@pytest.mark.slow
def test_a_hosts_runtime_is_described_once_and_kept(tmp_path: Path) -> None:
    """Workers after the first start without a runner child: the description is kept per installation."""
    from services.worker.__main__ import describe_runtime
    from shared.jobs.runtimes import default_runtime

    settings = get_settings().model_copy(update={"data_dir": tmp_path})
    first = describe_runtime(settings)  # asked of a runner child
    assert first.compiler_version == "aot_eager-2.13.0+cpu"
    [kept] = (tmp_path / "runtimes").glob("*.json")
    kept.write_text(first.model_copy(update={"compiler_version": "the-kept-answer"}).model_dump_json())
    assert describe_runtime(settings).compiler_version == "the-kept-answer"  # read back, not asked again
    eager = settings.model_copy(update={"cpu_compile_backend": "eager"})
    assert describe_runtime(eager).compiler_version == "eager-2.13.0+cpu"  # what it depends on changed: asked
    # what the API plans a job for while no worker is live (a host restarting its workers) is what they serve
    bf16 = settings.model_copy(update={"cpu_dtype": "bfloat16"})
    for configured, described in ((settings, first), (eager, describe_runtime(eager)), (bf16, describe_runtime(bf16))):
        planned = default_runtime(configured)
        assert planned is not None and planned.compiler_name == described.compiler_name
        assert planned.compiler_version == described.compiler_version
        assert planned.stack() == described.stack()  # the whole stack: a worker refuses a job of any other


def test_a_launcher_that_loses_the_database_keeps_its_workers_and_goes_on() -> None:
    """PostgreSQL refusing connections (a cut, a failover) is a step that plans nothing, not the launcher's end: an
    uncaught error there left its forked workers orphaned and their cores unplanned (the soak bench found it)."""
    from shared.processes import free_port

    closed = f"postgresql+psycopg://127.0.0.1:{free_port()}/none?connect_timeout=2"
    steps = (
        "from services.worker.host import HostLauncher\nfrom shared.settings import get_settings\n"
        "launcher = HostLauncher(get_settings(), total_cores=1)\n"
        "print([launcher.step() for _ in range(3)], launcher.database_lost is not None)"
    )
    env = os.environ | {"SUPPORTMATRIX_DATABASE_URL": closed, "SUPPORTMATRIX_VERDICT_WORKERS": "0",
                        "SUPPORTMATRIX_ZYGOTE": "false"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", steps], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("[None, None, None] True"), done.stdout
    assert done.stdout.count("plan: cannot read the backlog (OperationalError)") == 1, done.stdout  # once an outage


def test_a_host_is_idle_only_when_sql_shows_it_no_work_and_looks_again_before_it_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """work_left (what --exit-when-idle reads): a job queued on one of the host's queues, one running under a lease of
    this host (a `_` in its name matches only itself), or one to judge on its verdict queue is work; another host's,
    another queue's or a finished job is not. IdleClock: a database that does not answer is work, and a job claimed
    since the last look keeps the host at the moment it would leave."""
    rt = RuntimeInfo(backend="cpu", compiler_name="idle", compiler_version=f"idle-{uuid.uuid4().hex[:8]}",
                     library_version="5.25.0", torch_version="2.13.0")  # fmt: skip
    queue, host = job_queue(rt.backend, rt.stack(), 1), f"node_{uuid.uuid4().hex[:6]}"
    model = ResolvedModel(model_id=f"idle/{rt.compiler_version}", sha="a" * 40, gated=False, pipeline_tag=None)
    with new_session() as session:
        [submitted] = submission.submit(session, model, None, [rt], cores=1)
        job = submitted.job
        session.commit()
        assert work_left(host, [queue]) and not work_left(host, [queue.replace(".c1", ".c2")])
        job.state, job.lease_owner = JobState.running, f"cores-0@{host}:123"
        session.commit()
        assert work_left(host, []) and not work_left(host.replace("_", "x"), []) and not work_left("node%", [])
        job.state, job.lease_owner, job.verdict_queue = JobState.judging, None, verdict_queue(host)
        session.commit()
        assert work_left(host, []) and not work_left(f"other-{host}", [])
        job.state = JobState.done
        session.commit()
        assert not work_left(host, [queue])
        session.delete(job)  # the suite's shared database: no row of a job that never ran stays for other tests
        session.commit()
    answers: list[bool | Exception] = []

    def look(_host: str, _queues: Any) -> bool:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr("services.worker.host.work_left", look)
    clock = IdleClock(host, [queue], exit_after_s=0.2)
    answers[:] = [sa.exc.OperationalError("SELECT", {}, Exception("gone"))]
    time.sleep(0.25)
    assert not clock.expired() and answers == []  # could not read: work, the clock starts again
    answers[:] = [False]
    time.sleep(0.25)
    clock.looked_at = time.monotonic()  # a look just now, as if within its tenth
    answers[:] = [True]  # but a job was claimed since: the look before leaving sees it
    assert not clock.expired() and answers == []
    answers[:] = [False, False]
    time.sleep(0.25)
    assert clock.expired()

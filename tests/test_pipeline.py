"""End to end on real parts: HTTP submit → Redis → a real worker process → runner child → SQL → Parquet."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import pandas as pd
import psutil
import pytest

from tests.conftest import stage_runner, started_runners, wait_for_job

FINISHED = {"done", "failed", "cancelled"}


def submit(api: Any, model_id: str, expect: int = 202, **extra: Any) -> list[dict[str, Any]]:
    response = api.post("/jobs", json={"model_id": model_id, **extra})
    assert response.status_code == expect, response.text
    return response.json()["jobs"]


def wait_running_runner(worker: Any, api: Any, job_id: int) -> Any:
    wait_for_job(api, job_id, {"running"})
    return stage_runner(worker, job_id, "accelerator", timeout=60)


def accelerator_owner(job_id: int) -> str:
    """Who ran a job's accelerator stage, from its attempt log (the verdict worker holds the lease at the end)."""
    from shared.contracts.enums import Stage
    from shared.db.engine import new_session
    from shared.db.models import Job
    from shared.jobs.attempts import attempts

    with new_session() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return [a.owner for a in attempts(job) if a.stage == Stage.accelerator][-1]


def result_rows(api: Any, **params: Any) -> list[dict[str, Any]]:
    response = api.get("/results", params=params)
    assert response.status_code == 200, response.text
    return response.json()["items"]


def test_submitted_model_ends_in_a_pass_row_exported_to_parquet(
    api: Any, worker: Any, verdict_worker: Any, host_zygote: Path, hub: Any
) -> None:
    jobs = submit(api, "org/tiny-llama")
    assert len(jobs) == 1 and jobs[0]["created"] and jobs[0]["state"] == "queued"
    job = wait_for_job(api, jobs[0]["id"], FINISHED)
    assert job["state"] == "done", job
    # the accelerator stage ran on w-main's core; the verdict stage, which wrote the row, on the verdict worker
    assert job["attempts"] == 1 and job["lease_owner"].startswith("v-main@")
    assert accelerator_owner(job["id"]).startswith("w-main@")
    # both stages' runners, and their children, forked from the host's zygote (tests/conftest.py), as a fleet's are
    for stage, log in (("accelerator", worker.log), ("verdict", verdict_worker.log)):
        assert re.search(rf"starting runner: job {job['id']}, {stage} stage: .*forked by the zygote", log.read_text())
    for spec in ("accelerator", "reference"):
        assert re.search(
            rf"fork \d+: services\.runner\.child \S+/job-{job['id']}/{spec}\.spec\.json", host_zygote.read_text()
        )

    [row] = result_rows(api, model_id="org/tiny-llama")
    assert row["result"] == "PASS"
    assert row["neuronx_cc"] == "aot_eager-2.13.0+cpu" and row["library"] == "transformers"
    assert row["neuron_cores"] == 1 and row["revision"] == job["sha"]
    assert len(row["generated_token_ids"]) == 32 and row["generated_token_ids"] == row["reference_token_ids"]
    assert row["first_divergence"] is None and row["generated_text"] == row["reference_text"]
    assert row["wall_s"] >= row["load_s"] > 0 and row["compile_s"] > 0 and row["generate_s"] > 0
    assert row["peak_memory_bytes"] > 100 * 2**20  # VmHWM of a process that imported torch
    assert row["reproduce"] == (
        "SUPPORTMATRIX_CPU_COMPILE_BACKEND=aot_eager "
        f"python -m services.runner org/tiny-llama --revision {job['sha']} --backend cpu --cores 1"
    )
    [live] = [w for w in api.get("/workers").json() if w["name"].startswith("w-main@")]
    assert live["compiler_version"] == row["neuronx_cc"] and live["queue"] == job["queue"]
    assert row["torch_version"].startswith("2.13.0") and row["host"]
    assert row["visible_cores"] == "0" and row["core_range"] == "0"  # w-main owns core 0: the runner ran there
    assert row["parallelism"] == "none" and row["tokens_match"] and row["prefill_rel_error"] < 1e-3

    # The worker asks the collector for an export after each result; the seed query reads it verbatim.
    from shared.settings import get_settings

    export = get_settings().export_path
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list((export / "data").glob("*.parquet")):
        time.sleep(0.2)
    from services.worker.collector import export_once

    export_once()
    df = pd.read_parquet(f"{export}/data")
    seed = df[df.model_id == "org/tiny-llama"][["neuronx_cc", "library", "library_version", "neuron_cores", "result"]]
    assert seed.to_dict("records") == [
        {
            "neuronx_cc": "aot_eager-2.13.0+cpu",
            "library": "transformers",
            "library_version": row["library_version"],
            "neuron_cores": 1,
            "result": "PASS",
        }
    ]

    # Another delivery of the finished job's message does nothing: single execution is a SQL invariant.
    from shared.jobs.broker import enqueue_job, get_producer

    enqueue_job(get_producer(), job["id"], job["queue"])
    time.sleep(3)
    assert api.get(f"/jobs/{job['id']}").json()["finished_at"] == job["finished_at"]
    assert len(result_rows(api, model_id="org/tiny-llama")) == 1


def test_identical_submission_returns_the_existing_job_unless_forced(api: Any, worker: Any) -> None:
    [first] = submit(api, "org/tiny-llama", expect=200)  # done in the test above, or still active
    assert first["created"] is False
    [again] = submit(api, "org/tiny-llama", expect=200, revision=first["sha"])
    assert again["id"] == first["id"]
    wait_for_job(api, first["id"], FINISHED)
    [forced] = submit(api, "org/tiny-llama", force=True)
    assert forced["created"] and forced["id"] != first["id"]
    # force never doubles an active job
    [same] = submit(api, "org/tiny-llama", expect=200, force=True)
    assert same["id"] == forced["id"]
    assert wait_for_job(api, forced["id"], FINISHED)["state"] == "done"


def test_cancel_queued_and_running_jobs(api: Any, worker: Any) -> None:
    [running] = submit(api, "org/tiny-qwen3")
    runner = wait_running_runner(worker, api, running["id"])
    [queued] = submit(api, "org/tiny-gpt2")  # waits behind the running job: the worker runs one at a time
    assert api.get(f"/jobs/{queued['id']}").json()["state"] == "queued"

    cancelled = api.delete(f"/jobs/{queued['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert api.delete(f"/jobs/{queued['id']}").status_code == 200  # idempotent

    assert api.delete(f"/jobs/{running['id']}").json()["state"] == "cancelled"
    runner.wait(timeout=30)  # the worker kills the runner within a heartbeat
    time.sleep(2)
    for job_id in (running["id"], queued["id"]):
        job = api.get(f"/jobs/{job_id}").json()
        assert job["state"] == "cancelled", job
        assert api.get("/results", params={"model_id": job["model_id"]}).json()["items"] == []
    assert api.delete("/jobs/999999").status_code == 404


def test_runner_crash_is_an_error_row_and_the_worker_takes_the_next_job(api: Any, worker: Any) -> None:
    [crashing] = submit(api, "org/tiny-qwen3")
    runner = wait_running_runner(worker, api, crashing["id"])
    runner.send_signal(signal.SIGSEGV)
    job = wait_for_job(api, crashing["id"], FINISHED)
    assert job["state"] == "failed" and job["error_class"] == "crash", job
    assert "killed by SIGSEGV" in job["error_message"]
    [row] = result_rows(api, model_id="org/tiny-qwen3")
    assert row["result"] == "ERROR" and row["error_class"] == "crash"

    assert worker.proc.poll() is None
    [after] = submit(api, "org/tiny-gpt2")
    assert wait_for_job(api, after["id"], FINISHED)["state"] == "done"
    assert result_rows(api, model_id="org/tiny-gpt2")[0]["result"] == "PASS"
    # the crashed job can be submitted again without force: it failed, it did not finish a test
    [retry] = submit(api, "org/tiny-qwen3")
    assert retry["created"]
    assert wait_for_job(api, retry["id"], FINISHED)["state"] == "done"


def test_runner_over_its_time_limit_is_an_error_timeout(api: Any, worker: Any, start_worker: Any) -> None:
    # A second worker serving another compiler ("eager") with a 3 s limit: jobs for it go to its queue only.
    slow = start_worker("w-eager", SUPPORTMATRIX_CPU_COMPILE_BACKEND="eager", SUPPORTMATRIX_JOB_TIMEOUT_S="3")
    try:
        served = {r["compiler_version"] for r in submit(api, "org/tiny-llama", expect=202)}
        assert served == {"aot_eager-2.13.0+cpu", "eager-2.13.0+cpu"}  # one job per live compiler version
        jobs = {j["compiler_version"]: j for j in submit(api, "org/tiny-llama", expect=200)}
        job = wait_for_job(api, jobs["eager-2.13.0+cpu"]["id"], FINISHED)
        assert job["state"] == "failed" and job["error_class"] == "timeout", job
        assert "3 s limit" in job["error_message"]
        [runner] = started_runners(slow.log.read_text(), job["id"])  # killed, and waited for
        assert not psutil.pid_exists(runner) or psutil.Process(runner).status() == psutil.STATUS_ZOMBIE
        wait_for_job(api, jobs["aot_eager-2.13.0+cpu"]["id"], FINISHED)
    finally:
        slow.stop()


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ({"model_id": "not-a-model-id"}, 422, "not a Hub model id"),
        ({"model_id": "org/a--b"}, 422, "not a Hub model id"),
        ({"model_id": "org/tiny\u0000llama"}, 422, "not a Hub model id"),
        ({"model_id": "org/tiny-llama", "revision": "ma\u0000in"}, 422, "not a revision"),
        ({"model_id": "org/tiny-llama", "compilers": ["x\u0000y"]}, 422, "pattern"),
        ({"model_id": "org/tiny-llama", "compilers": ["nope-1.0"]}, 422, "is not served"),
        ({"model_id": "org/does-not-exist"}, 404, "does not exist on the Hub"),
        ({"model_id": "org/tiny-llama", "revision": "v9"}, 404, "revision 'v9'"),
        ({"model_id": "org/tiny-llama", "surprise": 1}, 422, "Extra inputs"),
        ({"model_id": 7}, 422, "string"),
    ],
)
def test_bad_submissions_get_a_4xx_with_a_reason_and_enqueue_nothing(
    api: Any, worker: Any, body: dict[str, Any], status: int, reason: str
) -> None:
    before = _queued_state(api)
    response = api.post("/jobs", json=body)
    assert response.status_code == status, response.text
    assert reason in response.text
    assert _queued_state(api) == before


@pytest.mark.parametrize(
    ("content", "status", "reason"),
    [
        (b"", 422, "Field required"),
        (b"{not json", 422, "JSON decode error"),
        (b'{"model_id": "org/x"' + b" " * 70_000 + b"}", 413, "request body larger than"),
    ],
)
def test_malformed_bodies_get_a_4xx_with_a_reason(
    api: Any, worker: Any, content: bytes, status: int, reason: str
) -> None:
    before = _queued_state(api)
    response = api.post("/jobs", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert reason in response.text
    assert _queued_state(api) == before


def test_streamed_oversized_body_is_refused(api: Any) -> None:
    chunks = (b"x" * 10_000 for _ in range(20))
    response = api.post("/jobs", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413


def _queued_state(api: Any) -> tuple[int, int]:
    """(jobs in SQL, messages waiting in the live worker's Redis queue: the one w-main registered)."""
    import redis
    import sqlalchemy as sa

    from shared.db.engine import new_session
    from shared.db.models import Job, Worker
    from shared.settings import get_settings

    with new_session() as session:
        jobs = session.scalar(sa.select(sa.func.count()).select_from(Job))
        [queue] = session.scalars(sa.select(Worker.queue).where(Worker.name.startswith("w-main@"))).all()
    client = redis.Redis.from_url(get_settings().redis_url)
    return int(jobs or 0), int(client.llen(queue))


def test_submission_with_the_queue_down_is_a_503_that_keeps_nothing(api: Any, worker: Any) -> None:
    from services.api.deps import producer
    from shared.jobs.broker import make_celery
    from shared.settings import Settings

    dead = make_celery(Settings(redis_url="redis://127.0.0.1:1/0"))
    api.app.dependency_overrides[producer] = lambda: dead
    try:
        before = _queued_state(api)
        response = api.post("/jobs", json={"model_id": "org/tiny-qwen3", "force": True})
    finally:
        api.app.dependency_overrides.clear()
    assert response.status_code == 503 and "the job queue is unavailable" in response.text
    assert _queued_state(api) == before

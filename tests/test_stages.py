"""A job's two stages with real processes: the accelerator stage frees its cores before the verdict stage
runs on the host's CPUs, and a verdict stage lost with its worker is retried from the saved artifacts."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil

from shared.settings import get_settings
from tests.conftest import stage_runner, started_runners, wait_for_job
from tests.test_pipeline import FINISHED, result_rows, submit


def runner_starts(worker: Any, job_id: int, stage: str) -> int:
    """How many runners a worker started for one stage of a job, from its log."""
    return len(started_runners(worker.log.read_text(errors="replace"), job_id, stage))


@contextmanager
def frozen(runner: psutil.Process) -> Iterator[None]:
    """Stop a runner and its children (its own process group) until the block ends."""
    os.killpg(runner.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with suppress(ProcessLookupError):  # gone, if the block killed it
            os.killpg(runner.pid, signal.SIGCONT)


def test_the_core_group_takes_the_next_job_while_the_first_is_judged(
    api: Any, worker: Any, verdict_worker: Any
) -> None:
    [first] = submit(api, "stage/tiny-llama")
    wait_for_job(api, first["id"], {"judging"})
    with frozen(stage_runner(verdict_worker, first["id"], "verdict")):
        # The first job's verdict stage is still running; w-main's only core group is free again.
        [second] = submit(api, "stage/tiny-qwen3")
        judged = wait_for_job(api, second["id"], {"judging"})  # its accelerator stage ran on core 0
        assert judged["lease_owner"] is None and judged["attempts"] == 1
        assert judged["verdict_queue"] == first_queue(api, first["id"])
        assert api.get(f"/jobs/{first['id']}").json()["state"] == "judging"
    for job in (first, second):
        done = wait_for_job(api, job["id"], FINISHED)
        assert done["state"] == "done" and done["attempts"] == 1 and done["verdict_attempts"] == 1
        [row] = result_rows(api, model_id=job["model_id"])
        assert row["result"] == "PASS" and row["core_range"] == "0" and row["visible_cores"] == "0"
        assert runner_starts(worker, job["id"], "accelerator") == 1
        assert runner_starts(verdict_worker, job["id"], "verdict") == 1
        assert not (get_settings().data_dir / "artifacts" / f"job-{job['id']}").exists()  # a PASS leaves none


def first_queue(api: Any, job_id: int) -> str:
    return str(api.get(f"/jobs/{job_id}").json()["verdict_queue"])


def test_a_verdict_worker_killed_mid_stage_is_retried_from_the_artifacts_once(
    api: Any, worker: Any, verdict_worker: Any
) -> None:
    """The lonely case: one job, nothing else queued, default lease timeout."""
    [job] = submit(api, "stage/tiny-gpt2")
    wait_for_job(api, job["id"], {"judging"})
    runner = stage_runner(verdict_worker, job["id"], "verdict")
    [pool_child] = psutil.Process(verdict_worker.proc.pid).children()  # the worker's one pool process: the stage's
    with frozen(runner):
        pool_child.kill()  # the verdict worker's process that runs the stage dies mid-stage
    psutil.wait_procs([runner], timeout=30)
    assert not runner.is_running() or runner.status() == psutil.STATUS_ZOMBIE  # it died with its worker
    done = wait_for_job(api, job["id"], FINISHED, timeout=120)
    assert done["state"] == "done", done
    assert done["attempts"] == 1 and done["verdict_attempts"] == 2  # redelivered, taken over from the dead owner
    [row] = result_rows(api, model_id="stage/tiny-gpt2")
    assert row["result"] == "PASS"
    # the accelerator stage ran once; the verdict stage twice, from the same artifacts
    assert runner_starts(worker, job["id"], "accelerator") == 1
    assert runner_starts(verdict_worker, job["id"], "verdict") == 2
    assert verdict_worker.proc.poll() is None


def secrets_in(runner: psutil.Process, secrets: list[str]) -> list[str]:
    """Which of ``secrets`` (and which connection settings) a runner and its children were given."""
    found = []
    for process in [runner, *runner.children(recursive=True)]:
        env = process.environ()
        found += [k for k in ("SUPPORTMATRIX_DATABASE_URL", "SUPPORTMATRIX_REDIS_URL") if k in env]
        found += [s for s in secrets if any(s in v for v in env.values())]
    return found


def test_a_hosts_verdict_stage_runs_there_and_only_the_judge_holds_its_token(
    api: Any, start_worker: Any, planned_with: Any
) -> None:
    """A host whose workers judge sharded runs with an LLM (the API plans under the same judge, as one ConfigMap
    gives them): the verdict stage runs on the host that holds the artifacts, and only the judge's process holds its
    token. A job the API then plans under another judge is not run as if it were this one: it ends ERROR at once."""
    from tests.test_judges import ChatEndpoint

    endpoint = ChatEndpoint()
    secrets = {"SUPPORTMATRIX_JUDGE_TOKEN": "judge-secret", "SUPPORTMATRIX_PUBLISH_TOKEN": "hf_publish_secret",
               "HF_TOKEN": "hf_read_secret"}  # fmt: skip
    host = {"SUPPORTMATRIX_HOST_NAME": "judgehost", "SUPPORTMATRIX_JUDGE_KIND": "openai",
            "SUPPORTMATRIX_JUDGE_URL": endpoint.url, "SUPPORTMATRIX_JUDGE_MODEL": "judge-model", **secrets}  # fmt: skip
    accelerators = start_worker("w-judgehost", "0-1", SUPPORTMATRIX_CPU_COMPILE_BACKEND="eager", **host)
    verdicts = start_worker("v-judgehost", None, **host)
    planned_with(SUPPORTMATRIX_JUDGE_KIND="openai", SUPPORTMATRIX_JUDGE_MODEL="judge-model")
    try:
        [job] = submit(api, "stage/tiny-llama", cores=2, compilers=["eager-2.13.0+cpu"])
        runner = stage_runner(accelerators, job["id"], "accelerator")
        with frozen(runner):
            assert secrets_in(runner, list(secrets.values())) == []
        judging = wait_for_job(api, job["id"], {"judging"})
        assert judging["verdict_queue"] == "supportmatrix.verdict.judgehost"  # the host that holds the artifacts
        runner = stage_runner(verdicts, job["id"], "verdict")
        with frozen(runner):  # the process that loads the tested checkpoint on the CPU
            assert secrets_in(runner, list(secrets.values())) == []
        done = wait_for_job(api, job["id"], FINISHED)
        assert done["state"] == "done" and done["lease_owner"].startswith("v-judgehost@judgehost:")
        [row] = [r for r in result_rows(api, model_id="stage/tiny-llama") if r["job_id"] == job["id"]]
        assert row["result"] == "PASS" and row["neuron_cores"] == 2 and row["parallelism"] == "tp"
        assert row["judge_kind"] == "openai" and row["judge_model"] == "judge-model"
        # the judge stage, a process of its own that loads no checkpoint, is the one that held the token
        assert [r["auth"] for r in endpoint.requests] == ["Bearer judge-secret"] * 2
        assert runner_starts(verdicts, job["id"], "judge") == 1
        assert_no_secret_anywhere(list(secrets.values()), row, [accelerators.log, verdicts.log])
        # The API back on its default judge: the same model over 2 cores is another test (its config_hash), which
        # these workers do not run. Alone in the queue, under default timeouts: ERROR at once, one row, saying why.
        planned_with(SUPPORTMATRIX_JUDGE_KIND=None, SUPPORTMATRIX_JUDGE_MODEL=None)
        [other] = submit(api, "stage/tiny-llama", cores=2, compilers=["eager-2.13.0+cpu"])
        assert other["id"] != job["id"]  # not the finished job: another test
        assert wait_for_job(api, other["id"], FINISHED, timeout=60)["state"] == "failed"
        rows = [r for r in result_rows(api, model_id="stage/tiny-llama") if r["job_id"] in (job["id"], other["id"])]
        assert sorted(r["job_id"] for r in rows) == [job["id"], other["id"]]  # one row each
        [refused] = [r for r in rows if r["job_id"] == other["id"]]
        assert refused["result"] == "ERROR" and refused["error_class"] == "internal", refused
        said = refused["error_message"]
        assert "configured out of step" in said and "judge_kind=openai, " in said, said
        assert runner_starts(accelerators, other["id"], "accelerator") == 0  # refused before any runner started
    finally:
        endpoint.server.shutdown()


def assert_no_secret_anywhere(secrets: list[str], row: dict[str, Any], logs: list[Path]) -> None:
    """No token in the result row (its reproduce command included), the Parquet export, logs or data files."""
    import pandas as pd

    from services.worker.collector import export_once
    from shared.settings import get_settings

    export_once()
    settings = get_settings()
    exported = pd.concat(pd.read_parquet(p) for p in settings.export_path.rglob("*.parquet"))
    texts = [json.dumps(row), exported.to_csv()]
    texts += [p.read_text(errors="replace") for p in logs]
    kept = [settings.data_dir / "artifacts", settings.export_path]  # what jobs leave on disk
    texts += [p.read_text(errors="replace") for root in kept for p in root.rglob("*") if p.is_file()]
    leaks = [s for s in secrets for text in texts if s in text]
    assert leaks == [] and "python -m services.runner" in row["reproduce"]


def test_a_fails_artifacts_stay_until_the_retention(api: Any, worker: Any, start_worker: Any) -> None:
    artifacts = get_settings().data_dir / "artifacts"
    # an old FAIL's artifacts, kept past the retention (seven days by default)
    expired = artifacts / "job-999999"
    expired.mkdir(parents=True, exist_ok=True)
    (expired / "verdict.json").write_text("{}")
    os.utime(expired, (time.time() - 8 * 24 * 3600,) * 2)
    start_worker("w-faulty", "1", SUPPORTMATRIX_CPU_COMPILE_BACKEND="eager", SUPPORTMATRIX_CPU_FAULT="drop_layer")
    [failed] = submit(api, "stage/tiny-qwen3", compilers=["eager-2.13.0+cpu"])
    assert wait_for_job(api, failed["id"], FINISHED)["state"] == "done"
    [row] = [r for r in result_rows(api, model_id="stage/tiny-qwen3") if r["job_id"] == failed["id"]]
    assert row["result"] == "FAIL" and "prefill logits differ" in row["verdict_reason"]  # the planted fault
    kept = artifacts / f"job-{failed['id']}"
    assert (kept / "accelerator.json").exists() and (kept / "prefill-logits.npy").exists()  # for inspection
    assert (kept / "verdict.json").exists() and not expired.exists()
    assert (kept / "work-accelerator").is_dir() and (kept / "work-verdict").is_dir()  # what the stages compiled there


def test_cancelling_a_judging_job_stops_its_verdict_stage_and_writes_nothing(
    api: Any, worker: Any, verdict_worker: Any
) -> None:
    [job] = submit(api, "stage/tiny-llama-6h")
    wait_for_job(api, job["id"], {"judging"})
    runner = stage_runner(verdict_worker, job["id"], "verdict")
    with frozen(runner):
        cancelled = api.delete(f"/jobs/{job['id']}")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        psutil.wait_procs([runner], timeout=15)  # the verdict worker kills it within a heartbeat
    assert not runner.is_running() or runner.status() == psutil.STATUS_ZOMBIE
    time.sleep(2)
    after = api.get(f"/jobs/{job['id']}").json()
    assert after["state"] == "cancelled" and after["finished_at"] == cancelled.json()["finished_at"]
    assert result_rows(api, model_id="stage/tiny-llama-6h") == []
    assert not (get_settings().data_dir / "artifacts" / f"job-{job['id']}").exists()

"""Untrusted code and paths: an allow-listed org's trust_remote_code repo really runs, pinned to the commit it
was sized at; any other org's is SKIPPED(remote_code); a model id is always a Hub id, never a directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from services.api.deps import current_settings
from shared.settings import get_settings
from tests.conftest import HUB_TOKEN, wait_for_job
from tests.test_pipeline import FINISHED, _queued_state, result_rows, submit


@pytest.fixture
def trusting_api(api: Any, hub: Any, tiny_models: Path) -> Iterator[Any]:
    """The API with one org allow-listed for remote code; both orgs serve the same custom-code repo."""
    for org in ("trusted", "stranger"):
        hub.add(f"{org}/tiny-custom", tiny_models / "tiny-custom")  # tagged custom_code: its config has auto_map
    settings = get_settings().model_copy(update={"remote_code_orgs": ["trusted"]})
    api.app.dependency_overrides[current_settings] = lambda: settings
    yield api
    api.app.dependency_overrides.clear()


def test_an_allowlisted_orgs_remote_code_runs_and_a_strangers_is_skipped(
    trusting_api: Any, worker: Any, hub: Any
) -> None:
    before = _queued_state(trusting_api)
    [stranger] = submit(trusting_api, "stranger/tiny-custom")
    assert stranger["state"] == "done" and stranger["error_class"] == "remote_code"
    assert "stranger is not in SUPPORTMATRIX_REMOTE_CODE_ORGS" in stranger["error_message"]
    assert _queued_state(trusting_api)[1] == before[1]  # never enqueued
    assert [r["result"] for r in result_rows(trusting_api, model_id="stranger/tiny-custom")] == ["SKIPPED"]

    requests_before = len(hub.requests)
    [trusted] = submit(trusting_api, "trusted/tiny-custom")
    done = wait_for_job(trusting_api, trusted["id"], FINISHED)
    assert done["state"] == "done", done
    [row] = result_rows(trusting_api, model_id="trusted/tiny-custom")
    assert row["result"] == "PASS" and row["generated_token_ids"] == row["reference_token_ids"]
    assert row["reproduce"].endswith(f"--revision {trusted['sha']} --backend cpu --cores 1 --trust-remote-code")
    # the repo's code came from the commit it was sized at
    paths = [p for _, p in hub.requests[requests_before:]]
    assert any(p.endswith(f"/resolve/{trusted['sha']}/modeling_custom.py") for p in paths)


def test_a_model_id_is_fetched_from_the_hub_even_when_a_directory_has_its_name(
    hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.runner.download import download

    decoy = tmp_path / "org" / "tiny-gpt2"
    decoy.mkdir(parents=True)
    (decoy / "config.json").write_text("{}")  # a directory of the same name in the working directory
    monkeypatch.chdir(tmp_path)
    requests_before = len(hub.requests)
    checkpoint = download("org/tiny-gpt2", None, None, [])
    assert checkpoint.sha is not None and len(checkpoint.sha) == 40 and checkpoint.path != decoy.resolve()
    assert (checkpoint.path / "model.safetensors").exists()  # the Hub's files, from the Hub
    assert any(p.startswith("/api/models/org/tiny-gpt2") for _, p in hub.requests[requests_before:])  # asked


def test_remote_code_does_not_run_without_the_switch(tiny_models: Path) -> None:
    from tests.test_runner import run_local

    code, report = run_local(tiny_models / "tiny-custom")
    assert code == 3 and report.failure.error_class == "load" and "trust_remote_code" in report.failure.error_message


OFFLINE_READ = """\
import json, sys
from services.runner.download import download
from services.runner.failures import RunFailure
try:
    checkpoint = download(sys.argv[1], sys.argv[2], None, [], with_code=sys.argv[3] == "code")
except RunFailure as failure:
    print(json.dumps([failure.error_class, failure.message]))
else:
    print(json.dumps([str(checkpoint.path), checkpoint.sha, sorted(p.name for p in checkpoint.path.iterdir())]))
"""


FETCH_ONE = """\
import sys
from huggingface_hub import hf_hub_download
hf_hub_download(sys.argv[1], sys.argv[3], revision=sys.argv[2])
"""


def test_the_workers_download_of_a_gated_repo_with_code_is_read_offline_without_the_token(
    hub: Any, tiny_models: Path, tmp_path: Path
) -> None:
    """``python -m services.runner.download``, as the worker runs it for a gated repo with code of its own: with
    the token it fetches the weights and the repo's ``*.py`` from the pinned commit into its HF_HOME; a runner
    with HF_HUB_OFFLINE=1 and no token then finds that snapshot and asks the Hub nothing. Without the token the
    download ends in a report of class ``gated`` (exit 3), as the runner's own would; with it, at a commit that
    does not exist, ``not_found`` — neither its report nor its output holds the token. Offline, a snapshot without
    the repo's code (when it runs) or without weights is no checkpoint: ``download``, naming what is missing."""
    from huggingface_hub import HfApi

    from shared.contracts.report import RunReport
    from shared.contracts.run import RunRequest

    hub.add("auth/gated-custom", tiny_models / "tiny-custom", gated="manual")
    sha = HfApi().model_info("auth/gated-custom").sha
    base = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"} | {"HF_HOME": str(tmp_path / "hf-home")}
    request = RunRequest(model_id="auth/gated-custom", revision=sha, trust_remote_code=True,
                         report=tmp_path / "download-report.json")  # fmt: skip
    download = [sys.executable, "-m", "services.runner.download", *request.to_argv()]
    refused = subprocess.run(download, env=base, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 3, refused.stderr
    report = RunReport.model_validate_json(request.report.read_text())  # type: ignore[union-attr]
    assert report.failure.error_class == "gated" and report.failure.failure_signature

    missing = request.model_copy(update={"revision": "f" * 40, "report": tmp_path / "missing-report.json"})
    with_token = base | {"HF_TOKEN": HUB_TOKEN}
    absent = subprocess.run([sys.executable, "-m", "services.runner.download", *missing.to_argv()], env=with_token,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert absent.returncode == 3, absent.stderr
    written = (tmp_path / "missing-report.json").read_text()
    assert RunReport.model_validate_json(written).failure.error_class == "not_found"
    for said in (written, absent.stdout, absent.stderr):
        assert HUB_TOKEN not in said

    fetched = subprocess.run(download, env=with_token, capture_output=True, text=True, timeout=120)
    assert fetched.returncode == 0, fetched.stderr
    assert HUB_TOKEN not in fetched.stdout + fetched.stderr
    asked = len(hub.requests)
    offline = base | {"HF_HUB_OFFLINE": "1"}

    def read_offline(env: dict[str, str], code: str) -> Any:
        read = subprocess.run([sys.executable, "-c", OFFLINE_READ, "auth/gated-custom", sha, code], env=env,
                              capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
        return json.loads(read.stdout)

    path, found_sha, files = read_offline(offline, "code")
    assert Path(path) == Path(fetched.stdout.strip().splitlines()[-1]) and found_sha == sha
    assert {"config.json", "model.safetensors", "modeling_custom.py"} <= set(files)
    assert len(hub.requests) == asked  # offline: not one request

    # A snapshot folder of only some files (what sizing or a single-file fetch leaves in a Hub cache): offline,
    # one without weights, or without the repo's code when it runs, is no checkpoint.
    partial = with_token | {"HF_HOME": str(tmp_path / "hf-partial")}
    partial_offline = base | {"HF_HOME": partial["HF_HOME"], "HF_HUB_OFFLINE": "1"}
    for name in ("config.json", "model.safetensors"):
        subprocess.run([sys.executable, "-c", FETCH_ONE, "auth/gated-custom", sha, name], env=partial, check=True,
                       capture_output=True, timeout=120)  # fmt: skip
        if name == "config.json":
            error_class, message = read_offline(partial_offline, "no-code")
            assert error_class == "download" and message.endswith("has no weights (*.safetensors or *.bin)"), message
    no_code = (
        f"the Hub cache's snapshot of auth/gated-custom at {sha} has no code of its own (*.py), which its run needs"
    )
    assert read_offline(partial_offline, "code") == ["download", no_code]
    assert read_offline(partial_offline, "no-code")[1] == sha  # a run of transformers' code needs none


def test_a_gated_repo_with_code_is_skipped_where_runners_are_not_isolated(tmp_path: Path) -> None:
    """A worker that is not root (or runs runners as itself) cannot keep a repo's code from its own environment,
    where the Hub token is: a gated repo with code of its own is not run there. Its stage ends SKIPPED
    (remote_code) with the reason, nothing is downloaded and no runner starts."""
    from services.worker.supervise import supervise
    from shared.contracts.enums import Stage
    from shared.contracts.run import RunRequest
    from shared.isolation import Sandbox
    from shared.settings import Settings
    from tests.test_isolation import lease_held, stage_job

    job_dir = tmp_path / "artifacts" / "job-3"
    job_dir.mkdir(parents=True)
    request = RunRequest(model_id="auth/gated-custom", trust_remote_code=True, stage=Stage.accelerator,
                         artifacts=job_dir, report=job_dir / "accelerator-report.json")  # fmt: skip
    job = stage_job("auth/gated-custom", 3, gated=True, trust_remote_code=True)
    settings = Settings(data_dir=tmp_path)
    private = Sandbox.of_job(job_dir).environment(None)
    report = supervise(request, job, settings, lease_held, None, {"HF_TOKEN": HUB_TOKEN}, None, private)
    assert report is not None and (report.verdict, report.failure.error_class) == ("SKIPPED", "remote_code")
    assert "needs runners under users of their own" in (report.failure.error_message or "")
    assert HUB_TOKEN not in report.model_dump_json()
    assert list(job_dir.iterdir()) == [] and not (tmp_path / "artifacts" / ".downloads").exists()


def test_the_workers_download_counts_against_the_stages_limit_and_the_runners_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's download of a gated repo with code is part of the stage: the runner started after it gets what
    is left of its budget outside compilation (``timeout_s``), and the worker's hard limit of the stage counts the
    download's seconds — a runner whose stage's limit the download used up is killed at once, the row naming
    the download."""
    import time

    from services.worker import supervise as supervising
    from shared.contracts.enums import Stage
    from shared.contracts.report import RunReport
    from shared.contracts.run import RunRequest
    from shared.isolation import RunAs
    from shared.settings import Settings, child_environment
    from tests.test_isolation import lease_held, stage_job

    def slow_download(*args: Any) -> supervising.Prefetched:
        time.sleep(1.5)
        return supervising.Prefetched.done

    started: dict[str, Any] = {}

    def runner_started(request: RunRequest, *args: Any) -> RunReport:
        started["timeout_s"], started["spent_s"] = request.timeout_s, args[-1]
        return RunReport.model_validate({"subject": {"model_id": "auth/m", "task": "text-generation",
                                                     "backend": "cpu"}})  # fmt: skip

    monkeypatch.setattr(supervising, "prefetch", slow_download)
    monkeypatch.setattr(supervising, "_run_stage", runner_started)
    job_dir = tmp_path / "job-4"
    job_dir.mkdir()
    request = RunRequest(model_id="auth/m", trust_remote_code=True, stage=Stage.accelerator, artifacts=job_dir,
                         report=job_dir / "accelerator-report.json")  # fmt: skip
    job = stage_job("auth/m", 4, gated=True, trust_remote_code=True)
    settings = Settings(data_dir=tmp_path, job_timeout_s=100, zygote=False)
    whoever = RunAs(name="the-worker", uid=os.geteuid(), gid=os.getegid())  # as the worker's isolation names one
    supervising.supervise(request, job, settings, lease_held, None, {"HF_TOKEN": HUB_TOKEN}, whoever)
    assert 1.5 <= started["spent_s"] < 10 and started["timeout_s"] == pytest.approx(100 - started["spent_s"])
    monkeypatch.undo()

    # the worker's hard limit: a stage whose limit the download used up (stage limit + grace, 100 + 30 s here)
    judge = RunRequest(model_id="auth/m", stage=Stage.judge, artifacts=job_dir, report=job_dir / "judge-report.json")
    env = child_environment(settings, {})
    report = supervising._run_stage(
        judge, job, settings, lease_held, None, env, None, partial(stage_failed, job), 131.0
    )
    assert report is not None and report.failure.error_class == "timeout", report
    assert "130 s limit, 131 s of it the worker's download" in (report.failure.error_message or "")


def stage_failed(job: Any, error_class: Any, message: str) -> Any:
    from shared.contracts.enums import Verdict
    from shared.jobs.outcomes import job_report

    return job_report(job, Verdict.ERROR, error_class, message)

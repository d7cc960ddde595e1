"""Untrusted code and paths: an allow-listed org's trust_remote_code repo really runs, pinned to the commit it
was sized at; any other org's is SKIPPED(remote_code); a model id is always a Hub id, never a directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.api.deps import current_settings
from shared.settings import get_settings
from tests.conftest import wait_for_job
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

"""Every kind of repo the Hub's lists hold gets a clear row, decided from metadata before any weights are
downloaded where it can be: adapters, GGUF / ONNX / MLX weights and quantization methods the backend does not
load are SKIPPED at submission, naming the cause; an FP8 checkpoint the cpu backend loads runs; a model_type
the worker's transformers does not know is an ERROR row from the runner; a pipeline we do not test is a 422
naming the tasks we do, and never a sweep's job."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, Verdict
from shared.db.models import Job, SweepEntry, Worker
from shared.hub.kinds import QUANTIZATION_LOADS, quantization_refusal
from shared.jobs.sweeps import candidates, open_sweep, run_sweep
from shared.settings import Settings
from tests.conftest import wait_for_job
from tests.test_pipeline import FINISHED, _queued_state, result_rows, submit

# repo → (its directory among the tiny checkpoints, the stand-in's metadata)
REPOS: dict[str, tuple[str, dict[str, Any]]] = {
    "kinds/adapter": ("tiny-adapter", {"pipeline_tag": "text-generation", "library_name": "peft"}),
    "kinds/gguf": ("tiny-gguf", {"pipeline_tag": "text-generation"}),
    "kinds/onnx": ("tiny-onnx", {}),
    "kinds/mlx": ("tiny-mlx", {"library_name": "mlx", "tags": ["mlx"]}),
    "kinds/gptq": ("tiny-gptq", {}),
    "kinds/awq": ("tiny-awq", {}),
    "kinds/bnb-4bit": ("tiny-bnb-4bit", {}),
    "kinds/mxfp4": ("tiny-mxfp4", {}),
    "kinds/compressed": ("tiny-compressed", {}),
    "kinds/fp8": ("tiny-llama-fp8", {}),
    "kinds/unknown-arch": ("tiny-unknown-arch", {}),
    # the top of the trending list, tagged with a task we do not run
    "kinds/vlm": ("tiny-llama", {"pipeline_tag": "image-text-to-text", "trendingScore": 10_000}),
}

# repo → (error class, what its message names)
SKIPPED_KINDS = {
    "kinds/adapter": (ErrorClass.adapter, ["PEFT adapter of org/tiny-llama", "adapter_config.json"]),
    "kinds/gguf": (ErrorClass.weights_format, ["only as GGUF (tiny-llama-Q8_0.gguf)"]),
    "kinds/onnx": (ErrorClass.weights_format, ["only as ONNX (onnx/model.onnx)"]),
    "kinds/mlx": (ErrorClass.weights_format, ["MLX weights (library mlx)"]),
    "kinds/gptq": (ErrorClass.quantized, ["quantized with gptq", "the cpu backend does not load", "loads: fp8"]),
    "kinds/awq": (ErrorClass.quantized, ["quantized with awq"]),
    "kinds/bnb-4bit": (ErrorClass.quantized, ["quantized with bitsandbytes_4bit"]),
    "kinds/mxfp4": (ErrorClass.quantized, ["quantized with mxfp4"]),
    "kinds/compressed": (ErrorClass.quantized, ["quantized with compressed-tensors"]),
}


@pytest.fixture(scope="module")
def kind_repos(hub: Any, tiny_models: Path) -> None:
    for repo, (directory, meta) in REPOS.items():
        hub.add(repo, tiny_models / directory, **meta)


def fetched(hub: Any, since: int, repo: str) -> list[str]:
    """The files of ``repo`` downloaded from the stand-in since request number ``since``."""
    return sorted({p.rsplit("/", 1)[1] for _, p in hub.requests[since:] if p.startswith(f"/{repo}/resolve/")})


@pytest.mark.parametrize("repo", list(SKIPPED_KINDS))
def test_a_repo_we_cannot_load_is_skipped_at_submission_naming_why(
    api: Any, worker: Any, hub: Any, kind_repos: None, repo: str
) -> None:
    # ``worker``: "never enqueued" is read off the live worker's queue, so this file must not run before one is up
    error_class, named = SKIPPED_KINDS[repo]
    before, requests_before = _queued_state(api), len(hub.requests)
    [job] = submit(api, repo)
    assert (job["state"], job["error_class"]) == ("done", error_class.value), job
    for words in named:
        assert words in job["error_message"]
    [row] = result_rows(api, model_id=repo)
    assert (row["result"], row["error_class"]) == ("SKIPPED", error_class.value)
    assert _queued_state(api)[1] == before[1]  # never enqueued
    # decided from metadata: no weights fetched, at most the small JSON files that tell the kind
    assert set(fetched(hub, requests_before, repo)) <= {"config.json", "adapter_config.json"}


def test_a_pipeline_we_do_not_test_is_a_422_naming_the_tasks_we_do(api: Any, kind_repos: None) -> None:
    response = api.post("/jobs", json={"model_id": "kinds/vlm"})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "'image-text-to-text', which has no test here" in detail
    assert "text-generation, feature-extraction" in detail and "sentence-similarity" in detail


def test_fp8_runs_on_cpu_and_an_unknown_model_type_is_an_error_row_before_any_weights(
    api: Any, worker: Any, hub: Any, kind_repos: None
) -> None:
    requests_before = len(hub.requests)
    [fp8] = submit(api, "kinds/fp8")
    [unknown] = submit(api, "kinds/unknown-arch")
    assert fp8["state"] == unknown["state"] == "queued"  # neither can be told from metadata the API may read

    unknown = wait_for_job(api, unknown["id"], FINISHED)
    assert (unknown["state"], unknown["error_class"]) == ("failed", "unsupported_architecture"), unknown
    assert "model_type 'zorblax'" in unknown["error_message"] and "ZorblaxForCausalLM" in unknown["error_message"]
    [row] = result_rows(api, model_id="kinds/unknown-arch")
    assert (row["result"], row["error_class"]) == ("ERROR", "unsupported_architecture")
    assert fetched(hub, requests_before, "kinds/unknown-arch") == ["config.json"]  # judged before any weights

    # block-wise FP8 weights, dequantized by transformers as they load: the run passes against the reference
    fp8 = wait_for_job(api, fp8["id"], FINISHED)
    assert fp8["state"] == "done", fp8
    [row] = result_rows(api, model_id="kinds/fp8")
    assert row["result"] == "PASS" and row["generated_token_ids"] == row["reference_token_ids"], row


def test_quantization_methods_load_per_backend() -> None:
    assert quantization_refusal("a/b", "fp8", "cpu") is None
    refusal = quantization_refusal("a/b", "fp8", "neuron")
    assert refusal is not None and refusal.verdict == Verdict.SKIPPED and refusal.error_class == ErrorClass.quantized
    assert "the neuron backend does not load (it loads: none)" in refusal.reason
    assert set(QUANTIZATION_LOADS) == {"cpu", "neuron", "cuda"}


@pytest.fixture
def cpu_settings(session: Session, tmp_path: Path) -> Settings:
    session.add(
        Worker(name="w-cpu", host="h", pid=1, backend="cpu", compiler_name="inductor", compiler_version="cpu-1",
               library="transformers", library_version="5.24.0", torch_version="2.13.0", cores="0", core_count=1,
               queue="q", heartbeat_at=dt.datetime.now(dt.UTC))
    )  # fmt: skip
    session.commit()
    return Settings(data_dir=tmp_path, backend="cpu", sweep_tasks=["text-generation"], sweep_limit=1)


def test_a_sweep_never_enqueues_a_task_we_do_not_run_and_gives_each_kind_its_row(
    session: Session, cpu_settings: Settings, kind_repos: None
) -> None:
    # the most trending repo of all is tagged image-text-to-text: no text-generation listing holds it
    assert "kinds/vlm" not in {c.model_id for c in candidates(cpu_settings)}
    # pinned without a task, it is tested as its tag says: not at all
    settings = cpu_settings.model_copy(
        update={"sweep_tasks": [], "sweep_selected": ["kinds/vlm", "kinds/gguf", "kinds/gptq", "kinds/fp8"]}
    )
    sweep = open_sweep(session, settings, "api")
    assert sweep is not None
    queued = run_sweep(session, settings, sweep)
    session.commit()
    assert [s.job.model_id for s in queued] == ["kinds/fp8"]
    jobs = {j.model_id: j for j in session.scalars(sa.select(Job))}
    assert set(jobs) == {"kinds/gguf", "kinds/gptq", "kinds/fp8"}
    assert (jobs["kinds/gguf"].state.value, jobs["kinds/gguf"].error_class) == ("done", ErrorClass.weights_format)
    assert (jobs["kinds/gptq"].state.value, jobs["kinds/gptq"].error_class) == ("done", ErrorClass.quantized)
    [vlm] = session.scalars(sa.select(SweepEntry).where(SweepEntry.model_id == "kinds/vlm"))
    assert vlm.job_id is None and vlm.task == "" and "'image-text-to-text', which has no test here" in vlm.note

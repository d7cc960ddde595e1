"""The roadmap's tasks (issue 21): sentence-transformers pipelines and diffusers text-to-image.

End to end through the API, a worker and the export: each repo's task chosen from its pipeline tag (or its
library), its own pipeline run, the row's output fields, the model page's images, Parquet. In process, on the
cpu backend: the embeddings each pooling mode should give, computed here without sentence-transformers; planted
faults (a wrong pooling, a dropped layer) that FAIL.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from shared.contracts.enums import Task
from tests.conftest import RUN_DIR, wait_for_job
from tests.test_pipeline import FINISHED, result_rows, submit

REPOS = {  # Hub id: (local repo, pipeline tag, library)
    "tasks/st-cls": ("tiny-st-cls", "sentence-similarity", "sentence-transformers"),
    "tasks/st-mean": ("tiny-st-mean", "feature-extraction", "sentence-transformers"),
    "tasks/st-mean-normalize": ("tiny-st-mean-normalize", None, "sentence-transformers"),  # by its library
    "tasks/tiny-sd": ("tiny-sd", "text-to-image", "diffusers"),
    "tasks/tiny-pixart": ("tiny-pixart", "text-to-image", "diffusers"),
}


@pytest.fixture(scope="module")
def pipeline_repos(hub: Any, pipelines: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # tiny-sd as the Hub serves Stable Diffusion: with an fp16 variant beside each default weight file, which a
    # pipeline's from_pretrained never reads (here not even a safetensors file: fetching or sizing it would fail)
    served = {name: pipelines / name for name, _, _ in REPOS.values()}
    served["tiny-sd"] = tmp_path_factory.mktemp("served") / "tiny-sd"
    shutil.copytree(pipelines / "tiny-sd", served["tiny-sd"])
    for weights in list(served["tiny-sd"].glob("*/*.safetensors")):
        weights.with_suffix(".fp16.safetensors").write_bytes(b"not weights")
    for model_id, (name, tag, library) in REPOS.items():
        hub.add(model_id, served[name], pipeline_tag=tag, library_name=library)
    huge = tmp_path_factory.mktemp("huge-pipeline")  # a 40 B-parameter pipeline, as the Hub describes it
    (huge / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline", "_diffusers_version": "0.42.1"}))
    hub.add(
        "tasks/huge-flux",
        huge,
        pipeline_tag="text-to-image",
        library_name="diffusers",
        safetensors={"parameters": {"BF16": 40_000_000_000}, "total": 40_000_000_000},
    )
    lora = tmp_path_factory.mktemp("lora")  # a LoRA tagged text-to-image: no pipeline of its own
    (lora / "pytorch_lora_weights.safetensors").write_bytes((8).to_bytes(8, "little") + b"{}      ")
    hub.add("tasks/a-lora", lora, pipeline_tag="text-to-image", library_name="diffusers", tags=["lora"])  # fmt: skip


def test_sentence_transformers_and_diffusers_repos_run_end_to_end_through_the_api_worker_and_export(
    api: Any, worker: Any, pipeline_repos: None
) -> None:
    jobs = {model_id: submit(api, model_id)[0] for model_id in REPOS}
    assert {m: j["task"] for m, j in jobs.items()} == {
        "tasks/st-cls": "feature-extraction",
        "tasks/st-mean": "feature-extraction",
        "tasks/st-mean-normalize": "feature-extraction",
        "tasks/tiny-sd": "text-to-image",
        "tasks/tiny-pixart": "text-to-image",
    }
    # a pipeline too large for one core is not split by a guess: SKIPPED at submission, with the class that says so
    [huge] = submit(api, "tasks/huge-flux")
    assert huge["state"] == "done" and huge["error_class"] == "unsupported_parallelism", huge
    assert "text-to-image runs whole on one core" in huge["error_message"]
    assert result_rows(api, model_id="tasks/huge-flux")[0]["result"] == "SKIPPED"
    [lora] = submit(api, "tasks/a-lora")  # a LoRA is no pipeline: SKIPPED as an adapter, never an ERROR
    assert (lora["state"], lora["error_class"]) == ("done", "adapter") and "LoRA" in lora["error_message"], lora

    for job in jobs.values():
        done = wait_for_job(api, job["id"], FINISHED, timeout=300)
        assert done["state"] == "done" and done["cores"] == 1, done
    rows = {model_id: result_rows(api, model_id=model_id) for model_id in REPOS}
    # the runners fetched tiny-sd's default weights and none of its fp16 variants (which would have been sized too)
    fetched = list((RUN_DIR / "hf-home").rglob("*tiny-sd*/**/*.safetensors"))
    assert fetched and not [f for f in fetched if f.name.endswith(".fp16.safetensors")], fetched
    assert {m: len(r) for m, r in rows.items()} == dict.fromkeys(REPOS, 1)  # exactly one row each
    for model_id, (pooling, normalized) in {
        "tasks/st-cls": ("cls", False),
        "tasks/st-mean": ("mean", False),
        "tasks/st-mean-normalize": ("mean", True),
    }.items():
        [row] = rows[model_id]
        assert row["result"] == "PASS" and row["similarity"] >= 0.999, row
        assert (row["pipeline_library"], row["embedding_pooling"], row["embedding_normalized"]) == (
            "sentence-transformers",
            pooling,
            normalized,
        )
        assert row["embedding_dim"] == 32 and row["pipeline_library_version"]
    for model_id, denoiser in {
        "tasks/tiny-sd": "UNet2DConditionModel",
        "tasks/tiny-pixart": "PixArtTransformer2DModel",
    }.items():
        [row] = rows[model_id]
        assert row["result"] == "PASS" and "PSNR" in row["verdict_reason"], row
        assert row["image_psnr"] >= 40 and row["image_ssim"] >= 0.99  # fp32 on both sides
        assert (row["pipeline_library"], row["denoiser"], row["image_size"], row["denoising_steps"]) == (
            "diffusers",
            denoiser,
            128,
            8,
        )
        assert 0 < row["denoise_step_s"] < row["generate_s"] and row["wall_s"] >= row["load_s"] > 0
        assert row["peak_memory_bytes"] > 0 and row["parallelism"] == "none"
        page = api.get(f"/model/{model_id}")
        assert page.status_code == 200 and page.text.count('src="data:image/png;base64,') == 2, page.text[-3000:]
        assert "Denoising step" in page.text and denoiser in page.text
    # the results page has a tab per task, the text-to-image one listing the pipelines
    tab = api.get("/", params={"task": "text-to-image"})
    assert tab.status_code == 200 and all(f">{t.value}<" in tab.text for t in Task)

    from services.worker.collector import export_once
    from shared.settings import get_settings

    export_once()
    deadline = time.monotonic() + 30
    frame = pd.DataFrame()
    while time.monotonic() < deadline:
        frame = pd.read_parquet(f"{get_settings().export_path}/data")
        if set(REPOS) <= set(frame.model_id):
            break
        time.sleep(0.5)
        export_once()
    exported = frame[frame.model_id.isin(list(REPOS))].set_index("model_id")
    assert len(exported) == len(REPOS)
    assert exported.loc["tasks/tiny-pixart", "task"] == "text-to-image"
    assert exported.loc["tasks/tiny-sd", "image_ssim"] == rows["tasks/tiny-sd"][0]["image_ssim"]
    assert exported.loc["tasks/st-cls", "embedding_pooling"] == "cls"


# --- in process: the embeddings are right, and planted faults FAIL ------------------------------------------------


def _backend(tmp_path: Path, fault: str | None = None) -> Any:
    from services.runner.backends.cpu import CpuBackend
    from shared.settings import Settings

    return CpuBackend(Settings(data_dir=tmp_path, cpu_compile_backend="aot_eager", cpu_fault=fault))


def _run(task: Any, model_dir: Path, tmp_path: Path, fault: str | None = None) -> tuple[Any, Any]:
    """The accelerator run (with ``fault``) and its conclusion against the CPU reference."""
    from services.runner.specs import AcceleratorSpec, ReferenceSpec
    from shared.contracts.handoffs import Artifacts

    planted, clean = _backend(tmp_path, fault), _backend(tmp_path)
    spec = AcceleratorSpec(backend="cpu", task=task.name, model_dir=model_dir, artifacts=tmp_path)
    acc = task.accelerator(spec, planted)
    reference_spec = ReferenceSpec(
        backend="cpu", task=task.name, model_dir=model_dir, artifacts=tmp_path, accelerator=acc
    )
    found = task.reference(reference_spec, clean)
    return acc, task.conclude(acc, found, Artifacts(tmp_path), clean.dtype)


def _expected_embeddings(model_dir: Path, pooling: str, normalize: bool) -> np.ndarray:
    """What the repo's modules define, computed with transformers alone: the encoder's last hidden states pooled
    by ``pooling`` over the attention mask, L2-normalised when the repo has a Normalize module."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from tasks.feature_extraction import SENTENCES

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    inputs = tokenizer(SENTENCES, padding=True, truncation=True, max_length=16, return_tensors="pt")
    with torch.inference_mode():
        hidden = AutoModel.from_pretrained(model_dir).eval()(**inputs).last_hidden_state
    mask = inputs["attention_mask"].unsqueeze(-1).float()
    pooled = hidden[:, 0] if pooling == "cls" else (hidden * mask).sum(1) / mask.sum(1)
    return (torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled).numpy()


@pytest.mark.parametrize("name", ["tiny-st-cls", "tiny-st-mean", "tiny-st-mean-normalize"])
def test_each_pooling_mode_gives_the_embeddings_its_modules_define_and_a_wrong_pooling_fails(
    pipelines: Path, tmp_path: Path, name: str
) -> None:
    from services.runner.tasks import get_task
    from shared.contracts.enums import Verdict
    from testing.tiny_pipelines import ST_POOLING

    task = get_task(Task.feature_extraction.value)
    acc, conclusion = _run(task, pipelines / name, tmp_path)
    pooling, normalize = ST_POOLING[name]
    np.testing.assert_allclose(np.asarray(acc.embeddings), _expected_embeddings(pipelines / name, pooling, normalize),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    assert conclusion.verdict == Verdict.PASS and acc.output.embedding_pooling == pooling
    norms = np.linalg.norm(np.asarray(acc.embeddings), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) == normalize

    _, wrong = _run(task, pipelines / name, tmp_path, fault="wrong_pooling")
    assert wrong.verdict == Verdict.FAIL and wrong.comparison.similarity < 0.99, wrong.reason


def test_a_pipeline_split_by_force_is_skipped_with_the_class_that_says_so(pipelines: Path, tmp_path: Path) -> None:
    """--cores 2 for a diffusers pipeline: no guess at a split, a SKIPPED row naming unsupported_parallelism."""
    import subprocess
    import sys

    from shared.contracts.report import RunReport
    from tests.conftest import ROOT

    done = subprocess.run(
        [sys.executable, "-m", "services.runner", "local/tiny-sd", "--local-dir", str(pipelines / "tiny-sd"),
         "--task", "text-to-image", "--cores", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "SUPPORTMATRIX_DATA_DIR": str(tmp_path), "SUPPORTMATRIX_CPU_COMPILE_BACKEND": "aot_eager"},
    )  # fmt: skip
    report = RunReport.model_validate_json(done.stdout.strip().splitlines()[-1])
    assert (report.verdict, report.failure.error_class) == ("SKIPPED", "unsupported_parallelism"), done.stderr[-2000:]
    assert "a diffusers pipeline runs whole on one core" in (report.failure.error_message or "")


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-pixart"])
def test_a_denoiser_with_a_dropped_block_draws_an_image_that_fails(pipelines: Path, tmp_path: Path, name: str) -> None:
    from services.runner.tasks import get_task
    from shared.contracts.enums import Verdict

    acc, conclusion = _run(get_task(Task.text_to_image.value), pipelines / name, tmp_path, fault="drop_layer")
    assert conclusion.verdict == Verdict.FAIL and "PSNR" in conclusion.reason
    assert conclusion.comparison.image_psnr < 40 and set(conclusion.comparison.evidence["images"]) == {
        "accelerator",
        "reference",
    }
    assert acc.timings.denoise_step_s > 0 and np.asarray(acc.image).shape == (128, 128, 3)
    from PIL import Image

    from shared.contracts.handoffs import Artifacts

    for side, path in Artifacts(tmp_path).images.items():  # both images, whole, among the job's artifacts
        assert Image.open(path).size == (128, 128), side

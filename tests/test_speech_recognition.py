"""automatic-speech-recognition (tasks/automatic_speech_recognition/): a Whisper-style encoder-decoder transcribes a
synthetic clip with greedy ``generate``, token by token against the CPU reference's transcript.

End to end through the API, a worker and the export: the task chosen from the repo's pipeline tag, one row, a forced
rerun that reuses the stored reference, the model page, Parquet. In process: planted faults FAIL, a stored
reference serves only a transcript it matches, and the rule on constructed evidence (a near tie PASSes, a far
divergence FAILs).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from shared.contracts.enums import Task, Verdict
from tests.conftest import RUN_DIR, wait_for_job
from tests.test_pipeline import FINISHED, result_rows, submit
from tests.test_task_pipelines import _run

MODEL_ID = "speech/tiny-whisper"


@pytest.fixture(scope="module")
def whisper() -> Path:
    from testing.tiny_speech import build

    [built] = build(RUN_DIR / "speech")
    return built


@pytest.fixture(scope="module")
def served_whisper(hub: Any, whisper: Path) -> str:
    hub.add(MODEL_ID, whisper, pipeline_tag="automatic-speech-recognition", library_name="transformers")
    return MODEL_ID


def test_a_whisper_repo_is_transcribed_end_to_end_and_a_rerun_reuses_its_reference(
    api: Any, worker: Any, served_whisper: str
) -> None:
    [job] = submit(api, served_whisper)
    assert job["task"] == Task.automatic_speech_recognition and job["cores"] == 1, job
    done = wait_for_job(api, job["id"], FINISHED, timeout=300)
    assert done["state"] == "done", done
    [row] = result_rows(api, model_id=served_whisper)
    assert row["result"] == "PASS" and "transcript matches" in row["verdict_reason"], row
    assert row["tokens_match"] is True and row["first_divergence"] is None
    assert row["generated_text"] == row["reference_text"] and row["generated_text"]
    assert len(row["generated_token_ids"]) == 32 and row["generated_token_ids"] == row["reference_token_ids"]
    assert row["reference_reused"] is False and row["parallelism"] == "none"
    assert row["wall_s"] >= row["load_s"] > 0 and row["peak_memory_bytes"] > 0 and row["backend_graphs"] == 2
    assert row["pipeline_library"] == "transformers"

    [rerun] = submit(api, served_whisper, force=True)  # the same test again: the CPU reference comes from the store
    assert rerun["id"] != job["id"]
    assert wait_for_job(api, rerun["id"], FINISHED, timeout=300)["state"] == "done"
    rows = {r["job_id"]: r for r in result_rows(api, model_id=served_whisper)}
    assert set(rows) == {job["id"], rerun["id"]}  # exactly one row per job
    again = rows[rerun["id"]]
    assert again["result"] == "PASS" and again["reference_reused"] is True, again
    assert again["generated_text"] == row["generated_text"]

    page = api.get(f"/model/{served_whisper}")
    assert page.status_code == 200 and 'id="transcript"' in page.text and "none: the transcripts match" in page.text
    versions = {"compiler": row["neuronx_cc"], "library": row["library_version"]}  # its cell's: other tests run others
    tab = api.get("/", params={"task": Task.automatic_speech_recognition.value, **versions})
    assert tab.status_code == 200 and served_whisper in tab.text

    from services.worker.collector import export_once
    from shared.settings import get_settings

    deadline, frame = time.monotonic() + 30, pd.DataFrame()
    while time.monotonic() < deadline and served_whisper not in set(frame.get("model_id", [])):
        export_once()
        frame = pd.read_parquet(f"{get_settings().export_path}/data")
        time.sleep(0.2)
    exported = frame[frame.model_id == served_whisper]
    assert len(exported) == 1 and exported.iloc[0]["task"] == Task.automatic_speech_recognition  # a cell: its newest


@pytest.mark.slow  # runs the model here (the whisper fixture builds it)
@pytest.mark.parametrize("fault", ["drop_layer", "scale_shard_10pct"])
def test_a_planted_fault_in_the_speech_model_fails(whisper: Path, tmp_path: Path, fault: str) -> None:
    from services.runner.tasks import get_task

    _, conclusion = _run(get_task(Task.automatic_speech_recognition), whisper, tmp_path, fault=fault)
    assert conclusion.verdict == Verdict.FAIL and "decode step" in conclusion.reason, conclusion.reason
    errors = conclusion.comparison.evidence["step_rel_errors"]
    assert len(errors) == 32 and max(errors) > conclusion.comparison.evidence["tolerances"]["decode"]


@pytest.mark.slow
def test_a_stored_reference_serves_only_a_transcript_it_matches(whisper: Path, tmp_path: Path) -> None:
    from services.runner.tasks import get_task
    from shared.contracts.handoffs import Artifacts

    task = get_task(Task.automatic_speech_recognition)
    clean = tmp_path / "clean"
    clean.mkdir()
    acc, conclusion = _run(task, whisper, clean)
    assert conclusion.verdict == Verdict.PASS and acc.token_ids is not None
    stored = {  # what a stored reference of this clean run holds: the reference matched it token for token
        "sequence": acc.token_ids,
        "text": acc.text,
        "step_top_ids": [list(range(64))] * 32,
        "step_top_logits": np.load(Artifacts(clean).step_logits)[:, :64].tolist(),
    }
    reused = task.reuse(acc, stored, Artifacts(clean), "float32")
    assert reused is not None and reused.reused and reused.step_rel_errors == [0.0] * 32
    assert task.conclude(acc, reused, Artifacts(clean), "float32").verdict == Verdict.PASS
    other = acc.model_copy(update={"token_ids": [*acc.token_ids[:-1], acc.token_ids[-1] + 1]})
    assert task.reuse(other, stored, Artifacts(clean), "float32") is None  # parted: the reference runs again


@pytest.mark.parametrize(("gap", "verdict"), [(0.1, Verdict.PASS), (0.5, Verdict.FAIL)])
def test_transcripts_that_part_pass_only_at_a_near_tie_of_the_reference(gap: float, verdict: Verdict) -> None:
    from services.runner.specs import ReferenceResult
    from services.runner.tasks import get_task
    from shared.contracts.evidence import StepEvidence
    from shared.contracts.handoffs import AcceleratorData, Artifacts
    from shared.contracts.report import Placement, Timings

    reference = [1, 2, *range(10, 42)]  # the decoder's forced start, then 32 generated tokens
    ours = [*reference[:7], 99, *reference[8:]]  # parted at generated step 5
    acc = AcceleratorData(token_ids=ours, text="ours", finite=True, placement=Placement(), timings=Timings())
    found = ReferenceResult(
        data={"sequence": reference, "text": "theirs", "step_top_ids": [[0]] * 32, "step_top_logits": [[1.0]] * 32},
        divergent_steps=[StepEvidence(step=5, accelerator_token=99, reference_token=reference[7], gap=gap, rank=1)],
        step_rel_errors=[0.01] * 32,  # every step's logits within bf16's 0.04, on the accelerator's prefix
    )
    task = get_task(Task.automatic_speech_recognition)
    conclusion = task.conclude(acc, found, Artifacts(Path()), "bfloat16")
    assert conclusion.verdict == verdict and conclusion.comparison.first_divergence == 5, conclusion.reason
    assert conclusion.comparison.tokens_match is False
    assert ("near tie" in conclusion.reason) == (verdict == Verdict.PASS)


def test_the_clip_is_the_same_waveform_on_every_host() -> None:
    from tasks.automatic_speech_recognition import CLIP_SECONDS
    from tasks.automatic_speech_recognition.runner import clip

    a, b = clip(16000), clip(16000)
    assert np.array_equal(a, b) and len(a) == int(CLIP_SECONDS * 16000) and a.dtype == np.float32
    assert np.abs(a[: 16000 // 2]).max() > 0.4 and not a[-1600:].any()  # tones, then silence
    assert len(clip(8000)) == int(CLIP_SECONDS * 8000)  # at the repo's own rate

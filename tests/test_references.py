"""The CPU reference is computed once per (commit, task, test config, dtype, versions) and reused.

Through the service: the worker looks the stored reference up and hands it to the verdict stage as a file,
and stores the one a verdict stage computed; the runner itself never opens the database.
"""

from __future__ import annotations

from typing import Any

from shared.db.engine import new_session
from shared.results import references
from tests.conftest import wait_for_job
from tests.test_pipeline import FINISHED, result_rows, submit

MODELS = ("refs/tiny-qwen3", "refs/tiny-gpt2")  # an org no other test submits


def test_m_models_times_k_compilers_run_m_references(api: Any, worker: Any, start_worker: Any) -> None:
    start_worker("w-refs-eager", SUPPORTMATRIX_CPU_COMPILE_BACKEND="eager")  # a second compiler version
    with new_session() as session:
        before = {m: references.count(session, m) for m in MODELS}
    jobs = [job for model in MODELS for job in submit(api, model)]
    assert len(jobs) == 4 and {j["compiler_version"] for j in jobs} == {"aot_eager-2.13.0+cpu", "eager-2.13.0+cpu"}
    for job in jobs:
        assert wait_for_job(api, job["id"], FINISHED)["state"] == "done"
    with new_session() as session:
        runs = {m: references.count(session, m) - before[m] for m in MODELS}
    assert runs == dict.fromkeys(MODELS, 1)  # M references for M x K runs
    for model in MODELS:
        rows = result_rows(api, model_id=model)
        assert len(rows) == 2 and {r["result"] for r in rows} == {"PASS"}
        # one verdict stage ran the reference, the other reused it — with the same evidence a fresh one gives
        assert sorted(r["reference_reused"] for r in rows) == [False, True]
        assert all(r["generated_token_ids"] == r["reference_token_ids"] and r["reference_text"] for r in rows)
        assert all(r["prefill_rel_error"] < 1e-3 for r in rows)

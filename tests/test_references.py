"""The CPU reference is computed once per (commit, task, test config, dtype, versions) and reused."""

from __future__ import annotations

from typing import Any

from shared.db.engine import new_session
from shared.results import references
from tests.test_runner import run_runner

MODELS = ("refs/tiny-qwen3", "refs/tiny-gpt2")  # an org no other test submits
COMPILERS = ("aot_eager", "eager")  # two compiler versions on the cpu backend


def test_m_models_times_k_compilers_run_m_references(hub: Any) -> None:
    with new_session() as session:
        before = {m: references.count(session, m) for m in MODELS}
    reused = []
    for model in MODELS:
        for compiler in COMPILERS:
            code, report = run_runner(model, SUPPORTMATRIX_CPU_COMPILE_BACKEND=compiler)
            assert code == 0 and report["verdict"] == "PASS", report["error_message"] or report["verdict_reason"]
            assert report["compiler_version"].startswith(compiler)
            reused.append(report["reference_reused"])
            # the stored reference gives the same evidence a fresh one would
            assert report["generated_token_ids"] == report["reference_token_ids"]
            assert report["reference_text"] and report["prefill_rel_error"] < 1e-3
    with new_session() as session:
        runs = {m: references.count(session, m) - before[m] for m in MODELS}
    assert runs == dict.fromkeys(MODELS, 1)  # M references for M x K runs
    assert reused == [False, True, False, True]

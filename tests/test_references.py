"""The CPU reference is computed once per (commit, task, test config, dtype, versions) and reused.

Through the service: the worker looks the stored reference up and hands it to the verdict stage as a file,
and stores the one a verdict stage computed; the runner itself never opens the database.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np

from services.runner.faults import LATE_STEP
from shared.contracts.enums import LongOutcome
from shared.contracts.handoffs import AcceleratorData, Artifacts, StoredReference
from shared.contracts.report import Placement, Timings
from shared.db.engine import new_session, session_scope
from shared.db.models import ReferenceRun
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


TIERS_ON = {"SUPPORTMATRIX_LONG_GENERATION": "true"}


def test_a_second_compiler_version_reusing_the_reference_still_checks_its_long_generation(
    api: Any, verdict_worker: Any, start_worker: Any
) -> None:
    """Two compiler versions of one model, tiers on, as a sweep runs them: the first computes the reference and stores
    its long generation with it. The second carries a late fault (a cache corrupted from token 100 on: its 32 tokens
    are the reference's, so the stored reference is looked up): its long tokens are not the stored ones, so the model
    runs again, and the fault is caught. A rerun of the first then reuses the reference without running the model,
    and gets its long-generation outcome from it. Every row has one. Compilers no other worker serves, so that the
    tiers are on for all three runs."""
    model = "refs/tiny-llama"  # no other test submits it
    clean, faulted = "eager-2.13.0+cpu", "aot_eager_decomp_partition-2.13.0+cpu"
    start_worker("w-refs-long-a", SUPPORTMATRIX_CPU_COMPILE_BACKEND="eager", **TIERS_ON)
    start_worker("w-refs-long-b", SUPPORTMATRIX_CPU_COMPILE_BACKEND="aot_eager_decomp_partition",
                 SUPPORTMATRIX_CPU_FAULT="late_corruption", **TIERS_ON)  # fmt: skip
    jobs = []
    for compiler, force in [(clean, False), (faulted, False), (clean, True)]:  # in turn: each finds the reference
        [job] = submit(api, model, compilers=[compiler], force=force)
        assert wait_for_job(api, job["id"], FINISHED, timeout=300)["state"] == "done"
        jobs.append(job["id"])
    with new_session() as session:
        assert references.count(session, model) == 1  # the faulted run's reference is the same run: not stored twice
        [(stored, _)] = [references.load(session, r.key) for r in session.query(ReferenceRun).filter_by(model_id=model)]
    assert stored is not None and len(stored.data["long_token_ids"]) == len(stored.data["long_logprobs"]) > 200
    rows = {r["job_id"]: r for r in result_rows(api, model_id=model)}
    assert sorted(rows) == jobs and [rows[j]["result"] for j in jobs] == ["PASS"] * 3
    first, second, rerun = (rows[j] for j in jobs)
    assert (first["neuronx_cc"], second["neuronx_cc"], rerun["neuronx_cc"]) == (clean, faulted, clean)
    # the first ran the reference: its long generation is the reference's own
    assert first["reference_reused"] is False and first["long_generation"] == LongOutcome.ok
    # the second's 32 tokens are the stored ones, its long tokens are not: the model ran, and the fault is caught
    assert second["reference_reused"] is False, second
    assert second["long_generation"] in (LongOutcome.collapsed, LongOutcome.diverged), second
    assert second["long_first_divergence"] >= LATE_STEP
    # the rerun's long tokens are the stored ones: reused, and decided as a fresh reference decides them
    assert rerun["reference_reused"] is True, rerun
    assert rerun["long_generation"] == LongOutcome.ok and rerun["long_first_divergence"] is None


def _steps(root: Path, vocab: int = 200) -> tuple[Artifacts, dict[str, Any]]:
    """A job's directory whose accelerator left 32 steps of logits, and a stored reference's top logits of the same
    steps: the reference's own run, on the accelerator's (the same) tokens."""
    from services.runner.tasks.logits import top_logits
    from tasks.text_generation import DECODE_TOP

    artifacts = Artifacts(root)
    steps = np.random.default_rng(0).normal(size=(32, vocab)).astype(np.float32) + 3.0
    np.save(artifacts.step_logits, steps)
    tops = [top_logits(step, DECODE_TOP) for step in steps]
    return artifacts, {"step_top_ids": [ids for ids, _ in tops], "step_top_logits": [logits for _, logits in tops]}


def test_a_stored_reference_decides_the_long_generation_as_a_fresh_one_and_asks_for_the_model_when_it_cannot(
    tmp_path: Path,
) -> None:
    """``TextGeneration.reuse`` alone: the same 32 and long tokens get the stored long log-probs (the accelerator's
    tokens are the reference's own); other long tokens, or a reference stored without its long generation (the tiers
    off), need the model; with the tiers off the long data is not needed."""
    from tasks.text_generation.runner import TextGeneration

    tokens, long = list(range(32)), list(range(256))
    artifacts, tops = _steps(tmp_path)
    stored = {"token_ids": tokens, "reference_loglik": -2.0, "long_token_ids": long, "long_logprobs": [-1.5] * 256,
              **tops}  # fmt: skip
    placement = Placement()
    acc = AcceleratorData(token_ids=tokens, long_token_ids=long, long_finite=True, finite=True, placement=placement,
                          timings=Timings())  # fmt: skip
    found = TextGeneration().reuse(acc, stored, artifacts, "float32")
    assert found is not None and found.reused and found.long_logprobs == [-1.5] * 256
    assert found.accelerator_loglik == -2.0 and found.step_rel_errors == [0.0] * 32
    late = acc.model_copy(update={"long_token_ids": [*long[:100], *range(1000, 1156)]})
    assert TextGeneration().reuse(late, stored, artifacts, "float32") is None
    tiers_off = {k: v for k, v in stored.items() if not k.startswith("long_")}
    assert TextGeneration().reuse(acc, tiers_off, artifacts, "float32") is None
    no_long = TextGeneration().reuse(acc.model_copy(update={"long_token_ids": None}), tiers_off, artifacts, "float32")
    assert no_long is not None and no_long.long_logprobs is None


def test_a_stored_reference_holds_each_decode_step_to_its_own_top_logits_as_a_fresh_one_does(tmp_path: Path) -> None:
    """A decode-only fault (an off-by-one cache position) can leave every token the stored reference's: reused, its
    moved step is measured against the stored run's top logits — the same prefix — and the run fails, as with a fresh
    reference. A reference stored before the steps' top logits were kept needs the model; so does a MoE's moved step
    after a flip (only the counterfactual can excuse it)."""
    from shared.contracts.handoffs import Routing
    from tasks.text_generation import Tolerances
    from tasks.text_generation.runner import TextGeneration

    tokens = list(range(32))
    artifacts, tops = _steps(tmp_path)
    stored = {"token_ids": tokens, "text": "", "reference_loglik": -2.0, "generate_s": 1.0, "peak_rss_bytes": 1, **tops}
    steps = np.load(artifacts.step_logits)
    steps[12] += np.random.default_rng(1).normal(scale=0.5, size=steps.shape[1]).astype(np.float32)
    np.save(artifacts.step_logits, steps)
    acc = AcceleratorData(token_ids=tokens, finite=True, placement=Placement(), timings=Timings())
    found = TextGeneration().reuse(acc, stored, artifacts, "bfloat16")
    assert found is not None and found.reused and found.step_rel_errors is not None
    assert found.step_rel_errors[12] > Tolerances.for_dtype("bfloat16").decode
    assert max(found.step_rel_errors[:12] + found.step_rel_errors[13:]) == 0.0
    np.save(artifacts.prefill, steps[0])
    np.save(artifacts.reference_prefill, steps[0])
    conclusion = TextGeneration().conclude(acc, found, artifacts, "bfloat16")
    assert conclusion.verdict.value == "FAIL" and "step 12's logits differ" in conclusion.reason, conclusion.reason
    steps[20] = np.nan  # non-finite logits (rule 1's): no error to compare, and the result still crosses as JSON
    np.save(artifacts.step_logits, steps)
    nan = TextGeneration().reuse(acc, stored, artifacts, "bfloat16")
    assert nan is not None and nan.step_rel_errors is not None and nan.step_rel_errors[20] is None
    assert type(nan).model_validate_json(nan.model_dump_json()).step_rel_errors == nan.step_rel_errors
    older = {k: v for k, v in stored.items() if not k.startswith("step_top")}
    assert TextGeneration().reuse(acc, older, artifacts, "bfloat16") is None
    routing = {"experts": [[[0, 1]]] * 13, "prompt_positions": 1, "top_logits": [[[2.0, 1.0, 0.99, 0.1]]] * 13,
               "top_experts": [[[0, 1, 2, 3]]] * 13}  # fmt: skip
    flipped = [[[0, 1]]] * 5 + [[[0, 2]]] + [[[0, 1]]] * 7  # step 5 flipped at a near tie
    moe = acc.model_copy(update={"routing": Routing(**(routing | {"experts": flipped}))})
    assert TextGeneration().reuse(moe, stored | {"routing": routing}, artifacts, "bfloat16") is None


def test_a_stored_moe_reference_is_reused_only_with_its_router_logits(tmp_path: Path) -> None:
    """A MoE's accelerator routing is compared with the stored reference's: one stored by an older runner (its
    margins, no router logits) cannot give a flip its margin, so the model runs again; one with them gives the
    flips, each at the gap between the experts that swapped. A flip in the prompt may have moved the prefill, which
    only the counterfactual (the model made to choose the accelerator's experts) can excuse: the model runs again."""
    from shared.contracts.handoffs import Routing
    from tasks.text_generation.runner import TextGeneration

    tokens = list(range(32))
    experts = [[[0, 1]]] * 2  # two positions, one layer, top-2
    old = {"experts": experts, "margins": [[0.5]] * 2, "prompt_positions": 2}
    artifacts, tops = _steps(tmp_path)
    stored = {"token_ids": tokens, "reference_loglik": -2.0, "routing": old, **tops}
    acc = AcceleratorData(token_ids=tokens, finite=True, placement=Placement(), timings=Timings(),
                          routing=Routing(experts=[[[0, 1]], [[0, 2]]], prompt_positions=2))  # fmt: skip
    assert TextGeneration().reuse(acc, stored, artifacts, "float32") is None
    top = {"top_logits": [[[2.0, 1.0, 0.99, 0.1]]] * 2, "top_experts": [[[0, 1, 2, 3]]] * 2}
    found = TextGeneration().reuse(acc, stored | {"routing": old | top}, artifacts, "float32")
    assert found is None  # the flip is at the prompt's last position (step 0)
    generated = {"prompt_positions": 1}  # the same flip one position later: step 1, after the prefill
    acc = acc.model_copy(update={"routing": acc.routing.model_copy(update=generated)})
    found = TextGeneration().reuse(acc, stored | {"routing": old | top | generated}, artifacts, "float32")
    assert found is not None and found.routing_flips is not None and len(found.routing_flips) == 1
    assert found.routing_flips[0].step == 1 and abs(found.routing_flips[0].margin - 0.01) < 1e-9


def test_a_reference_stored_with_the_tiers_off_takes_the_long_generation_of_the_next_one() -> None:
    """The first reference of a model stored without its long generation is completed by the one a later run with
    the tiers on computes; a concurrent equal one changes nothing."""
    key = f"refs-upgrade-{uuid.uuid4().hex}"[:64]
    base = StoredReference(key=key, model_id="refs-upgrade/m", sha="s" * 40, task="text-generation", dtype="float32",
                           library_version="5.24.0", torch_version="2.13.0",
                           data={"token_ids": [1, 2], "reference_loglik": -1.0})  # fmt: skip
    longer = base.model_copy(update={"data": {**base.data, "long_token_ids": [3, 4], "long_logprobs": [-0.5, -0.7]}})
    with session_scope() as session:
        references.store(session, base, None)
    with session_scope() as session:
        references.store(session, longer, None)
    with session_scope() as session:
        references.store(session, base, None)  # the tiers off again: what it lacks stays
    with new_session() as session:
        found = references.load(session, key)
    assert found is not None and found[0].data == longer.data


def test_a_stored_reference_is_completed_only_by_the_same_run_and_keeps_what_it_holds() -> None:
    """Another run's reference (other tokens, or other long tokens) changes nothing of a stored one: its data would not
    describe the stored prefill logits. The same run's adds only the keys the stored one lacks."""
    key = f"refs-merge-{uuid.uuid4().hex}"[:64]
    base = StoredReference(key=key, model_id="refs-merge/m", sha="s" * 40, task="text-generation", dtype="float32",
                           library_version="5.24.0", torch_version="2.13.0",
                           data={"token_ids": [1, 2], "reference_loglik": -1.0, "long_token_ids": [3, 4],
                                 "long_logprobs": [-0.5, -0.7]})  # fmt: skip
    other_tokens = base.model_copy(update={"data": {"token_ids": [1, 9], "reference_loglik": -3.0, "routing": {}}})
    other_long = base.model_copy(update={"data": {**base.data, "long_token_ids": [3, 8], "routing": {"x": 1}}})
    same = base.model_copy(update={"data": {**base.data, "reference_loglik": -1.5, "routing": {"x": 2}}})
    with session_scope() as session:
        references.store(session, base, b"prefill")
    for other in (other_tokens, other_long):
        with session_scope() as session:
            references.store(session, other, None)
        with new_session() as session:
            found = references.load(session, key)
        assert found is not None and found[0].data == base.data and found[1] == b"prefill"
    with session_scope() as session:
        references.store(session, same, None)
    with new_session() as session:
        found = references.load(session, key)
    assert found is not None and found[0].data == {**base.data, "routing": {"x": 2}}  # its own log-lik stays


def test_two_references_are_the_same_run_when_their_tokens_and_long_tokens_agree() -> None:
    stored = {"token_ids": [1, 2], "long_token_ids": [3, 4]}
    assert references.same_run(stored, {"token_ids": [1, 2]})  # no long generation: the 32 tokens decide
    assert references.same_run(stored, {"token_ids": [1, 2], "long_token_ids": [3, 4]})
    assert not references.same_run(stored, {"token_ids": [1, 2], "long_token_ids": [3, 5]})
    assert not references.same_run(stored, {"token_ids": [1, 3], "long_token_ids": [3, 4]})
    assert references.same_run({"token_ids": [1, 2]}, stored)

"""The verdict rule, on constructed evidence: no model needed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from shared.contracts.enums import Verdict
from shared.contracts.evidence import Evidence, JudgeOutcome, RoutingFlip, StepEvidence
from shared.contracts.handoffs import Routing
from shared.contracts.report import Comparison, JudgeAudit
from shared.testconfig import config_hash
from tasks import feature_extraction
from tasks.text_generation import Tolerances
from tasks.text_generation.verdict import decide, first_divergence, flip_margin, routing_flips, routing_roots

BF16 = Tolerances.for_dtype("bfloat16")
FP32 = Tolerances.for_dtype("float32")
TOKENS = list(range(32))


def diverged(at: int) -> list[int]:
    return [*TOKENS[:at], 999, *TOKENS[at + 1 :]]


def evidence(
    generated: list[int],
    reference: list[int],
    divergent_steps: list[StepEvidence] | None = None,
    *,
    accelerator_loglik: float = 0.0,
    reference_loglik: float = 0.0,
    prefill_rel_error: float = 0.0,
    **rule: Any,
) -> Evidence:
    """The evidence of a run with these tokens and numbers (its comparison), and what the rule needs besides."""
    numbers = Comparison(generated_token_ids=generated, reference_token_ids=reference,
                         prefill_rel_error=prefill_rel_error, accelerator_loglik=accelerator_loglik,
                         reference_loglik=reference_loglik)  # fmt: skip
    return Evidence(numbers, divergent_steps or [], **rule)


def judge(fluent: bool | None, reference_fluent: bool | None) -> JudgeOutcome:
    audit = JudgeAudit(judge_kind="openai", judge_model="m", judge_prompt_hash="h", judge_answer="No / Yes",
                       judge_rationale="garbled")  # fmt: skip
    return JudgeOutcome(audit, fluent, reference_fluent)


def test_matching_tokens_pass() -> None:
    decision = decide(evidence(TOKENS, TOKENS, prefill_rel_error=1e-7), FP32)
    assert decision.verdict == Verdict.PASS and decision.first_divergence is None


def test_divergences_that_are_near_ties_pass_single_core() -> None:
    step = StepEvidence(step=5, accelerator_token=999, reference_token=5, gap=0.1, rank=1)
    found = evidence(diverged(5), TOKENS, [step], accelerator_loglik=-2.0, reference_loglik=-2.05)
    decision = decide(found, BF16)
    assert decision.verdict == Verdict.PASS and decision.first_divergence == 5
    assert "near tie" in decision.reason


def test_a_divergence_that_is_not_a_near_tie_fails() -> None:
    far = StepEvidence(step=5, accelerator_token=999, reference_token=5, gap=2.5, rank=1)
    assert decide(evidence(diverged(5), TOKENS, [far]), BF16).verdict == Verdict.FAIL
    outside_top_k = StepEvidence(step=5, accelerator_token=999, reference_token=5, gap=0.1, rank=9)
    decision = decide(evidence(diverged(5), TOKENS, [outside_top_k]), BF16)
    assert decision.verdict == Verdict.FAIL and "rank 9" in decision.reason
    # the same gap is a near tie in bf16 but not in fp32, where drift is a million times smaller
    near = StepEvidence(step=5, accelerator_token=999, reference_token=5, gap=0.1, rank=1)
    assert decide(evidence(diverged(5), TOKENS, [near]), FP32).verdict == Verdict.FAIL


def test_prefill_error_and_non_finite_logits_fail_even_with_matching_tokens() -> None:
    assert decide(evidence(TOKENS, TOKENS, prefill_rel_error=0.2), BF16).verdict == Verdict.FAIL
    assert decide(evidence(TOKENS, TOKENS, finite=False), BF16).verdict == Verdict.FAIL


def test_text_the_reference_finds_implausible_fails_only_where_some_divergence_is_no_near_tie() -> None:
    """Rule 4 (version 8). A text whose every divergence is a near tie is the reference's own greedy text of its
    prefix up to those ties: however much less likely its path than the reference's text, it passes. The benign bf16
    run that failed version 7 (a 24-layer dense Llama, seed 7 of the MoE calibration): one exact tie at step 4, then
    the reference's own best picks, 0.33 nats per token below its own text. With a far step, the same likelihoods
    fail as implausible, before any judge is asked."""
    tie = StepEvidence(step=4, accelerator_token=999, reference_token=4, gap=0.0, rank=0)
    greedy = evidence(diverged(4), TOKENS, [tie], accelerator_loglik=-3.672, reference_loglik=-3.346)
    decision = decide(greedy, BF16)
    assert decision.verdict == Verdict.PASS and "every divergence a near tie" in decision.reason, decision.reason
    near = StepEvidence(step=3, accelerator_token=999, reference_token=3, gap=0.2, rank=1)
    far = StepEvidence(step=9, accelerator_token=999, reference_token=9, gap=2.0, rank=3)
    assert decide(evidence(diverged(3), TOKENS, [near], accelerator_loglik=-4.0, reference_loglik=-2.0),
                  BF16).verdict == Verdict.PASS  # fmt: skip
    for dtype in (BF16, FP32):
        found = evidence(diverged(3), TOKENS, [near, far], accelerator_loglik=-4.0, reference_loglik=-2.0,
                         sharded=True, judge=judge(True, True))  # fmt: skip
        decision = decide(found, dtype)
        assert decision.verdict == Verdict.FAIL and "implausible" in decision.reason, decision.reason
        # the argument: a near tie costs the reference at most near_tie_gap nats, never more than the slack
        assert dtype.near_tie_gap <= dtype.loglik_slack


def test_the_judge_fails_a_sharded_run_only_when_the_reference_text_is_fluent() -> None:
    base = {"generated": TOKENS, "reference": TOKENS, "sharded": True}
    assert decide(evidence(**base, judge=judge(False, True)), BF16).verdict == Verdict.FAIL
    assert decide(evidence(**base, judge=judge(False, False)), BF16).verdict == Verdict.PASS  # inconclusive
    assert decide(evidence(**base, judge=judge(True, True)), BF16).verdict == Verdict.PASS
    # single-core runs are not judged
    assert decide(evidence(TOKENS, TOKENS, judge=judge(False, True)), BF16).verdict == Verdict.PASS


def test_the_judge_never_turns_a_numeric_failure_into_a_pass() -> None:
    found = evidence(TOKENS, TOKENS, prefill_rel_error=0.5, sharded=True, judge=judge(True, True))
    assert decide(found, BF16).verdict == Verdict.FAIL
    nan = evidence(TOKENS, TOKENS, finite=False, sharded=True, judge=judge(True, True))
    assert decide(nan, BF16).verdict == Verdict.FAIL


def test_first_divergence() -> None:
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1


def test_the_judge_decides_a_sharded_run_whose_numbers_are_inconclusive() -> None:
    """A divergence that is no near tie, in text about as likely as the reference's: the numbers cannot tell a
    benign reordering from a fault, so a judge that reads the text decides — both ways."""
    far = StepEvidence(step=5, accelerator_token=999, reference_token=5, gap=2.5, rank=9)
    inconclusive = {"generated": diverged(5), "reference": TOKENS, "divergent_steps": [far],
                    "accelerator_loglik": -2.1, "reference_loglik": -2.0, "sharded": True}  # fmt: skip
    passed = decide(evidence(**inconclusive, judge=judge(True, True)), BF16)
    assert passed.verdict == Verdict.PASS and "not a near tie" in passed.reason and "finds it fluent" in passed.reason
    failed = decide(evidence(**inconclusive, judge=judge(False, True)), BF16)
    assert failed.verdict == Verdict.FAIL and "not fluent" in failed.reason
    # a judge that cannot tell, or cannot tell the reference's text from garbage, leaves the numbers' FAIL
    assert decide(evidence(**inconclusive, judge=judge(None, True)), BF16).verdict == Verdict.FAIL
    assert decide(evidence(**inconclusive, judge=judge(True, False)), BF16).verdict == Verdict.FAIL
    # no answer about the reference's text: the judge's answer about the accelerator's decides
    assert decide(evidence(**inconclusive, judge=judge(True, None)), BF16).verdict == Verdict.PASS
    assert decide(evidence(**inconclusive, judge=judge(False, None)), BF16).verdict == Verdict.FAIL
    # the likelihood judge weighs only what the rule already weighed; single-core runs have no judge
    audit = JudgeAudit(
        judge_kind="likelihood", judge_prompt_hash="h", judge_answer="Yes / Yes", judge_rationale="close"
    )
    likelihood = JudgeOutcome(audit, True, True)
    assert decide(evidence(**inconclusive, judge=likelihood), BF16).verdict == Verdict.FAIL
    single = inconclusive | {"sharded": False}
    assert decide(evidence(**single, judge=judge(True, True)), BF16).verdict == Verdict.FAIL
    # implausible text fails before any judge is asked
    implausible = inconclusive | {"accelerator_loglik": -3.0}
    decision = decide(evidence(**implausible, judge=judge(True, True)), BF16)
    assert decision.verdict == Verdict.FAIL and "implausible" in decision.reason


def test_the_bf16_and_fp32_tolerances_at_their_edges() -> None:
    """The thresholds themselves (bench/calibrate_verdict.py measured where they sit): a hair inside passes, a hair
    outside fails — prefill error, near-tie gap and rank (top-5), likelihood slack."""
    for tol, prefill, gap, slack in ((BF16, 4e-2, 0.3, 0.3), (FP32, 1e-3, 1e-3, 0.05)):
        assert decide(evidence(TOKENS, TOKENS, prefill_rel_error=prefill * 0.99), tol).verdict == Verdict.PASS
        assert decide(evidence(TOKENS, TOKENS, prefill_rel_error=prefill * 1.01), tol).verdict == Verdict.FAIL
        for step_gap, rank, verdict in (
            (gap, 4, Verdict.PASS),
            (gap * 1.01, 1, Verdict.FAIL),
            (gap / 2, 5, Verdict.FAIL),
        ):
            step = StepEvidence(step=5, accelerator_token=999, reference_token=5, gap=step_gap, rank=rank)
            assert decide(evidence(diverged(5), TOKENS, [step]), tol).verdict == verdict, (tol, step_gap, rank)
        # the slack decides a text with a far step (one with none is decided by its near ties): a sharded run whose
        # judge finds it fluent passes within it
        far = StepEvidence(step=5, accelerator_token=999, reference_token=5, gap=gap * 3, rank=1)
        for loss, verdict in ((slack * 0.99, Verdict.PASS), (slack * 1.01, Verdict.FAIL)):
            found = evidence(diverged(5), TOKENS, [far], accelerator_loglik=-2.0 - loss, reference_loglik=-2.0,
                             sharded=True, judge=judge(True, True))  # fmt: skip
            assert decide(found, tol).verdict == verdict


def test_any_tolerance_is_part_of_the_test_so_changing_it_makes_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 prefill tolerance went from 0.05 to 0.04 once without a new rule version: older verdicts counted as
    the same test. The tolerances are hashed into the test config (a job's identity) as they are."""
    before = {task: config_hash(task) for task in ("text-generation", "feature-extraction")}
    bf16 = Tolerances.for_dtype("bfloat16")
    monkeypatch.setattr(Tolerances, "for_dtype", classmethod(lambda cls, dtype: replace(bf16, prefill=0.05)))
    assert config_hash("text-generation") != before["text-generation"]
    monkeypatch.setitem(feature_extraction.SIMILARITY, "bfloat16", 0.98)
    assert config_hash("feature-extraction") != before["feature-extraction"]


def flip(step: int, layer: int, margin: float | None) -> RoutingFlip:
    return RoutingFlip(step=step, layer=layer, margin=margin)


def test_a_moe_prefill_error_is_excused_only_where_the_routing_really_flipped_at_a_near_tie() -> None:
    """bf16 flips a router choice the reference makes at a near tie: the prefill moves past its tolerance though
    nothing is wrong, and the run is decided by its tokens. A real MoE has a near tie somewhere at almost every
    position, so the tie alone excuses nothing: the accelerator's routing must differ from the reference's there.
    No flip, a flip at a clear margin, no recorded routing (a dense model), or an error past the routing cap: FAIL.
    And the flip must explain the error (version 5): the reference made to choose the accelerator's experts matches
    its prefill; a fault moves the hidden state, flips near ties with it, and its error stays when they are forced."""
    flipped = evidence(TOKENS, TOKENS, prefill_rel_error=0.098, routing_flips=[flip(-3, 5, 0.01)],
                       forced_prefill_rel_error=0.008)  # fmt: skip
    decision = decide(flipped, BF16)
    assert decision.verdict == Verdict.PASS and "routing flipped in the prompt" in decision.reason
    assert "layer 5 (step -3; margin <= 0.01)" in decision.reason  # where it flipped, as the row says
    assert "the reference made to choose the accelerator's experts differs by 0.008" in decision.reason
    unexplained = decide(replace(flipped, forced_prefill_rel_error=0.09), BF16)
    assert unexplained.verdict == Verdict.FAIL and "does not explain it" in unexplained.reason
    assert decide(replace(flipped, forced_prefill_rel_error=None), BF16).verdict == Verdict.FAIL  # none ran
    not_flipped = replace(flipped, routing_flips=[])  # the reference's ties are there; the run kept every choice
    assert decide(not_flipped, BF16).verdict == Verdict.FAIL
    clear = replace(flipped, routing_flips=[flip(-3, 5, 0.5)])
    assert decide(clear, BF16).verdict == Verdict.FAIL
    assert decide(replace(flipped, routing_flips=None), BF16).verdict == Verdict.FAIL
    gross = replace(flipped, comparison=flipped.comparison.model_copy(update={"prefill_rel_error": 0.9}))
    assert decide(gross, BF16).verdict == Verdict.FAIL  # a dropped layer is no flipped expert
    after_the_prefill = replace(flipped, routing_flips=[flip(2, 5, 0.01)])  # it cannot have moved the prefill
    assert decide(after_the_prefill, BF16).verdict == Verdict.FAIL


def test_a_moe_far_divergence_at_a_near_tie_layer_is_excused_only_where_the_routing_flipped() -> None:
    """A divergent step that is no near tie of the reference's tokens, at a position whose router margin is a near tie
    at some layer: excused only where the accelerator chose other experts there, by that step, at a near tie — the
    flips no earlier flip explains (a lower layer at or before that position); the reason names those layers. And the
    step must be a near tie of the reference made to choose the accelerator's experts (version 5): the flips explain
    the token, or something else made it."""
    step = StepEvidence(step=3, accelerator_token=999, reference_token=3, gap=1.14, rank=6, routing_margin=0.002,
                        forced_gap=0.0, forced_rank=0)  # fmt: skip
    far = evidence(diverged(3), TOKENS, [step], accelerator_loglik=-1.9, reference_loglik=-2.0, routing_flips=[])
    decision = decide(far, BF16)  # a near-tie margin at the step, but the routing did NOT flip: a fault's divergence
    assert decision.verdict == Verdict.FAIL and "not a near tie" in decision.reason
    # it flipped at layer 7 of step 3 (a near tie), and layers above followed at clear margins: its consequences
    flipped = replace(far, routing_flips=[flip(3, 7, 0.004), flip(3, 9, 0.8), flip(5, 12, 1.3)])
    decision = decide(flipped, BF16)
    assert decision.verdict == Verdict.PASS, decision.reason
    assert "routing flipped at near ties" in decision.reason and "layer 7 (step 3; margin <= 0.004)" in decision.reason
    assert "layer 9" not in decision.reason  # explained by layer 7's flip below it
    assert "with the accelerator's experts forced the reference nearly picks its token" in decision.reason
    # the counterfactual still ranks the token 6th, 1.1 nats away: the flips do not explain it
    unexplained = replace(flipped, divergent_steps=[replace(step, forced_gap=1.1, forced_rank=6)])
    assert decide(unexplained, BF16).verdict == Verdict.FAIL
    no_counterfactual = replace(flipped, divergent_steps=[replace(step, forced_gap=None, forced_rank=None)])
    assert decide(no_counterfactual, BF16).verdict == Verdict.FAIL
    implausible = replace(flipped, comparison=flipped.comparison.model_copy(update={"accelerator_loglik": -2.5}))
    assert decide(implausible, BF16).verdict == Verdict.FAIL  # the likelihood still decides
    later_flip = replace(far, routing_flips=[flip(4, 7, 0.004)])  # after the step: it cannot explain it
    assert decide(later_flip, BF16).verdict == Verdict.FAIL
    # an earlier position's flip at a lower layer at a clear margin is where the runs first parted: a fault's
    clear_root = replace(flipped, routing_flips=[flip(1, 2, 0.4), flip(3, 7, 0.004)])
    assert decide(clear_root, BF16).verdict == Verdict.FAIL
    # an earlier position's flip at a HIGHER layer explains nothing at a later position's lower layer: both are roots
    two_roots = replace(flipped, routing_flips=[flip(1, 20, 0.01), flip(3, 7, 0.004)])
    decision = decide(two_roots, BF16)
    assert decision.verdict == Verdict.PASS and "layer 7" in decision.reason and "layer 20" in decision.reason
    # every far step needs its flips: one before the routing parted is not excused by a later flip
    early = replace(step, step=1)
    assert decide(replace(flipped, divergent_steps=[early, step]), BF16).verdict == Verdict.FAIL


def test_a_decode_step_whose_logits_moved_fails_with_matching_tokens_and_a_moes_is_excused_only_by_its_flips() -> None:
    """Rule version 7: each decode step's logits are held to the dtype's decode tolerance as the prefill's are, so a
    fault of the decode alone (an off-by-one cache position) fails where every token still matches. A MoE's step past
    it passes only where the routing flipped at near ties by that step and the reference made to choose the
    accelerator's experts matches that step; step 0 is the prefill's, ruled on by its own tolerance."""
    steady = [0.01] * 32
    moved = [*steady[:9], 0.07, *steady[10:]]  # step 9 past bf16's 0.04
    assert decide(evidence(TOKENS, TOKENS, step_rel_errors=steady), BF16).verdict == Verdict.PASS
    decision = decide(evidence(TOKENS, TOKENS, step_rel_errors=moved), BF16)
    assert decision.verdict == Verdict.FAIL and "step 9's logits differ" in decision.reason, decision.reason
    assert decide(evidence(TOKENS, TOKENS, step_rel_errors=[0.07, *steady[1:]]), BF16).verdict == Verdict.PASS
    assert decide(evidence(TOKENS, TOKENS, step_rel_errors=[0.0, 2e-3, *[0.0] * 30]), FP32).verdict == Verdict.FAIL
    # a MoE: flipped at a near tie at step 9's position, and the counterfactual matches that step
    forced = [0.01] * 32
    moe = evidence(
        TOKENS, TOKENS, step_rel_errors=moved, routing_flips=[flip(9, 4, 0.1)], forced_step_rel_errors=forced
    )
    excused = decide(moe, BF16)
    assert excused.verdict == Verdict.PASS and "1 decode step(s) differ past the tolerance" in excused.reason
    assert "step 9 by 0.07" in excused.reason and "matches each (step 9 by 0.01)" in excused.reason, excused.reason
    # a step whose logits were not finite compares nothing here: rule 1 fails the run
    assert decide(evidence(TOKENS, TOKENS, step_rel_errors=[0.0, None, *steady[2:]]), BF16).verdict == Verdict.PASS
    assert decide(evidence(TOKENS, TOKENS, finite=False, step_rel_errors=[0.0, None]), BF16).verdict == Verdict.FAIL
    unexplained = replace(moe, forced_step_rel_errors=[*forced[:9], 0.06, *forced[10:]])
    assert "does not explain it" in decide(unexplained, BF16).reason
    for without in (
        replace(moe, forced_step_rel_errors=None),
        replace(moe, routing_flips=[flip(10, 4, 0.1)]),
        replace(moe, routing_flips=[flip(9, 4, 0.6)]),
        replace(moe, step_rel_errors=[*moved[:9], 0.5]),
    ):
        assert (
            decide(without, BF16).verdict == Verdict.FAIL
        )  # no counterfactual, a later flip, a clear one, past the cap


def test_a_moe_text_is_weighed_under_the_reference_made_to_choose_its_experts_too() -> None:
    """A benign bf16 run of a 24-layer, 64-expert Mixtral in the calibration: 142 flips, every root a near tie, a
    prefill error of 0.142 (under the routing cap) and text the reference, with its own routing, finds 0.68 nats less
    likely per token than its own text. With the accelerator's experts forced the reference matches its prefill
    (0.017) and its text is its own best picks (-3.78 a token either way): the routing explains it. A text
    implausible under both still FAILs, and so does one whose counterfactual does not match the prefill."""
    step = StepEvidence(
        step=0, accelerator_token=999, reference_token=0, gap=0.375, rank=1, forced_gap=0.0, forced_rank=0
    )
    flips = [flip(-10, 15, 0.004), flip(-8, 2, 0.0), flip(-5, 18, 0.04), flip(0, 11, 0.055)]
    run = evidence(diverged(0), TOKENS, [step], prefill_rel_error=0.142, accelerator_loglik=-3.807,
                   reference_loglik=-3.128, routing_flips=flips, forced_prefill_rel_error=0.017,
                   forced_accelerator_loglik=-3.78, forced_reference_loglik=-3.78)  # fmt: skip
    assert decide(run, BF16).verdict == Verdict.PASS, decide(run, BF16).reason
    unlikely = decide(replace(run, forced_reference_loglik=-3.3), BF16)
    assert unlikely.verdict == Verdict.FAIL and "with the accelerator's experts forced too: -3.780 vs -3.300" in (
        unlikely.reason
    )
    assert decide(replace(run, forced_prefill_rel_error=0.09), BF16).verdict == Verdict.FAIL
    assert decide(replace(run, forced_accelerator_loglik=None), BF16).verdict == Verdict.FAIL


def test_routing_roots_are_each_positions_lowest_flips() -> None:
    """A lower flip at the same position explains the flips above it; one at an earlier position explains nothing
    (rule version 4): each position's lowest flipped layer is a root."""
    flips = [flip(0, 4, 0.0), flip(0, 6, 0.9), flip(2, 4, 0.01), flip(2, 9, 0.3), flip(3, 1, 0.02), flip(5, 3, 0.5)]
    assert routing_roots(flips) == [flip(0, 4, 0.0), flip(2, 4, 0.01), flip(3, 1, 0.02), flip(5, 3, 0.5)]
    assert routing_roots([flip(1, 2, 0.01), flip(1, 2, 0.7), flip(1, 5, 0.9)]) == [flip(1, 2, 0.01), flip(1, 2, 0.7)]
    assert routing_roots([]) == []


def test_one_near_tie_low_in_the_prompt_explains_no_far_flip_at_another_position() -> None:
    """Version 3 let one near-tie root at layer 0 of an early prompt position explain every later flip at a higher
    layer: 414 flips far from any tie, a prefill error of 0.12 and a far divergent step (gap 5, rank 40) passed. Each
    of those positions' lowest flips is a root of its own now, far from a tie: nothing is excused."""
    lone_tie = [flip(-15, 0, 0.019)]
    spread = [flip(step, layer, 2.0) for step in range(-14, 4) for layer in range(1, 24)]  # 18 positions x 23 layers
    assert len(spread) == 414
    far = StepEvidence(step=3, accelerator_token=999, reference_token=3, gap=5.0, rank=40)
    run = evidence(diverged(3), TOKENS, [far], prefill_rel_error=0.12, routing_flips=lone_tie + spread)
    decision = decide(run, BF16)
    assert decision.verdict == Verdict.FAIL and "prefill logits differ" in decision.reason
    assert {root.step for root in routing_roots(lone_tie + spread)} == set(range(-15, 4))
    # the same run with its far flips at the root's own position: excused only where forcing the accelerator's
    # experts reproduces its prefill and its far step (version 5's counterfactual closes version 4's remaining gap)
    above = [flip(-15, layer, 2.0) for layer in range(1, 24)]
    explained = replace(far, forced_gap=0.0, forced_rank=0)
    tied = replace(run, routing_flips=lone_tie + above, divergent_steps=[explained], forced_prefill_rel_error=0.01)
    assert decide(tied, BF16).verdict == Verdict.PASS
    assert decide(replace(tied, forced_prefill_rel_error=0.11), BF16).verdict == Verdict.FAIL
    unexplained = replace(tied, divergent_steps=[replace(far, forced_gap=5.0, forced_rank=40)])
    assert decide(unexplained, BF16).verdict == Verdict.FAIL


def test_a_flips_margin_is_the_reference_gap_between_the_experts_that_swapped() -> None:
    """Not the reference's k-th minus (k+1)-th logit whatever was swapped: the accelerator dropped expert 2 (logit
    1.50) for expert 5 (1.49), a near tie, though the k-th/next gap (expert 3 at 1.80 vs 5) is 0.31. Several swapped:
    the largest gap. An expert brought in from outside the reference's top k+8, or no expert on a side: no near tie."""
    logits = {7: 2.4, 3: 1.8, 2: 1.5, 5: 1.49, 9: 1.2}  # the reference's recorded top logits (fewer here)
    assert flip_margin([3, 5, 7], [2, 3, 7], logits) == pytest.approx(0.01)
    assert flip_margin([5, 9, 7], [2, 3, 7], logits) == pytest.approx(1.8 - 1.2)  # 3 -> 9 is the largest gap
    assert flip_margin([3, 11, 7], [2, 3, 7], logits) is None  # 11: outside the top k+8
    assert flip_margin([-1, -1, -1], [2, 3, 7], logits) is None  # the accelerator's router did not run
    assert flip_margin([2, 3, 7], [-1, -1, -1], {-1: 0.0}) is None  # nor the reference's


def _routing(experts: list[list[list[int]]], top: list[list[list[float]]] | None = None, **ids: Any) -> Routing:
    return Routing(experts=experts, top_logits=top, prompt_positions=2, **ids)


def test_routing_flips_read_each_flip_at_its_own_experts_and_compare_nothing_that_does_not_line_up() -> None:
    """Two positions (the prompt's last is step 0), two layers, top-1 of 4 experts with the reference's top 3 logits."""
    reference = _routing([[[0], [1]], [[2], [3]]], [[[1.0, 0.99, 0.5], [2.0, 1.0, 0.0]], [[3.0, 2.0, 1.0]] * 2],
                         top_experts=[[[0, 1, 2], [1, 0, 2]], [[2, 0, 1], [3, 2, 1]]])  # fmt: skip
    assert routing_flips(_routing([[[0], [1]], [[2], [3]]]), reference) == []
    flips = routing_flips(_routing([[[1], [1]], [[2], [0]]]), reference)
    assert flips == [flip(-1, 0, pytest.approx(0.01)), flip(0, 1, None)]  # 0 -> 1 at a tie; 3 -> 0 outside
    assert routing_flips(_routing([[[-1], [1]], [[2], [3]]]), reference) == [flip(-1, 0, None)]
    # a record of other positions or layers, or a reference without router logits: nothing compared, nothing excused
    assert routing_flips(_routing([[[0], [1]]]), reference) is None
    assert routing_flips(_routing([[[0]], [[2]]]), reference) is None
    assert routing_flips(_routing([[[0], [1]], [[2], [3]]]), _routing(reference.experts)) is None
    no_expert = evidence(TOKENS, TOKENS, prefill_rel_error=0.098, routing_flips=[flip(-1, 0, None)])
    assert decide(no_expert, BF16).verdict == Verdict.FAIL


@pytest.mark.slow
def test_a_planted_fault_a_routing_near_tie_excused_before_fails_on_a_moe_at_a_real_router_shape(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """End to end (the runner CLI, bf16, one core): a 10 % scaled shard on a 6-layer, 64-expert Mixtral. Its reference
    routes the prompt at a near tie somewhere (as a real MoE does at almost every position) and its prefill error is
    under the routing cap, so rule version 2 excused it on the reference's margin. Its routing really flipped in the
    prompt, every root at a near tie (the fault moves the hidden state, so it flips choices rounding could flip too):
    version 4 excused it as well. The counterfactual FAILs it (version 5): forcing the accelerator's experts on the
    reference leaves the error past the tolerance — the routing does not explain it."""
    from testing.moe_fixtures import build
    from tests.test_runner import run_local

    checkpoint = build(tmp_path_factory.mktemp("moe"), "moe-mixtral-6x64", seed=0)
    code, report = run_local(
        checkpoint, SUPPORTMATRIX_CPU_DTYPE="bfloat16", SUPPORTMATRIX_CPU_FAULT="scale_shard_10pct"
    )
    assert code == 1 and report.verdict == Verdict.FAIL, report.verdict_reason
    numbers = report.comparison
    assert numbers.routing_margin is not None and numbers.routing_margin <= 0.05  # what version 2 read (its 0.05)...
    assert BF16.prefill < (numbers.prefill_rel_error or 0) <= BF16.routing_cap  # ...and excused
    prompt_roots = [root for root in numbers.evidence["routing_roots"] if root["step"] <= 0]
    # ...as version 4 did: the routing flipped in the prompt, every root a near tie
    assert prompt_roots and all(
        root["margin"] is not None and root["margin"] <= BF16.routing_tie for root in prompt_roots
    )
    assert "does not explain it" in (report.verdict_reason or ""), report.verdict_reason
    assert numbers.evidence["forced_prefill_rel_error"] > BF16.prefill
    assert report.resources.graphs_compiled == report.resources.backend_graphs == 2  # the recording broke no graph

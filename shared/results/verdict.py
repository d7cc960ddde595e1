"""The verdict from evidence: pure functions that tests call without a model.

The rule (``decide``), in order — the numeric rules first, so that no judge can pass NaN or implausible text:
1. Non-finite accelerator logits → FAIL.
2. The prefill logits (the prompt's last position) differ from the reference's by more than the dtype's
   tolerance, relative to the reference's norm → FAIL. Gross faults (a perturbed shard, a skipped
   all-reduce, a dropped layer) show here; thread counts and reduction orders do not. A MoE whose reference
   routes some prompt token at a near tie (a router margin bf16 can flip) is excused up to the routing cap: a
   flipped expert moves the prefill by more than the tolerance, and the run is decided by the rules below —
   with one change: a flipped expert at the prompt's end moves every later step's state, so the reference,
   scoring the accelerator's prefix with its own routing, cannot tell a near tie; a divergent step that is no
   near tie is excused there when the text is as likely as the reference's (rule 4 holds). So is one whose own
   position the reference routes at a near tie (the step's ``routing_margin``): a flip there moves that very step,
   the prefill untouched.
3. Every one of the 32 tokens matches → PASS (a sharded run's judge may still find the text not fluent).
4. The accelerator's text is implausible under the reference: its mean log-prob per token (raw logits,
   teacher-forced) is more than the dtype's slack below the reference's own text's → FAIL.
5. Every divergent step is a near tie: the accelerator's token is in the reference's top-k *processed*
   scores (what greedy picked from) with a gap under the dtype's tolerance — bf16 drift reorders near
   ties; a real fault does not → PASS.
6. Otherwise the numbers are inconclusive: a divergence that is no near tie, in text about as likely as
   the reference's. A sharded run with a judge that reads the text (local or openai) is decided by the
   judge: fluent, where the reference's text is too → PASS; not fluent → FAIL. Without one → FAIL.
   The likelihood judge reads only the numbers the rules above already weighed: it decides nothing here.
The judge also turns a sharded run's PASS into a FAIL when it finds the accelerator's text not fluent while
the reference's is (a random tiny model's text is fluent neither way: the judge is inconclusive there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.contracts.enums import LongOutcome, Verdict
from shared.contracts.evidence import Evidence, StepEvidence
from shared.contracts.report import LongGeneration
from shared.testconfig import LongTolerances, Tolerances


def _routing_tie(margin: float | None, tol: Tolerances) -> bool:
    return margin is not None and margin <= tol.routing_tie


def is_near_tie(step: StepEvidence, tol: Tolerances) -> bool:
    return step.rank < tol.top_k and step.gap <= tol.near_tie_gap


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    first_divergence: int | None


def first_divergence(generated: Sequence[int], reference: Sequence[int]) -> int | None:
    for i, (g, r) in enumerate(zip(generated, reference, strict=False)):
        if g != r:
            return i
    if len(generated) != len(reference):
        return min(len(generated), len(reference))
    return None


def decide(evidence: Evidence, tol: Tolerances) -> Decision:
    numbers = evidence.comparison
    divergence = first_divergence(numbers.generated_token_ids or [], numbers.reference_token_ids or [])
    prefill_error = numbers.prefill_rel_error or 0.0
    acc_loglik, ref_loglik = numbers.accelerator_loglik or 0.0, numbers.reference_loglik or 0.0

    def fail(reason: str) -> Decision:
        return Decision(Verdict.FAIL, reason, divergence)

    if not evidence.finite:
        return fail("the accelerator produced non-finite logits")
    routed = ""
    if prefill_error > tol.prefill:
        margin = numbers.routing_margin
        if margin is None or margin > tol.routing_tie or prefill_error > tol.routing_cap:
            return fail(
                f"prefill logits differ from the reference by {prefill_error:.3g} "
                f"(relative; tolerance {tol.prefill:.3g})"
            )
        routed = (
            f"; the prefill differs by {prefill_error:.3g} at a routing near-tie of the reference (router margin "
            f"{margin:.3g} <= {tol.routing_tie:.3g}), which bf16 can flip: decided by the tokens"
        )
    judge = evidence.judge if evidence.sharded else None
    if divergence is None:
        reason = "all 32 tokens match the reference"
    else:
        if acc_loglik < ref_loglik - tol.loglik_slack:
            return fail(
                f"the reference finds the accelerator's text implausible: {acc_loglik:.3f} "
                f"vs {ref_loglik:.3f} nats per token (slack {tol.loglik_slack:.3g})"
            )
        far_steps = [step for step in evidence.divergent_steps if not is_near_tie(step, tol)]
        far = far_steps[0] if far_steps else None
        if far is None:
            reason = f"tokens diverge from step {divergence}, every divergence a near tie"
        elif routed or all(_routing_tie(s.routing_margin, tol) for s in far_steps):
            where = "after the prompt's" if routed else "at each such step's own"
            reason = (
                f"tokens diverge from step {divergence} (step {far.step}: gap {far.gap:.3g} nats, rank {far.rank}), "
                f"{where} routing near-tie of the reference (router margin <= {tol.routing_tie:.3g}), which bf16 "
                f"can flip, in text as likely as the reference's ({acc_loglik:.3f} vs {ref_loglik:.3f} nats per token)"
            )
        else:
            reason = (
                f"step {far.step}: token {far.accelerator_token} is not a near tie of the reference's "
                f"{far.reference_token} (gap {far.gap:.3g} nats, rank {far.rank}; tolerance "
                f"{tol.near_tie_gap:.3g} within top-{tol.top_k})"
            )
            if judge is None or not judge.reads_text or judge.fluent is None or judge.reference_fluent is False:
                return fail(reason)
            if not judge.fluent:
                return fail(f"{reason}; the {judge.kind} judge finds the text not fluent: {judge.rationale}")
            return Decision(
                Verdict.PASS, f"{reason}, but the text is as likely as the reference's and the {judge.kind} judge "
                f"finds it fluent: {judge.rationale}{routed}", divergence
            )  # fmt: skip
    if judge is not None:
        if judge.fluent is False and judge.reference_fluent is not False:
            return fail(f"the {judge.kind} judge finds the sharded output not fluent: {judge.rationale}")
        reason += f"; {judge.kind} judge: {judge.rationale}"
    return Decision(Verdict.PASS, reason + routed, divergence)


def repetition(tokens: Sequence[int], n: int) -> float:
    """The share of ``tokens``' n-grams that already occurred earlier among them: 0 for varied text, near 1 for
    a loop."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams)


def long_outcome(
    generated: Sequence[int],
    reference: Sequence[int],
    generated_logprobs: Sequence[float],
    reference_logprobs: Sequence[float],
    finite: bool,
    tol: LongTolerances,
) -> LongGeneration:
    """The long-generation check, from the accelerator's tokens and the reference's (its own greedy run of the same
    length), the log-prob the reference gives each accelerator token on the accelerator's prefix, and its own
    tokens' log-probs. In order: a non-finite step; a collapse into repetition the reference does not show; a
    window whose tokens the reference finds implausible (more than ``loglik_drop`` nats each below its own text's:
    loss of agreement, not a late benign divergence, which stays as likely); else ok."""
    w = tol.window
    starts = range(0, min(len(generated), len(reference)), w)
    agreement = [
        sum(g == r for g, r in zip(generated[s : s + w], reference[s : s + w], strict=False))
        / len(generated[s : s + w])
        for s in starts
    ]
    drops = [
        sum(reference_logprobs[s : s + w]) / len(reference_logprobs[s : s + w])
        - sum(generated_logprobs[s : s + w]) / len(generated_logprobs[s : s + w])
        for s in starts
    ]
    ours, theirs = repetition(generated[-w:], tol.ngram), repetition(reference[-w:], tol.ngram)
    divergence = first_divergence(generated, reference)
    found = LongGeneration(
        long_new_tokens=len(generated), long_first_divergence=divergence, long_agreement=agreement,
        long_loglik_drop=drops, long_repetition=ours, long_reference_repetition=theirs,
    )  # fmt: skip
    worst = max(range(len(drops)), key=drops.__getitem__, default=None)
    if not finite:
        outcome, reason = LongOutcome.non_finite, "the accelerator produced non-finite logits in the long generation"
    elif ours > tol.repetition and ours - theirs > tol.repetition_margin:
        outcome = LongOutcome.collapsed
        reason = f"the last {w} tokens repeat {tol.ngram}-grams {ours:.0%} of the time (the reference: {theirs:.0%})"
    elif worst is not None and drops[worst] > tol.loglik_drop:
        outcome = LongOutcome.diverged
        reason = (
            f"tokens {worst * w}-{worst * w + w - 1} lose {drops[worst]:.2f} nats each against the reference's own "
            f"text (at most {tol.loglik_drop:g}): implausible under the reference from there"
        )
    elif divergence is None:
        outcome, reason = LongOutcome.ok, f"all {len(generated)} tokens match the reference"
    else:
        outcome = LongOutcome.ok
        reason = (
            f"diverges from the reference at step {divergence}, as plausible as its own text (the most a window "
            f"loses: {max(drops):.2f} nats per token)"
        )
    return found.model_copy(update={"long_generation": outcome, "long_reason": reason})

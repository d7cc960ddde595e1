"""The verdict from evidence: pure functions that tests call without a model.

The rule (``decide``), in order — the numeric rules first, so that no judge can pass NaN or implausible text:
1. Non-finite accelerator logits → FAIL.
2. The prefill logits (the prompt's last position) differ from the reference's by more than the dtype's
   tolerance, relative to the reference's norm → FAIL. Gross faults (a perturbed shard, a skipped
   all-reduce, a dropped layer) show here; thread counts and reduction orders do not. A MoE whose routing really
   flipped in the prompt, at a near tie, is excused up to the routing cap and decided by the rules below: the
   accelerator records the experts it chose at each position and layer, the reference its own on the same prefix
   with its top k+8 router logits, each flip's margin is the reference's gap between the experts that swapped
   (``routing_flips``), and each position's lowest flips (``routing_roots``: a lower flip at the same position
   explains the ones above it) must all be near ties (a margin of at most ``routing_tie``) that a rounding can flip.
   And the flips must explain the error (the counterfactual, rule version 5): the reference re-run with the
   accelerator's experts forced at every position must match the accelerator's prefill within the dtype's
   tolerance. A flip at a clear margin is a fault's; a fault that moves the hidden state flips near ties too, but
   forcing its experts leaves its error in place; no flip, no excuse.
   Each decode step's logits are held to the same (rule version 7), at the reference's top ``DECODE_TOP`` logits on the
   accelerator's prefix (teacher-forced, so a divergence does not move them): a fault of the decode alone — a cache
   position off by one — moves them while the 32 tokens still match. A MoE's step past the tolerance is excused up to
   the routing cap where the routing flipped at near ties by that step and the counterfactual's step matches.
3. Every one of the 32 tokens matches → PASS (a sharded run's judge may still find the text not fluent).
4. The accelerator's text is implausible under the reference: its mean log-prob per token (raw logits,
   teacher-forced) is more than the dtype's slack below the reference's own text's, and some divergent step is no
   near tie → FAIL. Where every divergence is a near tie, the text is the reference's own greedy text of its prefix
   up to those ties, however less likely its path is: rule 5 decides it (rule version 8). A MoE whose flips the
   counterfactual explains (rule 2's sense, over the whole run) is weighed under the counterfactual too, against the
   counterfactual's own best pick at each step of the same prefix: plausible there, it is not implausible.
5. Every divergent step is a near tie: the accelerator's token is in the reference's top-k *processed*
   scores (what greedy picked from) with a gap under the dtype's tolerance — bf16 drift reorders near
   ties; a real fault does not → PASS. A MoE's divergent step that is no near tie passes too where the routing
   flipped at near ties by then (the roots of the flips up to that step, as in rule 2): a flipped expert moves the
   step's state, and the reference, scoring the accelerator's prefix with its own routing, cannot see a near tie
   there — so the step must be a near tie of the reference re-run with the accelerator's experts forced; the reason
   names the layers that flipped.
6. Otherwise the numbers are inconclusive: a divergence that is no near tie, in text about as likely as
   the reference's. A sharded run with a judge that reads the text (local or openai) is decided by the
   judge: fluent, where the reference's text is too → PASS; not fluent → FAIL. Without one → FAIL.
   The likelihood judge reads only the numbers the rules above already weighed: it decides nothing here.
The judge also turns a sharded run's PASS into a FAIL when it finds the accelerator's text not fluent while
the reference's is (a random tiny model's text is fluent neither way: the judge is inconclusive there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared.contracts.enums import LongOutcome, Verdict
from shared.contracts.evidence import Evidence, RoutingFlip, StepEvidence
from shared.contracts.handoffs import Routing
from shared.contracts.report import LongGeneration
from tasks.text_generation import DECODE_TOP, LongTolerances, Tolerances


def flip_margin(chosen: Sequence[int], expected: Sequence[int], logits: dict[int, float]) -> float | None:
    """How close the reference came to the accelerator's choice at one router: the reference's logit of an expert the
    accelerator dropped minus that of one it added, the largest such gap over the experts swapped (the rounding that
    flips the choice must close every gap it swaps across). ``logits``: the reference's top k+8 router logits by
    expert. No near tie (None): no expert on either side (a router that did not run), or an added expert outside the
    reference's top k+8."""
    dropped, added = set(expected) - set(chosen), set(chosen) - set(expected)
    if -1 in dropped | added or not dropped or not added or any(e not in logits for e in dropped | added):
        return None
    return max(logits[d] for d in dropped) - min(logits[a] for a in added)


def routing_flips(accelerator: Routing, reference: Routing) -> list[RoutingFlip] | None:
    """Every position and layer where the accelerator's experts differ from the reference's on the same prefix, each
    with the margin of the choice that flipped (``flip_margin``). A choice is a set (the order of the k experts
    changes nothing the layer computes). None — nothing compared, so nothing excused — when the two records do not
    cover the same positions and layers, or the reference kept no router logits."""
    if reference.top_logits is None or reference.top_experts is None:
        return None
    rows = (accelerator.experts, reference.experts, reference.top_logits, reference.top_experts)
    if accelerator.prompt_positions != reference.prompt_positions or len({len(r) for r in rows}) != 1:
        return None
    last_prompt = reference.prompt_positions - 1
    flips = []
    for position, (ours, theirs, logits, experts) in enumerate(zip(*rows, strict=True)):
        if len({len(ours), len(theirs), len(logits), len(experts)}) != 1:
            return None
        for layer, (chosen, expected, top, ids) in enumerate(zip(ours, theirs, logits, experts, strict=True)):
            if set(chosen) != set(expected):
                margin = flip_margin(chosen, expected, dict(zip(ids, top, strict=True)))
                flips.append(RoutingFlip(step=position - last_prompt, layer=layer, margin=margin))
    return flips


def routing_roots(flips: Sequence[RoutingFlip]) -> list[RoutingFlip]:
    """The flips no other flip explains: at each position, the flips at its lowest flipped layer. A flip at a lower
    layer at the same position explains the flips above it (its expert's output is what they read). A flip at an
    earlier position explains nothing here (rule version 4): its effect reaches this position only through attention,
    diluted, and counting it let one near tie low in the prompt explain every later flip, a fault's included. So each
    position's lowest flip must itself sit at a near tie for an excuse. What this still lets through: flips above a
    near-tie root at the same position are excused whatever their margin; the counterfactual (the reference re-run
    with the accelerator's experts, ``Evidence.forced_prefill_rel_error`` and each step's ``forced_gap``) checks that
    what they changed is all that differs."""
    roots: list[RoutingFlip] = []
    for step in sorted({f.step for f in flips}):
        here = [f for f in flips if f.step == step]
        layer = min(f.layer for f in here)
        roots += [f for f in here if f.layer == layer]
    return roots


def flipped_at_near_ties(evidence: Evidence, step: int, tol: Tolerances) -> list[RoutingFlip] | None:
    """The routing flips that excuse what happened by ``step`` (0: the prefill), when they do: the roots of the flips
    at the positions up to that step's, every one at a near tie of the reference's routing. None when the run
    recorded no routing, when nothing flipped by then, or when a root flipped a choice no rounding reaches."""
    roots = routing_roots([f for f in evidence.routing_flips or () if f.step <= step])
    if roots and all(f.margin is not None and f.margin <= tol.routing_tie for f in roots):
        return roots
    return None


def routing_explains(evidence: Evidence, step: int, tol: Tolerances) -> bool:
    """The routing flipped at near ties by ``step`` (``flipped_at_near_ties``), and the reference made to choose the
    accelerator's experts matches its prefill within the dtype's tolerance (the counterfactual)."""
    forced = evidence.forced_prefill_rel_error
    return forced is not None and forced <= tol.prefill and flipped_at_near_ties(evidence, step, tol) is not None


def _flips(roots: Sequence[RoutingFlip]) -> str:
    """Where the routing flipped, as a reader of the row wants it: each layer, the steps there and the margins."""
    layers = sorted({f.layer for f in roots})
    parts = []
    for layer in layers:
        at = [f for f in roots if f.layer == layer]
        steps = ", ".join(f"{f.step}" for f in at)
        margin = max(math.inf if f.margin is None else f.margin for f in at)
        parts.append(f"layer {layer} (step {steps}; margin <= {margin:.3g})")
    return "; ".join(parts)


def _near_tie(gap: float, rank: int, tol: Tolerances) -> bool:
    return rank < tol.top_k and gap <= tol.near_tie_gap


def is_near_tie(step: StepEvidence, tol: Tolerances) -> bool:
    """The accelerator's token is one the reference nearly picked: in its top k, within the dtype's gap."""
    return _near_tie(step.gap, step.rank, tol)


def implausible_text(accelerator_loglik: float, reference_loglik: float, steps: Sequence[StepEvidence],
                     tol: Tolerances) -> bool:  # fmt: skip
    """Rule 4 without the counterfactual: less likely than the reference's own text by more than the slack, where some
    divergent step is no near tie. A text whose every divergence is a near tie is the reference's own greedy text of
    its prefix up to those ties (each within ``near_tie_gap`` of the reference's pick in the processed scores greedy
    chose from, which is no more than the slack): its likelihood is its path's, not an error's (rule version 8). What
    such a text is still held to: rule 5's near ties, and on every step rule 2's decode check."""
    far = not all(is_near_tie(step, tol) for step in steps)
    return far and accelerator_loglik < reference_loglik - tol.loglik_slack


def explained_by_routing(step: StepEvidence, tol: Tolerances) -> bool:
    """With the accelerator's experts forced (the counterfactual), the reference nearly picks the accelerator's token:
    the routing that flipped is what moved this step. No counterfactual ran: nothing explained."""
    if step.forced_gap is None or step.forced_rank is None:
        return False
    return _near_tie(step.forced_gap, step.forced_rank, tol)


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
        prompt_flips = flipped_at_near_ties(evidence, 0, tol)
        forced_error = evidence.forced_prefill_rel_error
        differ = (
            f"prefill logits differ from the reference by {prefill_error:.3g} (relative; tolerance {tol.prefill:.3g})"
        )
        if prompt_flips is None or prefill_error > tol.routing_cap or forced_error is None:
            return fail(differ)
        if not routing_explains(evidence, 0, tol):
            return fail(
                f"{differ}, and by {forced_error:.3g} from the reference made to choose the accelerator's experts: the "
                f"routing that flipped in the prompt ({_flips(prompt_flips)}) does not explain it"
            )
        routed = (
            f"; the prefill differs by {prefill_error:.3g} where the routing flipped in the prompt at near ties of "
            f"the reference (router margin <= {tol.routing_tie:.3g}), which bf16 can flip: {_flips(prompt_flips)}; "
            f"the reference made to choose the accelerator's experts differs by {forced_error:.3g}; decided by the "
            "tokens"
        )
    moved, decode_excused = _decode_moved(evidence, tol)
    if moved is not None:
        return fail(moved)
    routed += decode_excused
    judge = evidence.judge if evidence.sharded else None
    if divergence is None:
        reason = "all 32 tokens match the reference"
    else:
        # A MoE whose routing flipped at near ties, where forcing the accelerator's experts reproduces its prefill: the
        # reference so routed is as much the model as the reference itself, and the text is weighed under it too,
        # against its own best pick at each step of the same prefix
        routed_text, routed_best = evidence.forced_accelerator_loglik, evidence.forced_reference_loglik
        every_flip = max((flip.step for flip in evidence.routing_flips or ()), default=0)
        implausible, weighed = implausible_text(acc_loglik, ref_loglik, evidence.divergent_steps, tol), ""
        if routed_text is not None and routed_best is not None and routing_explains(evidence, every_flip, tol):
            implausible = implausible and routed_text < routed_best - tol.loglik_slack
            weighed = f"; with the accelerator's experts forced too: {routed_text:.3f} vs {routed_best:.3f}"
        if implausible:
            return fail(
                f"the reference finds the accelerator's text implausible: {acc_loglik:.3f} "
                f"vs {ref_loglik:.3f} nats per token (slack {tol.loglik_slack:.3g}){weighed}"
            )
        far_steps = [step for step in evidence.divergent_steps if not is_near_tie(step, tol)]
        far = far_steps[0] if far_steps else None
        # each far step is excused only where the routing flipped at near ties by then (the last one's flips hold all)
        # and the reference made to choose the accelerator's experts nearly picks the accelerator's token there
        excuses = [flipped_at_near_ties(evidence, step.step, tol) for step in far_steps]
        explained = all(explained_by_routing(step, tol) for step in far_steps)
        flipped = excuses[-1] if excuses and all(excuses) and explained else None
        if far is None:
            reason = f"tokens diverge from step {divergence}, every divergence a near tie"
        elif flipped is not None:
            reason = (
                f"tokens diverge from step {divergence} (step {far.step}: gap {far.gap:.3g} nats, rank {far.rank}) "
                f"after the routing flipped at near ties of the reference (router margin <= {tol.routing_tie:.3g}), "
                f"which bf16 can flip: {_flips(flipped)}; with the accelerator's experts forced the reference nearly "
                f"picks its token there (gap {far.forced_gap:.3g} nats, rank {far.forced_rank}); in text as likely as "
                f"the reference's ({acc_loglik:.3f} vs {ref_loglik:.3f} nats per token)"
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


def _decode_moved(evidence: Evidence, tol: Tolerances) -> tuple[str | None, str]:
    """Why a decode step's logits fail the run (rule 2, version 7), or None; and what the reason says of the MoE steps
    it excused. Each step past the prefill is within ``tol.decode`` of the reference's on the same prefix, or a MoE's
    step is excused, up to the routing cap, by routing that flipped at near ties by then where the counterfactual's
    step is within the tolerance. A step whose logits were not finite (None) is rule 1's."""
    forced, excused = evidence.forced_step_rel_errors, []
    for step, error in enumerate(evidence.step_rel_errors or ()):
        if step == 0 or error is None or error <= tol.decode:  # step 0 is the prefill, ruled on above
            continue
        flips = flipped_at_near_ties(evidence, step, tol)
        forced_error = forced[step] if forced is not None and step < len(forced) else None
        differ = (
            f"step {step}'s logits differ from the reference's on the same prefix by {error:.3g} (relative, at its top "
            f"{DECODE_TOP}; tolerance {tol.decode:.3g})"
        )
        if flips is None or forced_error is None or error > tol.routing_cap:
            return differ, ""
        if forced_error > tol.decode:
            return (
                f"{differ}, and by {forced_error:.3g} from the reference made to choose the accelerator's experts: the "
                f"routing that flipped by then ({_flips(flips)}) does not explain it"
            ), ""
        excused.append((step, error, forced_error))
    if not excused:
        return None, ""
    worst = max(excused, key=lambda found: found[1])
    return None, (
        f"; {len(excused)} decode step(s) differ past the tolerance ({tol.decode:.3g}; step {worst[0]} by "
        f"{worst[1]:.3g}) where the routing flipped at near ties by then, and the reference made to choose the "
        f"accelerator's experts matches each (step {worst[0]} by {worst[2]:.3g})"
    )


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

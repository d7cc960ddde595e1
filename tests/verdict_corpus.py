"""The verdict rule's golden corpus: evidence cases, each with the outcome the rule gave it when the corpus was
written, under the ``VERDICT_RULE_VERSION`` it records. ``tests/test_verdict_corpus.py`` decides every case again:
an outcome that moved while the version stayed is a change of the rule's logic that no row's identity shows.

A case holds its evidence and the tolerances it was decided with, as they were: a threshold changed in its task's
declaration (``tasks/text_generation/__init__.py``) is a new test by its hash already, and moves no case here. What
the cases pin is the logic - which rule fires, in which order, with which excuses.

``python -m tests.verdict_corpus`` writes the corpus afresh from the grid below and the rule as it is now: run it
after raising ``VERDICT_RULE_VERSION``, and read the diff of ``tests/data/verdict_corpus.json``'s outcomes before
committing it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from shared.contracts.evidence import Evidence, JudgeOutcome, RoutingFlip, StepEvidence
from shared.contracts.report import Comparison, JudgeAudit
from tasks.declaration import DTYPES
from tasks.text_generation import NEW_TOKENS, VERDICT_RULE_VERSION, LongTolerances, Tolerances
from tasks.text_generation.verdict import decide, long_outcome

CORPUS = Path(__file__).parent / "data" / "verdict_corpus.json"
REFERENCE = list(range(100, 100 + NEW_TOKENS))


class DecideCase(BaseModel):
    """One call of ``decide``: its evidence, its dtype's tolerances (the corpus's), and the outcome it had."""

    name: str
    dtype: str
    comparison: dict[str, Any]  # but the tokens: the reference's are REFERENCE, the accelerator's differ at its steps
    divergent_steps: list[dict[str, Any]]
    finite: bool
    sharded: bool
    judge: dict[str, Any] | None
    routing_flips: list[dict[str, Any]] | None = None  # a MoE's recorded flips (None: no routing recorded)
    forced_prefill_rel_error: float | None = None  # a MoE's counterfactual (None: it did not run)
    forced_accelerator_loglik: float | None = None
    forced_reference_loglik: float | None = None
    step_rel_errors: list[float] | None = None  # each step's logits against the reference's (None: not compared)
    forced_step_rel_errors: list[float] | None = None  # and against the counterfactual's
    verdict: str
    first_divergence: int | None

    def evidence(self) -> Evidence:
        judge = None
        if self.judge is not None:
            audit = JudgeAudit(**self.judge["audit"])
            judge = JudgeOutcome(audit, self.judge["fluent"], self.judge["reference_fluent"])
        steps = [StepEvidence(**step) for step in self.divergent_steps]
        generated = list(REFERENCE)
        for step in steps:
            generated[step.step] = step.accelerator_token
        comparison = Comparison(**self.comparison, generated_token_ids=generated, reference_token_ids=REFERENCE)
        flips = None if self.routing_flips is None else [RoutingFlip(**flip) for flip in self.routing_flips]
        return Evidence(comparison, steps, self.finite, self.sharded, judge, routing_flips=flips,
                        step_rel_errors=self.step_rel_errors, forced_prefill_rel_error=self.forced_prefill_rel_error,
                        forced_step_rel_errors=self.forced_step_rel_errors,
                        forced_accelerator_loglik=self.forced_accelerator_loglik,
                        forced_reference_loglik=self.forced_reference_loglik)  # fmt: skip

    def decided(self, tolerances: Tolerances) -> tuple[str, int | None]:
        decision = decide(self.evidence(), tolerances)
        return decision.verdict.value, decision.first_divergence


class LongCase(BaseModel):
    """One call of ``long_outcome``: its tokens and log-probs, its tolerances, and the outcome it had."""

    name: str
    tolerances: dict[str, Any]
    generated: list[int]
    reference: list[int]
    generated_logprobs: list[float]
    reference_logprobs: list[float]
    finite: bool
    outcome: str
    first_divergence: int | None

    def decided(self) -> tuple[str, int | None]:
        found = long_outcome(self.generated, self.reference, self.generated_logprobs, self.reference_logprobs,
                             self.finite, LongTolerances(**self.tolerances))  # fmt: skip
        assert found.long_generation is not None
        return found.long_generation.value, found.long_first_divergence


class Corpus(BaseModel):
    rule: int  # the VERDICT_RULE_VERSION the outcomes were decided under
    tolerances: dict[str, dict[str, Any]]  # per dtype, as they were
    decide: list[DecideCase]
    long: list[LongCase]

    def tolerances_of(self, case: DecideCase) -> Tolerances:
        return Tolerances(**self.tolerances[case.dtype])


def _judges() -> Iterator[tuple[str, dict[str, Any] | None]]:
    """The judges a sharded run may have had: none, the likelihood one, and a text-reading one's answers."""
    yield "no judge", None
    yield "likelihood judge", {"audit": {"judge_kind": "likelihood", "judge_rationale": "r"}, "fluent": True,
                               "reference_fluent": True}  # fmt: skip
    for fluent, reference_fluent in [(True, True), (False, True), (None, True), (True, False), (False, None)]:
        audit = {"judge_kind": "local", "judge_model": "m", "judge_rationale": "r"}
        yield (
            f"local judge fluent={fluent} reference_fluent={reference_fluent}",
            {"audit": audit, "fluent": fluent, "reference_fluent": reference_fluent},
        )


def _divergences(tol: Tolerances) -> Iterator[tuple[str, list[StepEvidence]]]:
    """Divergent steps at step 5 (and 9), as the reference scores them: near ties or not, at a routing tie or not."""
    near, far = dict(gap=tol.near_tie_gap / 2, rank=1), dict(gap=tol.near_tie_gap * 4 + 1, rank=tol.top_k + 2)
    tie, untied = tol.routing_tie / 2, tol.routing_tie * 4 + 0.1
    yield "no divergence", []
    yield "a near tie", [StepEvidence(5, 7, REFERENCE[5], **near)]
    yield "a near tie out of the top k", [StepEvidence(5, 7, REFERENCE[5], gap=tol.near_tie_gap / 2, rank=tol.top_k)]
    yield "a far step", [StepEvidence(5, 7, REFERENCE[5], **far)]
    yield "a far step at its own routing tie", [StepEvidence(5, 7, REFERENCE[5], **far, routing_margin=tie)]
    yield "a far step routed far from a tie", [StepEvidence(5, 7, REFERENCE[5], **far, routing_margin=untied)]
    yield (
        "a near tie, then a far step at its routing tie and one that is not",
        [StepEvidence(5, 7, REFERENCE[5], **near), StepEvidence(9, 8, REFERENCE[9], **far, routing_margin=tie),
         StepEvidence(12, 9, REFERENCE[12], **far, routing_margin=untied)],
    )  # fmt: skip


def decide_cases() -> Iterator[DecideCase]:
    for dtype in DTYPES:
        tol = Tolerances.for_dtype(dtype)
        prefills = {"prefill within tolerance": tol.prefill / 2, "prefill past tolerance": tol.prefill * 2,
                    "prefill past the routing cap": max(tol.prefill, tol.routing_cap) * 3}  # fmt: skip
        margins = {"no router": None, "a routing tie at the prompt": tol.routing_tie / 2,
                   "routed far from a tie": tol.routing_tie * 4 + 0.1}  # fmt: skip
        likelihoods = {"as likely": 0.0, "a little less likely": tol.loglik_slack / 2,
                       "implausible": tol.loglik_slack * 2 + 0.1}  # fmt: skip
        grid = itertools.product(prefills.items(), margins.items(), _divergences(tol), likelihoods.items())
        for (prefill_name, prefill), (margin_name, margin), (steps_name, steps), (loglik_name, loss) in grid:
            comparison = Comparison(prefill_rel_error=prefill, reference_loglik=-2.0, accelerator_loglik=-2.0 - loss,
                                    routing_margin=margin)  # fmt: skip
            placements = [("unsharded", False, None)] + [("sharded, " + name, True, judge) for name, judge in _judges()]
            for placement, sharded, judge in placements:
                yield DecideCase(
                    name=f"{prefill_name}, {margin_name}, {steps_name}, {loglik_name}, {placement}", dtype=dtype,
                    comparison=comparison.model_dump(exclude_none=True),
                    divergent_steps=[dataclasses.asdict(step) for step in steps], finite=True, sharded=sharded,
                    judge=judge, verdict="", first_divergence=None,
                )  # fmt: skip
        non_finite = Comparison(prefill_rel_error=0.0)
        yield DecideCase(name="non-finite logits, every token matching", dtype=dtype,
                         comparison=non_finite.model_dump(exclude_none=True), divergent_steps=[], finite=False,
                         sharded=False, judge=None, verdict="", first_divergence=None)  # fmt: skip


def _routings(tol: Tolerances) -> Iterator[tuple[str, list[RoutingFlip] | None]]:
    """What a MoE run's recorded routing can say against the reference's: nothing recorded, no flip, a root flip at a
    near tie or far from one, before the divergent steps (at 5) or only after, a clear earlier root under a tie; a
    flip against no expert or to an expert outside the reference's top k+8 (margin None); one near tie low in the
    prompt beside far flips at higher layers of later positions (each position's lowest flip is a root)."""
    tie, untied = tol.routing_tie / 2, tol.routing_tie * 4 + 0.4
    yield "no routing recorded", None
    yield "no flip", []
    yield "a root flip at a near tie in the prompt", [RoutingFlip(-3, 5, tie), RoutingFlip(-2, 9, 1.3)]
    yield "a root flip far from a tie in the prompt", [RoutingFlip(-3, 5, untied)]
    yield "a root flip at a near tie at the divergent step", [RoutingFlip(5, 7, tie), RoutingFlip(5, 9, 0.8)]
    yield "a flip only after the divergent step", [RoutingFlip(6, 7, tie)]
    yield "a clear earlier root, then a flip at a near tie", [RoutingFlip(1, 2, untied), RoutingFlip(5, 7, tie)]
    yield "a flip against no expert in the prompt", [RoutingFlip(-3, 5, None)]
    yield (
        "a near tie, then a flip to an expert outside the top k+8",
        [RoutingFlip(-3, 5, tie), RoutingFlip(2, 9, None)],
    )
    yield "a far flip above a near tie at its position", [RoutingFlip(-3, 0, tie), RoutingFlip(-3, 9, untied)]
    yield (
        "one near tie low in the prompt, far flips above it later",
        [RoutingFlip(-15, 0, tie), *(RoutingFlip(step, layer, untied) for step in (-10, -2, 5) for layer in (1, 12))],
    )


def _counterfactuals(
    numbers: Comparison, steps: list[StepEvidence]
) -> Iterator[tuple[str, float | None, tuple[float | None, float | None] | None, list[StepEvidence]]]:
    """What the reference re-run with the accelerator's experts forced can say (rule version 5): it did not run, it
    reproduces the accelerator (its prefill within a hair, each divergent step its own pick, the text as likely as the
    reference's own), or it changes nothing. Each: its prefill error, the text's likelihood and its own best picks'
    under it, the steps."""
    prefill, loglik = numbers.prefill_rel_error or 0.0, numbers.accelerator_loglik
    explained = [dataclasses.replace(step, forced_gap=0.0, forced_rank=0) for step in steps]
    unchanged = [dataclasses.replace(step, forced_gap=step.gap, forced_rank=step.rank) for step in steps]
    yield "no counterfactual", None, None, steps
    yield "the counterfactual explains it", prefill / 100, (loglik, loglik), explained
    yield "the counterfactual changes nothing", prefill, (loglik, numbers.reference_loglik), unchanged


def moe_cases() -> Iterator[DecideCase]:
    """A MoE's runs: the recorded routing flips beside the reference's router margins, and the counterfactual."""
    for dtype in DTYPES:
        tol = Tolerances.for_dtype(dtype)
        prefills = {"prefill within tolerance": tol.prefill / 2, "prefill past tolerance": tol.prefill * 2,
                    "prefill past the routing cap": max(tol.prefill, tol.routing_cap) * 3}  # fmt: skip
        likelihoods = {"as likely": 0.0, "implausible": tol.loglik_slack * 2 + 0.1}
        grid = itertools.product(prefills.items(), _routings(tol), _divergences(tol), likelihoods.items())
        for (prefill_name, prefill), (routing_name, flips), (steps_name, steps), (loglik_name, loss) in grid:
            comparison = Comparison(prefill_rel_error=prefill, reference_loglik=-2.0, accelerator_loglik=-2.0 - loss,
                                    routing_margin=tol.routing_tie / 2)  # fmt: skip
            for forced_name, forced_prefill, forced_loglik, forced_steps in _counterfactuals(comparison, steps):
                for placement, sharded in [("unsharded", False), ("sharded, no judge", True)]:
                    yield DecideCase(
                        name=f"MoE: {prefill_name}, {routing_name}, {steps_name}, {loglik_name}, {forced_name}, "
                        f"{placement}", dtype=dtype, comparison=comparison.model_dump(exclude_none=True),
                        divergent_steps=[dataclasses.asdict(step) for step in forced_steps], finite=True,
                        sharded=sharded, judge=None, verdict="", first_divergence=None,
                        routing_flips=None if flips is None else [dataclasses.asdict(flip) for flip in flips],
                        forced_prefill_rel_error=forced_prefill,
                        forced_accelerator_loglik=None if forced_loglik is None else forced_loglik[0],
                        forced_reference_loglik=None if forced_loglik is None else forced_loglik[1],
                    )  # fmt: skip


def decode_cases() -> Iterator[DecideCase]:
    """Each decode step's logits (rule version 7): within the decode tolerance, one step (9) past it, past the routing
    cap; with every token matching or a near tie at step 5; a dense run or a MoE whose routing flipped at a near tie by
    that step, only after it, or at a clear margin; the counterfactual's step matching, unchanged, or not run."""
    for dtype in DTYPES:
        tol = Tolerances.for_dtype(dtype)
        within = [tol.decode / 2] * NEW_TOKENS

        def moved(error: float, within: list[float] = within) -> list[float]:
            return [*within[:9], error, *within[10:]]

        errors = {"steps within the decode tolerance": within, "a step past it": moved(tol.decode * 2),
                  "a step past the routing cap": moved(max(tol.decode, tol.routing_cap) * 3)}  # fmt: skip
        tie, untied = tol.routing_tie / 2, tol.routing_tie * 4 + 0.4
        routings = {"dense": None, "a near-tie flip by that step": [RoutingFlip(8, 3, tie)],
                    "a near-tie flip only after it": [RoutingFlip(11, 3, tie)],
                    "a clear flip by that step": [RoutingFlip(8, 3, untied)]}  # fmt: skip
        near = StepEvidence(5, 7, REFERENCE[5], gap=tol.near_tie_gap / 2, rank=1, forced_gap=0.0, forced_rank=0)
        tokens = {"every token matching": [], "a near tie at step 5": [near]}
        grid = itertools.product(errors.items(), routings.items(), tokens.items())
        for (errors_name, step_errors), (routing_name, flips), (tokens_name, steps) in grid:
            counterfactuals = {"no counterfactual": None, "the counterfactual's step matching": within,
                               "the counterfactual's step unchanged": step_errors}  # fmt: skip
            for forced_name, forced in counterfactuals.items():
                comparison = Comparison(prefill_rel_error=tol.prefill / 2, reference_loglik=-2.0,
                                        accelerator_loglik=-2.0)  # fmt: skip
                yield DecideCase(
                    name=f"decode: {errors_name}, {routing_name}, {tokens_name}, {forced_name}", dtype=dtype,
                    comparison=comparison.model_dump(exclude_none=True),
                    divergent_steps=[dataclasses.asdict(step) for step in steps], finite=True, sharded=False,
                    judge=None, verdict="", first_divergence=None,
                    routing_flips=None if flips is None else [dataclasses.asdict(flip) for flip in flips],
                    step_rel_errors=step_errors, forced_step_rel_errors=None if flips is None else forced,
                )  # fmt: skip


def long_cases() -> Iterator[LongCase]:
    tol = LongTolerances()
    n = 4 * tol.window
    reference = [1000 + i for i in range(n)]
    reference_logprobs = [-1.5] * n
    early = reference_logprobs[: 3 * tol.window]
    late = [*reference[: 3 * tol.window], *(2000 + i for i in range(tol.window))]
    looping = [*reference[: 3 * tol.window], *([7, 8, 9, 10] * (tol.window // 4))]
    texts = {
        "all matching": (reference, reference_logprobs),
        "a late divergence as likely": (late, reference_logprobs),
        "a late divergence a little less likely": (late, [*early, *[-1.5 - tol.loglik_drop / 2] * tol.window]),
        "a late window implausible": (late, [*early, *[-1.5 - tol.loglik_drop * 2] * tol.window]),
        "an early window implausible": ([5000 + i for i in range(n)], [-1.5 - tol.loglik_drop * 2] * n),
        "a collapse into repetition": (looping, reference_logprobs),
    }  # fmt: skip
    for (name, (generated, logprobs)), finite in itertools.product(texts.items(), (True, False)):
        yield LongCase(
            name=f"{name}{'' if finite else ', non-finite'}", tolerances=dataclasses.asdict(tol), generated=generated,
            reference=reference, generated_logprobs=logprobs, reference_logprobs=reference_logprobs, finite=finite,
            outcome="", first_divergence=None,
        )  # fmt: skip


def written_now() -> Corpus:
    """The corpus from the grid, each case's outcome as the rule decides it now."""
    tolerances = {dtype: dataclasses.asdict(Tolerances.for_dtype(dtype)) for dtype in DTYPES}
    decided: list[DecideCase] = []
    for case in itertools.chain(decide_cases(), moe_cases(), decode_cases()):
        verdict, divergence = case.decided(Tolerances(**tolerances[case.dtype]))
        decided.append(case.model_copy(update={"verdict": verdict, "first_divergence": divergence}))
    long: list[LongCase] = []
    for case in long_cases():
        outcome, divergence = case.decided()
        long.append(case.model_copy(update={"outcome": outcome, "first_divergence": divergence}))
    return Corpus(rule=VERDICT_RULE_VERSION, tolerances=tolerances, decide=decided, long=long)


def load() -> Corpus:
    return Corpus.model_validate_json(CORPUS.read_text())


def main() -> int:
    corpus = written_now()
    CORPUS.parent.mkdir(exist_ok=True)
    # One case a line: a change of outcome reads as a one-line diff.
    lines = [json.dumps(case.model_dump(), sort_keys=True) for case in corpus.decide]
    long = [json.dumps(case.model_dump(), sort_keys=True) for case in corpus.long]
    CORPUS.write_text(
        f'{{"rule": {corpus.rule},\n"tolerances": {json.dumps(corpus.tolerances, sort_keys=True)},\n"decide": [\n'
        + ",\n".join(lines)
        + '\n],\n"long": [\n'
        + ",\n".join(long)
        + "\n]}\n"
    )
    print(f"{CORPUS}: {len(lines)} decide cases, {len(long)} long-generation cases, rule {corpus.rule}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

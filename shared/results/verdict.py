"""The verdict from evidence: pure functions that tests call without a model.

The rule (``decide``), in order — the numeric rules first, so that no judge can pass NaN or implausible text:
1. Non-finite accelerator logits → FAIL.
2. The prefill logits (the prompt's last position) differ from the reference's by more than the dtype's
   tolerance, relative to the reference's norm → FAIL. Gross faults (a perturbed shard, a skipped
   all-reduce, a dropped layer) show here; thread counts and reduction orders do not.
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

from shared.contracts.enums import Verdict
from shared.contracts.evidence import Evidence, StepEvidence


@dataclass(frozen=True)
class Tolerances:
    prefill: float  # ||acc - ref|| / ||ref|| of the prefill logits (Comparison.prefill_rel_error)
    near_tie_gap: float  # nats between the reference's best token and the accelerator's
    top_k: int
    loglik_slack: float  # nats per token the accelerator's text may lose against the reference's

    @classmethod
    def for_dtype(cls, dtype: str) -> Tolerances:
        if dtype == "float32":
            return cls(prefill=1e-3, near_tie_gap=1e-3, top_k=5, loglik_slack=0.05)
        # bf16 / fp16 keep 8-11 bits of mantissa. Measured by bench/calibrate_verdict.py (BENCHMARKS.md, *Verdict
        # calibration*: 203 benign bf16 runs of 10 architectures, graded faults):
        # - prefill 0.04: dense benign runs reach 0.0244 (1.6x margin); a 10 % scaled shard reaches 0.0487 on
        #   GPT-2, which 0.05 missed. A MoE router near-tie flipped by bf16 reaches 0.098 — no threshold that
        #   catches faults separates that; the bench reports it as the miss.
        # - near-tie gap 0.3 nats: dense benign gaps reach 0.094; 0.2 would catch two more off-by-one cache
        #   positions on these tiny models (logits of 1-4), but a real model's logits of 30-60 round in bf16
        #   steps of 0.125-0.25 nats, so 0.3 stays until trn2 rows say otherwise.
        # - top-5 and 0.3 nats of likelihood slack: benign runs reach rank 1 and a 0.141 drop.
        return cls(prefill=4e-2, near_tie_gap=0.3, top_k=5, loglik_slack=0.3)


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
    if prefill_error > tol.prefill:
        return fail(
            f"prefill logits differ from the reference by {prefill_error:.3g} (relative; tolerance {tol.prefill:.3g})"
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
        far = next((step for step in evidence.divergent_steps if not is_near_tie(step, tol)), None)
        if far is None:
            reason = f"tokens diverge from step {divergence}, every divergence a near tie"
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
                f"finds it fluent: {judge.rationale}", divergence
            )  # fmt: skip
    if judge is not None:
        if judge.fluent is False and judge.reference_fluent is not False:
            return fail(f"the {judge.kind} judge finds the sharded output not fluent: {judge.rationale}")
        reason += f"; {judge.kind} judge: {judge.rationale}"
    return Decision(Verdict.PASS, reason, divergence)

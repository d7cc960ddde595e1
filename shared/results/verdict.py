"""The verdict from evidence: pure functions that tests call without a model.

The rule (``decide``), in order:
1. Non-finite accelerator logits → FAIL.
2. The prefill logits (the prompt's last position) differ from the reference's by more than the dtype's
   tolerance, relative to the reference's norm → FAIL. Every real fault we plant (a perturbed shard, a
   skipped all-reduce, a dropped layer) shows here; thread counts and reduction orders do not.
3. Tokens: every one of the 32 matches → evidence passes. Otherwise each step where the accelerator's
   token is not the reference's choice — scored teacher-forced, under the reference model, on the
   accelerator's own prefix — must be a near tie: in the reference's top-k with a log-prob gap under the
   dtype's tolerance (bf16 drift reorders near ties; a real fault does not). And the accelerator's text
   must be about as likely under the reference as the reference's own text (mean log-prob per token,
   within a slack); else FAIL.
4. Sharded runs also ask the judge whether the accelerator's text is fluent English. It can only turn a
   PASS into a FAIL — when it finds the accelerator's text not fluent while the reference's text is (a
   random tiny model's text is not fluent either way, so the judge is inconclusive there) — and never
   turns a numeric failure into a PASS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.enums import Verdict


@dataclass(frozen=True)
class Tolerances:
    prefill_rel_error: float  # ||acc - ref|| / ||ref|| of the prefill logits
    near_tie_gap: float  # nats between the reference's best token and the accelerator's
    top_k: int
    loglik_slack: float  # nats per token the accelerator's text may lose against the reference's

    @classmethod
    def for_dtype(cls, dtype: str) -> Tolerances:
        if dtype == "float32":
            return cls(prefill_rel_error=1e-3, near_tie_gap=1e-3, top_k=5, loglik_slack=0.05)
        # bf16 / fp16 keep 8-11 bits of mantissa: logits drift by a few percent through a deep model
        return cls(prefill_rel_error=5e-2, near_tie_gap=0.3, top_k=5, loglik_slack=0.3)


@dataclass(frozen=True)
class StepEvidence:
    step: int
    accelerator_token: int
    reference_token: int  # the reference's argmax given the accelerator's prefix
    gap: float  # reference log-prob of its argmax minus that of the accelerator's token, ≥ 0
    rank: int  # 0-based rank of the accelerator's token in the reference's distribution

    def is_near_tie(self, tol: Tolerances) -> bool:
        return self.rank < tol.top_k and self.gap <= tol.near_tie_gap


@dataclass(frozen=True)
class JudgeOutcome:
    kind: str
    model: str | None
    prompt_hash: str
    fluent: bool | None  # the accelerator's text; None: the judge could not tell
    reference_fluent: bool | None
    answer: str  # raw answers, accelerator's then reference's
    rationale: str


@dataclass(frozen=True)
class Evidence:
    generated: Sequence[int]
    reference: Sequence[int]
    divergent_steps: Sequence[StepEvidence] = field(default_factory=list)
    accelerator_loglik: float = 0.0  # mean log-prob per token of the accelerator's text under the reference
    reference_loglik: float = 0.0  # mean log-prob per token of the reference's own text
    prefill_rel_error: float = 0.0
    finite: bool = True
    sharded: bool = False
    judge: JudgeOutcome | None = None


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
    divergence = first_divergence(evidence.generated, evidence.reference)

    def fail(reason: str) -> Decision:
        return Decision(Verdict.FAIL, reason, divergence)

    if not evidence.finite:
        return fail("the accelerator produced non-finite logits")
    if evidence.prefill_rel_error > tol.prefill_rel_error:
        return fail(
            f"prefill logits differ from the reference by {evidence.prefill_rel_error:.3g} "
            f"(relative; tolerance {tol.prefill_rel_error:.3g})"
        )
    if divergence is None:
        reason = "all 32 tokens match the reference"
    else:
        for step in evidence.divergent_steps:
            if not step.is_near_tie(tol):
                return fail(
                    f"step {step.step}: token {step.accelerator_token} is not a near tie of the reference's "
                    f"{step.reference_token} (gap {step.gap:.3g} nats, rank {step.rank}; tolerance "
                    f"{tol.near_tie_gap:.3g} within top-{tol.top_k})"
                )
        if evidence.accelerator_loglik < evidence.reference_loglik - tol.loglik_slack:
            return fail(
                f"the reference finds the accelerator's text implausible: {evidence.accelerator_loglik:.3f} "
                f"vs {evidence.reference_loglik:.3f} nats per token"
            )
        reason = f"tokens diverge from step {divergence}, every divergence a near tie"
    judge = evidence.judge
    if evidence.sharded and judge is not None:
        if judge.fluent is False and judge.reference_fluent is not False:
            return fail(f"the {judge.kind} judge finds the sharded output not fluent: {judge.rationale}")
        reason += f"; {judge.kind} judge: {judge.rationale}"
    return Decision(Verdict.PASS, reason, divergence)


def judge_report_fields(judge: JudgeOutcome | None) -> dict[str, str | None]:
    """The report's audit fields of a judge (all None without one)."""
    return {
        "judge_kind": judge.kind if judge else None,
        "judge_model": judge.model if judge else None,
        "judge_prompt_hash": judge.prompt_hash if judge else None,
        "judge_answer": judge.answer if judge else None,
        "judge_rationale": judge.rationale if judge else None,
    }

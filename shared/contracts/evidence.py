"""What the verdict rules on (``shared.results.verdict.decide``): the evidence of a text-generation run, and a
judge's answer. Frozen data, made by the runner's stages and ruled on by pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.contracts.enums import JudgeKind
from shared.contracts.report import Comparison, JudgeAudit


@dataclass(frozen=True)
class StepEvidence:
    step: int
    accelerator_token: int
    reference_token: int  # the reference's argmax given the accelerator's prefix
    gap: float  # reference log-prob of its argmax minus that of the accelerator's token, ≥ 0
    rank: int  # 0-based rank of the accelerator's token in the reference's distribution


@dataclass(frozen=True)
class JudgeOutcome:
    kind: str
    model: str | None
    prompt_hash: str
    fluent: bool | None  # the accelerator's text; None: the judge could not tell
    reference_fluent: bool | None
    answer: str  # raw answers, accelerator's then reference's
    rationale: str

    @property
    def reads_text(self) -> bool:
        """A judge that reads the text (a language model), not the likelihoods the rule already weighed."""
        return self.kind != JudgeKind.likelihood

    def audit(self) -> JudgeAudit:
        """What a result row keeps of this judge."""
        return JudgeAudit(judge_kind=self.kind, judge_model=self.model, judge_prompt_hash=self.prompt_hash,
                          judge_answer=self.answer, judge_rationale=self.rationale)  # fmt: skip


@dataclass(frozen=True)
class Evidence:
    """A text-generation run's comparison (tokens, prefill error, likelihoods: what its row records), and what
    the rule needs besides: each divergent step under the reference, finiteness, sharding, the judge."""

    comparison: Comparison
    divergent_steps: Sequence[StepEvidence] = field(default_factory=list)
    finite: bool = True
    sharded: bool = False
    judge: JudgeOutcome | None = None

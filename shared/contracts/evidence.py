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
    # MoE: the reference's smallest top-k router margin, over its layers, at the position that chose this token
    routing_margin: float | None = None


@dataclass(frozen=True)
class JudgeOutcome:
    """A judge's answer: what the row keeps of it (``audit``), and what the rule reads."""

    audit: JudgeAudit  # which judge, asked what, answered what
    fluent: bool | None  # the accelerator's text; None: the judge could not tell
    reference_fluent: bool | None

    @property
    def kind(self) -> str:
        return self.audit.judge_kind or ""

    @property
    def rationale(self) -> str:
        return self.audit.judge_rationale or ""

    @property
    def reads_text(self) -> bool:
        """A judge that reads the text (a language model), not the likelihoods the rule already weighed."""
        return self.kind != JudgeKind.likelihood


@dataclass(frozen=True)
class Evidence:
    """A text-generation run's comparison (tokens, prefill error, likelihoods: what its row records), and what
    the rule needs besides: each divergent step under the reference, finiteness, sharding, the judge."""

    comparison: Comparison
    divergent_steps: Sequence[StepEvidence] = field(default_factory=list)
    finite: bool = True
    sharded: bool = False
    judge: JudgeOutcome | None = None

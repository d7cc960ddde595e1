"""What the verdict rules on (``tasks.text_generation.verdict.decide``): the evidence of a text-generation run, and a
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
    # MoE: the reference's smallest top-k router margin, over its layers, at the position that chose this token. What
    # the row shows of the step; no rule reads it since version 3 (the flips' own margins decide), but the golden
    # corpus's version-2 cases and the bench's recorded runs carry it
    routing_margin: float | None = None
    # MoE whose routing flipped: the same step under the reference re-run with the accelerator's experts forced at every
    # position (the counterfactual): the gap and rank of the accelerator's token there. None: no such run
    forced_gap: float | None = None
    forced_rank: int | None = None


@dataclass(frozen=True)
class RoutingFlip:
    """A MoE layer where the accelerator chose other experts than the reference at the same position, on the same
    prefix (the accelerator's tokens, teacher-forced)."""

    step: int  # the generation step whose token that position chose: 0 the prompt's last position, < 0 earlier ones
    layer: int  # the MoE layer, 0 the first
    # how close the reference came to the accelerator's choice there: its logit of an expert the accelerator dropped
    # minus that of one it added, the largest such gap (tasks.text_generation.verdict.flip_margin); None: no near tie
    # at all (no expert on a side, or an added expert outside the reference's top k+8; None, not inf: JSON has no
    # infinity)
    margin: float | None


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
    the rule needs besides: each divergent step under the reference, finiteness, sharding, the judge, and (a MoE)
    where the accelerator's routing differs from the reference's."""

    comparison: Comparison
    divergent_steps: Sequence[StepEvidence] = field(default_factory=list)
    finite: bool = True
    sharded: bool = False
    judge: JudgeOutcome | None = None
    # MoE: every position and layer where the routing differs (empty: it never does); None for a dense model, or a
    # run that recorded no routing (then no divergence is excused as a flipped expert)
    routing_flips: Sequence[RoutingFlip] | None = None
    # each step's logits against the reference's on the same prefix, at the reference's top logits
    # (services.runner.tasks.logits.top_logit_error; step 0 the prefill): None where none were compared, and
    # then no decode step is checked; None at a step: its logits were not finite (rule 1's)
    step_rel_errors: Sequence[float | None] | None = None
    # MoE whose routing flipped: the accelerator's prefill against the reference re-run with the accelerator's experts
    # forced (the counterfactual); None: no such run, so no prefill error is excused as a flipped expert
    forced_prefill_rel_error: float | None = None
    # and each step's, as in step_rel_errors
    forced_step_rel_errors: Sequence[float | None] | None = None
    # and the accelerator's text's mean log-prob per token under that counterfactual (raw logits, teacher-forced),
    # against the counterfactual's own best pick's at each step of the same prefix
    forced_accelerator_loglik: float | None = None
    forced_reference_loglik: float | None = None

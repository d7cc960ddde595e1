"""What a task concludes from the accelerator's output and the reference's: the verdict, why, the comparison, and
the tiers past the verdict (the long generation's outcome, the performance of a PASS)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.runner.specs import ReferenceResult
from shared.contracts.enums import LongOutcome, Verdict
from shared.contracts.evidence import Evidence
from shared.contracts.handoffs import AcceleratorData, Artifacts
from shared.contracts.report import Comparison, LongGeneration, Performance, RunReport
from tasks.text_generation.verdict import Decision

NOT_RUN = LongGeneration(long_generation=LongOutcome.not_run)


class ComparesOutputs:
    """A task whose verdict compares the accelerator's output with the reference's alone (embeddings, an image):
    a stored reference's output is all it needs, whatever the accelerator produced."""

    def reuse(
        self, acc: AcceleratorData, stored: dict[str, Any], artifacts: Artifacts, dtype: str
    ) -> ReferenceResult | None:
        return ReferenceResult(data=stored, reused=True)


@dataclass(frozen=True)
class Conclusion:
    verdict: Verdict
    reason: str
    comparison: Comparison
    evidence: Evidence | None = None  # text-generation: what a judge would rule on with the rule
    long: LongGeneration = field(default_factory=lambda: NOT_RUN)
    performance: Performance = field(default_factory=Performance)

    @classmethod
    def of(
        cls,
        decision: Decision,
        comparison: Comparison,
        evidence: Evidence | None = None,
        long: LongGeneration = NOT_RUN,
        performance: Performance | None = None,
    ) -> Conclusion:
        first = comparison.model_copy(update={"first_divergence": decision.first_divergence})
        return cls(decision.verdict, decision.reason, first, evidence, long, performance or Performance())

    def into(self, report: RunReport) -> RunReport:
        """``report`` with this conclusion: its verdict, reason, comparison and long generation, and the timed
        generations only when the verdict is PASS (a speed means nothing for a run that is not right)."""
        performance = self.performance if self.verdict == Verdict.PASS else Performance()
        update = {"verdict": self.verdict, "verdict_reason": self.reason, "comparison": self.comparison}
        return report.model_copy(update=update | {"long": self.long, "performance": performance})

"""What a task concludes from the accelerator's output and the reference's: the verdict, why, and the comparison."""

from __future__ import annotations

from dataclasses import dataclass

from shared.contracts.enums import Verdict
from shared.contracts.evidence import Evidence
from shared.contracts.report import Comparison, RunReport
from shared.results.verdict import Decision


@dataclass(frozen=True)
class Conclusion:
    verdict: Verdict
    reason: str
    comparison: Comparison
    evidence: Evidence | None = None  # text-generation: what a judge would rule on with the rule

    @classmethod
    def of(cls, decision: Decision, comparison: Comparison, evidence: Evidence | None = None) -> Conclusion:
        first = comparison.model_copy(update={"first_divergence": decision.first_divergence})
        return cls(decision.verdict, decision.reason, first, evidence)

    def into(self, report: RunReport) -> RunReport:
        """``report`` with this conclusion: its verdict, reason and comparison."""
        return report.model_copy(
            update={"verdict": self.verdict, "verdict_reason": self.reason, "comparison": self.comparison}
        )

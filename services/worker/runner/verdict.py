"""The verdict from evidence: pure functions that tests call without a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.enums import Verdict


@dataclass(frozen=True)
class TokenComparison:
    verdict: Verdict
    first_divergence: int | None  # index of the first generated token that differs; None when all match


def first_divergence(generated: Sequence[int], reference: Sequence[int]) -> int | None:
    for i, (g, r) in enumerate(zip(generated, reference, strict=False)):
        if g != r:
            return i
    if len(generated) != len(reference):
        return min(len(generated), len(reference))
    return None


def compare_tokens(generated: Sequence[int], reference: Sequence[int]) -> TokenComparison:
    """PASS when the accelerator generated exactly the reference's tokens, FAIL otherwise."""
    divergence = first_divergence(generated, reference)
    return TokenComparison(Verdict.PASS if divergence is None else Verdict.FAIL, divergence)

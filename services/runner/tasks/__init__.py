"""Tasks: what is run on a checkpoint and how its outputs are compared. One class per task."""

from __future__ import annotations

from typing import Any, Protocol

from services.runner.backends.base import Backend
from services.runner.specs import AcceleratorSpec, ReferenceResult, ReferenceSpec
from services.runner.tasks.feature_extraction import FeatureExtraction
from services.runner.tasks.text_generation import TextGeneration
from shared.contracts import AcceleratorData, Artifacts, RunReport
from shared.enums import Task
from shared.results.verdict import Evidence


class TaskRunner(Protocol):
    name: Task

    def accelerator(self, spec: AcceleratorSpec, backend: Backend) -> AcceleratorData:
        """One rank of the accelerator run (in a child process): load, compile, run twice, measure."""
        ...

    def reference(self, spec: ReferenceSpec, backend: Backend) -> ReferenceResult:
        """The CPU reference (in a child process): its outputs, and what it says of the accelerator's."""
        ...

    def reuse(self, acc: AcceleratorData, stored: dict[str, Any]) -> ReferenceResult | None:
        """The reference's findings from a stored run alone, or None when the model must run again."""
        ...

    def conclude(
        self, report: RunReport, acc: AcceleratorData, found: ReferenceResult, artifacts: Artifacts, dtype: str
    ) -> tuple[RunReport, Evidence | None]:
        """The report with the verdict and its evidence fields; the evidence a judge would rule on."""
        ...


TASKS: dict[Task, TaskRunner] = {t.name: t for t in (TextGeneration(), FeatureExtraction())}


def get_task(name: str) -> TaskRunner:
    try:
        return TASKS[Task(name)]
    except ValueError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}") from None

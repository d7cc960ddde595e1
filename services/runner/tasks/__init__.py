"""Tasks: what is run on a checkpoint and how its outputs are compared. One class per task."""

from __future__ import annotations

from typing import Any, Protocol

from services.runner.backends.base import Backend
from services.runner.specs import AcceleratorSpec, ReferenceResult, ReferenceSpec
from services.runner.tasks.conclusion import Conclusion
from services.runner.tasks.feature_extraction import FeatureExtraction
from services.runner.tasks.text_generation import TextGeneration
from services.runner.tasks.text_to_image import TextToImage
from shared.contracts.enums import Task
from shared.contracts.handoffs import AcceleratorData, Artifacts


class TaskRunner(Protocol):
    name: Task

    def accelerator(self, spec: AcceleratorSpec, backend: Backend) -> AcceleratorData:
        """One rank of the accelerator run (in a child process): load, compile, run twice, measure."""
        ...

    def reference(self, spec: ReferenceSpec, backend: Backend) -> ReferenceResult:
        """The CPU reference (in a child process): its outputs, and what it says of the accelerator's."""
        ...

    def reuse(
        self, acc: AcceleratorData, stored: dict[str, Any], artifacts: Artifacts, dtype: str
    ) -> ReferenceResult | None:
        """The reference's findings from a stored run alone, or None when the model must run again."""
        ...

    def conclude(self, acc: AcceleratorData, found: ReferenceResult, artifacts: Artifacts, dtype: str) -> Conclusion:
        """The verdict, its reason and the comparison it rests on; the evidence a judge would rule on."""
        ...


TASKS: dict[Task, TaskRunner] = {t.name: t for t in (TextGeneration(), FeatureExtraction(), TextToImage())}


def get_task(name: str) -> TaskRunner:
    try:
        return TASKS[Task(name)]
    except ValueError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}") from None

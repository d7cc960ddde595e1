"""The runner's side of the tasks: what a task's torch half (``tasks/<name>/runner.py``, its ``RUNNER``) provides,
and ``get_task``, which imports the half of the task a run needs and no other."""

from __future__ import annotations

from functools import cache
from importlib import import_module
from typing import Any, Protocol, cast

from services.runner.backends.base import Backend
from services.runner.specs import AcceleratorSpec, ReferenceResult, ReferenceSpec
from services.runner.tasks.conclusion import Conclusion
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


RUNNER_MODULES = tuple(f"tasks.{task.name}.runner" for task in Task)  # what a zygote preloads


@cache
def get_task(name: str) -> TaskRunner:
    try:
        task = Task(name)
    except ValueError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(Task)}") from None
    return cast(TaskRunner, import_module(f"tasks.{task.name}.runner").RUNNER)

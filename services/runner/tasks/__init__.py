"""Tasks: what is run on a checkpoint and how its outputs are compared. One module per task."""

from __future__ import annotations

from types import ModuleType

from services.runner.tasks import feature_extraction, text_generation
from shared.enums import Task

TASKS: dict[str, ModuleType] = {
    Task.text_generation.value: text_generation,
    Task.feature_extraction.value: feature_extraction,
}


def get_task(name: str) -> ModuleType:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}") from None

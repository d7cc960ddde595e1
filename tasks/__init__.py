"""The tasks: one folder each, named after its ``Task`` member (``shared.contracts.enums``), which is its one line
in the registry. A folder holds the task's declaration and test config (its ``__init__``: pure, read by the API),
its torch half (``runner.py``, imported by the runner alone), its evidence on the model page (``page.html``) and,
where it draws its own, its charts there (``charts.html``). Adding a task: docs/adding-a-task.md.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from shared.contracts.enums import Task
from tasks.declaration import TaskDeclaration

TASKS_DIR = Path(__file__).resolve().parent  # where the pages find a task's page.html and charts.html


def _declared(task: Task) -> TaskDeclaration:
    declared = import_module(f"{__name__}.{task.name}").DECLARATION
    if not isinstance(declared, TaskDeclaration) or declared.task != task:
        raise TypeError(f"tasks/{task.name}/__init__.py must declare DECLARATION = TaskDeclaration({task!r}, ...)")
    return declared


DECLARATIONS: dict[Task, TaskDeclaration] = {task: _declared(task) for task in Task}
# The Hub's pipeline tags we know how to test, and the task each is tested as; a repo without a pipeline tag is
# tested as its library says, where the library has one task here.
TASK_BY_PIPELINE: dict[str, Task] = {tag: d.task for d in DECLARATIONS.values() for tag in d.pipeline_tags}
TASK_BY_LIBRARY: dict[str, Task] = {lib: d.task for d in DECLARATIONS.values() for lib in d.libraries}
SHARDED_TASKS = frozenset(d.task for d in DECLARATIONS.values() if d.sharded)
SWEPT_TASKS = tuple(d.task.value for d in DECLARATIONS.values() if d.sweeps)  # the sweeps' default


def declaration(task: str) -> TaskDeclaration:
    """The declaration of ``task`` (a ``Task`` or its value)."""
    return DECLARATIONS[Task(task)]

"""What a task declares about itself, apart from the code that runs it: ``TaskDeclaration``.

Pure: no torch, no database, no runner. The API, the sweeps and the admission read a task's declaration; only the
runner imports its torch half (``tasks.<name>.runner``), through ``services.runner.tasks.get_task``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from shared.contracts.enums import Task
from shared.hub.kinds import Refusal

DTYPES = ("float32", "bfloat16")  # the run dtypes of the backends (shared.hub.sizing.run_dtype)


@dataclass(frozen=True)
class TaskDeclaration:
    """One task, as the service plans, admits, sweeps and shows it.

    ``config`` is everything that decides what its test runs and how it is judged (hashed into every job's
    identity: a change is a new test). ``refusal``, when given, settles a repo the task cannot load before any
    size is read (a text-to-image repo with no pipeline layout). ``config_file`` is what admission sizes it by.
    """

    task: Task
    summary: str  # one line: what it runs and what it compares, for the docs and the API's schema
    pipeline_tags: tuple[str, ...]  # the Hub's pipeline tags it tests
    config: Callable[[], dict[str, object]]
    libraries: tuple[str, ...] = ()  # an untagged repo of one of these libraries is tested as this task
    sharded: bool = False  # sharded over several cores (tensor or expert parallel); else whole on one core
    sweeps: bool = True  # the scheduled sweeps list its trending and most-downloaded models
    config_file: str = "config.json"
    refusal: Callable[[str, Collection[str], Collection[str]], Refusal | None] | None = None

    @property
    def folder(self) -> str:
        """Its package under ``tasks/``: the runner half ``tasks.<folder>.runner``, the page ``<folder>/page.html``."""
        return self.task.name

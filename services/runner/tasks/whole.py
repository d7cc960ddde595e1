"""The accelerator side of a task that runs whole, on one core (feature-extraction, text-to-image,
automatic-speech-recognition): one shape for all of them. Load, plant the fault asked for, compile the module that runs
at every call with the backend, call once (the compile) and again (the run: its output is the one compared)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from services.runner import parallel
from services.runner.backends.base import Backend
from services.runner.failures import phase
from services.runner.measure import Stopwatch
from services.runner.specs import AcceleratorSpec
from shared.contracts.enums import ErrorClass


class Whole(Protocol):
    """A task's loaded model or pipeline."""

    @property
    def network(self) -> Any:
        """The module the backend compiles (its ``forward``) and a module fault is planted in."""
        ...

    def plant(self, fault: str) -> None:
        """A planted fault (services/runner/faults.py), or a ValueError naming why this task takes none of that kind."""
        ...


Loaded = TypeVar("Loaded", bound=Whole)
Result = TypeVar("Result")


def compiled_twice(
    spec: AcceleratorSpec, backend: Backend, what: str, load: Callable[[], Loaded], call: Callable[[Loaded], Result]
) -> tuple[Loaded, Result, Stopwatch]:
    """``load()`` under the load phase, the fault, the compile, then ``call`` twice: the first under the compile phase
    (the backend compiles at its first call), the second under the runtime phase. The loaded model, the second call's
    output and the clock of the phases (``load``, ``first``, ``generate``)."""
    parallel.whole(what, spec.world_size)
    clock = Stopwatch(announce=spec.phase_file)
    with phase(ErrorClass.load), clock.time("load"):
        loaded = load()
    if backend.fault:
        loaded.plant(backend.fault)
    network = loaded.network
    network.forward = backend.compile(network.forward)
    with phase(ErrorClass.compile), clock.time("first"):
        call(loaded)
    with phase(ErrorClass.runtime), clock.time("generate"):
        output = call(loaded)
    return loaded, output, clock

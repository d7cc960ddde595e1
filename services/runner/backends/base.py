"""The interface every backend implements: devices, compile, collectives, memory, environment."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.runner.compile_cache import key_device_meshes_by_value
from shared.contracts.enums import CacheOutcome
from shared.contracts.report import Placement, Resources
from shared.contracts.run import LIBRARY, RuntimeInfo
from shared.cores import parse_cpus
from shared.hub.sizing import run_dtype
from shared.settings import RunnerSettings


class Backend(ABC):
    name: str
    device: str  # where the accelerator run places the model
    collective: str  # torch.distributed backend for sharded runs
    compile_backend: str  # what torch.compile is given

    def __init__(self, settings: RunnerSettings) -> None:
        self.settings = settings
        self.counted: CountingBackend | None = None  # the last compile's backend (``compile``)

    @property
    def dtype(self) -> str:
        """The run dtype of both the accelerator run and the CPU reference: sizing's answer, so that the API
        sizes a model at the dtype it will run in."""
        return run_dtype(self.name, self.settings.cpu_dtype)

    @property
    def fault(self) -> str | None:
        """A fault planted in the accelerator run (the cpu backend's test knob); none elsewhere."""
        return None

    def reproduce_env(self) -> dict[str, str]:
        """Settings that changed what ran, as they must prefix the reproduce command."""
        return {}

    def reference_env(self) -> dict[str, str]:
        """Environment of the CPU-reference process (eager, on the CPU)."""
        return {}

    @abstractmethod
    def accelerator_env(self) -> dict[str, str]:
        """Environment of the accelerator process: compile caches, fallback switches."""

    @abstractmethod
    def compiler(self) -> tuple[str, str, str]:
        """The compiler's name, published version (what users type) and full build string; may import torch, so
        call it in a runner process only."""

    def stack_versions(self) -> dict[str, str]:
        """The versions of the backend's own stack beyond torch and the compiler (RuntimeVersions' fields)."""
        return {}

    def describe(self) -> RuntimeInfo:
        import torch
        import transformers

        compiler_name, compiler_version, compiler_build = self.compiler()
        return RuntimeInfo(
            backend=self.name,
            compiler_name=compiler_name,
            compiler_version=compiler_version,
            compiler_build=compiler_build,
            library=LIBRARY,
            library_version=transformers.__version__,
            torch_version=torch.__version__,
            **self.stack_versions(),
        )

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The backend's torch.compile of ``fn``: a full graph, static shapes; ``self.counted`` counts the graphs
        dynamo hands this compile (``backend_graphs`` of the row: all of dynamo's, when no other compile ran).

        A sharded model's graphs take its DeviceMesh as an input: its cache keys must not depend on the process.
        """
        import torch

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            key_device_meshes_by_value()
        self.counted = CountingBackend(self.compile_backend)
        return torch.compile(fn, backend=self.counted, fullgraph=True, dynamic=False)

    def generation_config(self) -> dict[str, Any]:
        """What the accelerator run's ``generate`` is told besides the test's own arguments (none by default)."""
        return {}

    def synchronize(self) -> None:  # noqa: B027 - the CPU has nothing to wait for
        pass

    @abstractmethod
    def peak_memory_bytes(self) -> int:
        """Peak memory of this process on the accelerator run's device."""

    @abstractmethod
    def visible_cores(self) -> str:
        """The cores this process may use, as the machine reports them (provenance, and checked in tests)."""

    def prepare_process(self) -> None:  # noqa: B027 - most backends need nothing
        """Per-process setup of an accelerator rank before torch does any work."""

    # Whether a core is exclusive to one process, so that two ranks seeing the same core is a broken placement
    # (an accelerator's core; not a CPU, which a group of more cores than the host has CPUs shares).
    exclusive_cores = True

    @abstractmethod
    def rank_pin(self, core: int) -> RankPin:
        """How a rank of a sharded run is given its ``core`` (a core of the runner's group)."""

    def runner_cores(self) -> list[int]:
        """The cores this runner may give its ranks when no core group was named: the first ones."""
        return []

    def rank_pins(self, core_range: str | None, world_size: int) -> list[RankPin] | None:
        """Each rank's core: the ``world_size`` first of the runner's group (its worker's ``core_range``, else
        the cores the runner sees), one each; None for a single process, which keeps the runner's own."""
        if world_size == 1:
            return None
        cores = sorted(parse_cpus(core_range)) if core_range else self.runner_cores()
        cores = cores if len(cores) >= world_size else list(range(world_size))
        return [self.rank_pin(core) for core in cores[:world_size]]

    def placement(self) -> Placement:
        """What this rank sees: its cores, the device transformers bound it to, its process group's backend."""
        import torch

        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        where = f"{device.type}:{torch.accelerator.current_device_index()}" if device else "cpu"
        return Placement(
            visible_cores=self.visible_cores(),
            rank_cores=f"{self.visible_cores()}@{where}",
            collective=torch.distributed.get_backend() if distributed else None,
        )

    @abstractmethod
    def cache_lookups(self) -> CacheLookups:
        """This process's own compile-cache lookups, from the compiler's counters: never from the cache
        directory, which other jobs on the host write to at the same time."""


class CountingBackend:
    """A dynamo backend by name, counting the graphs it receives; every other attribute is the backend's own."""

    def __init__(self, name: str) -> None:
        import torch

        self.name = name
        # torch.compile wraps "inductor" in its own wrapper (mode and options applied): the same one here
        self.backend = (
            torch._TorchCompileInductorWrapper(None, None, False)
            if name == "inductor"
            else torch._dynamo.lookup_backend(name)
        )
        self.received = 0

    def __call__(self, graph: Any, example_inputs: Any, **kwargs: Any) -> Any:
        self.received += 1
        return self.backend(graph, example_inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


@dataclass(frozen=True)
class CacheLookups:
    """The graphs a run looked up in its compiler's persistent cache: found, and compiled anew."""

    hits: int | None = None
    misses: int | None = None
    kept: bool = True  # the compiler keeps a persistent cache at all

    @property
    def outcome(self) -> CacheOutcome:
        if not self.kept:
            return CacheOutcome.none
        if self.hits is None or self.misses is None:
            return CacheOutcome.unknown
        if not self.hits and not self.misses:
            return CacheOutcome.none
        return CacheOutcome.miss if self.misses else CacheOutcome.hit

    def into(self, resources: Resources) -> None:
        resources.compile_cache, resources.cache_hits, resources.cache_misses = self.outcome, self.hits, self.misses


def inductor_cache_lookups() -> CacheLookups:
    """Inductor's FX-graph cache counters of this process; a dynamo backend that never reached inductor (eager,
    aot_eager) keeps no cache."""
    from torch._dynamo.utils import counters

    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    return CacheLookups(hits, misses) if hits or misses else CacheLookups(kept=False)


@dataclass(frozen=True)
class RankPin:
    env: dict[str, str]  # added to the rank's environment
    cpus: set[int] | None = None  # its CPU affinity; None: the runner's


class DeviceBackend(Backend):
    """A backend with its own device memory, read through torch.<device> (cuda, neuron).

    A rank of a sharded run sees only its own core, as device 0 (``rank_pin``), rather than the group's whole range
    with ``LOCAL_RANK`` picking one: a runtime that claims every core it can see at start-up (as a report on the
    Neuron runtime's ``nrt_init`` says it does) can then never take a core of another rank, and a rank that ends up
    on someone else's core shows in ``rank_cores`` and fails the run instead of sharing it silently.
    """

    visible_variable: str  # the environment variable that says which cores a process may use

    def rank_pin(self, core: int) -> RankPin:
        return RankPin({self.visible_variable: str(core), "LOCAL_RANK": "0"})

    def runner_cores(self) -> list[int]:
        given = os.environ.get(self.visible_variable, "")
        return sorted(parse_cpus(given)) if given.replace(",", "").replace("-", "").isdigit() else []

    def _module(self) -> Any:
        import torch

        return getattr(torch, self.device)

    def synchronize(self) -> None:
        self._module().synchronize()

    def peak_memory_bytes(self) -> int:
        self.synchronize()
        return int(self._module().max_memory_allocated())

    def visible_cores(self) -> str:
        """The core range this process was given (its ``visible_variable``), as the group names its cores."""
        return os.environ.get(self.visible_variable) or f"{self._module().device_count()} device(s)"

"""The interface every backend implements: devices, compile, collectives, memory, environment."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from services.runner.compile_cache import key_device_meshes_by_value
from shared.contracts.run import LIBRARY, RuntimeInfo
from shared.hub.sizing import run_dtype
from shared.settings import Settings


class Backend(ABC):
    name: str
    device: str  # where the accelerator run places the model
    collective: str  # torch.distributed backend for sharded runs
    compile_backend: str  # what torch.compile is given

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

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
    def compiler(self) -> tuple[str, str]:
        """The compiler's name and full version; may import torch, so call it in a runner process only."""

    def describe(self) -> RuntimeInfo:
        import torch
        import transformers

        compiler_name, compiler_version = self.compiler()
        return RuntimeInfo(
            backend=self.name,
            compiler_name=compiler_name,
            compiler_version=compiler_version,
            library=LIBRARY,
            library_version=transformers.__version__,
            torch_version=torch.__version__,
        )

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The backend's torch.compile of ``fn``: a full graph, static shapes.

        A sharded model's graphs take its DeviceMesh as an input: its cache keys must not depend on the process.
        """
        import torch

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            key_device_meshes_by_value()
        return torch.compile(fn, backend=self.compile_backend, fullgraph=True, dynamic=False)

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

    def cache_outcome(self, new_files: int) -> str:
        """hit or miss of this process's compiles in the local compile cache.

        By default from the cache directory: a compile that wrote no new entry found what it needed.
        """
        return "hit" if new_files == 0 else "miss"


def inductor_cache_outcome() -> str:
    """hit or miss from inductor's FX graph cache counters; none when the dynamo backend does not use it."""
    from torch._dynamo.utils import counters

    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    if not hits and not misses:
        return "none"
    return "hit" if not misses else "miss"


class DeviceBackend(Backend):
    """A backend with its own device memory, read through torch.<device> (cuda, neuron)."""

    def _module(self) -> Any:
        import torch

        return getattr(torch, self.device)

    def synchronize(self) -> None:
        self._module().synchronize()

    def peak_memory_bytes(self) -> int:
        self.synchronize()
        return int(self._module().max_memory_allocated())

    def visible_cores(self) -> str:
        return f"{self._module().device_count()} device(s)"

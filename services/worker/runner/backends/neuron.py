"""The Trainium backend: TorchNeuron (`torch-neuronx`), `torch.compile(backend="neuron")`.

Runs only where torch-neuronx is installed (the image from Dockerfile.neuron); nothing here imports it
before a runner process asks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.worker.runner.backends.base import Backend
from shared.runtime import LIBRARY, RuntimeInfo


class NeuronBackend(Backend):
    name = "neuron"
    device = "neuron"
    collective = "neuron"
    dtype = "bfloat16"

    def reference_env(self) -> dict[str, str]:
        # torch-neuronx registers itself as torch's accelerator on import; the reference must stay on the CPU.
        return {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}

    def accelerator_env(self) -> dict[str, str]:
        cache = self.settings.cache_path
        return {
            # A graph that fails to compile must fail the run, not fall back to eager/CPU silently.
            "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
            "TORCH_NEURONX_NEFF_CACHE_DIR": str(cache / "neff"),
            "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(cache / "neff-locks"),
        }

    def describe(self) -> RuntimeInfo:
        import neuronxcc  # the full version, with its +hash, as the NEFF cache namespaces it
        import torch
        import transformers

        return RuntimeInfo(
            backend=self.name,
            compiler_name="neuronx-cc",
            compiler_version=str(neuronxcc.__version__),
            library=LIBRARY,
            library_version=transformers.__version__,
            torch_version=torch.__version__,
        )

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch
        import torch_neuronx  # noqa: F401 - registers the "neuron" device and dynamo backend

        return torch.compile(fn, backend="neuron", fullgraph=True, dynamic=False)

    def synchronize(self) -> None:
        import torch

        torch.neuron.synchronize()

    def peak_memory_bytes(self) -> int:
        import torch

        torch.neuron.synchronize()
        return int(torch.neuron.max_memory_allocated())

    def visible_cores(self) -> str:
        import torch

        return f"{torch.neuron.device_count()} device(s)"

"""The Trainium backend: TorchNeuron (`torch-neuronx`), `torch.compile(backend="neuron")`.

Runs only where torch-neuronx is installed (the trn2 image); nothing here imports it before a runner
process asks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.runner.backends.base import DeviceBackend
from services.runner.compile_cache import local_cache_dir


class NeuronBackend(DeviceBackend):
    name = "neuron"
    device = "neuron"
    collective = "neuron"
    compile_backend = "neuron"

    def reference_env(self) -> dict[str, str]:
        # torch-neuronx registers itself as torch's accelerator on import; the reference must stay on the CPU.
        return {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}

    def accelerator_env(self) -> dict[str, str]:
        cache = self.settings.cache_path
        return {
            # A graph that fails to compile must fail the run, not fall back to eager/CPU silently.
            "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
            "TORCH_NEURONX_NEFF_CACHE_DIR": str(local_cache_dir(cache, self.name)),
            "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(cache / "neff-locks"),
        }

    def prepare_process(self) -> None:
        # Registers the "neuron" device, its collective and dynamo backend: what autoload does when torch is
        # imported, which a runner forked from the zygote (torch imported with autoload off) has not had.
        import torch_neuronx  # noqa: F401

    def compiler(self) -> tuple[str, str]:
        import neuronxcc  # the full version, with its +hash, as the NEFF cache namespaces it

        return "neuronx-cc", str(neuronxcc.__version__)

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch_neuronx  # noqa: F401 - registers the "neuron" device and dynamo backend

        return super().compile(fn)

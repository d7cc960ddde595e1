"""The Trainium backend: TorchNeuron (`torch-neuronx`), `torch.compile(backend="neuron")`.

Runs only where torch-neuronx is installed (the trn2 image); nothing here imports it before a runner
process asks for it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from services.runner.backends.base import CacheLookups, DeviceBackend
from services.runner.compile_cache import local_cache_dir
from shared.installed import installed_version, neuron_versions

DEBUG_DIR = "TORCH_NEURONX_DEBUG_DIR"  # where TorchNeuron writes the FX graphs, StableHLO and NEFFs it compiles


def private_debug_dir(environ: Mapping[str, str]) -> dict[str, str]:
    """TorchNeuron's work directory for this run: the one ``environ`` names (the worker's, in the stage's own
    ``shared.isolation.WorkDir``), else a fresh one of this run's own, 0700, under its TMPDIR — never TorchNeuron's
    default ``/tmp/neuron_backend``, one directory for every user of the host, where the first run to create it
    owns it and every later run reads the graphs left there (a reproduce command, a local run)."""
    if environ.get(DEBUG_DIR):
        return {}
    return {DEBUG_DIR: tempfile.mkdtemp(prefix="neuron_backend-", dir=environ.get("TMPDIR") or None)}


class NeuronBackend(DeviceBackend):
    name = "neuron"
    device = "neuron"
    collective = "neuron"
    compile_backend = "neuron"
    visible_variable = "NEURON_RT_VISIBLE_CORES"

    def reference_env(self) -> dict[str, str]:
        # torch-neuronx registers itself as torch's accelerator on import; the reference must stay on the CPU.
        return {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}

    def accelerator_env(self) -> dict[str, str]:
        # TorchNeuron's work directory passes to the ranks with the rest of this runner's environment.
        cache = self.settings.cache_path
        return private_debug_dir(os.environ) | {
            # A graph that fails to compile must fail the run, not fall back to eager/CPU silently.
            "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
            "TORCH_NEURONX_NEFF_CACHE_DIR": str(local_cache_dir(cache, self.name)),
            "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(cache / "neff-locks"),
        }

    def prepare_process(self) -> None:
        # Registers the "neuron" device, its collective and dynamo backend: what autoload does when torch is
        # imported, which a runner forked from the zygote (torch imported with autoload off) has not had.
        import torch_neuronx  # noqa: F401

    def compiler(self) -> tuple[str, str, str]:
        import neuronxcc  # the full build, with its +hash, as the NEFF cache namespaces it

        build = str(neuronxcc.__version__)
        # the published version users type (--compiler 2.28.7631.0) is the package's, without the +hash
        return "neuronx-cc", installed_version("neuronx-cc") or build.split("+")[0], build

    def stack_versions(self) -> dict[str, str]:
        return neuron_versions()

    def cache_lookups(self) -> CacheLookups:
        """TorchNeuron's compilation-cache counters of this process (CompilationCache.PersistentHits and
        PersistentMisses, its metrics). Read only, without a trn2 host here: a TorchNeuron that does not expose
        them reports the outcome as unknown rather than guessing from the shared cache directory."""
        import torch_neuronx

        metrics = getattr(torch_neuronx, "metrics", None)
        read = getattr(metrics, "get_metrics", None) or getattr(torch_neuronx, "get_dynamo_metrics", None)
        found = read() if callable(read) else {}
        flat = {str(k).lower(): v for k, v in (found.items() if isinstance(found, dict) else [])}

        def count(name: str) -> int | None:
            value = next((v for k, v in flat.items() if k.endswith(name)), None)
            return int(value) if isinstance(value, int | float) else None

        return CacheLookups(count("persistenthits"), count("persistentmisses"))

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch_neuronx  # noqa: F401 - registers the "neuron" device and dynamo backend

        return super().compile(fn)

"""Backends: where a model runs. Each is a small class; importing one never imports torch."""

from __future__ import annotations

from services.runner.backends.base import Backend
from services.runner.backends.cpu import CpuBackend
from services.runner.backends.cuda import CudaBackend
from services.runner.backends.neuron import NeuronBackend
from shared.settings import RunnerSettings

BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (CpuBackend, CudaBackend, NeuronBackend)}


def get_backend(name: str, settings: RunnerSettings) -> Backend:
    try:
        return BACKENDS[name](settings)
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}") from None

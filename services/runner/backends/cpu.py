"""The CPU backend: inductor (or the configured dynamo backend) on this machine's cores."""

from __future__ import annotations

import os
from typing import Any

from services.runner.backends.base import Backend, CacheLookups, RankPin, inductor_cache_lookups
from services.runner.compile_cache import inductor_env, local_cache_dir
from services.runner.measure import peak_rss_bytes
from shared.cores import CoreGroup, cpu_set, format_cpus
from shared.installed import cpu_compiler


class CpuBackend(Backend):
    name = "cpu"
    device = "cpu"
    collective = "gloo"

    @property
    def compile_backend(self) -> str:  # type: ignore[override]
        return self.settings.cpu_compile_backend

    @property
    def fault(self) -> str | None:
        return self.settings.cpu_fault

    def reproduce_env(self) -> dict[str, str]:
        env = {}
        if self.compile_backend != "inductor":
            env["SUPPORTMATRIX_CPU_COMPILE_BACKEND"] = self.compile_backend
        if self.dtype != "float32":
            env["SUPPORTMATRIX_CPU_DTYPE"] = self.dtype
        return env

    def accelerator_env(self) -> dict[str, str]:
        return inductor_env(local_cache_dir(self.settings.cache_path, self.name))

    def compiler(self) -> tuple[str, str, str]:
        import torch

        name, version = cpu_compiler(self.compile_backend, torch.__version__, self.dtype)
        return name, version, version

    def peak_memory_bytes(self) -> int:
        return peak_rss_bytes()

    exclusive_cores = False  # a group may have more cores than the host has CPUs: core i runs on CPU i mod n

    def rank_pin(self, core: int) -> RankPin:
        """A rank runs on its core's CPU (``cpu_set``), as a core-group worker runs on its group's."""
        return RankPin({"LOCAL_RANK": "0"}, cpus=cpu_set(CoreGroup(core, 1)))

    def visible_cores(self) -> str:
        return format_cpus(os.sched_getaffinity(0))

    def prepare_process(self) -> None:
        if self.settings.cpu_threads:
            import torch

            torch.set_num_threads(self.settings.cpu_threads)

    def generation_config(self) -> dict[str, Any]:
        """transformers' switch that makes generate treat the CPU as it treats a neuron device: eligible for its
        own auto-compile. With it on, every cpu run takes the branch a trn2 run takes, so the tests see that the
        run's ``disable_compile`` keeps it to one compile."""
        from transformers import CompileConfig

        config = CompileConfig()
        config._compile_all_devices = True  # type: ignore[assignment]  # declared None in transformers, read as a bool
        return {"compile_config": config}

    def cache_lookups(self) -> CacheLookups:
        return inductor_cache_lookups()

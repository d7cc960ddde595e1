"""The CPU backend: inductor (or the configured dynamo backend) on this machine's cores."""

from __future__ import annotations

import os

from services.runner.backends.base import Backend, inductor_cache_outcome
from services.runner.compile_cache import inductor_env, local_cache_dir
from services.runner.measure import peak_rss_bytes
from shared.cores import format_cpus
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

    def compiler(self) -> tuple[str, str]:
        import torch

        return cpu_compiler(self.compile_backend, torch.__version__, self.dtype)

    def peak_memory_bytes(self) -> int:
        return peak_rss_bytes()

    def visible_cores(self) -> str:
        return format_cpus(os.sched_getaffinity(0))

    def prepare_process(self) -> None:
        if self.settings.cpu_threads:
            import torch

            torch.set_num_threads(self.settings.cpu_threads)

    def cache_outcome(self, new_files: int) -> str:
        return inductor_cache_outcome()

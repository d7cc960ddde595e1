"""The CUDA backend: inductor on a GPU."""

from __future__ import annotations

from services.runner.backends.base import CacheLookups, DeviceBackend, inductor_cache_lookups
from services.runner.compile_cache import inductor_env, local_cache_dir


class CudaBackend(DeviceBackend):
    name = "cuda"
    device = "cuda"
    collective = "nccl"
    compile_backend = "inductor"
    visible_variable = "CUDA_VISIBLE_DEVICES"

    def accelerator_env(self) -> dict[str, str]:
        return inductor_env(local_cache_dir(self.settings.cache_path, self.name))

    def compiler(self) -> tuple[str, str, str]:
        import torch

        version = f"inductor-{torch.__version__}"
        return "inductor", version, version

    def cache_lookups(self) -> CacheLookups:
        return inductor_cache_lookups()

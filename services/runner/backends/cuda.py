"""The CUDA backend: inductor on a GPU."""

from __future__ import annotations

from services.runner.backends.base import DeviceBackend, inductor_cache_outcome
from services.runner.compile_cache import inductor_env, local_cache_dir


class CudaBackend(DeviceBackend):
    name = "cuda"
    device = "cuda"
    collective = "nccl"
    compile_backend = "inductor"

    def accelerator_env(self) -> dict[str, str]:
        return inductor_env(local_cache_dir(self.settings.cache_path, self.name))

    def compiler(self) -> tuple[str, str]:
        import torch

        return "inductor", f"inductor-{torch.__version__}"

    def cache_outcome(self, new_files: int) -> str:
        return inductor_cache_outcome()

"""The CUDA backend: inductor on a GPU."""

from __future__ import annotations

from services.worker.runner.backends.base import DeviceBackend


class CudaBackend(DeviceBackend):
    name = "cuda"
    device = "cuda"
    collective = "nccl"
    dtype = "bfloat16"
    compile_backend = "inductor"

    def accelerator_env(self) -> dict[str, str]:
        inductor = self.settings.cache_path / "inductor-cuda"
        return {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "TMPDIR": str(inductor / "tmp")}

    def compiler(self) -> tuple[str, str]:
        import torch

        return "inductor", f"inductor-{torch.__version__}"

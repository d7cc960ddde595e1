"""The CUDA backend: inductor on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.worker.runner.backends.base import Backend
from shared.runtime import LIBRARY, RuntimeInfo


class CudaBackend(Backend):
    name = "cuda"
    device = "cuda"
    collective = "nccl"
    dtype = "bfloat16"

    def accelerator_env(self) -> dict[str, str]:
        inductor = self.settings.cache_path / "inductor-cuda"
        return {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "TMPDIR": str(inductor / "tmp")}

    def describe(self) -> RuntimeInfo:
        import torch
        import transformers

        return RuntimeInfo(
            backend=self.name,
            compiler_name="inductor",
            compiler_version=f"inductor-{torch.__version__}",
            library=LIBRARY,
            library_version=transformers.__version__,
            torch_version=torch.__version__,
        )

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def peak_memory_bytes(self) -> int:
        import torch

        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())

    def visible_cores(self) -> str:
        import torch

        return f"{torch.cuda.device_count()} device(s)"

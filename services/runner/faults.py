"""Planted faults, for tests that prove the verdict catches real breakage (cpu backend only).

Each is a small, deterministic change to the accelerator's model after it is loaded:
- ``perturb_shard``: noise on one rank's shard of one attention weight (the last rank's);
- ``skip_allreduce``: one row-parallel projection returns its rank's partial sum, never all-reduced;
- ``drop_layer``: the last decoder layer passes its input through.
"""

from __future__ import annotations

from typing import Any

FAULTS = ("perturb_shard", "skip_allreduce", "drop_layer")


def decoder_layers(model: Any) -> Any:
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def inject(model: Any, fault: str, rank: int, world_size: int) -> None:
    import torch

    layers = decoder_layers(model)
    if fault == "perturb_shard":
        weight = layers[0].self_attn.q_proj.weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        if rank == world_size - 1:
            generator = torch.Generator().manual_seed(1234)
            noise = torch.randn(local.shape, generator=generator, dtype=torch.float32).to(local.dtype)
            with torch.no_grad():
                local.add_(noise.to(local.device) * local.float().std().item())
    elif fault == "skip_allreduce":
        if world_size < 2:
            raise ValueError("skip_allreduce needs a sharded run")
        from torch.distributed.tensor import DTensor

        projection = layers[0].self_attn.o_proj
        tp_forward = projection.forward
        local_weight = projection.weight.to_local()  # this rank's slice of the input dimension

        def partial_forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            tp_forward(x, *args, **kwargs)  # every rank still joins the collective, so nothing hangs
            local_x = x.to_local() if isinstance(x, DTensor) else x
            return torch.nn.functional.linear(local_x, local_weight)  # the partial sum, never reduced

        projection.forward = partial_forward
    elif fault == "drop_layer":
        layers[-1].forward = lambda hidden_states, *args, **kwargs: hidden_states
    else:
        raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")

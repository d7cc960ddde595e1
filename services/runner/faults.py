"""Planted faults, for tests that prove the verdict catches real breakage (cpu backend only).

Each is a small, deterministic change to the accelerator's model after it is loaded:
- ``perturb_shard``: noise on one rank's shard of one attention weight (the last rank's);
- ``skip_allreduce``: one row-parallel projection returns its rank's partial sum, never all-reduced;
- ``drop_layer``: the last decoder layer passes its input through.

Two act on generation instead, after the logits processors (what greedy picks from):
- ``swap_token``: at decode step 4 greedy takes the token ranked 10th — a divergence that is no near tie;
- ``swap_near_tie``: at the first step from 4 on whose two best scores are within 0.05 nats, greedy takes
  the second — the reordering bf16 drift causes, which the verdict must not fail.
"""

from __future__ import annotations

from typing import Any

MODEL_FAULTS = ("perturb_shard", "skip_allreduce", "drop_layer")
GENERATION_FAULTS = ("swap_token", "swap_near_tie")
FAULTS = MODEL_FAULTS + GENERATION_FAULTS
SWAP_STEP = 4
SWAP_RANK = 10
NEAR_TIE_NATS = 0.05


def decoder_layers(model: Any) -> Any:
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def logits_processors(fault: str | None, prompt_length: int) -> list[Any]:
    """The generation fault's processor, run after the model's own (none for a model fault)."""
    if fault not in GENERATION_FAULTS:
        return []
    from transformers import LogitsProcessor

    class Swap(LogitsProcessor):
        def __init__(self) -> None:
            self.done = False

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            step = input_ids.shape[1] - prompt_length
            if self.done or step < SWAP_STEP:
                return scores
            ranked = scores[0].float().log_softmax(-1).sort(descending=True)
            if fault == "swap_token":
                chosen = int(ranked.indices[SWAP_RANK])
            elif ranked.values[0] - ranked.values[1] < NEAR_TIE_NATS:
                chosen = int(ranked.indices[1])
            else:
                return scores
            self.done = True
            scores = scores.clone()
            scores[0, chosen] = scores[0].max() + 1.0
            return scores

    return [Swap()]


def inject(model: Any, fault: str, rank: int, world_size: int) -> None:
    import torch

    if fault in GENERATION_FAULTS:
        return

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

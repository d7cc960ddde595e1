"""Planted faults, for tests and benches that prove the verdict catches real breakage (cpu backend only).

Each is a small, deterministic change to the accelerator's model after it is loaded, graded from gross to
subtle (``bench/calibrate_verdict.py`` measures which ones the verdict catches):
- ``perturb_shard``: noise on one rank's shard of one attention weight (the last rank's);
- ``scale_shard_10pct``, ``scale_shard_1pct``: the last rank's shard of the first layer's attention output
  projection (row-parallel: its slice of the input dimension, the heads that rank holds) scaled by 1.10 or
  1.01; on one core, the slice a 2-way split would give the last rank. ``scale_shard@0.005`` takes any scale;
- ``skip_allreduce``: one row-parallel projection returns its rank's partial sum, never all-reduced;
- ``drop_layer``: the last decoder layer passes its input through;
- ``zero_head``: the first layer's last attention head contributes nothing (its input columns of the output
  projection are zero; on a sharded run, on the rank that holds that head);
- ``rotary_base``: the rotary embedding's base (``rope_theta``) doubled — its ``inv_freq`` recomputed;
- ``cache_position``: every decode step runs at the position one past the cache's length (an off-by-one
  position id: RoPE, or a learned position embedding, of the wrong position); the prefill is untouched;
- ``permute_experts`` (MoE): the last rank's experts, in every MoE layer, hold their neighbour's weights (rotated by
  one: expert i computes what expert i - 1 should), as a loader that maps expert indices wrongly on one rank
  would leave them; the router is untouched, so it still chooses as the reference does where its input agrees. On
  one core, the experts a 2-way split gives the last rank.

Two only the long generation can see (the 32-token run never gets that far):
- ``late_corruption``: from 100 tokens past the prompt on, every decode step reads a blank input (its token's
  embedding zeroed), as a cache corrupted past a position would leave the model without what it wrote;
- ``late_nan``: from there on, the input embedding is NaN.

For embedding and image models (``inject_module``), on the encoder or the denoiser, and on a sentence-transformers
pipeline's own modules:
- ``drop_layer``: the last layer of the encoder, or the denoiser's last transformer block, passes its input through;
- ``scale_shard_10pct``, ``scale_shard_1pct``, ``scale_shard@<s>``: the first attention output projection's last
  half of input columns (a 2-way split's last shard) scaled by 1 + s;
- ``wrong_pooling``: a sentence-transformers pipeline pools with another mode than its repo says (CLS for mean,
  mean for anything else).

Three act on generation instead, after the logits processors (what greedy picks from):
- ``swap_token``: at decode step 4 greedy takes the token ranked 10th — a divergence that is no near tie;
- ``swap_near_tie``: at the first step from 4 on whose two best scores are within 0.05 nats, greedy takes
  the second — the reordering bf16 drift causes, which the verdict must not fail;
- ``slow_decode``: every step sleeps 50 ms before its token is picked: right tokens, decoded slower.
"""

from __future__ import annotations

import math
import time
from typing import Any

from shared.contracts.enums import Fault

SCALED: dict[str, float] = {Fault.scale_shard_1pct: 0.01, Fault.scale_shard_10pct: 0.10}
SCALE_PREFIX = "scale_shard@"  # scale_shard@<s>: the shard scaled by 1 + s (benches)
# The late decode steps' input embedding, times this.
LATE_FAULTS: dict[str, float] = {Fault.late_corruption: 0.0, Fault.late_nan: math.nan}
MODEL_FAULTS = (
    Fault.perturb_shard, Fault.skip_allreduce, Fault.drop_layer, *SCALED, Fault.zero_head, Fault.rotary_base,
    Fault.cache_position, Fault.permute_experts, *LATE_FAULTS,
)  # fmt: skip
GENERATION_FAULTS = (Fault.swap_token, Fault.swap_near_tie, Fault.slow_decode)
# Embedding and image models (scale_shard@<s> too).
MODULE_FAULTS = (Fault.drop_layer, *SCALED, Fault.wrong_pooling)
# Where each library keeps what the module faults change: the layers' containers, attention output projections.
LAYER_CONTAINERS = (".layer", ".layers", ".transformer_blocks", ".blocks")
OUTPUT_PROJECTIONS = ("attention.output.dense", "to_out.0", "o_proj", "out_proj")
LATE_STEP = 100  # tokens past the prompt: far beyond the 32 the verdict reads, well inside the long generation
# Past a tiny model's step even on a starved 2-CPU machine (CI saw 35 ms there beside other runs): the slow run stays
# clearly slower than the clean one it is compared with, by more than /changes' noise band.
SLOW_DECODE_S = 0.05
SWAP_STEP = 4
SWAP_RANK = 10
NEAR_TIE_NATS = 0.05
ROTARY_BASE_FACTOR = 2.0


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

    if fault == Fault.slow_decode:

        class Slow(LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                time.sleep(SLOW_DECODE_S)
                return scores

        return [Slow()]

    class Swap(LogitsProcessor):
        def __init__(self) -> None:
            self.done = False

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            step = input_ids.shape[1] - prompt_length
            if self.done or step < SWAP_STEP:
                return scores
            ranked = scores[0].float().log_softmax(-1).sort(descending=True)
            if fault == Fault.swap_token:
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


def inject(model: Any, fault: str, rank: int, world_size: int, prompt_length: int = 0) -> None:
    import torch

    if fault in GENERATION_FAULTS:
        return

    layers = decoder_layers(model)
    if fault in SCALED or fault.startswith(SCALE_PREFIX):
        scale = SCALED[fault] if fault in SCALED else float(fault.removeprefix(SCALE_PREFIX))
        scale_shard(model, scale, rank, world_size)
    elif fault == Fault.perturb_shard:
        weight = layers[0].self_attn.q_proj.weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        if rank == world_size - 1:
            generator = torch.Generator().manual_seed(1234)
            noise = torch.randn(local.shape, generator=generator, dtype=torch.float32).to(local.dtype)
            with torch.no_grad():
                local.add_(noise.to(local.device) * local.float().std().item())
    elif fault == Fault.skip_allreduce:
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
    elif fault == Fault.drop_layer:
        layers[-1].forward = lambda hidden_states, *args, **kwargs: hidden_states
    elif fault == Fault.zero_head:
        zero_head(model, rank, world_size)
    elif fault == Fault.rotary_base:
        rotary_base(model, ROTARY_BASE_FACTOR)
    elif fault == Fault.cache_position:
        shift_decode_positions(model, 1)
    elif fault == Fault.permute_experts:
        permute_experts(model, rank, world_size)
    elif fault in LATE_FAULTS:
        scale_late_inputs(model, prompt_length + LATE_STEP, LATE_FAULTS[fault])
    else:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(Fault)}")


def _output_projection(model: Any) -> tuple[Any, int, bool]:
    """The first layer's attention output projection: its local weight, the axis of its inputs (the heads),
    and whether it is sharded. ``o_proj`` is a Linear (out x in), GPT-2's ``c_proj`` a Conv1D (in x out). Under
    tensor parallelism it is row-parallel: each rank holds its heads' slice of the input axis."""
    layer = decoder_layers(model)[0]
    attention = getattr(layer, "self_attn", None) or layer.attn
    if hasattr(attention, "o_proj"):
        weight, axis = attention.o_proj.weight, 1
    elif hasattr(attention, "c_proj"):
        weight, axis = attention.c_proj.weight, 0
    else:
        raise ValueError(f"cannot find the attention output projection of {type(model).__name__}")
    sharded = hasattr(weight, "to_local")
    return (weight.to_local() if sharded else weight), axis, sharded


def scale_shard(model: Any, scale: float, rank: int, world_size: int) -> None:
    """The last rank's shard of the first layer's attention output projection, times (1 + scale)."""
    import torch

    if rank != world_size - 1:
        return
    local, axis, sharded = _output_projection(model)
    size = local.shape[axis]
    # A sharded weight's local tensor is the shard; one core's weight, the slice a 2-way split gives rank 1.
    start = 0 if sharded else size - size // 2
    with torch.no_grad():
        local.narrow(axis, start, size - start).mul_(1.0 + scale)


def zero_head(model: Any, rank: int, world_size: int) -> None:
    """The last attention head of the first layer contributes nothing: its output projection's inputs are 0."""
    import torch

    if rank != world_size - 1:  # the last head lives on the last rank
        return
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    local, axis, _ = _output_projection(model)
    with torch.no_grad():
        local.narrow(axis, local.shape[axis] - head_dim, head_dim).zero_()


def permute_experts(model: Any, rank: int, world_size: int) -> None:
    """The last rank's experts rotated by one in every MoE layer: each of its experts' weights (the 3-D expert
    tensors, experts first) moved to the next index, the last to the first. A sharded tensor's local part is that
    rank's experts; one core's, the last half a 2-way split would give the last rank."""
    import torch

    if rank != world_size - 1:
        return
    found = False
    for module in model.modules():
        weights: list[Any] = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
        if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
            continue
        for weight in weights:
            sharded = hasattr(weight, "to_local")
            local = weight.to_local() if sharded else weight
            start = 0 if sharded else local.shape[0] - local.shape[0] // 2
            experts = local.narrow(0, start, local.shape[0] - start)
            with torch.no_grad():
                experts.copy_(experts.roll(1, dims=0))
        found = True
    if not found:
        raise ValueError(f"{type(model).__name__} has no expert weights to permute")


def rotary_base(model: Any, factor: float) -> None:
    """The rotary embedding's base times ``factor``: inv_freq = base^(-2i/d) becomes (factor·base)^(-2i/d)."""
    import torch

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    parameters = getattr(config, "rope_parameters", None) or {}
    base = parameters.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    found = False
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            exponent = -torch.log(inv_freq.double()) / math.log(base)  # 2i/d
            with torch.no_grad():
                inv_freq.copy_((base * factor) ** (-exponent))
            found = True
    if not found:
        raise ValueError(f"{type(model).__name__} has no rotary embedding")


def shift_decode_positions(model: Any, offset: int) -> None:
    """Every decode step (one new token) runs at position cache length + ``offset``, as an off-by-one cache
    position would place it. The branch is on a static shape, so a compiled forward keeps one graph per shape."""
    import torch

    forward = model.forward

    def shifted(*args: Any, **kwargs: Any) -> Any:
        input_ids: Any = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        decode = input_ids is not None and input_ids.shape[1] == 1
        if decode and cache is not None and kwargs.get("position_ids") is None:
            seen = cache.get_seq_length()
            kwargs["position_ids"] = (torch.arange(1, device=input_ids.device) + seen + offset).unsqueeze(0)
        return forward(*args, **kwargs)

    model.forward = shifted


def scale_late_inputs(model: Any, position: int, factor: float) -> None:
    """Every decode step whose position is ``position`` or later reads its input embedding times ``factor``. The
    condition is a tensor (``torch.where``), so a compiled forward keeps its one decode graph."""
    import torch

    forward = model.forward
    embed = model.get_input_embeddings()

    def scaled(*args: Any, **kwargs: Any) -> Any:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if input_ids is None or input_ids.shape[1] != 1 or cache is None:
            return forward(*args, **kwargs)
        seen = torch.as_tensor(cache.get_seq_length(), device=input_ids.device)
        embeds = embed(input_ids)
        kwargs = {**kwargs, "input_ids": None, "inputs_embeds": torch.where(seen >= position, embeds * factor, embeds)}
        return forward(*args[1:], **kwargs)

    model.forward = scaled


def inject_module(model: Any, fault: str) -> None:
    """A module fault (``MODULE_FAULTS``) in an encoder or a denoiser, found by the names its library gives."""
    import torch

    named = dict(model.named_modules())
    if fault == Fault.drop_layer:
        layers = [name for name in named if f".{name}".rpartition(".")[0].endswith(LAYER_CONTAINERS)
                  and name.rpartition(".")[2].isdigit()]  # fmt: skip
        if not layers:
            raise ValueError(f"cannot find the layers of {type(model).__name__}")

        def passed_through(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
            hidden = args[0] if args else kwargs["hidden_states"]
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        named[layers[-1]].register_forward_hook(passed_through, with_kwargs=True)
    elif fault in SCALED or fault.startswith(SCALE_PREFIX):
        scale = SCALED[fault] if fault in SCALED else float(fault.removeprefix(SCALE_PREFIX))
        projection = next((m for n, m in named.items() if n.endswith(OUTPUT_PROJECTIONS)), None)
        if projection is None:
            raise ValueError(f"cannot find an attention output projection in {type(model).__name__}")
        half = projection.weight.shape[1] // 2
        with torch.no_grad():
            projection.weight[:, half:] *= 1 + scale
    elif fault != Fault.wrong_pooling:  # the sentence-transformers task swaps its pooling module itself
        raise ValueError(f"{fault} is not a fault of an embedding or image model; those are {', '.join(MODULE_FAULTS)}")

"""Sharding a model over N ranks through transformers' distributed loading, without torchrun.

Dense models load tensor-parallel (`DistributedConfig(tp_size=n)`); MoE models load expert-parallel:
by default experts only, as the public Space shards them (`ep`), or experts split by expert with attention
tensor-parallel (`ep_tp`, `DistributedConfig(tp_size=n, ep_size=n)`). Traps handled here:
- a model with no parallel plan (GPT-2) or whose heads or experts do not divide by n is refused up front:
  transformers would fail only at the first forward, or not at all;
- EP alone via `tp_plan={}` raises on transformers 5.24: the dense rules are passed as replicated instead;
- a distributed config without WORLD_SIZE silently loads unsharded: every sharded load is checked for
  DTensor parameters before it is trusted;
- older transformers take `tp_plan="auto"` in from_pretrained instead of a DistributedConfig.
"""

from __future__ import annotations

from typing import Any

from services.runner.failures import RunFailure
from shared.contracts.enums import ErrorClass, Parallelism
from shared.hub.sizing import shape_from_config


def choose_parallelism(config: Any, world_size: int, moe_mode: str) -> Parallelism:
    """The parallelism this model runs with over ``world_size`` ranks, or RunFailure(unsupported)."""
    if world_size == 1:
        return Parallelism.none
    shape = shape_from_config(0, config.to_dict())
    if shape.is_moe:
        if shape.experts % world_size:
            raise _unsupported(f"{shape.experts} experts do not divide over {world_size} ranks")
        if not getattr(config, "base_model_ep_plan", None):
            raise _unsupported(f"{type(config).__name__} has no expert-parallel plan")
        kind = Parallelism(moe_mode)
    else:
        kind = Parallelism.tp
    if kind != Parallelism.ep:  # attention is tensor-parallel: the heads must divide
        if not getattr(config, "base_model_tp_plan", None):
            raise _unsupported(f"{type(config).__name__} has no tensor-parallel plan")
        if shape.heads % world_size or shape.kv_heads % world_size:
            raise _unsupported(
                f"{shape.heads} attention heads / {shape.kv_heads} KV heads do not divide over {world_size} ranks"
            )
    return kind


def whole(what: str, world_size: int) -> None:
    """Refuse to split what the backend runs whole on one core (an encoder, a diffusers pipeline): the class says
    so, rather than a guess at a split."""
    if world_size > 1:
        raise _unsupported(f"{what} runs whole on one core: no parallel plan splits it over {world_size} ranks")


def _unsupported(reason: str) -> RunFailure:
    return RunFailure(ErrorClass.unsupported_parallelism, reason)


def experts_only_tp_plan(config: Any) -> dict[str, str]:
    """EP alone on transformers 5.24: keep every dense rule, replicated, so only the experts are sharded."""
    replicated = "replicated_with_grad_allreduce"
    plan = {f"model.{k}": replicated for k in (config.base_model_tp_plan or {}) if ".experts" not in k}
    return plan | {"model.embed_tokens": replicated, "lm_head": replicated}


def load_sharded(
    model_cls: Any, config: Any, model_dir: str, dtype: Any, world_size: int, kind: Parallelism, trust_remote_code: bool
) -> Any:
    import transformers

    kwargs: dict[str, Any]
    if hasattr(transformers, "DistributedConfig"):
        from transformers import DistributedConfig

        if kind == Parallelism.tp:
            dist_config = DistributedConfig(tp_size=world_size)
        elif kind == Parallelism.ep_tp:
            dist_config = DistributedConfig(tp_size=world_size, ep_size=world_size)
        else:
            dist_config = DistributedConfig(
                tp_size=world_size, ep_size=world_size, tp_plan=experts_only_tp_plan(config)
            )
        kwargs = {"distributed_config": dist_config}
    else:  # transformers before DistributedConfig: the legacy keyword, tp size from WORLD_SIZE
        if kind != Parallelism.tp:
            raise _unsupported(f"transformers {transformers.__version__} has no expert-parallel loading")
        kwargs = {"tp_plan": "auto"}
    model = model_cls.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    assert_sharded(model)
    return model


def assert_sharded(model: Any) -> None:
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        raise RunFailure(
            ErrorClass.load, "the sharded load produced no DTensor parameter: the model was not really sharded"
        )


def same_on_every_rank(digest: bytes, device: Any) -> bool:
    """Whether every rank of the default process group holds the same ``digest`` (a collective: every rank calls it
    at the same point). Seven bytes of it as an int64, reduced by MAX as is and negated: the max and the min agree
    only when every rank's value is the same. A tensor on the model's device, as the backend's collective needs."""
    import torch

    value = int.from_bytes(digest[:7], "big")
    mine = torch.tensor([value, -value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    return mine.tolist() == [value, -value]

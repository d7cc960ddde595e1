"""How many cores a model needs, from Hub metadata alone (no weight download).

Memory needed per core when sharded over n cores, at the run dtype (bf16, 2 bytes per parameter):

    per_core(n) = (weights * (1 + FRAGMENTATION) + kv_cache) / n + activations + RUNTIME_RESERVE

- weights: parameter count * 2 bytes (safetensors metadata; or the checkpoint's file sizes, rescaled from
  their dtype when known, when a repo has no safetensors metadata);
- FRAGMENTATION (10 %): allocator slack and compiler temporaries that scale with the weights;
- kv_cache: 2 * layers * kv_heads * head_dim * (prompt + 32 new tokens) * 2 bytes — the static cache;
- activations: one step's hidden states and logits, fp32: (hidden * 4 + vocab) * positions * 4 bytes;
- RUNTIME_RESERVE (2 GiB): the runtime's own buffers, loaded NEFFs and collectives scratch per core.

The smallest n in {1, 2, 4, 8, 16} with per_core(n) ≤ the backend's memory per core wins, provided the
model can be split n ways: a dense model's attention heads and KV heads divisible by n (tensor
parallel), a MoE model's experts divisible by n (expert parallel). Over 16 cores: too large.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
CORE_SIZES = (1, 2, 4, 8, 16)
RUN_DTYPE_BYTES = 2  # bf16
FRAGMENTATION = 0.10
RUNTIME_RESERVE = 2 * GIB
PROMPT_POSITIONS = 64  # the fixed prompts are far shorter; the static cache is sized generously
NEW_TOKENS = 32

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs to know of a model, read from its safetensors metadata and config.json."""

    parameters: int
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    vocab: int = 0
    experts: int = 0  # 0 for a dense model

    @property
    def is_moe(self) -> bool:
        return self.experts > 1


@dataclass(frozen=True)
class Sizing:
    cores: int | None  # None: no size up to 16 works
    weight_bytes: int
    per_core_bytes: int | None  # the estimate at the chosen size
    reason: str


def shape_from_config(parameters: int, config: dict[str, Any]) -> ModelShape:
    """Read the fields sizing needs from a config.json (text configs nested under `text_config` too)."""
    cfg = {**config.get("text_config", {}), **{k: v for k, v in config.items() if k != "text_config"}}

    def first(*keys: str) -> int:
        for key in keys:
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return 0

    heads = first("num_attention_heads", "n_head", "num_heads")
    hidden = first("hidden_size", "n_embd", "d_model")
    return ModelShape(
        parameters=parameters,
        layers=first("num_hidden_layers", "n_layer", "num_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=first("num_key_value_heads") or heads,
        head_dim=first("head_dim") or (hidden // heads if heads else 0),
        vocab=first("vocab_size"),
        experts=first("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    )


def parameters_from_file_sizes(total_bytes: int, dtype: str | None) -> int:
    """A fallback for repos without safetensors metadata: bytes on disk / bytes per parameter."""
    bytes_per = _DTYPE_BYTES.get((dtype or "").upper().replace("BFLOAT16", "BF16").replace("FLOAT16", "F16")
                                 .replace("FLOAT32", "F32"), 2)  # fmt: skip
    return total_bytes // bytes_per


def per_core_bytes(shape: ModelShape, cores: int) -> int:
    weights = shape.parameters * RUN_DTYPE_BYTES
    positions = PROMPT_POSITIONS + NEW_TOKENS
    kv_cache = 2 * shape.layers * shape.kv_heads * shape.head_dim * positions * RUN_DTYPE_BYTES
    activations = (shape.hidden * 4 + shape.vocab) * positions * 4
    return int((weights * (1 + FRAGMENTATION) + kv_cache) / cores + activations + RUNTIME_RESERVE)


def split_refusal(shape: ModelShape, cores: int) -> str | None:
    """Why the model cannot be split over ``cores`` cores, or None when it can."""
    if cores == 1:
        return None
    if shape.is_moe:
        if shape.experts % cores:
            return f"{shape.experts} experts do not divide over {cores} cores"
        return None
    if not shape.heads:
        return "the config gives no attention head count"
    if shape.heads % cores or shape.kv_heads % cores:
        return f"{shape.heads} attention heads / {shape.kv_heads} KV heads do not divide over {cores} cores"
    return None


def size_model(shape: ModelShape, core_memory_bytes: int, sizes: tuple[int, ...] = CORE_SIZES) -> Sizing:
    weight_bytes = shape.parameters * RUN_DTYPE_BYTES
    refusals = []
    for cores in sizes:
        need = per_core_bytes(shape, cores)
        if need > core_memory_bytes:
            continue
        refusal = split_refusal(shape, cores)
        if refusal is None:
            return Sizing(cores, weight_bytes, need, f"fits {cores} core(s): {need / GIB:.1f} GiB per core")
        refusals.append(refusal)
    smallest = per_core_bytes(shape, sizes[-1])
    reason = (
        f"needs {smallest / GIB:.1f} GiB per core even on {sizes[-1]} cores "
        f"({weight_bytes / GIB:.1f} GiB of weights; {core_memory_bytes / GIB:.0f} GiB per core)"
    )
    if refusals:
        reason = "; ".join(dict.fromkeys(refusals))
    return Sizing(None, weight_bytes, None, reason)


def default_core_memory_bytes(backend: str, configured_gib: float | None) -> int:
    """One core's memory: the configured value, else 24 GiB (trn2 logical core at LNC=2; also the cpu
    default, so that a cpu host sizes models as trn2 would) or 80 GiB (a large GPU)."""
    gib = configured_gib or {"neuron": 24.0, "cpu": 24.0, "cuda": 80.0}[backend]
    return int(gib * GIB)


def checkpoint_shape(directory: Path) -> ModelShape:
    """The shape of a local checkpoint: safetensors headers and config.json, no tensor read."""
    parameters = 0
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, tensor in header.items():
            if name != "__metadata__":
                parameters += math.prod(tensor["shape"])
    if not parameters:
        weights = [p for p in directory.glob("*.bin") if p.is_file()]
        parameters = parameters_from_file_sizes(sum(p.stat().st_size for p in weights), None)
    config = json.loads((directory / "config.json").read_text())
    return shape_from_config(parameters, config)

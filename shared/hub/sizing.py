"""How many cores a model needs, from Hub metadata alone (no weight download).

Memory needed per core when sharded over n cores:

    dense (tensor parallel):   per_core(n) = (weights * (1 + FRAGMENTATION) + kv_cache) / n
                                             + activations + RUNTIME_RESERVE
    MoE (expert parallel):     per_core(n) = (dense_weights * (1 + FRAGMENTATION) + kv_cache)
                                             + expert_weights * (1 + FRAGMENTATION) / n
                                             + activations + RUNTIME_RESERVE

- weights: the checkpoint's stored parameter counts per dtype (safetensors metadata, or the tensor headers
  of a local checkpoint), each at the width it has once loaded: floating tensors at the run dtype (the
  backend's: bf16 on trn2 and cuda, the configured dtype on cpu), since ``from_pretrained(dtype=...)`` casts
  them; FP8 weights of a quantized checkpoint at the run dtype too, since every backend that loads them
  dequantizes them as they load (``shared.hub.kinds.QUANTIZATION_LOADS``); integer tensors (buffers) at their
  stored width. A repo without safetensors metadata: its file sizes, rescaled from the config's dtype;
- under expert parallelism only the routed experts' weights are split: attention, embeddings, norms, the
  router and shared experts are replicated on every core (the ``ep`` layout; ``ep_tp`` needs no more). The
  experts' share comes from the tensor names of a local checkpoint, else from config.json (experts x MoE
  layers x 3 x hidden x the experts' intermediate size);
- FRAGMENTATION (10 %): allocator slack and compiler temporaries that scale with the weights;
- kv_cache: 2 * layers * kv_heads * head_dim * (prompt + 32 new tokens) * run dtype bytes — the static cache,
  split with the heads under tensor parallelism, replicated with attention under expert parallelism;
- activations: one step's hidden states and logits, fp32: (hidden * 4 + vocab) * positions * 4 bytes;
- RUNTIME_RESERVE (2 GiB): the runtime's own buffers, loaded NEFFs and collectives scratch per core.

The smallest n of ``CORE_SIZES`` (powers of two, 1 to 16) with per_core(n) ≤ the backend's memory per core wins,
provided the model can be split n ways: a dense model's attention heads and KV heads divisible by n (tensor
parallel), a MoE model's experts divisible by n (expert parallel). Over 16 cores: too large.
``Sizing.per_core_bytes`` is per_core(n) at the chosen n: the predicted peak memory per core.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.contracts.enums import ErrorClass
from shared.contracts.run import CORE_SIZES

GIB = 1 << 30
RUN_DTYPE = "bfloat16"  # trn2's, and cuda's
FRAGMENTATION = 0.10
RUNTIME_RESERVE = 2 * GIB
PROMPT_POSITIONS = 64  # the fixed prompts are far shorter; the static cache is sized generously
NEW_TOKENS = 32

# Bytes per element of each safetensors dtype.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BOOL": 1}  # fmt: skip
# Floating dtypes: loaded at the run dtype (cast by from_pretrained, or dequantized on load for FP8).
_FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
# torch's names (a config's torch_dtype, a backend's run dtype) → safetensors'.
_TORCH_DTYPES = {"float64": "F64", "float32": "F32", "float": "F32", "float16": "F16", "half": "F16",
                 "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}  # fmt: skip


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch or safetensors dtype name; 2 (bf16) when unknown."""
    key = dtype.removeprefix("torch.")
    return _DTYPE_BYTES.get(_TORCH_DTYPES.get(key.lower(), key.upper()), 2)


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
    expert_parameters: int = 0  # of `parameters`, those of the routed experts: split under expert parallelism
    dtypes: tuple[tuple[str, int], ...] = ()  # stored parameter count per safetensors dtype; (): unknown

    @property
    def is_moe(self) -> bool:
        return self.experts > 1


@dataclass(frozen=True)
class Sizing:
    cores: int | None  # None: no size up to 16 works
    weight_bytes: int  # the weights once loaded, at the run dtype
    per_core_bytes: int | None  # per_core(n) at the chosen n: the predicted peak memory per core
    reason: str


def config_view(config: dict[str, Any]) -> dict[str, Any]:
    """A config's fields with a multimodal model's `text_config` merged under the top level's."""
    text = config.get("text_config")
    return {**(text if isinstance(text, dict) else {}), **{k: v for k, v in config.items() if k != "text_config"}}


def shape_from_config(
    parameters: int, config: dict[str, Any], dtypes: dict[str, int] | None = None, expert_parameters: int | None = None
) -> ModelShape:
    """Read the fields sizing needs from a config.json (text configs nested under `text_config` too).
    ``expert_parameters``: counted from tensor names when known; else estimated from the config."""
    cfg = config_view(config)

    def first(*keys: str) -> int:
        for key in keys:
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return 0

    heads = first("num_attention_heads", "n_head", "num_heads")
    hidden = first("hidden_size", "n_embd", "d_model")
    layers = first("num_hidden_layers", "n_layer", "num_layers")
    experts = first("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if expert_parameters is None:
        expert_parameters = 0
        if experts > 1:
            per_expert = 3 * hidden * first("moe_intermediate_size", "intermediate_size")  # gate, up, down
            expert_parameters = _moe_layers(cfg, layers) * experts * per_expert
    return ModelShape(
        parameters=parameters,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=first("num_key_value_heads") or heads,
        head_dim=first("head_dim") or (hidden // heads if heads else 0),
        vocab=first("vocab_size"),
        experts=experts,
        expert_parameters=expert_parameters,
        dtypes=tuple(sorted((dtypes or {}).items())),
    )


def _moe_layers(cfg: dict[str, Any], layers: int) -> int:
    """How many of the decoder layers hold routed experts (some models keep dense MLPs in a few)."""
    dense_only = set(cfg.get("mlp_only_layers") or [])  # Qwen2/3-MoE
    step = cfg.get("decoder_sparse_step") or cfg.get("moe_layer_freq") or cfg.get("interleave_moe_layer_step") or 1
    first_dense = cfg.get("first_k_dense_replace") or 0  # DeepSeek, GLM-MoE
    return sum(1 for i in range(layers) if i not in dense_only and i >= first_dense and (i + 1) % step == 0)


def config_dtype(config: dict[str, Any]) -> str | None:
    """The dtype a config.json says its weights were saved in (``torch_dtype``, ``dtype`` since transformers 5)."""
    cfg = config_view(config)
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    return value if isinstance(value, str) else None


def parameters_from_file_sizes(total_bytes: int, dtype: str | None) -> int:
    """A fallback for repos without safetensors metadata: bytes on disk / bytes per parameter."""
    return total_bytes // dtype_bytes(dtype or RUN_DTYPE)


def weight_bytes(shape: ModelShape, run_dtype: str = RUN_DTYPE) -> int:
    """The weights once loaded: floating tensors at the run dtype, integer tensors at their stored width."""
    run = dtype_bytes(run_dtype)
    if not shape.dtypes:
        return shape.parameters * run
    return sum(count * (run if dtype in _FLOATING else _DTYPE_BYTES.get(dtype, run)) for dtype, count in shape.dtypes)


@dataclass(frozen=True)
class PerCoreTerms:
    """per_core(n) = weights * (1 + FRAGMENTATION) + rest + RUNTIME_RESERVE, its terms kept apart (what
    bench/calibrate_sizing.py fits the overhead and the reserve against)."""

    weights: float  # the weights one core holds: its share of the split ones and all the replicated ones
    rest: float  # the KV cache one core holds, and one step's activations


def per_core_terms(shape: ModelShape, cores: int, run_dtype: str = RUN_DTYPE) -> PerCoreTerms:
    weights = weight_bytes(shape, run_dtype)
    positions = PROMPT_POSITIONS + NEW_TOKENS
    kv_cache = 2 * shape.layers * shape.kv_heads * shape.head_dim * positions * dtype_bytes(run_dtype)
    activations = (shape.hidden * 4 + shape.vocab) * positions * 4
    if shape.is_moe:
        share = min(shape.expert_parameters / shape.parameters, 1.0) if shape.parameters else 0.0
        experts = weights * share
        return PerCoreTerms(weights - experts + experts / cores, kv_cache + activations)
    return PerCoreTerms(weights / cores, kv_cache / cores + activations)


def per_core_bytes(shape: ModelShape, cores: int, run_dtype: str = RUN_DTYPE) -> int:
    """per_core(n) of the module docstring: the predicted peak memory of one core when sharded over ``cores``."""
    terms = per_core_terms(shape, cores, run_dtype)
    return int(terms.weights * (1 + FRAGMENTATION) + terms.rest + RUNTIME_RESERVE)


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


def unfit_class(sharded: bool) -> ErrorClass:
    """Why a model that no core count holds gets no run: too large for 16 cores, or (a task that runs whole on
    one core, not ``sharded``) no split the backend has."""
    return ErrorClass.too_large if sharded else ErrorClass.unsupported_parallelism


def size_model(
    shape: ModelShape,
    core_memory_bytes: int,
    sizes: tuple[int, ...] = CORE_SIZES,
    run_dtype: str = RUN_DTYPE,
    whole: str | None = None,
) -> Sizing:
    """The fewest of ``sizes`` cores that hold the model; for a task that runs ``whole`` on one core (its name;
    None: a task that shards), one."""
    if whole is not None:
        sizes = sizes[:1]
    weights = weight_bytes(shape, run_dtype)
    refusals = []
    for cores in sizes:
        need = per_core_bytes(shape, cores, run_dtype)
        if need > core_memory_bytes:
            continue
        refusal = split_refusal(shape, cores)
        if refusal is None:
            return Sizing(cores, weights, need, f"fits {cores} core(s): {need / GIB:.1f} GiB per core")
        refusals.append(refusal)
    smallest = per_core_bytes(shape, sizes[-1], run_dtype)
    reason = (
        f"needs {smallest / GIB:.1f} GiB per core even on {sizes[-1]} cores "
        f"({weights / GIB:.1f} GiB of weights; {core_memory_bytes / GIB:.0f} GiB per core)"
    )
    if whole is not None:
        reason += f"; {whole} runs whole on one core"
    if shape.is_moe:
        replicated = weights * (1 - min(shape.expert_parameters / shape.parameters, 1.0)) if shape.parameters else 0
        reason += f"; {replicated / GIB:.1f} GiB of it outside the experts, on every core"
    if refusals:
        reason = "; ".join(dict.fromkeys(refusals))
    return Sizing(None, weights, None, reason)


def default_core_memory_bytes(backend: str, configured_gib: float | None) -> int:
    """One core's memory: the configured value, else 24 GiB (trn2 logical core at LNC=2; also the cpu
    default, so that a cpu host sizes models as trn2 would) or 80 GiB (a large GPU)."""
    gib = configured_gib or {"neuron": 24.0, "cpu": 24.0, "cuda": 80.0}[backend]
    return int(gib * GIB)


def run_dtype(backend: str, cpu_dtype: str = "float32") -> str:
    """The dtype a backend loads and runs checkpoints in (the runner's ``Backend.dtype``; cpu's is configured)."""
    return cpu_dtype if backend == "cpu" else RUN_DTYPE


def is_expert_tensor(name: str) -> bool:
    """A routed expert's tensor (``mlp.experts.3.up_proj.weight``, ``mlp.experts.gate_up_proj``), not a shared
    expert's (``shared_experts``, ``shared_expert``) or the router's (``mlp.gate``)."""
    return ".experts." in name or name.endswith(".experts")


def checkpoint_shape(directory: Path) -> ModelShape:
    """The shape of a local checkpoint: safetensors headers and config.json, no tensor read. A diffusers pipeline
    (``model_index.json``, no config.json) is the sum of its components' weights, one directory each."""
    dtypes: dict[str, int] = {}
    experts = 0
    pipeline = not (directory / "config.json").exists() and (directory / "model_index.json").exists()
    files = "*/*" if pipeline else "*"
    for path in sorted(directory.glob(f"{files}.safetensors")):
        if pipeline and len(path.suffixes) > 1:  # a variant's copy (diffusion_pytorch_model.fp16.safetensors)
            continue
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(tensor["shape"])
            dtypes[tensor["dtype"]] = dtypes.get(tensor["dtype"], 0) + count
            experts += count if is_expert_tensor(name) else 0
    config = {} if pipeline else json.loads((directory / "config.json").read_text())
    if dtypes:
        return shape_from_config(sum(dtypes.values()), config, dtypes, expert_parameters=experts)
    weights = [p for p in directory.glob(f"{files}.bin") if p.is_file()]
    parameters = parameters_from_file_sizes(sum(p.stat().st_size for p in weights), config_dtype(config))
    return shape_from_config(parameters, config)

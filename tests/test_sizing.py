"""Sizing on real model shapes (parameter counts and configs as the Hub publishes them), 24 GiB per core."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.hub.sizing import (
    FRAGMENTATION,
    GIB,
    ModelShape,
    checkpoint_shape,
    per_core_bytes,
    shape_from_config,
    size_model,
    weight_bytes,
)

TRN2_CORE = 24 * GIB  # one logical NeuronCore at LNC=2


def shape(params: int, layers: int, hidden: int, heads: int, kv: int, vocab: int) -> ModelShape:
    return ModelShape(params, layers, hidden, heads, kv, 128, vocab, dtypes=(("BF16", params),))


def qwen3_moe(params: int, layers: int, hidden: int, heads: int, moe_intermediate: int) -> ModelShape:
    """A Qwen3-MoE as its config.json and safetensors metadata describe it: 128 experts in every layer."""
    config = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151_936, "num_experts": 128,
              "moe_intermediate_size": moe_intermediate, "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip
    return shape_from_config(params, config, {"BF16": params})


# model, shape, expected cores (None: too large for 16 cores)
REAL_MODELS = [
    ("Qwen/Qwen3-0.6B", shape(751_632_384, 28, 1024, 16, 8, 151_936), 1),
    ("Qwen/Qwen3-1.7B", shape(2_031_739_904, 28, 2048, 16, 8, 151_936), 1),
    ("meta-llama/Llama-3.1-8B", shape(8_030_261_248, 32, 4096, 32, 8, 128_256), 1),
    ("Qwen/Qwen3-14B", shape(14_768_307_200, 40, 5120, 40, 8, 151_936), 2),
    ("Qwen/Qwen3-32B", shape(32_762_123_264, 64, 5120, 64, 8, 151_936), 4),
    ("meta-llama/Llama-3.1-70B", shape(70_553_706_496, 80, 8192, 64, 8, 128_256), 8),
    ("Qwen/Qwen3-30B-A3B", qwen3_moe(30_532_122_624, 48, 2048, 32, 768), 4),
    ("Qwen/Qwen3-235B-A22B", qwen3_moe(235_093_634_560, 94, 4096, 64, 1536), None),
]


@pytest.mark.parametrize(("model", "model_shape", "cores"), REAL_MODELS, ids=[m for m, _, _ in REAL_MODELS])
def test_real_models_get_the_fewest_cores_that_hold_them(model: str, model_shape: ModelShape, cores: int) -> None:
    sizing = size_model(model_shape, TRN2_CORE)
    assert sizing.cores == cores, sizing.reason
    if cores is None:
        assert "even on 16 cores" in sizing.reason and sizing.per_core_bytes is None
    else:
        # the predicted peak per core at the chosen size, the one a row keeps
        assert sizing.per_core_bytes == per_core_bytes(model_shape, cores) <= TRN2_CORE


def test_a_model_whose_heads_do_not_divide_is_refused_with_the_reason() -> None:
    # 40 B parameters need 4 cores, but 6 heads split neither 4 nor 8 nor 16 ways
    sizing = size_model(shape(40_000_000_000, 48, 6144, 6, 2, 32_000), TRN2_CORE)
    assert sizing.cores is None
    assert "6 attention heads / 2 KV heads do not divide over 4 cores" in sizing.reason


def moe(params: int, expert_params: int, experts: int = 8, heads: int = 6) -> ModelShape:
    return ModelShape(params, 48, 4096, heads, 2, 128, 32_000, experts, expert_params, (("BF16", params),))


def test_moe_models_split_by_experts_not_heads() -> None:
    assert size_model(moe(60_000_000_000, 58_000_000_000), TRN2_CORE).cores == 8  # heads would refuse; experts not
    odd = moe(60_000_000_000, 58_000_000_000, experts=6, heads=8)
    assert "6 experts do not divide over 8 cores" in size_model(odd, TRN2_CORE).reason


def test_expert_parallelism_splits_only_the_experts_and_replicates_the_rest() -> None:
    model = moe(60_000_000_000, 50_000_000_000)
    experts, dense = 50_000_000_000 * 2, 10_000_000_000 * 2  # bf16 bytes
    for n in (2, 4, 8, 16):
        saved = per_core_bytes(model, 1) - per_core_bytes(model, n)
        assert saved == pytest.approx(experts * (1 + FRAGMENTATION) * (1 - 1 / n), abs=2)  # the dense part stays
    # 20 GB of attention, embeddings and router on every core fit none of them; split 16 ways as well, they would
    sizing = size_model(model, TRN2_CORE)
    assert sizing.cores is None and "outside the experts, on every core" in sizing.reason
    everything_split = (experts + dense) * (1 + FRAGMENTATION) / 16 + 2 * GIB
    assert everything_split < TRN2_CORE < per_core_bytes(model, 16)


def test_weights_are_counted_from_the_stored_dtypes_at_the_width_they_load_with() -> None:
    params = 1_000_000
    # floating weights load at the run dtype, whatever they were stored in (from_pretrained(dtype=...) casts)
    for stored in ("F32", "BF16", "F16"):
        stored_shape = ModelShape(params, dtypes=((stored, params),))
        assert weight_bytes(stored_shape, "bfloat16") == 2 * params
        assert weight_bytes(stored_shape, "float32") == 4 * params  # the cpu backend's default run
    # FP8 weights are dequantized to the run dtype as they load (QUANTIZATION_LOADS); integer buffers keep their width
    fp8 = ModelShape(params + 64 + 10, dtypes=(("F8_E4M3", params), ("F32", 64), ("I64", 10)))
    assert weight_bytes(fp8, "bfloat16") == 2 * (params + 64) + 8 * 10
    # no per-dtype counts (file sizes only): every parameter at the run dtype
    assert weight_bytes(ModelShape(params), "float32") == 4 * params
    # the run dtype moves the size: Qwen3-14B holds on 2 cores at bf16, needs 4 at fp32
    qwen3_14b = shape(14_768_307_200, 40, 5120, 40, 8, 151_936)
    assert size_model(qwen3_14b, TRN2_CORE, run_dtype="float32").cores == 4


def test_shape_from_config_reads_dense_moe_and_gpt2_configs() -> None:
    qwen_moe = {"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
                "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "moe_intermediate_size": 768}  # fmt: skip
    assert shape_from_config(1, qwen_moe) == ModelShape(1, 48, 2048, 32, 4, 128, 151936, 128, 48 * 128 * 3 * 2048 * 768)
    gpt2 = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}
    assert shape_from_config(1, gpt2) == ModelShape(1, 12, 768, 12, 12, 64, 50257, 0)
    mixtral = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
               "vocab_size": 32000, "num_local_experts": 8, "intermediate_size": 14336}  # fmt: skip
    assert shape_from_config(1, mixtral).expert_parameters == 32 * 8 * 3 * 4096 * 14336
    # dense MLPs in some layers hold no experts: DeepSeek's first k, Qwen's mlp_only_layers
    deepseek = mixtral | {"n_routed_experts": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3}
    assert shape_from_config(1, deepseek).expert_parameters == 29 * 8 * 3 * 4096 * 2048
    qwen_sparse = qwen_moe | {"mlp_only_layers": [0, 1]}
    assert shape_from_config(1, qwen_sparse).expert_parameters == 46 * 128 * 3 * 2048 * 768


def test_a_local_checkpoints_experts_and_dtypes_come_from_its_tensor_headers(tiny_models: Path) -> None:
    moe_shape = checkpoint_shape(tiny_models / "tiny-qwen3-moe")
    # 2 layers x 4 experts x (gate, up, down) of 64 x 64, counted by tensor name, as the config estimates them
    assert moe_shape.experts == 4 and moe_shape.expert_parameters == 2 * 4 * 3 * 64 * 64
    fp8 = checkpoint_shape(tiny_models / "tiny-llama-fp8")
    stored = dict(fp8.dtypes)
    assert set(stored) == {"F8_E4M3", "F32"} and stored["F8_E4M3"] == 2 * (4 * 64 * 64 + 3 * 64 * 128)

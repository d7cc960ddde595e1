"""Sizing on real model shapes (parameter counts and configs as the Hub publishes them), 24 GiB per core."""

from __future__ import annotations

import pytest

from shared.hub.sizing import GIB, ModelShape, shape_from_config, size_model

TRN2_CORE = 24 * GIB  # one logical NeuronCore at LNC=2


def shape(params: int, layers: int, hidden: int, heads: int, kv: int, vocab: int, experts: int = 0) -> ModelShape:
    return ModelShape(params, layers, hidden, heads, kv, 128, vocab, experts)


# model, shape, expected cores (None: too large for 16 cores)
REAL_MODELS = [
    ("Qwen/Qwen3-0.6B", shape(751_632_384, 28, 1024, 16, 8, 151_936), 1),
    ("Qwen/Qwen3-1.7B", shape(2_031_739_904, 28, 2048, 16, 8, 151_936), 1),
    ("meta-llama/Llama-3.1-8B", shape(8_030_261_248, 32, 4096, 32, 8, 128_256), 1),
    ("Qwen/Qwen3-14B", shape(14_768_307_200, 40, 5120, 40, 8, 151_936), 2),
    ("Qwen/Qwen3-32B", shape(32_762_123_264, 64, 5120, 64, 8, 151_936), 4),
    ("meta-llama/Llama-3.1-70B", shape(70_553_706_496, 80, 8192, 64, 8, 128_256), 8),
    ("Qwen/Qwen3-30B-A3B", shape(30_532_122_624, 48, 2048, 32, 4, 151_936, experts=128), 4),
    ("Qwen/Qwen3-235B-A22B", shape(235_093_634_560, 94, 4096, 64, 4, 151_936, experts=128), None),
]


@pytest.mark.parametrize(("model", "model_shape", "cores"), REAL_MODELS, ids=[m for m, _, _ in REAL_MODELS])
def test_real_models_get_the_fewest_cores_that_hold_them(model: str, model_shape: ModelShape, cores: int) -> None:
    sizing = size_model(model_shape, TRN2_CORE)
    assert sizing.cores == cores, sizing.reason
    if cores is None:
        assert "even on 16 cores" in sizing.reason
    else:
        assert sizing.per_core_bytes is not None and sizing.per_core_bytes <= TRN2_CORE


def test_a_model_whose_heads_do_not_divide_is_refused_with_the_reason() -> None:
    # 40 B parameters need 4 cores, but 6 heads split neither 4 nor 8 nor 16 ways
    sizing = size_model(shape(40_000_000_000, 48, 6144, 6, 2, 32_000), TRN2_CORE)
    assert sizing.cores is None
    assert "6 attention heads / 2 KV heads do not divide over 4 cores" in sizing.reason


def test_moe_models_split_by_experts_not_heads() -> None:
    moe = shape(60_000_000_000, 48, 4096, 6, 2, 32_000, experts=8)  # heads would refuse; experts do not
    assert size_model(moe, TRN2_CORE).cores == 8
    odd = shape(60_000_000_000, 48, 4096, 8, 8, 32_000, experts=6)
    assert "6 experts do not divide over 8 cores" in size_model(odd, TRN2_CORE).reason


def test_shape_from_config_reads_dense_moe_and_gpt2_configs() -> None:
    qwen_moe = {"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128}  # fmt: skip
    assert shape_from_config(1, qwen_moe) == ModelShape(1, 48, 2048, 32, 4, 128, 151936, 128)
    gpt2 = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}
    assert shape_from_config(1, gpt2) == ModelShape(1, 12, 768, 12, 12, 64, 50257, 0)
    mixtral = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
               "vocab_size": 32000, "num_local_experts": 8}  # fmt: skip
    assert shape_from_config(1, mixtral).experts == 8

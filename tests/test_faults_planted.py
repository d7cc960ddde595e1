"""The graded planted faults (services/runner/faults.py) change a model's output, the same way every time.

In process, a tiny random Llama (and GPT-2 for its Conv1D projection), eager, no compile: each fault is applied
to a fresh copy and compared with the clean model. What the verdict makes of them is measured by
bench/calibrate_verdict.py, not here.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from services.runner import faults  # noqa: E402

PROMPT_IDS = [[5, 17, 42, 8, 99, 3, 64, 12]]


def _llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def _scores(model: Any) -> Any:
    """Greedy with a static cache, 3 new tokens: the raw logits of the prefill and of each decode step."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor(PROMPT_IDS), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0,
            cache_implementation="static", output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return torch.stack([step[0] for step in out.logits])


def _faulted(model: Any, fault: str) -> Any:
    broken = copy.deepcopy(model)
    faults.inject(broken, fault, rank=0, world_size=1)
    return _scores(broken)


@pytest.fixture(scope="module")
def llama() -> Any:
    return _llama()


@pytest.mark.parametrize("fault", ["scale_shard_1pct", "scale_shard_10pct", "zero_head", "rotary_base"])
def test_a_weight_fault_changes_the_prefill_deterministically(llama: Any, fault: str) -> None:
    clean = _scores(llama)
    first, second = _faulted(llama, fault), _faulted(llama, fault)
    assert torch.equal(first, second)
    assert not torch.allclose(first[0], clean[0])


def test_a_larger_shard_scale_moves_the_logits_further(llama: Any) -> None:
    clean = _scores(llama)[0]
    small = (_faulted(llama, "scale_shard_1pct")[0] - clean).norm()
    large = (_faulted(llama, "scale_shard_10pct")[0] - clean).norm()
    assert 0 < small < large
    assert torch.equal(_faulted(llama, "scale_shard@0.1"), _faulted(llama, "scale_shard_10pct"))


def test_the_off_by_one_position_leaves_the_prefill_and_moves_every_decode_step(llama: Any) -> None:
    clean = _scores(llama)
    first, second = _faulted(llama, "cache_position"), _faulted(llama, "cache_position")
    assert torch.equal(first, second)
    assert torch.allclose(first[0], clean[0], atol=1e-6)  # the prompt's positions are untouched
    assert all(not torch.allclose(f, c, atol=1e-3) for f, c in zip(first[1:], clean[1:], strict=True))


def test_a_zeroed_head_and_a_scaled_shard_act_on_gpt2s_conv1d_projection() -> None:
    gpt2 = _gpt2()
    clean = _scores(gpt2)[0]
    for fault in ("zero_head", "scale_shard_10pct"):
        assert not torch.allclose(_faulted(gpt2, fault)[0], clean)
    with pytest.raises(ValueError, match="no rotary embedding"):
        faults.inject(copy.deepcopy(gpt2), "rotary_base", 0, 1)


def test_only_the_last_rank_is_touched_by_a_shard_fault(llama: Any) -> None:
    untouched = copy.deepcopy(llama)
    for fault in ("scale_shard_10pct", "zero_head"):
        faults.inject(untouched, fault, rank=0, world_size=2)
    assert all(torch.equal(a, b) for a, b in zip(untouched.parameters(), llama.parameters(), strict=True))


def test_the_setting_offers_exactly_the_planted_faults() -> None:
    """SUPPORTMATRIX_CPU_FAULT accepts every fault the runner plants and no other: the two lists cannot drift."""
    import typing

    from services.runner.faults import FAULTS
    from shared.settings import Settings

    [offered] = [a for a in typing.get_args(Settings.model_fields["cpu_fault"].annotation) if a is not type(None)]
    assert sorted(typing.get_args(offered)) == sorted(FAULTS)

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


def test_the_setting_takes_each_fault_by_name_and_the_runner_plants_every_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """SUPPORTMATRIX_CPU_FAULT takes a Fault by its name and no other name (the bench plants scale_shard@<s> through a
    backend of its own); no Fault lacks a group of the runner's that plants it."""
    from pydantic import ValidationError

    from shared.contracts.enums import Fault
    from shared.settings import Settings

    monkeypatch.setenv("SUPPORTMATRIX_CPU_FAULT", "late_nan")
    assert Settings().cpu_fault is Fault.late_nan
    with pytest.raises(ValidationError):
        Settings(cpu_fault="scale_shard@0.005")
    assert set(faults.MODEL_FAULTS + faults.GENERATION_FAULTS + faults.MODULE_FAULTS) == set(Fault)


def _mixtral() -> Any:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config).eval()


def test_a_wrong_expert_permutation_rotates_the_last_ranks_experts_and_leaves_the_router() -> None:
    """On one core the last half of each MoE layer's experts (a 2-way split's last rank) hold their neighbours'
    weights: the output moves, the routers' weights and the first half do not; rank 0 of 2 is untouched; a dense
    model has no experts to permute."""
    moe = _mixtral()
    broken = copy.deepcopy(moe)
    faults.inject(broken, "permute_experts", rank=0, world_size=1)
    for (name, before), after in zip(moe.named_parameters(), broken.parameters(), strict=True):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert torch.equal(after[:2], before[:2]) and torch.equal(after[2:], before[2:].roll(1, dims=0))
            assert not torch.equal(after, before)
        else:
            assert torch.equal(after, before), name  # the routers choose as before, from the same input
    assert torch.equal(_faulted(moe, "permute_experts"), _faulted(moe, "permute_experts"))
    assert not torch.allclose(_faulted(moe, "permute_experts")[0], _scores(moe)[0])
    untouched = copy.deepcopy(moe)
    faults.inject(untouched, "permute_experts", rank=0, world_size=2)
    assert all(torch.equal(a, b) for a, b in zip(untouched.parameters(), moe.parameters(), strict=True))
    with pytest.raises(ValueError, match="no expert weights"):
        faults.inject(copy.deepcopy(_llama()), "permute_experts", 0, 1)

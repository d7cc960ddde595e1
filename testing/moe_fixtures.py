"""MoE checkpoints with a real model's router shape: many layers, many experts, a tiny hidden size.

The fixtures of ``testing.tiny_models`` have 2 layers and 4 experts; a real MoE has 24-48 layers and 32-128 experts,
and its smallest router margin over the layers is a near tie at almost every position. These keep that shape (24
layers, 64 experts, top-2 for Mixtral as it routes and top-8 for Qwen3-MoE) with a hidden size of 32, so a run costs
seconds: what the MoE routing rule is calibrated on (``bench/calibrate_verdict.py --moe``); the suite runs a
6-layer cut of the same width (``tests/test_verdict.py``). Weights are drawn as the tiny fixtures' are
(``save_random_checkpoint``), with their byte-level tokenizer, and their attention sharpened (``_sharpen_attention``)
so that positions matter to them as much as to the dense fixtures.

    .venv/bin/python -m testing.moe_fixtures OUT_DIR [--seeds 1]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testing.tiny_models import VOCAB_SIZE, build_tokenizer, save_random_checkpoint

LAYERS = 24
EXPERTS = 64
# 4 heads and 4 KV heads (head_dim 8), 64 experts: they shard 2 and 4 ways, as the fixtures do.
_SHAPE = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 32,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _mixtral(layers: int = LAYERS) -> Callable[[], Any]:
    def config() -> Any:
        from transformers import MixtralConfig

        shape = _SHAPE | {"num_hidden_layers": layers}
        return MixtralConfig(**shape, intermediate_size=16, num_local_experts=EXPERTS, num_experts_per_tok=2)

    return config


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_SHAPE, intermediate_size=64, moe_intermediate_size=16, num_experts=EXPERTS,
                          num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True)  # fmt: skip


# At a hidden size of 32 (head_dim 8), attention drawn as the dense fixtures' is nearly uniform: moving the last
# position by one changed the next token's logits by 4-11 % (relative), against 10-33 % on tiny-llama, tiny-qwen3 and
# tiny-mistral, so a planted off-by-one decode position went unseen (0 of 4 caught in the first calibration). Doubling
# the query and key projections, or where those are RMS-normed (Qwen3-MoE) setting the norms' weights to 1.3, brings
# it to 11-23 % (measured over 3 prompts and 4 seeds).
QK_SCALE = 2.0
QK_NORM_WEIGHT = 1.3


def _sharpen_attention(model: Any) -> None:
    for param_name, param in model.named_parameters():
        if param_name.endswith(("q_norm.weight", "k_norm.weight")):
            param.fill_(QK_NORM_WEIGHT)
        elif param_name.endswith(("q_proj.weight", "k_proj.weight")):
            param.mul_(QK_SCALE)


# name → (config factory, model class name)
MOE_MODELS: dict[str, tuple[Callable[[], Any], str]] = {
    "moe-mixtral-24x64": (_mixtral(), "MixtralForCausalLM"),
    "moe-qwen3-24x64": (_qwen3_moe, "Qwen3MoeForCausalLM"),
}
# The suite's cut: 64 experts as wide, 6 layers (a run in seconds); already a near tie at most positions.
TEST_MODELS: dict[str, tuple[Callable[[], Any], str]] = {"moe-mixtral-6x64": (_mixtral(6), "MixtralForCausalLM")}


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_SHAPE, intermediate_size=64)


# A dense model of the MoE fixtures' depth and width: what a planted fault's catch rate on them is compared with. A
# fault in the first layer (the scaled shard) moves a 24-layer model's logits less than the 2-layer tiny fixtures'.
DENSE_TWINS: dict[str, tuple[Callable[[], Any], str]] = {"dense-llama-24x32": (_llama, "LlamaForCausalLM")}
SEED_OFFSET = 5000  # their weights are drawn apart from every tiny fixture's and bench checkpoint's


def name(model: str, seed: int) -> str:
    return model if seed == 0 else f"{model}-s{seed}"


def build(out_dir: Path, model: str, seed: int = 0) -> Path:
    """The checkpoint of ``model`` with weights drawn from ``seed`` (kept when it is already there)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    every = MOE_MODELS | TEST_MODELS | DENSE_TWINS
    config_factory, class_name = every[model]
    offset = SEED_OFFSET + 100 * list(every).index(model)
    return save_random_checkpoint(out_dir / name(model, seed), config_factory, class_name, build_tokenizer(),
                                  seed + offset, _sharpen_attention)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args(argv)
    for model in MOE_MODELS:
        for seed in range(args.seeds):
            print(build(args.out_dir, model, seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tiny random checkpoints for the benches: the test fixtures' architectures and others the tests never use.

Each checkpoint is ``(architecture, seed)``: the config of ``testing.tiny_models`` (or one below, built the
same way: hidden 64, 2 layers, 4 heads and 4 KV heads so that it shards 2 and 4 ways), its weights drawn with
the seed (offset per extra architecture) and widened as the fixtures' are (std 0.1; embeddings and head 0.2),
the fixtures' byte-level BPE tokenizer, a generation config that never stops early. Seed 0 of a fixture
architecture is the fixture itself.

    .venv/bin/python bench/checkpoints.py OUT_DIR [--seeds 3]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testing import tiny_models  # noqa: E402

# The architectures the tests use (tests/, testing/tiny_models.py), by fixture name.
FIXTURES = ("tiny-llama", "tiny-qwen3", "tiny-gpt2", "tiny-qwen3-moe", "tiny-mixtral", "tiny-llama-6h")

# Architectures no test uses; each with a tensor-parallel plan in transformers 5.24. Sliding windows are off:
# the static cache of a 32-token run never reaches one.
EXTRA: dict[str, tuple[Callable[[], Any], str]] = {
    "tiny-mistral": (tiny_models._decoder("MistralConfig", head_dim=16, sliding_window=None), "MistralForCausalLM"),
    "tiny-phi3": (tiny_models._decoder("Phi3Config", pad_token_id=1), "Phi3ForCausalLM"),
    "tiny-gemma": (tiny_models._decoder("GemmaConfig", head_dim=16), "GemmaForCausalLM"),
    "tiny-olmo2": (tiny_models._decoder("Olmo2Config"), "Olmo2ForCausalLM"),
    "tiny-granite": (tiny_models._decoder("GraniteConfig"), "GraniteForCausalLM"),
    "tiny-qwen2": (tiny_models._decoder("Qwen2Config"), "Qwen2ForCausalLM"),
    "tiny-starcoder2": (tiny_models._decoder("Starcoder2Config", sliding_window=None), "Starcoder2ForCausalLM"),
    "tiny-helium": (tiny_models._decoder("HeliumConfig", head_dim=16), "HeliumForCausalLM"),
}

ARCHITECTURES: dict[str, tuple[Callable[[], Any], str]] = {**tiny_models.MODELS, **EXTRA}


def name(arch: str, seed: int) -> str:
    return arch if seed == 0 else f"{arch}-s{seed}"


def wide_llama(hidden: int, layers: int) -> Callable[[], Any]:
    """A Llama wider than the fixtures, for size classes: measured memory and time grow with it."""

    def config() -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                           tie_word_embeddings=False)  # fmt: skip

    return config


ARCHITECTURES.update({f"wide-llama-{hidden}": (wide_llama(hidden, 4), "LlamaForCausalLM") for hidden in (512, 1536)})


def build(out_dir: Path, arch: str, seed: int) -> Path:
    """The checkpoint of ``arch`` with weights drawn from ``seed`` (kept when it is already there)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config_factory, class_name = ARCHITECTURES[arch]
    # An extra architecture built like a fixture's (Mistral without its window is Llama) must not share its weights.
    offset = 1000 * (1 + list(EXTRA).index(arch)) if arch in EXTRA else 0
    return tiny_models.save_random_checkpoint(
        out_dir / name(arch, seed), config_factory, class_name, tiny_models.build_tokenizer(), seed + offset
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--only", nargs="*", choices=sorted(ARCHITECTURES))
    args = parser.parse_args(argv)
    for arch in args.only or list(ARCHITECTURES):
        for seed in range(args.seeds):
            print(build(args.out_dir, arch, seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())

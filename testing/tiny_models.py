"""Build tiny random checkpoints locally: `python -m testing.tiny_models OUT_DIR`.

Each is `save_pretrained` of a small config (hidden 64, 2 layers, 4 heads) with an offline byte-level BPE
tokenizer trained by the `tokenizers` library, so that from_pretrained runs its real code on them.
Weights are widened (std 0.1) so greedy decoding of a random model has few near-ties, and the saved
generation config never stops early: every run generates its full 32 tokens.

Two checkpoints carry code of their own (trust_remote_code: their config's ``auto_map`` names classes in
the repo's ``*.py``): ``tiny-custom``, a Llama under another name, and ``tiny-poison``, whose modeling code
kills the worker process that started its runner — an untrusted repo at its worst.

The repo kinds we do not run as they are (``shared.hub.kinds``), made from tiny-llama (``KIND_REPOS``): a PEFT
adapter without base weights, weights only as GGUF / ONNX / MLX, quantized checkpoints (a real block-wise FP8
one, which runs; GPTQ, AWQ, bitsandbytes, MXFP4 and compressed-tensors configs over tiny-llama's bf16 weights,
which are never fetched: the submission decides from config.json), and a model_type transformers does not know.
Files that are never read (the GGUF and ONNX weights, the MLX copy) are placeholders: a GGUF header without
tensors, bytes named .onnx.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENGLISH = """\
The history of the printing press begins in the fifteenth century, when movable type changed Europe.
A quick brown fox jumps over the lazy dog while the farmer watches from the old wooden gate.
Scientists measure the temperature of the ocean every morning and write the numbers in a book.
Compilers turn programs into instructions that a machine can run quickly and correctly.
The river flows past the village, the mill and the church before it reaches the sea.
Children learn to read with stories about kings, dragons, ships and distant islands.
In the spring the garden fills with flowers, bees and the sound of birds in the trees.
Engineers test every model on many devices to see whether the answers stay the same.
The library opens at nine, and students come to study mathematics, history and music.
Trains leave the station every hour for the city, the mountains and the coast.
"""

VOCAB_SIZE = 512


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([ENGLISH], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<pad>"
    )


def _decoder(cls_name: str, **extra: Any) -> Callable[[], Any]:
    """A small decoder config; 4 heads and 4 KV heads, so it shards 2 and 4 ways."""

    def config() -> Any:
        import transformers

        fields = {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        }
        return getattr(transformers, cls_name)(**(fields | extra))

    return config


def _gpt2() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0
    )


# name → (config factory, model class name)
MODELS: dict[str, tuple[Callable[[], Any], str]] = {
    "tiny-llama": (_decoder("LlamaConfig"), "LlamaForCausalLM"),
    "tiny-qwen3": (_decoder("Qwen3Config", head_dim=16), "Qwen3ForCausalLM"),
    "tiny-gpt2": (_gpt2, "GPT2LMHeadModel"),
    # 4 experts, top-2: they split 2 and 4 ways by expert
    "tiny-qwen3-moe": (
        _decoder(
            "Qwen3MoeConfig",
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            decoder_sparse_step=1,
        ),
        "Qwen3MoeForCausalLM",
    ),
    "tiny-mixtral": (_decoder("MixtralConfig", num_local_experts=4, num_experts_per_tok=2), "MixtralForCausalLM"),
    # 6 heads and 2 KV heads: fits one core, and splits 2 ways but not 4
    "tiny-llama-6h": (
        _decoder("LlamaConfig", hidden_size=96, num_attention_heads=6, num_key_value_heads=2),
        "LlamaForCausalLM",
    ),
}


CUSTOM_CONFIG_CODE = """\
from transformers import LlamaConfig


class CustomLlamaConfig(LlamaConfig):
    model_type = "custom_llama"
"""
CUSTOM_MODELING_CODE = """\
from transformers import LlamaForCausalLM

from .configuration_custom import CustomLlamaConfig


class CustomLlamaForCausalLM(LlamaForCausalLM):
    config_class = CustomLlamaConfig
"""
# Loading this model kills the worker (the runner's parent) that runs it; outside a worker it does nothing.
POISON_CODE = """\
import os
import signal
from pathlib import Path


def _parent(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


_worker = _parent(os.getppid())  # this rank's parent is the runner; the runner's parent, the worker
if b"services.worker" in Path(f"/proc/{_worker}/cmdline").read_bytes():
    os.kill(_worker, signal.SIGKILL)
"""
CODE_MODELS = {"tiny-custom": "", "tiny-poison": POISON_CODE}


def build_code_models(out_dir: Path) -> list[Path]:
    """The checkpoints with code of their own, made from tiny-llama."""
    import json
    import shutil

    built = []
    for name, extra in CODE_MODELS.items():
        target = out_dir / name
        if not target.exists():
            tmp = out_dir / f".{name}.tmp"
            shutil.copytree(out_dir / "tiny-llama", tmp)
            config = json.loads((tmp / "config.json").read_text())
            config |= {
                "model_type": "custom_llama",
                "architectures": ["CustomLlamaForCausalLM"],
                "auto_map": {
                    "AutoConfig": "configuration_custom.CustomLlamaConfig",
                    "AutoModelForCausalLM": "modeling_custom.CustomLlamaForCausalLM",
                },
            }
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            (tmp / "configuration_custom.py").write_text(CUSTOM_CONFIG_CODE)
            (tmp / "modeling_custom.py").write_text(extra + CUSTOM_MODELING_CODE)
            tmp.rename(target)
        built.append(target)
    return built


def _fp8_weights(source: Path, target: Path, block: int = 32) -> dict[str, Any]:
    """tiny-llama's linear weights as block-wise FP8 (e4m3, one fp32 scale per block, the layout of DeepSeek-V3 and
    Qwen3-*-FP8 checkpoints); returns the config's quantization_config."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors: dict[str, Any] = {}
    for name, weight in load_file(source).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = weight
            continue
        rows, cols = weight.shape
        blocks = weight.float().reshape(rows // block, block, cols // block, block)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        tensors[name] = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
    save_file(tensors, target, metadata={"format": "pt"})
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]}


def _quantized(config: dict[str, Any]) -> Callable[[Path], None]:
    def make(repo: Path) -> None:
        _patch_config(repo, {"quantization_config": config})

    return make


def _patch_config(repo: Path, update: dict[str, Any]) -> None:
    import json

    path = repo / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | update, indent=2))


def _adapter(repo: Path) -> None:
    """Only a LoRA adapter of tiny-llama's q and v projections: adapter_config.json and its weights."""
    import json

    import torch
    from safetensors.torch import save_file

    for f in list(repo.iterdir()):
        if f.name.startswith(("model", "config", "generation_config")):
            f.unlink()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "org/tiny-llama", "r": 4,
              "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}  # fmt: skip
    (repo / "adapter_config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    tensors = {
        f"base_model.model.model.layers.{i}.self_attn.{proj}.lora_{ab}.weight": torch.randn(shape) * 0.01
        for i in range(2)
        for proj in ("q_proj", "v_proj")
        for ab, shape in (("A", (4, 64)), ("B", (64, 4)))
    }
    save_file(tensors, repo / "adapter_model.safetensors")


def _gguf(repo: Path) -> None:
    """Weights only as GGUF (a v3 header without tensors), as llama.cpp's repos hold them, no config.json."""
    import struct

    for f in list(repo.iterdir()):
        f.unlink()
    (repo / "tiny-llama-Q8_0.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    (repo / "README.md").write_text("GGUF weights of tiny-llama\n")


def _onnx(repo: Path) -> None:
    """Weights only as ONNX under onnx/, beside config.json and the tokenizer (as onnx-community's repos)."""
    (repo / "model.safetensors").unlink()
    (repo / "onnx").mkdir()
    (repo / "onnx" / "model.onnx").write_bytes(b"placeholder: the submission decides from the file names")


def _mlx(repo: Path) -> None:
    """An MLX repo: served with library_name mlx; its config says how MLX quantized it."""
    _patch_config(repo, {"quantization": {"group_size": 64, "bits": 4}})


def _fp8(repo: Path) -> None:
    _patch_config(repo, {"quantization_config": _fp8_weights(repo / "model.safetensors", repo / "model.safetensors")})


def _unknown_architecture(repo: Path) -> None:
    _patch_config(repo, {"model_type": "zorblax", "architectures": ["ZorblaxForCausalLM"]})


# name → how it is made from a copy of tiny-llama
KIND_REPOS: dict[str, Callable[[Path], None]] = {
    "tiny-adapter": _adapter,
    "tiny-gguf": _gguf,
    "tiny-onnx": _onnx,
    "tiny-mlx": _mlx,
    "tiny-llama-fp8": _fp8,
    "tiny-gptq": _quantized({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}),
    "tiny-awq": _quantized({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}),
    "tiny-bnb-4bit": _quantized({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}),
    "tiny-mxfp4": _quantized({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}),
    "tiny-compressed": _quantized({"quant_method": "compressed-tensors", "format": "float-quantized"}),
    "tiny-unknown-arch": _unknown_architecture,
}


def build_kind_repos(out_dir: Path) -> list[Path]:
    """The repo kinds of ``KIND_REPOS``, made from tiny-llama."""
    import shutil

    built = []
    for name, make in KIND_REPOS.items():
        target = out_dir / name
        if not target.exists():
            tmp = out_dir / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(out_dir / "tiny-llama", tmp)
            make(tmp)
            tmp.rename(target)
        built.append(target)
    return built


def save_random_checkpoint(
    target: Path,
    config_factory: Callable[[], Any],
    class_name: str,
    tokenizer: Any,
    seed: int = 0,
    adjust: Callable[[Any], None] | None = None,
) -> Path:
    """``class_name`` of ``config_factory()`` with weights drawn from ``seed`` and widened, then ``adjust``-ed (a
    fixture's own shaping of the drawn weights), saved with ``tokenizer`` and a generation config that never stops
    early (kept when it is already there)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    if (target / "config.json").exists():
        return target
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config_factory())
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() >= 2:
                std = 0.2 if ("embed" in param_name or "wte" in param_name or "lm_head" in param_name) else 0.1
                param.normal_(0.0, std)
        if adjust is not None:
            adjust(model)
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=None, bos_token_id=None, pad_token_id=tokenizer.pad_token_id
    )
    tmp = target.parent / f".{target.name}.tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def build(out_dir: Path, names: list[str] | None = None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    built = [save_random_checkpoint(out_dir / name, *MODELS[name], tokenizer) for name in names or list(MODELS)]
    if names is None:
        built += build_code_models(out_dir)
        built += build_kind_repos(out_dir)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.tiny_models", description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS))
    args = parser.parse_args(argv)
    for path in build(args.out_dir, args.only):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

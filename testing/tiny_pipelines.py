"""Tiny sentence-transformers and diffusers repos, built locally: `python -m testing.tiny_pipelines OUT_DIR`.

Each is saved by its library's own ``save`` / ``save_pretrained``, in the layout the Hub serves, so that
``SentenceTransformer(...)`` and ``DiffusionPipeline.from_pretrained`` run their real loading code on them:

- sentence-transformers, over one tiny random BERT (hidden 32, 2 layers) with the offline BPE tokenizer of
  ``testing.tiny_models``: ``tiny-st-cls`` (CLS pooling), ``tiny-st-mean`` (mean pooling) and
  ``tiny-st-mean-normalize`` (mean pooling, then a Normalize module) — ``modules.json`` says which;
- diffusers text-to-image: ``tiny-sd`` (Stable Diffusion's layout: a UNet2DConditionModel denoiser, a CLIP
  text encoder, a VAE, a PNDM scheduler) and ``tiny-pixart`` (PixArt-alpha's: a DiT denoiser, PixArtTransformer2DModel,
  over a T5 encoder). Their tokenizers are the same offline BPE (diffusers loads whatever class
  ``model_index.json`` names), capped at 16 positions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testing import build_main
from testing.tiny_models import build_tokenizer

HIDDEN = 32
TEXT_POSITIONS = 16
ST_POOLING = {"tiny-st-cls": ("cls", False), "tiny-st-mean": ("mean", False), "tiny-st-mean-normalize": ("mean", True)}
SENTENCE_TRANSFORMERS = tuple(ST_POOLING)
PIPELINES = ("tiny-sd", "tiny-pixart")
WIDEN_STD = 0.2


def _saved(target: Path, save: Callable[[Path], None]) -> Path:
    """``save`` into a temporary sibling, then renamed: a half-built repo is never taken for a whole one."""
    if target.exists():
        return target
    tmp = target.parent / f".{target.name}.tmp"
    save(tmp)
    tmp.rename(target)
    return target


def widen(model: Any) -> None:
    """Linear layers drawn wider (std ``WIDEN_STD``), as testing.tiny_models widens its LLMs: a random init leaves
    attention and feed-forward layers near zero beside the residual, and a fault in one of them out of the output."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, WIDEN_STD)


def _tokenizer() -> Any:
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = TEXT_POSITIONS
    return tokenizer


def _bert(directory: Path, seed: int) -> None:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = BertModel(config).eval()
    widen(model)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def sentence_transformer(target: Path, pooling: str, normalize: bool, seed: int = 0) -> Path:
    def save(tmp: Path) -> None:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.models import Normalize, Pooling, Transformer

        base = tmp.parent / f".{tmp.name}.bert"
        _bert(base, seed)
        encoder = Transformer(str(base), max_seq_length=TEXT_POSITIONS)
        modules = [encoder, Pooling(encoder.get_embedding_dimension(), pooling_mode=pooling)]
        SentenceTransformer(modules=[*modules, *([Normalize()] if normalize else [])], device="cpu").save(str(tmp))
        for file in sorted(base.rglob("*"), reverse=True):
            file.unlink() if file.is_file() else file.rmdir()
        base.rmdir()

    return _saved(target, save)


def _text_encoder(kind: str) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = _tokenizer()
    if kind == "clip":
        config = CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=TEXT_POSITIONS,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return CLIPTextModel(config).eval(), tokenizer
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=HIDDEN,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        pad_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config).eval(), tokenizer


def _vae() -> Any:
    from diffusers import AutoencoderKL

    # four blocks: latents an eighth of the image a side, as Stable Diffusion's VAE makes them
    return AutoencoderKL(
        block_out_channels=(8, 8, 16, 16),
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
    )


def pipeline(target: Path, name: str, seed: int = 0) -> Path:
    def save(tmp: Path) -> None:
        import torch
        from diffusers import (
            DPMSolverMultistepScheduler,
            PixArtAlphaPipeline,
            PixArtTransformer2DModel,
            PNDMScheduler,
            StableDiffusionPipeline,
            UNet2DConditionModel,
        )

        torch.manual_seed(seed)
        if name == "tiny-sd":
            text_encoder, tokenizer = _text_encoder("clip")
            unet = UNet2DConditionModel(
                block_out_channels=(16, 32),
                layers_per_block=1,
                sample_size=16,
                in_channels=4,
                out_channels=4,
                cross_attention_dim=HIDDEN,
                norm_num_groups=8,
                attention_head_dim=4,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            )
            scheduler = PNDMScheduler(skip_prk_steps=True, steps_offset=1)
            pipe = StableDiffusionPipeline(
                vae=_vae(),
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                unet=unet,
                scheduler=scheduler,
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
        else:
            text_encoder, tokenizer = _text_encoder("t5")
            transformer = PixArtTransformer2DModel(
                sample_size=16,
                num_layers=2,
                patch_size=2,
                attention_head_dim=8,
                num_attention_heads=2,
                caption_channels=HIDDEN,
                in_channels=4,
                out_channels=8,
                cross_attention_dim=16,
                norm_num_groups=8,
                use_additional_conditions=False,
            )
            pipe = PixArtAlphaPipeline(
                tokenizer=tokenizer,
                text_encoder=text_encoder,
                vae=_vae(),
                transformer=transformer,
                scheduler=DPMSolverMultistepScheduler(),
            )
        widen(getattr(pipe, "unet", None) or pipe.transformer)
        pipe.save_pretrained(tmp)

    return _saved(target, save)


def build(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    built = [sentence_transformer(out_dir / name, *ST_POOLING[name]) for name in SENTENCE_TRANSFORMERS]
    return built + [pipeline(out_dir / name, name) for name in PIPELINES]


def main(argv: list[str] | None = None) -> int:
    return build_main("tiny_pipelines", __doc__, build, argv)


if __name__ == "__main__":
    sys.exit(main())

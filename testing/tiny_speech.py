"""A tiny Whisper-style checkpoint, built locally: `python -m testing.tiny_speech OUT_DIR`.

``tiny-whisper``: a 2+2-layer ``WhisperForConditionalGeneration`` with random weights (drawn wide, as
``testing.tiny_models`` draws its LLMs, so that greedy decoding does not collapse onto one token), its own feature
extractor (16 mel bins over 2-second windows, where Whisper's are 80 over 30 s) and the BPE tokenizer of the tiny
LLMs with Whisper's special tokens: what ``from_pretrained`` and Whisper's own ``generate`` load on the real Hub.
"""

from __future__ import annotations

from pathlib import Path

from testing import build_main
from testing.tiny_models import build_tokenizer

SPECIAL = ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")
WINDOW_S = 2  # the feature extractor's window: 200 frames at a 10 ms hop, 100 encoder positions after its convs


def whisper(target: Path, seed: int = 0) -> Path:
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    if (target / "config.json").exists():
        return target
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    start, _, _, no_timestamps = tokenizer.convert_tokens_to_ids(list(SPECIAL))
    mel_bins = 16
    config = WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=mel_bins, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=WINDOW_S * 50, max_target_positions=64, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=start,
        suppress_tokens=[], begin_suppress_tokens=[],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.5 if ("embed" in name or "proj_out" in name) else 0.3)
    # an English-only model's generation config, as openai/whisper-tiny.en's: the decoder starts with
    # <|startoftranscript|><|notimestamps|>; EOS never comes from random weights, so the transcript is 32 tokens
    model.generation_config = GenerationConfig(
        decoder_start_token_id=start, no_timestamps_token_id=no_timestamps, is_multilingual=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, max_length=64,
    )  # fmt: skip
    features = WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=16000, chunk_length=WINDOW_S)
    tmp = target.parent / f".{target.name}.tmp"
    for part in (model, tokenizer, features):
        part.save_pretrained(tmp)
    tmp.rename(target)
    return target


def build(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [whisper(out_dir / "tiny-whisper")]


def main(argv: list[str] | None = None) -> int:
    return build_main("tiny_speech", __doc__, build, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""text-generation: greedy, exactly 32 new tokens from a fixed prompt, static shapes (static KV cache).

``run`` executes in one runner child: the CPU reference (eager, on the CPU) or the accelerator run (the
backend's torch.compile on its device). ``compare`` turns the two outputs into the report's fields.
"""

from __future__ import annotations

from typing import Any

from services.worker.runner.backends.base import Backend
from services.worker.runner.failures import phase
from services.worker.runner.measure import Stopwatch, peak_rss_bytes
from services.worker.runner.verdict import compare_tokens
from shared.enums import ErrorClass

PROMPT = "The history of the printing press begins in"
NEW_TOKENS = 32


def run(role: str, model_dir: str, backend: Backend) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    accelerated = role == "accelerator"
    device = backend.device if accelerated else "cpu"
    clock = Stopwatch()
    torch.manual_seed(0)
    with phase(ErrorClass.load), clock.time("load"):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, backend.dtype))
        model = model.to(device).eval()
        inputs = tokenizer(PROMPT, return_tensors="pt").to(device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate() -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                cache_implementation="static",
                pad_token_id=pad_id,
            )
        backend.synchronize()
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    if accelerated:
        model.forward = backend.compile(model.forward)
        # The first call compiles and generates; the second only generates. Their difference is the
        # compile time; the first call's tokens are what an unmodified user run produces.
        with phase(ErrorClass.compile), clock.time("first"):
            tokens = generate()
        with phase(ErrorClass.runtime), clock.time("generate"):
            generate()
        compile_s = max(clock.seconds["first"] - clock.seconds["generate"], 0.0)
        wall_s = clock.seconds["load"] + clock.seconds["first"]
        peak = backend.peak_memory_bytes()
    else:
        with phase(ErrorClass.runtime), clock.time("generate"):
            tokens = generate()
        compile_s = 0.0
        wall_s = clock.seconds["load"] + clock.seconds["generate"]
        peak = peak_rss_bytes()
    return {
        "token_ids": tokens,
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "load_s": clock.seconds["load"],
        "compile_s": compile_s,
        "generate_s": clock.seconds["generate"],
        "wall_s": wall_s,
        "peak_memory_bytes": peak,
    }


def compare(reference: dict[str, Any], accelerator: dict[str, Any]) -> dict[str, Any]:
    comparison = compare_tokens(accelerator["token_ids"], reference["token_ids"])
    return {
        "verdict": comparison.verdict,
        "first_divergence": comparison.first_divergence,
        "generated_token_ids": accelerator["token_ids"],
        "reference_token_ids": reference["token_ids"],
        "generated_text": accelerator["text"],
        "reference_text": reference["text"],
    }

"""feature-extraction: sentence embeddings of a fixed sentence set, accelerator vs CPU reference.

Embeddings are the model's last hidden states mean-pooled over the attention mask and L2-normalised
(what sentence-transformers does for MiniLM-style models). Verdict: PASS when every sentence's
embedding has a cosine similarity to the reference's of at least the dtype's threshold — 0.999 in fp32
(numeric noise is ~1e-6 there), 0.99 in bf16 (8 bits of mantissa through a deep encoder) — else FAIL.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.runner.backends.base import Backend
from services.runner.failures import phase
from services.runner.measure import Stopwatch, accelerator_timings
from shared.enums import ErrorClass, Parallelism, Verdict
from shared.settings import Settings
from shared.testconfig import SENTENCES

THRESHOLD = {"float32": 0.999}
DEFAULT_THRESHOLD = 0.99


def _embed(model: Any, inputs: dict[str, Any]) -> Any:
    import torch

    with torch.inference_mode():
        hidden = model(**inputs).last_hidden_state.float()
    mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1).cpu()


def _load(spec: dict[str, Any], backend: Backend, device: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModel.from_pretrained(spec["model_dir"], dtype=getattr(torch, backend.dtype)).to(device).eval()
    # Static shapes: one padded batch of fixed length.
    inputs = tokenizer(SENTENCES, padding="max_length", max_length=32, truncation=True, return_tensors="pt")
    return model, inputs.to(device)


def accelerator(spec: dict[str, Any], backend: Backend) -> dict[str, Any]:
    from transformers import AutoConfig

    from services.runner import parallel

    clock = Stopwatch()
    with phase(ErrorClass.load), clock.time("load"):
        # Encoders carry no parallel plan: a forced split is refused here with the reason.
        parallel.choose_parallelism(AutoConfig.from_pretrained(spec["model_dir"]), spec["world_size"], "ep")
        model, inputs = _load(spec, backend, backend.device)
    model.forward = backend.compile(model.forward)
    with phase(ErrorClass.compile), clock.time("first"):
        embeddings = _embed(model, inputs)
    with phase(ErrorClass.runtime), clock.time("generate"):
        _embed(model, inputs)
    return {
        "embeddings": embeddings.tolist(),
        "finite": bool(embeddings.isfinite().all()),
        "parallelism": Parallelism.none.value,
        **accelerator_timings(clock),
        "peak_memory_bytes": backend.peak_memory_bytes(),
        "visible_cores": backend.visible_cores(),
    }


def reference(spec: dict[str, Any], backend: Backend) -> dict[str, Any]:
    with phase(ErrorClass.load):
        model, inputs = _load(spec, backend, "cpu")
    with phase(ErrorClass.runtime):
        cache = {"embeddings": _embed(model, inputs).tolist()}
    return conclude(spec, backend.settings, backend.dtype, cache) | {"cache": cache}


def conclude_from_cache(
    spec: dict[str, Any], settings: Settings, dtype: str, cached: dict[str, Any]
) -> dict[str, Any] | None:
    """Stored reference embeddings are all the verdict needs."""
    return conclude(spec, settings, dtype, cached)


def conclude(spec: dict[str, Any], settings: Settings, dtype: str, ref: dict[str, Any]) -> dict[str, Any]:
    acc = np.asarray(spec["accelerator"]["embeddings"], dtype=np.float64)
    expected = np.asarray(ref["embeddings"], dtype=np.float64)
    norms = np.linalg.norm(acc, axis=1) * np.linalg.norm(expected, axis=1)
    cosines = ((acc * expected).sum(axis=1) / np.maximum(norms, 1e-12)).tolist()
    threshold = THRESHOLD.get(dtype, DEFAULT_THRESHOLD)
    lowest = min(cosines)
    finite = spec["accelerator"]["finite"]
    passed = finite and lowest >= threshold
    reason = (
        f"lowest cosine similarity {lowest:.6f} {'>=' if passed else '<'} {threshold} over {len(SENTENCES)} sentences"
        if finite
        else "the accelerator produced non-finite embeddings"
    )
    return {
        "verdict": Verdict.PASS if passed else Verdict.FAIL,
        "verdict_reason": reason,
        "similarity": lowest,
        "evidence": {"cosines": cosines, "threshold": threshold},
    }

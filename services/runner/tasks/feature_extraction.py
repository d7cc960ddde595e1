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
from services.runner.measure import Stopwatch, accelerator_timings, compile_record
from services.runner.specs import AcceleratorSpec, ReferenceResult, ReferenceSpec
from services.runner.tasks.conclusion import Conclusion
from shared.contracts.enums import ErrorClass, Parallelism, Task, Verdict
from shared.contracts.handoffs import AcceleratorData, Artifacts
from shared.contracts.report import Comparison, Resources
from shared.testconfig import SENTENCES, similarity_threshold


def _embed(model: Any, inputs: dict[str, Any]) -> Any:
    import torch

    with torch.inference_mode():
        hidden = model(**inputs).last_hidden_state.float()
    mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1).cpu()


def _load(model_dir: Any, backend: Backend, device: str, trust_remote_code: bool) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModel, AutoTokenizer

    code = {"trust_remote_code": trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **code)
    model = AutoModel.from_pretrained(model_dir, dtype=getattr(torch, backend.dtype), **code).to(device).eval()
    # Static shapes: one padded batch of fixed length.
    inputs = tokenizer(SENTENCES, padding="max_length", max_length=32, truncation=True, return_tensors="pt")
    return model, inputs.to(device)


class FeatureExtraction:
    name = Task.feature_extraction

    def accelerator(self, spec: AcceleratorSpec, backend: Backend) -> AcceleratorData:
        from transformers import AutoConfig

        from services.runner import parallel

        clock = Stopwatch(announce=spec.phase_file)
        with phase(ErrorClass.load), clock.time("load"):
            # Encoders carry no parallel plan: a forced split is refused here with the reason.
            config = AutoConfig.from_pretrained(spec.model_dir, trust_remote_code=spec.trust_remote_code)
            parallel.choose_parallelism(config, spec.world_size, "ep")
            model, inputs = _load(spec.model_dir, backend, backend.device, spec.trust_remote_code)
        model.forward = backend.compile(model.forward)
        with phase(ErrorClass.compile), clock.time("first"):
            embeddings = _embed(model, inputs)
        with phase(ErrorClass.runtime), clock.time("generate"):
            _embed(model, inputs)
        return AcceleratorData(
            embeddings=embeddings.tolist(),
            finite=bool(embeddings.isfinite().all()),
            placement=backend.placement().model_copy(update={"parallelism": Parallelism.none}),
            timings=accelerator_timings(clock),
            resources=Resources(peak_memory_bytes=backend.peak_memory_bytes(), **compile_record(model, backend)),
        )

    def reference(self, spec: ReferenceSpec, backend: Backend) -> ReferenceResult:
        with phase(ErrorClass.load):
            model, inputs = _load(spec.model_dir, backend, "cpu", spec.trust_remote_code)
        with phase(ErrorClass.runtime):
            return ReferenceResult(data={"embeddings": _embed(model, inputs).tolist()})

    def reuse(self, acc: AcceleratorData, stored: dict[str, Any]) -> ReferenceResult | None:
        """Stored reference embeddings are all the verdict needs."""
        return ReferenceResult(data=stored, reused=True)

    def conclude(self, acc: AcceleratorData, found: ReferenceResult, artifacts: Artifacts, dtype: str) -> Conclusion:
        produced = np.asarray(acc.embeddings, dtype=np.float64)
        expected = np.asarray(found.data["embeddings"], dtype=np.float64)
        norms = np.linalg.norm(produced, axis=1) * np.linalg.norm(expected, axis=1)
        cosines = ((produced * expected).sum(axis=1) / np.maximum(norms, 1e-12)).tolist()
        threshold = similarity_threshold(dtype)
        lowest = min(cosines)
        passed = acc.finite and lowest >= threshold
        reason = (
            f"lowest cosine similarity {lowest:.6f} {'>=' if passed else '<'} {threshold} over {len(SENTENCES)} "
            "sentences"
            if acc.finite
            else "the accelerator produced non-finite embeddings"
        )
        comparison = Comparison(
            similarity=lowest, reference_reused=found.reused, evidence={"cosines": cosines, "threshold": threshold}
        )
        return Conclusion(Verdict.PASS if passed else Verdict.FAIL, reason, comparison)

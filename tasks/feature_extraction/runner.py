"""feature-extraction: sentence embeddings of a fixed sentence set, accelerator vs CPU reference.

A repo that ships ``modules.json`` is a sentence-transformers pipeline: it runs through ``SentenceTransformer``
itself — its own pooling, dense and normalization modules, on the accelerator, with the transformer's forward
compiled by the backend — as its users run it. Any other encoder's embeddings are its last hidden states
mean-pooled over the attention mask and L2-normalised. Verdict: PASS when every sentence's embedding has a cosine
similarity to the reference's of at least the dtype's threshold (``tasks.feature_extraction.SIMILARITY``), else FAIL.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from services.runner import faults
from services.runner.backends.base import Backend
from services.runner.failures import phase
from services.runner.measure import accelerator_timings, compile_record
from services.runner.specs import AcceleratorSpec, ReferenceResult, ReferenceSpec
from services.runner.tasks.conclusion import ComparesOutputs, Conclusion
from services.runner.tasks.whole import compiled_twice
from shared.contracts.enums import ErrorClass, Fault, Parallelism, Task, Verdict
from shared.contracts.handoffs import AcceleratorData, Artifacts
from shared.contracts.report import Comparison, Output, Resources
from tasks.feature_extraction import SENTENCES, similarity_threshold

TEXT_POSITIONS = 32  # a transformers encoder's batch is padded to this length: static shapes


def _mode(mode: Any) -> str:
    """A pooling module's mode as one word: "mean", or "cls+mean" for a module that concatenates several."""
    return "+".join(mode) if isinstance(mode, list | tuple) else str(mode)


class Encoder:
    """A loaded embedding model: ``embed()`` the test's sentences; ``network`` is the module the backend compiles."""

    def __init__(self, model_dir: Path, backend: Backend, device: str, trust_remote_code: bool) -> None:
        import torch

        dtype = getattr(torch, backend.dtype)
        self.sentence_transformer: Any = None
        if (model_dir / "modules.json").is_file():
            from sentence_transformers import SentenceTransformer

            self.sentence_transformer = SentenceTransformer(
                str(model_dir), device=device, trust_remote_code=trust_remote_code, model_kwargs={"dtype": dtype}
            )
            self.network = self.sentence_transformer[0].auto_model
        else:
            from transformers import AutoModel, AutoTokenizer

            code: dict[str, Any] = {"trust_remote_code": trust_remote_code}
            tokenizer = AutoTokenizer.from_pretrained(model_dir, **code)
            self.network = AutoModel.from_pretrained(model_dir, dtype=dtype, **code).to(device).eval()
            self.inputs = tokenizer(
                SENTENCES, padding="max_length", max_length=TEXT_POSITIONS, truncation=True, return_tensors="pt"
            ).to(device)
        self.described = self.output()  # the pipeline as the repo declares it, before a planted fault changes it

    def embed(self) -> Any:
        import torch

        if self.sentence_transformer is not None:
            encoded = self.sentence_transformer.encode(SENTENCES, batch_size=len(SENTENCES), convert_to_tensor=True)
            return encoded.float().cpu()
        with torch.inference_mode():
            hidden = self.network(**self.inputs).last_hidden_state.float()
        mask = self.inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).cpu()

    def plant(self, fault: str) -> None:
        """A planted fault (``faults.MODULE_FAULTS``): the module faults in the network; a wrong pooling mode."""
        faults.inject_module(self.network, fault)
        if fault == Fault.wrong_pooling:
            pooling = self._pooling()
            if pooling is None:
                raise ValueError("wrong_pooling needs a sentence-transformers pipeline with a pooling module")
            pooling.pooling_mode = "cls" if pooling.pooling_mode == "mean" else "mean"

    def _pooling(self) -> Any:
        modules = list(self.sentence_transformer or [])
        return next((m for m in modules if hasattr(m, "pooling_mode")), None)

    def output(self) -> Output:
        """The pipeline as the repo defines it now."""
        if self.sentence_transformer is None:
            return Output(
                pipeline_library="transformers",
                pipeline_library_version=version("transformers"),
                embedding_pooling="mean",
                embedding_normalized=True,
            )
        pooling = self._pooling()
        normalized = any(type(m).__name__ == "Normalize" for m in self.sentence_transformer)
        return Output(
            pipeline_library="sentence-transformers",
            pipeline_library_version=version("sentence-transformers"),
            embedding_pooling=_mode(pooling.pooling_mode) if pooling else None,
            embedding_normalized=normalized,
        )


class FeatureExtraction(ComparesOutputs):
    name = Task.feature_extraction

    def accelerator(self, spec: AcceleratorSpec, backend: Backend) -> AcceleratorData:
        encoder, embeddings, clock = compiled_twice(
            spec, backend, "an embedding model",
            lambda: Encoder(spec.model_dir, backend, backend.device, spec.trust_remote_code), Encoder.embed,
        )  # fmt: skip
        return AcceleratorData(
            output=encoder.described.model_copy(update={"embedding_dim": int(embeddings.shape[-1])}),
            embeddings=embeddings.nan_to_num().tolist(),  # JSON holds no NaN: ``finite`` says whether there was one
            finite=bool(embeddings.isfinite().all()),
            placement=backend.placement().model_copy(update={"parallelism": Parallelism.none}),
            timings=accelerator_timings(clock),
            resources=Resources(
                peak_memory_bytes=backend.peak_memory_bytes(), **compile_record(encoder.network, backend)
            ),
        )

    def reference(self, spec: ReferenceSpec, backend: Backend) -> ReferenceResult:
        with phase(ErrorClass.load):
            encoder = Encoder(spec.model_dir, backend, "cpu", spec.trust_remote_code)
        with phase(ErrorClass.runtime):
            return ReferenceResult(data={"embeddings": encoder.embed().tolist()})

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


RUNNER = FeatureExtraction()

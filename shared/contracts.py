"""What a worker serves (compiler, library, versions) and what a runner reports back."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from pydantic import BaseModel

from shared.enums import CompilerName, ErrorClass, Verdict
from shared.settings import Settings

LIBRARY = "transformers"


class RuntimeInfo(BaseModel):
    backend: str
    compiler_name: str
    compiler_version: str
    library: str = LIBRARY
    library_version: str
    torch_version: str


class RunReport(BaseModel):
    """What `python -m services.runner` prints: one finished test, good or bad."""

    model_id: str
    revision: str | None = None
    sha: str | None = None
    task: str
    backend: str
    verdict: Verdict
    error_class: ErrorClass | None = None
    error_message: str | None = None
    compiler_name: str | None = None
    compiler_version: str | None = None
    library: str = LIBRARY
    library_version: str | None = None
    torch_version: str | None = None
    cores: int = 1
    core_range: str | None = None
    host: str | None = None
    wall_s: float | None = None
    load_s: float | None = None
    compile_s: float | None = None
    generate_s: float | None = None
    peak_memory_bytes: int | None = None
    generated_token_ids: list[int] | None = None
    reference_token_ids: list[int] | None = None
    generated_text: str | None = None
    reference_text: str | None = None
    first_divergence: int | None = None
    reproduce: str | None = None
    parallelism: str | None = None
    visible_cores: str | None = None  # what the accelerator process could use (CPU affinity, devices)
    compile_cache: str | None = None  # hit, miss, or none (a compiler without a persistent cache)
    reference_reused: bool | None = None  # the CPU reference came from the stored runs
    verdict_reason: str | None = None
    tokens_match: bool | None = None
    prefill_rel_error: float | None = None
    accelerator_loglik: float | None = None  # mean log-prob per token of its text under the reference
    reference_loglik: float | None = None
    similarity: float | None = None  # feature-extraction: the lowest cosine similarity to the reference
    judge_kind: str | None = None
    judge_model: str | None = None
    judge_prompt_hash: str | None = None
    judge_answer: str | None = None
    judge_rationale: str | None = None
    evidence: dict[str, Any] | None = None


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def default_runtime(settings: Settings) -> RuntimeInfo | None:
    """The runtime a job is planned for when no live worker says what it serves.

    Read from package metadata so that the API never imports torch; None when it cannot be known here.
    """
    torch_version = _installed("torch")
    library_version = _installed(LIBRARY)
    if settings.backend == "neuron":
        compiler_name = CompilerName.neuronx_cc.value
        compiler_version = settings.default_compiler or _installed("neuronx-cc")
    else:
        compiler_name = CompilerName.inductor.value
        compiler_version = settings.default_compiler or (torch_version and f"inductor-{torch_version}")
    if not (compiler_version and library_version):
        return None
    return RuntimeInfo(
        backend=settings.backend,
        compiler_name=compiler_name,
        compiler_version=compiler_version,
        library_version=library_version,
        torch_version=torch_version or "unknown",
    )

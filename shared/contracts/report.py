"""A finished test, composed of parts: what was tested, what ran it, where, how long, how close, who judged, why
it failed — the way optimum-benchmark's report is composed of its measurements.

Each field is declared once, here. A result row (``shared.db.models.Result``) has a column per field of the
parts in ``ROW_PARTS`` and the report's own ``verdict_reason``; the flat record of the API and Parquet
(``shared.results.records.ResultRecord``) is the job's identity followed by those columns. Adding a field to a
part is one edit here and a migration, and a new ``SCHEMA_VERSION`` of the published record (the columns it had are
pinned: ``tests/test_records.py::test_a_change_of_the_published_columns_raises_the_schema_version``).
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from shared.contracts.enums import CacheOutcome, CompilePath, ErrorClass, LongOutcome, Parallelism, Task, Verdict
from shared.contracts.fields import Int32, SqlOnly, Str16, Str32, Str64, Str200, shape_of
from shared.contracts.run import RuntimeInfo, RuntimeVersions


class Subject(BaseModel):
    """What was asked: the model at a commit, the task, the backend. The job's own columns: a row does not repeat
    them."""

    model_id: str
    revision: str | None = None  # as requested
    sha: str | None = None  # as resolved
    task: Task
    backend: str


class Failure(BaseModel):
    """Why a test ended ERROR (or SKIPPED), and the normalised cause of an ERROR or FAIL."""

    error_class: ErrorClass | None = None
    error_message: str | None = None
    failure_signature: str | None = None  # ERROR and FAIL: the normalised cause (shared.results.signatures)
    signature_id: Str16 | None = None  # a digest of the signature: what GET /failures groups by


class Timings(BaseModel):
    """The accelerator run's seconds: load, then the first call (compile and generate), then a second call."""

    wall_s: float | None = None  # load + compile + generate, as the public table counts it
    load_s: float | None = None
    compile_s: float | None = None  # the first call minus the second
    generate_s: float | None = None
    denoise_step_s: float | None = None  # text-to-image: the median denoising step of the second call


class Resources(BaseModel):
    """What the accelerator run took: memory, and the compiler's work."""

    peak_memory_bytes: int | None = None  # measured: the max over ranks
    predicted_peak_bytes_per_core: int | None = None  # what sizing expected
    graphs_compiled: Int32 | None = None  # graphs dynamo built, for any compile: 2 (prefill, decode) when once
    backend_graphs: Int32 | None = None  # of those, the graphs the backend's compile received
    compile_path: Annotated[CompilePath | None, Field(max_length=32)] = None
    compile_cache: Annotated[CacheOutcome | None, Field(max_length=8)] = None  # from this run's own lookups:
    cache_hits: Int32 | None = None  # graphs it looked up in the compile cache and found
    cache_misses: Int32 | None = None  # and those it compiled anew


class Comparison(BaseModel):
    """The accelerator's output against the CPU reference's: what the verdict was decided on."""

    first_divergence: Int32 | None = None
    tokens_match: bool | None = None
    prefill_rel_error: float | None = None
    accelerator_loglik: float | None = None  # mean log-prob per token of its text under the reference
    reference_loglik: float | None = None
    similarity: float | None = None  # feature-extraction: the lowest cosine similarity to the reference
    image_psnr: float | None = None  # text-to-image: the decoded image against the reference's (dB)
    image_ssim: float | None = None  # and their structural similarity (1: the same image)
    routing_margin: float | None = None  # MoE: the reference's smallest top-k router margin at the prompt's end
    reference_reused: bool | None = None  # the CPU reference came from the stored runs
    generated_text: str | None = None
    reference_text: str | None = None
    generated_token_ids: list[int] | None = None
    reference_token_ids: list[int] | None = None
    evidence: Annotated[dict[str, Any] | None, SqlOnly] = None  # per-step detail: scores, cosines


class Output(BaseModel):
    """What ran the task and the shape of what it produced, beyond the comparison: the library whose pipeline ran
    (a sentence-transformers repo's own modules, a diffusers pipeline, or transformers alone), an embedding's
    dimension, pooling and normalization as the repo defines them, and the image a pipeline drew."""

    pipeline_library: Str32 | None = None  # transformers, sentence-transformers or diffusers
    pipeline_library_version: Str64 | None = None
    embedding_dim: Int32 | None = None
    embedding_pooling: Str64 | None = None  # the pooling module's mode (cls, mean, max, ...), or mean without one
    embedding_normalized: bool | None = None  # a Normalize module (or our mean pooling) L2-normalises embeddings
    denoiser: Str64 | None = None  # the pipeline's compiled component: its class (a UNet or a transformer)
    image_size: Int32 | None = None  # pixels a side
    denoising_steps: Int32 | None = None

    @property
    def pipeline_key(self) -> str:
        """The task's own library and version, when it is not transformers alone: part of a stored reference's key
        (a diffusers release may draw another image)."""
        if self.pipeline_library in (None, "transformers"):
            return ""
        return f"{self.pipeline_library} {self.pipeline_library_version}"


class Performance(BaseModel):
    """Speed of a PASS at batch 1, after its compile, on the same cores: repeated timed generations of a fixed
    prompt and number of new tokens (what AWS Neuron's and LLM-Perf's tables report). It promises nothing about
    other batch sizes or lengths; a row that is not a PASS has none."""

    perf_prompt_tokens: Int32 | None = None
    perf_new_tokens: Int32 | None = None
    perf_iterations: Int32 | None = None
    decode_tokens_per_s: float | None = None  # median over iterations: tokens after the first / their seconds
    ttft_p50_s: float | None = None  # time to first token: the prefill and its sampling
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None  # time per output token after the first
    tpot_p99_s: float | None = None


class LongGeneration(BaseModel):
    """A longer greedy generation against the CPU reference's of the same length: whether the text stays sane past
    the 32 tokens the verdict reads. Its outcome is its own; a late benign bf16 divergence is ``ok``."""

    long_generation: Annotated[LongOutcome | None, Field(max_length=16)] = None
    long_new_tokens: Int32 | None = None
    long_first_divergence: Int32 | None = None
    long_agreement: list[float] | None = None  # per window of positions: the share of tokens equal to the reference's
    long_loglik_drop: list[float] | None = None  # per window: nats per token the text loses to the reference's own
    long_repetition: float | None = None  # repeated n-grams' share in the last window, the accelerator's text
    long_reference_repetition: float | None = None  # and the reference's
    long_reason: str | None = None


class JudgeAudit(BaseModel):
    """What the judge of a sharded run was, was asked and answered."""

    judge_kind: Str32 | None = None
    judge_model: Str200 | None = None
    judge_prompt_hash: Str64 | None = None
    judge_answer: str | None = None
    judge_rationale: str | None = None


class Placement(BaseModel):
    """How the accelerator run was laid out, as its rank 0 saw it."""

    parallelism: Annotated[Parallelism | None, Field(max_length=16)] = None
    visible_cores: Str200 | None = None  # the cores the accelerator ranks saw, together, as a range ("4-7")
    rank_cores: Str200 | None = None  # each rank's core as that rank saw it, in rank order ("4,5,6,7")
    collective: Str16 | None = None  # the process group's backend of a sharded run (gloo, neuron, nccl)


class Provenance(BaseModel):
    """Where it ran and how to run it again."""

    host: Str200 | None = None
    cores: Int32 = 1
    core_range: Str32 | None = None  # the core group the worker owns
    reproduce: str | None = None  # the command that runs the same test


class RunReport(BaseModel):
    """What the runner reports: one finished test, good or bad. ``verdict`` is None only after the accelerator
    stage of a job whose verdict stage is still to come; ``runtime`` None until the accelerator run said."""

    subject: Subject
    verdict: Verdict | None = None
    verdict_reason: str | None = None
    runtime: RuntimeInfo | None = None
    failure: Failure = Field(default_factory=Failure)
    timings: Timings = Field(default_factory=Timings)
    resources: Resources = Field(default_factory=Resources)
    comparison: Comparison = Field(default_factory=Comparison)
    output: Output = Field(default_factory=Output)
    judge: JudgeAudit = Field(default_factory=JudgeAudit)
    placement: Placement = Field(default_factory=Placement)
    provenance: Provenance = Field(default_factory=Provenance)
    performance: Performance = Field(default_factory=Performance)
    long: LongGeneration = Field(default_factory=LongGeneration)


# The parts a result row keeps, in column order, each as the model whose fields are its columns: every part but
# the subject (the job's), and of the runtime only its versions (the rest is the job's identity).
ROW_PARTS: dict[str, type[BaseModel]] = {
    "failure": Failure,
    "timings": Timings,
    "resources": Resources,
    "comparison": Comparison,
    "output": Output,
    "judge": JudgeAudit,
    "placement": Placement,
    "provenance": Provenance,
    "performance": Performance,
    "long": LongGeneration,
    "runtime": RuntimeVersions,
}
OPTIONAL_PARTS = {"runtime"}  # a report may have none: their columns are nullable whatever the fields say


class RowField(NamedTuple):
    name: str
    info: FieldInfo
    optional: bool  # None is allowed: by the field, or because its part may be absent


def row_fields() -> list[RowField]:
    """Every column a result row has of a report, in order: the verdict's reason, then each part's fields."""
    fields = [RowField("verdict_reason", RunReport.model_fields["verdict_reason"], True)]
    for part_name, part in ROW_PARTS.items():
        for name, info in part.model_fields.items():
            assert name not in {f.name for f in fields}, f"{name} is declared by two parts"
            fields.append(RowField(name, info, part_name in OPTIONAL_PARTS or shape_of(info).optional))
    return fields


def row_values(report: RunReport) -> dict[str, Any]:
    """The report as a result row's column values (``row_fields``), and its verdict."""
    values: dict[str, Any] = {"verdict": report.verdict, "verdict_reason": report.verdict_reason}
    for name, part in ROW_PARTS.items():
        present = getattr(report, name)
        values |= {field: getattr(present, field) if present else None for field in part.model_fields}
    return values

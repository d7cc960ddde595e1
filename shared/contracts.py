"""What crosses the worker ↔ runner boundary, typed: the request, the runtime, the report, the stage hand-offs.

The worker writes a ``RunRequest``; the runner's command line, the worker's command and the reproduce
command are all derived from it (``to_argv`` / ``from_argv``), so a flag is spelled once. A job runs in
two stages that hand over through files in the job's artifact directory (``Artifacts``): the accelerator
stage leaves an ``AcceleratorOutput`` (and the prefill logits and per-step scores as .npy files), the
verdict stage a ``VerdictOutput``; the judge stage (sharded runs) a ``JudgeOutcome``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import types
import typing
from dataclasses import replace
from enum import Enum
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.enums import ErrorClass, Parallelism, Stage, Task, Verdict
from shared.results.verdict import Evidence, JudgeOutcome, Tolerances, decide, judge_report_fields
from shared.settings import BackendName
from shared.testconfig import config_hash

LIBRARY = "transformers"
RUNNER_MODULE = "services.runner"


def installed_version(dist: str) -> str | None:
    """An installed distribution's version from its metadata, without importing it (torch takes seconds)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class RuntimeInfo(BaseModel):
    backend: str
    compiler_name: str
    compiler_version: str
    library: str = LIBRARY
    library_version: str
    torch_version: str


def cpu_compiler(compile_backend: str, torch_version: str, dtype: str) -> tuple[str, str]:
    """The cpu backend's compiler name and version: what its runner reports, and what the API plans a job for
    when no worker is live. A bf16 run is another configuration of the same compiler: its cells stay apart."""
    suffix = "" if dtype == "float32" else "-bf16"
    return compile_backend, f"{compile_backend}-{torch_version}{suffix}"


class RunRequest(BaseModel):
    """One runner invocation. Field names are the runner's flags (``--core-range`` for ``core_range``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: str = Field(description="Hub id (org/name); with --local-dir, a label for that directory")
    revision: str | None = Field(None, description="branch, tag or commit sha (Hub ids only)")
    local_dir: Path | None = Field(
        None, description="run this checkpoint directory instead of downloading MODEL_ID (never used by jobs)"
    )
    backend: BackendName | None = Field(None, description="default: SUPPORTMATRIX_BACKEND")
    task: Task = Field(Task.text_generation, description="what is run and how it is compared")
    cores: Literal[1, 2, 4, 8, 16] | None = Field(None, description="shard over this many cores (default: sized)")
    trust_remote_code: bool = Field(False, description="run the repo's own code (its *.py), at the pinned commit")
    core_range: str | None = Field(None, description="the cores this run is pinned to, recorded as provenance")
    stage: Stage = Field(Stage.full, description="the whole test, or one stage of a job")
    artifacts: Path | None = Field(None, description="the job's artifact directory, where its stages hand over")
    timeout_s: float | None = Field(None, gt=0, description="seconds per child process (default: the job timeout)")
    report: Path | None = Field(None, description="also write the JSON report to this file")

    # What a person needs to run the same test again; the rest says where this run's files go.
    REPRODUCIBLE: typing.ClassVar[frozenset[str]] = frozenset(
        {"model_id", "revision", "local_dir", "backend", "task", "cores", "trust_remote_code"}
    )

    def to_argv(self) -> list[str]:
        """The runner's arguments for this request: MODEL_ID, then every field that is not its default."""
        argv = [self.model_id]
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if name == "model_id" or value == field.default:
                continue
            if isinstance(value, bool):  # a switch: present means True
                argv.append(_flag(name))
                continue
            argv += [_flag(name), str(value.value if isinstance(value, Enum) else value)]
        return argv

    @classmethod
    def from_argv(cls, argv: list[str]) -> RunRequest:
        return cls.model_validate(vars(cls.parser().parse_args(argv)))

    @classmethod
    def parser(
        cls, prog: str = f"python -m {RUNNER_MODULE}", description: str | None = None
    ) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog, description=description)
        for name, field in cls.model_fields.items():
            if name == "model_id":
                parser.add_argument("model_id", metavar="MODEL_ID", help=field.description)
                continue
            if field.annotation is bool:
                parser.add_argument(_flag(name), dest=name, action="store_true", help=field.description)
                continue
            choices = _choices(field.annotation)
            parser.add_argument(
                _flag(name),
                dest=name,
                default=field.default,
                choices=choices,
                type=type(choices[0]) if choices else str,
                help=field.description,
            )
        return parser

    def reproduce_command(self, env: dict[str, str]) -> str:
        """How a person runs the same test: the settings that changed what ran, then the runner's command."""
        request = RunRequest.model_validate(self.model_dump(include=set(self.REPRODUCIBLE)))
        parts = [f"{k}={v}" for k, v in sorted(env.items())]
        return shlex.join([*parts, "python", "-m", RUNNER_MODULE, *request.to_argv()])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _choices(annotation: Any) -> list[Any] | None:
    """The allowed values of a Literal or Enum annotation (optional or not), as the command line spells them."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    for arg in args:
        if typing.get_origin(arg) is Literal:
            return list(typing.get_args(arg))
        if isinstance(arg, type) and issubclass(arg, Enum):
            return [str(m.value) for m in arg]
    return None


class RunReport(BaseModel):
    """What the runner reports: one finished test, good or bad. ``verdict`` is None only after the accelerator
    stage of a job whose verdict stage is still to come."""

    model_id: str
    revision: str | None = None
    sha: str | None = None
    task: str
    backend: str
    verdict: Verdict | None = None
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
    failure_signature: str | None = None  # ERROR and FAIL: the normalised cause (shared.results.signatures)
    signature_id: str | None = None
    graphs_compiled: int | None = None
    predicted_peak_bytes_per_core: int | None = None  # what sizing expected; peak_memory_bytes is measured


class AcceleratorData(BaseModel):
    """What one accelerator rank produced (rank 0's is kept; peak memory is the max over ranks)."""

    token_ids: list[int] | None = None  # text-generation
    text: str | None = None
    embeddings: list[list[float]] | None = None  # feature-extraction
    finite: bool
    parallelism: Parallelism
    load_s: float
    compile_s: float
    generate_s: float
    wall_s: float
    peak_memory_bytes: int
    visible_cores: str
    compile_cache: str | None = None
    graphs_compiled: int | None = None  # graphs the compiler built: one for a model that compiles once
    runtime: RuntimeInfo | None = None


class AcceleratorOutput(BaseModel):
    """The accelerator stage's hand-off to the verdict stage (``Artifacts.accelerator``)."""

    report: RunReport  # provenance, timings and memory; the verdict stage adds its conclusions
    data: AcceleratorData
    model_dir: Path  # the checkpoint on this host's disk (HF cache), which the reference loads too
    dtype: str  # the run dtype of the accelerator run, and so of the reference
    content_id: str  # the commit, or a digest of a local directory's files
    reference_key: str  # the stored reference this run can reuse (StoredReference.key_for)

    def new_reference(self, data: dict[str, Any]) -> StoredReference:
        """A reference computed for this run, as it is stored for every other compiler version and rerun."""
        r = self.report
        assert r.library_version and r.torch_version
        return StoredReference(
            key=self.reference_key,
            model_id=r.model_id,
            sha=self.content_id,
            task=r.task,
            dtype=self.dtype,
            library=r.library,
            library_version=r.library_version,
            torch_version=r.torch_version,
            data=data,
        )


class StoredReference(BaseModel):
    """A CPU reference run as ``reference_runs`` keeps it; its prefill logits travel as a .npy file."""

    key: str
    model_id: str
    sha: str  # the commit, or a digest of a local directory's files
    task: str
    dtype: str
    library: str = LIBRARY
    library_version: str
    torch_version: str
    data: dict[str, Any]  # task-specific: tokens, text, log-likelihood, timings; or embeddings

    @staticmethod
    def key_for(model_id: str, sha: str, task: str, dtype: str, library_version: str, torch_version: str) -> str:
        """What determines a reference's output: the commit, the task and its test config, dtype, versions."""
        parts = [model_id, sha, task, config_hash(task), dtype, library_version, torch_version]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()


class VerdictOutput(BaseModel):
    """The verdict stage's result (``Artifacts.verdict``): the report, and what the worker still does with it."""

    report: RunReport
    dtype: str  # whose tolerances the rule applies
    evidence: Evidence | None = None  # text-generation: what the judge and the rule rule on
    judge_needed: bool = False  # a sharded text-generation run: the judge stage decides with the evidence
    new_reference: StoredReference | None = None  # computed here, for the worker to store

    def judged(self, judge: JudgeOutcome) -> RunReport:
        """The final report once the judge has answered: the same rule, now with the judge's outcome."""
        assert self.evidence is not None
        decision = decide(replace(self.evidence, judge=judge), Tolerances.for_dtype(self.dtype))
        update = {"verdict": decision.verdict, "verdict_reason": decision.reason,
                  "first_divergence": decision.first_divergence, **judge_report_fields(judge)}  # fmt: skip
        return self.report.model_copy(update=update)


class Artifacts:
    """The files of one job's artifact directory, named once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.accelerator = root / "accelerator.json"
        self.prefill = root / "prefill-logits.npy"
        self.step_scores = root / "step-scores.npy"
        self.stored_reference = root / "stored-reference.json"
        self.reference_prefill = root / "reference-prefill-logits.npy"
        self.verdict = root / "verdict.json"
        self.judge = root / "judge.json"


def write_model(path: Path, model: BaseModel) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # writers of the same file never share a name
    tmp.write_text(model.model_dump_json())
    tmp.replace(path)

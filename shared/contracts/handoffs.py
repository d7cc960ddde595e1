"""What a job's stages hand each other through its artifact directory (``Artifacts``).

The accelerator stage leaves an ``AcceleratorOutput`` (and the prefill logits and per-step scores as .npy
files), the verdict stage a ``VerdictOutput``; the worker puts a ``StoredReference`` there before the verdict
stage and stores the new one it finds there after.

A job's directory is its stage user's (a runner user, or a repo's own code's sandbox uid), and the worker, root,
reads and writes in it: a process of that user may have planted a symbolic link (or a hard link) to a file only
root reaches at any name there. So every file the worker opens there goes through ``read_regular`` and
``write_atomically``, which never follow one.
"""

from __future__ import annotations

import errno
import math
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel, Field

from shared.contracts.evidence import Evidence
from shared.contracts.report import Output, Performance, Placement, Resources, RunReport, Timings
from shared.contracts.run import LIBRARY, RuntimeInfo


class Routing(BaseModel):
    """A MoE's routing over one sequence: the experts each position chose at each MoE layer (positions x layers x k,
    the layers in depth order; -1: no expert, the router did not run) and, for the reference's, each router's top
    k+8 logits, best first, and their experts (positions x layers x k+8): the margin of a flip is read between the
    experts that really swapped (``tasks.text_generation.verdict.routing_flips``)."""

    experts: list[list[list[int]]]
    top_logits: list[list[list[float]]] | None = None
    top_experts: list[list[list[int]]] | None = None
    prompt_positions: int  # the prompt's: position prompt_positions - 1 + i chose generated token i

    def smallest_margins(self, k: int) -> list[float] | None:
        """The reference's smallest k-th-minus-(k+1)-th router logit gap over the layers, at each position: what the
        row's ``routing_margin`` and a step's ``routing_margin`` describe (the rule reads the flips, not these)."""
        if self.top_logits is None or self.top_experts is None:
            return None
        return [  # a layer whose router did not run (-1) has no margin
            min((top[k - 1] - top[k] for top, ids in zip(layers, chosen, strict=True) if len(top) > k and ids[0] >= 0),
                default=math.inf)
            for layers, chosen in zip(self.top_logits, self.top_experts, strict=True)
        ]  # fmt: skip


class AcceleratorData(BaseModel):
    """What one accelerator rank produced (rank 0's is kept; peak memory is the max over ranks)."""

    token_ids: list[int] | None = None  # text-generation
    text: str | None = None
    embeddings: list[list[float]] | None = None  # feature-extraction
    image: list[list[list[float]]] | None = None  # text-to-image: height x width x RGB in [0, 1]
    finite: bool
    placement: Placement
    timings: Timings
    resources: Resources = Field(default_factory=Resources)
    output: Output = Field(default_factory=Output)
    runtime: RuntimeInfo | None = None
    long_token_ids: list[int] | None = None  # the long generation's tokens (None: not run)
    long_finite: bool | None = None
    # MoE: the experts the compiled run chose at each position its forward ran (the prompt's, then each generated
    # token's but the last), what the verdict compares with the reference's routing on the same prefix
    routing: Routing | None = None
    performance: Performance = Field(default_factory=Performance)  # the timed generations (empty: not run)


class StoredReference(BaseModel):
    """A CPU reference run as ``reference_runs`` keeps it; its prefill logits travel as a .npy file."""

    key: str  # shared.testconfig.reference_key: what determines its output
    model_id: str
    sha: str  # the commit, or a digest of a local directory's files
    task: str
    dtype: str
    library: str = LIBRARY
    library_version: str
    torch_version: str
    data: dict[str, Any]  # task-specific: tokens, text, log-likelihood, timings; or embeddings


class AcceleratorOutput(BaseModel):
    """The accelerator stage's hand-off to the verdict stage (``Artifacts.accelerator``)."""

    report: RunReport  # provenance, timings and memory; the verdict stage adds its conclusions
    data: AcceleratorData
    model_dir: Path  # the checkpoint on this host's disk (HF cache), which the reference loads too
    dtype: str  # the run dtype of the accelerator run, and so of the reference
    content_id: str  # the commit, or a digest of a local directory's files
    reference_key: str  # the stored reference this run can reuse

    def new_reference(self, data: dict[str, Any]) -> StoredReference:
        """A reference computed for this run, as it is stored for every other compiler version and rerun."""
        runtime = self.report.runtime
        assert runtime is not None and runtime.torch_version
        return StoredReference(
            key=self.reference_key,
            model_id=self.report.subject.model_id,
            sha=self.content_id,
            task=self.report.subject.task,
            dtype=self.dtype,
            library=runtime.library,
            library_version=runtime.library_version,
            torch_version=runtime.torch_version,
            data=data,
        )


class VerdictOutput(BaseModel):
    """The verdict stage's result (``Artifacts.verdict``): the report, and what the worker still does with it."""

    report: RunReport
    dtype: str  # whose tolerances the rule applies
    evidence: Evidence | None = None  # text-generation: what the judge and the rule rule on
    judge_needed: bool = False  # a sharded text-generation run: the judge stage decides with the evidence
    new_reference: StoredReference | None = None  # computed here, for the worker to store


class Phase(BaseModel):
    """The phase a runner's child is in, as it announces it (``<child>.phase`` in the artifact directory): what the
    launcher reads to charge time to the compile's budget or to the rest, and what a timeout names."""

    phase: str
    since: float  # Unix time

    @classmethod
    def read(cls, path: Path) -> Phase | None:
        try:
            return cls.model_validate_json(read_regular(path))
        except (OSError, ValueError):
            return None


class Artifacts:
    """The files of one job's artifact directory, named once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.accelerator = root / "accelerator.json"
        self.prefill = root / "prefill-logits.npy"
        self.step_scores = root / "step-scores.npy"
        self.step_logits = root / "step-logits.npy"
        self.stored_reference = root / "stored-reference.json"
        self.reference_prefill = root / "reference-prefill-logits.npy"
        self.verdict = root / "verdict.json"
        self.judge = root / "judge.json"
        self.images = {side: root / f"{side}-image.png" for side in ("accelerator", "reference")}  # text-to-image

    def latest_phase(self) -> Phase | None:
        """The phase a child of this job's runner announced last."""
        phases = [p for p in map(Phase.read, self.root.glob("*.phase")) if p is not None]
        return max(phases, key=lambda p: p.since, default=None)


def write_model(path: Path, model: BaseModel) -> None:
    """Write atomically: a reader never sees half a file."""
    write_atomically(path, model.model_dump_json().encode())


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` at ``path``, replaced whole (a reader never sees half a file), through a temporary file created
    anew (O_EXCL: a link planted at its name is removed first, one planted meanwhile fails the write, OSError) and
    renamed over ``path`` (which replaces a link there, never following it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # writers of the same file never share a name
    with create_anew(tmp) as file:
        file.write(data)
    tmp.replace(path)


def create_anew(path: Path, mode: int = 0o644) -> BinaryIO:
    """A new, empty file at ``path``, open for writing: whatever was at the name (a link planted there included) is
    removed first, never followed, and the file is created exclusively (O_EXCL: one planted meanwhile is not
    followed either; OSError)."""
    path.unlink(missing_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode), "wb")


def read_regular(path: Path) -> bytes:
    """The bytes of the file at ``path``, which must be a regular file with one name: a symbolic link there is not
    followed (O_NOFOLLOW), and a FIFO, a device or a hard link to another file (Linux refuses those to a user who
    cannot write the file, unless fs.protected_hardlinks is off) is refused. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        held = os.fstat(fd)
        if not stat.S_ISREG(held.st_mode) or held.st_nlink != 1:
            raise OSError(errno.EPERM, "not a regular file of one name", str(path))
        return file.read()

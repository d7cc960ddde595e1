"""What the runner hands its child processes, and what they hand back: typed, written as JSON files.

A child is started with the path of its spec; it writes a ``ChildOutcome`` to the spec's ``out`` path —
its data on success, or an error class, message and traceback. A crash leaves no file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from shared.contracts.enums import ErrorClass, Task
from shared.contracts.evidence import RoutingFlip, StepEvidence
from shared.contracts.handoffs import AcceleratorData


class ChildSpec(BaseModel):
    role: str
    backend: str
    out: Path = Path()  # set per rank by the launcher
    rank: int = 0
    world_size: int = 1

    @property
    def phase_file(self) -> Path | None:
        """None for a spec run in-process, without the launcher (no outcome file to announce beside)."""
        return phase_file(self.out) if self.out != Path() else None


def phase_file(out: Path) -> Path:
    """Where the child whose outcome goes to ``out`` announces the phase it is in (``measure.Phase``)."""
    return out.with_suffix(".phase")


class DescribeSpec(ChildSpec):
    role: Literal["describe"] = "describe"


class AcceleratorSpec(ChildSpec):
    """One rank of the accelerator run; rank 0 writes the prefill logits and step scores to ``artifacts``."""

    role: Literal["accelerator"] = "accelerator"
    task: Task
    model_dir: Path
    artifacts: Path
    trust_remote_code: bool = False  # the repo's own code may run here (an allow-listed org's)


class ReferenceSpec(ChildSpec):
    """The CPU reference: its own outputs, and (text-generation) the accelerator's tokens scored teacher-forced."""

    role: Literal["reference"] = "reference"
    task: Task
    model_dir: Path
    artifacts: Path
    accelerator: AcceleratorData
    trust_remote_code: bool = False


AnySpec = Annotated[DescribeSpec | AcceleratorSpec | ReferenceSpec, Field(discriminator="role")]


class SpecFile(BaseModel):
    spec: AnySpec


class ReferenceResult(BaseModel):
    """What the reference child found: the payload a stored reference keeps, and the teacher-forced scoring."""

    data: dict[str, Any]
    divergent_steps: list[StepEvidence] = []
    accelerator_loglik: float | None = None
    processor_reordered_steps: list[int] = []  # where the logits processors changed greedy's pick
    reused: bool = False  # from a stored reference: the model did not run again
    # each step's raw logits against the accelerator's, relative, at the reference's top logits (step 0 the prefill)
    step_rel_errors: list[float | None] | None = None  # None at a step: not finite, nothing compared
    long_logprobs: list[float] | None = None  # the accelerator's long tokens' log-probs under the reference
    routing_flips: list[RoutingFlip] | None = None  # MoE: where the accelerator's routing differs (None: not recorded)
    # MoE whose routing flipped: the accelerator's prefill against the reference made to choose its experts
    forced_prefill_rel_error: float | None = None
    forced_step_rel_errors: list[float | None] | None = None  # and each step's (as step_rel_errors)
    forced_accelerator_loglik: float | None = None  # and the accelerator's text's likelihood under that reference
    forced_reference_loglik: float | None = None  # and that reference's best picks' on the same prefix


class ChildOutcome(BaseModel):
    ok: bool
    data: dict[str, Any] | None = None  # validated by the caller against the role's result model
    error_class: ErrorClass | None = None
    message: str = ""
    traceback: str = ""
    graphs_compiled: int | None = None  # a failed accelerator child: the graphs its compiler built by then

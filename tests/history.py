"""Constructing result histories in a database without running models."""

from __future__ import annotations

from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, Stage, Verdict
from shared.contracts.report import RunReport
from shared.contracts.run import RuntimeInfo
from shared.hub.client import ResolvedModel
from shared.jobs.lease import acquire_lease
from shared.jobs.outcomes import finish
from shared.jobs.submission import submit
from shared.settings import Settings


def runtime(compiler: str, library: str) -> RuntimeInfo:
    return RuntimeInfo(
        backend="neuron",
        compiler_name="neuronx-cc",
        compiler_version=compiler,
        library_version=library,
        torch_version="2.13.0",
    )


def record(
    session: Session, model: str, rt: RuntimeInfo, verdict: Verdict, force: bool = False, sha: str = "b" * 40
) -> None:
    """One finished run of ``model`` under ``rt`` with ``verdict``, as a worker would have written it."""
    resolved = ResolvedModel(model_id=model, sha=sha, gated=False, pipeline_tag=None)
    [sub] = submit(session, resolved, None, [rt], force=force)
    acquire_lease(session, sub.job.id, "w", Settings(), Stage.accelerator)
    error = ErrorClass.compile if verdict == Verdict.ERROR else None
    finish(
        session,
        sub.job.id,
        "w",
        RunReport.of(model_id=model, task="text-generation", backend="neuron", verdict=verdict, error_class=error,
                  cores=2, wall_s=12.5, peak_memory_bytes=3 << 30),
    )  # fmt: skip
    session.commit()

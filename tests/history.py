"""Constructing result histories in a database without running models."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, Stage, Verdict
from shared.contracts.report import OPTIONAL_PARTS, ROW_PARTS, RunReport, Subject
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


def report_of(**fields: Any) -> RunReport:
    """A report from flat field names, as a row spells them: each goes to the part that declares it (the
    subject's too; ``verdict``, ``verdict_reason`` and ``runtime`` as they are)."""
    top = {name: fields.pop(name) for name in ("verdict", "verdict_reason", "runtime") if name in fields}
    parts = {"subject": Subject} | {part: model for part, model in ROW_PARTS.items() if part not in OPTIONAL_PARTS}
    values: dict[str, dict[str, Any]] = {}
    for name, value in fields.items():
        [owner] = [part for part, model in parts.items() if name in model.model_fields]
        values.setdefault(owner, {})[name] = value
    return RunReport(**top, **{part: parts[part](**given) for part, given in values.items()})


def record(
    session: Session, model: str, rt: RuntimeInfo, verdict: Verdict, force: bool = False, sha: str = "b" * 40
) -> int:
    """One finished run of ``model`` under ``rt`` with ``verdict``, as a worker would have written it."""
    resolved = ResolvedModel(model_id=model, sha=sha, gated=False, pipeline_tag=None)
    [sub] = submit(session, resolved, None, [rt], force=force)
    acquire_lease(session, sub.job.id, "w", Settings(), Stage.accelerator)
    error = ErrorClass.compile if verdict == Verdict.ERROR else None
    finish(
        session,
        sub.job.id,
        "w",
        report_of(model_id=model, task="text-generation", backend="neuron", verdict=verdict, error_class=error,
                  cores=2, wall_s=12.5, peak_memory_bytes=3 << 30),
    )  # fmt: skip
    session.commit()
    return sub.job.id

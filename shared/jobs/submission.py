"""From "test this model" to job rows: resolve on the Hub, pick the task, size, plan compilers, insert.

Used by the API and by sweeps: nothing here commits or enqueues. A model that needs trust_remote_code from
an org not allowlisted, a gated one the token cannot read, one too large for 16 cores, or one that cannot
be sized gets its job settled at once — SKIPPED(remote_code), SKIPPED(gated), SKIPPED(too_large) or
ERROR(unsizable), with the reason — and is never enqueued.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from shared.enums import ErrorClass, Task, Verdict
from shared.hub.client import Gated, ResolvedModel, Unsizable, model_shape, resolve_model
from shared.hub.sizing import default_core_memory_bytes, size_model
from shared.jobs import rules as jobs
from shared.settings import Settings

# The Hub's pipeline tags we know how to test, and the task each is tested as.
TASK_BY_PIPELINE = {
    "text-generation": Task.text_generation,
    "feature-extraction": Task.feature_extraction,
    "sentence-similarity": Task.feature_extraction,
}


class UnsupportedTask(ValueError):
    pass


@dataclass(frozen=True)
class Request:
    model_id: str
    revision: str | None = None
    compilers: list[str] | None = None
    force: bool = False
    task: Task | None = None
    cores: int | None = None  # None: sized from the Hub's metadata
    fresh: bool = False  # ask the Hub now rather than take its answer of the last few minutes (sweeps)


def choose_task(model: ResolvedModel, requested: Task | None) -> Task:
    if requested is not None:
        return requested
    task = TASK_BY_PIPELINE.get(model.pipeline_tag or "")
    if task is None:
        raise UnsupportedTask(
            f"{model.model_id} is tagged {model.pipeline_tag!r}, which has no test here; "
            f"pass task (one of {[t.value for t in Task]})"
        )
    return task


def submit_model(session: Session, settings: Settings, request: Request) -> list[jobs.Submitted]:
    """Insert (or find) the jobs of a request. Raises the Hub's, the planner's and the task's refusals."""
    model = resolve_model(request.model_id, request.revision, fresh=request.fresh)
    task = choose_task(model, request.task)
    runtimes = jobs.plan_runtimes(session, settings, request.compilers)
    cores, refusal = request.cores, None
    org = model.model_id.split("/")[0]
    if model.needs_remote_code and org not in settings.remote_code_orgs:
        reason = f"{model.model_id} needs trust_remote_code; {org} is not in SUPPORTMATRIX_REMOTE_CODE_ORGS"
        refusal = (Verdict.SKIPPED, ErrorClass.remote_code, reason)
    elif cores is None:
        try:
            sizing = size_model(
                model_shape(model), default_core_memory_bytes(settings.backend, settings.core_memory_gib)
            )
            cores = sizing.cores
            if cores is None:
                refusal = (Verdict.SKIPPED, ErrorClass.too_large, sizing.reason)
        except Unsizable as exc:
            refusal = (Verdict.ERROR, ErrorClass.unsizable, str(exc))
        except Gated as exc:
            refusal = (Verdict.SKIPPED, ErrorClass.gated, str(exc))
    submitted = jobs.submit(session, model, request.revision, runtimes, force=request.force, task=task.value,
                            cores=cores or 1)  # fmt: skip
    if refusal is not None:
        for s in submitted:
            if s.created:
                session.flush()
                jobs.settle(session, s.job, *refusal)
                s.enqueue = False
    return submitted

"""From "test this model" to job rows: resolve on the Hub, pick the task, size, plan compilers, insert.

Used by the API and by sweeps: nothing here commits or enqueues. A model gets its job settled at once, with
the reason, and is never enqueued when it is (in this order): a PEFT adapter without weights of its own
(SKIPPED(adapter)), weights only as GGUF, ONNX or MLX (SKIPPED(format)), in need of trust_remote_code from an
org not allowlisted (SKIPPED(remote_code)), gated where the token cannot read it (SKIPPED(gated)), quantized
with a method the backend does not load (SKIPPED(quantized), ``shared.hub.kinds``), too large for 16 cores
(SKIPPED(too_large)), or impossible to size (ERROR(unsizable)). A pipeline tag we have no test for is refused
(UnsupportedTask: the API's 422, naming the tasks we run).
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.contracts.enums import ACTIVE_STATES, ErrorClass, JobState, Task, Verdict
from shared.contracts.run import IDENTITY_VERSIONS, RuntimeInfo, Stack
from shared.db.models import Job
from shared.hub import kinds
from shared.hub.client import Gated, ResolvedModel, Unsizable, adapter_base, model_shape, read_json, resolve_model
from shared.hub.kinds import Refusal
from shared.hub.sizing import default_core_memory_bytes, run_dtype, size_model, unfit_class
from shared.jobs.outcomes import settle
from shared.jobs.queues import job_queue
from shared.jobs.runtimes import plan_runtimes
from shared.settings import Settings, get_settings
from shared.testconfig import planned_config_hash
from tasks import TASK_BY_LIBRARY, TASK_BY_PIPELINE, declaration


class UnsupportedTask(ValueError):
    pass


@dataclass(frozen=True)
class Request:
    model_id: str
    revision: str | None = None
    compilers: list[str] | None = None
    stacks: list[Stack] | None = None  # exactly these stacks (a rerun of a cell), rather than compilers' every one
    force: bool = False
    task: Task | None = None
    cores: int | None = None  # None: sized from the Hub's metadata
    fresh: bool = False  # ask the Hub now rather than take its answer of the last few minutes (sweeps)
    submitted_by: str | None = None  # the API token's name (a sweep's jobs: the sweep's)


def choose_task(model: ResolvedModel, requested: Task | None) -> Task:
    if requested is not None:
        return requested
    task = TASK_BY_PIPELINE.get(model.pipeline_tag or "")
    if task is None and model.pipeline_tag is None:
        task = TASK_BY_LIBRARY.get(model.library_name or "")
    if task is None:
        raise UnsupportedTask(
            f"{model.model_id} is tagged {model.pipeline_tag!r}, which has no test here; "
            f"the tasks tested are {', '.join(t.value for t in Task)} (pipeline tags "
            f"{', '.join(TASK_BY_PIPELINE)}): pass task to test it as one of them"
        )
    return task


@dataclass
class Submitted:
    job: Job
    created: bool
    enqueue: bool = False  # created and waiting for a worker (not settled at submission)


# What makes two jobs the same test, as columns of the job row.
IDENTITY = ("model_id", "sha", *IDENTITY_VERSIONS, "task", "config_hash", "cores")
# The newest job of an identity in some states: built once, its values bound per call (a submission of a known
# model spent more CPU building this expression than PostgreSQL spent answering it).
_EXISTING = (
    sa.select(Job)
    .where(*(getattr(Job, column) == sa.bindparam(column) for column in IDENTITY))
    .where(Job.state.in_(sa.bindparam("states", expanding=True)))
    .order_by(Job.id.desc())
    .limit(1)
)


def _identity(model: ResolvedModel, runtime: RuntimeInfo, task: str, cores: int) -> dict[str, object]:
    versions = runtime.stack().model_dump()
    hashed = planned_config_hash(task, cores, get_settings())  # this deployment's judge and split
    return {
        "model_id": model.model_id,
        "sha": model.sha,
        **versions,
        "task": task,
        "config_hash": hashed,
        "cores": cores,
    }


def _existing(session: Session, identity: dict[str, object], force: bool) -> Job | None:
    states = ACTIVE_STATES if force else (*ACTIVE_STATES, JobState.done)
    return session.scalars(_EXISTING, {**identity, "states": list(states)}).first()


def submit(
    session: Session,
    model: ResolvedModel,
    revision: str | None,
    runtimes: list[RuntimeInfo],
    *,
    force: bool = False,
    task: str = Task.text_generation.value,
    cores: int = 1,
    submitted_by: str | None = None,
) -> list[Submitted]:
    """One job per runtime; an identical queued, running or done job is returned instead of a new one (still
    its first submitter's: a second token that asks for the same test cannot cancel it).

    ``force`` reruns finished jobs but never doubles a queued or running one. The caller commits, then
    enqueues the created jobs: a message must never reach a worker before its row does.
    """
    out: list[Submitted] = []
    for runtime in runtimes:
        identity = _identity(model, runtime, task, cores)
        existing = _existing(session, identity, force)
        if existing is not None:
            out.append(Submitted(existing, created=False))
            continue
        job = Job(
            # the runtime, then the identity over it: its stack spells a torch no runner has said as ""
            **{**runtime.model_dump(), **identity},
            revision=revision,
            gated=model.gated,
            trust_remote_code=model.needs_remote_code,
            submitted_by=submitted_by,
            queue=job_queue(runtime.backend, runtime.stack(), cores),
            state=JobState.queued,
        )
        try:
            with session.begin_nested():
                session.add(job)
                session.flush()
        except IntegrityError:
            # A concurrent submission inserted the same active job first: return that one.
            raced = _existing(session, identity, force=True)
            if raced is None:
                raise
            out.append(Submitted(raced, created=False))
            continue
        out.append(Submitted(job, created=True, enqueue=True))
    return out


def submit_model(session: Session, settings: Settings, request: Request) -> list[Submitted]:
    """Insert (or find) the jobs of a request. Raises the Hub's, the planner's and the task's refusals."""
    model = resolve_model(request.model_id, request.revision, fresh=request.fresh)
    task = choose_task(model, request.task)
    runtimes = plan_runtimes(session, settings, request.compilers, request.stacks)
    cores, refusal = admit(model, settings, request.cores, task)
    submitted = submit(session, model, request.revision, runtimes, force=request.force, task=task.value,
                       cores=cores or 1, submitted_by=request.submitted_by)  # fmt: skip
    if refusal is not None:
        for s in submitted:
            if s.created:
                session.flush()
                settle(session, s.job, *refusal)
                s.enqueue = False
    return submitted


def admit(
    model: ResolvedModel, settings: Settings, cores: int | None, task: Task = Task.text_generation
) -> tuple[int | None, Refusal | None]:
    """The cores a model runs on (``cores`` when forced, else sized), or why it gets a row without running. A
    task is read from the file its declaration names (a diffusers pipeline's ``model_index.json``, sized by all its
    components' weights), after the refusal it declares, if any."""
    declared = declaration(task)
    if kinds.is_adapter_only(model.files):
        return cores, kinds.adapter_refusal(model.model_id, adapter_base(model))
    if declared.refusal and (refusal := declared.refusal(model.model_id, model.files, model.tags)):
        return cores, refusal
    refusal = kinds.format_refusal(model.model_id, model.files, model.library_name, model.tags)
    if refusal is not None:
        return cores, refusal
    org = model.model_id.split("/")[0]
    if model.needs_remote_code and org not in settings.remote_code_orgs:
        reason = f"{model.model_id} needs trust_remote_code; {org} is not in SUPPORTMATRIX_REMOTE_CODE_ORGS"
        return cores, Refusal(Verdict.SKIPPED, ErrorClass.remote_code, reason)
    try:
        config = read_json(model, declared.config_file)
    except Gated as exc:
        return cores, Refusal(Verdict.SKIPPED, ErrorClass.gated, str(exc))
    except Unsizable as exc:
        # Forced cores need no size: the runner reports what it finds.
        return cores, None if cores is not None else Refusal(Verdict.ERROR, ErrorClass.unsizable, str(exc))
    method = kinds.quantization_method(config)
    if method is not None:
        refusal = kinds.quantization_refusal(model.model_id, method, settings.backend)
        if refusal is not None:
            return cores, refusal
    if cores is not None:
        return cores, None
    try:
        shape = model_shape(model, config)
    except Unsizable as exc:
        return None, Refusal(Verdict.ERROR, ErrorClass.unsizable, str(exc))
    memory = default_core_memory_bytes(settings.backend, settings.core_memory_gib)
    whole = None if declared.sharded else task.value
    sizing = size_model(shape, memory, run_dtype=run_dtype(settings.backend, settings.cpu_dtype), whole=whole)
    if sizing.cores is None:
        return None, Refusal(Verdict.SKIPPED, unfit_class(declared.sharded), sizing.reason)
    return sizing.cores, None

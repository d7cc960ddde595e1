"""Queue names and message ids, defined once. A job's accelerator stage goes to the queue of its software stack
and core-group size; its verdict stage to the verdict queue of the host that ran the accelerator stage."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.contracts.run import STACK_NAME_PREFIX, Stack, safe_name

CONTROL_QUEUE = "supportmatrix.control"  # export and sweep tasks: the collector consumes it
JOB_QUEUE_PREFIX = "supportmatrix.jobs"
VERDICT_QUEUE_PREFIX = "supportmatrix.verdict"

RUN_JOB_TASK = "supportmatrix.run_job"  # the accelerator stage
JUDGE_JOB_TASK = "supportmatrix.judge_job"  # the verdict stage
EXPORT_TASK = "supportmatrix.export"
SWEEP_TASK = "supportmatrix.sweep"
RECONCILE_TASK = "supportmatrix.reconcile"


def job_queue(backend: str, stack: Stack, cores: int) -> str:
    """``supportmatrix.jobs.<backend>.<compiler version>.stack-<digest>.c<cores>``: the compiler version for the
    people who read queue names, the stack's name (``Stack.name``) so that two worker images on one compiler with
    another torch, TorchNeuron, runtime or transformers never share a queue."""
    return f"{JOB_QUEUE_PREFIX}.{backend}.{safe_name(stack.compiler_version)}.{stack.name}.c{cores}"


def compiler_queues_like(backend: str, compiler_version: str) -> str:
    """The SQL ``LIKE`` pattern of the job queues of every stack and core-group size on one compiler version (what the
    trn2-autoscaled overlay's KEDA trigger counts: an image's exact stack is known only once it is built). The
    wildcards are the stack's digest and the size; a ``_`` of the version (``safe_name`` flattens odd characters to
    it) is escaped with PostgreSQL's default escape character, the backslash, so that it matches itself only."""
    version = safe_name(compiler_version).replace("_", "\\_")
    return f"{JOB_QUEUE_PREFIX}.{backend}.{version}.{STACK_NAME_PREFIX}%.c%"


def verdict_queue(host: str) -> str:
    return f"{VERDICT_QUEUE_PREFIX}.{safe_name(host)}"


def celery_task_id(job_id: int) -> str:
    """The broker message of a job carries a stable id, so the API can revoke it."""
    return f"job-{job_id}"


def verdict_task_id(job_id: int) -> str:
    return f"verdict-{job_id}"


@dataclass(frozen=True)
class Deliveries:
    """Which job messages the broker holds, by task id (``shared.jobs.broker.deliveries`` reads them)."""

    waiting: frozenset[str] = frozenset()  # in a queue, not yet taken
    taken_s_ago: dict[str, float] = field(default_factory=dict)  # taken by a worker, not yet acknowledged

    def holds(self, task_id: str, taken_within_s: float) -> bool:
        """A message waits, or was taken within ``taken_within_s`` (a live worker claims what it takes at once;
        an older unacknowledged one belongs to a worker that died holding it)."""
        return task_id in self.waiting or self.taken_s_ago.get(task_id, taken_within_s + 1) <= taken_within_s

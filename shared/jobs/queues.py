"""Queue names and message ids, defined once. A job's accelerator stage goes to the queue of its compiler
version and core-group size; its verdict stage to the verdict queue of the host that ran the accelerator stage."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

CONTROL_QUEUE = "supportmatrix.control"  # export and sweep tasks: the collector consumes it
JOB_QUEUE_PREFIX = "supportmatrix.jobs"
VERDICT_QUEUE_PREFIX = "supportmatrix.verdict"

RUN_JOB_TASK = "supportmatrix.run_job"  # the accelerator stage
JUDGE_JOB_TASK = "supportmatrix.judge_job"  # the verdict stage
EXPORT_TASK = "supportmatrix.export"
SWEEP_TASK = "supportmatrix.sweep"
RECONCILE_TASK = "supportmatrix.reconcile"


def job_queue(backend: str, compiler_version: str, cores: int) -> str:
    # Versions like "2.21.33363.0+6dfecc895" are safe Redis keys; anything odd is flattened anyway.
    version = re.sub(r"[^A-Za-z0-9.+_-]", "_", compiler_version)
    return f"{JOB_QUEUE_PREFIX}.{backend}.{version}.c{cores}"


def verdict_queue(host: str) -> str:
    return f"{VERDICT_QUEUE_PREFIX}.{re.sub(r'[^A-Za-z0-9.+_-]', '_', host)}"


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

"""Queue names, defined once. A job's accelerator stage goes to the queue of its compiler version and
core-group size; its verdict stage to the verdict queue of the host that ran the accelerator stage."""

from __future__ import annotations

import re

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

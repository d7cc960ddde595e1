"""Running one stage of a job as a runner child: hard timeout, lease heartbeats, cancel, crash capture.

The worker never imports torch or the runner: it starts `python -m services.runner` (the command derived
from a ``RunRequest``) in its own process group, with an allow-listed environment — forked from the host's
warm zygote when there is one (shared/zygote_client.py), else as a fresh interpreter — and reads the report it
writes. Whatever happens to that process — crash, hang, OOM kill — ends here as a RunReport (ERROR with its
class), never as a dead worker. The runner dies with the worker too: a fresh one by a parent-death signal, a
forked one by the zygote when the worker's connection to it closes.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Callable

from celery.utils.log import get_task_logger
from pydantic import ValidationError

from shared.contracts.enums import ErrorClass, Stage, Verdict
from shared.contracts.handoffs import Artifacts
from shared.contracts.report import RunReport
from shared.contracts.run import RUNNER_MODULE, RunRequest
from shared.cores import CoreGroup, cpu_set, pin_environment
from shared.db.models import Job
from shared.isolation import RunAs
from shared.jobs.outcomes import job_report
from shared.processes import describe_exit, output_tail
from shared.settings import Settings, child_environment
from shared.zygote_client import kill_group, start_python, zygote_address

logger = get_task_logger(__name__)
STAGE_LIMIT_GRACE_S = 30.0  # the runner reports its own timeouts; this waits a little for that report


def runner_command(request: RunRequest) -> list[str]:
    return [sys.executable, "-m", RUNNER_MODULE, *request.to_argv()]


def supervise(
    request: RunRequest,
    job: Job,
    settings: Settings,
    keep_lease: Callable[[], bool],
    group: CoreGroup | None,
    secrets: dict[str, str] | None = None,
    run_as: RunAs | None = None,
    private: dict[str, str] | None = None,
) -> RunReport | None:
    """Run one stage to its end; None when the lease was lost (cancelled), so nothing is written.

    ``group`` pins the runner to a core group (the accelerator stage); None leaves it on the host's CPUs.
    ``secrets`` are the only secret variables the child gets (a gated model's HF_TOKEN, the judge's token).
    ``run_as`` is the user it runs as, ``private`` what it is given instead of the shared directories (a run of
    a repo's own code: shared.isolation).
    """
    assert request.report is not None and request.artifacts is not None
    log_path = request.artifacts / f"{request.stage.value}-runner.log"
    # A backstop to the runner's own budgets, which it enforces first (and names the phase that ran out of its).
    compiles = request.stage in (Stage.accelerator, Stage.full)
    limit_s = settings.stage_limit_s(compiles) + STAGE_LIMIT_GRACE_S
    deadline = time.monotonic() + limit_s
    core_range = str(group) if group else None

    def failed(error_class: ErrorClass, message: str) -> RunReport:
        return job_report(job, Verdict.ERROR, error_class, message, core_range=core_range)

    request.report.unlink(missing_ok=True)
    try:
        proc, refused = start_python(
            RUNNER_MODULE,
            request.to_argv(),
            child_environment(
                settings, (pin_environment(job.backend, group) if group else {}) | (private or {}), secrets
            ),
            log_path,
            own_group=True,  # one kill takes the runner and its children
            cpus=cpu_set(group) if group and job.backend == "cpu" else None,
            zygote=zygote_address(settings.data_dir, settings.host_name) if settings.zygote else None,
            run_as=run_as,
        )
    except OSError as exc:  # the host's fault (an interpreter its runner user may not run): the row says so
        who = run_as.name if run_as else "the worker's user"
        return failed(ErrorClass.internal, f"the {request.stage.value} runner could not start as {who}: {exc}")
    how = "forked by the zygote" if not isinstance(proc, subprocess.Popen) else f"a fresh interpreter{refused or ''}"
    logger.info(
        "starting runner: job %s, %s stage: %s (pid %s, %s, as %s)",
        job.id, request.stage.value, shlex.join(runner_command(request)), proc.pid, how,
        run_as.name if run_as else "the worker's user",
    )  # fmt: skip
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                kill_group(proc)
                phase = Artifacts(request.artifacts).latest_phase()
                where = f" in the {phase.phase} phase" if phase else " before any model phase"
                return failed(
                    ErrorClass.timeout, f"runner exceeded its stage's {limit_s:.0f} s limit{where} and was killed"
                )
            try:
                returncode = proc.wait(timeout=min(settings.heartbeat_interval_s, remaining))
                break
            except subprocess.TimeoutExpired:
                if not keep_lease():
                    kill_group(proc)
                    return None
    finally:
        if proc.poll() is None:
            kill_group(proc)
    try:
        report = RunReport.model_validate_json(request.report.read_text())
    except (OSError, ValidationError) as exc:
        tail = output_tail(log_path)
        message = f"runner {describe_exit(returncode)} without a report ({type(exc).__name__}); output:\n{tail}"
        return failed(ErrorClass.crash, message)
    report.provenance.cores = job.cores
    return report

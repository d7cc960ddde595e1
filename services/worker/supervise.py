"""Running one job's runner as a child process: hard timeout, lease heartbeats, cancel, crash capture.

The worker never imports torch or the runner: it starts `python -m services.runner` in its own
process group and reads the report it writes. Whatever happens to that process — crash, hang, OOM kill —
ends here as a RunReport (ERROR with its class), never as a dead worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from shared.contracts import RunReport
from shared.cores import CoreGroup, cpu_set, pin_environment
from shared.db.models import Job
from shared.enums import ErrorClass, Verdict
from shared.jobs.rules import job_report
from shared.processes import describe_exit, output_tail
from shared.settings import Settings, child_environment


def runner_command(job: Job, report_path: Path, group: CoreGroup) -> list[str]:
    return [
        sys.executable,
        "-m",
        "services.runner",
        job.model_id,
        "--revision",
        job.sha,
        "--backend",
        job.backend,
        "--task",
        job.task,
        "--cores",
        str(job.cores),
        "--core-range",
        str(group),
        "--report",
        str(report_path),
    ]


def error_report(job: Job, error_class: ErrorClass, message: str, group: CoreGroup) -> RunReport:
    return job_report(job, Verdict.ERROR, error_class, message, core_range=str(group))


def supervise(
    job: Job,
    settings: Settings,
    workdir: Path,
    keep_lease: Callable[[], bool],
    group: CoreGroup,
) -> RunReport | None:
    """Run the job's runner to its end; None when the lease was lost (cancelled), so nothing is written."""
    report_path = workdir / "report.json"
    log_path = workdir / "runner.log"
    deadline = time.monotonic() + settings.job_timeout_s
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            runner_command(job, report_path, group),
            env=child_environment(pin_environment(job.backend, group)),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: one kill takes the runner and its children
            preexec_fn=_pin_cpus(group) if job.backend == "cpu" else None,
        )
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _kill_group(proc)
                    return error_report(
                        job,
                        ErrorClass.timeout,
                        f"runner exceeded the {settings.job_timeout_s:.0f} s limit and was killed",
                        group,
                    )
                try:
                    returncode = proc.wait(timeout=min(settings.heartbeat_interval_s, remaining))
                    break
                except subprocess.TimeoutExpired:
                    if not keep_lease():
                        _kill_group(proc)
                        return None
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    try:
        report = RunReport.model_validate_json(report_path.read_text())
    except (OSError, ValidationError) as exc:
        tail = output_tail(log_path)
        message = f"runner {describe_exit(returncode)} without a report ({type(exc).__name__}); output:\n{tail}"
        return error_report(job, ErrorClass.crash, message, group)
    report.cores = job.cores
    return report


def _pin_cpus(group: CoreGroup) -> Callable[[], None]:
    cpus = cpu_set(group)

    def pin() -> None:  # in the child, before exec: the runner and all it starts inherit the affinity
        os.sched_setaffinity(0, cpus)

    return pin


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

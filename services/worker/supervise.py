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
from enum import Enum
from pathlib import Path

from celery.utils.log import get_task_logger
from pydantic import ValidationError

from shared.contracts.enums import ErrorClass, Stage, Verdict
from shared.contracts.handoffs import Artifacts, read_regular
from shared.contracts.report import RunReport
from shared.contracts.run import RUNNER_MODULE, RunRequest
from shared.cores import CoreGroup, cpu_set, pin_environment
from shared.db.models import Job
from shared.isolation import DownloadStaging, RunAs, Sandbox, WorkDir
from shared.jobs.outcomes import job_report
from shared.processes import ChildProcess, describe_exit, output_tail
from shared.settings import Settings, child_environment
from shared.zygote_client import kill_group, start_python, zygote_address

logger = get_task_logger(__name__)
STAGE_LIMIT_GRACE_S = 30.0  # the runner reports its own timeouts; this waits a little for that report
DOWNLOAD_MODULE = "services.runner.download"  # started, never imported: the worker imports no runner code
HUB_TOKEN = "HF_TOKEN"


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
    a repo's own code: shared.isolation). The runner works in a directory of its own user's (``WorkDir``), kept
    with the artifacts while the row may be a FAIL or is an ERROR (the retention rule of the worker's tasks then
    decides), removed when the stage ends otherwise. A repo's own code never gets the Hub token: for a gated one
    the worker downloads first (``prefetch``), and its runner reads that download offline, within what is left of
    the stage's limit; with runners not isolated (``run_as`` None: the code could read this worker's environment)
    such a repo is not run, SKIPPED(remote_code).
    """
    assert request.report is not None and request.artifacts is not None
    core_range = str(group) if group else None

    def failed(error_class: ErrorClass, message: str) -> RunReport:
        return job_report(job, Verdict.ERROR, error_class, message, core_range=core_range)

    started = time.monotonic()
    secrets = dict(secrets or {})
    overrides = (pin_environment(job.backend, group) if group else {}) | (private or {})
    request.report.unlink(missing_ok=True)
    if job.trust_remote_code and (token := secrets.pop(HUB_TOKEN, None)) is not None:
        if run_as is None:
            return job_report(job, Verdict.SKIPPED, ErrorClass.remote_code, NOT_ISOLATED, core_range=core_range)
        prefetched = prefetch(request, job, settings, keep_lease, token, run_as, failed)
        if prefetched is Prefetched.lease_lost:
            return None
        if prefetched is not Prefetched.done:
            return prefetched
        overrides |= {"HF_HUB_OFFLINE": "1"}
    spent_s = time.monotonic() - started  # the worker's download: the stage's limit includes it
    if spent_s > 1.0:  # the runner's own budget outside compilation is what is left of it
        left_s = max((request.timeout_s or settings.job_timeout_s) - spent_s, 1.0)
        request = request.model_copy(update={"timeout_s": left_s})
    assert request.artifacts is not None, "a stage's request names its job's artifacts (_stage_request)"
    work = WorkDir.of_stage(request.artifacts, request.stage.value)
    try:
        work.create(run_as)
    except OSError as exc:
        return failed(ErrorClass.internal, f"the runner's work directory {work.path} could not be made: {exc}")
    report: RunReport | None = None
    try:
        env = child_environment(settings, overrides | work.environment(), secrets)
        report = _run_stage(request, job, settings, keep_lease, group, env, run_as, failed, spent_s)
        return report
    finally:
        if not keeps_work_directory(report):
            work.remove()


# Why a gated repo with code of its own is not run by a worker that cannot isolate it.
NOT_ISOLATED = (
    "not run: a gated repo with code of its own needs runners under users of their own (a root worker, "
    "SUPPORTMATRIX_RUNNER_USER set): here its code would run as this worker's user, which can read the worker's "
    "environment and so its Hub token (docs/security.md)"
)


def keeps_work_directory(report: RunReport | None) -> bool:
    """Whether a stage's work directory (TorchNeuron's graphs and dumps) stays with the job's artifacts: while
    the row may still be a FAIL (the accelerator stage handing over to the verdict), and for a FAIL or an ERROR —
    the worker's retention rule then keeps a FAIL's artifacts for inspection and removes the rest. A PASS's, a
    SKIPPED's and a cancelled stage's go at once."""
    if report is None:
        return False
    return report.verdict in (None, Verdict.FAIL, Verdict.ERROR)


def _run_stage(
    request: RunRequest, job: Job, settings: Settings, keep_lease: Callable[[], bool], group: CoreGroup | None,
    env: dict[str, str], run_as: RunAs | None, failed: Callable[[ErrorClass, str], RunReport], spent_s: float,
) -> RunReport | None:  # fmt: skip
    """The stage's runner, started with ``env`` and waited for: its report, or why there is none. ``spent_s`` of
    the stage's limit went before it (the worker's download)."""
    assert request.report is not None and request.artifacts is not None
    log_path = request.artifacts / f"{request.stage.value}-runner.log"
    # A backstop to the runner's own budgets, which it enforces first (and names the phase that ran out of its).
    compiles = request.stage in (Stage.accelerator, Stage.full)
    limit_s = settings.stage_limit_s(compiles) + STAGE_LIMIT_GRACE_S
    deadline = time.monotonic() + limit_s - spent_s
    try:
        proc, refused = start_python(
            RUNNER_MODULE,
            request.to_argv(),
            env,
            log_path,
            own_group=True,  # one kill takes the runner and its children
            cpus=cpu_set(group) if group and job.backend == "cpu" else None,
            zygote=zygote_address(settings.data_dir, settings.host_name) if settings.zygote else None,
            run_as=run_as,
        )
    # the host's fault (an interpreter its runner user may not run; a child that failed before its exec, as Popen
    # says it): the row says so
    except (OSError, subprocess.SubprocessError) as exc:
        who = run_as.name if run_as else "the worker's user"
        return failed(ErrorClass.internal, f"the {request.stage.value} runner could not start as {who}: {exc}")
    how = "forked by the zygote" if not isinstance(proc, subprocess.Popen) else f"a fresh interpreter{refused or ''}"
    logger.info(
        "starting runner: job %s, %s stage: %s (pid %s, %s, as %s)",
        job.id, request.stage.value, shlex.join(runner_command(request)), proc.pid, how,
        run_as.name if run_as else "the worker's user",
    )  # fmt: skip
    try:
        returncode = wait(proc, deadline, keep_lease, settings.heartbeat_interval_s)
    except DeadlinePassed:
        phase = Artifacts(request.artifacts).latest_phase()
        where = f" in the {phase.phase} phase" if phase else " before any model phase"
        before = f", {spent_s:.0f} s of it the worker's download" if spent_s >= 1 else ""
        message = f"runner exceeded its stage's {limit_s:.0f} s limit{before}{where} and was killed"
        return failed(ErrorClass.timeout, message)
    if returncode is None:
        return None
    report = read_report(request.report)
    if report is None:
        return failed(ErrorClass.crash, crashed("runner", returncode, log_path))
    report.provenance.cores = job.cores
    return report


class DeadlinePassed(Exception):
    """A child ran past its deadline and was killed."""


def wait(proc: ChildProcess, deadline: float, keep_lease: Callable[[], bool], interval_s: float) -> int | None:
    """The child's exit status, keeping the lease meanwhile; None when the lease was lost, and DeadlinePassed
    past ``deadline`` (the child's process group killed either way)."""
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                kill_group(proc)
                raise DeadlinePassed
            try:
                return proc.wait(timeout=min(interval_s, remaining))
            except subprocess.TimeoutExpired:
                if not keep_lease():
                    kill_group(proc)
                    return None
    finally:
        if proc.poll() is None:
            kill_group(proc)


def read_report(path: Path) -> RunReport | None:
    """The report a child wrote; None when it wrote none that parses (or left a link at its name)."""
    try:
        return RunReport.model_validate_json(read_regular(path))
    except (OSError, ValidationError):
        return None


def crashed(what: str, returncode: int, log_path: Path) -> str:
    return f"{what} {describe_exit(returncode)} without a report; output:\n{output_tail(log_path)}"


class Prefetched(Enum):
    """How the worker's download of a gated repo with code ended, when it left no report to write."""

    done = "done"
    lease_lost = "lease_lost"


def prefetch(
    request: RunRequest, job: Job, settings: Settings, keep_lease: Callable[[], bool], token: str, run_as: RunAs,
    failed: Callable[[ErrorClass, str], RunReport],
) -> Prefetched | RunReport:  # fmt: skip
    """A gated repo with code of its own, downloaded by the worker: a child of the worker's own user (no runner's
    user may read its environment, which holds ``token``) runs no repo code and fetches the repo, its code from
    the same commit, into a staging directory only the worker can reach (``DownloadStaging``: no process of
    ``run_as`` can plant a link there for the download to write through). Once the child's process group is gone,
    the files are given to ``run_as`` and moved into the job's sandbox Hub cache. ``done`` when the files are
    there; else the report of why not (the download's own: gated, not found, the Hub down, …; or the worker's: a
    crash, a timeout, a staging that could not be made or handed over), or ``lease_lost``."""
    assert request.artifacts is not None
    try:
        staging = DownloadStaging.create(request.artifacts.parent, request.artifacts.name)
    except OSError as exc:
        return failed(ErrorClass.internal, f"the worker's download of {job.model_id} has no private directory: {exc}")
    try:
        download = request.model_copy(update={"report": staging.report})
        limit_s = settings.job_timeout_s  # what the runner's own download had: the stage's budget outside compiling
        deadline = time.monotonic() + limit_s
        env = child_environment(settings, staging.environment(), {HUB_TOKEN: token})
        try:
            proc, _ = start_python(DOWNLOAD_MODULE, download.to_argv(), env, staging.log, own_group=True)
        except OSError as exc:
            return failed(ErrorClass.internal, f"the worker's download of {job.model_id} could not start: {exc}")
        logger.info("job %s: the worker downloads gated %s for its code's sandbox (pid %s)", job.id, job.model_id,
                    proc.pid)  # fmt: skip
        try:
            returncode = wait(proc, deadline, keep_lease, settings.heartbeat_interval_s)
        except DeadlinePassed:
            return failed(ErrorClass.timeout, f"the worker's download of {job.model_id} ran past {limit_s:g} s")
        kill_group(proc)  # anything the download left running goes before its files are handed over
        if returncode is None:
            return Prefetched.lease_lost
        if returncode != 0:
            report = read_report(staging.report)
            if report is None:
                return failed(ErrorClass.crash, crashed("the worker's download", returncode, staging.log))
            report.provenance.cores = job.cores
            return report
        try:
            staging.hand_over(request.artifacts, Sandbox.of_job(request.artifacts), run_as)
        except OSError as exc:
            return failed(ErrorClass.internal, f"the worker's download of {job.model_id} was not handed over: {exc}")
        return Prefetched.done
    finally:
        staging.remove()

"""How a job ends: with a result (finished by its worker, or closed while unattended), settled at submission, or
cancelled. ``_close`` is the one way a job ends with a result: its final state and its result row in one
transaction."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import ACTIVE_STATES, FINISHED_STATES, ErrorClass, JobState, Verdict
from shared.contracts.report import Failure, Provenance, RunReport, Subject, row_values
from shared.db.engine import rows_changed
from shared.db.models import Job, Result, utcnow
from shared.jobs.attempts import end_attempts, end_job_attempt
from shared.results.signatures import error_signature, fail_signature


class JobNotFound(LookupError):
    pass


class JobFinished(RuntimeError):
    pass


class NotYourJob(PermissionError):
    pass


def cancel(session: Session, job_id: int, by: str, any_job: bool) -> Job:
    """Queued or running → cancelled, by the token named ``by``: its own job, or any when ``any_job`` (an admin
    token). The worker that holds a running job sees it and kills its runner."""
    job = session.get(Job, job_id, with_for_update=True)
    if job is None:
        raise JobNotFound(f"job {job_id} does not exist")
    if not any_job and job.submitted_by != by:
        owner = f"token {job.submitted_by!r}" if job.submitted_by else "a scheduled sweep"
        raise NotYourJob(
            f"job {job_id} was submitted by {owner}; a submit token cancels only the jobs it submitted "
            "(an admin token cancels any)"
        )
    if job.state == JobState.cancelled:
        return job
    if job.state in FINISHED_STATES:
        raise JobFinished(f"job {job_id} already finished ({job.state.value})")
    job.state = JobState.cancelled
    job.finished_at = utcnow()
    end_attempts(job, "cancelled")
    return job


def job_report(
    job: Job, verdict: Verdict, error_class: ErrorClass, message: str, core_range: str | None = None
) -> RunReport:
    """The report of a job that ended without a runner's report: settled, timed out, crashed, lost."""
    runtime = job.runtime()
    return RunReport(
        subject=Subject.model_validate(job, from_attributes=True),
        verdict=verdict,
        runtime=runtime if runtime.torch_version else runtime.model_copy(update={"torch_version": None}),
        failure=Failure(error_class=error_class, error_message=message),
        provenance=Provenance(cores=job.cores, core_range=core_range),
    )


def finish(session: Session, job_id: int, owner: str, report: RunReport) -> bool:
    """Write the result of a job we hold; False (nothing written) when the lease is no longer ours."""
    held = sa.and_(Job.lease_owner == owner, Job.state.in_(ACTIVE_STATES))
    written = _close(session, job_id, held, report)
    if written:
        end_job_attempt(session, job_id, f"done: wrote the result ({report.verdict})")
    return written


def settle(session: Session, job: Job, verdict: Verdict, error_class: ErrorClass, reason: str) -> None:
    """Finish a just-created, still queued job without running it (refused at submission)."""
    settled = job.state == JobState.queued and close_unattended(
        session, job, job_report(job, verdict, error_class, reason)
    )
    assert settled, f"job {job.id} was no longer queued"
    session.refresh(job)


def close_unattended(session: Session, job: Job, report: RunReport) -> bool:
    """End a job that nobody holds (or whose holder is gone) as it was read: False when it moved meanwhile —
    taken, heartbeated or finished — so that a live worker's job is never closed under it."""
    unchanged = sa.and_(
        Job.state == job.state,
        Job.lease_owner.is_(None) if job.lease_owner is None else Job.lease_owner == job.lease_owner,
        Job.heartbeat_at.is_(None) if job.heartbeat_at is None else Job.heartbeat_at == job.heartbeat_at,
    )
    closed = _close(session, job.id, unchanged, report)
    if closed:
        end_job_attempt(session, job.id, f"ended {report.failure.error_class or report.verdict} while unattended")
    return closed


def _close(session: Session, job_id: int, condition: sa.ColumnElement[bool], report: RunReport) -> bool:
    """The one way a job ends with a result: its final state and its result row, in the caller's transaction."""
    assert report.verdict is not None, "a result needs a verdict"
    state = JobState.failed if report.verdict == Verdict.ERROR else JobState.done
    now = utcnow()
    moved = rows_changed(
        session,
        sa.update(Job)
        .where(Job.id == job_id, condition)
        .values(
            state=state,
            finished_at=now,
            heartbeat_at=now,
            error_class=report.failure.error_class,
            error_message=report.failure.error_message,
        )
        .execution_options(synchronize_session=False),
    )
    if not moved:
        return False
    session.add(Result(job_id=job_id, **row_values(_with_signature(report))))
    return True


def _with_signature(report: RunReport) -> RunReport:
    """``report`` with its failure signature: an ERROR or FAIL keeps the runner's (which saw the traceback),
    else gets one from its message or verdict reason — a job the worker ended (timeout, crash, lost, no
    worker, refused at submission) or a FAIL, whose reason names the rule that failed it."""
    failure = report.failure
    if failure.signature_id is not None or report.verdict not in (Verdict.ERROR, Verdict.FAIL):
        return report
    model_id = report.subject.model_id
    if report.verdict == Verdict.FAIL:
        signature = fail_signature(report.verdict_reason, model_id)
    else:
        signature = error_signature(failure.error_class, failure.error_message, model_id=model_id)
    signed = failure.model_copy(update={"failure_signature": signature.text, "signature_id": signature.id})
    return report.model_copy(update={"failure": signed})

"""Job rules on a real database (SQLite here; the pipeline tests run them on PostgreSQL)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, JobState, Stage, Verdict
from shared.contracts.report import RunReport
from shared.contracts.run import RuntimeInfo
from shared.db.models import Job, Result, Worker, utcnow
from shared.hub.client import ResolvedModel
from shared.jobs.attempts import attempts
from shared.jobs.lease import Claim, acquire_lease, heartbeat, release_for_verdict
from shared.jobs.outcomes import JobFinished, JobNotFound, NotYourJob, cancel, finish, settle
from shared.jobs.queues import job_queue
from shared.jobs.reconcile import mark_queue_live, reconcile
from shared.jobs.runtimes import RUNTIMES_SNAPSHOT_S, NoRuntime, UnknownCompiler, plan_runtimes, served_runtimes
from shared.jobs.submission import submit
from shared.settings import Settings
from tests.conftest import fresh_database
from tests.history import report_of

RUNTIME = RuntimeInfo(
    backend="cpu",
    compiler_name="inductor",
    compiler_version="inductor-2.13.0+cpu",
    library_version="5.24.0",
    torch_version="2.13.0+cpu",
)
ADMIN = "an-admin-token"
MODEL = ResolvedModel(model_id="org/m", sha="a" * 40, gated=False, pipeline_tag="text-generation")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path, max_attempts=2, lease_timeout_s=30, default_compiler=None)


def report(verdict: Verdict = Verdict.PASS, error_class: ErrorClass | None = None) -> RunReport:
    return report_of(model_id="org/m", task="text-generation", backend="cpu", verdict=verdict, error_class=error_class)


def new_job(session: Session, force: bool = False) -> Job:
    [submitted] = submit(session, MODEL, None, [RUNTIME], force=force)
    session.commit()
    return submitted.job


def test_a_leased_job_cannot_be_leased_again(session: Session, settings: Settings) -> None:
    job = new_job(session)
    assert acquire_lease(session, job.id, "w1", settings)[0] == Claim.taken
    assert acquire_lease(session, job.id, "w2", settings)[0] == Claim.held  # deliver again later
    assert finish(session, job.id, "w2", report()) is False  # not the lease owner
    assert finish(session, job.id, "w1", report()) is True
    session.commit()
    assert acquire_lease(session, job.id, "w1", settings)[0] == Claim.gone  # done: a redelivery does nothing
    assert session.scalar(sa.select(sa.func.count()).select_from(Result)) == 1
    assert session.get(Job, job.id, populate_existing=True).state == JobState.done


def test_a_stale_lease_is_taken_over_until_attempts_run_out(session: Session, settings: Settings) -> None:
    job = new_job(session)
    assert acquire_lease(session, job.id, "w1", settings)[0] == Claim.taken
    stale = utcnow() - dt.timedelta(seconds=settings.lease_timeout_s + 1)
    session.execute(sa.update(Job).values(heartbeat_at=stale))
    claim, taken = acquire_lease(session, job.id, "w2", settings)
    assert claim == Claim.taken and taken is not None and taken.attempts == 2 and taken.lease_owner == "w2"
    assert heartbeat(session, job.id, "w1") is False  # the old owner learns it lost the lease
    session.execute(sa.update(Job).values(heartbeat_at=stale))
    assert acquire_lease(session, job.id, "w3", settings)[0] == Claim.gone  # max_attempts=2 reached
    session.commit()
    job = session.get(Job, job.id, populate_existing=True)
    assert job.state == JobState.failed and job.error_class == ErrorClass.worker_lost
    assert job.result is not None and job.result.verdict == Verdict.ERROR


def test_cancelled_job_is_never_run_or_written(session: Session, settings: Settings) -> None:
    job = new_job(session)
    assert acquire_lease(session, job.id, "w1", settings)[0] == Claim.taken
    cancel(session, job.id, by=ADMIN, any_job=True)
    session.commit()
    assert heartbeat(session, job.id, "w1") is False
    assert finish(session, job.id, "w1", report()) is False
    queued = new_job(session, force=True)
    cancel(session, queued.id, by=ADMIN, any_job=True)
    assert acquire_lease(session, queued.id, "w1", settings)[0] == Claim.gone
    with pytest.raises(JobNotFound):
        cancel(session, 12345, by=ADMIN, any_job=True)


def test_the_verdict_stage_is_taken_from_judging_after_the_cores_are_released(
    session: Session, settings: Settings
) -> None:
    job = new_job(session)
    assert acquire_lease(session, job.id, "acc", settings)[0] == Claim.taken
    # a verdict stage cannot start while the accelerator stage runs
    assert acquire_lease(session, job.id, "v1", settings, Stage.verdict)[0] == Claim.gone
    assert release_for_verdict(session, job.id, "acc", "supportmatrix.verdict.h")
    job = session.get(Job, job.id, populate_existing=True)
    assert job.state == JobState.judging and job.lease_owner is None and job.verdict_queue == "supportmatrix.verdict.h"
    assert finish(session, job.id, "acc", report()) is False  # the accelerator stage holds nothing now
    # the accelerator stage's message, redelivered, is spent; the verdict stage takes the job once
    assert acquire_lease(session, job.id, "acc2", settings)[0] == Claim.gone
    assert acquire_lease(session, job.id, "v1", settings, Stage.verdict)[0] == Claim.taken
    assert acquire_lease(session, job.id, "v2", settings, Stage.verdict)[0] == Claim.held
    # an owner known to be dead is taken over at once, without waiting for its lease to lapse
    claim, taken = acquire_lease(session, job.id, "v2", settings, Stage.verdict, dead_owner="v1")
    assert claim == Claim.taken and taken is not None and taken.verdict_attempts == 2 and taken.attempts == 1
    assert heartbeat(session, job.id, "v1") is False and heartbeat(session, job.id, "v2") is True
    # max_attempts=2: a third verdict delivery ends the job ERROR(worker_lost), with one result row
    assert acquire_lease(session, job.id, "v3", settings, Stage.verdict, dead_owner="v2")[0] == Claim.gone
    session.commit()
    job = session.get(Job, job.id, populate_existing=True)
    assert job.state == JobState.failed and job.error_class == ErrorClass.worker_lost
    assert "verdict stage was delivered 2 times" in (job.error_message or "")
    log = attempts(job)
    assert [(a.stage, a.owner) for a in log] == [
        (Stage.accelerator, "acc"),
        (Stage.verdict, "v1"),
        (Stage.verdict, "v2"),
    ]
    assert [a.ended for a in log] == [
        "done: released its cores for the verdict stage",
        "lost: its process died",
        "lost: its process died",
    ]
    for attempt in log[1:]:  # ERROR(worker_lost) lists each attempt: owner, stage, start, how it ended
        assert f"{attempt.owner} (verdict, {attempt.started_at:%Y-%m-%d %H:%M:%S}): lost" in (job.error_message or "")
    assert session.scalar(sa.select(sa.func.count()).select_from(Result).where(Result.job_id == job.id)) == 1


def test_a_submit_token_cancels_only_its_own_jobs_and_an_admin_any(session: Session) -> None:
    [mine] = submit(session, MODEL, None, [RUNTIME], submitted_by="alice")
    [scheduled] = submit(session, MODEL, None, [RUNTIME], cores=2)  # a scheduled sweep's: no token
    for job, owner in ((mine.job, "token 'alice'"), (scheduled.job, "a scheduled sweep")):
        with pytest.raises(NotYourJob, match=f"submitted by {owner}; a submit token cancels only the jobs it"):
            cancel(session, job.id, by="bob", any_job=False)
        assert job.state == JobState.queued
    assert cancel(session, mine.job.id, by="alice", any_job=False).state == JobState.cancelled
    assert cancel(session, scheduled.job.id, by=ADMIN, any_job=True).state == JobState.cancelled


def test_settle_ends_a_queued_job_without_a_lease(session: Session, settings: Settings) -> None:
    job = new_job(session)
    settle(session, job, Verdict.SKIPPED, ErrorClass.too_large, "needs 32 cores")
    session.commit()
    assert job.state == JobState.done and job.lease_owner is None and job.error_class == ErrorClass.too_large
    assert job.result is not None and job.result.verdict == Verdict.SKIPPED
    with pytest.raises(AssertionError, match="no longer queued"):
        settle(session, job, Verdict.SKIPPED, ErrorClass.too_large, "twice")


def test_finished_jobs_cannot_be_cancelled(session: Session, settings: Settings) -> None:
    job = new_job(session)
    acquire_lease(session, job.id, "w1", settings)
    finish(session, job.id, "w1", report(Verdict.ERROR, ErrorClass.compile))
    assert session.get(Job, job.id, populate_existing=True).state == JobState.failed
    with pytest.raises(JobFinished):
        cancel(session, job.id, by=ADMIN, any_job=True)


def test_submission_deduplicates_and_the_database_refuses_a_second_active_job(session: Session) -> None:
    first = new_job(session)
    [again] = submit(session, MODEL, "main", [RUNTIME])
    assert not again.created and again.job.id == first.id
    [forced] = submit(session, MODEL, None, [RUNTIME], force=True)
    assert not forced.created  # force never doubles an active job
    columns = ("model_id", "sha", "task", "compiler_name", "compiler_version", "library", "library_version",
               "torch_version", "backend", "queue", "config_hash")  # fmt: skip
    duplicate = Job(**{c: getattr(first, c) for c in columns})
    session.add(duplicate)
    with pytest.raises(sa.exc.IntegrityError):
        session.flush()


def live_worker(name: str, version: str, beat: dt.datetime | None = None, torch: str = "2") -> Worker:
    return Worker(name=name, host="h", pid=1, backend="cpu", compiler_name="c", compiler_version=version,
                  library="transformers", library_version="5", torch_version=torch, cores="0", core_count=1,
                  queue="q", heartbeat_at=beat or utcnow())  # fmt: skip


def test_without_a_live_worker_the_default_runtime_is_planned(session: Session, settings: Settings) -> None:
    with pytest.raises(NoRuntime):
        plan_runtimes(session, settings.model_copy(update={"backend": "neuron"}), None)
    default = plan_runtimes(session, settings.model_copy(update={"default_compiler": "x-1"}), None)
    assert [r.compiler_version for r in default] == ["x-1"]


def test_runtimes_come_from_live_workers_not_stale_ones(session: Session, settings: Settings) -> None:
    session.add_all([live_worker("a", "c-1"), live_worker("b", "c-2", utcnow() - dt.timedelta(hours=1))])
    session.flush()
    assert [r.compiler_version for r in plan_runtimes(session, settings, None)] == ["c-1"]
    with pytest.raises(UnknownCompiler, match="'c-2' is not served"):
        plan_runtimes(session, settings, ["c-2"])


def test_a_newly_live_workers_runtime_is_served_once_the_snapshot_has_aged(
    session: Session, settings: Settings
) -> None:
    with_default = settings.model_copy(update={"default_compiler": "x-1"})
    assert [r.compiler_version for r in plan_runtimes(session, with_default, None)] == ["x-1"]
    session.add(live_worker("a", "c-1"))
    session.flush()
    time.sleep(RUNTIMES_SNAPSHOT_S)  # the live workers read above (none) are kept this long
    assert [r.compiler_version for r in plan_runtimes(session, with_default, None)] == ["c-1"]


def test_each_stack_is_served_by_the_runtime_of_its_first_live_worker(session: Session, settings: Settings) -> None:
    # (name, compiler version, torch version): "b" and "d" share c-1 with "a" but differ in torch: other stacks;
    # "e" serves a's stack again.
    workers = [("d", "c-1", "t-3"), ("c", "c-2", "t-1"), ("b", "c-1", "t-2"), ("a", "c-1", "t-1"), ("e", "c-1", "t-1")]
    for name, version, torch in workers:
        session.add(live_worker(name, version, torch=torch))
    session.flush()
    served = served_runtimes(session, settings)
    assert [(r.compiler_version, r.torch_version) for r in served] == [
        ("c-1", "t-1"), ("c-1", "t-2"), ("c-2", "t-1"), ("c-1", "t-3"),
    ]  # fmt: skip


def test_a_fleet_scaled_to_zero_is_planned_for_the_stacks_it_served_last(session: Session, settings: Settings) -> None:
    """With no worker live, jobs go to the stacks whose queues were live last (what the fleet serves again when it
    scales up: only a worker knows its exact builds), not to the API's own reading of what is installed; a stack
    that stopped well before them is not planned, nor another backend's; the default compiler, when set, picks."""
    newest = utcnow()
    other_torch = RUNTIME.model_copy(update={"torch_version": "2.13.1+cpu"})
    older = RUNTIME.model_copy(update={"compiler_version": "inductor-2.12.0+cpu"})
    neuron = RUNTIME.model_copy(update={"backend": "neuron", "compiler_version": "2.28.7631.0"})
    for runtime, at in [(RUNTIME, newest), (other_torch, newest - dt.timedelta(seconds=5)),
                        (older, newest - dt.timedelta(hours=1)), (neuron, newest)]:  # fmt: skip
        mark_queue_live(session, job_queue(runtime.backend, runtime.stack(), 1), now=at, runtime=runtime)
    mark_queue_live(session, "supportmatrix.verdict.h", now=newest)  # a verdict queue serves no stack
    session.flush()
    cpu = settings.model_copy(update={"backend": "cpu"})
    assert [r.stack() for r in plan_runtimes(session, cpu, None)] == [RUNTIME.stack(), other_torch.stack()]
    chosen = cpu.model_copy(update={"default_compiler": older.compiler_version})
    assert plan_runtimes(session, chosen, None) == [older]
    [job] = submit(session, MODEL, None, plan_runtimes(session, cpu, None)[:1])
    assert job.job.queue == job_queue("cpu", RUNTIME.stack(), 1)  # the queue its workers consume when they are back


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_job_planned_for_a_fleet_scaled_to_zero_waits_no_worker_after_s_from_its_own_submission(
    kind: str, tmp_path: Path, settings: Settings
) -> None:
    """The queue a fleet scaled to zero served last was live hours ago: a job planned for it now stays queued (re-sent
    each grace) while KEDA starts a node, and ends ERROR(no_worker) only no_worker_after_s after its own submission,
    never one grace after it. A verdict stage counts from when it began the same way."""
    cpu = settings.model_copy(update={"backend": "cpu"})
    long_ago = utcnow() - dt.timedelta(hours=2)
    queue = job_queue("cpu", RUNTIME.stack(), 1)
    with fresh_database(kind, tmp_path) as engine, Session(engine, expire_on_commit=False) as session:
        mark_queue_live(session, queue, now=long_ago, runtime=RUNTIME)
        mark_queue_live(session, "supportmatrix.verdict.gone", now=long_ago)
        [waiting] = submit(session, MODEL, None, plan_runtimes(session, cpu, None))
        [judged] = submit(session, dataclasses.replace(MODEL, model_id="org/judged"), None, [RUNTIME])
        session.flush()
        submitted = waiting.job.created_at
        assert waiting.job.queue == queue
        session.execute(sa.update(Job).where(Job.id == judged.job.id).values(
            state=JobState.judging, judging_at=submitted, verdict_queue="supportmatrix.verdict.gone"))  # fmt: skip
        session.commit()

        def states() -> dict[int, JobState]:
            rows = session.execute(sa.select(Job.id, Job.state).execution_options(populate_existing=True))
            return dict(rows.tuples().all())

        after_grace = reconcile(session, cpu, now=submitted + dt.timedelta(seconds=cpu.queue_grace_s + 1))
        session.commit()
        assert after_grace.no_worker == []
        assert {r.job_id for r in after_grace.resend} == {waiting.job.id, judged.job.id}  # re-sent, not ended
        late = cpu.no_worker_after_s - cpu.queue_grace_s - 1  # its last re-send, a grace before the last pass
        almost = reconcile(session, cpu, now=submitted + dt.timedelta(seconds=late))
        session.commit()
        assert almost.no_worker == [] and len(almost.resend) == 2
        assert states() == {waiting.job.id: JobState.queued, judged.job.id: JobState.judging}
        assert session.scalar(sa.select(sa.func.count()).select_from(Result)) == 0

        past = reconcile(session, cpu, now=submitted + dt.timedelta(seconds=cpu.no_worker_after_s + 1))
        session.commit()
        assert sorted(past.no_worker) == sorted([waiting.job.id, judged.job.id])
        assert states() == {waiting.job.id: JobState.failed, judged.job.id: JobState.failed}
        ended = session.execute(sa.select(Result.job_id, Result.error_class)).tuples().all()
        assert sorted(ended) == sorted([(waiting.job.id, ErrorClass.no_worker), (judged.job.id, ErrorClass.no_worker)])


def test_a_declared_fleet_is_planned_beside_the_live_stacks_once_and_a_live_description_of_it_first(
    session: Session, settings: Settings
) -> None:
    """SUPPORTMATRIX_FLEET_RUNTIME: the declared stack is served with no worker of it live, after the live workers'
    other stacks (a rollout's old image); a live worker of the declared stack is one runtime, its own description
    kept (the compiler's build string it found), never two."""
    old = live_worker("cores-a", "c-1")
    session.add(old)
    session.flush()
    fleet = RuntimeInfo(
        backend="cpu", compiler_name="c", compiler_version="c-2", library_version="5", torch_version="2"
    )
    declared = settings.model_copy(update={"fleet_runtime": fleet})
    assert [r.compiler_version for r in served_runtimes(session, declared)] == ["c-1", "c-2"]
    time.sleep(RUNTIMES_SNAPSHOT_S)  # the live runtimes read above are kept this long
    session.add(live_worker("cores-b", "c-2"))
    session.flush()
    session.execute(sa.update(Worker).where(Worker.name == "cores-b").values(compiler_build="c-2+abc"))
    served = served_runtimes(session, declared)
    assert [(r.compiler_version, r.compiler_build) for r in served] == [("c-1", ""), ("c-2", "c-2+abc")]

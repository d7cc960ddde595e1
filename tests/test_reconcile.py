"""The reconciler's rules on constructed states: what it re-sends, what it ends, what it leaves alone."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, JobState, Stage, SweepState
from shared.contracts.run import RuntimeInfo, Stack
from shared.db.models import Job, Result, Sweep, utcnow
from shared.hub.client import ResolvedModel
from shared.jobs.queues import Deliveries, job_queue
from shared.jobs.reconcile import Resend, claim_sweep, mark_queue_live, reconcile
from shared.jobs.submission import submit
from shared.settings import Settings

RUNTIME = RuntimeInfo(backend="cpu", compiler_name="c", compiler_version="c-1", library_version="5", torch_version="2")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path, lease_timeout_s=30, queue_grace_s=60, no_worker_after_s=600)


def job(session: Session, name: str, age_s: float, **state: object) -> Job:
    model = ResolvedModel(model_id=f"org/{name}", sha="a" * 40, gated=False, pipeline_tag=None)
    [submitted] = submit(session, model, None, [RUNTIME])
    created = utcnow() - dt.timedelta(seconds=age_s)
    session.execute(sa.update(Job).where(Job.id == submitted.job.id).values(created_at=created, **state))
    session.flush()
    return submitted.job


def ago(seconds: float) -> dt.datetime:
    return utcnow() - dt.timedelta(seconds=seconds)


def test_lost_messages_are_sent_again_and_live_work_is_left_alone(session: Session, settings: Settings) -> None:
    queue = job_queue("cpu", RUNTIME.stack(), 1)
    mark_queue_live(session, queue)
    mark_queue_live(session, "supportmatrix.verdict.h")
    waiting = job(session, "waiting", age_s=120)  # queued past the grace: its message may be lost
    fresh = job(session, "fresh", age_s=5)
    lapsed = job(session, "lapsed", 300, state=JobState.running, lease_owner="w@h:1", heartbeat_at=ago(40))
    live = job(session, "live", 300, state=JobState.running, lease_owner="w@h:2", heartbeat_at=ago(1))
    judging = job(session, "judging", 300, state=JobState.judging, verdict_queue="supportmatrix.verdict.h",
                  judging_at=ago(90), enqueued_at=ago(90))  # fmt: skip
    judged_live = job(session, "judged-live", 300, state=JobState.judging, verdict_queue="supportmatrix.verdict.h",
                      lease_owner="v@h:3", heartbeat_at=ago(1), enqueued_at=ago(90))  # fmt: skip
    found = reconcile(session, settings)
    assert found.resend == [
        Resend(waiting.id, queue, Stage.accelerator),
        Resend(lapsed.id, queue, Stage.accelerator),
        Resend(judging.id, "supportmatrix.verdict.h", Stage.verdict),
    ]
    assert found.no_worker == [] and {fresh.id, live.id, judged_live.id}.isdisjoint(r.job_id for r in found.resend)
    session.commit()
    # re-sent just now: not again until the grace passes once more
    assert reconcile(session, settings).resend == [Resend(lapsed.id, queue, Stage.accelerator)]


def test_a_job_whose_message_the_broker_still_holds_is_not_sent_again(session: Session, settings: Settings) -> None:
    queue, verdicts = job_queue("cpu", RUNTIME.stack(), 1), "supportmatrix.verdict.h"
    mark_queue_live(session, queue)
    mark_queue_live(session, verdicts)
    behind = job(session, "behind", age_s=120)  # waits behind a busy worker: its message is in the queue
    taken = job(session, "taken", age_s=120)  # a live worker just took it, and claims it now
    held_long = job(session, "held-long", age_s=120)  # taken long ago, never acknowledged: that worker died
    lost = job(session, "lost", age_s=120)  # its message is gone
    lapsed_copy = job(session, "lapsed-copy", 300, state=JobState.running, lease_owner="w@h:1", heartbeat_at=ago(40))
    lapsed_dead = job(session, "lapsed-dead", 300, state=JobState.running, lease_owner="w@h:2", heartbeat_at=ago(40))
    judging = job(session, "judging", 300, state=JobState.judging, verdict_queue=verdicts, enqueued_at=ago(90))
    held = Deliveries(
        waiting=frozenset({f"job-{behind.id}", f"job-{lapsed_copy.id}", f"verdict-{judging.id}"}),
        taken_s_ago={f"job-{taken.id}": 2.0, f"job-{held_long.id}": 31.0, f"job-{lapsed_dead.id}": 300.0},
    )
    asked: list[set[str]] = []
    found = reconcile(session, settings, lambda queues: asked.append(set(queues)) or held)
    assert asked == [{queue, verdicts}]  # one read of the broker, for the queues of the jobs it found
    assert [r.job_id for r in found.resend] == [held_long.id, lost.id, lapsed_dead.id]
    resends = dict(session.execute(sa.select(Job.id, Job.resends)).tuples().all())
    assert [resends[j.id] for j in (behind, taken, held_long, lost, lapsed_copy, lapsed_dead, judging)] == [
        0, 0, 1, 1, 0, 1, 0,
    ]  # fmt: skip


def test_jobs_of_a_queue_nobody_serves_end_no_worker_once(session: Session, settings: Settings) -> None:
    orphan = job(session, "orphan", age_s=700)  # its queue never had a live worker
    gone, ok = (job_queue("cpu", Stack(compiler_version=c, library_version="5"), 1) for c in ("gone", "ok"))
    served_once = job(session, "served-once", age_s=700)
    session.execute(sa.update(Job).where(Job.id == served_once.id).values(queue=gone))
    mark_queue_live(session, gone, now=ago(650))
    recently_served = job(session, "recent", age_s=700)
    session.execute(sa.update(Job).where(Job.id == recently_served.id).values(queue=ok))
    mark_queue_live(session, ok, now=ago(100))
    found = reconcile(session, settings)
    session.commit()
    assert sorted(found.no_worker) == sorted([orphan.id, served_once.id])
    assert [r.job_id for r in found.resend] == [recently_served.id]
    for ended in (orphan, served_once):
        row = session.get(Job, ended.id, populate_existing=True)
        assert row.state == JobState.failed and row.error_class == ErrorClass.no_worker
        assert row.queue in (row.error_message or "")
        assert session.scalar(sa.select(sa.func.count()).select_from(Result).where(Result.job_id == ended.id)) == 1
    assert reconcile(session, settings).no_worker == []  # ended once


def test_a_sweep_whose_message_was_lost_is_sent_again_and_claimed_once(session: Session, settings: Settings) -> None:
    lost = Sweep(trigger="api", state=SweepState.queued, config={}, created_at=ago(120))
    stuck = Sweep(trigger="api", state=SweepState.running, config={}, created_at=ago(2000), claimed_at=ago(1000))
    running = Sweep(trigger="api", state=SweepState.running, config={}, created_at=ago(100), claimed_at=ago(10))
    session.add_all([lost, stuck, running])
    session.flush()
    assert sorted(reconcile(session, settings).sweeps) == sorted([lost.id, stuck.id])
    assert claim_sweep(session, lost.id, settings) and not claim_sweep(session, lost.id, settings)
    assert claim_sweep(session, stuck.id, settings) and not claim_sweep(session, running.id, settings)

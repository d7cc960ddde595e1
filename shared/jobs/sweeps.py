"""Sweeps: test what people use — per task, the Hub's trending and most-downloaded models and a pinned
selection — for every compiler version served, never twice.

A sweep is idempotent: its jobs go through the same submission as the API, so a model whose identical
job (commit, compiler, library, task, test config, cores) is queued, running or done gets no new job,
and a new revision, compiler version or library version does. A scheduled sweep belongs to a slot of
the schedule, unique in SQL, so a schedule that fires twice sweeps once.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.contracts.enums import JobState, SweepState, SweepView, Task, Verdict
from shared.db.models import Job, Result, Sweep, SweepEntry, utcnow
from shared.hub.client import HUB_RANKINGS, HubError, ModelNotFound, RevisionNotFound, list_top, resolve_model
from shared.jobs.runtimes import NoRuntime, served_runtimes
from shared.jobs.submission import Request, Submitted, submit_model
from shared.results.cells import CellStatus, cells
from shared.settings import Settings
from tasks import SWEPT_TASKS, declaration


def swept_tasks(settings: Settings) -> list[str]:
    """The tasks a sweep lists models of: the configured ones, or every task whose declaration sweeps."""
    return list(SWEPT_TASKS) if settings.sweep_tasks is None else settings.sweep_tasks


@dataclass(frozen=True)
class Candidate:
    model_id: str
    task: str  # "": a selected model without a task, tested as its pipeline tag says (or refused)
    view: str  # a SweepView, or "rerun": a FLAKY cell run again (rerun_flipped_cells)
    rank: int


def open_sweep(
    session: Session, settings: Settings, trigger: str, slot: str | None = None, submitted_by: str | None = None
) -> Sweep | None:
    """A new sweep row, or None when this schedule slot was swept already."""
    sweep = Sweep(trigger=trigger, slot=slot, state=SweepState.queued, config={}, submitted_by=submitted_by)
    try:
        with session.begin_nested():
            session.add(sweep)
            session.flush()
    except IntegrityError:
        return None
    return sweep


def candidates(settings: Settings) -> list[Candidate]:
    """Per configured task: the pinned selection, then trending and downloads tops, each in rank order. A
    listing holds only the pipeline tags we test (one ranking over a task's declared tags): a model tagged
    image-text-to-text, say, is never a candidate; a selected one without a task is tested as its tag says, as
    POST /jobs would."""
    found = []
    for rank, entry in enumerate(settings.sweep_selected, start=1):
        model_id, _, task = entry.partition(":")
        found.append(Candidate(model_id, task, SweepView.selected, rank))
    for task in swept_tasks(settings):
        for view in HUB_RANKINGS:
            listed = list_top(list(declaration(task).pipeline_tags), view, settings.sweep_limit)
            found += [Candidate(m.model_id, task, view, m.rank) for m in listed]
    return found


def run_sweep(session: Session, settings: Settings, sweep: Sweep) -> list[Submitted]:
    """Submit every candidate; returns what to enqueue after the caller commits. HubUnavailable propagates."""
    sweep.state = SweepState.running
    sweep.config = {"tasks": swept_tasks(settings), "limit": settings.sweep_limit, "selected": settings.sweep_selected}
    to_enqueue: list[Submitted] = []
    # A model in several views is submitted once; each view still gets its entry.
    submitted_before: dict[tuple[str, str], tuple[list[Submitted], str | None]] = {}
    for c in candidates(settings):
        key = (c.model_id, c.task)
        if key not in submitted_before:
            try:
                task = Task(c.task) if c.task else None
                submitted = submit_model(
                    session, settings, Request(c.model_id, task=task, fresh=True, submitted_by=sweep.submitted_by)
                )
                submitted_before[key] = (submitted, None)
            except (ModelNotFound, RevisionNotFound, ValueError, NoRuntime) as exc:  # ValueError: task, compiler
                submitted_before[key] = ([], str(exc))
            to_enqueue += [s for s in submitted_before[key][0] if s.enqueue]
        add_entries(session, sweep, c, *submitted_before[key])
    to_enqueue += rerun_flipped_cells(session, settings, sweep)
    sweep.state = SweepState.done
    sweep.finished_at = utcnow()
    return longest_first(to_enqueue)


def expected_work(parameters: int, cores: int) -> float:
    """What a job's accelerator stage grows with: the parameters each core loads and compiles a graph for."""
    return parameters / max(cores, 1)


def longest_first(submitted: list[Submitted]) -> list[Submitted]:
    """A sweep's jobs in the order to enqueue them: the longest expected first (longest processing time
    first). Each group size's queue is FIFO, so a long job enqueued late would start late and end the sweep
    alone (bench/makespan.py measures it). The parameter counts come from the Hub answers submission just
    cached; a model without them goes last."""

    def work(s: Submitted) -> float:
        try:
            model = resolve_model(s.job.model_id, s.job.revision)
        except HubError:
            return 0.0
        return expected_work(sum(model.parameters.values()), s.job.cores)

    return sorted(submitted, key=work, reverse=True)  # stable: equal work keeps the rank order


def add_entries(
    session: Session, sweep: Sweep, candidate: Candidate, submitted: list[Submitted], note: str | None
) -> None:
    """One entry per job the candidate got, or one entry with the note saying why it got none."""
    entries: Sequence[Submitted | None] = submitted or [None]
    for s in entries:
        session.add(
            SweepEntry(
                sweep_id=sweep.id,
                model_id=candidate.model_id,
                task=candidate.task or (s.job.task if s else ""),
                view=candidate.view,
                rank=candidate.rank,
                job_id=s.job.id if s else None,
                created=bool(s and s.created),
                note=note,
            )
        )


def rerun_flipped_cells(session: Session, settings: Settings, sweep: Sweep) -> list[Submitted]:
    """One more run of each FLAKY cell of a served stack whose runs flipped sweep_rerun_flips times."""
    if not settings.sweep_rerun_flips:
        return []
    try:
        served = {r.stack() for r in served_runtimes(session, settings)}
    except NoRuntime:  # no stack can be planned now: nothing to rerun (the candidates' entries say why)
        return []
    queued = []
    for cell in cells(session):
        if cell.status != CellStatus.FLAKY or cell.flips < settings.sweep_rerun_flips:
            continue
        if cell.stack not in served:
            continue
        request = Request(
            cell.model_id, task=Task(cell.task), stacks=[cell.stack], force=True, fresh=True,
            submitted_by=sweep.submitted_by,
        )  # fmt: skip
        candidate = Candidate(cell.model_id, cell.task, "rerun", 0)
        try:
            submitted = submit_model(session, settings, request)
        except (ModelNotFound, RevisionNotFound) as exc:
            add_entries(session, sweep, candidate, [], str(exc))
            continue
        add_entries(session, sweep, candidate, submitted, f"{cell.flips} flips")
        queued += [s for s in submitted if s.enqueue]
    return queued


class SweepEntryOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    model_id: str
    task: str = Field(description="The task tested; empty for a selected model whose task could not be chosen.")
    view: str
    rank: int
    job_id: int | None
    created: bool = Field(description="A new job, rather than an existing one.")
    note: str | None = Field(description="Why there is no job, or why a cell was rerun.")


class SweepOut(BaseModel):
    """A sweep's progress: its entries, and its distinct jobs by state and by verdict."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    trigger: str
    slot: str | None
    submitted_by: str | None = Field(description="the API token that started it; null for the schedule's")
    state: SweepState
    error: str | None
    config: dict[str, Any]
    created_at: dt.datetime
    finished_at: dt.datetime | None
    jobs: dict[JobState, int] = Field(default_factory=dict)
    verdicts: dict[Verdict, int] = Field(default_factory=dict)
    entries: list[SweepEntryOut]


def progress(session: Session, sweep: Sweep) -> SweepOut:
    """The sweep with its entries, and its distinct jobs counted by state and by verdict."""
    job_ids = sa.select(SweepEntry.job_id).where(SweepEntry.sweep_id == sweep.id, SweepEntry.job_id.is_not(None))
    states = session.execute(
        sa.select(Job.state, sa.func.count()).where(Job.id.in_(job_ids.distinct())).group_by(Job.state)
    ).all()
    verdicts = session.execute(
        sa.select(Result.verdict, sa.func.count()).where(Result.job_id.in_(job_ids.distinct())).group_by(Result.verdict)
    ).all()
    counts = {"jobs": dict(states), "verdicts": dict(verdicts)}
    return SweepOut.model_validate(sweep).model_copy(update=counts)

"""The whole software stack is the cell: two worker images on one neuronx-cc that differ only in TorchNeuron (or
only in torch) plan to two queues, make two cells (never one FLAKY cell), two Parquet files and two columns of
/changes, and a live worker of one never runs the other's job. Real SQL (SQLite and PostgreSQL), real Redis and a
real worker where the test is about routing."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, JobState, Stage, Verdict
from shared.contracts.run import IDENTITY_VERSIONS, RuntimeInfo, Stack
from shared.db.engine import new_session, session_scope
from shared.db.models import Job, Result, Worker, utcnow
from shared.hub.client import ResolvedModel
from shared.jobs.broker import enqueue_job, get_producer
from shared.jobs.lease import acquire_lease, refuse_other_stack
from shared.jobs.outcomes import finish
from shared.jobs.queues import JOB_QUEUE_PREFIX, job_queue
from shared.jobs.submission import submit
from shared.results.cells import CellStatus, cells, diff
from shared.results.export import export_keys, export_results, file_name
from shared.results.records import query_results
from shared.settings import Settings, get_settings
from testing.services import wait_until
from tests.conftest import fresh_database
from tests.history import report_of

COMPILER = "2.28.7631.0"
NEURON = RuntimeInfo(
    backend="neuron",
    compiler_name="neuronx-cc",
    compiler_version=COMPILER,
    library_version="5.24.0",
    torch_version="2.13.0",
    torch_neuronx_version="2.13.3.0.1",
    neuron_runtime_version="2.30.51.0",
)
# The two ways two worker images on one neuronx-cc differ that the issue names: TorchNeuron alone, torch alone.
OTHER = {"torch_neuronx_version": "2.13.3.0.2", "torch_version": "2.13.1"}


def pair(field: str) -> tuple[RuntimeInfo, RuntimeInfo]:
    """Two runtimes that differ only in ``field``."""
    return NEURON, NEURON.model_copy(update={field: OTHER[field]})


def finished(session: Session, model: str, rt: RuntimeInfo, verdict: Verdict, **report: Any) -> Job:
    """One finished run of ``model`` under ``rt``, written as a worker writes it."""
    resolved = ResolvedModel(model_id=model, sha="d" * 40, gated=False, pipeline_tag=None)
    [sub] = submit(session, resolved, None, [rt], force=True)
    session.flush()
    acquire_lease(session, sub.job.id, "w", Settings(), Stage.accelerator)
    finish(
        session,
        sub.job.id,
        "w",
        report_of(model_id=model, task="text-generation", backend="neuron", verdict=verdict, **report),
    )
    session.commit()
    return sub.job


def test_a_stacks_digest_is_stable_and_names_every_version() -> None:
    """Queue and file names carry the digest, and migration 0016 renamed queues by it: it must never drift."""
    assert NEURON.stack().digest == "be64c1e49879" and NEURON.stack().name == "stack-be64c1e49879"
    assert "torch_version" in IDENTITY_VERSIONS and "torch_neuronx_version" in IDENTITY_VERSIONS
    digests = {NEURON.stack().digest}
    for field in IDENTITY_VERSIONS:  # every version of the stack changes its digest
        digests.add(NEURON.model_copy(update={field: "other"}).stack().digest)
    assert len(digests) == 1 + len(IDENTITY_VERSIONS)
    assert NEURON.stack().label() == (
        "compiler 2.28.7631.0 · torch 2.13.0 · torch-neuronx 2.13.3.0.1 · neuron-runtime 2.30.51.0"
        " · transformers 5.24.0"
    )
    cpu = RuntimeInfo(backend="cpu", compiler_name="aot_eager", compiler_version="aot_eager-2.13.0+cpu",
                      library_version="5.24.0", torch_version=None)  # fmt: skip
    assert cpu.stack().torch_neuronx_version == cpu.stack().torch_version == ""  # cpu: no Neuron fields, no torch yet


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
@pytest.mark.parametrize("field", sorted(OTHER))
def test_two_stacks_on_one_compiler_are_two_queues_cells_files_and_diff_columns(
    kind: str, field: str, tmp_path: Path
) -> None:
    x, y = pair(field)
    model = "org/stacked"
    with fresh_database(kind, tmp_path) as engine, Session(engine, expire_on_commit=False) as session:
        resolved = ResolvedModel(model_id=model, sha="d" * 40, gated=False, pipeline_tag=None)
        planned = submit(session, resolved, None, [x, y])
        session.commit()
        # two tests, both active at once (the database's one-active-job-per-identity index lets them be)
        assert [s.created for s in planned] == [True, True]
        queues = [s.job.queue for s in planned]
        assert queues == [job_queue("neuron", x.stack(), 1), job_queue("neuron", y.stack(), 1)]
        assert queues[0] != queues[1]
        for queue, rt in zip(queues, (x, y), strict=True):
            assert queue == f"{JOB_QUEUE_PREFIX}.neuron.{COMPILER}.stack-{rt.stack().digest}.c1"  # readable
        # each row stores its stack's digest as it is inserted: what the stack axis of a diff reads by its index
        assert [s.job.stack_digest for s in planned] == [x.stack().digest, y.stack().digest]

        for sub, verdict in zip(planned, (Verdict.PASS, Verdict.FAIL), strict=True):
            acquire_lease(session, sub.job.id, "w", Settings(), Stage.accelerator)
            report = report_of(model_id=model, task="text-generation", backend="neuron", verdict=verdict)
            finish(session, sub.job.id, "w", report)
        session.commit()

        found = cells(session, compiler=COMPILER)
        # two cells, neither FLAKY
        assert {c.stack: (c.status, c.runs) for c in found} == {
            x.stack(): (CellStatus.PASS, 1),
            y.stack(): (CellStatus.FAIL, 1),
        }
        assert len(found) == 2
        assert {c.status for c in cells(session)} == {CellStatus.PASS, CellStatus.FAIL}

        changes = diff(session, "stack", x.stack().digest, y.stack().digest)
        assert [(c.model_id, c.from_status, c.to_status) for c in changes.regressed] == [
            (model, CellStatus.PASS, CellStatus.FAIL)
        ]
        assert changes.flaky == [] and changes.cells_compared == 1

        assert len(export_keys(session)) == 2
        summary = export_results(session, tmp_path / "export")
    names = sorted(p.name for p in summary.written)
    assert names == sorted(file_name("transformers", rt.stack()) for rt in (x, y)) and len(set(names)) == 2
    for rt, verdict in ((x, "PASS"), (y, "FAIL")):
        rows = pd.read_parquet(summary.data_dir / file_name("transformers", rt.stack()))
        assert rows.result.tolist() == [verdict]  # the cell's status: not FLAKY
        assert rows[field].tolist() == [getattr(rt, field)]  # each file's row states its own stack
        assert rows.neuronx_cc.tolist() == [COMPILER]


def test_the_row_states_the_stack_the_job_was_planned_for(session: Session) -> None:
    """A report that names other versions (a runner's own reading) never mixes into the row: the row's stack is the
    job's, every field of it, beside the planned compiler."""
    reported = NEURON.model_copy(
        update={"torch_neuronx_version": "9.9", "torch_version": "9.8", "compiler_build": "b+1"}
    )
    job = finished(session, "org/row", NEURON, Verdict.PASS, runtime=reported)
    [row] = query_results(session, model_id="org/row").records
    assert row.job_id == job.id
    assert (row.neuronx_cc, row.torch_version, row.torch_neuronx_version, row.neuron_runtime_version) == (
        COMPILER, "2.13.0", "2.13.3.0.1", "2.30.51.0"
    )  # fmt: skip
    assert row.compiler_build == "b+1"  # provenance: the build string is what the runner found
    # the result row keeps the runner's reading; the record states the planned stack
    stored = session.scalar(sa.select(Result.torch_neuronx_version).where(Result.job_id == job.id))
    assert stored == "9.9"


@pytest.mark.parametrize("field", sorted(OTHER))
def test_a_worker_refuses_a_job_of_another_stack_on_its_compiler(session: Session, field: str) -> None:
    """The rule the worker applies before any lease: a job of another stack is sent to its own queue, or (when its
    own queue is this one) ends ERROR(no_worker); one of its own stack is claimed as usual."""
    x, y = pair(field)
    served_queue = job_queue("neuron", y.stack(), 1)
    resolved = ResolvedModel(model_id="org/refused", sha="e" * 40, gated=False, pipeline_tag=None)
    [sub] = submit(session, resolved, None, [x])
    session.commit()
    refusal = refuse_other_stack(session, sub.job.id, y.stack(), served_queue, Settings())
    assert refusal is not None and refusal.resend_to == sub.job.queue != served_queue
    assert x.stack().label() in refusal.said and y.stack().label() in refusal.said
    own = refuse_other_stack(session, sub.job.id, x.stack(), sub.job.queue, Settings())
    assert own is None  # its own stack: claim it
    job = session.get(Job, sub.job.id, populate_existing=True)
    assert job.state == JobState.queued and job.attempts == 0 and job.lease_owner is None


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_lapsed_lease_on_the_workers_own_queue_for_another_stack_ends_the_job_once(kind: str, tmp_path: Path) -> None:
    """A job running under a lapsed lease, whose own queue is this worker's but whose stack is not: no worker of
    that queue will ever take it, and every re-send would meet the same refusal with its attempts never growing. It
    ends ERROR(no_worker), one row; while its lease is live it is left to its holder."""
    x, y = pair("torch_neuronx_version")
    settings = Settings(lease_timeout_s=30)
    resolved = ResolvedModel(model_id="org/lapsed", sha="e" * 40, gated=False, pipeline_tag=None)
    with fresh_database(kind, tmp_path) as engine, Session(engine, expire_on_commit=False) as session:
        [sub] = submit(session, resolved, None, [x])
        session.flush()
        queue = job_queue("neuron", y.stack(), 1)
        sub.job.queue = queue  # a row naming the worker's queue for a stack the worker does not run
        session.commit()
        assert acquire_lease(session, sub.job.id, "gone@h", settings, Stage.accelerator)[0].value == "taken"
        session.commit()
        live = refuse_other_stack(session, sub.job.id, y.stack(), queue, settings)
        assert live is not None and live.resend_to is None and "left to its lease holder gone@h" in live.said
        lapsed_at = utcnow() - dt.timedelta(seconds=settings.lease_timeout_s + 1)
        session.execute(sa.update(Job).where(Job.id == sub.job.id).values(heartbeat_at=lapsed_at))
        session.commit()
        ended = refuse_other_stack(session, sub.job.id, y.stack(), queue, settings)
        session.commit()
        assert ended is not None and ended.resend_to is None and "ended ERROR(no_worker)" in ended.said
        assert refuse_other_stack(session, sub.job.id, y.stack(), queue, settings) is None  # finished: nothing left
        job = session.get(Job, sub.job.id, populate_existing=True)
        assert job is not None and job.state == JobState.failed and job.error_class == ErrorClass.no_worker
        assert x.stack().label() in (job.error_message or "") and job.attempts == 1
        counted = session.scalar(sa.select(sa.func.count()).select_from(Result).where(Result.job_id == sub.job.id))
        assert counted == 1


def test_a_live_worker_never_runs_a_job_planned_for_another_stack_on_its_compiler(start_worker: Any) -> None:
    """A real worker, on real Redis: the messages of jobs planned for its compiler version but another torch, or
    another TorchNeuron, delivered onto its own queue, are not run. Each is sent on to its own queue, untouched (no
    lease, no attempt, no result); a job whose own queue is the worker's ends ERROR(no_worker), one row."""
    proc = start_worker(f"w-stack-{uuid.uuid4().hex[:6]}")
    with session_scope() as session:
        worker = session.scalar(sa.select(Worker).where(Worker.name.startswith(f"{proc.name}@")))
        assert worker is not None
        served, queue = worker.runtime(), worker.queue
    org = f"stacks{uuid.uuid4().hex[:8]}"
    others = {
        "torch": served.model_copy(update={"torch_version": f"{served.torch_version}.other"}),
        "torch-neuronx": served.model_copy(update={"torch_neuronx_version": "2.13.3.0.1"}),
    }
    with session_scope() as session:
        jobs: dict[str, Job] = {}
        for name, rt in [*others.items(), ("stranded", others["torch"])]:
            resolved = ResolvedModel(model_id=f"{org}/{name}", sha="f" * 40, gated=False, pipeline_tag=None)
            [sub] = submit(session, resolved, None, [rt])
            jobs[name] = sub.job
        jobs["stranded"].queue = queue  # a row naming the worker's queue for a stack the worker does not run
        ids = {name: job.id for name, job in jobs.items()}
        own = {name: job.queue for name, job in jobs.items()}
    assert all(own[name] == job_queue(rt.backend, rt.stack(), 1) != queue for name, rt in others.items())
    client = redis.Redis.from_url(get_settings().redis_url)
    for job_id in ids.values():
        enqueue_job(get_producer(), job_id, queue)  # delivered where the worker takes it

    def states() -> dict[str, tuple[JobState, int, str | None]]:
        with session_scope() as session:
            rows = session.execute(sa.select(Job.id, Job.state, Job.attempts, Job.lease_owner).where(
                Job.id.in_(ids.values())))  # fmt: skip
            by_id = {job_id: (state, attempts, owner) for job_id, state, attempts, owner in rows}
        return {name: by_id[job_id] for name, job_id in ids.items()}

    wait_until(lambda: all(client.llen(own[name]) == 1 for name in others), 60, "messages sent on to their own queues")
    wait_until(lambda: states()["stranded"][0] == JobState.failed, 60, "the stranded job ended")
    now = states()
    for name in others:
        assert now[name] == (JobState.queued, 0, None), name  # never leased, never run
    with session_scope() as session:
        counted = dict(session.execute(sa.select(Result.job_id, sa.func.count()).where(
            Result.job_id.in_(ids.values())).group_by(Result.job_id)).tuples().all())  # fmt: skip
        stranded = session.get(Job, ids["stranded"])
        assert stranded is not None and stranded.error_class == ErrorClass.no_worker and stranded.attempts == 0
        assert others["torch"].stack().label() in (stranded.error_message or "")
        assert served.stack().label() in (stranded.error_message or "")
        # the two refused jobs are withdrawn here, so that no other test's worker of their stack meets them
        session.execute(sa.update(Job).where(Job.id.in_([ids[n] for n in others])).values(state=JobState.cancelled))
    assert counted == {ids["stranded"]: 1}
    for name in others:
        client.delete(own[name])


def test_the_changes_page_compares_two_stacks_on_one_compiler_in_two_columns(api: Any) -> None:
    """/changes?axis=stack: the two stacks (by digest in the URL, by their versions on the page) are the table's two
    columns, and the model that passed on one and failed on the other is listed as regressed; GET /results/diff
    says the same as JSON."""
    compiler = f"stackpage-{uuid.uuid4().hex[:6]}"
    x = NEURON.model_copy(update={"compiler_version": compiler})
    y = x.model_copy(update={"torch_neuronx_version": OTHER["torch_neuronx_version"]})
    model = f"stackpage/{uuid.uuid4().hex[:8]}"
    with new_session() as session:  # each run committed as a worker commits it
        finished(session, model, x, Verdict.PASS)
        finished(session, model, y, Verdict.FAIL)
    query = {"axis": "stack", "from": x.stack().digest, "to": y.stack().digest}
    page = api.get("/changes", params=query)
    assert page.status_code == 200
    html = page.text
    header = f'<th scope="col">{x.stack().label()}</th><th scope="col">{y.stack().label()}</th>'
    assert header in html  # the two columns
    regressed = html[html.index('id="regressed"') :].split("</table>")[0]
    assert model in regressed
    assert f'<option value="{x.stack().digest}" selected>{x.stack().label()}</option>' in html
    answer = api.get("/results/diff", params=query).json()
    assert [(c["model_id"], c["from"], c["to"]) for c in answer["regressed"]] == [(model, "PASS", "FAIL")]
    assert answer["flaky"] == []


def test_the_stacks_with_results_are_listed_with_the_digest_the_stack_axis_takes(api: Any) -> None:
    """GET /results/stacks lists each stack with results by digest, label and versions; a digest read there is what
    /results/diff?axis=stack takes."""
    compiler = f"stacklist-{uuid.uuid4().hex[:6]}"
    x = NEURON.model_copy(update={"compiler_version": compiler})
    y = x.model_copy(update={"torch_version": OTHER["torch_version"]})
    model = f"stacklist/{uuid.uuid4().hex[:8]}"
    with new_session() as session:
        finished(session, model, x, Verdict.FAIL)
        finished(session, model, y, Verdict.PASS)
    answer = api.get("/results/stacks")
    assert answer.status_code == 200
    listed = [s for s in answer.json() if s["versions"]["compiler_version"] == compiler]
    assert sorted(s["digest"] for s in listed) == sorted([x.stack().digest, y.stack().digest])
    for item in listed:
        stack = Stack.model_validate(item["versions"])
        assert item["digest"] == stack.digest and item["label"] == stack.label()
    older, newer = x.stack().digest, y.stack().digest
    changes = api.get("/results/diff", params={"axis": "stack", "from": older, "to": newer}).json()
    assert [(c["model_id"], c["from"], c["to"]) for c in changes["fixed"]] == [(model, "FAIL", "PASS")]
    assert (changes["fixed"][0]["from_stack"]["digest"], changes["fixed"][0]["to_stack"]["digest"]) == (older, newer)

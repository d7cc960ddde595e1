"""Metrics: the SQL-derived families' exact values over seeded rows (SQLite and PostgreSQL), the API's HTTP
metrics, the Prometheus config and alert rules under promtool, the dashboard as its generator's output — and a
real Prometheus that scrapes a running stack (``tests/test_deploy.py``'s compose smoke test calls
``running_prometheus`` and ``assert_every_expression_returns_data``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from shared.processes import free_port
from tests.conftest import ROOT, fresh_database

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "supportmatrix.json"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is not installed: apt-get install -y --no-install-recommends prometheus (scripts/setup.sh)"
        )
    return found


# --- the SQL families over seeded rows -----------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def seeded(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A fresh migrated database of either kind with jobs, results, workers and a sweep at known times."""
    from sqlalchemy.orm import Session

    with fresh_database(request.param, tmp_path) as engine:
        with Session(engine) as session:
            seed(session)
            session.commit()
        yield lambda: Session(engine)


def ago(seconds: float) -> dt.datetime:
    return T0 - dt.timedelta(seconds=seconds)


def seed(session: Any) -> None:
    from shared.contracts.enums import ErrorClass, JobState, SweepState, Verdict
    from shared.db.models import Job, QueueSeen, Result, Sweep, SweepEntry, Worker

    runtime = {"backend": "cpu", "compiler_name": "inductor", "library_version": "5.0", "torch_version": "2.13"}
    q1, q2, vq = "supportmatrix.jobs.cpu.v1.c1", "supportmatrix.jobs.cpu.v1.c2", "supportmatrix.verdict.h1"

    def job(n: int, state: JobState, version: str = "v1", **kw: Any) -> Job:
        row = Job(model_id=f"org/m{n}", sha="a" * 40, task="text-generation", compiler_version=version, queue=q1,
                  state=state, **runtime, **kw)  # fmt: skip
        session.add(row)
        session.flush()
        return row

    job(1, JobState.queued, created_at=ago(100), enqueued_at=ago(10), resends=2)  # re-sent twice by the reconciler
    job(2, JobState.queued, created_at=ago(40))
    waiting = dict(created_at=ago(300), started_at=ago(200), judging_at=ago(30), verdict_queue=vq)
    job(3, JobState.judging, **waiting, enqueued_at=ago(30))  # its verdict stage waits: 170 s accelerator
    job(4, JobState.judging, **waiting, lease_owner="verdict@h1:9", verdict_attempts=1)  # being judged
    job(5, JobState.running, started_at=ago(50), lease_owner="cores-0@h1:123", attempts=1)
    a = job(6, JobState.done, started_at=ago(1000), judging_at=ago(930), finished_at=ago(885), attempts=1)
    b = job(7, JobState.done, started_at=ago(800), judging_at=ago(550), finished_at=ago(542), attempts=2,
            verdict_attempts=3)  # fmt: skip
    c = job(8, JobState.failed, "v2", started_at=ago(400), finished_at=ago(388), attempts=1)
    job(9, JobState.failed, "v2", finished_at=ago(5))  # settled at submission: never ran, no duration
    results = [
        (a, Verdict.PASS, None, 12.0, 50.0, "miss", ago(885)),
        (b, Verdict.FAIL, None, 3.0, 200.0, "hit", ago(542)),
        (c, Verdict.ERROR, ErrorClass.compile, None, None, None, ago(388)),
    ]
    for row, verdict, error_class, compile_s, wall_s, cache, at in results:
        timings = {"compile_s": compile_s, "wall_s": wall_s, "compile_cache": cache, "created_at": at}
        session.add(Result(job_id=row.id, verdict=verdict, error_class=error_class, cores=1,
                           compiler_version=row.compiler_version, **timings))  # fmt: skip
    worker = {**runtime, "pid": 1, "queue": q1, "compiler_version": "v1", "started_at": ago(3600)}
    session.add_all(
        [
            Worker(name="cores-0@m", host="h1", cores="0", core_count=1, heartbeat_at=ago(2), **worker),
            Worker(name="cores-1@m", host="h1", cores="1", core_count=1, heartbeat_at=ago(2), **worker),
            Worker(name="cores-2-3@m", host="h1", cores="2-3", core_count=2, heartbeat_at=ago(3), **worker),
            Worker(
                name="cores-0@n",
                host="h2",
                cores="0",
                core_count=1,
                heartbeat_at=ago(1000),
                **(worker | {"compiler_version": "v3"}),
            ),
            QueueSeen(queue=q2, last_live_at=ago(5)),
            QueueSeen(queue=vq, last_live_at=ago(5)),
        ]
    )
    sweep = Sweep(trigger="api", state=SweepState.running, created_at=ago(600))
    session.add(sweep)
    session.flush()
    for rank, job_id in enumerate([a.id, 1, None]):
        session.add(SweepEntry(sweep_id=sweep.id, model_id=f"org/s{rank}", task="text-generation", view="trending",
                               rank=rank, job_id=job_id))  # fmt: skip


def state_collector(sessions: Any) -> Any:
    """The SQL families over ``sessions``, read at T0 with fixed settings."""
    from services.api.metrics import StateCollector
    from shared.settings import Settings

    return StateCollector(Settings(worker_stale_s=60, job_timeout_s=3600), sessions, lambda: T0)


def scrape(sessions: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one collection of the SQL families."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(state_collector(sessions))
    return parsed(generate_latest(registry))


def parsed(exposition: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    text = exposition.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def values(samples: dict[Any, float], name: str, **match: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple((k, v) for k, v in labels if k not in match): value
        for (sample, labels), value in samples.items()
        if sample == name and all(dict(labels).get(k) == v for k, v in match.items())
    }


def test_queues_are_counted_in_sql_with_the_age_of_their_oldest_job(seeded: Any) -> None:
    samples = scrape(seeded)
    depth = values(samples, "supportmatrix_queue_depth")
    age = values(samples, "supportmatrix_queue_oldest_age_seconds")

    def key(queue: str, stage: str) -> Labels:
        return (("queue", queue), ("stage", stage))

    assert depth == {
        key("supportmatrix.jobs.cpu.v1.c1", "accelerator"): 2,
        key("supportmatrix.jobs.cpu.v1.c2", "accelerator"): 0,  # served once, empty: listed at 0
        key("supportmatrix.verdict.h1", "verdict"): 1,  # the judging job nobody holds; the held one is not waiting
    }
    assert age == {
        key("supportmatrix.jobs.cpu.v1.c1", "accelerator"): pytest.approx(100),
        key("supportmatrix.jobs.cpu.v1.c2", "accelerator"): 0,
        key("supportmatrix.verdict.h1", "verdict"): pytest.approx(30),
    }
    assert values(samples, "supportmatrix_jobs") == {
        (("state", "queued"),): 2, (("state", "running"),): 1, (("state", "judging"),): 2,
        (("state", "done"),): 2, (("state", "failed"),): 2, (("state", "cancelled"),): 0,
    }  # fmt: skip


def test_stage_and_compile_durations_are_cumulative_histograms_up_to_two_hours(seeded: Any) -> None:
    samples = scrape(seeded)
    accelerator = values(samples, "supportmatrix_job_duration_seconds_bucket", compiler_version="v1",
                         stage="accelerator")  # fmt: skip
    le = {dict(k)["le"]: v for k, v in accelerator.items()}
    # 70 s, 250 s (done), 170 s twice (judging): the running job and the never-run job have no duration
    assert [le[b] for b in ("60.0", "120.0", "300.0", "7200.0", "+Inf")] == [0, 1, 4, 4, 4]
    assert list(le)[-2:] == ["7200.0", "+Inf"]
    assert samples[
        ("supportmatrix_job_duration_seconds_sum", (("compiler_version", "v1"), ("stage", "accelerator")))
    ] == (pytest.approx(660, abs=0.01))
    verdict = {dict(k)["le"]: v for k, v in values(samples, "supportmatrix_job_duration_seconds_bucket",
                                                    compiler_version="v1", stage="verdict").items()}  # fmt: skip
    assert [verdict[b] for b in ("5.0", "10.0", "30.0", "60.0", "+Inf")] == [0, 1, 1, 2, 2]  # 45 s and 8 s
    v2 = values(samples, "supportmatrix_job_duration_seconds_count", compiler_version="v2")
    assert v2 == {(("stage", "accelerator"),): 1}  # 12 s; it never reached the verdict stage
    compile_le = {dict(k)["le"]: v for k, v in values(samples, "supportmatrix_compile_duration_seconds_bucket",
                                                       compiler_version="v1").items()}  # fmt: skip
    assert [compile_le[b] for b in ("1.0", "5.0", "10.0", "30.0", "+Inf")] == [0, 1, 1, 2, 2]
    assert values(samples, "supportmatrix_compile_duration_seconds_count") == {(("compiler_version", "v1"),): 2}


def test_results_count_by_compiler_verdict_error_class_and_cache_outcome(seeded: Any) -> None:
    samples = scrape(seeded)
    verdicts = {tuple(v for _, v in k): n for k, n in values(samples, "supportmatrix_verdicts_total").items()}
    assert {k: n for k, n in verdicts.items() if n} == {("v1", "", "PASS"): 1, ("v1", "", "FAIL"): 1,
                                                         ("v2", "compile", "ERROR"): 1}  # fmt: skip
    # every served or seen compiler version has each verdict's series from the start (v3's worker is stale)
    assert {(c, v) for c, _, v in verdicts} == {
        (c, v) for c in ("v1", "v2") for v in ("PASS", "FAIL", "ERROR", "SKIPPED")
    }
    cache = {tuple(v for _, v in k): n for k, n in values(samples, "supportmatrix_compile_cache_total").items()}
    assert cache == {("v1", "hit"): 1, ("v1", "miss"): 1, ("v1", "none"): 0, ("v2", "hit"): 0, ("v2", "miss"): 0,
                     ("v2", "none"): 1}  # fmt: skip
    assert samples[("supportmatrix_results", (("error_class", ""), ("verdict", "FAIL")))] == 1
    assert samples[("supportmatrix_last_result_timestamp_seconds", ())] == ago(388).timestamp()
    slowest = values(samples, "supportmatrix_slowest_models_wall_seconds")
    assert slowest == {
        (("compiler_version", "v1"), ("cores", "1"), ("model_id", "org/m7")): 200,
        (("compiler_version", "v1"), ("cores", "1"), ("model_id", "org/m6")): 50,
    }


def test_hosts_show_busy_idle_cores_fragmentation_and_worker_liveness(seeded: Any) -> None:
    samples = scrape(seeded)
    assert values(samples, "supportmatrix_host_cores") == {
        (("host", "h1"), ("state", "busy")): 1,  # cores-0 holds the running job (lease owner cores-0@h1:…)
        (("host", "h1"), ("state", "idle")): 3,
    }
    # idle cores 1, 2, 3: the largest aligned group is 2-3 (1-2 is not aligned)
    assert values(samples, "supportmatrix_host_largest_free_group_cores") == {(("host", "h1"),): 2}
    assert values(samples, "supportmatrix_workers") == {
        (("host", "h1"), ("state", "live")): 3, (("host", "h1"), ("state", "stale")): 0,
        (("host", "h2"), ("state", "live")): 0, (("host", "h2"), ("state", "stale")): 1,
    }  # fmt: skip
    assert values(samples, "supportmatrix_host_heartbeat_age_seconds") == {
        (("host", "h1"),): pytest.approx(2),
        (("host", "h2"),): pytest.approx(1000),
    }
    assert values(samples, "supportmatrix_live_workers") == {(("compiler_version", "v1"),): 3}


def test_redeliveries_resent_jobs_and_sweep_progress(seeded: Any) -> None:
    samples = scrape(seeded)
    assert values(samples, "supportmatrix_redeliveries_total") == {
        (("stage", "accelerator"),): 1,  # job 7 was taken twice
        (("stage", "verdict"),): 2,  # and its verdict stage three times
    }
    assert values(samples, "supportmatrix_resent_jobs") == {
        (("stage", "accelerator"),): 1,  # job 1: queued, its message re-sent
        (("stage", "verdict"),): 0,  # job 3's verdict message is the one sent when its cores were released
    }
    assert samples[("supportmatrix_reconciler_resends_total", ())] == 2
    assert values(samples, "supportmatrix_sweeps", state="running") == {(): 1}
    progress = {dict(k)["job_state"]: n for k, n in values(samples, "supportmatrix_sweep_entries").items()}
    assert progress == {"done": 1, "queued": 1, "none": 1}
    assert samples[("supportmatrix_job_timeout_seconds", ())] == 3600


# (model, backend, compiler, version, cores, decode rate): PASS rows of the throughput cells. The neuronx-cc
# 2.27 release ran another mix than 2.26 — org/a's fast model is gone, org/c's slow one came — and no cell got
# slower: the mean over each version's rows (what the metric was) still drops by 62 %.
MIX_CHANGE = [
    ("org/a", "neuron", "neuronx-cc", "2.26.6360.0", 1, 100.0),
    ("org/b", "neuron", "neuronx-cc", "2.26.6360.0", 1, 20.0),
    ("org/b", "neuron", "neuronx-cc", "2.27.5334.0", 1, 20.0),
    ("org/b", "neuron", "neuronx-cc", "2.27.5334.0", 1, 22.0),  # a rerun of the cell: the mean of both
    ("org/b", "neuron", "neuronx-cc", "2.27.5334.0", 2, 30.0),  # the same model on 2 cores: a cell of its own
    ("org/c", "neuron", "neuronx-cc", "2.27.5334.0", 1, 20.0),
    # another compiler on the same backend is not a version of this one: eager is never inductor's previous
    ("org/a", "cpu", "inductor", "inductor-2.13.0", 1, 50.0),
    ("org/a", "cpu", "eager", "eager-2.13.0", 1, 5.0),
]
# Versions by their numbers: 2.10 follows 2.9 (a string comparison would put it first), and is slower; an rc
# follows its release (the numbers compare equal, then the longer version follows), so 2.28.0rc1 is the newer.
ORDERED = [
    ("org/d", "neuron", "neuronx-cc", "2.9.1.0", 1, 30.0),
    ("org/d", "neuron", "neuronx-cc", "2.10.0.0", 1, 24.0),
    ("org/e", "neuron", "neuronx-cc", "2.28.0", 1, 20.0),
    ("org/e", "neuron", "neuronx-cc", "2.28.0rc1", 1, 10.0),
]


# Two TorchNeuron releases on one neuronx-cc: two stacks of the cell, never averaged together. The newer is slower,
# which a per-compiler-version mean (100 and 75 together, then nothing to compare) would not show.
TORCH_NEURONX_BUMP = [
    ("org/f", "neuron", "neuronx-cc", "2.27.5334.0", 1, 40.0, "2.8.0.1"),
    ("org/f", "neuron", "neuronx-cc", "2.27.5334.0", 1, 30.0, "2.9.0.1"),
]


def stack_label(version: str, torch_neuronx: str = "") -> str:
    """The ``stack`` label of a speed row's stack (``add_speed_rows``)."""
    from shared.contracts.run import Stack

    return Stack(compiler_version=version, torch_version="2.13.0", torch_neuronx_version=torch_neuronx,
                 library_version="5.24.0").label()  # fmt: skip


def add_speed_rows(session: Any, rows: list[tuple[Any, ...]], verdict: str = "PASS") -> None:
    """A finished job with its result for each (model, backend, compiler, version, cores, decode rate[, TorchNeuron
    version])."""
    from shared.contracts.enums import JobState, Verdict
    from shared.db.models import Job, Result

    for model_id, backend, compiler, version, cores, rate, *torch_neuronx in rows:
        job = Job(model_id=model_id, sha="c" * 40, task="text-generation", compiler_version=version,
                  queue=f"supportmatrix.jobs.{backend}.{version}.c{cores}", state=JobState.done, backend=backend,
                  compiler_name=compiler, library_version="5.24.0", torch_version="2.13.0", cores=cores,
                  torch_neuronx_version=torch_neuronx[0] if torch_neuronx else "")  # fmt: skip
        session.add(job)
        session.flush()
        session.add(Result(job_id=job.id, verdict=Verdict(verdict), cores=cores, compiler_version=version,
                           decode_tokens_per_s=rate))  # fmt: skip
    session.commit()


Labels = tuple[tuple[str, str], ...]


def ratio_labels(model: str, cores: int, version: str, previous: str, neuronx: tuple[str, str] = ("", "")) -> Labels:
    """The sorted labels of a neuron text-generation cell's ``supportmatrix_decode_speed_ratio`` series: its newest
    and previous stacks — the compiler's versions, and TorchNeuron's on each (``neuronx``)."""
    labels = {"model_id": model, "task": "text-generation", "backend": "neuron", "compiler": "neuronx-cc",
              "cores": str(cores), "compiler_version": version, "previous_compiler_version": previous}  # fmt: skip
    labels |= {"stack": stack_label(version, neuronx[0]), "previous_stack": stack_label(previous, neuronx[1])}
    return tuple(sorted(labels.items()))


def per_version_mean(session: Any) -> dict[str, float]:
    """What the family the per-cell ratio replaced said: the mean decode rate over all rows of a compiler version,
    whatever their models and cores."""
    import sqlalchemy as sa

    from shared.db.models import Result

    rows = session.execute(
        sa.select(Result.compiler_version, sa.func.avg(Result.decode_tokens_per_s))
        .where(Result.decode_tokens_per_s.is_not(None))
        .group_by(Result.compiler_version)
    )
    return {version: float(mean) for version, mean in rows}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_decode_rates_are_per_cell_against_the_same_cells_previous_stack(kind: str, tmp_path: Path) -> None:
    """One ratio series per cell that has decode rates on two software stacks or more, and none for a cell of
    one stack (org/a, org/c, the 2-core org/b, each compiler of the CPU backend: eager is never inductor's
    previous). "Newest" is the newest version *with a PASS rate*: org/b's 2.28 rows all failed, so its ratio is
    still 2.27's over 2.26's. A rerun is averaged into its cell; 2.10 follows 2.9; an rc follows its release; two
    TorchNeuron releases on one neuronx-cc are two stacks of the cell (org/f). The per-version mean of these rows
    (the family this replaced) drops by 62 % where no cell got slower."""
    from sqlalchemy.orm import Session

    with fresh_database(kind, tmp_path) as engine:
        with Session(engine) as session:
            add_speed_rows(session, MIX_CHANGE + ORDERED)
            add_speed_rows(session, [("org/b", "neuron", "neuronx-cc", "2.28.7631.0", 1, 1.0)], verdict="FAIL")
            per_version = per_version_mean(session)
            add_speed_rows(session, TORCH_NEURONX_BUMP)
        samples = scrape(lambda: Session(engine))
    assert per_version["2.27.5334.0"] == pytest.approx(0.38 * per_version["2.26.6360.0"], rel=0.01)
    assert values(samples, "supportmatrix_decode_speed_ratio") == {
        ratio_labels("org/b", 1, "2.27.5334.0", "2.26.6360.0"): pytest.approx(21 / 20),
        ratio_labels("org/d", 1, "2.10.0.0", "2.9.1.0"): pytest.approx(0.8),
        ratio_labels("org/e", 1, "2.28.0rc1", "2.28.0"): pytest.approx(0.5),
        ratio_labels("org/f", 1, "2.27.5334.0", "2.27.5334.0", ("2.9.0.1", "2.8.0.1")): pytest.approx(0.75),
    }
    assert not values(samples, "supportmatrix_decode_tokens_per_second")  # no per-cell rate: nothing reads one


@contextmanager
def counted_statements(sessions: Any) -> Iterator[list[str]]:
    """The SQL statements run on the seeded database while the block runs."""
    import sqlalchemy as sa

    with sessions() as session:
        engine = session.get_bind()
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)


def queued_jobs(samples: dict[Any, float]) -> float:
    return samples[("supportmatrix_jobs", (("state", "queued"),))]


def add_queued_job(sessions: Any) -> None:
    from shared.contracts.enums import JobState
    from shared.db.models import Job

    with sessions() as session:
        session.add(Job(model_id="org/late", sha="b" * 40, task="text-generation", compiler_version="v1",
                        queue="supportmatrix.jobs.cpu.v1.c1", state=JobState.queued, backend="cpu",
                        compiler_name="inductor", library_version="5.0", torch_version="2.13"))  # fmt: skip
        session.commit()


def test_a_scrape_serves_the_last_snapshot_and_its_age_without_running_sql(seeded: Any) -> None:
    from services.api.metrics import Snapshot

    now = [100.0]
    snapshot = Snapshot(state_collector(seeded), every_s=10, clock=lambda: now[0])
    with counted_statements(seeded) as statements:
        first = parsed(snapshot.exposition())  # no snapshot yet: the first scrape takes it
        assert statements and queued_jobs(first) == 2
        assert first[("supportmatrix_metrics_snapshot_age_seconds", ())] == 0
        add_queued_job(seeded)
        now[0] += 7
        statements.clear()
        stale = parsed(snapshot.exposition())
        assert statements == []  # a scrape reads no SQL
        assert queued_jobs(stale) == 2 and stale[("supportmatrix_metrics_snapshot_age_seconds", ())] == 7
        assert {k: v for k, v in stale.items() if "snapshot_age" not in k[0]} == {
            k: v for k, v in first.items() if "snapshot_age" not in k[0]
        }  # every family served from the snapshot
        snapshot.refresh()  # what the thread does every SUPPORTMATRIX_METRICS_REFRESH_S
        assert statements
        statements.clear()
        fresh = parsed(snapshot.exposition())
        assert statements == [] and queued_jobs(fresh) == 3
        assert fresh[("supportmatrix_metrics_snapshot_age_seconds", ())] == 0


def test_refresh_zero_reads_sql_at_each_scrape(seeded: Any) -> None:
    from services.api.metrics import Snapshot

    snapshot = Snapshot(state_collector(seeded), every_s=0)
    with counted_statements(seeded) as statements:
        assert queued_jobs(parsed(snapshot.exposition())) == 2
        add_queued_job(seeded)
        statements.clear()
        now = parsed(snapshot.exposition())
        assert statements and queued_jobs(now) == 3
        assert now[("supportmatrix_metrics_snapshot_age_seconds", ())] == 0


def test_the_refresher_thread_retakes_the_snapshot_until_stopped(seeded: Any) -> None:
    from services.api.metrics import Snapshot

    snapshot = Snapshot(state_collector(seeded), every_s=0.05)
    snapshot.start()
    try:
        assert queued_jobs(parsed(snapshot.exposition())) == 2
        add_queued_job(seeded)
        deadline = time.monotonic() + 20
        while queued_jobs(parsed(snapshot.exposition())) != 3:
            assert time.monotonic() < deadline, "the refresher never picked up the new job"
            time.sleep(0.05)
    finally:
        snapshot.stop()
    with counted_statements(seeded) as statements:
        time.sleep(0.2)  # four refresh periods: a stopped refresher runs nothing
        assert statements == []


def test_the_api_serves_its_snapshot_with_the_age_gauge_and_live_http_metrics(api: Any) -> None:
    first = api.get("/metrics").text
    assert "supportmatrix_metrics_snapshot_age_seconds " in first
    assert 'supportmatrix_jobs{state="queued"}' in first
    second = api.get("/metrics").text  # the HTTP metrics are live: the first scrape is counted in the second
    assert 'supportmatrix_http_requests_total{method="GET",route="/metrics",status="200"}' in second


def test_largest_free_group_is_aligned() -> None:
    from services.api.metrics import largest_free_group

    assert largest_free_group(set()) == 0
    assert largest_free_group({1, 2}) == 1  # 1-2 is not an aligned pair
    assert largest_free_group({4, 5, 6, 7, 9}) == 4
    assert largest_free_group(set(range(64)) - {31}) == 32


def test_http_metrics_are_labelled_by_route_template_method_and_status() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry, generate_latest

    from services.api.metrics import instrument

    app = FastAPI()

    @app.get("/things/{thing_id}")
    def thing(thing_id: int) -> dict[str, int]:
        return {"id": thing_id}

    registry = CollectorRegistry()
    instrument(app, registry)
    with TestClient(app) as client:
        for i in range(3):
            assert client.get(f"/things/{i}").status_code == 200
        assert client.get("/things/x").status_code == 422
        assert client.get("/nowhere").status_code == 404
    text = generate_latest(registry).decode()
    assert 'supportmatrix_http_requests_total{method="GET",route="/things/{thing_id}",status="200"} 3.0' in text
    assert 'supportmatrix_http_requests_total{method="GET",route="/things/{thing_id}",status="422"} 1.0' in text
    assert 'supportmatrix_http_requests_total{method="GET",route="<unmatched>",status="404"} 1.0' in text
    assert (
        'supportmatrix_http_request_duration_seconds_count{method="GET",route="/things/{thing_id}",status="200"} 3.0'
        in text
    )
    assert "/things/0" not in text  # never the raw path


# --- promtool and the dashboard file --------------------------------------------------------------------


def local_config(tmp_path: Path, target: str, interval: str = "30s") -> Path:
    """The repo's prometheus.yml with the rule file at its repo path and the API at ``target``."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"] |= {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval}
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    config["rule_files"] = [str(ALERTS)]
    [scrape_config] = config["scrape_configs"]
    scrape_config["static_configs"] = [{"targets": [target]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_promtool_checks_the_config_and_rules_and_unit_tests_every_alert(tmp_path: Path) -> None:
    promtool = binary("promtool")
    for argv in (
        ["check", "config", str(local_config(tmp_path, "api:8000"))],
        ["check", "rules", str(ALERTS)],
        ["test", "rules", str(ALERT_TESTS)],
    ):
        done = subprocess.run([promtool, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"promtool {' '.join(argv)}:\n{done.stdout}{done.stderr}"
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    alerts = {rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}
    firing = {t["alertname"] for test in tests for t in test["alert_rule_test"] if t["exp_alerts"]}
    quiet = {t["alertname"] for test in tests for t in test["alert_rule_test"] if not t["exp_alerts"]}
    assert firing == alerts and quiet == alerts, "each alert needs a firing and a quiet case"


def test_the_dashboard_is_its_generators_output_on_the_provisioned_datasource() -> None:
    try:
        import grafana_foundation_sdk  # noqa: F401
    except ImportError:
        pytest.fail("grafana-foundation-sdk is not installed: pip install 'grafana-foundation-sdk==1769699379!11.6.0'")
    done = subprocess.run([sys.executable, str(ROOT / "deploy/grafana/build_dashboard.py"), "--check"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    [source] = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    dashboard = json.loads(DASHBOARD.read_text())
    refs = [p["datasource"] for p in dashboard["panels"] if p["type"] != "row"]
    refs += [t["datasource"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert refs and all(r == {"type": "prometheus", "uid": source["uid"]} for r in refs)
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/supportmatrix.yml").read_text())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert (
        f"./deploy/grafana/dashboards:{provider['providers'][0]['options']['path']}:ro"
        in (compose["services"]["grafana"]["volumes"])
    )


# --- a real Prometheus ------------------------------------------------------------------------------------


def wait_answering(url: str, proc: subprocess.Popen[bytes], log: Path, seconds: float = 60) -> None:
    """Until ``url`` answers 200, while ``proc`` (the server behind it) lives; its log when it dies or never does."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


@contextmanager
def running_prometheus(api_port: int, workdir: Path) -> Iterator[str]:
    """Debian's Prometheus scraping the API every second with the repo's config and alert rules, once it says it
    is ready (before, its API answers nothing)."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    config = local_config(workdir, f"127.0.0.1:{api_port}", interval="1s")
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_answering(f"{base}/-/ready", proc, workdir / "prometheus.log")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


_TOP_LEVEL_SET_OP = re.compile(r"\s+(and|or|unless)\s+")
_MATCHING = re.compile(r"^\s*(?:(?:on|ignoring|group_left|group_right)\s*\([^)]*\)\s*)+")
_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(?!~)")


def _top_level(expr: str) -> list[int]:
    """Offsets of the characters of ``expr`` outside (), [], {} and quotes."""
    depth, quote, out = 0, "", []
    for i, ch in enumerate(expr):
        if quote:
            quote = "" if ch == quote and expr[i - 1] != "\\" else quote
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0:
            out.append(i)
    return out


def signals(expr: str) -> list[str]:
    """What an alert compares, as queries that return a series whatever the comparison's outcome: the operands
    of a top-level ``and``/``or``/``unless`` one by one, each top-level comparison turned into ``> bool``
    (1 or 0 per series instead of a filter). A rule whose signal returns nothing can never fire."""
    outside = set(_top_level(expr))
    cuts = [m for m in _TOP_LEVEL_SET_OP.finditer(expr) if m.start() in outside]
    parts, start = [], 0
    for m in cuts:
        parts.append(expr[start : m.start()])
        start = m.end()
    parts.append(expr[start:])
    out = []
    for part in parts:
        part = _MATCHING.sub("", part)
        outside = set(_top_level(part))
        comparisons = [m for m in _COMPARISON.finditer(part) if m.start() in outside]
        for m in reversed(comparisons):
            part = part[: m.end()] + " bool" + part[m.end() :]
        out.append(part.strip())
    return out


def test_signals_turn_each_condition_into_a_series_that_always_answers() -> None:
    assert signals('up{job="a"} == 0') == ['up{job="a"} == bool 0']
    assert signals('time() - x > 3 * 3600\nand on() sum(y{stage="a"}) > 0') == [
        "time() - x > bool 3 * 3600",
        'sum(y{stage="a"}) > bool 0',
    ]
    assert signals("histogram_quantile(0.95, rate(b[1h])) > on() group_left() (0.8 * t)") == [
        "histogram_quantile(0.95, rate(b[1h])) > bool on() group_left() (0.8 * t)"
    ]
    assert signals('x{a=~"p|q", b!="r"} >= 20') == ['x{a=~"p|q", b!="r"} >= bool 20']


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def alert_expressions() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


# Families a cell has only once it ran under two compiler versions: a stack that ran one job has none, so there
# their expressions need only evaluate; a real Prometheus over cells of three versions has them return data
# (test_a_real_prometheus_fires_on_a_cells_slowdown_and_not_on_a_changed_model_mix).
CROSS_VERSION_FAMILIES = ("supportmatrix_decode_speed_ratio",)


def checked_expressions() -> dict[str, str]:
    """{query: the expression it checks} over every panel's PromQL and every signal of every alert rule; an
    alert's own expression maps to "" (it must evaluate, and may be empty: no alert firing)."""
    checks = {expr: expr for expr in dashboard_expressions()}
    for expr in alert_expressions():
        checks |= {signal: expr for signal in signals(expr)}
        checks.setdefault(expr, "")
    return checks


def cross_version(query: str) -> bool:
    return any(family in query for family in CROSS_VERSION_FAMILIES)


def assert_every_expression_returns_data(prometheus: str, timeout: float = 45) -> None:
    """Every panel's PromQL, and every signal of every alert rule, returns at least one series from the
    Prometheus that scraped the stack (but those over CROSS_VERSION_FAMILIES, which one job cannot make); the
    alert expressions themselves evaluate without error."""
    checks = {query: "" if cross_version(query) else source for query, source in checked_expressions().items()}
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=prometheus, timeout=10) as client:
        while True:
            empty, errors = [], []
            for query, source in checks.items():
                answer = client.get("/api/v1/query", params={"query": query}).json()
                if answer["status"] != "success":
                    errors.append(f"{query}: {answer.get('error')}")
                elif source and not answer["data"]["result"]:
                    empty.append(query if query == source else f"{query}   (of {source!r})")
            assert errors == [], "\n".join(errors)
            if not empty:
                return
            if time.monotonic() > deadline:
                targets = client.get("/api/v1/targets").json()["data"]["activeTargets"]
                health = [(t["scrapeUrl"], t["health"], t.get("lastError")) for t in targets]
                raise AssertionError("no data for:\n" + "\n".join(empty) + f"\ntargets: {health}")
            time.sleep(1)


@contextmanager
def serving_api(database_url: str, workdir: Path) -> Iterator[int]:
    """The API itself (``uvicorn services.api.main:app``) on a free port over ``database_url``, reading its SQL
    families at each scrape (SUPPORTMATRIX_METRICS_REFRESH_S=0); yields the port once /metrics answers."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SUPPORTMATRIX_DATABASE_URL": database_url, "SUPPORTMATRIX_METRICS_REFRESH_S": "0"}
    with (workdir / "api.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "services.api.main:app", "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_answering(f"http://127.0.0.1:{port}/metrics", proc, workdir / "api.log")
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rule_state(client: httpx.Client, alert: str) -> tuple[float, str, list[dict[str, Any]]]:
    """When Prometheus last evaluated the rule ``alert`` (Unix time), its state, and its alerts' labels."""
    groups = client.get("/api/v1/rules").json()["data"]["groups"]
    [rule] = [r for g in groups for r in g["rules"] if r["name"] == alert]
    evaluated = dt.datetime.fromisoformat(rule["lastEvaluation"].replace("Z", "+00:00")).timestamp()
    return evaluated, rule["state"], [a["labels"] for a in rule.get("alerts", [])]


def settled_rule(client: httpx.Client, alert: str, since: float, timeout: float = 30) -> tuple[str, list[Any]]:
    """The rule's state and alerts at its first evaluation two seconds (two scrapes) after ``since``."""
    deadline = time.monotonic() + timeout
    while True:
        evaluated, state, alerts = rule_state(client, alert)
        if evaluated > since + 2:
            return state, alerts
        assert time.monotonic() < deadline, f"{alert} not evaluated since {since}"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_real_prometheus_fires_on_a_cells_slowdown_and_not_on_a_changed_model_mix(tmp_path: Path) -> None:
    """Debian's Prometheus, with the repo's config and rules, scrapes the API's /metrics (the app itself, under
    uvicorn) over a database whose neuronx-cc 2.27 ran another model mix than 2.26 (its mean over rows 62 %
    lower, no cell slower): the cells'
    ratios are there — every dashboard and alert expression over them returns data — and
    SupportmatrixCellDecodeSlower stays inactive. Then 2.28 halves one cell's rate and keeps another's: the alert
    fires for that cell alone, naming both versions."""
    from sqlalchemy.orm import Session

    alert = "SupportmatrixCellDecodeSlower"
    with fresh_database("postgresql", tmp_path) as engine, ExitStack() as stack:
        with Session(engine) as session:
            add_speed_rows(session, MIX_CHANGE)
            per_version = per_version_mean(session)
        # what the per-version mean over these rows (the family the ratio replaced) says: 62 % slower
        assert per_version["2.27.5334.0"] < 0.85 * per_version["2.26.6360.0"]
        api_port = stack.enter_context(serving_api(engine.url.render_as_string(hide_password=False), tmp_path / "api"))
        prometheus = stack.enter_context(running_prometheus(api_port, tmp_path / "prometheus"))
        client = stack.enter_context(httpx.Client(base_url=prometheus, timeout=10))
        queries = [q for q in checked_expressions() if cross_version(q)]
        assert len(queries) >= 3  # the alert, its signal, the dashboard's table
        deadline = time.monotonic() + 60
        while True:
            answers = {q: client.get("/api/v1/query", params={"query": q}).json() for q in queries}
            assert all(a["status"] == "success" for a in answers.values()), answers
            if all(a["data"]["result"] for q, a in answers.items() if checked_expressions()[q]):
                break
            assert time.monotonic() < deadline, f"no data from {prometheus}: {answers}"
            time.sleep(0.5)
        assert settled_rule(client, alert, time.time()) == ("inactive", [])

        with Session(engine) as session:
            add_speed_rows(session, [("org/b", "neuron", "neuronx-cc", "2.28.7631.0", 1, 10.5),
                                     ("org/c", "neuron", "neuronx-cc", "2.28.7631.0", 1, 20.0)])  # fmt: skip
        deadline = time.monotonic() + 60
        while (state := settled_rule(client, alert, time.time()))[0] != "firing":
            assert time.monotonic() < deadline, state
        [labels] = state[1]
        assert labels == {
            "alertname": alert, "severity": "ticket", "job": "supportmatrix-api",
            "instance": f"127.0.0.1:{api_port}", "model_id": "org/b", "task": "text-generation",
            "backend": "neuron", "compiler": "neuronx-cc", "cores": "1", "compiler_version": "2.28.7631.0",
            "previous_compiler_version": "2.27.5334.0", "stack": stack_label("2.28.7631.0"),
            "previous_stack": stack_label("2.27.5334.0"),
        }  # fmt: skip

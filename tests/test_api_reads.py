"""Reading through the API: jobs and results pages, CSV and Parquet, health, metrics, the OpenAPI schema."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from typing import Any

import pandas as pd
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from services.api.deps import current_settings
from shared.contracts.enums import Verdict
from shared.contracts.run import RuntimeInfo
from shared.db.engine import session_scope
from shared.hub.client import ResolvedModel
from shared.jobs.lease import acquire_lease
from shared.jobs.outcomes import finish
from shared.jobs.submission import submit
from shared.settings import Settings, get_settings
from tests.history import record, report_of

RUNTIME = RuntimeInfo(
    backend="cpu", compiler_name="c", compiler_version="reads-1.0", library_version="5.0", torch_version="2"
)


@pytest.fixture(scope="module")
def org() -> str:
    """Five finished jobs of a fresh org: three PASS, two FAIL."""
    org = f"reads{uuid.uuid4().hex[:8]}"
    with session_scope() as session:
        for i, verdict in enumerate([Verdict.PASS, Verdict.FAIL, Verdict.PASS, Verdict.FAIL, Verdict.PASS]):
            model = ResolvedModel(model_id=f"{org}/m{i}", sha=f"{i:040d}", gated=False, pipeline_tag=None)
            [sub] = submit(session, model, None, [RUNTIME])
            session.flush()
            acquire_lease(session, sub.job.id, "reader", get_settings())
            finish(
                session,
                sub.job.id,
                "reader",
                report_of(model_id=model.model_id, task="text-generation", backend="cpu", verdict=verdict),
            )
    return org


def test_results_page_with_a_cursor_and_filters(api: Any, org: str) -> None:
    first = api.get("/results", params={"compiler": "reads-1.0", "limit": 2}).json()
    assert len(first["items"]) == 2 and first["next_cursor"]
    second = api.get("/results", params={"compiler": "reads-1.0", "limit": 2, "cursor": first["next_cursor"]})
    ids = [r["job_id"] for r in first["items"] + second.json()["items"]]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 4
    fails = api.get("/results", params={"compiler": "reads-1.0", "verdict": "FAIL"}).json()["items"]
    assert {r["model_id"] for r in fails} == {f"{org}/m1", f"{org}/m3"}
    assert api.get("/results", params={"model_id": f"{org}/m0"}).json()["items"][0]["result"] == "PASS"


def test_a_view_pages_in_its_rank_order(api: Any, org: str) -> None:
    """A sweep's view is paged by position in its rank order, not by job id: every row once, in rank order."""
    from shared.contracts.enums import SweepState
    from shared.db.models import Job, Sweep, SweepEntry

    ranked = [f"{org}/m{i}" for i in (3, 0, 4, 1, 2)]
    with session_scope() as session:
        rows = session.execute(sa.select(Job.model_id, Job.id).where(Job.model_id.startswith(f"{org}/"))).all()
        ids = {model_id: job_id for model_id, job_id in rows}
        sweep = Sweep(trigger="api", state=SweepState.done, config={})
        session.add(sweep)
        session.flush()
        for rank, model_id in enumerate(ranked, start=1):
            session.add(SweepEntry(sweep_id=sweep.id, model_id=model_id, task="text-generation", view="trending",
                                   rank=rank, job_id=ids[model_id]))  # fmt: skip
        # a job ranked twice is listed once, at its first rank; an entry without a job, another view's entries and
        # a newer sweep still running are not the view
        session.add_all([
            SweepEntry(sweep_id=sweep.id, model_id=ranked[1], task="text-generation", view="trending", rank=6,
                       job_id=ids[ranked[1]]),
            SweepEntry(sweep_id=sweep.id, model_id=f"{org}/none", task="text-generation", view="trending", rank=2,
                       job_id=None, note="no job"),
            SweepEntry(sweep_id=sweep.id, model_id=ranked[4], task="text-generation", view="downloads", rank=1,
                       job_id=ids[ranked[4]]),
        ])  # fmt: skip
        running = Sweep(trigger="api", state=SweepState.running, config={})
        session.add(running)
        session.flush()
        session.add(SweepEntry(sweep_id=running.id, model_id=ranked[4], task="text-generation", view="trending",
                               rank=1, job_id=ids[ranked[4]]))  # fmt: skip
    for verdict, expected in ((None, ranked), ("PASS", [m for m in ranked if m[-1] in "024"])):
        seen, cursor = [], None
        while True:
            params = {"view": "trending", "task": "text-generation", "limit": 2, "cursor": cursor, "verdict": verdict}
            page = api.get("/results", params={k: v for k, v in params.items() if v is not None}).json()
            seen += [r["model_id"] for r in page["items"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == expected
    first_page = {"view": "trending", "task": "text-generation", "limit": 2}
    assert [r["model_id"] for r in api.get("/results", params=first_page).json()["items"]] == ranked[:2]
    with session_scope() as session:  # a newer sweep finishes, ranking them the other way; no result is written
        newer = Sweep(trigger="api", state=SweepState.done, config={})
        session.add(newer)
        session.flush()
        for rank, model_id in enumerate(reversed(ranked), start=1):
            session.add(SweepEntry(sweep_id=newer.id, model_id=model_id, task="text-generation", view="trending",
                                   rank=rank, job_id=ids[model_id]))  # fmt: skip
    assert [r["model_id"] for r in api.get("/results", params=first_page).json()["items"]] == ranked[::-1][:2]
    with session_scope() as session:  # the newest sweep swept another task only: this task's view stays the newer one
        other = Sweep(trigger="api", state=SweepState.done, config={})
        session.add(other)
        session.flush()
        session.add(SweepEntry(sweep_id=other.id, model_id=ranked[0], task="feature-extraction", view="trending",
                               rank=1, job_id=None, note="not swept"))  # fmt: skip
    assert [r["model_id"] for r in api.get("/results", params=first_page).json()["items"]] == ranked[::-1][:2]
    # the page reads the same view (one query's meaning): its rows in the same rank order, from the same sweep
    from shared.results.views import table_page

    with session_scope() as session:
        table = table_page(session, task="text-generation", compiler="reads-1.0", library_version="5.0",
                           price_per_core_hour=1.0, view="trending", limit=100)  # fmt: skip
    assert table.sweep_id == newer.id
    assert [row.model_id for row in table.rows if row.job_id is not None] == ranked[::-1]


def test_a_results_answer_is_kept_until_results_change_and_never_served_older(api: Any, org: str) -> None:
    """GET /results keeps each answer by its query and the records' version (services/api/answers.py). Shown by a
    change the version cannot see (triggers switched off for one statement): the same queries, as JSON and as CSV
    (with its next cursor), answer the bytes they kept, while another query reads the change. The next write of any
    result raises the version, and the queries read their records again. (A result that another process of the
    session commits meanwhile raises the version too: the check is then made again.)"""
    from shared.db.models import Job, Result
    from shared.results.records import records_version

    def version() -> Any:
        with session_scope() as session:
            return records_version(session)

    model = {"model_id": f"{org}/m0"}
    queries = [model, {**model, "format": "csv"}, {"compiler": "reads-1.0", "limit": 2, "format": "csv"}]
    job_id = sa.select(Job.id).where(Job.model_id == model["model_id"]).scalar_subquery()
    try:
        for attempt in range(5):
            before = version()
            kept = [api.get("/results", params=query) for query in queries]
            with session_scope() as session:
                session.execute(sa.text("SET LOCAL session_replication_role = replica"))  # no trigger fires
                unseen = f"changed unseen ({attempt})"
                session.execute(sa.update(Result).where(Result.job_id == job_id).values(verdict_reason=unseen))
            again = [api.get("/results", params=query) for query in queries]
            if version() == before:
                break
        else:
            pytest.fail("results landed during each of 5 tries")
        assert kept[0].json()["items"][0]["verdict_reason"] is None and kept[2].headers["x-next-cursor"]
        assert [(a.content, a.headers.get("x-next-cursor")) for a in again] == [
            (k.content, k.headers.get("x-next-cursor")) for k in kept
        ]
        [changed] = api.get("/results", params={**model, "verdict": "PASS"}).json()["items"]
        assert changed["verdict_reason"] == unseen
        with session_scope() as session:  # any result written (of another compiler version): the version rises
            later = RUNTIME.model_copy(update={"compiler_version": "reads-later"})
            record(session, f"{org}/later", later, Verdict.PASS)
        assert api.get("/results", params=model).json()["items"][0]["verdict_reason"] == unseen
        assert unseen in api.get("/results", params=queries[1]).text
    finally:
        with session_scope() as session:  # and back, for the other tests of this org
            session.execute(sa.update(Result).where(Result.job_id == job_id).values(verdict_reason=None))


def test_kept_answers_are_bounded_in_bytes_least_recently_used_first_out_and_none_large_or_unversioned() -> None:
    from services.api.answers import LARGEST_SHARE, Answer, Answers
    from shared.results.records import RecordsVersion

    at = RecordsVersion(7, 1)
    answers = Answers(max_bytes=LARGEST_SHARE * 100)
    reads: list[str] = []

    def current() -> RecordsVersion:
        reads.append("version")
        return at

    assert answers.get("a", current) is None and reads == [], "nothing kept: the version is not read"
    for name in "abcdefghijklmnop":  # 16 answers of 100 bytes fill it
        answers.keep(name, Answer(at, name.encode() * 100, "text/csv", {"X-Next-Cursor": "2"}))
    assert answers.get("a", current) is not None  # "a", the first kept, is now the most recently used
    answers.keep("q", Answer(at, b"q" * 100, "text/csv", {}))
    assert answers.get("b", current) is None and answers.get("a", current) is not None
    kept = answers.get("a", current)
    assert kept is not None and kept.body == b"a" * 100 and kept.headers["x-next-cursor"] == "2"
    assert answers.get("a", lambda: RecordsVersion(8, 1)) is None, "kept at another version"
    answers.keep("large", Answer(at, b"x" * 101, "text/csv", {}))
    answers.keep("empty", Answer(None, b"[]", "application/json", {}))
    assert answers.get("large", current) is None and answers.get("empty", current) is None
    assert answers.get("q", current) is not None, "neither pushed out what was kept"
    assert Answers(max_bytes=0).keep("a", Answer(at, b"a", "text/csv", {})).body == b"a"


def test_results_as_csv_and_parquet_for_downstream_tools(api: Any, org: str) -> None:
    csv = api.get("/results", params={"compiler": "reads-1.0", "format": "csv"})
    assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
    table = pd.read_csv(io.StringIO(csv.text))
    assert sorted(table.model_id) == [f"{org}/m{i}" for i in range(5)]
    parquet = api.get("/results", params={"compiler": "reads-1.0", "format": "parquet", "limit": 3})
    frame = pd.read_parquet(io.BytesIO(parquet.content))
    assert len(frame) == 3 and parquet.headers["x-next-cursor"] == str(frame.job_id.iloc[-1])
    assert list(frame.columns[:6]) == ["model_id", "neuronx_cc", "library", "library_version", "neuron_cores", "result"]


def test_jobs_page_and_filters(api: Any, org: str) -> None:
    page = api.get("/jobs", params={"model_id": f"{org}/m2"}).json()
    assert [j["model_id"] for j in page["items"]] == [f"{org}/m2"] and page["next_cursor"] is None
    done = api.get("/jobs", params={"state": "done", "limit": 1}).json()
    assert done["items"][0]["state"] == "done" and done["next_cursor"]
    assert api.get("/jobs/424242").status_code == 404


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/jobs", {"state": "sleeping"}),
        ("/jobs", {"limit": 0}),
        ("/jobs", {"cursor": "abc"}),
        ("/jobs", {"model_id": "bad\u0000id"}),
        ("/results", {"verdict": "MAYBE"}),
        ("/results", {"format": "xlsx"}),
        ("/results", {"limit": 10**9}),
        ("/jobs/not-a-number", {}),
    ],
)
def test_bad_query_parameters_get_a_422_with_a_reason(api: Any, path: str, params: dict[str, Any]) -> None:
    response = api.get(path, params=params)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["msg"]


def test_health_says_which_dependency_is_down(api: Any) -> None:
    ok = api.get("/healthz")
    assert ok.status_code == 200 and ok.json() == {"database": "ok", "redis": "ok"}
    app = api.app
    broken = Settings(redis_url="redis://127.0.0.1:1/0")
    app.dependency_overrides[current_settings] = lambda: broken
    try:
        down = api.get("/healthz")
    finally:
        app.dependency_overrides.clear()
    assert down.status_code == 503 and down.json()["database"] == "ok" and "Error" in down.json()["redis"]


def test_a_database_outage_is_a_503_with_retry_after_and_without_the_databases_words(api: Any) -> None:
    from services.api.deps import get_session
    from shared.db.engine import make_engine

    dead = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/none")

    def dead_session() -> Iterator[Session]:
        with Session(dead) as session:
            yield session

    api.app.dependency_overrides[get_session] = dead_session
    try:
        answers = [api.get("/jobs"), api.get("/results"), api.post("/jobs", json={"model_id": "org/tiny-llama"})]
    finally:
        api.app.dependency_overrides.pop(get_session)
        dead.dispose()
    for response in answers:
        assert response.status_code == 503 and int(response.headers["retry-after"]) > 0
        assert response.json() == {"detail": "the database is unavailable"}
        assert not any(word in response.text for word in ("127.0.0.1", "postgres", "psycopg", "connection"))


def test_metrics_count_jobs_and_results_with_the_shared_codes(api: Any, org: str) -> None:
    text = api.get("/metrics").text
    assert 'supportmatrix_jobs{state="done"}' in text
    assert 'supportmatrix_results{error_class="",verdict="FAIL"}' in text


def test_openapi_documents_every_status_each_route_returns(api: Any) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    assert set(paths["/jobs"]["post"]["responses"]) == {
        "200",
        "202",
        "400",
        "401",
        "403",
        "404",
        "413",
        "422",
        "429",
        "503",
    }
    assert set(paths["/jobs/{job_id}"]["delete"]["responses"]) == {
        "200",
        "401",
        "403",
        "404",
        "409",
        "422",
        "429",
        "503",
    }
    assert set(paths["/sweeps"]["post"]["responses"]) == {"202", "401", "403", "429", "503"}
    assert "Retry-After" in paths["/jobs"]["post"]["responses"]["429"]["headers"]
    assert "security" in paths["/jobs"]["post"] and "security" not in paths["/jobs"]["get"]
    assert set(paths["/results"]["get"]["responses"]) == {"200", "422", "503"}
    assert set(paths["/healthz"]["get"]["responses"]) == {"200", "503"}
    assert "pattern" in str(paths["/jobs"]["get"]["parameters"])


def test_openapi_types_every_response_body(api: Any) -> None:
    schema = api.get("/openapi.json").json()
    paths, models = schema["paths"], schema["components"]["schemas"]

    def body(path: str, method: str, status: str) -> str:
        return str(paths[path][method]["responses"][status]["content"]["application/json"]["schema"])

    assert "ResultRecord" in str(models["ResultPage"]) and "neuron_cores" in models["ResultRecord"]["properties"]
    assert "SweepOut" in body("/sweeps", "post", "202") and "SweepOut" in body("/sweeps/{sweep_id}", "get", "200")
    assert "SweepEntryOut" in str(models["SweepOut"])
    assert "CellDiff" in body("/results/diff", "get", "200")
    assert set(models["CellChange"]["properties"]) == {
        "model_id", "task", "from", "to", "from_sha", "to_sha", "from_stack", "to_stack"
    }  # fmt: skip
    assert {"axis", "from", "to"} <= set(models["CellDiff"]["properties"])


def test_a_pooled_connection_is_pinged_only_after_idling_and_one_the_database_dropped_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    import psycopg

    from shared.db.engine import PING_IDLE_S, make_engine
    from tests.conftest import PG_BASE

    engine = make_engine(PG_BASE)
    pings: list[int] = []
    ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda conn: pings.append(1) or ping(conn))

    def backend() -> int:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())

    try:
        first = backend()
        assert backend() == first and pings == []  # handed out again at once: no ping, no new connection
        with psycopg.connect(PG_BASE.replace("postgresql+psycopg", "postgresql"), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (first,))  # as a restart drops it, in the pool
        time.sleep(PING_IDLE_S + 0.2)
        replaced = backend()  # the ping finds it gone: the pool hands out a new one, and the read succeeds
        assert replaced != first and pings == [1]
    finally:
        engine.dispose()

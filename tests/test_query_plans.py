"""The queries the API and the export issue use indexes: PostgreSQL runs them (EXPLAIN ANALYZE) over a table big
enough that it would scan it whole without them, and none scans jobs or results sequentially, nor reads more than a
model's runs' worth of their rows only to filter them out (what an index on too few columns does: the export's
reads through the compiler version alone threw away every other library version's rows).

The SQL is what the code really issues — the routes called through the app, the export's and the submission's
functions called directly — captured from the engine as it runs, then EXPLAINed with the same parameters. The
table: 200 k finished jobs with their results, generated server-side (``testing.bulk_rows``: 10 000 models over
8 compiler versions, a sweep per round with its ranked views) and analysed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from services.api.deps import get_session
from services.api.main import app
from shared.db.models import Job
from shared.hub.client import ResolvedModel
from shared.jobs.submission import submit
from shared.results.export import ExportKey, key_cells
from testing.bulk_rows import TABLES, History, populate
from tests.conftest import fresh_database

ROWS = 200_000
BIG_TABLES = {"jobs", "results"}
DISCARDED_AT_MOST = 1000  # rows one scan of a big table may read and filter out (a model has 20 runs here)


@dataclass(frozen=True)
class Big:
    engine: sa.Engine
    history: History


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Big]:
    with fresh_database("postgresql", tmp_path_factory.mktemp("plans")) as engine:
        with engine.begin() as conn:
            history = populate(conn.connection.driver_connection, ROWS)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f"ANALYZE {', '.join(TABLES)}")
        yield Big(engine, history)


@pytest.fixture(scope="module")
def client(big: Big) -> Iterator[TestClient]:
    """The API reading the big database."""

    def session_of_big() -> Iterator[Session]:
        with Session(big.engine) as session:
            yield session

    app.dependency_overrides[get_session] = session_of_big
    try:
        with TestClient(app) as client:
            yield client
    finally:
        app.dependency_overrides.pop(get_session)


@contextmanager
def issued(engine: sa.Engine) -> Iterator[list[tuple[str, Any]]]:
    """The statements ``engine`` sends while the block runs, with their parameters."""
    seen: list[tuple[str, Any]] = []

    def keep(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        seen.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", keep)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", keep)


def wasteful_scans(node: dict[str, Any]) -> list[str]:
    """The scans of a big table in a plan (EXPLAIN ANALYZE's JSON node) that are sequential or discard more than
    ``DISCARDED_AT_MOST`` rows by their filter."""
    found = []
    if node.get("Relation Name") in BIG_TABLES:
        discarded = node.get("Rows Removed by Filter", 0)
        if node["Node Type"] == "Seq Scan" or discarded > DISCARDED_AT_MOST:
            found.append(f"{node['Node Type']} on {node['Relation Name']}, {discarded} rows filtered out")
    return found + [scan for child in node.get("Plans", []) for scan in wasteful_scans(child)]


def assert_read_through_indexes(engine: sa.Engine, statements: list[tuple[str, Any]]) -> None:
    reads = [(sql, params) for sql, params in statements if sql.lstrip().upper().startswith(("SELECT", "WITH"))]
    assert any(table in sql for sql, _ in reads for table in BIG_TABLES), "no query of jobs or results ran"
    with engine.connect() as conn:
        for sql, params in reads:
            [plan] = conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).scalar_one()
            wasteful = wasteful_scans(plan["Plan"])
            assert not wasteful, f"{wasteful}:\n{sql}\n{params}\n{json.dumps(plan, indent=1)}"


def test_a_models_results_are_read_through_the_model_index(big: Big, client: TestClient) -> None:
    model = big.history.model_id(1234)
    with issued(big.engine) as statements:
        page = client.get("/results", params={"model_id": model}).json()
    assert {row["model_id"] for row in page["items"]} == {model} and len(page["items"]) == big.history.rounds
    assert_read_through_indexes(big.engine, statements)


def test_a_views_page_and_its_next_read_only_the_views_jobs(big: Big, client: TestClient) -> None:
    view = {"view": "trending", "task": "text-generation", "limit": 100}
    with issued(big.engine) as statements:
        first = client.get("/results", params=view).json()
        second = client.get("/results", params={**view, "cursor": first["next_cursor"]}).json()
    assert len(first["items"]) == len(second["items"]) == 100
    assert not {r["job_id"] for r in first["items"]} & {r["job_id"] for r in second["items"]}
    assert_read_through_indexes(big.engine, statements)


def test_an_export_files_runs_are_read_by_their_key(big: Big) -> None:
    """What the export reads for one stack's file (compiler, torch, TorchNeuron, runtime and library versions) — the
    statement ``key_cells`` sends, which the columnar reader sends with its values inline — for a compiler version
    that ran on two stacks (two library versions, each with its torch)."""
    h = big.history
    round_ = next(
        k
        for k in range(1, h.rounds)
        if h.compiler(k) == h.compiler(k - 1) and h.library_version(k) != h.library_version(k - 1)
    )
    key = ExportKey.of(h.stack(round_))
    assert key.stack.torch_version != h.torch_version(round_ - 1)  # the other stack on this compiler is another file
    with issued(big.engine) as statements, Session(big.engine) as session:
        cells = key_cells(session, key)
    stacks = {(c.neuronx_cc, c.library_version, c.torch_version, c.torch_neuronx_version, c.neuron_runtime_version)
              for c in cells}  # fmt: skip
    assert cells and stacks == {
        (key.stack.compiler_version, key.stack.library_version, key.stack.torch_version, "", "")
    }
    assert_read_through_indexes(big.engine, statements)


def test_a_submission_finds_the_known_models_job_through_the_model_index(big: Big) -> None:
    """POST /jobs of a model that has its job: the identity lookup (shared.jobs.submission.submit) finds it."""
    with Session(big.engine) as session:
        job = session.scalars(sa.select(Job).where(Job.model_id == big.history.model_id(4321)).limit(1)).one()
        model = ResolvedModel(model_id=job.model_id, sha=job.sha, gated=job.gated, pipeline_tag=job.task)
        with issued(big.engine) as statements:
            [submitted] = submit(session, model, None, [job.runtime()], task=job.task, cores=job.cores)
        assert not submitted.created and submitted.job.model_id == job.model_id
    assert_read_through_indexes(big.engine, statements)


def test_a_diff_page_and_its_next_read_only_the_pages_cells(big: Big, client: TestClient) -> None:
    """GET /results/diff between two compiler versions of 10 000 models: a page of 200 cells, then the next, each read
    through the version-and-key index; neither reads either version whole."""
    h = big.history
    old, new = h.compiler(0), h.newest_compiler
    params = {"from": old, "to": new, "limit": 200}
    with issued(big.engine) as statements:
        first = client.get("/results/diff", params=params).json()
        second = client.get("/results/diff", params={**params, "cursor": first["next_cursor"]}).json()
    assert first["cells_compared"] == second["cells_compared"] == 200 and second["next_cursor"] > first["next_cursor"]
    assert_read_through_indexes(big.engine, statements)

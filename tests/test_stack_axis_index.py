"""The stack axis of a diff reads through the stored stack digest's index (ix_jobs_diff_stack), as the compiler and
library axes read through theirs: PostgreSQL, sequential scans turned off so that a small table's plan shows which
index a statement can use at all (tests/test_query_plans.py measures the other axes on a million rows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import Verdict
from shared.results.cells import diff
from tests.conftest import fresh_database
from tests.test_stack_identity import NEURON, finished


def scans_of_jobs(node: dict[str, Any]) -> list[tuple[str, str | None]]:
    """Each scan of the jobs table in a plan (EXPLAIN's JSON node): its kind and index."""
    found = [(node["Node Type"], node.get("Index Name"))] if node.get("Relation Name") == "jobs" else []
    return found + [scan for child in node.get("Plans", []) for scan in scans_of_jobs(child)]


def test_a_stack_diff_reads_the_jobs_of_its_two_stacks_through_the_digest_index(tmp_path: Path) -> None:
    older = NEURON
    newer = NEURON.model_copy(update={"torch_neuronx_version": "2.13.3.0.2"})
    with fresh_database("postgresql", tmp_path) as engine:
        with Session(engine, expire_on_commit=False) as session:
            for i in range(3):
                finished(session, f"plan/m{i}", older, Verdict.PASS)
                finished(session, f"plan/m{i}", newer, Verdict.FAIL if i == 0 else Verdict.PASS)
        issued: list[tuple[str, Any]] = []

        def keep(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
            issued.append((statement, parameters))

        sa.event.listen(engine, "before_cursor_execute", keep)
        try:
            with Session(engine) as session:
                changes = diff(session, "stack", older.stack().digest, newer.stack().digest, limit=2)
        finally:
            sa.event.remove(engine, "before_cursor_execute", keep)
        assert [c.model_id for c in changes.regressed] == ["plan/m0"] and changes.next_cursor is not None
        reads = [(sql, params) for sql, params in issued if sql.lstrip().upper().startswith("SELECT")]
        assert len(reads) >= 3  # each stack by its digest, the page's keys, both sides' cells
        with engine.connect() as conn:
            conn.exec_driver_sql("SET enable_seqscan = off")
            for sql, params in reads:
                [plan] = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + sql, params).scalar_one()
                scans = scans_of_jobs(plan["Plan"])
                assert scans and all(index == "ix_jobs_diff_stack" for _, index in scans), (
                    f"{scans}\n{sql}\n{json.dumps(plan, indent=1)}"
                )

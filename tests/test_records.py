"""One field list: a report's parts declare each result field once; the SQL columns, the published record, its
Parquet schema and the API's result shape are derived from them, and a value goes through all of them unchanged."""

from __future__ import annotations

import datetime as dt
import io
import json
import re
import sys
from enum import StrEnum
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy.orm import Session

from services.api.main import app
from shared.contracts.enums import ErrorClass, Stage, Verdict
from shared.contracts.fields import FieldShape, shape_of
from shared.contracts.report import ROW_PARTS, RunReport, row_fields
from shared.contracts.run import RuntimeInfo, RuntimeVersions
from shared.db.models import Result
from shared.hub.client import ResolvedModel
from shared.jobs.lease import acquire_lease
from shared.jobs.outcomes import finish
from shared.jobs.submission import submit
from shared.results.records import (
    FROM_JOB,
    RENAMED_RESULT_COLUMNS,
    RESULT_SCHEMA,
    SCHEMA_VERSION,
    RecordHead,
    ResultRecord,
    query_results,
    to_parquet_bytes,
)
from shared.results.type_stubs import STUBS
from shared.settings import Settings
from tests.conftest import ROOT
from tests.history import report_of

PINNED_SCHEMA = ROOT / "tests" / "data" / "record_schema.json"
PIN = "python -m tests.test_records"
ROW = [f.name for f in row_fields()]
SQL_ONLY = {f.name for f in row_fields() if shape_of(f.info).sql_only}
REPEATED = {"compiler_version"}  # the row repeats the job's, which the record publishes as neuronx_cc


# Fields only a result has (no job, worker or setting shares the name): each is written once, in its part.
RESULT_ONLY = ["prefill_rel_error", "reference_loglik", "similarity", "tokens_match", "reference_reused",
               "generated_token_ids", "reference_text", "judge_rationale", "judge_prompt_hash", "visible_cores",
               "parallelism", "predicted_peak_bytes_per_core", "failure_signature", "reproduce", "load_s"]  # fmt: skip


def test_a_result_field_is_declared_in_exactly_one_place() -> None:
    """``prefill_rel_error: ...`` is written once, in shared/contracts/report.py: no other module of shared/ or
    services/ declares a field, column or attribute of that name — the SQL column, the record and Parquet derive."""
    sources = [p for top in ("shared", "services") for p in (ROOT / top).rglob("*.py")]
    assert set(RESULT_ONLY) <= set(ROW)
    for name in RESULT_ONLY:
        declared = [
            str(path.relative_to(ROOT))
            for path in sources
            for _ in re.finditer(rf"^\s+{name}: ", path.read_text(), re.MULTILINE)
        ]
        assert declared == ["shared/contracts/report.py"], f"{name} declared in {declared}"


def test_the_sql_columns_the_record_and_parquet_are_the_parts_fields() -> None:
    # every part of a report is a row's but the subject (the job's own columns): a new part cannot be left out
    parts = {name for name in RunReport.model_fields if name not in ("verdict", "verdict_reason")}
    assert parts == set(ROW_PARTS) | {"subject"}
    columns = [c.key for c in Result.__table__.columns]
    assert sorted(columns) == sorted(["id", "job_id", "verdict", "created_at", *ROW])
    published = [
        n
        for n in ROW
        if n not in SQL_ONLY | set(RENAMED_RESULT_COLUMNS.values()) | set(RecordHead.model_fields) | REPEATED
    ]
    assert list(ResultRecord.model_fields) == [*RecordHead.model_fields, *published, "job_id", "finished_at"]
    assert {"evidence"} == SQL_ONLY  # per-step detail (scores, cosines): nested, no flat column holds it
    assert set(FROM_JOB) | set(RENAMED_RESULT_COLUMNS) <= set(ResultRecord.model_fields)
    assert RESULT_SCHEMA.names == list(ResultRecord.model_fields)
    public = [("model_id", pa.string()), ("neuronx_cc", pa.string()), ("library", pa.string()),
              ("library_version", pa.string()), ("neuron_cores", pa.int32()), ("result", pa.string())]  # fmt: skip
    assert [(f.name, f.type) for f in RESULT_SCHEMA][:6] == public
    # the API publishes the same shape
    schema = app.openapi()["components"]["schemas"]["ResultRecord"]["properties"]
    assert list(schema) == list(ResultRecord.model_fields)


def test_the_type_stubs_match_the_classes_built_at_run_time() -> None:
    """The row's columns and the record are built from the parts when imported; a type checker reads their fields
    in checked-in stubs, which must say what the classes are now."""
    stale = [str(path.relative_to(ROOT)) for path, render in STUBS.items() if path.read_text() != render()]
    assert stale == [], f"{stale} differ from the fields: run python -m shared.results.type_stubs"


def _sample(name: str, shape: FieldShape) -> Any:
    """A value of this shape that no other field gets: a field read from the wrong column shows."""
    n = ROW.index(name) + 3
    if isinstance(shape.kind, type) and issubclass(shape.kind, StrEnum):
        return list(shape.kind)[n % len(shape.kind)]
    samples = {bool: n % 2 == 0, int: n * 1000 + 7, float: n + 0.25, list: [n, n + 1], dict: {"n": n}}
    if shape.kind is str:
        return f"{name}-{n}"[: shape.max_length or 100]
    return samples[shape.kind]


def test_every_field_goes_through_sql_the_record_and_parquet_unchanged(session: Session) -> None:
    """A report with every field set, finished as a worker finishes it: the row, the record and the Parquet
    file hold each value under its name (cores and verdict under the public dataset's)."""
    values = {f.name: _sample(f.name, shape_of(f.info)) for f in row_fields()}
    values |= {"signature_id": "feedc0de", "cores": 2}
    versions = {n: values.pop(n) for n in RuntimeVersions.model_fields}
    runtime = RuntimeInfo(backend="cpu", compiler_name="c", **versions)
    model = ResolvedModel(model_id="org/every-field", sha="a" * 40, gated=False, pipeline_tag=None)
    [sub] = submit(session, model, None, [runtime], cores=2)
    session.flush()
    acquire_lease(session, sub.job.id, "w", Settings(), Stage.accelerator)
    report = report_of(model_id=model.model_id, task="text-generation", backend="cpu", verdict=Verdict.FAIL,
                          runtime=runtime, **values)  # fmt: skip
    assert finish(session, sub.job.id, "w", report)
    session.commit()
    row = session.get(Result, 1)
    assert row is not None
    for name, value in {**values, **versions}.items():
        assert getattr(row, name) == value, name
    [record] = query_results(session, model_id=model.model_id).records
    assert (
        record.result == Verdict.FAIL and record.neuron_cores == 2 and record.neuronx_cc == versions["compiler_version"]
    )
    for name, value in {**values, **versions}.items():
        if name not in SQL_ONLY | set(RENAMED_RESULT_COLUMNS.values()) | REPEATED:
            assert getattr(record, name) == value, name
    table = pq.read_table(io.BytesIO(to_parquet_bytes([record])))
    assert table.to_pylist() == [
        {k: v.value if isinstance(v, StrEnum) else v for k, v in record.model_dump().items()}
        | {"finished_at": record.finished_at.astimezone(dt.UTC)}
    ]
    assert row.error_class in ErrorClass  # enums stay enums in SQL


def published_columns() -> list[list[str]]:
    """The published record's columns, each its name and Parquet type: what a dataset reader depends on."""
    return [[field.name, str(field.type)] for field in RESULT_SCHEMA]


def test_a_change_of_the_published_columns_raises_the_schema_version() -> None:
    """A new row field is one edit (its part in shared/contracts/report.py) and a migration — and the published
    schema's version: the columns as they were at ``SCHEMA_VERSION`` are pinned in tests/data/record_schema.json, and
    a column added, removed, renamed or retyped under the same version fails here."""
    pinned = json.loads(PINNED_SCHEMA.read_text())
    assert pinned["schema_version"] == SCHEMA_VERSION, (
        f"SCHEMA_VERSION is {SCHEMA_VERSION}, the pinned columns are version {pinned['schema_version']}'s: pin them "
        f"anew ({PIN})"
    )
    now, then = published_columns(), pinned["columns"]
    changed = [c for c in now if c not in then] + [c for c in then if c not in now]
    assert now == then, (
        f"the published columns changed under SCHEMA_VERSION {SCHEMA_VERSION} ({changed[:6]}; or their order): raise "
        f"it in shared/results/records.py, say why beside it, and run {PIN}"
    )


if __name__ == "__main__":  # pin the published columns at the current SCHEMA_VERSION
    columns = ",\n".join(json.dumps(column) for column in published_columns())  # a column a line: a diff reads
    PINNED_SCHEMA.write_text(f'{{"schema_version": {SCHEMA_VERSION}, "columns": [\n{columns}\n]}}\n')
    print(f"{PINNED_SCHEMA}: {len(published_columns())} columns at schema version {SCHEMA_VERSION}", file=sys.stderr)

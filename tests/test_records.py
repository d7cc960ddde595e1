"""One list of result fields: the SQL columns, what the runner reports, and the published record agree."""

from __future__ import annotations

import pyarrow as pa

from shared.contracts import RunReport
from shared.db.models import Job, Result
from shared.results.records import FROM_JOB, RENAMED_RESULT_COLUMNS, RESULT_SCHEMA, ResultRecord

RESULT_COLUMNS = {c.key for c in Result.__table__.columns} - {"id", "job_id", "created_at"}
# Result columns the flat record leaves out, and why.
NOT_PUBLISHED = {"evidence"}  # per-step detail (scores, cosines): nested, no flat column holds it


def test_every_result_column_is_reported_by_the_runner_and_every_report_field_is_kept() -> None:
    reported = set(RunReport.model_fields)
    assert sorted(RESULT_COLUMNS - reported) == [], "result columns no report fills"
    # A report field without a result column must be one the job holds: the identity the report repeats.
    job_columns = {c.key for c in Job.__table__.columns}
    assert sorted(reported - RESULT_COLUMNS - job_columns) == [], "report fields kept nowhere"


def test_every_result_column_is_published_under_its_name_or_a_named_rename() -> None:
    published = set(ResultRecord.model_fields) | set(FROM_JOB.values()) | set(RENAMED_RESULT_COLUMNS.values())
    assert sorted(RESULT_COLUMNS - published - NOT_PUBLISHED) == [], "result columns missing from ResultRecord"
    assert set(FROM_JOB) | set(RENAMED_RESULT_COLUMNS) <= set(ResultRecord.model_fields)


def test_the_parquet_schema_is_the_record_in_field_order_with_the_public_columns_first() -> None:
    assert RESULT_SCHEMA.names == list(ResultRecord.model_fields)
    public = [("model_id", pa.string()), ("neuronx_cc", pa.string()), ("library", pa.string()),
              ("library_version", pa.string()), ("neuron_cores", pa.int32()), ("result", pa.string())]  # fmt: skip
    assert [(f.name, f.type) for f in RESULT_SCHEMA][:6] == public

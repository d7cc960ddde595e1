"""Results as flat records: one shape for the API (JSON, CSV, Parquet) and the dataset export.

The first six columns are the public dataset's (aws-neuron/torch-neuronx-model-support), with its names;
ours follow. ``result`` holds the Verdict string (PASS / FAIL / ERROR / SKIPPED).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.db.models import Job, Result
from shared.enums import Verdict

SCHEMA_VERSION = 1

RESULT_SCHEMA = pa.schema(
    [
        ("model_id", pa.string()),
        ("neuronx_cc", pa.string()),  # the compiler version that ran: neuronx-cc's, or inductor-<torch>
        ("library", pa.string()),
        ("library_version", pa.string()),
        ("neuron_cores", pa.int32()),
        ("result", pa.string()),
        ("schema_version", pa.int32()),
        ("revision", pa.string()),
        ("task", pa.string()),
        ("backend", pa.string()),
        ("compiler", pa.string()),
        ("error_class", pa.string()),
        ("error_message", pa.string()),
        ("wall_s", pa.float64()),
        ("load_s", pa.float64()),
        ("compile_s", pa.float64()),
        ("generate_s", pa.float64()),
        ("peak_memory_bytes", pa.int64()),
        ("first_divergence", pa.int32()),
        ("verdict_reason", pa.string()),
        ("compile_cache", pa.string()),
        ("reference_reused", pa.bool_()),
        ("parallelism", pa.string()),
        ("tokens_match", pa.bool_()),
        ("prefill_rel_error", pa.float64()),
        ("accelerator_loglik", pa.float64()),
        ("reference_loglik", pa.float64()),
        ("similarity", pa.float64()),
        ("judge_kind", pa.string()),
        ("judge_model", pa.string()),
        ("judge_prompt_hash", pa.string()),
        ("judge_answer", pa.string()),
        ("judge_rationale", pa.string()),
        ("generated_text", pa.string()),
        ("reference_text", pa.string()),
        ("generated_token_ids", pa.list_(pa.int64())),
        ("reference_token_ids", pa.list_(pa.int64())),
        ("host", pa.string()),
        ("core_range", pa.string()),
        ("visible_cores", pa.string()),
        ("torch_version", pa.string()),
        ("reproduce", pa.string()),
        ("job_id", pa.int64()),
        ("finished_at", pa.timestamp("us", tz="UTC")),
    ]
)
COLUMNS = RESULT_SCHEMA.names
EVIDENCE_COLUMNS = COLUMNS[COLUMNS.index("verdict_reason") : COLUMNS.index("judge_rationale") + 1]


def record(result: Result, job: Job) -> dict[str, Any]:
    return {
        "model_id": job.model_id,
        "neuronx_cc": job.compiler_version,
        "library": job.library,
        "library_version": job.library_version,
        "neuron_cores": result.cores,
        "result": result.verdict.value,
        "schema_version": SCHEMA_VERSION,
        "revision": job.sha,
        "task": job.task,
        "backend": job.backend,
        "compiler": job.compiler_name,
        "error_class": result.error_class.value if result.error_class else None,
        "error_message": result.error_message,
        "wall_s": result.wall_s,
        "load_s": result.load_s,
        "compile_s": result.compile_s,
        "generate_s": result.generate_s,
        "peak_memory_bytes": result.peak_memory_bytes,
        "first_divergence": result.first_divergence,
        **{key: getattr(result, key) for key in EVIDENCE_COLUMNS},
        "generated_text": result.generated_text,
        "reference_text": result.reference_text,
        "generated_token_ids": result.generated_token_ids,
        "reference_token_ids": result.reference_token_ids,
        "host": result.host,
        "core_range": result.core_range,
        "visible_cores": result.visible_cores,
        "torch_version": result.torch_version,
        "reproduce": result.reproduce,
        "job_id": job.id,
        "finished_at": job.finished_at or result.created_at,
    }


def query_results(
    session: Session,
    *,
    model_id: str | None = None,
    compiler: str | None = None,
    library_version: str | None = None,
    verdict: Verdict | None = None,
    before_id: int | None = None,
    limit: int | None = None,
    job_ids: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Newest first, or in the order of ``job_ids`` when given; ``before_id`` is the cursor (the last job id of
    the previous page)."""
    stmt = sa.select(Result, Job).join(Job, Result.job_id == Job.id).order_by(Job.id.desc())
    if model_id is not None:
        stmt = stmt.where(Job.model_id == model_id)
    if compiler is not None:
        stmt = stmt.where(Job.compiler_version == compiler)
    if library_version is not None:
        stmt = stmt.where(Job.library_version == library_version)
    if verdict is not None:
        stmt = stmt.where(Result.verdict == verdict)
    if before_id is not None:
        stmt = stmt.where(Job.id < before_id)
    if job_ids is not None:
        stmt = stmt.where(Job.id.in_(job_ids))
    if limit is not None and job_ids is None:
        stmt = stmt.limit(limit)
    rows = [record(r, j) for r, j in session.execute(stmt).all()]
    if job_ids is not None:
        order = {job_id: i for i, job_id in enumerate(job_ids)}
        rows = sorted(rows, key=lambda r: order[r["job_id"]])[:limit]
    return rows


def to_table(records: Sequence[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(list(records), schema=RESULT_SCHEMA)


def to_parquet_bytes(records: Sequence[dict[str, Any]]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(to_table(records), sink)
    return sink.getvalue()


def to_csv(records: Sequence[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS)
    writer.writeheader()
    for rec in records:
        writer.writerow({k: _csv_cell(v) for k, v in rec.items()})
    return out.getvalue()


def _csv_cell(value: Any) -> Any:
    if isinstance(value, list):
        return json.dumps(value)
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return value

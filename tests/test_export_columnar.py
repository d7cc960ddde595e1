"""The full export on PostgreSQL reads its files through ADBC's columnar driver, straight into Arrow; on SQLite
from the session's rows. The same rows make the same files either way."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import Verdict
from shared.db.models import Job, Result
from shared.results import export
from shared.results.records import COLUMNS, RESULT_SCHEMA, table_from_rows
from tests.conftest import fresh_database
from tests.history import record, runtime

A, B, C = runtime("2.21.0+x", "5.24.0"), runtime("2.21.0+x", "5.25.0"), runtime("2.22.0+y", "5.25.0")
FINISHED = dt.datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=dt.UTC)


def plant(session: Session) -> None:
    """Rows that take every way through the conversion: three files, a FLAKY cell, an error, token ids and float
    lists, an empty list, JSON's null beside SQL's NULL, times to the microsecond."""
    for i in range(12):
        record(session, f"org/model-{i:02d}", (A, B, C)[i % 3], (Verdict.PASS, Verdict.FAIL, Verdict.ERROR)[i % 3])
    record(session, "org/model-00", A, Verdict.FAIL, force=True)  # a rerun that disagrees: FLAKY
    record(session, "org/model-04", B, Verdict.PASS, sha="c" * 40)  # a new commit starts the cell afresh
    lists: list[dict[str, Any]] = [
        {"generated_token_ids": [791, 6722, 374], "reference_token_ids": [791, 6722, 13]},
        {"long_agreement": [1.0, 0.5, 1e-05], "long_loglik_drop": [-0.25, 3.5e3], "generated_token_ids": []},
        {"long_agreement": [], "reference_token_ids": [0]},
    ]
    ids = sorted(session.scalars(sa.select(Job.id)))
    for job_id in ids:
        when = FINISHED + dt.timedelta(minutes=job_id, microseconds=job_id)
        session.execute(sa.update(Job).where(Job.id == job_id).values(finished_at=when))
    for job_id, values in zip(ids, lists, strict=False):
        session.execute(sa.update(Result).where(Result.job_id == job_id).values(values))
    session.commit()


def exported(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[type, dict[str, pa.Table]]:
    """The reader the export picks for a database of ``kind`` holding the planted rows, and the files it writes."""
    with fresh_database(kind, tmp_path / kind) as engine, Session(engine, expire_on_commit=False) as session:
        plant(session)
        with export.file_tables(session) as files:
            reader = type(files)
        if kind == "postgresql":  # no file of a full export is read a row at a time
            with monkeypatch.context() as patched:
                patched.setattr(export, "key_cells", lambda *_: pytest.fail("a PostgreSQL file read row by row"))
                summary = export.export_results(session, tmp_path / kind / "export")
        else:
            summary = export.export_results(session, tmp_path / kind / "export")
    return reader, {path.name: pq.read_table(path) for path in summary.written}


def test_the_postgresql_export_reads_through_adbc_into_the_tables_the_sqlite_path_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sqlite").mkdir()
    rows_reader, by_rows = exported("sqlite", tmp_path, monkeypatch)
    columnar_reader, by_columns = exported("postgresql", tmp_path, monkeypatch)
    assert rows_reader is export.FileTables and columnar_reader is export.ColumnarFileTables
    assert sorted(by_columns) == sorted(by_rows) and len(by_rows) == 3
    for name, table in by_rows.items():
        assert by_columns[name].schema.equals(table.schema), name
        assert by_columns[name].equals(table), name
    flaky = by_columns[export.file_name("transformers", A.stack())]
    assert flaky.column("result").to_pylist()[0] == "FLAKY"


def test_a_file_the_export_after_a_job_cannot_patch_is_read_through_adbc_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``export_jobs`` writes a new file (a compiler version's first result) whole, through the same reader."""
    new = runtime("2.23.0+z", "5.25.0")
    key = export.ExportKey.of(new.stack())
    with fresh_database("postgresql", tmp_path) as engine, Session(engine, expire_on_commit=False) as session:
        plant(session)
        export.export_results(session, tmp_path / "export")
        job = record(session, "org/model-01", new, Verdict.PASS)
        by_rows = export._table(export.key_cells(session, key))
        monkeypatch.setattr(export, "key_cells", lambda *_: pytest.fail("a PostgreSQL file read row by row"))
        summary = export.export_jobs(session, tmp_path / "export", [job])
    assert [p.name for p in summary.written] == [key.file_name]
    assert pq.read_table(summary.written[0]).equals(by_rows) and by_rows.num_rows == 1


@pytest.mark.parametrize("column", ["generated_token_ids", "long_agreement"])  # lists of int, of float
def test_json_number_lists_parse_as_the_rows_json_is_parsed(column: str) -> None:
    text = [None, "null", "[]", "[ ]", "[1, 2, 3]", "[1,2]", " [ 5 ] ", "[-7]", "[0]"]
    if column == "long_agreement":
        text += ["[0.5, 1e-05, -2.25E3]", "[1.0]"]
    by_rows = table_from_rows([[value if name == column else None for name in COLUMNS] for value in text])[column]
    arrow = RESULT_SCHEMA.field(column).type
    assert export._number_lists(pa.chunked_array([pa.array(text, pa.string())]), arrow).equals(by_rows.combine_chunks())
    with pytest.raises(pa.ArrowInvalid):  # not a list of numbers: loud
        export._number_lists(pa.chunked_array([pa.array(['["a"]'])]), arrow)

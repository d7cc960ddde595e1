"""The collector's Parquet export: the public dataset's columns, the seed query, atomic and lazy writes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
from sqlalchemy.orm import Session

from shared.contracts.enums import Verdict
from shared.results.export import export_jobs, export_results, file_name
from shared.results.records import COLUMNS, RESULT_SCHEMA, SCHEMA_VERSION
from tests.history import record, runtime

PUBLIC = ["model_id", "neuronx_cc", "library", "library_version", "neuron_cores", "result"]


def test_one_file_per_compiler_and_library_version_read_by_the_seed_query(session: Session, tmp_path: Path) -> None:
    a, b = runtime("2.21.33363.0+6dfecc895", "5.24.0"), runtime("2.22.1.0+abc", "5.24.0")
    record(session, "Qwen/Qwen3-0.6B", a, Verdict.PASS)
    record(session, "Qwen/Qwen3-0.6B", b, Verdict.ERROR)
    record(session, "meta-llama/Llama-3.2-1B", a, Verdict.FAIL)
    summary = export_results(session, tmp_path / "export")
    names = sorted(p.name for p in summary.written)
    assert names == [
        f"2.21.33363.0+6dfecc895--transformers-5.24.0--stack-{a.stack().digest}.parquet",
        f"2.22.1.0+abc--transformers-5.24.0--stack-{b.stack().digest}.parquet",
    ]
    assert names == sorted(file_name("transformers", rt.stack()) for rt in (a, b))

    df = pd.read_parquet(f"{tmp_path / 'export'}/data")
    assert list(df.columns) == COLUMNS and COLUMNS[:6] == PUBLIC
    seed = df[df.model_id == "Qwen/Qwen3-0.6B"][["neuronx_cc", "library", "library_version", "neuron_cores", "result"]]
    assert sorted(seed.itertuples(index=False, name=None)) == [
        ("2.21.33363.0+6dfecc895", "transformers", "5.24.0", 2, "PASS"),
        ("2.22.1.0+abc", "transformers", "5.24.0", 2, "ERROR"),
    ]


def test_files_are_rewritten_only_when_their_rows_change(session: Session, tmp_path: Path) -> None:
    a, b = runtime("2.21.0+x", "5.24.0"), runtime("2.21.0+x", "5.25.0")
    record(session, "org/one", a, Verdict.PASS)
    record(session, "org/two", b, Verdict.PASS)
    export = tmp_path / "export"
    first = export_results(session, export)
    stamps = {p: p.stat().st_mtime_ns for p in first.written}

    second = export_results(session, export)
    assert second.written == [] and sorted(second.unchanged) == sorted(first.written)
    assert {p: p.stat().st_mtime_ns for p in second.unchanged} == stamps

    record(session, "org/one", a, Verdict.FAIL, force=True)  # a rerun of the same commit that disagrees
    third = export_results(session, export)
    [changed] = third.written
    assert changed.name.startswith("2.21.0+x--transformers-5.24.0")
    assert pd.read_parquet(changed).result.tolist() == ["FLAKY"]
    record(session, "org/one", a, Verdict.FAIL, sha="c" * 40)  # a new commit starts the cell afresh
    [fresh] = export_results(session, export).written
    assert pd.read_parquet(fresh).result.tolist() == ["FAIL"]
    assert sorted(p.name for p in (export / "data").iterdir()) == sorted(p.name for p in first.written)


def test_files_of_an_older_schema_are_all_rebuilt_by_the_next_export(session: Session, tmp_path: Path) -> None:
    """A new schema version (a column added) rewrites every file at the next export, not only the one a job
    touched: a reader of the directory never meets two schemas."""
    a, b = runtime("2.21.0+x", "5.24.0"), runtime("2.22.0+y", "5.24.0")
    record(session, "org/one", a, Verdict.PASS)
    record(session, "org/two", b, Verdict.PASS)
    export = tmp_path / "export"
    export_results(session, export)
    files = sorted((export / "data").iterdir())
    for path in files:  # as a collector of the previous schema left them
        pq.write_table(pq.read_table(path).drop_columns(["verdict_reason"]), path)
    covered = (export / ".exported").read_text().split()[0]
    (export / ".exported").write_text(f"{covered} {SCHEMA_VERSION - 1}")
    job = record(session, "org/one", a, Verdict.FAIL, sha="d" * 40)
    summary = export_jobs(session, export, [job])
    assert sorted(summary.written) == files
    assert all(pq.read_schema(path).equals(RESULT_SCHEMA) for path in files)
    assert (export / ".exported").read_text().endswith(f" {SCHEMA_VERSION}")

"""The collector's export: Parquet files readers of the public dataset can load unchanged.

One file per (compiler version, library, library version) under ``<export dir>/data/``, holding one row
per (model, task) for that combination: its newest run, with the cell's status as ``result``. A file is
replaced atomically (temp + rename) and only when its rows changed, so readers never see half a file and
unchanged files keep their mtime.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
from sqlalchemy.orm import Session

from shared.results.cells import cell_status
from shared.results.records import ResultRecord, query_results, to_table


@dataclass
class ExportSummary:
    data_dir: Path
    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)


def file_name(compiler_version: str, library: str, library_version: str) -> str:
    def safe(part: str) -> str:
        return re.sub(r"[^A-Za-z0-9.+_-]", "_", part)

    return f"{safe(compiler_version)}--{safe(library)}-{safe(library_version)}.parquet"


def latest_per_cell(records: list[ResultRecord]) -> dict[str, list[ResultRecord]]:
    """Group newest-first records by file; one row per (model, task): the newest run, whose ``result``
    is the cell's status over all runs of that commit (FLAKY when they disagree)."""
    files: dict[str, dict[tuple[str, str], list[ResultRecord]]] = {}
    for rec in records:
        name = file_name(rec.neuronx_cc, rec.library, rec.library_version)
        files.setdefault(name, {}).setdefault((rec.model_id, rec.task), []).append(rec)
    out = {}
    for name, groups in files.items():
        rows = []
        for runs in groups.values():
            newest = runs[0]
            verdicts = [r.result for r in runs if r.revision == newest.revision]
            rows.append(newest.model_copy(update={"result": cell_status(verdicts)}))
        out[name] = sorted(rows, key=lambda r: (r.model_id, r.task))
    return out


def export_results(session: Session, export_dir: Path) -> ExportSummary:
    data_dir = export_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    summary = ExportSummary(data_dir=data_dir)
    for name, rows in sorted(latest_per_cell(query_results(session)).items()):
        path = data_dir / name
        table = to_table(rows)
        if path.exists() and pq.read_table(path).equals(table, check_metadata=False):
            summary.unchanged.append(path)
            continue
        # A leading dot keeps the temp file out of pd.read_parquet(data_dir) while it is written.
        tmp = data_dir / f".{name}.{os.getpid()}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, path)
        summary.written.append(path)
    return summary

"""Which readers of a live export directory see a torn Parquet file, while the collector's writer replaces it.

    .venv/bin/python bench/torn_reads.py [--seconds 10]

One file is replaced as fast as the export replaces its files (``shared.results.export.replace_atomically``: a temp
file of its own, synced, renamed over the old one), with a different row count each time, while one thread per
reader reads it whole again and again. A read is torn when the reader fails or returns a row count no version had.
A reader that takes a file's footer and its pages from one open reads one version (the old file's inode stays
readable until it is closed, whatever replaces its name); one that opens the path again after reading the footer
(pyarrow's and pandas' reads of a path open it twice, DuckDB's four times, as strace shows) can pair one version's
footer with the next one's pages. (`datasets` opens it twice too, but its second open reads footer and pages
itself.) All readers run in the same run, against the same writer, so their counts compare.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import datasets  # noqa: E402
import duckdb  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from shared.results.export import replace_atomically  # noqa: E402

VERSIONS = [1000 + 37 * i for i in range(50)]  # row counts: every version a reader can see


def version(rows: int) -> pa.Table:
    return pa.table({"job_id": list(range(rows)), "model_id": [f"org/model-{i % 97}" for i in range(rows)]})


def once(path: Path, read: Callable[[Any], Any]) -> Any:
    with path.open("rb") as file:
        return read(file)


READERS: dict[str, tuple[bool, Callable[[Path], Any]]] = {  # name: (footer and pages from one open, read)
    "pq.ParquetFile(path)": (True, lambda p: pq.ParquetFile(p).read()),
    "pq.read_table(open file)": (True, lambda p: once(p, pq.read_table)),
    "pd.read_parquet(open file)": (True, lambda p: once(p, pd.read_parquet)),
    "duckdb read_parquet(open file)": (True, lambda p: once(p, lambda f: duckdb.connect().read_parquet(f).fetchall())),
    "datasets Dataset.from_parquet(path)": (True, lambda p: datasets.Dataset.from_parquet(str(p), keep_in_memory=True)),
    "pq.read_table(path)": (False, lambda p: pq.read_table(p)),
    "pd.read_parquet(path)": (False, lambda p: pd.read_parquet(p)),
    "duckdb read_parquet(path)": (
        False,
        lambda p: duckdb.connect().sql(f"select * from read_parquet('{p}')").fetchall(),
    ),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()
    work = Path(tempfile.mkdtemp(prefix="torn-reads-"))
    datasets.config.HF_DATASETS_CACHE = work / "datasets-cache"
    path, tables = work / "results.parquet", {rows: version(rows) for rows in VERSIONS}
    replace_atomically(path, lambda file: pq.write_table(tables[VERSIONS[0]], file))
    stop, reads, torn, example = threading.Event(), Counter[str](), Counter[str](), dict[str, str]()

    def read_continuously(name: str) -> None:
        read = READERS[name][1]
        while not stop.is_set():
            try:
                rows = len(read(path))
            except Exception as error:  # a torn file shows as any error of the reader's
                torn[name] += 1
                example.setdefault(name, f"{error.__class__.__name__}: {str(error)[:70]}")
            else:
                if rows not in tables:
                    torn[name] += 1
                    example.setdefault(name, f"{rows} rows")
            reads[name] += 1

    threads = [threading.Thread(target=read_continuously, args=(name,)) for name in READERS]
    for thread in threads:
        thread.start()
    writes, deadline = 0, time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        table = tables[VERSIONS[writes % len(VERSIONS)]]
        replace_atomically(path, lambda file, table=table: pq.write_table(table, file))
        writes += 1
    stop.set()
    for thread in threads:
        thread.join()
    print(f"{writes} replacements in {args.seconds:g} s, {len(READERS)} readers at once\n")
    print("| reader | footer and pages from one open | reads | torn | first torn read |\n|---|---|---:|---:|---|")
    for name, (single, _) in READERS.items():
        print(f"| {name} | {'yes' if single else 'no'} | {reads[name]} | {torn[name]} | {example.get(name, '')} |")


if __name__ == "__main__":
    main()

"""What one Prometheus scrape of the API costs over 1 M result rows in PostgreSQL, per metric family.

    .venv/bin/python bench/metrics_scrape.py [--rows 1000000] [--repeat 5] [--postgres URL]

In a scratch schema (dropped at the end) it migrates to head, bulk-inserts the rows server-side
(``testing.bulk_rows``: 1 M finished jobs, each with its result, plus 3 000 queued, running and judging jobs, 256
workers on 4 hosts, a sweep per round with its ranked views), VACUUM ANALYZEs, then times each family's
query and a whole scrape (``generate_latest``): the median of ``--repeat`` runs after one warm-up run. It does it
twice: without the metrics indexes (migration 0009 added them; dropped here first), then with them as migrated,
so both figures come from one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FAMILIES = (
    "jobs",
    "queues",
    "results",
    "durations",
    "compile_durations",
    "slowest",
    "throughput",
    "deliveries",
    "hosts",
    "sweeps",
)

# The indexes (migration 0009) that turn each scan into an index-only scan (or a partial index of a few rows).
METRICS_INDEXES = {
    "ix_results_metrics": "CREATE INDEX ix_results_metrics ON results (compiler_version, verdict, error_class, "
    "compile_cache)",
    "ix_results_compile_s": "CREATE INDEX ix_results_compile_s ON results (compiler_version, compile_s) "
    "WHERE compile_s IS NOT NULL",
    "ix_results_wall_s": "CREATE INDEX ix_results_wall_s ON results (wall_s) WHERE wall_s IS NOT NULL",
    "ix_jobs_stage_times": "CREATE INDEX ix_jobs_stage_times ON jobs (compiler_version, started_at, judging_at, "
    "finished_at) WHERE state IN ('judging', 'done', 'failed') AND started_at IS NOT NULL",
    "ix_jobs_redelivered": "CREATE INDEX ix_jobs_redelivered ON jobs (id) "
    "WHERE attempts > 1 OR verdict_attempts > 1 OR enqueued_at IS NOT NULL",
}


def timed(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm: the statement cache, the connection pool
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(collector: Any, sessions: Callable[[], Any], settings: Any, repeat: int) -> dict[str, float]:
    from prometheus_client import CollectorRegistry, generate_latest

    from shared.db.models import utcnow

    def family(name: str) -> Callable[[], None]:
        method = getattr(collector, name)

        def run() -> None:
            with sessions() as session:
                args: dict[str, Any] = {}
                if name in ("queues", "hosts", "results"):
                    args["now"] = utcnow()
                if name in ("hosts", "results"):
                    args["settings"] = settings
                if name in ("durations", "compile_durations"):
                    args["dialect"] = "postgresql"
                list(method(session, **args))

        return run

    out = {name: timed(family(name), repeat) for name in FAMILIES}
    registry = CollectorRegistry()
    registry.register(collector)
    out["whole scrape"] = timed(lambda: generate_latest(registry), repeat)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--postgres",
        default=os.environ.get("SUPPORTMATRIX_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    )
    args = parser.parse_args()

    from sqlalchemy.orm import Session

    from services.api.metrics import StateCollector
    from shared.db.engine import make_engine
    from shared.settings import Settings
    from testing.bulk_rows import analyze, scratch_history

    with scratch_history(args.postgres, args.rows, "bench_metrics") as scratch, scratch.connect() as conn:
        print(f"inserted {args.rows:,} results (+ their jobs) in {scratch.fill_s:.0f} s")
        engine = make_engine(scratch.url)
        try:
            settings = Settings(worker_stale_s=60)
            sessions = lambda: Session(engine)  # noqa: E731
            collector = StateCollector(settings, sessions)
            for name in METRICS_INDEXES:
                conn.execute(f"DROP INDEX {name}")
            analyze(conn)
            without = measure(collector, sessions, settings, args.repeat)
            for statement in METRICS_INDEXES.values():
                conn.execute(statement)
            analyze(conn)
            indexed = measure(collector, sessions, settings, args.repeat)
        finally:
            engine.dispose()
    print(f"\nscrape cost over {args.rows:,} result rows (median of {args.repeat}, ms)")
    print(f"{'family':<20} {'without its indexes':>20} {'as migrated':>12}")
    for name in (*FAMILIES, "whole scrape"):
        print(f"{name:<20} {without[name] * 1000:>20.1f} {indexed[name] * 1000:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

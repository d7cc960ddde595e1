"""What one Prometheus scrape of the API costs over 1 M result rows in PostgreSQL, per metric family.

    .venv/bin/python bench/metrics_scrape.py [--rows 1000000] [--repeat 5] [--postgres URL]

In a scratch schema (dropped at the end) it migrates to head, bulk-inserts the rows server-side
(``INSERT … SELECT … FROM generate_series``: 1 M finished jobs, each with its result, plus 3 000 queued, running
and judging jobs, 256 workers on 4 hosts, 100 sweeps of 200 entries), VACUUM ANALYZEs, then times each family's
query and a whole scrape (``generate_latest``): the median of ``--repeat`` runs after one warm-up run. It does it
twice: on the schema as migrated, then with the indexes the README proposes, so both figures come from one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FAMILIES = ("jobs", "queues", "results", "durations", "compile_durations", "slowest", "deliveries", "hosts", "sweeps")

# The indexes that turn each scan into an index-only scan (or a partial index of a few rows).
PROPOSED = {
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


def populate(conn: Any, rows: int) -> None:
    active = 3000
    total = rows + active
    conn.execute(
        """
        INSERT INTO jobs (id, model_id, sha, task, config_hash, gated, trust_remote_code, cores, queue, state,
                          attempts, verdict_attempts, verdict_queue, attempt_log, lease_owner, enqueued_at,
                          created_at, started_at, judging_at, finished_at,
                          library, library_version, torch_version, backend, compiler_name, compiler_version)
        SELECT g, 'org/model-' || g, repeat('a', 40), 'text-generation', '', false, false, 1,
               'supportmatrix.jobs.neuron.2.' || (g %% 4) || '.c1', s.state,
               CASE WHEN s.state = 'queued' THEN 0 WHEN g %% 50 = 0 THEN 2 ELSE 1 END,
               CASE WHEN s.state IN ('done', 'failed') AND g %% 10 <> 0 THEN 1 ELSE 0 END,
               'supportmatrix.verdict.host-' || (g %% 4), '[]',
               CASE WHEN s.state = 'running' THEN 'cores-' || (g %% 64) || '@host-' || (g %% 4) || ':1' END,
               CASE WHEN g %% 97 = 0 THEN t.created + interval '1 hour' END,
               t.created,
               CASE WHEN s.state <> 'queued' THEN t.created + interval '10 seconds' END,
               CASE WHEN s.state IN ('judging', 'done', 'failed') AND g %% 10 <> 0
                    THEN t.created + make_interval(secs => 10 + (g * 7919) %% 3600) END,
               CASE WHEN s.state IN ('done', 'failed')
                    THEN t.created + make_interval(secs => 10 + (g * 7919) %% 3600 + g %% 300) END,
               'transformers', '5.0', '2.13', 'neuron', 'neuronx-cc', '2.' || (g %% 4)
        FROM generate_series(1::bigint, %(total)s) AS g,
             LATERAL (SELECT now() - make_interval(secs => 2 * (%(total)s - g)) AS created) AS t,
             LATERAL (SELECT CASE WHEN g <= %(rows)s THEN CASE WHEN g %% 10 = 0 THEN 'failed' ELSE 'done' END
                                  WHEN g %% 3 = 0 THEN 'queued' WHEN g %% 3 = 1 THEN 'running'
                                  ELSE 'judging' END AS state) AS s
        """,
        {"rows": rows, "total": total},
    )
    conn.execute(
        """
        INSERT INTO results (job_id, verdict, error_class, cores, wall_s, compile_s, compiler_version, compile_cache,
                             created_at)
        SELECT id,
               CASE WHEN state = 'failed' THEN 'ERROR' WHEN id % 7 = 0 THEN 'FAIL' WHEN id % 13 = 0 THEN 'SKIPPED'
                    ELSE 'PASS' END,
               CASE WHEN state = 'failed' THEN (ARRAY['compile', 'runtime', 'oom', 'timeout', 'load'])[1 + id % 5] END,
               1, (id::bigint * 7919) % 3600, (id::bigint * 31) % 900, compiler_version,
               (ARRAY['hit', 'miss', 'none'])[1 + id % 3], finished_at
        FROM jobs WHERE state IN ('done', 'failed')
        """
    )
    conn.execute(
        """
        INSERT INTO workers (name, host, pid, cores, core_count, queue, started_at, heartbeat_at,
                             library, library_version, torch_version, backend, compiler_name, compiler_version)
        SELECT 'cores-' || c || '@host-' || h, 'host-' || h, 1, c::text, 1,
               'supportmatrix.jobs.neuron.2.' || h || '.c1', now(), now(),
               'transformers', '5.0', '2.13', 'neuron', 'neuronx-cc', '2.' || h
        FROM generate_series(0, 3) AS h, generate_series(0, 63) AS c
        """
    )
    conn.execute(
        "INSERT INTO queues_seen (queue, last_live_at) "
        "SELECT 'supportmatrix.jobs.neuron.2.' || h || '.c1', now() FROM generate_series(0, 3) AS h"
    )
    conn.execute(
        "INSERT INTO sweeps (id, trigger, state, config, created_at, attempts) "
        "SELECT s, 'schedule', CASE WHEN s = 100 THEN 'running' ELSE 'done' END, '{}', now(), 1 "
        "FROM generate_series(1, 100) AS s"
    )
    conn.execute(
        "INSERT INTO sweep_entries (sweep_id, model_id, task, view, rank, job_id, created) "
        "SELECT s, 'org/model-' || (s * 200 + r), 'text-generation', 'trending', r, 1 + (s * 200 + r) %% %(n)s, "
        "true FROM generate_series(1, 100) AS s, generate_series(1, 200) AS r",
        {"n": total},
    )


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

    import psycopg
    from sqlalchemy.orm import Session

    from services.api.metrics import StateCollector
    from shared.db.engine import make_engine
    from shared.db.migrate import upgrade
    from shared.settings import Settings

    admin = args.postgres.replace("postgresql+psycopg", "postgresql")
    schema = f"bench_metrics_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    url = f"{args.postgres}?options=-csearch_path%3D{schema}"
    engine = make_engine(url)
    try:
        upgrade(url)
        started = time.perf_counter()
        with psycopg.connect(admin, autocommit=True, options=f"-csearch_path={schema}") as conn:
            with conn.transaction():
                populate(conn, args.rows)
            conn.execute("VACUUM ANALYZE")
            print(f"inserted {args.rows:,} results (+ their jobs) in {time.perf_counter() - started:.0f} s")
            settings = Settings(worker_stale_s=60)
            sessions = lambda: Session(engine)  # noqa: E731
            collector = StateCollector(settings, sessions)
            as_migrated = measure(collector, sessions, settings, args.repeat)
            for statement in PROPOSED.values():
                conn.execute(statement)
            conn.execute("VACUUM ANALYZE")
            indexed = measure(collector, sessions, settings, args.repeat)
        print(f"\nscrape cost over {args.rows:,} result rows (median of {args.repeat}, ms)")
        print(f"{'family':<20} {'as migrated':>12} {'with proposed indexes':>22}")
        for name in (*FAMILIES, "whole scrape"):
            print(f"{name:<20} {as_migrated[name] * 1000:>12.1f} {indexed[name] * 1000:>22.1f}")
    finally:
        engine.dispose()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prometheus metrics read from SQL at scrape time, labelled with the shared enums."""

from __future__ import annotations

from collections.abc import Iterator

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.db.engine import new_session
from shared.db.models import Job, Result
from shared.enums import JobState, Verdict
from shared.jobs.rules import live_workers
from shared.settings import get_settings


class StateCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("supportmatrix_jobs", "Jobs by state", labels=["state"])
        results = GaugeMetricFamily(
            "supportmatrix_results", "Results by verdict and error class", labels=["verdict", "error_class"]
        )
        workers = GaugeMetricFamily(
            "supportmatrix_live_workers", "Live workers by compiler version", labels=["compiler_version"]
        )
        with new_session() as session:
            counts = dict(session.execute(sa.select(Job.state, sa.func.count()).group_by(Job.state)).all())
            for state in JobState:
                jobs.add_metric([state.value], counts.get(state, 0))
            by_verdict = session.execute(
                sa.select(Result.verdict, Result.error_class, sa.func.count()).group_by(
                    Result.verdict, Result.error_class
                )
            ).all()
            seen = set()
            for verdict, error_class, n in by_verdict:
                seen.add(verdict)
                results.add_metric([verdict.value, error_class.value if error_class else ""], n)
            for verdict in Verdict:
                if verdict not in seen:
                    results.add_metric([verdict.value, ""], 0)
            per_compiler: dict[str, int] = {}
            for w in live_workers(session, get_settings()):
                per_compiler[w.compiler_version] = per_compiler.get(w.compiler_version, 0) + 1
            for version, n in sorted(per_compiler.items()):
                workers.add_metric([version], n)
        yield jobs
        yield results
        yield workers

"""The supportmatrix Grafana dashboard, built with grafana-foundation-sdk (Grafana 11.6, the compose image).

    python deploy/grafana/build_dashboard.py            # writes deploy/grafana/dashboards/supportmatrix.json
    python deploy/grafana/build_dashboard.py --check    # exits 1 when the committed JSON is not this output

Every panel reads the provisioned Prometheus datasource by its fixed uid. tests/test_metrics.py checks that
the committed JSON is this script's output, and runs each panel's PromQL against a real Prometheus that
scraped a stack which ran jobs: each must return data (one over cells of two compiler versions, against a
Prometheus over such cells).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, stat, table, timeseries
from grafana_foundation_sdk.builders.dashboard import Dashboard, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "dashboards" / "supportmatrix.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="supportmatrix-prometheus")  # provisioning/datasources
UID = "supportmatrix"


def query(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> Dataquery:
    q = Dataquery().expr(expr).ref_id(ref).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    return q.instant() if instant else q


def series(title: str, unit: str, *queries: Dataquery, description: str = "", width: int = 12) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).datasource(DATASOURCE).unit(unit).span(width).height(8)
    for q in queries:
        panel = panel.with_target(q)
    return panel.description(description) if description else panel


def build() -> Dashboard:
    queues = Row("Queues")
    throughput = Row("Throughput and verdicts")
    hosts = Row("Hosts")
    durations = Row("Durations")
    return (
        Dashboard("supportmatrix")
        .uid(UID)
        .tags(["supportmatrix"])
        .refresh("30s")
        .time("now-24h", "now")
        .timezone("utc")
        .with_row(queues)
        .with_panel(
            series(
                "Queue depth",
                "short",
                query("supportmatrix_queue_depth", "{{stage}} {{queue}}"),
                description="Jobs waiting per queue, counted in SQL (a Redis LLEN reads 0 while every worker is busy).",
            )
        )
        .with_panel(
            series(
                "Oldest waiting job",
                "s",
                query("supportmatrix_queue_oldest_age_seconds", "{{stage}} {{queue}}"),
                description="Age of the oldest waiting job per queue.",
            )
        )
        .with_panel(series("Jobs by state", "short", query("supportmatrix_jobs", "{{state}}"), width=24))
        .with_row(throughput)
        .with_panel(
            series(
                "Throughput (results per hour)",
                "short",
                query(
                    "sum by (compiler_version) (rate(supportmatrix_verdicts_total[15m])) * 3600",
                    "{{compiler_version}}",
                ),
            )
        )
        .with_panel(
            bargauge.Panel()
            .title("Verdict mix per compiler version")
            .datasource(DATASOURCE)
            .span(12)
            .height(8)
            .with_target(
                query(
                    "sum by (compiler_version, verdict) (supportmatrix_verdicts_total)",
                    "{{compiler_version}} {{verdict}}",
                    instant=True,
                )
            )
        )
        .with_panel(
            table.Panel()
            .title("Error classes per compiler version")
            .datasource(DATASOURCE)
            .span(12)
            .height(8)
            .with_target(
                query(
                    'sum by (compiler_version, error_class) (supportmatrix_verdicts_total{verdict="ERROR"})',
                    instant=True,
                )
            )
        )
        .with_panel(
            stat.Panel()
            .title("Compile-cache hit rate (24 h)")
            .datasource(DATASOURCE)
            .unit("percentunit")
            .span(12)
            .height(8)
            .with_target(
                query(
                    'sum by (compiler_version) (increase(supportmatrix_compile_cache_total{outcome="hit"}[1d])) / '
                    'sum by (compiler_version) (increase(supportmatrix_compile_cache_total{outcome=~"hit|miss"}[1d]))',
                    "{{compiler_version}}",
                )
            )
        )
        .with_row(hosts)
        .with_panel(
            series(
                "Core utilisation",
                "percentunit",
                query(
                    'sum by (host) (supportmatrix_host_cores{state="busy"}) / sum by (host) (supportmatrix_host_cores)',
                    "{{host}}",
                ),
                description="Busy cores over the cores of live core-group workers.",
            )
        )
        .with_panel(
            series(
                "Fragmentation: idle cores and the largest free aligned group",
                "short",
                query('sum by (host) (supportmatrix_host_cores{state="idle"})', "{{host}} idle"),
                query("supportmatrix_host_largest_free_group_cores", "{{host}} largest free group", ref="B"),
                description="A host whose largest free group is far below its idle cores cannot start a large job.",
            )
        )
        .with_panel(
            series(
                "Workers",
                "short",
                query("sum by (host, state) (supportmatrix_workers)", "{{host}} {{state}}"),
                query("supportmatrix_host_heartbeat_age_seconds", "{{host}} heartbeat age (s)", ref="B"),
                width=24,
            )
        )
        .with_row(durations)
        .with_panel(
            series(
                "p95 stage duration",
                "s",
                query(
                    "histogram_quantile(0.95, sum by (le, compiler_version, stage)"
                    " (rate(supportmatrix_job_duration_seconds_bucket[1h])))",
                    "{{stage}} {{compiler_version}}",
                ),
                query("supportmatrix_job_timeout_seconds", "hard limit", ref="B"),
            )
        )
        .with_panel(
            series(
                "p95 compile time",
                "s",
                query(
                    "histogram_quantile(0.95, sum by (le, compiler_version)"
                    " (rate(supportmatrix_compile_duration_seconds_bucket[1h])))",
                    "{{compiler_version}}",
                ),
            )
        )
        .with_panel(
            table.Panel()
            .title("Decode rate against the previous software stack (slowest cells)")
            .description(
                "Per cell (model, task, backend, compiler, cores): its decode rate at batch 1 on its newest software "
                "stack over the same cell's on the stack before; below 0.85 is a slowdown (alert "
                "SupportmatrixCellDecodeSlower), to read in /changes."
            )
            .datasource(DATASOURCE)
            .unit("percentunit")
            .span(12)
            .height(8)
            .with_target(query("bottomk(10, supportmatrix_decode_speed_ratio)", instant=True))
        )
        .with_panel(
            table.Panel()
            .title("Slowest models (wall time)")
            .datasource(DATASOURCE)
            .unit("s")
            .span(12)
            .height(8)
            .with_target(query("topk(10, supportmatrix_slowest_models_wall_seconds)", instant=True))
        )
        .with_panel(
            series(
                "Redeliveries and re-sent jobs",
                "short",
                query("sum by (stage) (increase(supportmatrix_redeliveries_total[1h]))", "redelivered {{stage}}"),
                query("sum by (stage) (supportmatrix_resent_jobs)", "re-sent {{stage}}", ref="B"),
            )
        )
        .with_panel(
            series(
                "API requests",
                "reqps",
                query(
                    "sum by (route, status) (rate(supportmatrix_http_requests_total[5m]))",
                    "{{route}} {{status}}",
                ),
                width=24,
            )
        )
    )


def render() -> str:
    dashboard = build().build()
    return json.dumps(dashboard, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT} is not the output of {Path(__file__).name}: run it", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

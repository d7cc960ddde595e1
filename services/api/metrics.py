"""Prometheus metrics, computed from SQL (a snapshot, retaken every few seconds) and labelled with the shared
enums; and the API's own HTTP metrics.

Why SQL and not the workers' own registries (prometheus_client's multiprocess mode): workers are short-lived
processes the host launcher starts and drains on several hosts, their runners are children that die with
their model, and a multiprocess registry needs a shared directory per host plus the cleanup of dead pids.
Every fact a dashboard needs is already a row — a job's state, queue, stage timestamps and deliveries, a
result's verdict, timings and cache outcome, a worker's heartbeat and cores — so the API reads them and
Prometheus scrapes the API only. A counter here is a count of rows that only grow
(results, deliveries): it is monotonic without any process keeping it.

Each family costs one query of ``shared/jobs/stats.py`` (the host family two, both over small sets);
``bench/metrics_scrape.py`` measures them over 1 M result rows: about a second in all, too much for every scrape.
So a ``Snapshot`` reads and renders them in a background thread of the API process every
SUPPORTMATRIX_METRICS_REFRESH_S seconds and a scrape serves the last rendering, with
``supportmatrix_metrics_snapshot_age_seconds`` saying how old it is (0 = collect at each scrape). Each API process
(uvicorn worker) keeps its own snapshot: several behind one scrape target can serve a row counter one step back
from the scrape before (read as a reset), so run one API process per target, or 0.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy.orm import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.contracts.enums import JobState, Stage, SweepState, Verdict
from shared.cores import CoreGroup
from shared.db.engine import new_session
from shared.db.models import utcnow
from shared.jobs import stats
from shared.jobs.lease import LeaseOwner
from shared.jobs.runtimes import live_since
from shared.jobs.stats import DURATION_BUCKETS
from shared.settings import Settings, get_settings

log = logging.getLogger(__name__)

CACHE_OUTCOMES = ("hit", "miss", "none")
SLOWEST = 10  # rows of the slowest-models gauge
UNMATCHED = "<unmatched>"  # the route label of a request no route matched (bounded cardinality)


class Buckets:
    """Rows of (bucket, count, sum) gathered into one cumulative Prometheus histogram per label set."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0.0] * (len(DURATION_BUCKETS) + 1))
        self.sums: dict[tuple[str, ...], float] = defaultdict(float)

    def add(self, labels: tuple[str, ...], bucket: int | None, n: int, total: Any) -> None:
        if bucket is None:
            return
        self.counts[labels][int(bucket)] += n
        self.sums[labels] += float(total or 0)

    def into(self, family: HistogramMetricFamily) -> HistogramMetricFamily:
        n = len(DURATION_BUCKETS)
        for labels, by_bucket in sorted(self.counts.items()):
            # by_bucket[k]: rows with exactly k bounds >= value; at or below bound j: rows with k >= n - j
            cumulative = [sum(by_bucket[n - j :]) for j in range(n)]
            buckets = [(str(bound), c) for bound, c in zip(DURATION_BUCKETS, cumulative, strict=True)]
            family.add_metric(list(labels), [*buckets, ("+Inf", sum(by_bucket))], self.sums[labels])
        return family


def largest_free_group(free: set[int]) -> int:
    """The size of the largest aligned power-of-two group of cores in ``free`` (0 when none)."""
    size = 1
    while size * 2 <= max(len(free), 1):
        size *= 2
    while size >= 1:
        starts = {core - core % size for core in free}
        if any(all(c in free for c in range(start, start + size)) for start in starts):
            return size
        size //= 2
    return 0


class StateCollector(Collector):
    """Every SQL-derived family, read when Prometheus scrapes."""

    def __init__(
        self,
        settings: Settings | None = None,
        sessions: Callable[[], Session] = new_session,
        clock: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        self._settings = settings
        self._sessions = sessions
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        settings = self._settings or get_settings()
        now = self._clock()
        with self._sessions() as session:
            dialect = session.get_bind().dialect.name
            yield from self.jobs(session)
            yield from self.queues(session, now)
            yield from self.results(session, settings, now)
            yield from self.durations(session, dialect)
            yield from self.compile_durations(session, dialect)
            yield from self.slowest(session)
            yield from self.throughput(session)
            yield from self.deliveries(session)
            yield from self.hosts(session, settings, now)
            yield from self.sweeps(session)
        timeout = GaugeMetricFamily(
            "supportmatrix_job_timeout_seconds", "The hard limit on one runner (SUPPORTMATRIX_JOB_TIMEOUT_S)"
        )
        timeout.add_metric([], settings.job_timeout_s)
        yield timeout

    # --- jobs and queues ------------------------------------------------------------------------------

    def jobs(self, session: Session) -> Iterator[Metric]:
        family = GaugeMetricFamily("supportmatrix_jobs", "Jobs by state", labels=["state"])
        counts = stats.jobs_by_state(session)
        for state in JobState:
            family.add_metric([state.value], counts.get(state, 0))
        yield family

    def queues(self, session: Session, now: dt.datetime) -> Iterator[Metric]:
        """Jobs waiting per queue and the age of the oldest. Every queue a live worker ever served is listed, empty
        ones at 0."""
        depth = GaugeMetricFamily(
            "supportmatrix_queue_depth", "Jobs waiting for a worker, per queue and stage", labels=["queue", "stage"]
        )
        age = GaugeMetricFamily(
            "supportmatrix_queue_oldest_age_seconds",
            "Age of the oldest waiting job per queue (since submission, or since its accelerator stage ended)",
            labels=["queue", "stage"],
        )
        waiting: dict[tuple[str, str], tuple[int, float]] = {}
        seen: set[str] = set()
        for stage, queue, n, oldest in stats.queue_waits(session):
            if not stage:
                seen.add(queue)
                continue
            waiting[(queue, stage)] = (n, max(0.0, (now - oldest).total_seconds()) if oldest else 0.0)
        for queue in seen:
            stage = Stage.verdict.value if queue.startswith("supportmatrix.verdict.") else Stage.accelerator.value
            waiting.setdefault((queue, stage), (0, 0.0))
        for (queue, stage), (n, oldest_s) in sorted(waiting.items()):
            depth.add_metric([queue, stage], n)
            age.add_metric([queue, stage], oldest_s)
        yield depth
        yield age

    # --- results --------------------------------------------------------------------------------------

    def results(self, session: Session, settings: Settings, now: dt.datetime) -> Iterator[Metric]:
        """The verdict mix, the error classes and the compile-cache outcomes per compiler version; every served
        compiler version gets its zero series from the start, so that the first result is an increase Prometheus
        sees."""
        verdicts: dict[tuple[str, str, str], int] = defaultdict(int)
        cache: dict[tuple[str, str], int] = defaultdict(int)
        legacy: dict[tuple[str, str], int] = defaultdict(int)
        for version, verdict, error_class, outcome, n in stats.result_counts(session):
            version = version or ""
            klass = error_class.value if error_class else ""
            verdicts[(version, verdict.value, klass)] += n
            legacy[(verdict.value, klass)] += n
            cache[(version, outcome or "none")] += n
        served = stats.served_compilers(session, now - dt.timedelta(seconds=settings.worker_stale_s))
        for version in {v for v, *_ in verdicts} | served:
            for verdict in Verdict:
                verdicts.setdefault((version, verdict.value, ""), 0)
            for outcome in CACHE_OUTCOMES:
                cache.setdefault((version, outcome), 0)
        for verdict in Verdict:
            legacy.setdefault((verdict.value, ""), 0)

        total = CounterMetricFamily(
            "supportmatrix_verdicts",
            "Results by compiler version, verdict and error class",
            labels=["compiler_version", "verdict", "error_class"],
        )
        for key, n in sorted(verdicts.items()):
            total.add_metric(list(key), n)
        yield total
        outcomes = CounterMetricFamily(
            "supportmatrix_compile_cache",
            "Results by compiler version and compile-cache outcome (hit, miss, none: no persistent cache)",
            labels=["compiler_version", "outcome"],
        )
        for cache_key, n in sorted(cache.items()):
            outcomes.add_metric(list(cache_key), n)
        yield outcomes
        results = GaugeMetricFamily(
            "supportmatrix_results", "Results by verdict and error class", labels=["verdict", "error_class"]
        )
        for legacy_key, n in sorted(legacy.items()):
            results.add_metric(list(legacy_key), n)
        yield results
        last = stats.last_result_at(session)
        if last is not None:
            stamp = GaugeMetricFamily(
                "supportmatrix_last_result_timestamp_seconds", "When the newest result row was written (Unix time)"
            )
            stamp.add_metric([], last.timestamp())
            yield stamp

    def durations(self, session: Session, dialect: str) -> Iterator[Metric]:
        buckets = Buckets()
        for version, a, v, n, a_total, v_total in stats.stage_duration_buckets(session, dialect):
            buckets.add((version, Stage.accelerator.value), a, n, a_total)
            buckets.add((version, Stage.verdict.value), v, n, v_total)
        yield buckets.into(
            HistogramMetricFamily(
                "supportmatrix_job_duration_seconds",
                "Duration of a job's stages (each bounded by SUPPORTMATRIX_JOB_TIMEOUT_S)",
                labels=["compiler_version", "stage"],
            )
        )

    def compile_durations(self, session: Session, dialect: str) -> Iterator[Metric]:
        buckets = Buckets()
        for version, index, n, total in stats.compile_duration_buckets(session, dialect):
            buckets.add((version or "",), index, n, total)
        yield buckets.into(
            HistogramMetricFamily(
                "supportmatrix_compile_duration_seconds",
                "Compile time of the accelerator run (first call minus second)",
                labels=["compiler_version"],
            )
        )

    def slowest(self, session: Session) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "supportmatrix_slowest_models_wall_seconds",
            f"The {SLOWEST} slowest results: wall time (load + compile + generate) by model",
            labels=["model_id", "compiler_version", "cores"],
        )
        for model_id, version, cores, wall_s in stats.slowest_results(session, SLOWEST):
            family.add_metric([model_id, version or "", str(cores)], wall_s)
        yield family

    def throughput(self, session: Session) -> Iterator[Metric]:
        """Each cell's decode rate on its newest software stack against the same cell's on the stack before: one
        series per cell that has rates on two stacks (a cell of one stack has nothing to compare and no series), so
        that a slowdown is a cell's, never a change of model mix, and two stacks are never averaged together."""
        ratio = GaugeMetricFamily(
            "supportmatrix_decode_speed_ratio",
            "A cell's decode rate on its newest software stack over its rate on the stack before (1: as fast)",
            labels=[*stats.CELL_LABELS, "compiler_version", "previous_compiler_version", "stack", "previous_stack"],
        )
        for cell in stats.cell_speeds(session):
            newest, previous = cell.newest, cell.previous
            if previous is not None:
                ratio.add_metric(
                    [*cell.labels, newest.stack.compiler_version, previous.stack.compiler_version,
                     newest.stack.label(), previous.stack.label()],
                    newest.tokens_per_s / previous.tokens_per_s,
                )  # fmt: skip
        yield ratio

    def deliveries(self, session: Session) -> Iterator[Metric]:
        """Redeliveries, the reconciler's re-sends, and the active jobs riding on a re-sent message."""
        found = stats.deliveries(session)
        redeliveries = CounterMetricFamily(
            "supportmatrix_redeliveries",
            "Deliveries that took a job's stage again after its first (jobs.attempts, verdict_attempts)",
            labels=["stage"],
        )
        redeliveries.add_metric([Stage.accelerator.value], found.accelerator_redeliveries)
        redeliveries.add_metric([Stage.verdict.value], found.verdict_redeliveries)
        yield redeliveries
        riding = GaugeMetricFamily(
            "supportmatrix_resent_jobs",
            "Active jobs whose pending message the reconciler re-sent (the first one was lost or not taken)",
            labels=["stage"],
        )
        riding.add_metric([Stage.accelerator.value], found.accelerator_resent_jobs)
        riding.add_metric([Stage.verdict.value], found.verdict_resent_jobs)
        yield riding
        yield CounterMetricFamily(
            "supportmatrix_reconciler_resends",
            "Messages the reconciler sent again for jobs whose message was lost or not taken (jobs.resends)",
            value=found.resends,
        )

    # --- hosts and workers ------------------------------------------------------------------------------

    def hosts(self, session: Session, settings: Settings, now: dt.datetime) -> Iterator[Metric]:
        """Per host, from the workers table: cores of live core-group workers that hold a running job (busy)
        or not (idle), the largest aligned group among the idle ones, and worker liveness."""
        workers = stats.worker_beats(session)
        holders = [LeaseOwner.parse(owner) for owner in stats.running_lease_owners(session) if owner]
        busy = {(holder.worker, holder.host) for holder in holders if holder is not None}
        stale = live_since(settings, now)
        cores: dict[str, dict[str, int]] = defaultdict(lambda: {"busy": 0, "idle": 0})
        idle: dict[str, set[int]] = defaultdict(set)
        liveness: dict[str, dict[str, int]] = defaultdict(lambda: {"live": 0, "stale": 0})
        heartbeat: dict[str, dt.datetime] = {}
        per_compiler: dict[str, int] = defaultdict(int)
        for name, host, core_range, version, beat in workers:
            heartbeat[host] = max(beat, heartbeat.get(host, beat))
            if beat < stale:
                liveness[host]["stale"] += 1
                continue
            liveness[host]["live"] += 1
            per_compiler[version] += 1
            group = CoreGroup.parse(core_range)
            if (name.split("@")[0], host) in busy:
                cores[host]["busy"] += group.size
            else:
                cores[host]["idle"] += group.size
                idle[host].update(group.cores)

        host_cores = GaugeMetricFamily(
            "supportmatrix_host_cores", "Cores of live core-group workers, busy or idle", labels=["host", "state"]
        )
        largest = GaugeMetricFamily(
            "supportmatrix_host_largest_free_group_cores",
            "The largest aligned power-of-two group among a host's idle cores (fragmentation)",
            labels=["host"],
        )
        for host, by_state in sorted(cores.items()):
            for state, n in by_state.items():
                host_cores.add_metric([host, state], n)
            largest.add_metric([host], largest_free_group(idle[host]))
        yield host_cores
        yield largest
        registered = GaugeMetricFamily(
            "supportmatrix_workers",
            "Core-group worker rows per host: live, or stale (no heartbeat for SUPPORTMATRIX_WORKER_STALE_S)",
            labels=["host", "state"],
        )
        age = GaugeMetricFamily(
            "supportmatrix_host_heartbeat_age_seconds", "Seconds since any worker of the host beat", labels=["host"]
        )
        for host, by_state in sorted(liveness.items()):
            for state, n in by_state.items():
                registered.add_metric([host, state], n)
            age.add_metric([host], max(0.0, (now - heartbeat[host]).total_seconds()))
        yield registered
        yield age
        live = GaugeMetricFamily(
            "supportmatrix_live_workers", "Live workers by compiler version", labels=["compiler_version"]
        )
        for version, n in sorted(per_compiler.items()):
            live.add_metric([version], n)
        yield live

    # --- sweeps ---------------------------------------------------------------------------------------

    def sweeps(self, session: Session) -> Iterator[Metric]:
        """Sweeps by state, and the progress of the unfinished ones and of the newest: their entries by the
        state of the job each got ("none": no job, e.g. a model refused before sizing)."""
        by_state = GaugeMetricFamily("supportmatrix_sweeps", "Sweeps by state", labels=["state"])
        counts = stats.sweeps_by_state(session)
        for state in SweepState:
            by_state.add_metric([state.value], counts.get(state, 0))
        yield by_state
        progress = GaugeMetricFamily(
            "supportmatrix_sweep_entries",
            "Entries of the unfinished sweeps and the newest, by the state of their job",
            labels=["sweep_id", "job_state"],
        )
        for sweep_id, job_state, n in stats.sweep_progress(session):
            progress.add_metric([str(sweep_id), job_state.value if job_state else "none"], n)
        yield progress


class Snapshot:
    """The exposition of ``source`` (the SQL families), rendered when taken and served at each scrape with its age;
    retaken by a background thread every ``every_s`` seconds (``start``/``stop``). ``every_s`` 0 reads and renders
    at each scrape instead.

    A scrape never waits for a refresh and renders nothing but the age: it reads the snapshot as a whole (one
    attribute). Only a scrape that finds none yet (before the first refresh) collects in place. A refresh that
    fails keeps the old snapshot, whose age then grows: the age gauge is what an alert watches."""

    AGE = "supportmatrix_metrics_snapshot_age_seconds"

    def __init__(self, source: Collector, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = CollectorRegistry()
        self._registry.register(source)
        self._every_s = every_s
        self._clock = clock
        self._taken: tuple[bytes, float] | None = None
        self._collecting = threading.Lock()  # one collection at a time: the thread's and a first scrape's
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        with self._collecting:
            self._taken = self._rendered()

    def exposition(self) -> bytes:
        """The SQL families in Prometheus's text format, then the age of their snapshot."""
        if self._every_s == 0:
            text, age = generate_latest(self._registry), 0.0  # read by this scrape
        else:
            text, taken_at = self._taken or self._first()
            age = max(0.0, self._clock() - taken_at)
        return (
            text
            + (
                f"# HELP {self.AGE} Seconds since the SQL-derived families were read "
                f"(every SUPPORTMATRIX_METRICS_REFRESH_S; 0: at each scrape)\n"
                f"# TYPE {self.AGE} gauge\n{self.AGE} {floatToGoString(age)}\n"
            ).encode()
        )

    def _rendered(self) -> tuple[bytes, float]:
        return generate_latest(self._registry), self._clock()

    def _first(self) -> tuple[bytes, float]:
        with self._collecting:  # a scrape before the thread's first refresh: the one that gets here first collects
            if self._taken is None:
                self._taken = self._rendered()
            return self._taken

    def start(self) -> None:
        """Refresh every ``every_s`` seconds in a daemon thread until ``stop`` (nothing to do when 0)."""
        if self._every_s == 0 or self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._refresh_until_stopped, name="metrics-snapshot", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join()
        self._thread = None

    def _refresh_until_stopped(self) -> None:
        while not self._stopping.is_set():
            try:
                self.refresh()
            except Exception:  # the database may be down for a while: keep serving the old snapshot
                log.exception("metrics snapshot refresh failed; serving the previous one")
            self._stopping.wait(self._every_s)


# --- the API's own HTTP metrics ---------------------------------------------------------------------------


class HttpMetrics:
    """Counts and times each request by method, route template (``/jobs/{job_id}``, never the raw path) and
    status, as pure ASGI middleware: streamed bodies pass through untouched."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram) -> None:
        self.app = app
        self.requests = requests
        self.latency = latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or UNMATCHED
            labels = (scope["method"], template, str(status))
            self.requests.labels(*labels).inc()
            self.latency.labels(*labels).observe(time.perf_counter() - started)


def instrument(app: Any, registry: CollectorRegistry) -> None:
    """Add the HTTP metrics of ``app`` to ``registry`` (the one its /metrics exposes)."""
    labels = ["method", "route", "status"]
    requests = Counter(
        "supportmatrix_http_requests", "API requests by method, route and status", labels, registry=registry
    )
    latency = Histogram(
        "supportmatrix_http_request_duration_seconds",
        "API request latency by method, route and status",
        labels,
        registry=registry,
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    )
    app.add_middleware(HttpMetrics, requests=requests, latency=latency)

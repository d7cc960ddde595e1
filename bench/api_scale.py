"""P5 — the API over 1 M result rows in PostgreSQL, each route beside a plain endpoint served the same way.

    .venv/bin/python -m bench --only api_scale [--no-write]

In a scratch schema (dropped at the end) it migrates to head and generates a year of history server-side
(``testing.bulk_rows``: 1 M finished jobs of 50 000 models over 8 compiler versions, each round's sweep with its
ranked views, 3 000 unfinished jobs, 256 live workers), then VACUUM ANALYZEs as autovacuum would. It starts the
real API under uvicorn (one process, as docker-compose runs it) against that schema, a Hub stand-in that serves
one model (config and safetensors metadata only) and a Redis db of its own, and adds two routes to the app: the
plain endpoint, which returns a constant (GET and POST), and a sync route's database read (its session and
``SELECT 1``). Every request goes over HTTP on a keep-alive connection;
each measured request is followed by one to the plain endpoint, so that both see the same machine at the same
moment (this machine's CPUs are shared), and the ratio compares their p99s:

- ``GET /results?model_id=…``: a different model each time (20 runs each);
- a view's first page (``view=trending&task=text-generation&limit=100``) and its next page (its cursor), asked
  again while no result changes (each answered with the bytes kept at the records' version); and the first page
  after a result landed before each request (the version raised, as a result's commit raises it: read whole);
- ``GET /metrics``: the whole scrape;
- ``POST /jobs`` of a model that already has its job: requests/s over ``CONNECTIONS`` connections at once,
  beside the plain POST's requests/s measured the same way, with the CPU the API process spent per request in
  each. The token's rate limit is lifted for the run (its default, 60 a minute, would answer 429 after the first
  second).

The goals (issue 22): a model's lookup p99 at most twice the plain endpoint's, a view's page at most three times
(the page asked again while no result changed),
and POST /jobs at least 0.3 times the plain POST's rate.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import psutil
import redis
import sqlalchemy as sa
from fastapi import FastAPI
from sqlalchemy.orm import Session

from bench.metrics_scrape import measure as family_costs
from bench.metrics_scrape import timed
from bench.report import Goal, Measure, Section
from services.api.deps import SessionDep
from services.api.metrics import StateCollector
from shared.auth.tokens import CHECK_SNAPSHOT_S, authenticate, create_token, recent_caller
from shared.contracts.enums import Scope
from shared.db.engine import PING_IDLE_S, make_engine
from shared.db.models import Job, ResultsVersion
from shared.hub.client import ResolvedModel
from shared.jobs.runtimes import RUNTIMES_SNAPSHOT_S, live_runtimes, plan_runtimes
from shared.jobs.submission import submit
from shared.processes import free_port, output_tail
from shared.results.records import query_results, query_view
from shared.settings import Settings
from testing.bulk_rows import CORES_PER_HOST, HOSTS, History, scratch_history
from testing.hub_standin import HubStandin

ROOT = Path(__file__).resolve().parent.parent
ROWS = 1_000_000
POSTGRES = os.environ.get("SUPPORTMATRIX_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("SUPPORTMATRIX_TEST_REDIS", "redis://127.0.0.1:6379")
CONSTANT_PATH = "/bench/constant"
SESSION_PATH = "/bench/session"
CONSTANT = {"status": "ok"}
KNOWN_MODEL = "Qwen/Qwen3-0.6B"
# Qwen3-0.6B's config.json, and its safetensors metadata as the Hub reports it: sized without any weights.
KNOWN_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}
KNOWN_SAFETENSORS = {"parameters": {"BF16": 751_632_384}, "total": 751_632_384}
P99_GOAL = Goal(on="ratio", at_most=2.0)
VIEW_GOAL = Goal(on="ratio", at_most=3.0)  # a view's page: 100 records of ~2 kB each, against a 16-byte answer
RATE_GOAL = Goal(on="ratio", at_least=0.3)  # ours ≥ 0.3 times the plain endpoint's requests/s
SAMPLES = {"model": 600, "view": 300, "metrics": 15}
CONNECTIONS = 8
VIEW = ("trending", "text-generation")  # the view and task whose pages are read
POST_SECONDS = 8.0


def served_app() -> FastAPI:
    """The API as ``services.api.main`` builds it, plus the plain endpoint and a sync route that reads the
    database (its session, one ``SELECT 1``): same process, middleware and server."""
    from services.api.main import create_app

    app = create_app()

    @app.get(CONSTANT_PATH, include_in_schema=False)
    def constant() -> dict[str, str]:
        return CONSTANT

    @app.get(SESSION_PATH, include_in_schema=False)
    def session_floor(session: SessionDep) -> dict[str, str]:
        session.execute(sa.text("SELECT 1"))
        return CONSTANT

    @app.post(CONSTANT_PATH, include_in_schema=False)
    def constant_post(body: dict[str, Any]) -> dict[str, str]:
        return CONSTANT

    return app


# --- what runs: the database, the Hub, Redis, the API ------------------------------------------------------


@contextlib.contextmanager
def redis_db() -> Iterator[str]:
    """A Redis db number nobody uses (claimed with SET NX, as the suite claims its own), flushed after."""
    for db in range(15, 0, -1):
        client = redis.Redis.from_url(f"{REDIS}/{db}")
        if client.dbsize() == 0 and client.set("supportmatrix:bench-claim", str(os.getpid()), nx=True):
            try:
                yield f"{REDIS}/{db}"
            finally:
                client.flushdb()
            return
    raise RuntimeError("no free Redis db number in 1..15")


@contextlib.contextmanager
def hub_serving_known_model(work: Path) -> Iterator[str]:
    repo = work / "hub" / KNOWN_MODEL.split("/")[1]
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps(KNOWN_CONFIG))
    with HubStandin() as hub:
        hub.add(KNOWN_MODEL, repo, pipeline_tag="text-generation", safetensors=KNOWN_SAFETENSORS)
        yield hub.url


@dataclass(frozen=True)
class ServedApi:
    port: int
    pid: int

    def cpu_s(self) -> float:
        """CPU seconds (user and system) the API process has spent so far."""
        spent = psutil.Process(self.pid).cpu_times()
        return spent.user + spent.system


@contextlib.contextmanager
def api_server(work: Path, database_url: str, redis_url: str, hub_url: str) -> Iterator[ServedApi]:
    """``uvicorn bench.api_scale:served_app`` on a free port."""
    port = free_port()
    log = work / "api.log"
    env = {
        **os.environ,
        "SUPPORTMATRIX_DATABASE_URL": database_url,
        "SUPPORTMATRIX_REDIS_URL": redis_url,
        "SUPPORTMATRIX_DATA_DIR": str(work / "data"),
        "SUPPORTMATRIX_API_RATE_LIMIT": str(10**9),
        "SUPPORTMATRIX_WORKER_STALE_S": "86400",  # the generated workers' heartbeats are as old as the run
        "HF_ENDPOINT": hub_url,
        "HF_HOME": str(work / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
    }
    command = [sys.executable, "-m", "uvicorn", "bench.api_scale:served_app", "--factory", "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while Client(port).get(CONSTANT_PATH)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start:\n{output_tail(log)}")
            time.sleep(0.2)
        yield ServedApi(port, proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)


# --- the client ----------------------------------------------------------------------------------------------


class Client:
    """One keep-alive HTTP/1.1 connection (the standard library's: it costs the client little per request)."""

    def __init__(self, port: int, token: str | None = None) -> None:
        self.port = port
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes, dict[str, str]]:
        headers = dict(self.headers)
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):  # a connection the server closed between requests is opened again, once
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                self.conn.request(method, path, payload, headers)
                response = self.conn.getresponse()
                return response.status, response.read(), dict(response.getheaders())
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def get(self, path: str) -> tuple[int, bytes, dict[str, str]]:
        try:
            return self.request("GET", path)
        except (ConnectionError, http.client.HTTPException):
            return 0, b"", {}


@dataclass
class Latencies:
    ours: list[float]
    plain: list[float]
    kilobytes: float  # of the measured route's answer

    @staticmethod
    def p(samples: list[float], q: int) -> float:
        return statistics.quantiles(samples, n=100, method="inclusive")[q - 1] * 1000

    def ratio(self, q: int) -> float:
        return self.p(self.ours, q) / self.p(self.plain, q)

    def measures(self, what: str, note: str = "", goal: Goal | None = P99_GOAL) -> list[Measure]:
        return [
            Measure(measure=f"{what} p50", unit="ms", ours=self.p(self.ours, 50), baseline=self.p(self.plain, 50),
                    baseline_name="plain endpoint p50"),
            Measure(measure=f"{what} p99", unit="ms", ours=self.p(self.ours, 99), baseline=self.p(self.plain, 99),
                    baseline_name="plain endpoint p99", goal=goal, note=note),
        ]  # fmt: skip


def interleaved(
    client: Client, paths: Callable[[int], str], samples: int, warm: int = 3, before: Callable[[], object] | None = None
) -> Latencies:
    """Each request to ``paths(i)`` followed by one to the plain endpoint, timed alike; ``warm`` pairs first;
    ``before`` run (untimed) before each request to ``paths(i)``."""
    out = Latencies([], [], 0.0)
    for i in range(-warm, samples):
        for path, into in ((paths(i % samples), out.ours), (CONSTANT_PATH, out.plain)):
            if before is not None and into is out.ours:
                before()
            started = time.perf_counter()
            status, body, _ = client.request("GET", path)
            elapsed = time.perf_counter() - started
            if status != 200:
                raise RuntimeError(f"GET {path}: {status} {body[:300]!r}")
            if i >= 0:
                into.append(elapsed)
            if into is out.ours:
                out.kilobytes = len(body) / 1000
    return out


@dataclass(frozen=True)
class Rate:
    per_s: float  # answers per second
    statuses: dict[int, int]  # how many answers of each status code
    api_cpu_ms: float  # CPU the API process spent per answer


def requests_per_second(api: ServedApi, token: str, path: str, body: Any, seconds: float) -> Rate:
    """``CONNECTIONS`` clients POSTing ``body`` back to back for ``seconds``."""
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def hammer() -> None:
        client = Client(api.port, token)
        while time.monotonic() < deadline:
            status = client.request("POST", path, body)[0]
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    cpu_before = api.cpu_s()
    started = time.monotonic()
    threads = [threading.Thread(target=hammer) for _ in range(CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    answers = sum(statuses.values())
    return Rate(answers / (time.monotonic() - started), statuses, (api.cpu_s() - cpu_before) * 1000 / answers)


# --- the run ---------------------------------------------------------------------------------------------------


def token_for(engine: sa.Engine) -> str:
    with Session(engine) as session, session.begin():
        return create_token(session, "bench-api-scale", Scope.submit)


def submission_costs(engine: sa.Engine, token: str, job_id: int) -> dict[str, float]:
    """What a POST /jobs of the known model spends in its database steps, each timed alone in this process (median
    ms): the token's check and the live workers' runtimes as a request finds them (in their snapshots) and as one
    snapshot in each ``CHECK_SNAPSHOT_S`` / ``RUNTIMES_SNAPSHOT_S`` reads them (in SQL), and the lookup that finds
    the job."""
    settings = Settings(worker_stale_s=86400)
    with Session(engine) as session:
        job = session.get_one(Job, job_id)
        model = ResolvedModel(model_id=job.model_id, sha=job.sha, gated=job.gated, pipeline_tag=job.task)
        runtime, task, cores = job.runtime(), job.task, job.cores

    def token_check(check: Callable[[Session, str], object]) -> Callable[[], None]:
        def step() -> None:
            with Session(engine) as session:
                check(session, token)
                session.commit()

        return step

    def runtimes(fresh: bool) -> Callable[[], None]:
        def step() -> None:
            if fresh:
                live_runtimes.cache_clear()
            with Session(engine) as session:
                plan_runtimes(session, settings, None)

        return step

    def lookup() -> None:
        with Session(engine) as session:
            submit(session, model, None, [runtime], task=task, cores=cores)

    steps = {
        "token check, from its snapshot": token_check(recent_caller),
        f"token check in SQL + commit (once per {CHECK_SNAPSHOT_S:g} s)": token_check(authenticate),
        "runtimes of the live workers, from their snapshot": runtimes(fresh=False),
        f"runtimes of the live workers in SQL (once per {RUNTIMES_SNAPSHOT_S:g} s)": runtimes(fresh=True),
        "job lookup": lookup,
    }
    return {name: timed(step, repeat=30) * 1000 for name, step in steps.items()}


def reads_alone(engine: sa.Engine, model_ids: list[str]) -> dict[str, list[float]]:
    """Seconds of the reads ``GET /results`` makes, run here in this process with no HTTP around them: the
    statement and its records (``query_results`` / ``query_view``, validation included) on an autocommit
    connection, held for all of them (the route also takes one from the pool and gives it back, for each request).
    What the route adds to the plain endpoint's work cannot be less than this."""
    with Session(engine) as session:
        session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
        reads: dict[str, tuple[int, Callable[[int], object]]] = {
            "model": (SAMPLES["model"], lambda i: query_results(session, model_id=model_ids[i], limit=100)),
            "view first": (SAMPLES["view"], lambda i: query_view(session, *VIEW, offset=0, limit=100)),
            "view next": (SAMPLES["view"], lambda i: query_view(session, *VIEW, offset=100, limit=100)),
        }
        out: dict[str, list[float]] = {}
        for name, (samples, read) in reads.items():
            for i in range(3):
                read(i)
            out[name] = []
            for i in range(samples):
                started = time.perf_counter()
                read(i)
                out[name].append(time.perf_counter() - started)
    return out


def scrape_costs(engine: sa.Engine) -> dict[str, float]:
    """Each /metrics family's SQL, timed in this process (ms, bench/metrics_scrape.py's measure)."""
    settings = Settings(worker_stale_s=86400)
    sessions = lambda: Session(engine)  # noqa: E731
    return {
        name: s * 1000 for name, s in family_costs(StateCollector(settings, sessions), sessions, settings, 1).items()
    }


def run(work: Path, rows: int = ROWS) -> Section:
    with scratch_history(POSTGRES, rows, "bench_api") as scratch:
        engine = make_engine(scratch.url)
        try:
            token = token_for(engine)
            with (
                redis_db() as redis_url,
                hub_serving_known_model(work) as hub_url,
                api_server(work, scratch.url, redis_url, hub_url) as api,
            ):
                return measure(engine, api, token, scratch.history, scratch.fill_s)
        finally:
            engine.dispose()


def measure(engine: sa.Engine, api: ServedApi, token: str, history: History, fill_s: float) -> Section:
    client = Client(api.port)
    floor = interleaved(client, lambda i: SESSION_PATH, SAMPLES["model"])
    step = history.models // SAMPLES["model"]
    model_ids = [history.model_id(1 + i * step) for i in range(SAMPLES["model"])]  # a different model each
    by_model = interleaved(client, lambda i: "/results?" + urlencode({"model_id": model_ids[i]}),
                           SAMPLES["model"])  # fmt: skip

    first_page = "/results?" + urlencode({"view": VIEW[0], "task": VIEW[1], "limit": 100})
    status, body, _ = client.request("GET", first_page)
    first = json.loads(body)
    cursor = first["next_cursor"]
    if status != 200 or len(first["items"]) != 100 or cursor is None:
        raise RuntimeError(f"the view's first page: {status}, {len(first.get('items', []))} rows, cursor {cursor}")
    next_page = f"{first_page}&cursor={cursor}"
    view_first = interleaved(client, lambda i: first_page, SAMPLES["view"])
    view_next = interleaved(client, lambda i: next_page, SAMPLES["view"])

    def result_landed() -> None:  # raises the records' version as a result's commit does (writing none)
        with engine.begin() as connection:
            connection.execute(
                sa.update(ResultsVersion).where(ResultsVersion.id == 1).values(version=ResultsVersion.version + 1)
            )

    view_read = interleaved(client, lambda i: first_page, SAMPLES["view"], before=result_landed)
    metrics = interleaved(client, lambda i: "/metrics", SAMPLES["metrics"], warm=1)
    alone = reads_alone(engine, model_ids)
    families = scrape_costs(engine)

    submission = {"model_id": KNOWN_MODEL}
    status, body, _ = Client(api.port, token).request("POST", "/jobs", submission)  # the first one creates the jobs
    if status != 202:
        raise RuntimeError(f"the first POST /jobs: {status} {body[:300]!r}")
    created = [job["id"] for job in json.loads(body)["jobs"]]
    posts = requests_per_second(api, token, "/jobs", submission, POST_SECONDS)
    plain_posts = requests_per_second(api, token, CONSTANT_PATH, submission, POST_SECONDS)
    if set(posts.statuses) != {200}:
        raise RuntimeError(f"POST /jobs of a known model answered {posts.statuses}, not only 200 (found)")
    steps = submission_costs(engine, token, created[0])

    def read_note(latencies: Latencies, rows: str, goal: Goal, read: str) -> str:
        seconds = alone[read]
        alone_p50, alone_p99 = Latencies.p(seconds, 50), Latencies.p(seconds, 99)
        return (
            f"{latencies.ratio(99):.1f}x the plain p99 (goal {goal.at_most:g}x): {rows} and "
            f"{latencies.kilobytes:.0f} kB of JSON, read with one indexed statement (tests/test_query_plans.py) on an "
            "autocommit connection in one thread-pool hop; a sync route's SELECT 1 here (BEGIN, the query, ROLLBACK) "
            f"costs {floor.p(floor.ours, 50):.1f} ms p50 / {floor.p(floor.ours, 99):.1f} ms p99; the read alone, "
            f"in this process with no HTTP (statement and records), {alone_p50:.1f} ms p50 / {alone_p99:.1f} ms p99, "
            f"{alone_p50 / latencies.p(latencies.plain, 50):.1f}x the plain p50 and "
            f"{alone_p99 / latencies.p(latencies.plain, 99):.1f}x its p99 on top of the plain endpoint's own work"
        )

    def kept_note(latencies: Latencies, read: Latencies) -> str:
        return (
            f"{latencies.ratio(99):.1f}x the plain p99 (goal {VIEW_GOAL.at_most:g}x): the page asked again while no "
            "result changed, answered with the bytes kept at the records' version (services/api/answers.py) after "
            f"reading that version alone (one row); read whole, after a result landed, "
            f"{read.p(read.ours, 50):.1f} ms p50 / {read.p(read.ours, 99):.1f} ms p99 ({read.ratio(99):.1f}x)"
        )

    slowest = sorted(((v, k) for k, v in families.items() if k != "whole scrape"), reverse=True)[:3]
    measures = [
        *floor.measures("GET of a sync route reading its session (SELECT 1)", goal=None),
        *by_model.measures("GET /results?model_id= (20 runs)",
                           read_note(by_model, "the model's 20 records", P99_GOAL, "model")),
        *view_first.measures("GET /results?view= first page (100 rows)", kept_note(view_first, view_read),
                             goal=VIEW_GOAL),
        *view_next.measures("GET /results?view= next page (cursor)", kept_note(view_next, view_read),
                            goal=VIEW_GOAL),
        *view_read.measures("GET /results?view= first page, a result landed before each (read whole)",
                            read_note(view_read, "100 records", VIEW_GOAL, "view first"), goal=None),
        *metrics.measures(
            "GET /metrics (whole scrape)",
            "a scrape serves the snapshot a background thread retakes every SUPPORTMATRIX_METRICS_REFRESH_S; "
            "the refresh itself costs what a scrape cost before, slowest families "
            + ", ".join(f"{name} {ms:.0f} ms" for ms, name in slowest)
            + f"; the p99 of {SAMPLES['metrics']} scrapes is their slowest: one that meets a refresh (those "
            "families' SQL alone takes their sum, on the CPUs PostgreSQL and the API share) waits for it, so the "
            "ratio depends on whether one did in this run",
        ),
        Measure(measure=f"POST /jobs, known model ({CONNECTIONS} connections)", unit="req/s", ours=posts.per_s,
                baseline=plain_posts.per_s, baseline_name="plain POST", goal=RATE_GOAL,
                note=f"{posts.per_s / plain_posts.per_s:.2f}x the plain POST's rate (goal ≥ {RATE_GOAL.at_least:g}x): "
                f"the API process spent {posts.api_cpu_ms:.2f} ms of CPU per POST /jobs, {plain_posts.api_cpu_ms:.2f} "
                f"ms per plain POST ({plain_posts.api_cpu_ms / posts.api_cpu_ms:.2f}x; one process runs its Python "
                "on one CPU at a time); the token check and the runtimes come from snapshots: see the details"),
    ]  # fmt: skip
    family_rows = "\n".join(f"| {name} | {ms:,.0f} |" for name, ms in families.items())
    details = (
        f"""{history.rows:,} finished jobs with their results ({history.models:,} models, {history.rounds} rounds
over {len(set(map(history.compiler, range(history.rounds))))} compiler versions) and {history.active:,} unfinished
ones, generated and analysed in {fill_s:.0f} s (`testing.bulk_rows`). The API runs under uvicorn, one process, with
one more route for the baseline (`{CONSTANT_PATH}`: a constant) and one for a sync route's database read
(`{SESSION_PATH}`: its session and `SELECT 1`). Samples: {SAMPLES["model"]} model lookups (a different model each),
{SAMPLES["view"]} of each view page, {SAMPLES["metrics"]} scrapes (their p99 is close to their maximum), each followed
by a request to the plain endpoint on the same keep-alive connection; POST /jobs: {POST_SECONDS:.0f} s each,
{CONNECTIONS} connections. The first POST created job(s) {created}; the {sum(posts.statuses.values()):,} measured ones
each answered 200 with the existing job (found, nothing enqueued); the plain POST answered {plain_posts.statuses}.

What the reads cost beyond the plain endpoint: the sync route above (its session: BEGIN, `SELECT 1`, ROLLBACK; its
p50 is the session's cost; its p99, like every p99 here, is mostly this 2-CPU machine's other work, which the
interleaving spreads over both sides alike), then the page's records. `GET /results` reads them with one statement
in one thread-pool hop (`services.api.deps.read_in_one_hop`: the route and its session's close share the hop, and
FastAPI checks the answer on the event loop), on a connection in autocommit (no BEGIN before the statement, no
ROLLBACK after it). The statements are indexed (tests/test_query_plans.py), read as plain rows through SQLAlchemy
Core rather than the ORM (`shared.results.records.RECORD_SELECT`), and built once per shape with bound values
(`_newest_first`, `_in_view`), so that SQLAlchemy finds their compiled SQL without computing a cache key each time,
with the records' version beside each row (`shared.results.records.RecordsVersion`: a number every transaction that
writes results raises as it commits, and the newest finished sweep). Each API process keeps its answers by query and
that version (`services.api.answers`, 64 MiB): a query asked again reads the version alone (one row) and, while it
is unchanged, answers the kept bytes without reading or encoding its records. A
view's page is found in SQL: the newest finished sweep's ranked entries, filtered and paged as narrow rows, and only
the page's 100 rows read whole. Their JSON columns are parsed by pydantic-core, and the rows validated once, into the
records the page is written from. The pool pings a connection only after it has idled {PING_IDLE_S:g} s
(`shared.db.engine.PING_IDLE_S`), not at every checkout.

POST /jobs of a model that has its job, per request: the bearer token's check comes from a snapshot kept per
process (`shared.auth.tokens.recent_caller`: a valid token's check is kept {CHECK_SNAPSHOT_S:g} s, so a token revoked
by another process is refused within that; the process that revokes one drops it at once; a check in SQL writes
the last use at most once a minute), the rate limit is counted in Redis, the runtimes come from a snapshot of the
live workers' distinct runtime columns retaken at most every {RUNTIMES_SNAPSHOT_S:g} s
(`shared.jobs.runtimes.live_runtimes`; {HOSTS * CORES_PER_HOST} workers here), the Hub's answer comes from the API's
cache, sizing reads `config.json` pinned to the model's commit (once per process), and the identity lookup finds the
job, whose transaction is then committed. The settings, the producer, the rate limiter and the Hub pool are handed
to the route by async dependencies, and the session is opened and closed on the event loop, so a request makes two
thread-pool hops: the token check with its rate-limit call, and the submission in the Hub pool's threads. Timed
alone in this process (median ms):

| step | ms |
|---|---:|
"""
        + "\n".join(f"| {name} | {ms:.2f} |" for name, ms in steps.items())
        + f"""

The rates follow the API process's CPU: {posts.api_cpu_ms:.2f} ms per POST /jobs against {plain_posts.api_cpu_ms:.2f} ms
per plain POST, and one process runs its Python on one CPU at a time. With the token check and the runtimes out of SQL,
most of what remains is the submission itself (`shared.jobs.submission`): the identity lookup (a statement built once,
with bound values) loads a `Job` through the ORM, sizing reads `config.json` pinned to the model's commit (read once
per process), and each submission takes a pooled connection, begins, runs the lookup and commits: three round trips
to PostgreSQL, which shares the 2 CPUs, and one to Redis for the rate limit.

/metrics: each family's SQL over the {history.rows:,} rows, timed in this process (ms; `bench/metrics_scrape.py`):

| family | ms |
|---|---:|
{family_rows}
"""
    )
    return Section(name="api_scale", title="P5 — the API over 1 M result rows", measures=measures, details=details)

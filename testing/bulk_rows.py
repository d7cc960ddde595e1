"""A year of a fleet's history as rows, generated server-side in PostgreSQL (``INSERT … SELECT … FROM
generate_series``): 1 M rows in about a minute. For the benchmarks, and for the tests that need a table big
enough for the planner to choose as it would in production.

The history is a series of sweeps (rounds): every round tests each of ``models`` models once, on the software
stack of its time (``History.stack``: compiler, torch and library versions; a torch with each library version),
so a model has one job per round, its runs spread over the table, each stack holds a slice of it, and a job is
queued on its stack's queue. Every tenth model is a feature-extraction model, the others text-generation. Each
round's sweep lists, per task, the trending and most-downloaded models (a different ranking every round) and a
pinned selection, with the job each got. On top of the finished rows: ``active`` jobs
of a round in progress (queued, running, judging) listed by a running sweep, and 256 live workers on 4 hosts that
serve the newest versions. Result rows carry what a real one does (token ids, texts, the reproduce command, the
judge's fields), so that reading one costs what it costs in production.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shared.contracts.enums import Task
from shared.contracts.run import RuntimeInfo, Stack
from shared.jobs.queues import VERDICT_QUEUE_PREFIX, job_queue
from shared.testconfig import config_hash

# Oldest first; a round runs under the versions of its time.
COMPILERS = (
    "2.14.227.0",
    "2.15.128.0",
    "2.16.372.0",
    "2.17.194.0",
    "2.18.121.0",
    "2.19.8089.0",
    "2.20.9961.0",
    "2.21.18209.0",
)
LIBRARY_VERSIONS = ("4.51.3", "4.55.4", "4.57.1", "5.0.0")  # transformers
TORCH_VERSIONS = ("2.6.0", "2.7.0", "2.8.0", "2.9.0")  # the torch each library version ran with
# A new library version arrives a round before a compiler version's turn is over: some compiler versions ran
# under two library versions, as a fleet's do.
LIBRARY_LEAD = 1
HOSTS = 4
CORES_PER_HOST = 64
BACKEND = "neuron"
COMPILER_NAME = "neuronx-cc"
CORE_SIZES = (1, 2, 4, 8)  # the core-group sizes jobs ask for (model m asks for (1, 1, 1, 1, 2, 2, 4, 8)[m % 8])
# Per task and view: how many models a sweep lists (the sweep's limit), and the pinned selection's size.
LISTED = {Task.text_generation.value: 200, Task.feature_extraction.value: 100}
SELECTED = 20
# What populate fills: ANALYZE (or VACUUM ANALYZE) these after it, by name — a bare ANALYZE reads every table of
# the database, every other schema's too.
TABLES = ("jobs", "results", "workers", "queues_seen", "sweeps", "sweep_entries")


@dataclass(frozen=True)
class ScratchHistory:
    """A PostgreSQL schema of its own, migrated to head and holding a generated history."""

    schema: str
    url: str  # SQLAlchemy's, with the schema as its search path
    history: History
    fill_s: float  # generating, vacuuming and analysing it

    def connect(self) -> Any:
        """A psycopg connection (autocommit) whose search path is the schema."""
        import psycopg

        return psycopg.connect(_libpq(self.url), autocommit=True, options=f"-csearch_path={self.schema}")


def analyze(conn: Any) -> None:
    """What autovacuum would have done by now, on the generated tables only."""
    conn.execute(f"VACUUM ANALYZE {', '.join(TABLES)}")


def _libpq(url: str) -> str:
    return url.split("?")[0].replace("postgresql+psycopg", "postgresql")


@contextlib.contextmanager
def scratch_history(postgres: str, rows: int, prefix: str) -> Iterator[ScratchHistory]:
    """A schema named ``prefix_<random>`` in the database at ``postgres`` (a SQLAlchemy URL), migrated to head,
    holding ``rows`` finished jobs with their results (``populate``), vacuumed and analysed; dropped after."""
    import psycopg

    from shared.db.migrate import upgrade

    schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_libpq(postgres), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        url = f"{postgres}?options=-csearch_path%3D{schema}"
        upgrade(url)
        started = time.perf_counter()
        with psycopg.connect(_libpq(postgres), autocommit=True, options=f"-csearch_path={schema}") as conn:
            with conn.transaction():
                history = populate(conn, rows)
            analyze(conn)
        yield ScratchHistory(schema, url, history, time.perf_counter() - started)
    finally:
        with psycopg.connect(_libpq(postgres), autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@dataclass(frozen=True)
class History:
    """What ``populate`` generated: enough to name a model and the versions its rows hold."""

    rows: int  # finished jobs, each with its result
    models: int
    rounds: int
    active: int

    def model_id(self, model: int) -> str:
        """The id of model ``model`` (1-based); every tenth is a feature-extraction model."""
        return f"org-{model % 500:03d}/model-{model:06d}"

    def compiler(self, round_: int) -> str:
        return COMPILERS[in_round(len(COMPILERS), round_, self.rounds, 0)]

    def library_version(self, round_: int) -> str:
        return LIBRARY_VERSIONS[in_round(len(LIBRARY_VERSIONS), round_, self.rounds, LIBRARY_LEAD)]

    def torch_version(self, round_: int) -> str:
        return TORCH_VERSIONS[in_round(len(TORCH_VERSIONS), round_, self.rounds, LIBRARY_LEAD)]

    def stack(self, round_: int) -> Stack:
        """The software stack round ``round_`` ran on (no TorchNeuron or Neuron runtime version: the rows keep "")."""
        return Stack(
            compiler_version=self.compiler(round_),
            torch_version=self.torch_version(round_),
            library_version=self.library_version(round_),
        )

    def queue(self, round_: int, cores: int) -> str:
        """The job queue of round ``round_``'s jobs on ``cores`` cores."""
        return job_queue(BACKEND, self.stack(round_), cores)

    @property
    def newest_compiler(self) -> str:
        return self.compiler(self.rounds - 1)

    @property
    def newest_library_version(self) -> str:
        return self.library_version(self.rounds - 1)

    @property
    def newest_stack(self) -> Stack:
        """The stack of the round in progress, which the live workers serve."""
        return self.stack(self.rounds - 1)


def in_round(versions: int, round_: int, rounds: int, lead: int) -> int:
    """Which of ``versions`` versions round ``round_`` ran: they follow each other evenly over the rounds, ``lead``
    rounds early."""
    return min((round_ + lead) * versions // rounds, versions - 1)


def _in_round_sql(versions: str, lead: int) -> str:
    """``in_round`` in SQL, over the array parameter ``versions`` and the round ``k``."""
    n = f"cardinality(%({versions})s::text[])"
    return f"(%({versions})s::text[])[1 + least((k + {lead}) * {n} / %(rounds)s, {n} - 1)]"


# The SQL spelling of History's model ids, compiler and library versions: keep them equal.
_MODEL_ID = "'org-' || lpad((m %% 500)::text, 3, '0') || '/model-' || lpad(m::text, 6, '0')"
# A job's queue, of round k and c.cores cores, from ``round_queues`` (History.queue of each round and core size).
_QUEUE = "(%(round_queues)s::text[])[1 + k * %(sizes)s + array_position(%(core_sizes)s::int[], c.cores) - 1]"

JOBS = f"""
INSERT INTO jobs (id, model_id, revision, sha, task, config_hash, gated, trust_remote_code, cores, queue, state,
                  attempts, verdict_attempts, verdict_queue, attempt_log, lease_owner, heartbeat_at, created_at,
                  started_at, judging_at, finished_at, error_class, error_message,
                  library, library_version, torch_version, backend, compiler_name, compiler_version,
                  stack_digest)
SELECT g, {_MODEL_ID}, NULL, md5(m || '@' || k / 5) || substr(md5(m::text), 1, 8),
       CASE WHEN m %% 10 = 0 THEN %(fe)s ELSE %(tg)s END,
       CASE WHEN m %% 10 = 0 THEN %(fe_hash)s ELSE %(tg_hash)s END,
       m %% 97 = 0, m %% 89 = 0, c.cores,
       {_QUEUE}, s.state,
       CASE WHEN s.state = 'queued' THEN 0 WHEN h %% 50 = 0 THEN 2 ELSE 1 END,
       CASE WHEN s.state IN ('done', 'failed') AND h %% 10 <> 0 THEN 1 ELSE 0 END,
       %(verdict_queue)s || '.host-' || g %% %(hosts)s, '[]',
       CASE WHEN s.state IN ('running', 'judging') AND h %% 2 = 0
            THEN 'cores-' || g %% %(cores)s || '@host-' || g %% %(hosts)s || ':' || 1000 + g %% 30000 END,
       CASE WHEN s.state IN ('running', 'judging') THEN now() END,
       t.created,
       CASE WHEN s.state <> 'queued' THEN t.created + interval '10 seconds' END,
       CASE WHEN s.state IN ('judging', 'done', 'failed') AND h %% 10 <> 0
            THEN t.created + make_interval(secs => 10 + 60 * c.cores + h %% 1800) END,
       CASE WHEN s.state IN ('done', 'failed')
            THEN t.created + make_interval(secs => 40 + 60 * c.cores + h %% 2100) END,
       CASE WHEN s.state = 'failed' THEN (ARRAY['compile', 'runtime', 'oom', 'timeout', 'load'])[1 + h %% 5] END,
       CASE WHEN s.state = 'failed' THEN 'the accelerator run failed (see the result)' END,
       'transformers', v.library_version, v.torch_version, %(backend)s, %(compiler_name)s, v.compiler,
       (%(round_digests)s::text[])[1 + k]
FROM generate_series(1::bigint, %(total)s) AS g,
     LATERAL (SELECT 1 + (g - 1) %% %(models)s AS m, least((g - 1) / %(models)s, %(rounds)s - 1) AS k,
                     (g * 2654435761) %% 1000003 AS h) AS i,
     LATERAL (SELECT (ARRAY[1, 1, 1, 1, 2, 2, 4, 8])[1 + m %% 8] AS cores) AS c,
     LATERAL (SELECT {_in_round_sql("compilers", 0)} AS compiler,
                     {_in_round_sql("libraries", LIBRARY_LEAD)} AS library_version,
                     {_in_round_sql("torches", LIBRARY_LEAD)} AS torch_version) AS v,
     LATERAL (SELECT now() - make_interval(secs => 30 * (%(total)s - g)) AS created) AS t,
     LATERAL (SELECT CASE WHEN g > %(rows)s THEN (ARRAY['queued', 'running', 'judging'])[1 + g %% 3]
                          WHEN h %% 10 = 0 THEN 'failed' ELSE 'done' END AS state) AS s
"""

RESULTS = """
INSERT INTO results (job_id, verdict, error_class, error_message, cores, wall_s, load_s, compile_s, generate_s,
                     peak_memory_bytes, generated_token_ids, reference_token_ids, generated_text, reference_text,
                     first_divergence, host, core_range, torch_version, library_version, compiler_version,
                     reproduce, parallelism, visible_cores, compile_cache, reference_reused, verdict_reason,
                     tokens_match, prefill_rel_error, accelerator_loglik, reference_loglik, similarity, judge_kind,
                     judge_model, failure_signature, signature_id, graphs_compiled, predicted_peak_bytes_per_core,
                     created_at)
SELECT j.id, r.verdict,
       CASE WHEN r.verdict = 'ERROR' THEN j.error_class WHEN r.verdict = 'SKIPPED' THEN 'too_large' END,
       CASE WHEN r.verdict = 'ERROR' THEN 'neuronx-cc exited 70: ' || j.error_class || ' in graph ' || h %% 40 END,
       j.cores, 30 + h %% 3000 * 0.7, 3 + h %% 60 * 0.5, 20 + h %% 2500 * 0.6, 1 + h %% 30 * 0.2,
       (4 + h %% 20)::bigint << 30,
       ('[' || h %% 151000 || ', 374, 264, 279, 15966, 3200, 88, 2410, 315, 279, 4745, 11, 323, 432, 574, 1511, '
            '311, 1893, 1467, 389, 264, 1633, 5569, 13, 578, 1176, 2373, 1051, 304, 220, 10336, 15]')::json,
       ('[' || h %% 151000 || ', 374, 264, 279, 15966, 3200, 88, 2410, 315, 279, 4745, 11, 323, 432, 574, 1511, '
            '311, 1893, 1467, 389, 264, 1633, 5569, 13, 578, 1176, 2373, 1051, 304, 220, 10336, 15]')::json,
       ' Germany, in the 1440s, when Johannes Gutenberg built a press with movable metal type; run ' || j.id,
       ' Germany, in the 1440s, when Johannes Gutenberg built a press with movable metal type; run ' || j.id,
       CASE WHEN r.verdict = 'FAIL' THEN h %% 32 END,
       'host-' || j.id %% %(hosts)s, (j.id %% 8) * j.cores || '-' || (j.id %% 8 + 1) * j.cores - 1,
       j.torch_version, j.library_version, j.compiler_version,
       'python -m services.runner ' || j.model_id || ' --revision ' || j.sha || ' --task ' || j.task
           || ' --cores ' || j.cores || ' --compiler ' || j.compiler_version,
       CASE WHEN j.cores > 1 THEN 'tp' ELSE 'none' END, '0-' || j.cores - 1,
       (ARRAY['hit', 'miss', 'none'])[1 + h %% 3], h %% 4 <> 0,
       CASE r.verdict WHEN 'PASS' THEN 'tokens match the reference' WHEN 'FAIL' THEN 'tokens diverge at step '
            || h %% 32 || ' and the gap is not a near tie' END,
       r.verdict = 'PASS', (h %% 1000) * 1e-7, -1.2 - h %% 100 * 0.01, -1.2, 0.9 + h %% 100 * 0.001,
       CASE WHEN j.cores > 1 THEN 'local' END, CASE WHEN j.cores > 1 THEN 'Qwen/Qwen3-0.6B' END,
       CASE WHEN r.verdict IN ('ERROR', 'FAIL') THEN r.verdict || ': ' || coalesce(j.error_class, 'diverged') END,
       CASE WHEN r.verdict IN ('ERROR', 'FAIL')
            THEN substr(md5(r.verdict || coalesce(j.error_class, 'diverged')), 1, 16) END,
       1 + h %% 3, (3 + h %% 20)::bigint << 30, j.finished_at
FROM jobs AS j,
     LATERAL (SELECT (j.id * 2654435761) %% 1000003 AS h) AS i,
     LATERAL (SELECT CASE WHEN j.state = 'failed' THEN 'ERROR' WHEN h %% 7 = 0 THEN 'FAIL'
                          WHEN h %% 13 = 0 THEN 'SKIPPED' ELSE 'PASS' END AS verdict) AS r
WHERE j.state IN ('done', 'failed')
"""

WORKERS = """
INSERT INTO workers (name, host, pid, cores, core_count, queue, started_at, heartbeat_at,
                     library, library_version, torch_version, backend, compiler_name, compiler_version)
SELECT 'cores-' || c || '@host-' || h, 'host-' || h, 1000 + c, c::text, 1, %(worker_queue)s, now(), now(),
       'transformers', %(library_version)s, %(torch_version)s, %(backend)s, %(compiler_name)s, %(compiler)s
FROM generate_series(0, %(hosts)s - 1) AS h, generate_series(0, %(cores)s - 1) AS c
"""

QUEUES_SEEN = """
INSERT INTO queues_seen (queue, last_live_at, runtime)
SELECT q, now(), %(runtime)s::json FROM unnest(%(newest_queues)s::text[]) AS q
UNION ALL SELECT %(verdict_queue)s || '.host-' || h, now(), NULL FROM generate_series(0, %(hosts)s - 1) AS h
"""

# One finished sweep per round (its id is the round + 1), and a running one for the round in progress.
SWEEPS = """
INSERT INTO sweeps (id, slot, trigger, state, config, created_at, claimed_at, attempts, finished_at)
SELECT s, 'round-' || s, 'schedule', CASE WHEN s > %(rounds)s THEN 'running' ELSE 'done' END,
       '{"tasks": ["text-generation", "feature-extraction"], "limit": 200, "selected": []}',
       now() - make_interval(days => %(rounds)s + 1 - s), now() - make_interval(days => %(rounds)s + 1 - s),
       1, CASE WHEN s <= %(rounds)s THEN now() - make_interval(days => %(rounds)s - s) END
FROM generate_series(1, %(rounds)s + 1) AS s
"""

# A round's views: model m = 10 q + (1 + rank % 9) (text-generation) or 10 q (feature-extraction), q a
# permutation of the ranks that changes with the round and the view; the entry's job is the model's run of that
# round. The pinned selection: the text-generation models 11, 21, … in that order.
SWEEP_ENTRIES = f"""
INSERT INTO sweep_entries (sweep_id, model_id, task, view, rank, job_id, created)
SELECT k + 1, {_MODEL_ID}, l.task, l.view, l.rank,
       CASE WHEN k * %(models)s + m <= %(rows)s THEN k * %(models)s + m END, true
FROM generate_series(0, %(rounds)s - 1) AS k,
     (SELECT t.task, v.view, v.seed, r AS rank
      FROM (VALUES (%(tg)s, %(tg_listed)s), (%(fe)s, %(fe_listed)s)) AS t (task, listed),
           (VALUES ('trending', 0), ('downloads', 1)) AS v (view, seed),
           LATERAL generate_series(1, t.listed) AS r
      UNION ALL SELECT %(tg)s, 'selected', -1, r FROM generate_series(1, %(selected)s) AS r) AS l,
     LATERAL (SELECT CASE WHEN l.view = 'selected' THEN 10 * l.rank + 1
                          ELSE 10 * ((l.rank * 7919 + k * 104729 + l.seed * 3571) %% (%(models)s / 10))
                               + CASE WHEN l.task = %(fe)s THEN 10 ELSE 1 + l.rank %% 9 END END AS m) AS p
"""

ACTIVE_ENTRIES = f"""
INSERT INTO sweep_entries (sweep_id, model_id, task, view, rank, job_id, created)
SELECT %(rounds)s + 1, {_MODEL_ID}, CASE WHEN m %% 10 = 0 THEN %(fe)s ELSE %(tg)s END, 'trending',
       g - %(rows)s, g, true
FROM generate_series(%(rows)s + 1, %(total)s) AS g, LATERAL (SELECT 1 + (g - 1) %% %(models)s AS m) AS i
"""


def populate(conn: Any, rows: int, *, models: int | None = None, active: int = 3000) -> History:
    """Insert ``rows`` finished jobs with their results, ``active`` unfinished jobs, the sweeps and the workers,
    in the caller's transaction, on a migrated, empty schema (``conn``: a psycopg connection). ``models``: how many
    distinct models (a multiple of 10, at least 20 times the listed ranks; default one per 20 rows)."""
    models = models or max(rows // 200 * 10, 10 * max(LISTED.values()) * 2)
    if models % 10 or models / 10 <= max(LISTED.values()) or active > models:
        raise ValueError(f"{models} models cannot hold the views' ranks and {active} active jobs")
    history = History(rows=rows, models=models, rounds=-(-rows // models), active=active)
    newest = history.newest_stack
    runtime = RuntimeInfo(backend=BACKEND, compiler_name=COMPILER_NAME, **newest.model_dump())
    params = {
        "rows": rows,
        "total": rows + active,
        "models": models,
        "rounds": history.rounds,
        "compilers": list(COMPILERS),
        "libraries": list(LIBRARY_VERSIONS),
        "torches": list(TORCH_VERSIONS),
        "tg": Task.text_generation.value,
        "fe": Task.feature_extraction.value,
        "tg_hash": config_hash(Task.text_generation.value),
        "fe_hash": config_hash(Task.feature_extraction.value),
        "tg_listed": LISTED[Task.text_generation.value],
        "fe_listed": LISTED[Task.feature_extraction.value],
        "selected": SELECTED,
        "round_queues": [history.queue(k, n) for k in range(history.rounds) for n in CORE_SIZES],
        "round_digests": [history.stack(k).digest for k in range(history.rounds)],  # Job.stack_digest of each round
        "core_sizes": list(CORE_SIZES),
        "sizes": len(CORE_SIZES),
        "newest_queues": [history.queue(history.rounds - 1, n) for n in CORE_SIZES],
        "worker_queue": history.queue(history.rounds - 1, 1),
        "runtime": json.dumps(runtime.model_dump(mode="json")),
        "backend": BACKEND,
        "compiler_name": COMPILER_NAME,
        "verdict_queue": VERDICT_QUEUE_PREFIX,
        "hosts": HOSTS,
        "cores": CORES_PER_HOST,
        "compiler": newest.compiler_version,
        "library_version": newest.library_version,
        "torch_version": newest.torch_version,
    }
    conn.execute(JOBS, params)
    # Each result's foreign-key check is planned from the jobs table's statistics. A table that looks empty
    # (never analysed, or analysed by another session before this transaction commits: 0 rows) got a plan that
    # reads a whole index per check, (compiler_version, library, library_version, id) for "id = $1": hours.
    conn.execute("ANALYZE jobs")
    for statement in (RESULTS, WORKERS, QUEUES_SEEN, SWEEPS, SWEEP_ENTRIES, ACTIVE_ENTRIES):
        conn.execute(statement, params)
    # The ids were given: the next job the API inserts takes the next one.
    conn.execute("SELECT setval(pg_get_serial_sequence('jobs', 'id'), %(total)s)", params)
    conn.execute("SELECT setval(pg_get_serial_sequence('sweeps', 'id'), %(rounds)s + 1)", params)
    return history

"""The one place configuration is read from: the environment, prefix ``SUPPORTMATRIX_``.

Settings are split by the process that reads them: each is declared once, in the class of the process it configures
(``RunnerSettings``, ``ServiceSettings`` for what several service processes read, ``ApiSettings``, ``WorkerSettings``,
``ControlSettings``, ``CollectorSettings``), and ``Settings`` is their union. The runner reads its own class
(``get_runner_settings``); what the worker passes on to a runner child is derived from it (``RUNNER_SETTINGS``).
``tests/test_settings.py`` fails on a setting declared twice, a secret passed on, and a runner that reads another's.
"""

from __future__ import annotations

import json
import os
import socket
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.contracts.enums import BackendName, Fault, JudgeKind
from shared.contracts.run import RuntimeInfo


class SettingRole(StrEnum):
    """What a setting can change of what a test finds: each setting of ``Settings`` is marked with one
    (``Keyed[str]``, ...), and ``tests/test_verdict_corpus.py`` fails on a setting marked with none."""

    # Decides the verdict of a sharded text-generation run (the judge of rule 6, how a MoE is split): hashed into
    # such a job's config_hash (``verdict_settings``), so that another value is another test and an old row never
    # counts for it. An unsharded run, or another task's, reads none of them: its hash stays as it was.
    verdict = "verdict"
    # Decides what runs, and is keyed apart already: by the job's stack (the backend, the compiler version, which
    # names the cpu backend's dtype) or by its cores (what sizing hands out).
    keyed = "keyed"
    # Decides which measures past the verdict a row holds (the tiers): never the verdict, and each row says which
    # ran (a long generation not_run, its perf_iterations), so they stay out of the hash.
    tier = "tier"
    # The tests' and benches' instruments: a planted fault changes verdicts on purpose, a thread count moves the
    # benign noise the tolerances absorb. Never set in production.
    instrument = "instrument"
    # How, where and how long the service runs (budgets, addresses, schedules, limits): never what a test finds.
    # A budget that runs out is an ERROR that says which.
    operation = "operation"


_T = TypeVar("_T")
# A setting's type, marked with its role: ``moe_parallelism: DecidesVerdict[Literal["ep", "ep_tp"]]``.
DecidesVerdict = Annotated[_T, SettingRole.verdict]
Keyed = Annotated[_T, SettingRole.keyed]
Tier = Annotated[_T, SettingRole.tier]
Instrument = Annotated[_T, SettingRole.instrument]
Operational = Annotated[_T, SettingRole.operation]


class Withheld(StrEnum):
    """Why a worker withholds a runner's setting from the environment it gives every runner child: the others are
    passed on (``RUNNER_SETTINGS``), these only where ``child_environment``'s caller hands them over."""

    # A credential (a token; a URL that may hold a password): handed only to the one child that needs it, in
    # child_environment's ``secrets``, and never through the zygote, whose memory every later child shares
    # (shared.zygote_client.SECRET_NAMES). Marked wherever it lives, a runner's setting or not.
    secret = "secret"
    # Set for each child by what starts it: the zygote a runner was forked from (shared.zygote_client).
    per_child = "per_child"


# A setting's type, marked as withheld from runner children: ``judge_token: Secret[Operational[str | None]]``.
Secret = Annotated[_T, Withheld.secret]
PerChild = Annotated[_T, Withheld.per_child]


class _FromEnvironment(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SUPPORTMATRIX_", extra="ignore")


class RunnerSettings(_FromEnvironment):
    """What a runner child reads, and all it reads (``python -m services.runner``, its ranks and its reference):
    what shapes or places its run. The worker passes these on to every runner child (``RUNNER_SETTINGS``) but the
    ``Withheld`` ones; every other process reads them too, through ``Settings``."""

    data_dir: Operational[Path] = Field(Path(".data"), description="Root of everything the service writes locally.")
    backend: Keyed[BackendName] = "cpu"
    cache_dir: Operational[Path | None] = Field(
        None, description="Compile caches (inductor, NEFF); default data_dir/cache."
    )
    # This host's name: its verdict queue (a job's verdict stage runs where its artifacts are) and lease owners.
    host_name: Operational[str] = Field(default_factory=socket.gethostname)

    # What the cpu backend hands to torch.compile; tests may pick the cheaper "aot_eager".
    cpu_compile_backend: Keyed[str] = "inductor"

    # A stage's budgets. job_timeout_s bounds everything a runner does but compile (download, load, generate, the
    # CPU reference); the compile has its own, sized for a cold neuronx-cc compile of a 16-core model (users
    # report 45 minutes and more for one large graph, aws-neuron-sdk#646). A timeout names the phase that ran out.
    job_timeout_s: Operational[float] = Field(3600.0, gt=0, description="A runner's limit outside compilation.")
    compile_timeout_s: Operational[float] = Field(10800.0, gt=0, description="The compile phase's own budget.")
    # The tiers past the 32-token verdict, on the same cores after the compile (shared.testconfig sizes them):
    # timed generations for speed (0 iterations: off) and the long-generation check.
    perf_iterations: Tier[int] = Field(3, ge=0, le=100)
    long_generation: Tier[bool] = True

    # One core's memory, default per backend (24 GiB on trn2 at LNC=2).
    core_memory_gib: Keyed[float | None] = Field(None, gt=0)
    moe_parallelism: DecidesVerdict[Literal["ep", "ep_tp"]] = Field(
        "ep", description="experts only, or experts + TP attention"
    )

    judge_kind: DecidesVerdict[JudgeKind] = JudgeKind.likelihood
    judge_model: DecidesVerdict[str] = Field(
        "Qwen/Qwen3-0.6B", description="the local judge's Hub id or directory; or the endpoint's"
    )
    judge_url: Operational[str | None] = Field(
        None, description="an OpenAI-compatible base URL, e.g. http://host:8000/v1"
    )
    judge_token: Secret[Operational[str | None]] = None  # the verdict stage's runner only
    judge_loglik_slack: DecidesVerdict[float] = Field(1.0, ge=0)

    # Test and bench only: plant a fault in the cpu backend's accelerator run (services.runner.faults).
    cpu_fault: Instrument[Fault | None] = None
    # The cpu backend's run dtype, of the accelerator run and the reference alike: bfloat16 meets the
    # tolerances a trn2 run is held to.
    cpu_dtype: Keyed[Literal["float32", "bfloat16"]] = "float32"
    # cpu backend threads per accelerator rank (0: torch's default); a benign-noise knob for tests.
    cpu_threads: Instrument[int] = Field(0, ge=0)

    # The shared compile cache: hf://buckets/<ns>/<name>, any fsspec URL, or a directory; pushed to only
    # when compile_cache_push is set (with compile_cache_token for a bucket, an accelerator stage's runner only).
    compile_cache_remote: Operational[str | None] = None
    compile_cache_push: Operational[bool] = False
    compile_cache_token: Secret[Operational[str | None]] = None

    # A runner retries an unreachable Hub after each of these pauses (after huggingface_hub's own retries).
    hub_retry_delays_s: Operational[list[float]] = [2.0, 4.0, 8.0]
    # Set by the worker in the environment of a runner forked from the zygote: where its own children fork from.
    runner_zygote: PerChild[Operational[str | None]] = None

    @model_validator(mode="after")
    def _fill_runner_paths(self) -> RunnerSettings:
        self.data_dir = self.data_dir.expanduser().resolve()
        self.cache_dir = (self.cache_dir or self.data_dir / "cache").expanduser().resolve()
        return self

    def stage_limit_s(self, compiles: bool) -> float:
        """The hard limit of a stage's runner: its budget outside compilation, and the compile's when it
        compiles (the accelerator stage). The worker's supervisor, the planner and the fleet simulator use it."""
        return self.job_timeout_s + (self.compile_timeout_s if compiles else 0.0)

    @property
    def cache_path(self) -> Path:
        assert self.cache_dir is not None
        return self.cache_dir


class ServiceSettings(RunnerSettings):
    """What more than one kind of service process reads (the API, the host launcher and its workers, the control
    worker, beat), besides the runner's: the database and the broker, liveness and leases, what a job is planned
    for, and the Hub's metadata calls."""

    database_url: Secret[Operational[str]] = Field(
        "", description="SQLAlchemy URL; default: a SQLite file in data_dir."
    )
    redis_url: Secret[Operational[str]] = "redis://127.0.0.1:6379/0"
    # Redis re-delivers an unacknowledged message after this; a backstop only, since the reconciler re-sends
    # lost jobs after the lease timeout. None: the accelerator stage's hard limit + 10 * lease_timeout_s.
    visibility_timeout_s: Operational[float | None] = Field(None, gt=0)

    heartbeat_interval_s: Operational[float] = Field(5.0, gt=0)
    lease_timeout_s: Operational[float] = Field(
        120.0, gt=0, description="A running job whose heartbeat is older is stale."
    )
    worker_stale_s: Operational[float] = Field(60.0, gt=0, description="A worker whose heartbeat is older is not live.")

    # Compiler version a job gets when no live worker says what it serves (e.g. "inductor-2.13.0+cpu").
    default_compiler: Keyed[str | None] = None
    # The runtime the fleet serves — RuntimeInfo's JSON, as `python -m services.worker --describe` prints it on the
    # fleet's image — declared once for the API, beat and the launchers (the ConfigMap): the API plans a job for it
    # whoever is up (an autoscaled fleet at zero starts on the jobs planned for it), beside any other stack a live
    # worker serves, and a host launcher serving another refuses to start. None: the live workers' stacks, else those
    # last seen live, else this host's own (shared.jobs.runtimes.served_runtimes).
    fleet_runtime: Keyed[RuntimeInfo | None] = None
    remote_code_orgs: Operational[list[str]] = Field([], description="orgs whose trust_remote_code models are tested")

    # Every Hub metadata call gives up after hub_timeout_s; model_info answers are kept hub_info_cache_s per
    # (model, revision).
    hub_timeout_s: Operational[float] = Field(5.0, gt=0)
    hub_info_cache_s: Operational[float] = Field(300.0, ge=0)

    @model_validator(mode="after")
    def _fill_database_url(self) -> ServiceSettings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'supportmatrix.db'}"
        return self


class ApiSettings(ServiceSettings):
    """The API's own (services/api)."""

    api_max_body_bytes: Operational[int] = Field(65536, gt=0)
    page_limit_max: Operational[int] = Field(1000, gt=0)
    # GET /results keeps its answers by query and the records' version (services/api/answers.py), per API process.
    results_cache_bytes: Operational[int] = Field(
        64 * 2**20, ge=0, description="bytes of kept /results answers (0: none kept)"
    )
    # What the results page prices a run's core-seconds at. Default: a trn2.48xlarge on demand (US East (Ohio),
    # Linux) at $44.701 an hour, divided by its 64 NeuronCores (LNC=2). Source: AWS's EC2 On-Demand pricing
    # (https://aws.amazon.com/ec2/pricing/on-demand/) as listed by instances.vantage.sh — NOT re-verified on
    # 2026-11-30: neither page was reachable from here. Check it, or set SUPPORTMATRIX_PRICE_PER_CORE_HOUR_USD.
    price_per_core_hour_usd: Operational[float] = Field(
        44.701 / 64, gt=0, description="USD per core-hour of a run's cost"
    )

    # The API's write routes. Each token may make api_rate_limit requests in any api_rate_window_s seconds,
    # counted in Redis so that the limit holds across API processes.
    api_rate_limit: Operational[int] = Field(60, ge=1, description="write requests per token per window")
    api_rate_window_s: Operational[int] = Field(60, ge=1)
    # Public reads that scan (a diff's pages, the /changes page): per client address per window.
    api_scan_rate_limit: Operational[int] = Field(
        120, ge=1, description="reads that scan per client address per window"
    )
    diff_page_cells: Operational[int] = Field(500, ge=1, description="cells of the newer version a diff page compares")
    # Submissions wait on the Hub: each API process runs at most api_hub_lookups of them at once, in threads
    # of their own; one that finds no free slot within api_hub_wait_s is answered 503.
    api_hub_lookups: Operational[int] = Field(8, ge=1, le=64)
    api_hub_wait_s: Operational[float] = Field(5.0, ge=0)
    api_retry_after_s: Operational[int] = Field(5, ge=1, description="the Retry-After of a 503 (a dependency is down)")
    # /metrics serves a snapshot of its SQL-derived families, retaken every metrics_refresh_s seconds in each API
    # process (about a second of queries at 1 M results); 0 reads them at each scrape.
    metrics_refresh_s: Operational[float] = Field(
        10.0, ge=0, description="seconds between /metrics snapshots (0: at each scrape)"
    )


def _uid_range(text: str) -> range:
    """``FIRST-LAST`` (both included), as SUPPORTMATRIX_SANDBOX_UIDS spells a range of uids."""
    first, last = (int(bound) for bound in text.split("-"))
    return range(first, last + 1)


class WorkerSettings(ServiceSettings):
    """The host launcher's and its stage workers' own (services/worker: host, supervise, the stage tasks)."""

    # A host has host_cores (on cpu a count that may exceed the real CPUs), handed out as core groups.
    host_cores: Keyed[int] = Field(64, ge=1, le=1024)
    verdict_workers: Operational[int] = Field(1, ge=0, le=64, description="CPU workers of the verdict stage per host")
    max_attempts: Operational[int] = Field(
        3, ge=1, description="Deliveries of one job before it ends ERROR(worker_lost)."
    )
    # The host launcher keeps a zygote (shared/zygote_client.py): runners fork from a process that has imported torch
    # and transformers once, instead of importing them afresh, twice per stage, while the job's cores wait.
    zygote: Operational[bool] = True
    # Who runners run as when the worker is root (shared/isolation.py): transformers' code as runner_user (empty:
    # runners run as the worker, with its access), and a repo's own (trust_remote_code) as a uid of its job's own, the
    # first of sandbox_uids plus the job's id modulo the range's length (its gid the same number): two jobs share one
    # only when their ids are the range's length apart, so none reads another's files or signals its processes.
    # Numbers no account holds (a worker refuses to start otherwise), from 1000 (never root's or a system account's)
    # and below 65536 so that a user-namespaced container maps them.
    runner_user: Operational[str] = "supportmatrix-runner"
    sandbox_uids: Operational[str] = Field("60100-60899", pattern=r"^\d+-\d+$")
    # A job's artifacts are removed when its row is written, but kept this long after a FAIL, for inspection.
    artifact_retention_s: Operational[float] = Field(7 * 24 * 3600.0, ge=0)

    @field_validator("sandbox_uids")
    @classmethod
    def _a_range_of_unprivileged_uids(cls, value: str) -> str:
        uids = _uid_range(value)
        if not uids or uids.start < 1000 or uids.stop > 65536:
            raise ValueError(
                f"{value!r} is not FIRST-LAST with 1000 <= FIRST <= LAST < 65536: a repo's code must never run as "
                "root or a system account, and a user-namespaced container maps only uids below 65536"
            )
        return value

    @property
    def sandbox_uid_range(self) -> range:
        return _uid_range(self.sandbox_uids)

    @property
    def isolates_runners(self) -> bool:
        """Runners run as users of their own: the worker is root (it can switch users) and runner_user is set."""
        return os.geteuid() == 0 and bool(self.runner_user)

    @property
    def runner_home(self) -> Path:
        """The runner user's home, in the data dir: its Hub cache unless HF_HOME says otherwise."""
        return self.data_dir / "home" / self.runner_user

    @property
    def runner_hub_home(self) -> Path | None:
        """The runner user's Hub cache when the operator placed one (HF_HOME): a directory of its own in it, as the
        API and the worker, as root, download into HF_HOME itself (a model's config for sizing) and would leave
        the runner user entries it cannot write. None: its home's default."""
        return Path(os.environ["HF_HOME"]) / self.runner_user if "HF_HOME" in os.environ else None


class ControlSettings(ServiceSettings):
    """The reconciler's and the sweeps': beat sends them on schedule, the control worker runs them (the host
    launcher reads the reconciler's period and grace to know how long a lost message takes to come back)."""

    # The reconciler (on the locked beat scheduler): SQL is the truth, the broker only a delivery. Every
    # reconcile_every_s it re-sends jobs queued longer than queue_grace_s since their last message and jobs
    # whose lease lapsed, and ends ERROR(no_worker) the jobs of a queue no live worker served for
    # no_worker_after_s.
    reconcile_every_s: Operational[float] = Field(15.0, gt=0, le=30)
    queue_grace_s: Operational[float] = Field(60.0, gt=0)
    no_worker_after_s: Operational[float] = Field(900.0, gt=0)
    sweep_lease_s: Operational[float] = Field(
        900.0, gt=0, description="A running sweep not finished after this is re-sent."
    )
    # A sweep that meets an unreachable Hub is tried again after each of these pauses, then ends failed.
    sweep_retry_delays_s: Operational[list[float]] = [2.0, 4.0, 8.0, 16.0]

    # Sweeps: every sweep_every_s seconds (0: never by schedule), per task the top sweep_limit trending and
    # most-downloaded models, plus the pinned selection ("org/name" or "org/name:task").
    sweep_every_s: Operational[float] = Field(0, ge=0)
    # None: every task whose declaration sweeps (tasks.SWEPT_TASKS)
    sweep_tasks: Operational[list[str] | None] = None
    sweep_limit: Operational[int] = Field(20, ge=1, le=1000)
    sweep_selected: Operational[list[str]] = []
    sweep_rerun_flips: Operational[int] = Field(
        0, ge=0, description="rerun FLAKY cells whose runs flipped this often (0: never)"
    )


class CollectorSettings(ServiceSettings):
    """The collector's own: where the export is written, and the Hub dataset repo it is pushed to."""

    export_dir: Operational[Path | None] = Field(None, description="Parquet export root; default data_dir/export.")
    # The Hub dataset repo the collector pushes the export to (none: export locally only), and its token.
    publish_repo: Operational[str | None] = None
    publish_token: Secret[Operational[str | None]] = None

    @model_validator(mode="after")
    def _fill_export_dir(self) -> CollectorSettings:
        self.export_dir = (self.export_dir or self.data_dir / "export").expanduser().resolve()
        return self

    @property
    def export_path(self) -> Path:
        assert self.export_dir is not None
        return self.export_dir


class Settings(ApiSettings, WorkerSettings, ControlSettings, CollectorSettings):
    """Every setting: what a process reads that reads many (the API, the workers, the control worker, beat, the
    command line). It declares none of its own."""


def setting_role(name: str) -> SettingRole | None:
    """The role a setting is marked with (``SettingRole``); None for a setting marked with none."""
    roles = [mark for mark in Settings.model_fields[name].metadata if isinstance(mark, SettingRole)]
    return roles[0] if len(roles) == 1 else None


def withheld(name: str) -> Withheld | None:
    """Why a setting is withheld from runner children (``Withheld``); None for one passed on, or not the runner's."""
    marks = [mark for mark in Settings.model_fields[name].metadata if isinstance(mark, Withheld)]
    return marks[0] if marks else None


VERDICT_SETTINGS = tuple(sorted(name for name in Settings.model_fields if setting_role(name) == SettingRole.verdict))


@lru_cache
def get_settings() -> Settings:
    return Settings()


@lru_cache
def get_runner_settings() -> RunnerSettings:
    """A runner's settings (services/runner reads no others): from its environment, which the worker built."""
    return RunnerSettings()


# The settings every runner child is given: the runner's own (what shapes or places its run), but a secret or a
# per-child one. Never another process's, such as the database or broker URLs: a child loads checkpoints that nobody
# here wrote, and reads nothing else.
RUNNER_SETTINGS = frozenset(name for name in RunnerSettings.model_fields if withheld(name) is None)
# What a process needs from the host's environment: the interpreter and locale, huggingface_hub's settings
# (its token is passed on only where a gated model needs it), and the accelerator runtimes' own variables.
INHERITED_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV"}
    | {"HF_HOME", "HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}
)
INHERITED_PREFIXES = ("HF_HUB_", "NEURON_", "TORCH", "CUDA_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "FI_", "XLA_")


def _env_value(value: object) -> str:
    if isinstance(value, list):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def child_environment(
    settings: WorkerSettings, overrides: dict[str, str], secrets: dict[str, str] | None = None
) -> dict[str, str]:
    """The allow-listed environment of a runner: the host's basics, the runner settings, ``overrides``,
    and only the ``secrets`` this child is meant to hold (a gated model's HF_TOKEN, the judge's token)."""
    env = {k: v for k, v in os.environ.items() if k in INHERITED_NAMES or k.startswith(INHERITED_PREFIXES)}
    # huggingface_hub would read a token saved by `hf auth login` under HF_HOME: point it at none.
    env["HF_TOKEN_PATH"] = str(settings.data_dir / "no-hub-token")
    if settings.isolates_runners:  # the runner user's own, not the worker's (shared.isolation)
        env |= {"HOME": str(settings.runner_home), "USER": settings.runner_user, "LOGNAME": settings.runner_user}
        if settings.runner_hub_home is not None:
            env["HF_HOME"] = str(settings.runner_hub_home)
    for name in RUNNER_SETTINGS:
        value = getattr(settings, name)
        if value is not None:
            env[f"SUPPORTMATRIX_{name.upper()}"] = _env_value(value)
    return env | overrides | (secrets or {})


def inherited_environment(overrides: dict[str, str]) -> dict[str, str]:
    """A runner's own children (ranks, the reference) get the runner's environment — already allow-listed
    by the worker — with ``overrides`` applied."""
    return {**os.environ, **overrides}


def hub_token() -> str | None:
    """huggingface_hub's token, for the one child that needs it (a gated model's runner)."""
    return os.environ.get("HF_TOKEN")

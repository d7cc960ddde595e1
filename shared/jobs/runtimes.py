"""What is served: the runtimes live workers serve, and the runtimes a submission plans its jobs for."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Sequence

import sqlalchemy as sa
from cachetools import TTLCache, cached
from sqlalchemy.orm import Session

from shared.contracts.enums import CompilerName
from shared.contracts.run import IDENTITY_VERSIONS, LIBRARY, RuntimeInfo
from shared.db.models import Worker, utcnow
from shared.installed import cpu_compiler, installed_version, neuron_versions
from shared.settings import Settings


class UnknownCompiler(ValueError):
    pass


class NoRuntime(RuntimeError):
    pass


def live_since(settings: Settings, now: dt.datetime | None = None) -> dt.datetime:
    """A worker whose last heartbeat is older than this is not live."""
    return (now or utcnow()) - dt.timedelta(seconds=settings.worker_stale_s)


def live_workers(session: Session, settings: Settings, now: dt.datetime | None = None) -> Sequence[Worker]:
    since = live_since(settings, now)
    return session.scalars(sa.select(Worker).where(Worker.heartbeat_at >= since).order_by(Worker.name)).all()


# The columns of a worker that make up its RuntimeInfo.
RUNTIME_COLUMNS = [getattr(Worker, name) for name in RuntimeInfo.model_fields]
# How long the live workers' runtimes are kept, per process and engine: every submission plans its jobs for
# them, and they change only when a worker starts or stops (which heartbeats tell over worker_stale_s). A newly
# live worker's runtime is served within this many seconds.
RUNTIMES_SNAPSHOT_S = 1.0


@cached(
    TTLCache(maxsize=64, ttl=RUNTIMES_SNAPSHOT_S),
    key=lambda session, settings: (session.get_bind().engine, settings.worker_stale_s),
    lock=threading.Lock(),
)
def live_runtimes(session: Session, settings: Settings) -> tuple[RuntimeInfo, ...]:
    """Distinct runtimes of live workers, as they were at most ``RUNTIMES_SNAPSHOT_S`` ago.

    An identity (``IDENTITY_VERSIONS``: compiler, library, TorchNeuron and runtime versions) is served by the
    runtime of its first live worker by name, in that order. Read as the distinct runtime columns (with the first
    worker name of each), not as worker rows: a fleet has hundreds of workers and a handful of runtimes.
    """
    first_worker = sa.func.min(Worker.name)
    distinct = (
        sa.select(first_worker, *RUNTIME_COLUMNS)
        .where(Worker.heartbeat_at >= live_since(settings))
        .group_by(*RUNTIME_COLUMNS)
        .order_by(first_worker)
    )
    seen: dict[tuple[str, ...], RuntimeInfo] = {}
    for _, *columns in session.execute(distinct):
        runtime = RuntimeInfo(**dict(zip(RuntimeInfo.model_fields, columns, strict=True)))
        seen.setdefault(tuple(getattr(runtime, version) for version in IDENTITY_VERSIONS), runtime)
    return tuple(seen.values())


def served_runtimes(session: Session, settings: Settings) -> list[RuntimeInfo]:
    """The live workers' runtimes (``live_runtimes``), or the configured default when none is live."""
    live = live_runtimes(session, settings)
    if live:
        return list(live)
    default = default_runtime(settings)
    return [default] if default else []


def default_runtime(settings: Settings) -> RuntimeInfo | None:
    """The runtime a job is planned for when no live worker says what it serves.

    Read from package metadata so that the API never imports torch; None when it cannot be known here.
    """
    torch_version = installed_version("torch")
    library_version = installed_version(LIBRARY)
    if settings.backend == "neuron":
        compiler_name = CompilerName.neuronx_cc.value
        compiler_version = settings.default_compiler or installed_version("neuronx-cc")
    elif settings.backend == "cpu" and torch_version and not settings.default_compiler:
        # what this host's cpu workers will serve (a job planned for another compiler would find no worker)
        compiler_name, compiler_version = cpu_compiler(settings.cpu_compile_backend, torch_version, settings.cpu_dtype)
    else:
        compiler_name = CompilerName.inductor.value
        compiler_version = settings.default_compiler or (torch_version and f"inductor-{torch_version}")
    if not (compiler_version and library_version):
        return None
    return RuntimeInfo(
        backend=settings.backend,
        compiler_name=compiler_name,
        compiler_version=compiler_version,
        library_version=library_version,
        torch_version=torch_version or "unknown",
        **(neuron_versions() if settings.backend == "neuron" else {}),
    )


def plan_runtimes(session: Session, settings: Settings, compilers: list[str] | None) -> list[RuntimeInfo]:
    served = served_runtimes(session, settings)
    if not served:
        raise NoRuntime(
            "no live worker serves a compiler and no default is configured (SUPPORTMATRIX_DEFAULT_COMPILER)"
        )
    if compilers is None:
        return served
    planned = []
    for version in dict.fromkeys(compilers):
        matches = [r for r in served if r.compiler_version == version]
        if not matches:
            raise UnknownCompiler(
                f"compiler {version!r} is not served; served: {sorted({r.compiler_version for r in served})}"
            )
        planned.extend(matches)
    return planned

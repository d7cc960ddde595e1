"""What is served: the runtimes live workers serve, and the runtimes a submission plans its jobs for."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Sequence

import sqlalchemy as sa
from cachetools import TTLCache, cached
from sqlalchemy.orm import Session

from shared.contracts.enums import CompilerName
from shared.contracts.run import LIBRARY, RuntimeInfo, Stack
from shared.db.models import QueueSeen, Worker, utcnow
from shared.installed import NEURON_RUNTIME_PACKAGE, cpu_compiler, installed_version, neuron_versions
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

    A stack (``Stack``: compiler, torch, TorchNeuron, Neuron runtime and library versions) is served by the
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
    seen: dict[Stack, RuntimeInfo] = {}
    for _, *columns in session.execute(distinct):
        runtime = RuntimeInfo(**dict(zip(RuntimeInfo.model_fields, columns, strict=True)))
        seen.setdefault(runtime.stack(), runtime)
    return tuple(seen.values())


def served_runtimes(session: Session, settings: Settings) -> list[RuntimeInfo]:
    """The configured fleet's runtime (``Settings.fleet_runtime``) and any other the live workers serve, whoever is
    up; with none configured, the live workers' runtimes (``live_runtimes``), when none is live those served last
    (``last_served_runtimes``), else this host's default (``default_runtime``: NoRuntime when it cannot be known
    here)."""
    live = live_runtimes(session, settings)
    if settings.fleet_runtime is not None:
        served: dict[Stack, RuntimeInfo] = {}
        for runtime in (*live, settings.fleet_runtime):
            served.setdefault(runtime.stack(), runtime)  # a live worker's own description of its stack first
        return list(served.values())
    if live:
        return list(live)
    last = last_served_runtimes(session, settings)
    if last:
        return last
    return [default_runtime(settings)]


def last_served_runtimes(session: Session, settings: Settings) -> list[RuntimeInfo]:
    """The runtimes of the backend's job queues last seen live, of the configured default compiler when one is set:
    what a fleet scaled to zero serves again when it scales up (a stack a worker would refuse otherwise, since only the
    worker knows its exact TorchNeuron and runtime builds). The fleet's last moment, as the newest queue's last live
    time less a worker's staleness: a stack that stopped earlier is not served now. Newest first, a stack once."""
    seen = session.execute(
        sa.select(QueueSeen.runtime, QueueSeen.last_live_at)
        .where(QueueSeen.runtime.is_not(None))
        .order_by(QueueSeen.last_live_at.desc(), QueueSeen.queue)
    ).all()
    runtimes = [(RuntimeInfo.model_validate(runtime), at) for runtime, at in seen]
    wanted = [
        (runtime, at)
        for runtime, at in runtimes
        if runtime.backend == settings.backend and settings.default_compiler in (None, runtime.compiler_version)
    ]
    if not wanted:
        return []
    since = wanted[0][1] - dt.timedelta(seconds=settings.worker_stale_s)
    served: dict[Stack, RuntimeInfo] = {}
    for runtime, at in wanted:
        if at >= since:
            served.setdefault(runtime.stack(), runtime)
    return list(served.values())


# What an operator does when no stack can be planned (docs/kubernetes.md#planning-with-no-worker-live).
NO_STACK_KNOWN = (
    "declare the fleet's runtime in SUPPORTMATRIX_FLEET_RUNTIME (what `python -m services.worker --describe` prints "
    "on the fleet's image), or start one worker of the fleet's image once, so that its queues are seen with the stack "
    "it serves, then submit again"
)


def refuse_other_fleet(settings: Settings, served: RuntimeInfo) -> str | None:
    """Why a host launcher serving ``served`` must not start, or None: the fleet is declared
    (``Settings.fleet_runtime``) as another runtime, whose jobs the API plans and this host's workers would never
    take (a job waits on its stack's queue: ERROR(no_worker) after SUPPORTMATRIX_NO_WORKER_AFTER_S)."""
    fleet = settings.fleet_runtime
    if fleet is None or (fleet.backend, fleet.compiler_name, fleet.stack()) == (
        served.backend, served.compiler_name, served.stack()
    ):  # fmt: skip
        return None
    return (
        f"this host serves {served.stack().label()} ({served.backend}), but the fleet is declared as "
        f"{fleet.stack().label()} ({fleet.backend}; SUPPORTMATRIX_FLEET_RUNTIME), the stack the API plans jobs for: "
        "run the fleet's image here, or declare this host's runtime, as `python -m services.worker --describe` "
        f"prints it: {served.model_dump_json()}"
    )


def default_runtime(settings: Settings) -> RuntimeInfo:
    """The runtime a job is planned for when no worker is live and no queue says the stack it served.

    Read from package metadata so that the API never imports torch. NoRuntime, with the reason, when the whole stack
    cannot be known here: a job planned for a guessed stack would wait on a queue no worker consumes and end
    ERROR(no_worker). On neuron that is every API that runs without TorchNeuron and the Neuron runtime installed
    (the cpu image): only a neuron worker knows its builds.
    """
    torch_version = installed_version("torch")
    library_version = installed_version(LIBRARY)
    neuron = neuron_versions() if settings.backend == "neuron" else {}
    if settings.backend == "neuron":
        compiler_name = CompilerName.neuronx_cc.value
        compiler_version = settings.default_compiler or installed_version("neuronx-cc")
        packages = {
            "torch": torch_version,
            "torch-neuronx": neuron["torch_neuronx_version"],
            NEURON_RUNTIME_PACKAGE: neuron["neuron_runtime_version"],
        }
        unknown = [package for package, version in packages.items() if not version]
        if compiler_version and library_version and unknown:
            raise NoRuntime(
                f"no neuron worker is live and none was seen with its stack: this API cannot know the stack of "
                f"neuronx-cc {compiler_version} ({', '.join(unknown)} not installed here), and a job planned for "
                f"a guessed one would find no worker; {NO_STACK_KNOWN}"
            )
    elif settings.backend == "cpu" and torch_version and not settings.default_compiler:
        # what this host's cpu workers will serve (a job planned for another compiler would find no worker)
        compiler_name, compiler_version = cpu_compiler(settings.cpu_compile_backend, torch_version, settings.cpu_dtype)
    else:
        compiler_name = CompilerName.inductor.value
        compiler_version = settings.default_compiler or (torch_version and f"inductor-{torch_version}")
    if not (compiler_version and library_version):
        raise NoRuntime(
            f"no live worker serves a compiler, none was seen with its stack, and no default is configured "
            f"(SUPPORTMATRIX_DEFAULT_COMPILER): {NO_STACK_KNOWN}"
        )
    return RuntimeInfo(
        backend=settings.backend,
        compiler_name=compiler_name,
        compiler_version=compiler_version,
        library_version=library_version,
        torch_version=torch_version,  # None where not installed: the stack spells it "" (``stack_of``)
        **neuron,
    )


def plan_runtimes(
    session: Session, settings: Settings, compilers: list[str] | None, stacks: list[Stack] | None = None
) -> list[RuntimeInfo]:
    """The served runtimes a submission plans its jobs for: all of them, those of ``compilers`` (every stack served
    on each), or exactly ``stacks`` (a rerun of one cell: its stack, not every stack of its compiler)."""
    served = served_runtimes(session, settings)
    if stacks is not None:
        by_stack = {r.stack(): r for r in reversed(served)}  # the first runtime served of each stack
        unserved = [stack.label() for stack in stacks if stack not in by_stack]
        if unserved:
            raise UnknownCompiler(f"stack {unserved[0]} is not served; served: {[r.stack().label() for r in served]}")
        return [by_stack[stack] for stack in dict.fromkeys(stacks)]
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

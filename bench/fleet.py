"""A discrete-event simulation of a sweep on a fleet of hosts, driving the project's own scheduling code.

What it imports rather than re-implements: the host launcher's planning (``services.worker.planner.plan_host``
on the ``HostState`` the launcher builds: its running jobs plus its share (``services.worker.host.share``) of
the queued ones, the busy and draining workers, the expected seconds per size), and queue routing
(``shared.jobs.queues.job_queue``: one FIFO queue per software stack and group size, shared by every host's
workers of that size, as Redis serves it). What it models: a worker takes the head of its queue
when idle; a drained idle worker exits, a drained busy one finishes its job first; a started worker is ready
after ``worker_start_s``; a host re-plans ``poll_s`` after anything changed (a job queued, started or
finished, a worker started or exited); a job's verdict stage runs after its accelerator stage on one of the
host's ``verdict_workers`` CPU slots, off the cores.

Baselines on the same jobs: fixed layouts (workers started once, never re-planned; a job larger than every
group cannot run) and one model at a time per host (the public Space's script: load, compile, generate,
compare, then the next model).

A host serves one stack (its image's: a compiler version, with the one torch and transformers of ``stack``), and
takes jobs from that stack's queues only. The fleet is static (``FleetSimulation``: every host up from the start,
hosts spread over the compiler versions in turn) or autoscaled (``AutoscaledFleet``: hosts started as the
trn2-autoscaled overlay's KEDA ScaledJob asks, each leaving once idle, see ``Autoscaler``), and each is billed for
its hosts' whole time up, all of a host's cores.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.worker import planner
from services.worker.host import STARTING_S, share
from shared.contracts.run import CORE_SIZES, Stack
from shared.cores import CoreGroup
from shared.jobs.queues import job_queue
from shared.settings import Settings

BACKEND, COMPILER = "neuron", "2.21.0"
LIBRARY_VERSION = "5.24.0"  # the transformers of every simulated image


def stack(compiler: str) -> Stack:
    """The stack a simulated image of ``compiler`` runs: the versions its jobs' queues are named by."""
    return Stack(compiler_version=compiler, library_version=LIBRARY_VERSION)


@dataclass(frozen=True)
class SimJob:
    name: str
    cores: int
    accelerator_s: float  # on the cores: load, compile, generate
    verdict_s: float  # on the host's CPUs, after the cores are given back
    submitted_s: float = 0.0
    parameters: int = 0
    timed_out: bool = False  # the duration model made it longer than the stage's limit
    compiler: str = COMPILER  # the compiler version it is tested under (its ``stack``): its queue, and its hosts


@dataclass(frozen=True)
class Timings:
    worker_start_s: float = 1.0
    worker_exit_s: float = 0.5  # an idle worker's warm shutdown
    poll_s: float = 1.0  # the launcher re-plans once the backlog held still for a poll of 0.5 s
    dispatch_s: float = 0.1  # an idle worker takes a queued job
    verdict_workers: int = 4


# The accelerator stage's hard limit, as the runner and the launcher know it (Settings.stage_limit_s).
STAGE_LIMIT_S = Settings().stage_limit_s(compiles=True)


def within_limit(jobs: Sequence[SimJob], stage_limit_s: float = STAGE_LIMIT_S) -> list[SimJob]:
    """The jobs as the fleet runs them: one the duration model makes longer than the stage's limit ends
    ERROR(timeout) at the limit, holding its cores until then."""
    return [
        replace(j, accelerator_s=stage_limit_s, timed_out=True) if j.accelerator_s > stage_limit_s else j for j in jobs
    ]


@dataclass
class SimResult:
    makespan_s: float
    lower_bound_s: float
    jobs_run: int
    jobs_unrunnable: int
    core_utilisation: float  # the jobs' own accelerator-stage core-seconds / (cores x makespan)
    largest_size_wait_s: float  # longest time a job of the largest size waited between queued and started
    jobs_timed_out: int = 0  # ended at the stage's hard limit
    starts: dict[str, float] = field(default_factory=dict)
    ends: dict[str, float] = field(default_factory=dict)
    used_core_s: float = 0.0  # the jobs' accelerator-stage core-seconds
    billed_core_s: float = 0.0  # every host's cores from its start to its stop (a static fleet: to the makespan)
    hosts_up: list[tuple[float, float]] = field(default_factory=list)  # each host's (start, stop), seconds

    @property
    def ratio(self) -> float:
        return self.makespan_s / self.lower_bound_s

    @property
    def peak_hosts(self) -> int:
        """The most hosts up at once (a host counts from its start, booting included, to its stop)."""
        changes = sorted([(start, 1) for start, _ in self.hosts_up] + [(stop, -1) for _, stop in self.hosts_up])
        return max(itertools.accumulate(change for _, change in changes), default=0)


def lower_bound(jobs: Sequence[SimJob], total_cores: int) -> float:
    """``max(total core-seconds / cores, longest job)``: no schedule on these cores beats it."""
    core_seconds = sum(j.cores * j.accelerator_s for j in jobs)
    return max(core_seconds / total_cores, max(j.accelerator_s + j.verdict_s for j in jobs))


@dataclass
class _Worker:
    group: CoreGroup
    ready_at: float
    job: SimJob | None = None
    draining: bool = False


@dataclass
class _Host:
    index: int
    compiler: str = COMPILER
    workers: dict[CoreGroup, _Worker] = field(default_factory=dict)
    draining: dict[CoreGroup, _Worker] = field(default_factory=dict)
    verdict_free_at: list[float] = field(default_factory=list)
    plan_pending: bool = False
    started_s: float = 0.0  # billed from here
    ready_s: float = 0.0  # its launcher is up: it plans and starts workers
    leaving: bool = False  # scaled in: its workers drain, then it stops
    stopped_s: float | None = None
    idle_since: float | None = None  # the autoscaled fleet: since when it has had no work

    def serving(self, now: float) -> bool:
        """Up, and taking jobs: a host the launchers share the queued jobs over."""
        return self.ready_s <= now and not self.leaving and self.stopped_s is None

    def busy(self, now: float) -> bool:
        """A job on its cores, or a verdict stage still to run on its CPUs."""
        running = any(w.job is not None for w in [*self.workers.values(), *self.draining.values()])
        return running or max(self.verdict_free_at, default=0.0) > now


class FleetSimulation:
    """One run. ``layout``: None re-plans with the real planner; a list of group sizes is a fixed layout."""

    def __init__(
        self,
        jobs: Sequence[SimJob],
        hosts: int,
        cores_per_host: int,
        timings: Timings,
        seconds_per_job: dict[int, float] | None = None,
        layout: list[int] | None = None,
        learn_durations: bool = False,
        stage_limit_s: float | None = None,
        compilers: Sequence[str] = (COMPILER,),
    ) -> None:
        """``compilers``: the versions the hosts serve, host i the (i mod len)-th."""
        self.stage_limit_s = stage_limit_s if stage_limit_s is not None else STAGE_LIMIT_S
        self.jobs = within_limit(jobs, self.stage_limit_s)
        self.cores_per_host = cores_per_host
        self.timings = timings
        self.seconds_per_job = seconds_per_job or {}
        self.layout = layout
        # as the launcher does: the median accelerator-stage seconds of the jobs finished so far, per size
        self.learn_durations = learn_durations
        self.finished_seconds: dict[int, list[float]] = {}
        self.compilers = list(compilers)
        self.hosts = [self.new_host(self.compilers[i % len(self.compilers)], 0.0, 0.0) for i in range(hosts)]
        self.queues: dict[str, deque[SimJob]] = {}
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.starts: dict[str, float] = {}
        self.ends: dict[str, float] = {}

    def new_host(self, compiler: str, started_s: float, ready_s: float) -> _Host:
        index = len(getattr(self, "hosts", []))
        return _Host(index, compiler, verdict_free_at=[0.0] * self.timings.verdict_workers, started_s=started_s,
                     ready_s=ready_s)  # fmt: skip

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (when, next(self.seq), action))

    def runnable(self) -> list[SimJob]:
        """The jobs some host can run: of a compiler version the fleet serves, no larger than its largest group."""
        largest_group = max(self.layout) if self.layout else self.cores_per_host
        return [j for j in self.jobs if j.cores <= largest_group and j.compiler in self.compilers]

    def run(self) -> SimResult:
        runnable = self.runnable()
        for job in runnable:
            self.at(job.submitted_s, lambda job=job: self.submit(job))
        if self.layout is None:  # hosts idle before the sweep: their spare workers are up at its start
            for host in self.hosts:
                self.plan(host)
                for worker in host.workers.values():
                    worker.ready_at = 0.0
        else:
            for host in self.hosts:
                start = 0
                for size in sorted(self.layout, reverse=True):
                    group = CoreGroup(start, size)
                    host.workers[group] = _Worker(group, ready_at=0.0)
                    start += size
        self.run_events()
        makespan = max(self.ends.values(), default=0.0)
        for host in self.hosts:  # a static fleet is up until the sweep ends
            host.stopped_s = makespan
        return self.result(runnable, self.cores_per_host * len(self.hosts))

    def run_events(self) -> None:
        while self.events:
            self.now, _, action = heapq.heappop(self.events)
            action()

    def result(self, runnable: Sequence[SimJob], total_cores: int) -> SimResult:
        """What the run came to, against the lower bound on ``total_cores``."""
        makespan = max(self.ends.values(), default=0.0)
        biggest = max((j.cores for j in runnable), default=1)
        waits = [self.starts[j.name] - j.submitted_s for j in runnable if j.cores == biggest]
        used = sum(j.cores * j.accelerator_s for j in runnable)
        up = [(h.started_s, h.stopped_s if h.stopped_s is not None else makespan) for h in self.hosts]
        return SimResult(
            makespan_s=makespan,
            lower_bound_s=lower_bound(self.jobs, total_cores),
            jobs_run=len(self.ends),
            jobs_unrunnable=len(self.jobs) - len(runnable),
            core_utilisation=used / (total_cores * makespan),
            largest_size_wait_s=max(waits, default=0.0),
            jobs_timed_out=sum(j.timed_out for j in runnable),
            starts=self.starts,
            ends=self.ends,
            used_core_s=used,
            billed_core_s=self.cores_per_host * sum(stop - start for start, stop in up),
            hosts_up=up,
        )

    # events

    def submit(self, job: SimJob) -> None:
        # a fixed layout runs a job on its smallest group that is large enough: it is submitted at that size
        cores = min(s for s in self.layout if s >= job.cores) if self.layout else job.cores
        self.queues.setdefault(job_queue(BACKEND, stack(job.compiler), cores), deque()).append(job)
        self.changed()

    def queue(self, compiler: str, size: int) -> deque[SimJob] | None:
        return self.queues.get(job_queue(BACKEND, stack(compiler), size))

    def changed(self) -> None:
        """Something a launcher watches changed: every host re-plans after its poll, and idle workers look."""
        if self.layout is None:
            for host in self.hosts:
                if host.serving(self.now) and not host.plan_pending:
                    host.plan_pending = True
                    self.at(self.now + self.timings.poll_s, lambda host=host: self.plan(host))
        self.at(self.now, self.dispatch)

    def plan(self, host: _Host) -> None:
        host.plan_pending = False
        if not host.serving(self.now):
            return
        queues = {size: self.queue(host.compiler, size) for size in CORE_SIZES}
        queued = {size: len(q) for size, q in queues.items() if q}
        waited = {size: self.now - q[0].submitted_s for size, q in queues.items() if q}  # FIFO: the head is oldest
        # the queued jobs split over the live hosts of its compiler version, as the launchers read them from SQL
        peers = [h for h in self.hosts if h.compiler == host.compiler and h.serving(self.now)]
        backlog = {size: share(n, len(peers), peers.index(host)) for size, n in queued.items()}
        for worker in [*host.workers.values(), *host.draining.values()]:
            if worker.job is not None:
                backlog[worker.group.size] = backlog.get(worker.group.size, 0) + 1
        state = planner.HostState(
            total_cores=self.cores_per_host,
            backlog={size: n for size, n in backlog.items() if n},
            seconds_per_job=(
                {size: statistics.median(d) for size, d in self.finished_seconds.items()}
                if self.learn_durations
                else self.seconds_per_job
            ),
            workers=frozenset(host.workers),
            busy=frozenset(g for g, w in host.workers.items() if w.job is not None),
            starting=frozenset(
                g for g, w in host.workers.items() if self.now < w.ready_at - self.timings.worker_start_s + STARTING_S
            ),
            draining=frozenset(host.draining),
            waited=waited,
            stage_limit_s=self.stage_limit_s,
        )
        plan = planner.plan_host(state)
        for group in plan.drain:
            worker = host.workers.pop(group)
            worker.draining = True
            host.draining[group] = worker
            if worker.job is None:
                self.at(self.now + self.timings.worker_exit_s, lambda host=host, group=group: self.exit(host, group))
        for group in plan.start:
            host.workers[group] = _Worker(group, ready_at=self.now + self.timings.worker_start_s)
            self.at(self.now + self.timings.worker_start_s, self.changed)

    def exit(self, host: _Host, group: CoreGroup) -> None:
        del host.draining[group]
        self.changed()
        self.drained(host)

    def drained(self, host: _Host) -> None:
        """A host that stops once its last worker left: the static fleet's never do."""

    def dispatch(self) -> None:
        for host in self.hosts:
            for worker in host.workers.values():
                if worker.job is not None or worker.ready_at > self.now:
                    continue
                queue = self.queue(host.compiler, worker.group.size)
                if queue:
                    job = queue.popleft()
                    worker.job = job
                    began = self.now + self.timings.dispatch_s
                    self.starts[job.name] = began
                    self.at(began + job.accelerator_s, lambda host=host, worker=worker: self.finish(host, worker))

    def finish(self, host: _Host, worker: _Worker) -> None:
        job = worker.job
        assert job is not None
        worker.job = None
        self.finished_seconds.setdefault(job.cores, []).append(job.accelerator_s)
        slot = min(range(len(host.verdict_free_at)), key=host.verdict_free_at.__getitem__)
        verdict_start = max(self.now, host.verdict_free_at[slot])
        host.verdict_free_at[slot] = verdict_start + job.verdict_s
        self.ends[job.name] = verdict_start + job.verdict_s
        if worker.draining:
            self.at(self.now + self.timings.worker_exit_s, lambda: self.exit(host, worker.group))
        else:
            self.changed()


AUTOSCALED = Path(__file__).resolve().parent.parent / "deploy/kubernetes/overlays/trn2-autoscaled/pod"
# From the scale-up decision to a launcher that plans: Karpenter launches a trn2.48xlarge (about a minute to a
# running instance), the node joins the cluster and its Neuron device plugin registers (about another), the neuron
# image (torch-neuronx, transformers, the Neuron runtime: gigabytes) is pulled onto its empty disk, and the launcher's
# startup probe passes. Five minutes is what a pod that needs a new node is commonly quoted at on EKS with Karpenter;
# an assumption, not a measurement on trn2 (a larger image or a capacity shortage takes longer).
NODE_START_S = 300.0


@dataclass(frozen=True)
class Autoscaler:
    """How the autoscaled fleet grows and shrinks: the trn2-autoscaled overlay's KEDA ScaledJob, one per compiler
    version's image, and its launchers' ``--exit-when-idle`` (``from_manifests`` reads both), and the node each pod
    needs.

    Every ``polling_s`` each compiler version's fleet asks for the cores of its queued and running jobs over a host's
    cores (the postgresql ``cores-wanted`` trigger, which sums them in SQL over the queues of every stack on that
    compiler version, against ``targetQueryValue`` = a host's cores), at most ``max_hosts``, and KEDA starts that many
    minus the pods it runs (its default strategy); it never stops one. A host leaves on its own once it has had no
    work — nothing queued on its compiler's queues, nothing on its cores, no verdict stage left — for
    ``idle_exit_s``, seen at a poll here (the launcher looks every tenth of it). ``max_hosts`` is also the node
    pool's limit over every compiler version's fleet: when the wishes exceed it, the versions take hosts in turn."""

    max_hosts: int = 4
    node_start_s: float = NODE_START_S
    polling_s: float = 30.0
    idle_exit_s: float = 900.0

    @classmethod
    def from_manifests(cls, pod: Path = AUTOSCALED, node_start_s: float = NODE_START_S) -> Autoscaler:
        import yaml

        spec = next(d for d in yaml.safe_load_all((pod / "scaledjob.yaml").read_text()) if d["kind"] == "ScaledJob")
        [patch] = yaml.safe_load((pod / "kustomization.yaml").read_text())["patches"]
        args = [op["value"] for op in yaml.safe_load(patch["patch"])]
        return cls(
            max_hosts=spec["spec"]["maxReplicaCount"],
            node_start_s=node_start_s,
            polling_s=spec["spec"]["pollingInterval"],
            idle_exit_s=float(args[args.index("--exit-when-idle") + 1]),
        )


class AutoscaledFleet(FleetSimulation):
    """The fleet from zero hosts, scaled by ``Autoscaler`` per compiler version (``compilers``); re-planned by the
    real planner as the static fleet is. A host is billed from its start (booting included) to its stop."""

    def __init__(
        self,
        jobs: Sequence[SimJob],
        autoscaler: Autoscaler,
        cores_per_host: int,
        timings: Timings,
        seconds_per_job: dict[int, float] | None = None,
        compilers: Sequence[str] = (COMPILER,),
    ) -> None:
        super().__init__(jobs, 0, cores_per_host, timings, seconds_per_job, compilers=compilers)
        self.autoscaler = autoscaler
        self.unfinished = 0

    def run(self) -> SimResult:
        runnable = self.runnable()
        self.unfinished = len(runnable)
        for job in runnable:
            self.at(job.submitted_s, lambda job=job: self.submit(job))
        self.at(0.0, self.poll)
        self.run_events()
        return self.result(runnable, self.cores_per_host * self.autoscaler.max_hosts)

    def finish(self, host: _Host, worker: _Worker) -> None:
        job = worker.job
        assert job is not None
        super().finish(host, worker)
        self.unfinished -= 1
        # its verdict stage may be the host's last work: a leaving host stops after it
        self.at(self.ends[job.name], lambda: self.drained(host))

    # the scaler

    def up(self, compiler: str) -> list[_Host]:
        """The fleet's pods: hosts starting or up, not leaving."""
        return [h for h in self.hosts if h.compiler == compiler and not h.leaving and h.stopped_s is None]

    def queued(self, compiler: str) -> list[SimJob]:
        return [job for size in CORE_SIZES if (q := self.queue(compiler, size)) for job in q]

    def wish(self, compiler: str) -> int:
        """What the trigger asks for: a host per host's worth of the cores its queued and running jobs want."""
        running = [w.job for h in self.hosts if h.compiler == compiler
                   for w in [*h.workers.values(), *h.draining.values()] if w.job is not None]  # fmt: skip
        cores = sum(job.cores for job in [*self.queued(compiler), *running])
        return min(self.autoscaler.max_hosts, math.ceil(cores / self.cores_per_host))

    def poll(self) -> None:
        scaler = self.autoscaler
        wanted: dict[str, int] = {}
        for compiler in self.compilers:
            up = self.up(compiler)
            # KEDA subtracts every Job not finished: a host leaving still counts until it has stopped
            unfinished = [h for h in self.hosts if h.compiler == compiler and h.stopped_s is None]
            wanted[compiler] = max(0, self.wish(compiler) - len(unfinished))
            queued = bool(self.queued(compiler))
            for host in up:  # each leaves on its own, once idle long enough
                if host.ready_s > self.now or queued or host.busy(self.now):
                    host.idle_since = None
                elif host.idle_since is None:
                    host.idle_since = self.now
                elif self.now - host.idle_since >= scaler.idle_exit_s:
                    self.leave(host)
        free = scaler.max_hosts - sum(1 for h in self.hosts if h.stopped_s is None)  # a leaving node is still held
        while free > 0 and any(wanted.values()):
            for compiler in self.compilers:  # the versions in turn
                if free > 0 and wanted.get(compiler):
                    self.start(compiler)
                    wanted[compiler] -= 1
                    free -= 1
        if self.unfinished or any(h.stopped_s is None for h in self.hosts):
            self.at(self.now + scaler.polling_s, self.poll)

    def start(self, compiler: str) -> None:
        host = self.new_host(compiler, self.now, self.now + self.autoscaler.node_start_s)
        self.hosts.append(host)
        self.at(host.ready_s, self.changed)  # its launcher plans, the others share the queues with it

    def leave(self, host: _Host) -> None:
        """Idle long enough: it drains (as on SIGTERM) and stops once its workers have exited."""
        host.leaving = True
        for group, worker in list(host.workers.items()):
            del host.workers[group]
            worker.draining = True
            host.draining[group] = worker
            if worker.job is None:
                self.at(self.now + self.timings.worker_exit_s, lambda host=host, group=group: self.exit(host, group))
        self.changed()
        self.drained(host)

    def drained(self, host: _Host) -> None:
        idle = not host.workers and not host.draining and not host.busy(self.now)
        if host.leaving and host.stopped_s is None and idle:
            host.stopped_s = self.now


def simulate(
    jobs: Sequence[SimJob],
    hosts: int,
    cores_per_host: int,
    timings: Timings | None = None,
    seconds_per_job: dict[int, float] | None = None,
    layout: list[int] | None = None,
    learn_durations: bool = False,
    stage_limit_s: float | None = None,
    compilers: Sequence[str] = (COMPILER,),
) -> SimResult:
    return FleetSimulation(
        jobs,
        hosts,
        cores_per_host,
        timings or Timings(),
        seconds_per_job,
        layout,
        learn_durations,
        stage_limit_s,
        compilers,
    ).run()


def one_at_a_time(jobs: Sequence[SimJob], hosts: int, cores_per_host: int) -> SimResult:
    """The public Space's way: each host tests one model at a time (accelerator run, then the CPU compare);
    the next model goes to the host that frees first."""
    jobs = within_limit(jobs)
    free_at = [0.0] * hosts
    ends = {}
    for job in jobs:
        host = min(range(hosts), key=free_at.__getitem__)
        free_at[host] = max(free_at[host], job.submitted_s) + job.accelerator_s + job.verdict_s
        ends[job.name] = free_at[host]
    makespan = max(free_at)
    total_cores = hosts * cores_per_host
    return SimResult(
        makespan_s=makespan,
        lower_bound_s=lower_bound(jobs, total_cores),
        jobs_run=len(jobs),
        jobs_unrunnable=0,
        core_utilisation=sum(j.cores * j.accelerator_s for j in jobs) / (total_cores * makespan),
        largest_size_wait_s=0.0,
        jobs_timed_out=sum(j.timed_out for j in jobs),
        ends=ends,
    )


def median_seconds_per_size(jobs: Sequence[SimJob]) -> dict[int, float]:
    """What the launcher reads from SQL (recent accelerator-stage seconds per size), from a previous sweep."""
    by_size: dict[int, list[float]] = {}
    for job in jobs:
        by_size.setdefault(job.cores, []).append(job.accelerator_s)
    return {size: statistics.median(d) for size, d in by_size.items()}

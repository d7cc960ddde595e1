"""A discrete-event simulation of a sweep on a fleet of hosts, driving the project's own scheduling code.

What it imports rather than re-implements: the host launcher's planning (``services.worker.planner.plan_host``
on the ``HostState`` the launcher builds: its running jobs plus its share (``services.worker.host.share``) of
the queued ones, the busy and draining workers, the expected seconds per size), and queue routing
(``shared.jobs.queues.job_queue``: one FIFO queue per compiler version and group size, shared by every
host's workers of that size, as Redis serves it). What it models: a worker takes the head of its queue
when idle; a drained idle worker exits, a drained busy one finishes its job first; a started worker is ready
after ``worker_start_s``; a host re-plans ``poll_s`` after anything changed (a job queued, started or
finished, a worker started or exited); a job's verdict stage runs after its accelerator stage on one of the
host's ``verdict_workers`` CPU slots, off the cores.

Baselines on the same jobs: fixed layouts (workers started once, never re-planned; a job larger than every
group cannot run) and one model at a time per host (the public Space's script: load, compile, generate,
compare, then the next model).
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from services.worker import planner
from services.worker.host import STARTING_S, share
from shared.cores import CoreGroup
from shared.hub.sizing import CORE_SIZES
from shared.jobs.queues import job_queue
from shared.settings import Settings

BACKEND, COMPILER = "neuron", "2.21.0"


@dataclass(frozen=True)
class SimJob:
    name: str
    cores: int
    accelerator_s: float  # on the cores: load, compile, generate
    verdict_s: float  # on the host's CPUs, after the cores are given back
    submitted_s: float = 0.0
    parameters: int = 0
    timed_out: bool = False  # the duration model made it longer than the stage's limit


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

    @property
    def ratio(self) -> float:
        return self.makespan_s / self.lower_bound_s


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
    workers: dict[CoreGroup, _Worker] = field(default_factory=dict)
    draining: dict[CoreGroup, _Worker] = field(default_factory=dict)
    verdict_free_at: list[float] = field(default_factory=list)
    plan_pending: bool = False


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
    ) -> None:
        self.stage_limit_s = stage_limit_s if stage_limit_s is not None else STAGE_LIMIT_S
        self.jobs = within_limit(jobs, self.stage_limit_s)
        self.cores_per_host = cores_per_host
        self.timings = timings
        self.seconds_per_job = seconds_per_job or {}
        self.layout = layout
        # as the launcher does: the median accelerator-stage seconds of the jobs finished so far, per size
        self.learn_durations = learn_durations
        self.finished_seconds: dict[int, list[float]] = {}
        self.hosts = [_Host(i, verdict_free_at=[0.0] * timings.verdict_workers) for i in range(hosts)]
        self.queues: dict[str, deque[SimJob]] = {}
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.starts: dict[str, float] = {}
        self.ends: dict[str, float] = {}

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (when, next(self.seq), action))

    def run(self) -> SimResult:
        largest_group = max(self.layout) if self.layout else self.cores_per_host
        runnable = [j for j in self.jobs if j.cores <= largest_group]
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
        while self.events:
            self.now, _, action = heapq.heappop(self.events)
            action()
        total_cores = self.cores_per_host * len(self.hosts)
        makespan = max(self.ends.values(), default=0.0)
        biggest = max((j.cores for j in runnable), default=1)
        waits = [self.starts[j.name] - j.submitted_s for j in runnable if j.cores == biggest]
        return SimResult(
            makespan_s=makespan,
            lower_bound_s=lower_bound(self.jobs, total_cores),
            jobs_run=len(self.ends),
            jobs_unrunnable=len(self.jobs) - len(runnable),
            core_utilisation=sum(j.cores * j.accelerator_s for j in runnable) / (total_cores * makespan),
            largest_size_wait_s=max(waits, default=0.0),
            jobs_timed_out=sum(j.timed_out for j in runnable),
            starts=self.starts,
            ends=self.ends,
        )

    # events

    def submit(self, job: SimJob) -> None:
        # a fixed layout runs a job on its smallest group that is large enough: it is submitted at that size
        cores = min(s for s in self.layout if s >= job.cores) if self.layout else job.cores
        self.queues.setdefault(job_queue(BACKEND, COMPILER, cores), deque()).append(job)
        self.changed()

    def changed(self) -> None:
        """Something a launcher watches changed: every host re-plans after its poll, and idle workers look."""
        if self.layout is None:
            for host in self.hosts:
                if not host.plan_pending:
                    host.plan_pending = True
                    self.at(self.now + self.timings.poll_s, lambda host=host: self.plan(host))
        self.at(self.now, self.dispatch)

    def plan(self, host: _Host) -> None:
        host.plan_pending = False
        queues = {size: self.queues.get(job_queue(BACKEND, COMPILER, size)) for size in CORE_SIZES}
        queued = {size: len(q) for size, q in queues.items() if q}
        waited = {size: self.now - q[0].submitted_s for size, q in queues.items() if q}  # FIFO: the head is oldest
        backlog = {size: share(n, len(self.hosts), host.index) for size, n in queued.items()}
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

    def dispatch(self) -> None:
        for host in self.hosts:
            for worker in host.workers.values():
                if worker.job is not None or worker.ready_at > self.now:
                    continue
                queue = self.queues.get(job_queue(BACKEND, COMPILER, worker.group.size))
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


def simulate(
    jobs: Sequence[SimJob],
    hosts: int,
    cores_per_host: int,
    timings: Timings | None = None,
    seconds_per_job: dict[int, float] | None = None,
    layout: list[int] | None = None,
    learn_durations: bool = False,
    stage_limit_s: float | None = None,
) -> SimResult:
    return FleetSimulation(
        jobs, hosts, cores_per_host, timings or Timings(), seconds_per_job, layout, learn_durations, stage_limit_s
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

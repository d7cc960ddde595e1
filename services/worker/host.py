"""`python -m services.worker.host`: run a host's workers, one per core group, and re-plan as work changes.

Every ``--poll`` seconds it reads its share of the backlog (SQL: this host's running jobs, plus its share of
the queued ones split evenly over the live hosts, per group size), the accelerator-stage seconds recent jobs
took per size, and which of its workers are busy. When any of that changes, or a worker exits — a job
queued, started or finished — it re-plans (services/worker/planner.py) once the backlog has held still for
one poll: drains the workers whose group left the layout (SIGTERM: Celery's warm shutdown lets a running
job finish; a worker still starting is kept until it has started) and starts workers on new groups once
their cores are free. Every plan, drain, start and exit is one log line with the backlog
behind it. Beside them it keeps ``SUPPORTMATRIX_VERDICT_WORKERS`` verdict workers on the host's CPUs,
unpinned: a job's verdict stage runs there after its accelerator stage has given its cores back; and the
host's zygote, which forks the workers' runners with torch and transformers already imported
(``SUPPORTMATRIX_ZYGOTE``, on by default; shared/zygote_client.py).

With ``--exit-when-idle S`` the host leaves on its own once SQL has shown it no work for S seconds — nothing queued
on its queues, nothing running under its leases, nothing left to judge on its verdict queue — draining as on
SIGTERM and exiting 0: a pod of the trn2-autoscaled overlay's KEDA ScaledJob, which KEDA never stops, so the pod
that goes is always an idle one (docs/kubernetes.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa

from services.worker.__main__ import describe_runtime
from services.worker.__main__ import main as worker_main
from services.worker.planner import HostPlan, HostState, plan_host
from shared.contracts.enums import JobState
from shared.contracts.run import CORE_SIZES, RuntimeInfo
from shared.cores import CoreGroup
from shared.db.engine import DB_ERRORS, get_engine, new_session
from shared.db.models import Job, utcnow
from shared.jobs.backlog import backlog_facts
from shared.jobs.lease import LeaseOwner
from shared.jobs.queues import job_queue, verdict_queue
from shared.jobs.runtimes import live_since, refuse_other_fleet
from shared.processes import ChildProcess, die_with_parent, run_as_child
from shared.settings import Settings, child_environment, get_settings
from shared.zygote_client import ZYGOTE_ENVIRONMENT, zygote_address

ACCELERATOR_WORKER_PREFIX = "cores-"  # an accelerator worker is named cores-<group>
RECENT_JOBS = 200  # the accelerator-stage durations the expected seconds per size come from
# A worker is not drained while it starts: one stopped between taking a message from Redis and recording it
# as unacknowledged loses that message (seen in bench/burst.py: jobs left queued with no message). Until then
# the planner keeps it (HostState.starting).
STARTING_S = 10.0
ZYGOTE_RESTART_S = 30.0
DRAIN_POLL_S = 0.5  # how often a stopping launcher looks for verdict stages still to judge


def worker_name(group: CoreGroup) -> str:
    return f"{ACCELERATOR_WORKER_PREFIX}{group}"


@dataclass(frozen=True)
class HostBacklog:
    """This host's share of the work, as SQL says now."""

    jobs: dict[int, int]  # per group size: this host's running jobs + its share of the queued ones
    queued: dict[int, int]  # per group size, all hosts
    hosts: int  # live hosts sharing the queued jobs
    busy: frozenset[CoreGroup]  # this host's groups running a job
    seconds_per_job: dict[int, float] = field(default_factory=dict)
    waited: dict[int, float] = field(default_factory=dict)  # per size: the oldest queued job's wait, seconds

    def __str__(self) -> str:
        seconds = {size: round(s, 1) for size, s in sorted(self.seconds_per_job.items(), reverse=True)}
        return (
            f"backlog {dict(sorted(self.jobs.items(), reverse=True))} (queued on all {self.hosts} host(s): "
            f"{dict(sorted(self.queued.items(), reverse=True))}; busy: {' '.join(map(str, sorted(self.busy))) or '-'}"
            f"; seconds per job: {seconds or 'unknown'}; oldest waiting: "
            f"{ {size: round(s) for size, s in sorted(self.waited.items(), reverse=True)} })"
        )


def share(queued: int, hosts: int, index: int) -> int:
    """Host ``index``'s part of ``queued`` jobs split evenly over ``hosts``: the parts add up to ``queued``."""
    return queued // hosts + (1 if index < queued % hosts else 0)


def read_backlog(settings: Settings) -> HostBacklog:
    with new_session() as session:
        facts = backlog_facts(session, settings.backend, live_since(settings), RECENT_JOBS)
    now = utcnow()
    queued = {q.cores: q.jobs for q in facts.queued}
    waited = {q.cores: (now - q.oldest).total_seconds() for q in facts.queued}
    hosts = sorted(facts.live_hosts | {settings.host_name})
    index = hosts.index(settings.host_name)
    jobs = {size: share(n, len(hosts), index) for size, n in queued.items()}
    busy = set()
    for size, owner in facts.running:
        holder = LeaseOwner.parse(owner or "")
        if holder is None or holder.host != settings.host_name:
            continue
        jobs[size] = jobs.get(size, 0) + 1
        if holder.worker.startswith(ACCELERATOR_WORKER_PREFIX):
            busy.add(CoreGroup.parse(holder.worker.removeprefix(ACCELERATOR_WORKER_PREFIX)))
    durations: dict[int, list[float]] = {}
    for size, seconds in facts.stage_seconds:
        durations.setdefault(size, []).append(seconds)
    return HostBacklog(
        jobs={size: n for size, n in jobs.items() if n},
        queued=queued,
        hosts=len(hosts),
        busy=frozenset(busy),
        seconds_per_job={size: statistics.median(d) for size, d in durations.items()},
        waited=waited,
    )


def prepare_to_fork_workers() -> None:
    """Import what a worker imports when it starts (its tasks, Celery's worker, the Redis transport, the pool),
    once, in the launcher: its forked workers then skip them."""
    import billiard.pool  # noqa: F401
    import celery.apps.worker
    import celery.concurrency.prefork  # noqa: F401
    import kombu.transport.redis  # noqa: F401

    import services.worker.tasks  # noqa: F401


class ForkedWorker:
    """A worker forked from the launcher (a ``ChildProcess``): ``python -m services.worker ARGS`` without a new
    interpreter. The launcher is single-threaded; the child drops the launcher's database connections
    (SQLAlchemy's recipe for a forked process) and its signal handlers before it becomes the worker."""

    def __init__(self, args: list[str]) -> None:
        self.returncode: int | None = None
        sys.stdout.flush()  # else the child would write the launcher's buffered output a second time
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            get_engine().dispose(close=False)
            run_as_child(lambda: worker_main(args))

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            return self._reap(0) or 0
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.05)
        return code

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped: the pid is still this child's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def groups_text(groups: list[CoreGroup]) -> str:
    return " ".join(map(str, groups)) or "-"


class HostLauncher:
    def __init__(self, settings: Settings, total_cores: int, fork_workers: bool = False) -> None:
        self.settings = settings
        self.total_cores = total_cores
        self.fork_workers = fork_workers
        self.workers: dict[CoreGroup, ChildProcess] = {}
        self.draining: dict[CoreGroup, ChildProcess] = {}
        self.started_at: dict[CoreGroup, float] = {}
        self.verdict_workers: list[ChildProcess] = []
        self.zygote: subprocess.Popen[bytes] | None = None
        self.zygote_started_at = 0.0
        self.last_plan: HostPlan | None = None
        self.last_backlog: dict[int, int] | None = None
        self.database_lost: float | None = None  # since when the backlog cannot be read

    def step(self) -> HostPlan | None:
        """One look: None while the backlog is still changing (a burst of submissions arrives over a few polls,
        and planning on each part would start workers only to drain them), else the plan it applied."""
        self.keep_zygote()
        self.verdict_workers = [p for p in self.verdict_workers if p.poll() is None]
        for i in range(len(self.verdict_workers), self.settings.verdict_workers):
            log(f"start: verdict worker {i}")
            self.verdict_workers.append(self.start_worker(["--verdict", "--name", f"verdict-{i}"]))
        for group, proc in list(self.draining.items()):
            if proc.poll() is not None:
                del self.draining[group]
                log(f"exit: worker on cores {group} drained ({self.lifetime(group, proc)})")
        for group, proc in list(self.workers.items()):
            if proc.poll() is not None:  # died on its own: its group is free again, restarted below
                del self.workers[group]
                log(f"exit: worker on cores {group} ended on its own ({self.lifetime(group, proc)})")
        try:
            backlog = read_backlog(self.settings)
        except DB_ERRORS as exc:  # the workers go on as they are, and so does this host; planned again once it answers
            if self.database_lost is None:
                log(f"plan: cannot read the backlog ({type(exc).__name__}); keeping the workers as they are")
                self.database_lost = time.monotonic()
            return None
        if self.database_lost is not None:
            log(f"plan: the database answers again, after {time.monotonic() - self.database_lost:.0f} s")
            self.database_lost = None
        if backlog.jobs != self.last_backlog:
            self.last_backlog = backlog.jobs
            return None
        state = HostState(
            total_cores=self.total_cores,
            backlog=backlog.jobs,
            seconds_per_job=backlog.seconds_per_job,
            workers=frozenset(self.workers),
            busy=backlog.busy & set(self.workers),
            starting=self.starting(),
            draining=frozenset(self.draining),
            waited=backlog.waited,
            stage_limit_s=self.settings.stage_limit_s(compiles=True),
        )
        plan = plan_host(state)
        if plan != self.last_plan:
            log(
                f"plan: {backlog} -> layout {groups_text(plan.layout)}; drain {groups_text(plan.drain)}; "
                f"start {groups_text(plan.start)}; waiting for drains {groups_text(plan.waiting)}"
            )
            self.last_plan = plan
        for group in plan.drain:
            proc = self.workers.pop(group)
            proc.send_signal(signal.SIGTERM)
            self.draining[group] = proc
            log(f"drain: worker on cores {group} ({'busy: finishes its job first' if group in state.busy else 'idle'})")
        for group in plan.start:
            self.workers[group] = self.spawn(group)
        return plan

    def keep_zygote(self) -> None:
        """Start the host's zygote (shared/zygote_client.py), and again if it ended: until it is ready, runners start
        as fresh interpreters."""
        if not self.settings.zygote or (self.zygote is not None and self.zygote.poll() is None):
            return
        if self.zygote is not None:
            if time.monotonic() - self.zygote_started_at < ZYGOTE_RESTART_S:
                return  # one that cannot start (its address taken, an import failing) is not retried every poll
            log(f"exit: zygote ended on its own (exit {self.zygote.returncode})")
        address = zygote_address(self.settings.data_dir, self.settings.host_name)
        self.zygote = subprocess.Popen(
            [sys.executable, "-m", "services.runner.zygote_server", address],
            env=child_environment(self.settings, ZYGOTE_ENVIRONMENT),
            preexec_fn=die_with_parent,  # a launcher killed outright takes it along: the next one's can bind
        )
        self.zygote_started_at = time.monotonic()
        log(f"start: zygote at {address} (pid {self.zygote.pid})")

    def starting(self) -> frozenset[CoreGroup]:
        now = time.monotonic()
        return frozenset(g for g in self.workers if now - self.started_at.get(g, 0.0) < STARTING_S)

    def spawn(self, group: CoreGroup) -> ChildProcess:
        proc = self.start_worker(["--cores", str(group)])
        self.started_at[group] = time.monotonic()
        how = ", forked" if isinstance(proc, ForkedWorker) else ""
        log(f"start: worker on cores {group} (pid {proc.pid}{how})")
        return proc

    def start_worker(self, args: list[str]) -> ChildProcess:
        """``python -m services.worker ARGS``: forked from this process when it runs as the launcher (it has
        imported all a worker imports, so a worker is ready in a fraction of a fresh interpreter's start on a
        loaded host), else — a launcher inside another program, such as a test — a fresh interpreter."""
        if self.fork_workers:
            return ForkedWorker(args)
        return subprocess.Popen([sys.executable, "-m", "services.worker", *args])

    def lifetime(self, group: CoreGroup, proc: ChildProcess) -> str:
        return f"exit {proc.returncode}, after {time.monotonic() - self.started_at.pop(group, time.monotonic()):.1f} s"

    def stop(self) -> None:
        """Warm shutdown, in the order a job's stages run, so that a host leaving for good (a pod scaled away)
        strands no job on its verdict queue, which no other host serves: the core-group workers finish their jobs
        and exit, each finished accelerator stage having sent its verdict stage to this host's queue; the verdict
        workers take those until SQL says none is left (``finish_verdict_stages``), then exit; then the zygote,
        which their runners needed (it tells them their runners' exit status and kills a runner whose worker
        died). What outlives the shutdown — a SIGKILL after a grace period — is sent again by the reconciler once
        its lease lapses."""
        stop_and_wait([*self.workers.values(), *self.draining.values()])
        self.finish_verdict_stages()
        stop_and_wait(self.verdict_workers)
        stop_and_wait([self.zygote] if self.zygote is not None else [])

    def finish_verdict_stages(self) -> None:
        """Keep the verdict workers until this host's verdict queue has no job left to judge, for as long as one of
        them lives and they make progress: at most a verdict stage's own limit (SUPPORTMATRIX_JOB_TIMEOUT_S), and no
        longer than the reconciler takes to re-send a lost message (SUPPORTMATRIX_QUEUE_GRACE_S and two of its
        periods) while none of the jobs left is being judged."""
        settings = self.settings
        queue = verdict_queue(settings.host_name)
        deadline = time.monotonic() + settings.stage_limit_s(compiles=False)
        patience = settings.queue_grace_s + 2 * settings.reconcile_every_s
        said, judged_at = None, time.monotonic()
        while any(proc.poll() is None for proc in self.verdict_workers) and time.monotonic() < deadline:
            try:
                left, judging = verdict_stages_left(queue)
            except DB_ERRORS as exc:
                log(f"drain: cannot read what {queue} holds ({type(exc).__name__}); stopping the verdict workers")
                return
            if not left:
                return
            if judging:
                judged_at = time.monotonic()
            elif time.monotonic() - judged_at > patience:
                log(f"drain: {left} verdict stage(s) on {queue} untaken for {patience:g} s; stopping its workers")
                return
            if left != said:
                log(f"drain: {left} verdict stage(s) left on {queue}; the verdict workers judge them before they stop")
                said = left
            time.sleep(DRAIN_POLL_S)


def stop_and_wait(procs: Sequence[ChildProcess]) -> None:
    """SIGTERM to each that still runs (Celery's warm shutdown: a running job finishes first), then wait for all."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.wait()


def verdict_stages_left(queue: str) -> tuple[int, int]:
    """Jobs whose verdict stage is still to run on the host of this verdict queue, and how many of them a verdict
    worker holds (is judging) now."""
    with new_session() as session:
        counts = sa.select(sa.func.count(), sa.func.count(Job.lease_owner)).select_from(Job)
        left, judging = session.execute(counts.where(Job.state == JobState.judging, Job.verdict_queue == queue)).one()
    return int(left), int(judging)


def work_left(host: str, queues: Sequence[str]) -> bool:
    """SQL shows this host work: a job queued on one of its queues, one running under its leases (an owner
    ``worker@host:pid``), or one whose verdict stage is still to run on its verdict queue."""
    with new_session() as session:
        found = session.scalar(
            sa.select(Job.id)
            .where(
                sa.or_(
                    sa.and_(Job.state == JobState.queued, Job.queue.in_(queues)),
                    sa.and_(Job.state == JobState.running, Job.lease_owner.contains(f"@{host}:", autoescape=True)),
                    sa.and_(Job.state == JobState.judging, Job.verdict_queue == verdict_queue(host)),
                )
            )
            .limit(1)
        )
    return found is not None


@dataclass
class IdleClock:
    """How long SQL has shown a host no work (``work_left``), looked at every tenth of ``exit_after_s`` and once more
    before it says the time is up, so that a job claimed since the last look keeps the host; a database that does not
    answer counts as work, so a host never leaves on what it could not read."""

    host: str
    queues: Sequence[str]
    exit_after_s: float
    idle_since: float = field(default_factory=time.monotonic)
    looked_at: float = 0.0

    def expired(self) -> bool:
        now = time.monotonic()
        if now - self.looked_at >= self.exit_after_s / 10 or now - self.idle_since >= self.exit_after_s:
            self.looked_at = now
            try:
                busy = work_left(self.host, self.queues)
            except DB_ERRORS:
                busy = True
            if busy:
                self.idle_since = now
        return now - self.idle_since >= self.exit_after_s


def served_queues(served: RuntimeInfo, cores: int) -> list[str]:
    """The job queues a host of ``cores`` cores serves: its stack's, of every group size it can hold."""
    return [job_queue(served.backend, served.stack(), size) for size in CORE_SIZES if size <= cores]


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} host: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    settings = get_settings()
    parser = argparse.ArgumentParser(prog="python -m services.worker.host", description=__doc__)
    parser.add_argument("--cores", type=int, default=settings.host_cores, help="cores this host has")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between looks at the backlog and workers")
    parser.add_argument("--exit-when-idle", type=float, metavar="SECONDS", default=None,
                        help="drain and exit 0 once SQL has shown this host no work for this long")  # fmt: skip
    args = parser.parse_args(argv)
    # Described once per host and kept (services/worker/__main__.py): every worker started after reads it back
    # instead of importing torch in a runner child, so a worker is ready in about a second.
    served = describe_runtime(settings)
    if (refused := refuse_other_fleet(settings, served)) is not None:
        log(f"not started: {refused}")
        return 2
    log(f"serving {served.compiler_version}")
    prepare_to_fork_workers()
    launcher = HostLauncher(settings, args.cores, fork_workers=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    idle = None
    if args.exit_when_idle is not None:
        idle = IdleClock(settings.host_name, served_queues(served, args.cores), args.exit_when_idle)
    while not stop.is_set():
        launcher.step()
        # not while a worker starts: one stopped before it has recorded the message it took loses it (STARTING_S)
        if idle is not None and not launcher.starting() and idle.expired():
            log(f"exit: no work for {args.exit_when_idle:g} s; draining")
            break
        stop.wait(args.poll)
    launcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

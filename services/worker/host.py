"""`python -m services.worker.host`: run a host's workers, one per core group, and re-plan as work changes.

Every ``--every`` seconds it reads the backlog (queued and running jobs of this backend, per group size),
asks the planner for a layout, drains the workers whose group left the plan (SIGTERM: Celery's warm
shutdown lets the running job finish) and starts workers on new groups once their cores are free. Beside
them it keeps ``SUPPORTMATRIX_VERDICT_WORKERS`` verdict workers on the host's CPUs, unpinned: a job's
verdict stage runs there after its accelerator stage has given its cores back.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading

import sqlalchemy as sa

from services.worker.planner import overlaps, plan_layout, reconcile
from shared.cores import CoreGroup
from shared.db.engine import new_session
from shared.db.models import Job
from shared.enums import JobState
from shared.settings import Settings, get_settings

# The states that need cores: a judging job has given its cores back.
CORE_STATES = (JobState.queued, JobState.running)


def backlog(settings: Settings) -> dict[int, int]:
    with new_session() as session:
        rows = session.execute(
            sa.select(Job.cores, sa.func.count())
            .where(Job.backend == settings.backend, Job.state.in_(CORE_STATES))
            .group_by(Job.cores)
        ).all()
    return {int(cores): int(n) for cores, n in rows}


class HostLauncher:
    def __init__(self, settings: Settings, total_cores: int) -> None:
        self.settings = settings
        self.total_cores = total_cores
        self.workers: dict[CoreGroup, subprocess.Popen[bytes]] = {}
        self.draining: dict[CoreGroup, subprocess.Popen[bytes]] = {}
        self.verdict_workers: list[subprocess.Popen[bytes]] = []

    def step(self) -> None:
        self.verdict_workers = [p for p in self.verdict_workers if p.poll() is None]
        for i in range(len(self.verdict_workers), self.settings.verdict_workers):
            print(f"starting verdict worker {i}", flush=True)
            command = [sys.executable, "-m", "services.worker", "--verdict", "--name", f"verdict-{i}"]
            self.verdict_workers.append(subprocess.Popen(command))
        for group, proc in list(self.draining.items()):
            if proc.poll() is not None:
                del self.draining[group]
        for group, proc in list(self.workers.items()):
            if proc.poll() is not None:  # died on its own: its group is free again, restart it below
                del self.workers[group]
        target = plan_layout(self.total_cores, backlog(self.settings))
        drain, start = reconcile(set(self.workers), target)
        for group in drain:
            proc = self.workers.pop(group)
            proc.send_signal(signal.SIGTERM)
            self.draining[group] = proc
        busy = set(self.workers) | set(self.draining)
        for group in start:
            if not overlaps(group, busy):
                self.workers[group] = self.spawn(group)
                busy.add(group)

    def spawn(self, group: CoreGroup) -> subprocess.Popen[bytes]:
        print(f"starting a worker on cores {group}", flush=True)
        return subprocess.Popen([sys.executable, "-m", "services.worker", "--cores", str(group)])

    def stop(self) -> None:
        procs = list(self.workers.values()) + list(self.draining.values()) + self.verdict_workers
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    settings = get_settings()
    parser = argparse.ArgumentParser(prog="python -m services.worker.host", description=__doc__)
    parser.add_argument("--cores", type=int, default=settings.host_cores, help="cores this host has")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between re-plans")
    args = parser.parse_args(argv)
    launcher = HostLauncher(settings, args.cores)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.is_set():
        launcher.step()
        stop.wait(args.every)
    launcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

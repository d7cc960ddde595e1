"""`python -m services.worker`: start a job worker for this machine's backend.

It asks a runner child which compiler and library versions this machine serves (the worker itself never
imports torch), consumes the queue for that compiler version and its core-group size, registers in the
`workers` table, and runs one job at a time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from services.worker import registry
from services.worker.celery_app import app
from shared.contracts import RuntimeInfo
from shared.cores import CoreGroup
from shared.jobs.queues import job_queue
from shared.settings import child_environment, get_settings


def describe_runtime(backend: str) -> RuntimeInfo:
    out = subprocess.run(
        [sys.executable, "-m", "services.runner", "--describe", "--backend", backend],
        env=child_environment({}),
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return RuntimeInfo(**json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.worker", description=__doc__)
    parser.add_argument("--name", help="unique per host; default: cores-<group>")
    parser.add_argument(
        "--cores",
        type=CoreGroup.parse,
        default=CoreGroup(0, 1),
        help="the aligned core group this worker owns, e.g. 0-3 (default 0); it takes jobs of that size",
    )
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.cores.end >= settings.host_cores:
        parser.error(f"cores {args.cores} lie outside this host's {settings.host_cores} (SUPPORTMATRIX_HOST_CORES)")
    runtime = describe_runtime(settings.backend)
    queue = job_queue(runtime.backend, runtime.compiler_version, cores=args.cores.size)
    registry.configure(registry.Identity(runtime=runtime, queue=queue, group=args.cores))
    print(
        f"serving {runtime.compiler_version} / {runtime.library} {runtime.library_version} on {queue}",
        flush=True,
    )
    app.worker_main(
        [
            "worker",
            "--queues",
            queue,
            "--concurrency",
            "1",
            "--pool",
            "prefork",
            "--hostname",
            f"{args.name or f'cores-{args.cores}'}@%h",
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            args.loglevel,
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

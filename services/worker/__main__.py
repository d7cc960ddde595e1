"""`python -m services.worker`: start a worker of either stage for this machine's backend.

With `--cores A-B` (the default is core 0) it runs accelerator stages on that core group: it asks a runner
child which software stack this machine serves (compiler, torch, TorchNeuron, Neuron runtime and library
versions; the worker itself never imports torch), consumes the queue for that stack and core-group size,
registers in the `workers` table, and runs one job at a time, only of its own stack. With `--verdict` it runs
verdict stages on the host's CPUs, unpinned, from this host's verdict queue.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys

from services.worker import registry
from services.worker.celery_app import app
from shared.contracts.handoffs import write_model
from shared.contracts.run import RuntimeInfo
from shared.cores import CoreGroup
from shared.installed import NEURON_RUNTIME_PACKAGE, debian_package_version, installed_version
from shared.isolation import IsolationUnavailable, prepare
from shared.jobs.queues import job_queue, verdict_queue
from shared.settings import Settings, child_environment, get_settings

# What a runtime description depends on, besides the backend and its settings.
RUNTIME_PACKAGES = ("torch", "transformers", "neuronx-cc", "torch-neuronx")


def describe_runtime(settings: Settings) -> RuntimeInfo:
    """What this machine serves, asked of a runner child (the worker never imports torch) once per host and
    installation: the answer is kept under the data dir, keyed by all it depends on — the backend, the cpu
    backend's dynamo backend and dtype, the interpreter, the runtime packages' installed versions (the Neuron
    runtime's too) — so that the next worker starts without importing torch at all."""
    parts = [settings.backend, settings.cpu_compile_backend, settings.cpu_dtype, sys.executable]
    parts += [f"{dist}={installed_version(dist)}" for dist in RUNTIME_PACKAGES]
    if settings.backend == "neuron":  # the runtime library is an apt package: part of the stack a worker serves
        parts.append(f"{NEURON_RUNTIME_PACKAGE}={debian_package_version(NEURON_RUNTIME_PACKAGE)}")
    cached = settings.data_dir / "runtimes" / f"{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.json"
    if cached.exists():
        return RuntimeInfo.model_validate_json(cached.read_text())
    out = subprocess.run(
        [sys.executable, "-m", "services.runner.describe", "--backend", settings.backend],
        env=child_environment(settings, {}),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"describing the {settings.backend} runtime failed:\n{out.stderr[-3000:]}")
    info = RuntimeInfo.model_validate_json(out.stdout.strip().splitlines()[-1])
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_model(cached, info)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.worker", description=__doc__)
    parser.add_argument("--name", help="unique per host; default: cores-<group>")
    parser.add_argument(
        "--cores",
        type=CoreGroup.parse,
        default=CoreGroup(0, 1),
        help="the aligned core group this worker owns, e.g. 0-3 (default 0); it takes jobs of that size",
    )
    parser.add_argument("--verdict", action="store_true", help="run verdict stages from this host's verdict queue")
    parser.add_argument("--loglevel", default="INFO")
    parser.add_argument(
        "--describe",
        action="store_true",
        help="print the runtime this machine serves, as SUPPORTMATRIX_FLEET_RUNTIME declares a fleet's, and exit",
    )
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.describe:
        print(describe_runtime(settings).model_dump_json())
        return 0
    try:
        print(prepare(settings), flush=True)
    except IsolationUnavailable as exc:
        parser.error(str(exc))
    if args.verdict:
        queue = verdict_queue(settings.host_name)
        registry.configure(registry.Identity(queue=queue))
        name = args.name or "verdict"
    else:
        if args.cores.end >= settings.host_cores:
            parser.error(f"cores {args.cores} lie outside this host's {settings.host_cores} (SUPPORTMATRIX_HOST_CORES)")
        runtime = describe_runtime(settings)
        queue = job_queue(runtime.backend, runtime.stack(), cores=args.cores.size)
        registry.configure(registry.Identity(queue=queue, runtime=runtime, group=args.cores))
        name = args.name or f"cores-{args.cores}"
    print(f"serving {queue}", flush=True)
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
            f"{name}@{settings.host_name}",  # the host it serves, not the machine: two launchers of one machine
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            args.loglevel,
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

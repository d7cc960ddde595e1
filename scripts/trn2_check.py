"""The first-hour check of a new host: five runs of the runner, one per way a model is placed and task, and a table.

    python scripts/trn2_check.py [--backend neuron|cpu] [--models DIR] [--parallel]

- one model that fits one core;
- a dense model forced to tensor parallelism over 2 cores;
- a MoE model over 4 cores with expert parallelism;
- a sentence-transformers embedder (feature-extraction, its own pipeline) on one core;
- a diffusers text-to-image pipeline on one core.

By default the five are small real Hub models (downloaded through huggingface_hub: HF_TOKEN, HF_ENDPOINT,
HF_HOME apply); with ``--models DIR`` they are the tiny checkpoints of ``python -m testing.tiny_models DIR`` and
``python -m testing.tiny_pipelines DIR``. Each run is ``python -m services.runner`` (the report is its last
stdout line) on its own aligned core group (0, 2-3, 4-7, 8, 9: NEURON_RT_VISIBLE_CORES on neuron), so
``--parallel`` can run them at once. Prints the driver, runtime and compiler versions found, the software stack
this host's workers will serve and the job queues they will consume (named by that stack, as a worker names them at
start: ``python -m services.runner.describe``), then verdict, cores, parallelism, wall, compile and peak memory per
model, and exits 0 only when the stack was found and every run PASSes. `scripts/trn2-check.sh` runs this in the
neuron image.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared.contracts.enums import ErrorClass, Verdict  # noqa: E402
from shared.contracts.report import Failure, RunReport, Subject  # noqa: E402
from shared.contracts.run import CORE_SIZES, RuntimeInfo  # noqa: E402
from shared.cores import CoreGroup, pin_environment  # noqa: E402
from shared.installed import NEURON_RUNTIME_PACKAGE, debian_package_version, installed_version  # noqa: E402
from shared.jobs.queues import compiler_queues_like, job_queue  # noqa: E402
from shared.jobs.runtimes import refuse_other_fleet  # noqa: E402
from shared.settings import get_settings  # noqa: E402

DESCRIBE_TIMEOUT_S = 600.0  # the worker's own limit on the same question (services/worker/__main__.py)


@dataclass(frozen=True)
class Check:
    what: str
    hub_id: str  # a small real model
    tiny: str  # its stand-in among testing.tiny_models and testing.tiny_pipelines
    cores: int
    task: str = "text-generation"


CHECKS = (
    Check("fits one core", "Qwen/Qwen3-0.6B", "tiny-llama", 1),
    Check("dense, TP over 2", "Qwen/Qwen3-1.7B", "tiny-qwen3", 2),
    Check("MoE, EP over 4", "ibm-granite/granite-3.1-1b-a400m-base", "tiny-qwen3-moe", 4),
    Check("embedding", "sentence-transformers/all-MiniLM-L6-v2", "tiny-st-mean-normalize", 1, "feature-extraction"),
    Check("text-to-image", "segmind/tiny-sd", "tiny-sd", 1, "text-to-image"),
)


def placements(checks: tuple[Check, ...]) -> list[CoreGroup]:
    """Disjoint aligned groups, in the checks' order, each aligned to its size: 0, 2-3, 4-7, 8, 9."""
    groups, start = [], 0
    for check in checks:
        start = -(-start // check.cores) * check.cores  # align up to the group's size
        groups.append(CoreGroup(start, check.cores))
        start += check.cores
    return groups


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def versions(backend: str) -> dict[str, str | None]:
    """What this machine runs, found without importing torch (the runs report their compiler too)."""
    found: dict[str, str | None] = {
        "torch": installed_version("torch"),
        "transformers": installed_version("transformers"),
    }
    if backend == "neuron":
        found |= {
            # the driver is the host's kernel module; its sysfs entry is visible inside a container too
            "neuron driver": _read("/sys/module/neuron/version"),
            "neuron runtime": debian_package_version(NEURON_RUNTIME_PACKAGE),
            "neuron collectives": debian_package_version("aws-neuronx-collectives"),
            "neuronx-cc": installed_version("neuronx-cc"),
            "torch-neuronx": installed_version("torch-neuronx"),
        }
    return found


def served(backend: str) -> RuntimeInfo | str:
    """The runtime this host's workers will serve, asked as a worker asks it at start; or why it was not found."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "services.runner.describe", "--backend", backend],
            cwd=ROOT, capture_output=True, text=True, timeout=DESCRIBE_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"no answer after {DESCRIBE_TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        return f"exit {done.returncode}: {(done.stderr.strip().splitlines() or ['no output'])[-1][:300]}"
    return RuntimeInfo.model_validate_json(done.stdout.strip().splitlines()[-1])


def queues(runtime: RuntimeInfo) -> str:
    """The stack a host of ``runtime`` serves and its job queues, one per core-group size; and, on neuron, what the
    trn2-autoscaled overlay's KEDA trigger must count for them (it names the compiler version only)."""
    stack = runtime.stack()
    lines = [f"stack: {stack.label()} ({stack.name})", "job queues:"]
    lines += [f"  {job_queue(runtime.backend, stack, size)}" for size in CORE_SIZES]
    if runtime.backend == "neuron":
        counted = compiler_queues_like(runtime.backend, stack.compiler_version)
        lines.append(f"KEDA (trn2-autoscaled): cores-wanted must count queue LIKE '{counted}'")
    lines.append(f"fleet (the ConfigMap declares it so): SUPPORTMATRIX_FLEET_RUNTIME={runtime.model_dump_json()}")
    return "\n".join(lines)


def command(check: Check, backend: str, models: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "services.runner"]
    if models is not None:
        argv += [f"local/{check.tiny}", "--local-dir", str(models / check.tiny)]
    else:
        argv += [check.hub_id]
    return [*argv, "--backend", backend, "--cores", str(check.cores), "--task", check.task]


@dataclass(frozen=True)
class CheckRun:
    check: Check
    group: CoreGroup
    elapsed_s: float
    report: RunReport


def report_of(out: str) -> RunReport | None:
    """The runner's report: its last JSON line."""
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return RunReport.model_validate_json(line)
            except ValueError:
                return None
    return None


def no_report(check: Check, backend: str, error_class: ErrorClass, message: str) -> RunReport:
    subject = Subject(model_id=check.hub_id, task=check.task, backend=backend)
    return RunReport(subject=subject, verdict=Verdict.ERROR, failure=Failure(error_class=error_class,
                     error_message=message))  # fmt: skip


def run_one(check: Check, group: CoreGroup, backend: str, models: Path | None, timeout: float) -> CheckRun:
    started = time.monotonic()
    try:
        done = subprocess.run(
            command(check, backend, models), cwd=ROOT, env=os.environ | pin_environment(backend, group),
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        report = report_of(done.stdout)
        if report is None or report.verdict is None or done.returncode not in (0, 1, 3):
            sys.stderr.write(done.stderr[-3000:])
        if report is None:
            report = no_report(check, backend, ErrorClass.crash, f"exit {done.returncode}, no report")
    except subprocess.TimeoutExpired:
        report = no_report(check, backend, ErrorClass.timeout, f"no report after {timeout:.0f} s")
    return CheckRun(check, group, time.monotonic() - started, report)


def run_all(backend: str, models: Path | None, parallel: bool, timeout: float) -> list[CheckRun]:
    runs = [(check, group, backend, models, timeout) for check, group in zip(CHECKS, placements(CHECKS), strict=True)]
    if not parallel:
        return [run_one(*run) for run in runs]
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: run_one(*run), runs))


def _num(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def table(runs: list[CheckRun]) -> str:
    header = ("check", "model", "verdict", "cores", "parallelism", "wall s", "compile s", "peak GiB", "compiler")
    rows = [header]
    for run in runs:
        r = run.report
        verdict = (r.verdict or "-") + (f"({r.failure.error_class})" if r.failure.error_class else "")
        rows.append((
            run.check.what, r.subject.model_id, verdict, str(r.provenance.cores), r.placement.parallelism or "-",
            _num(r.timings.wall_s), _num(r.timings.compile_s), _num(r.resources.peak_memory_bytes, 2**30, 2),
            r.runtime.compiler_version if r.runtime else "-",
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def ranks(runs: list[CheckRun]) -> str:
    """Per sharded check, each rank's core as it saw it and the device the runtime bound it to."""
    lines = []
    for run in runs:
        seen = run.report.placement.rank_cores
        if run.check.cores > 1:
            for rank, core_at in enumerate((seen or "?").split(",")):
                core, _, device = core_at.partition("@")
                lines.append(f"{run.check.what}: rank {rank} sees core {core}, runs on {device or '?'}")
        if run.report.failure.error_class == ErrorClass.placement:
            lines.append(f"{run.check.what}: TWO RANKS HOLD THE SAME CORE: {run.report.failure.error_message}")
    return "\n".join(lines)


def calibration(runs: list[CheckRun]) -> list[dict[str, Any]]:
    """What the verdict's calibration needs from a trn2 host, per check: the compile path, and how far each step's
    logits are from the CPU reference's on the same prefix."""
    out = []
    for run in runs:
        r = run.report
        evidence = r.comparison.evidence or {}
        out.append({
            "check": run.check.what, "model": r.subject.model_id, "verdict": r.verdict, "reason": r.verdict_reason,
            "cores": r.provenance.cores, "parallelism": r.placement.parallelism, "rank_cores": r.placement.rank_cores,
            "collective": r.placement.collective, "compile_path": r.resources.compile_path,
            "graphs_compiled": r.resources.graphs_compiled, "backend_graphs": r.resources.backend_graphs,
            "prefill_rel_error": r.comparison.prefill_rel_error, "routing_margin": r.comparison.routing_margin,
            "step_rel_errors": evidence.get("step_rel_errors"), "divergent_steps": evidence.get("divergent_steps"),
            "similarity": r.comparison.similarity, "cosines": evidence.get("cosines"),
            "image_psnr": r.comparison.image_psnr, "image_ssim": r.comparison.image_ssim,
            "runtime": r.runtime.model_dump(mode="json") if r.runtime else None,
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/trn2_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--backend", choices=["neuron", "cpu", "cuda"], default="neuron")
    parser.add_argument("--models", type=Path, help="the tiny checkpoints' directory instead of the Hub models")
    parser.add_argument("--parallel", action="store_true", help="run the five at once, on disjoint cores")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per run (compilation included)")
    parser.add_argument("--json", type=Path, help="also write the reports here")
    parser.add_argument("--calibration", type=Path, default=Path("trn2-check-calibration.json"),
                        help="per check: every step's logit error and the compile path")  # fmt: skip
    args = parser.parse_args(argv)

    print(f"backend: {args.backend}")
    for name, version in versions(args.backend).items():
        print(f"{name}: {version or 'not found'}")
    runtime = served(args.backend)
    print(queues(runtime) if isinstance(runtime, RuntimeInfo) else f"stack: not found ({runtime})")
    # the fleet declared where this check runs (the ConfigMap's SUPPORTMATRIX_FLEET_RUNTIME, when set): a launcher
    # of this host would not start on another
    unlike = refuse_other_fleet(get_settings(), runtime) if isinstance(runtime, RuntimeInfo) else None
    if unlike is not None:
        print(f"FLEET NOT THIS HOST'S: {unlike}")
    print()
    runs = run_all(args.backend, args.models, args.parallel, args.timeout_s)
    print(table(runs))
    if any(run.check.cores > 1 for run in runs):
        print("\n" + ranks(runs))
    args.calibration.write_text(json.dumps(calibration(runs), indent=2))
    print(f"\ncalibration: {args.calibration}")
    if args.json:
        reports = [{"check": run.check.what, "group": str(run.group), "elapsed_s": run.elapsed_s,
                    "report": run.report.model_dump(mode="json")} for run in runs]  # fmt: skip
        args.json.write_text(json.dumps(reports, indent=2))
    failed = [run for run in runs if run.report.verdict != Verdict.PASS]
    if not isinstance(runtime, RuntimeInfo):
        print(f"\nno stack: a worker here could not say what it serves ({runtime})")
    if failed:
        print(f"\nnot PASS: {', '.join(run.check.what for run in failed)}; each report's error and reproduce say more")
        for run in failed:
            if run.report.failure.error_message:
                print(f"- {run.check.what}: {run.report.failure.error_message.strip().splitlines()[-1][:300]}")
    if unlike is not None:
        print("\nthe declared fleet (SUPPORTMATRIX_FLEET_RUNTIME) is not this host's stack: see FLEET above")
    return 1 if failed or not isinstance(runtime, RuntimeInfo) or unlike is not None else 0


if __name__ == "__main__":
    sys.exit(main())

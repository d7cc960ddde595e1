"""`python -m services.runner MODEL [--revision R] [--backend cpu]`: test one model, print a report.

MODEL is a Hub id (downloaded through huggingface_hub, honouring HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE)
or a local checkpoint directory. The CPU reference and the accelerator run each happen in a child process;
this process only downloads, launches, compares and reports. The report is one JSON object on the last
line of stdout (and in --report PATH). Exit status: 0 PASS, 1 FAIL, 2 bad usage, 3 ERROR or SKIPPED.
"""

from __future__ import annotations

import argparse
import shlex
import socket
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from services.runner.backends import BACKENDS, Backend, get_backend
from services.runner.download import Checkpoint, download
from services.runner.failures import RunFailure
from services.runner.launch import run_child, run_ranks
from services.runner.tasks import TASKS, get_task
from shared.contracts import RunReport, RuntimeInfo
from shared.db.engine import new_session
from shared.enums import ErrorClass, Task, Verdict
from shared.hub.sizing import CORE_SIZES, checkpoint_shape, default_core_memory_bytes, size_model
from shared.results import references
from shared.results.references import reference_key
from shared.settings import get_settings

EXIT_CODES = {Verdict.PASS: 0, Verdict.FAIL: 1, Verdict.ERROR: 3, Verdict.SKIPPED: 3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.runner", description=__doc__)
    parser.add_argument("model", nargs="?", help="Hub id (org/name) or a local checkpoint directory")
    parser.add_argument("--revision", help="branch, tag or commit sha (Hub ids only)")
    parser.add_argument("--backend", choices=sorted(BACKENDS), help="default: SUPPORTMATRIX_BACKEND")
    parser.add_argument("--task", default=Task.text_generation.value, choices=sorted(TASKS))
    parser.add_argument("--cores", type=int, choices=CORE_SIZES, help="shard over this many cores (default: sized)")
    parser.add_argument("--core-range", help="the cores this run is pinned to, recorded as provenance")
    parser.add_argument("--timeout", type=float, help="seconds per child process (default: the job timeout)")
    parser.add_argument("--report", type=Path, help="also write the JSON report to this file")
    parser.add_argument("--describe", action="store_true", help="print the backend's runtime versions and exit")
    args = parser.parse_args(argv)
    if not args.describe and not args.model:
        parser.error("MODEL is required")
    return args


def reproduce_command(model_id: str, sha: str | None, backend: Backend, task: str) -> str:
    parts = [f"{k}={v}" for k, v in sorted(backend.reproduce_env().items())]
    parts += ["python", "-m", "services.runner", model_id]
    if sha:
        parts += ["--revision", sha]
    parts += ["--backend", backend.name]
    if task != Task.text_generation.value:
        parts += ["--task", task]
    return shlex.join(parts)


def describe(backend_name: str, timeout_s: float) -> RuntimeInfo:
    with tempfile.TemporaryDirectory(prefix="describe-") as tmp:
        spec = {"role": "describe", "backend": backend_name}
        return RuntimeInfo(**run_child(spec, {}, timeout_s, Path(tmp)))


def choose_cores(args: argparse.Namespace, checkpoint: Checkpoint, backend: Backend) -> int:
    """--cores when given, else the fewest cores whose memory holds the checkpoint."""
    if args.cores:
        return int(args.cores)
    memory = default_core_memory_bytes(backend.name, backend.settings.core_memory_gib)
    try:
        shape = checkpoint_shape(checkpoint.path)
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise RunFailure(ErrorClass.load, f"the checkpoint's config or weight headers are unreadable: {exc}") from exc
    sizing = size_model(shape, memory)
    if sizing.cores is None:
        raise RunFailure(ErrorClass.too_large, sizing.reason)
    return sizing.cores


def reference_once(
    spec: dict[str, Any],
    backend: Backend,
    checkpoint: Checkpoint,
    runtime: RuntimeInfo,
    timeout_s: float,
    workdir: Path,
) -> tuple[dict[str, Any], bool]:
    """The reference's conclusions, from the stored reference run when it suffices, else from a new one
    (which is then stored). Returns them and whether the stored run was reused."""
    task = get_task(spec["task"])
    content_id = checkpoint.content_id
    key = reference_key(spec["model_id"], content_id, spec["task"], backend.dtype,
                        runtime.library_version, runtime.torch_version)  # fmt: skip
    try:
        session = new_session()
        stored = references.load(session, key)
    except SQLAlchemyError:  # no database here (a standalone run): nothing to reuse or keep
        session, stored = None, None
    if stored is not None:
        if stored.blob is not None:
            Path(spec["reference_prefill_path"]).write_bytes(stored.blob)
        concluded = task.conclude_from_cache(spec, backend.settings, backend.dtype, stored.data)
        if concluded is not None:
            session.close()
            return concluded, True
    reference = run_child(spec, backend.reference_env(), timeout_s, workdir)
    cache = reference.pop("cache")
    if session is not None:
        blob_path = Path(spec["reference_prefill_path"])
        identity = {"model_id": spec["model_id"], "sha": content_id, "task": spec["task"],
                    "dtype": backend.dtype, "library_version": runtime.library_version,
                    "torch_version": runtime.torch_version}  # fmt: skip
        with session:
            references.store(session, key, identity, cache, blob_path.read_bytes() if blob_path.exists() else None)
            session.commit()
    return reference, False


def run(args: argparse.Namespace) -> RunReport:
    settings = get_settings()
    backend = get_backend(args.backend or settings.backend, settings)
    timeout_s = args.timeout or settings.job_timeout_s
    report = RunReport(
        model_id=args.model,
        revision=args.revision,
        task=args.task,
        backend=backend.name,
        verdict=Verdict.ERROR,
        host=socket.gethostname(),
        core_range=args.core_range,
    )
    try:
        checkpoint = download(args.model, args.revision, settings.hub_retry_delays_s)
        report.sha = checkpoint.sha
        report.reproduce = reproduce_command(args.model, checkpoint.sha, backend, args.task)
        report.cores = choose_cores(args, checkpoint, backend)
        runs_dir = settings.data_dir / "runs"
        runs_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="run-", dir=runs_dir) as tmp:
            workdir = Path(tmp)
            common = {
                "model_id": args.model,
                "backend": backend.name,
                "task": args.task,
                "model_dir": str(checkpoint.path),
                "moe_parallelism": settings.moe_parallelism,
                "fault": settings.cpu_fault if backend.name == "cpu" else None,
                "prefill_path": str(workdir / "prefill-logits.npy"),
            }
            ranks = run_ranks(
                {**common, "role": "accelerator"}, report.cores, backend.accelerator_env(), timeout_s, workdir
            )
            accelerator = ranks[0]
            accelerator["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in ranks)
            runtime = RuntimeInfo(**accelerator["runtime"])
            reference_spec = {
                **common,
                "role": "reference",
                "accelerator_world_size": report.cores,
                "accelerator": accelerator,
                "reference_prefill_path": str(workdir / "reference-prefill-logits.npy"),
            }
            reference, report.reference_reused = reference_once(
                reference_spec, backend, checkpoint, runtime, timeout_s, workdir
            )
    except RunFailure as failure:
        report.verdict = Verdict.SKIPPED if failure.error_class == ErrorClass.too_large else Verdict.ERROR
        report.error_class = failure.error_class
        report.error_message = failure.message
        return report
    report = RunReport.model_validate(report.model_dump() | reference)
    report.compiler_name = runtime.compiler_name
    report.compiler_version = runtime.compiler_version
    report.library_version = runtime.library_version
    report.torch_version = runtime.torch_version
    keys = ("wall_s", "load_s", "compile_s", "generate_s", "peak_memory_bytes", "parallelism", "visible_cores",
            "compile_cache")  # fmt: skip
    for key in keys:
        setattr(report, key, accelerator[key])
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.describe:
        settings = get_settings()
        info = describe(args.backend or settings.backend, args.timeout or settings.job_timeout_s)
        print(info.model_dump_json())
        return 0
    try:
        report = run(args)
    except Exception as exc:  # a bug of ours still ends in a report, never in a silent exit
        report = RunReport(
            model_id=args.model,
            task=args.task,
            backend=args.backend or get_settings().backend,
            verdict=Verdict.ERROR,
            error_class=ErrorClass.internal,
            error_message=f"runner: {type(exc).__name__}: {exc}",
        )
    text = report.model_dump_json()
    if args.report:
        tmp = args.report.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(args.report)
    print(text)
    return EXIT_CODES[report.verdict]


if __name__ == "__main__":
    sys.exit(main())

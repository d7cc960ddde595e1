"""The first-hour check of a new host: three runs of the runner, one per way a model is placed, and a table.

    python scripts/trn2_check.py [--backend neuron|cpu] [--models DIR] [--parallel]

- one model that fits one core;
- a dense model forced to tensor parallelism over 2 cores;
- a MoE model over 4 cores with expert parallelism.

By default the three are small real Hub models (downloaded through huggingface_hub: HF_TOKEN, HF_ENDPOINT,
HF_HOME apply); with ``--models DIR`` they are the tiny checkpoints of ``python -m testing.tiny_models DIR``.
Each run is ``python -m services.runner`` (the report is its last stdout line) on its own aligned core group
(0, 2-3, 4-7: NEURON_RT_VISIBLE_CORES on neuron), so ``--parallel`` can run them at once. Prints the driver,
runtime and compiler versions found, then verdict, cores, parallelism, wall, compile and peak memory per
model, and exits 0 only when every run PASSes. `scripts/trn2-check.sh` runs this in the neuron image.
"""

from __future__ import annotations

import argparse
import importlib.metadata
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

from shared.cores import CoreGroup, pin_environment  # noqa: E402


@dataclass(frozen=True)
class Check:
    what: str
    hub_id: str  # a small real model
    tiny: str  # its stand-in among testing.tiny_models
    cores: int


CHECKS = (
    Check("fits one core", "Qwen/Qwen3-0.6B", "tiny-llama", 1),
    Check("dense, TP over 2", "Qwen/Qwen3-1.7B", "tiny-qwen3", 2),
    Check("MoE, EP over 4", "ibm-granite/granite-3.1-1b-a400m-base", "tiny-qwen3-moe", 4),
)


def placements(checks: tuple[Check, ...]) -> list[CoreGroup]:
    """Disjoint aligned groups, smallest first: 0, 2-3, 4-7."""
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


def _package(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _dpkg(name: str) -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", name], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def versions(backend: str) -> dict[str, str | None]:
    """What this machine runs, found without importing torch (the runs report their compiler too)."""
    found: dict[str, str | None] = {
        "torch": _package("torch"),
        "transformers": _package("transformers"),
    }
    if backend == "neuron":
        found |= {
            # the driver is the host's kernel module; its sysfs entry is visible inside a container too
            "neuron driver": _read("/sys/module/neuron/version"),
            "neuron runtime": _dpkg("aws-neuronx-runtime-lib"),
            "neuron collectives": _dpkg("aws-neuronx-collectives"),
            "neuronx-cc": _package("neuronx-cc"),
            "torch-neuronx": _package("torch-neuronx"),
        }
    return found


def command(check: Check, backend: str, models: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "services.runner"]
    if models is not None:
        argv += [f"local/{check.tiny}", "--local-dir", str(models / check.tiny)]
    else:
        argv += [check.hub_id]
    return [*argv, "--backend", backend, "--cores", str(check.cores)]


def report_of(out: str, returncode: int) -> dict[str, Any]:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    return {"verdict": "ERROR", "error_class": "crash", "error_message": f"exit {returncode}, no report"}


def run_one(check: Check, group: CoreGroup, backend: str, models: Path | None, timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    try:
        done = subprocess.run(
            command(check, backend, models), cwd=ROOT, env=os.environ | pin_environment(backend, group),
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        report = report_of(done.stdout, done.returncode)
        if report.get("verdict") is None or done.returncode not in (0, 1, 3):
            sys.stderr.write(done.stderr[-3000:])
    except subprocess.TimeoutExpired:
        report = {"verdict": "ERROR", "error_class": "timeout", "error_message": f"no report after {timeout:.0f} s"}
    return report | {"check": check.what, "group": str(group), "elapsed_s": time.monotonic() - started}


def run_all(backend: str, models: Path | None, parallel: bool, timeout: float) -> list[dict[str, Any]]:
    runs = [(check, group, backend, models, timeout) for check, group in zip(CHECKS, placements(CHECKS), strict=True)]
    if not parallel:
        return [run_one(*run) for run in runs]
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: run_one(*run), runs))


def _num(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def table(reports: list[dict[str, Any]]) -> str:
    header = ("check", "model", "verdict", "cores", "parallelism", "wall s", "compile s", "peak GiB", "compiler")
    rows = [header]
    for r in reports:
        verdict = r.get("verdict") or "-"
        if r.get("error_class"):
            verdict += f"({r['error_class']})"
        rows.append((
            r["check"], r.get("model_id", "-"), verdict, str(r.get("cores", "-")), r.get("parallelism") or "-",
            _num(r.get("wall_s")), _num(r.get("compile_s")), _num(r.get("peak_memory_bytes"), 2**30, 2),
            r.get("compiler_version") or "-",
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/trn2_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--backend", choices=["neuron", "cpu", "cuda"], default="neuron")
    parser.add_argument("--models", type=Path, help="the tiny checkpoints' directory instead of the Hub models")
    parser.add_argument("--parallel", action="store_true", help="run the three at once, on disjoint cores")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per run (compilation included)")
    parser.add_argument("--json", type=Path, help="also write the reports here")
    args = parser.parse_args(argv)

    print(f"backend: {args.backend}")
    for name, version in versions(args.backend).items():
        print(f"{name}: {version or 'not found'}")
    print()
    reports = run_all(args.backend, args.models, args.parallel, args.timeout_s)
    print(table(reports))
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2))
    failed = [r["check"] for r in reports if r.get("verdict") != "PASS"]
    if failed:
        print(f"\nnot PASS: {', '.join(failed)}; each report's error_message and reproduce say more")
        for r in reports:
            if r.get("verdict") != "PASS" and r.get("error_message"):
                print(f"- {r['check']}: {r['error_message'].strip().splitlines()[-1][:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

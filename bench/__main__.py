"""`python -m bench [--only NAME ...]`: run the benchmarks, print one table, rewrite BENCHMARKS.md.

Each benchmark is a module of this package with ``run(work: Path) -> Section`` (see bench/report.py); it
measures ours and its baseline side by side in the same run. The default set fits in 20 minutes on the
2-CPU development machine; the calibrations (tens of minutes) run only when named with ``--only``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import BENCHMARKS_MD, Section, load_all, rewrite, save, summary  # noqa: E402


@dataclass(frozen=True)
class Benchmark:
    module: str
    default: bool  # in the plain `python -m bench` run
    about: str
    # A calibration script runs its own main(argv) and writes its own BENCHMARKS.md section (a fit and
    # what-if tables, not ours-against-a-baseline rows).
    script_argv: tuple[str, ...] | None = None


BENCHMARKS = {
    "makespan": Benchmark("bench.makespan", True, "P1: sweep makespan on a simulated trn2 fleet"),
    "burst": Benchmark("bench.burst", True, "P1/P3/P4: the mixed burst with real processes; simulated vs measured"),
    "compile_cache": Benchmark("bench.compile_cache", True, "P2: cold vs warm compile, 1 core and 2 ranks"),
    "api_scale": Benchmark("bench.api_scale", True, "P5: the API over 1 M result rows in PostgreSQL"),
    "export": Benchmark("bench.export_scale", True, "P6: full and incremental export, batched publish"),
    "tiers": Benchmark("bench.tiers", True, "issue 20: the performance and long-generation tiers' cost per size"),
    "calibrate_sizing": Benchmark(
        "bench.calibrate_sizing", False, "issue 9: sizing fit (4 min)", ("--measure", "--quick", "--write")
    ),
    "calibrate_verdict": Benchmark(
        "bench.calibrate_verdict",
        False,
        "issue 9: verdict thresholds (30 min)",
        ("--runs", "200", "--write", "--json", ".data/bench/verdict/runs.jsonl"),
    ),
    "calibrate_verdict_moe": Benchmark(
        "bench.calibrate_verdict",
        False,
        "issue 30: the MoE routing rule at a real router shape (about an hour on 2 CPUs, 75 min budget)",
        (
            "--moe",
            "--runs",
            "200",
            "--sharded",
            "50",
            "--fault-seeds",
            "8",
            "--budget-min",
            "75",
            "--write",
            "--json",
            "bench/results/verdict/moe-calibration.jsonl",
            "--resume",  # the plan's runs its journal already holds are taken from it
        ),
    ),
    "soak": Benchmark("bench.soak", False, "issue 23: the real stack under waves of jobs and faults (20 min + drain)"),
}


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "celery", "sqlalchemy"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--only", action="append", choices=sorted(BENCHMARKS), help="run this one (repeatable)")
    parser.add_argument("--work", type=Path, default=ROOT / ".data" / "bench", help="scratch space")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    names = args.only or [name for name, b in BENCHMARKS.items() if b.default]
    command = " ".join([".venv/bin/python -m bench", *(argv if argv is not None else sys.argv[1:])])
    ran: list[Section] = []
    started = time.monotonic()
    for name in names:
        bench = BENCHMARKS[name]
        print(f"== {name}: {bench.about}", flush=True)
        module = importlib.import_module(bench.module)
        if bench.script_argv is not None:
            module.main(list(bench.script_argv))
            continue
        work = args.work / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        t0 = time.monotonic()
        section = module.run(work)
        section = section.model_copy(
            update={
                "name": name,
                "seconds": time.monotonic() - t0,
                "date": time.strftime("%Y-%m-%d"),
                "command": command,
                "machine": machine(),
                "versions": versions(),
            }
        )
        ran.append(section)
        print(summary([section]), flush=True)
        if not args.no_write:
            save(section)
    print(f"\nall {len(ran)} in {(time.monotonic() - started) / 60:.1f} min\n")
    print(summary(ran))
    if not args.no_write:
        rewrite(BENCHMARKS_MD, load_all(list(BENCHMARKS)), ran, command, machine())
        print(f"\nwrote {BENCHMARKS_MD}")
    met = [m.met for s in ran for m in s.measures]
    return 0 if False not in met else 1


if __name__ == "__main__":
    sys.exit(main())

"""Issue 20: what the tiers past the 32-token verdict cost, per model size class, and how much a decode rate moves.

    .venv/bin/python -m bench --only tiers --no-write     (or: .venv/bin/python -m bench.tiers)

For each size class, a whole test (``python -m services.runner``, the cpu backend's inductor, fp32: the accelerator
run and the CPU reference) of one checkpoint, timed end to end: with both tiers off (the 32-token job alone) and
with the performance tier (3 timed generations of 64 tokens) and the long generation (256 tokens, against the
reference's) on — each after a warm-up run, so that neither pays a cold compile. Then the spread of the decode rate
over repeated runs of the tiny class: what the /changes noise band (``THROUGHPUT_NOISE_BAND``) must exceed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import checkpoints
from bench.report import Goal, Measure, Section, run_alone
from shared.contracts.report import RunReport
from shared.results.cells import THROUGHPUT_NOISE_BAND

ROOT = Path(__file__).resolve().parent.parent
CLASSES = {  # size class -> checkpoint
    "tiny (hidden 64, 2 layers, ~0.1 M parameters)": "tiny-llama",
    "small (hidden 512, 4 layers, ~13 M)": "wide-llama-512",
    "medium (hidden 1536, 4 layers, ~115 M)": "wide-llama-1536",
}
OFF = {"SUPPORTMATRIX_PERF_ITERATIONS": "0", "SUPPORTMATRIX_LONG_GENERATION": "false"}
ON = {"SUPPORTMATRIX_PERF_ITERATIONS": "3", "SUPPORTMATRIX_LONG_GENERATION": "true"}
REPEATS = 5  # decode-rate measurements of the tiny class
GOAL = Goal(on="ratio", at_most=2.0)  # the tiers at most double a job's seconds


def job(model: Path, work: Path, tiers: dict[str, str]) -> tuple[float, RunReport]:
    """One whole test in a fresh runner process: its seconds end to end, and its report."""
    env = {**os.environ, **tiers, "SUPPORTMATRIX_BACKEND": "cpu", "SUPPORTMATRIX_CPU_COMPILE_BACKEND": "inductor",
           "SUPPORTMATRIX_DATA_DIR": str(work / "data"), "SUPPORTMATRIX_CACHE_DIR": str(work / "cache")}  # fmt: skip
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "services.runner", f"local/{model.name}", "--local-dir", str(model)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)  # fmt: skip
    seconds = time.monotonic() - started
    report = RunReport.model_validate_json(done.stdout.strip().splitlines()[-1])
    if report.verdict is None or report.failure.error_class is not None:
        raise RuntimeError(f"{model.name}: {report.failure.error_message}")
    return seconds, report


def run(work: Path) -> Section:
    measures, rows = [], []
    for size, arch in CLASSES.items():
        model = checkpoints.build(work / "models", arch, 0)
        job(model, work, ON)  # warm-up: the compile cache holds this class's graphs from here on
        alone, _ = job(model, work, OFF)
        tiered, report = job(model, work, ON)
        performance, long = report.performance, report.long
        measures.append(Measure(
            measure=f"a whole test with both tiers vs the 32-token job alone: {size}", unit="s", ours=tiered,
            baseline=alone, baseline_name="32 tokens alone", goal=GOAL,
            note=f"+{tiered - alone:.1f} s: {performance.perf_iterations} x {performance.perf_new_tokens} timed "
            f"tokens and {long.long_new_tokens} long ones, on both sides",
        ))  # fmt: skip
        rows.append(
            f"| {size} | {alone:.1f} s | {tiered:.1f} s | +{tiered - alone:.1f} s ({tiered / alone:.2f}x) | "
            f"{performance.decode_tokens_per_s:.0f} | {performance.ttft_p50_s * 1000:.0f} ms | "
            f"{performance.tpot_p50_s * 1000:.1f} ms | {long.long_generation} |"
        )
    model = checkpoints.build(work / "models", "tiny-llama", 0)
    rates = [job(model, work, ON)[1].performance.decode_tokens_per_s or 0.0 for _ in range(REPEATS)]
    spread = (max(rates) - min(rates)) / statistics.median(rates)
    measures.append(Measure(
        measure=f"decode-rate spread over {REPEATS} runs of one model (max - min over the median)", unit="",
        ours=spread, goal=Goal(on="ours", at_most=THROUGHPUT_NOISE_BAND),
        note=f"rates {', '.join(f'{r:.0f}' for r in rates)} tokens/s; /changes flags a slowdown past "
        f"{THROUGHPUT_NOISE_BAND:.0%}",
    ))  # fmt: skip
    details = DETAILS.format(rows="\n".join(rows))
    return Section(name="tiers", title="Issue 20 — what the tiers past the verdict cost", measures=measures,
                   details=details)  # fmt: skip


DETAILS = """\
A whole test (`python -m services.runner`: the accelerator run, then the CPU reference and the verdict) of one
checkpoint per size class on the cpu backend's inductor, fp32, timed end to end after a warm-up run; the tiers are
the performance tier (`SUPPORTMATRIX_PERF_ITERATIONS=3` generations of 64 tokens, timed per step) and the long
generation (`SUPPORTMATRIX_LONG_GENERATION`: 256 tokens, and the reference's 256 with the accelerator's scored under
it). On trn2 the accelerator's share shrinks (its decode is fast) and the reference's CPU share is the same.

| size class | 32 tokens alone | with both tiers | extra | decode tokens/s | time to first token | per token | long |
|---|---:|---:|---:|---:|---:|---:|---|
{rows}
"""


def main() -> int:
    return run_alone(run, "bench-tiers-")


if __name__ == "__main__":
    sys.exit(main())

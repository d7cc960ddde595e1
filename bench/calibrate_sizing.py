"""Fit sizing's overhead factor and runtime reserve from measured peak memory (issue 9, item 7).

    .venv/bin/python bench/calibrate_sizing.py                  # rows of the results database
    .venv/bin/python bench/calibrate_sizing.py --measure [--write]  # rows measured here first (cpu backend)

``shared/hub/sizing.py`` predicts one core's peak as

    per_core(n) = weights_per_core * (1 + FRAGMENTATION) + (kv_cache / n + activations) + RUNTIME_RESERVE

(for MoE under expert parallelism, weights_per_core is the replicated weights plus 1/n of the experts'). Each row
stores the predicted figure (``predicted_peak_bytes_per_core``) and the measured one (``peak_memory_bytes``: the
max over ranks). The bench splits each prediction into its terms with sizing's own ``per_core_bytes`` — run with
the overhead at 0 and at 1, the difference is weights_per_core — and fits, by least squares,

    measured - (kv_cache / n + activations) = a * weights_per_core + b

so that a is the fitted 1 + FRAGMENTATION and b the fitted RUNTIME_RESERVE; it prints the relative prediction
error (median and max) before and after the fit. A row's shape comes from its checkpoint (a ``--local-dir`` in
its reproduce command, or the local Hugging Face cache at its commit); a row whose checkpoint is not here is
split approximately: weights_per_core = (predicted - RUNTIME_RESERVE) / (1 + FRAGMENTATION).

``--measure`` produces rows on this machine: the runner (``python -m services.runner … --local-dir DIR --cores N``,
the cpu backend) on the tiny fixtures, the bench's extra architectures and two wider Llamas (so that the weights
span three orders of magnitude), on 1 and 2 cores. On cpu the measured figure is the accelerator process's peak
RSS (``VmHWM``: Python, torch and the compiler included), not device memory: the fitted reserve is then a
process's baseline, and only trn2 rows (``max_memory_allocated`` per core) calibrate the constants the
service uses.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shared.contracts.report import RunReport  # noqa: E402

HEADING = "## Sizing calibration (issue 9)"
DEFAULT_WORK = ROOT / ".data" / "bench" / "sizing"
MIB = 1 << 20


@dataclass
class Row:
    model: str
    cores: int
    dtype: str
    predicted: int
    measured: int
    weights_per_core: float  # x of the fit
    rest: float  # kv cache / n + activations: predicted, never fitted
    exact: bool  # the terms come from the checkpoint's shape (not the approximate split)


def terms(shape: Any, cores: int, dtype: str) -> tuple[int, float, float]:
    """(predicted, weights_per_core, rest): sizing's own prediction and the terms it is made of."""
    from shared.hub import sizing

    split = sizing.per_core_terms(shape, cores, dtype)
    return sizing.per_core_bytes(shape, cores, dtype), split.weights, split.rest


def approximate(predicted: int) -> tuple[float, float]:
    from shared.hub import sizing

    return (predicted - sizing.RUNTIME_RESERVE) / (1 + sizing.FRAGMENTATION), 0.0


def _checkpoint_dir(reproduce: str | None, model_id: str, sha: str | None) -> Path | None:
    match = re.search(r"--local-dir (\S+)", reproduce or "")
    if match and Path(match.group(1)).is_dir():
        return Path(match.group(1))
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, revision=sha, local_files_only=True))
    except Exception:
        return None


def _row_dtype(compiler_version: str | None) -> str:
    """The run dtype a row ran at: a cpu row's compiler version says bf16 (``…-bf16``) or not; others run bf16."""
    version = compiler_version or ""
    return "float32" if "+cpu" in version and not version.endswith("-bf16") else "bfloat16"


def rows_from_database(url: str | None) -> list[Row]:
    import sqlalchemy as sa

    from shared.db.engine import make_engine
    from shared.db.models import Job, Result
    from shared.hub.sizing import checkpoint_shape
    from shared.settings import get_settings

    engine = make_engine(url or get_settings().database_url)
    query = (
        sa.select(
            Job.model_id,
            Job.sha,
            Result.cores,
            Result.peak_memory_bytes,
            Result.predicted_peak_bytes_per_core,
            Result.reproduce,
            Result.compiler_version,
        )
        .join(Job, Job.id == Result.job_id)
        .where(Result.peak_memory_bytes.is_not(None), Result.predicted_peak_bytes_per_core.is_not(None))
    )
    rows = []
    try:
        with engine.connect() as conn:
            found = list(conn.execute(query))
    except sa.exc.DBAPIError as exc:  # no database there, or one not migrated
        print(f"no results to read at {engine.url!r}: {str(exc.orig).splitlines()[0]}")
        return []
    for model_id, sha, cores, measured, predicted, reproduce, compiler in found:
        directory = _checkpoint_dir(reproduce, model_id, sha)
        if directory is not None:
            _, weights, rest = terms(checkpoint_shape(directory), cores, _row_dtype(compiler))
        else:
            weights, rest = approximate(predicted)
        rows.append(
            Row(model_id, cores, _row_dtype(compiler), predicted, measured, weights, rest, directory is not None)
        )
    return rows


# --- measuring here -------------------------------------------------------------------------------------


def measure(work: Path, quick: bool, compile_backend: str, dtype: str, log: Any) -> list[Row]:
    from bench import checkpoints
    from shared.hub.sizing import checkpoint_shape

    plan = [("tiny-llama", 1), ("tiny-llama", 2), ("tiny-mixtral", 2), ("wide-llama-512", 1), ("wide-llama-1536", 1),
            ("wide-llama-1536", 2)]  # fmt: skip
    if not quick:
        plan += [("tiny-qwen3", 1), ("tiny-qwen3-moe", 1), ("tiny-qwen3-moe", 2), ("tiny-gpt2", 1),
                 ("tiny-mistral", 2), ("tiny-phi3", 1), ("tiny-gemma", 1), ("tiny-olmo2", 2), ("tiny-granite", 1),
                 ("wide-llama-512", 2)]  # fmt: skip
    env = {**os.environ, "SUPPORTMATRIX_DATA_DIR": str(work / "data"), "SUPPORTMATRIX_CACHE_DIR": str(work / "cache"),
           "SUPPORTMATRIX_CPU_COMPILE_BACKEND": compile_backend, "SUPPORTMATRIX_CPU_DTYPE": dtype,
           "SUPPORTMATRIX_CPU_THREADS": "1"}  # fmt: skip
    rows = []
    for arch, cores in plan:
        model_dir = checkpoints.build(work / "models", arch, 0)
        started = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "services.runner", f"local/{arch}", "--local-dir", str(model_dir), "--cores",
             str(cores)], cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=1200,
        )  # fmt: skip
        lines = out.stdout.strip().splitlines()
        report = RunReport.model_validate_json(lines[-1]) if lines else None
        measured = report.resources.peak_memory_bytes if report else None
        if report is None or not measured:
            why = (report.failure.error_message if report else None) or out.stderr[-300:]
            print(f"{arch} x{cores}: no measurement ({why})", file=log)
            continue
        predicted, weights, rest = terms(checkpoint_shape(model_dir), cores, dtype)
        rows.append(Row(arch, cores, dtype, predicted, measured, weights, rest, True))
        print(f"{arch} x{cores}: predicted {predicted / MIB:.0f} MiB, measured {measured / MIB:.0f} MiB "
              f"({report.verdict}, {time.monotonic() - started:.0f} s)", file=log, flush=True)  # fmt: skip
    return rows


# --- the fit --------------------------------------------------------------------------------------------


def fit(rows: list[Row]) -> tuple[float, float]:
    """Least squares of measured - rest = a * weights_per_core + b (a alone when the weights do not vary)."""
    xs = [r.weights_per_core for r in rows]
    ys = [r.measured - r.rest for r in rows]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    if var == 0:
        return 1.0, mean_y - mean_x
    a = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return a, mean_y - a * mean_x


def errors(rows: list[Row], predict: Any) -> tuple[float, float]:
    rel = [abs(predict(r) - r.measured) / r.measured for r in rows]
    return statistics.median(rel), max(rel)


def report(rows: list[Row], source: str, command: str, wall_s: float) -> str:
    from shared.hub import sizing

    a, b = fit(rows)
    before = errors(rows, lambda r: r.predicted)
    after = errors(rows, lambda r: a * r.weights_per_core + r.rest + b)
    when = time.strftime("%Y-%m-%d")
    lines = [HEADING, "", f"{when} · `{command}` · {len(rows)} rows ({source}) in {wall_s / 60:.1f} min", ""]
    lines += ["| model | cores | dtype | weights per core | predicted | measured | after the fit |",
              "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        fitted = a * r.weights_per_core + r.rest + b
        weights = f"{r.weights_per_core / MIB:.1f} MiB{'' if r.exact else ' ≈'}"
        lines.append(f"| {r.model} | {r.cores} | {r.dtype} | {weights} | {r.predicted / MIB:.0f} MiB | "
                     f"{r.measured / MIB:.0f} MiB | {fitted / MIB:.0f} MiB |")  # fmt: skip
    lines += ["",
              f"Fitted: overhead factor a = {a:.3f} (sizing: 1 + FRAGMENTATION = {1 + sizing.FRAGMENTATION:.2f}), "
              f"reserve b = {b / MIB:.0f} MiB (sizing: RUNTIME_RESERVE = {sizing.RUNTIME_RESERVE / MIB:.0f} MiB).",
              f"Relative prediction error, median / max: before {100 * before[0]:.0f} % / {100 * before[1]:.0f} %, "
              f"after the fit {100 * after[0]:.0f} % / {100 * after[1]:.0f} %.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from bench.report import write_section

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", help="default: SUPPORTMATRIX_DATABASE_URL, or the data dir's SQLite")
    parser.add_argument("--measure", action="store_true", help="run the runner here (cpu) to produce the rows")
    parser.add_argument("--quick", action="store_true", help="--measure: six runs, not sixteen")
    parser.add_argument("--compile-backend", default="aot_eager", help="--measure: the cpu backend's compiler")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--write", type=Path, nargs="?", const=ROOT / "BENCHMARKS.md", help="put the table here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.measure:
        rows = measure(args.work, args.quick, args.compile_backend, args.dtype, sys.stdout)
        source = (
            f"measured here: cpu backend, {args.compile_backend}, {args.dtype}, peak RSS of the accelerator process"
        )
    else:
        rows = rows_from_database(args.database_url)
        source = "the results database"
    if len(rows) < 2:
        print(f"{len(rows)} row(s) with both a predicted and a measured peak: nothing to fit (try --measure)")
        return []
    command = ".venv/bin/python bench/calibrate_sizing.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(rows, source, command.strip(), time.monotonic() - started)
    print(text)
    if args.write:
        write_section(args.write, HEADING, text)
    return [vars(r) for r in rows]


if __name__ == "__main__":
    main()

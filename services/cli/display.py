"""What the CLI shows: rich tables of the API's records, and the live progress of jobs being waited for.

On a terminal the progress is a live display, one bar per job (queued → running → judging → done); when
stdout is a file or a pipe (CI, the demo's log) each state change is one printed line instead.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from shared.contracts.enums import ACTIVE_STATES, FINISHED_STATES

if TYPE_CHECKING:
    from services.api.schemas import JobOut, WorkerOut
    from shared.db.models import ApiToken
    from shared.jobs.sweeps import SweepOut
    from shared.results.cells import CellDiff
    from shared.results.records import ResultRecord

# Wide enough that a table written to a pipe is not folded into a column of ellipses.
console = Console(width=None if Console().is_terminal else 200)

STEPS = {state: step for step, state in enumerate(ACTIVE_STATES)}  # a finished job is past the last of them
VERDICT_STYLE = {"PASS": "green", "FAIL": "red", "ERROR": "red", "SKIPPED": "yellow", "FLAKY": "magenta"}


def verdict_text(verdict: str | None) -> str:
    if verdict is None:
        return "-"
    return f"[{VERDICT_STYLE.get(verdict, 'default')}]{verdict}[/]"


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def when(moment: dt.datetime | None) -> str:
    return "-" if moment is None else f"{moment:%Y-%m-%d %H:%M:%S}"


def _table(title: str | None, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for name in columns:
        table.add_column(name, justify="right" if name in NUMERIC else "left", overflow="fold")
    return table


NUMERIC = {"job", "id", "cores", "attempts", "wall s", "compile s", "peak MiB", "core count", "heartbeat s ago"}


def jobs_table(jobs: Iterable[JobOut], verdicts: dict[int, str | None] | None = None) -> Table:
    columns = ["job", "model", "state", "compiler", "transformers", "cores", "attempts", "created (UTC)", "error"]
    if verdicts is not None:
        columns.insert(3, "verdict")
    table = _table(None, *columns)
    for job in jobs:
        error = f"{job.error_class.value}: {job.error_message or ''}"[:120] if job.error_class else ""
        cells = [str(job.id), job.model_id, job.state.value, job.compiler_version, job.library_version,
                 str(job.cores), str(job.attempts), when(job.created_at), error]  # fmt: skip
        if verdicts is not None:
            cells.insert(3, verdict_text(verdicts.get(job.id)))
        table.add_row(*cells)
    return table


def results_table(rows: Iterable[ResultRecord]) -> Table:
    table = _table(None, "job", "model", "task", "result", "cores", "wall s", "compile s", "peak MiB", "compiler",
                   "transformers", "error")  # fmt: skip
    for r in rows:
        error = f"{r.error_class.value}: {r.error_message or ''}"[:120] if r.error_class else ""
        table.add_row(str(r.job_id), r.model_id, r.task, verdict_text(r.result), str(r.neuron_cores), _num(r.wall_s),
                      _num(r.compile_s), _mib(r.peak_memory_bytes), r.neuronx_cc, r.library_version, error)  # fmt: skip
    return table


def tokens_table(tokens: Iterable[ApiToken]) -> Table:
    table = _table(None, "name", "scope", "created (UTC)", "last used", "revoked")
    for t in tokens:
        table.add_row(t.name, t.scope.value, when(t.created_at), when(t.last_used_at), when(t.revoked_at))
    return table


def workers_table(workers: Iterable[WorkerOut]) -> Table:
    now = dt.datetime.now(dt.UTC)
    table = _table(None, "name", "host", "cores", "core count", "queue", "compiler", "transformers", "heartbeat s ago")
    for w in workers:
        beat = w.heartbeat_at if w.heartbeat_at.tzinfo else w.heartbeat_at.replace(tzinfo=dt.UTC)
        table.add_row(w.name, w.host, w.cores, str(w.core_count), w.queue, w.compiler_version, w.library_version,
                      f"{(now - beat).total_seconds():.0f}")  # fmt: skip
    return table


def diff_tables(diff: CellDiff) -> list[Table]:
    """One table per kind of change that has any, then a line of totals."""
    tables = []
    for kind in ("regressed", "fixed", "flaky", "changed"):
        changes = getattr(diff, kind)
        if not changes:
            continue
        table = _table(f"{kind} ({len(changes)})", "model", "task", diff.from_version, diff.to_version, "stacks")
        for c in changes:
            stacks = f"{c.from_stack.digest} → {c.to_stack.digest}"  # a side may hold several stacks of one version
            table.add_row(c.model_id, c.task, verdict_text(c.from_status), verdict_text(c.to_status), stacks)
        tables.append(table)
    if diff.slower:
        table = _table(f"slower ({len(diff.slower)})", "model", "task", f"{diff.from_version} tok/s",
                       f"{diff.to_version} tok/s")  # fmt: skip
        for speed in diff.slower:
            table.add_row(speed.model_id, speed.task, f"{speed.from_tokens_per_s:.1f}", f"{speed.to_tokens_per_s:.1f}")
        tables.append(table)
    return tables


def sweep_summary(sweep: SweepOut) -> str:
    jobs = ", ".join(f"{state.value} {n}" for state, n in sorted(sweep.jobs.items())) or "none"
    verdicts = ", ".join(f"{verdict_text(v.value)} {n}" for v, n in sorted(sweep.verdicts.items())) or "none yet"
    error = f" — {sweep.error}" if sweep.error else ""
    entries = len(sweep.entries)
    return f"sweep {sweep.id}: {sweep.state.value}{error}; {entries} entries; jobs: {jobs}; verdicts: {verdicts}"


def follow_jobs(
    jobs: list[JobOut],
    fetch: Callable[[int], JobOut],
    verdict_of: Callable[[JobOut], str | None],
    timeout_s: float,
    poll_s: float = 1.0,
) -> tuple[dict[int, JobOut], dict[int, str | None]]:
    """Poll each job until all have finished, showing their states; returns the last state and verdict of
    each. Raises TimeoutError naming the unfinished ones after ``timeout_s``."""
    latest = {job.id: job for job in jobs}
    verdicts: dict[int, str | None] = {}
    start = time.monotonic()
    live = console.is_terminal
    progress = Progress(
        SpinnerColumn(finished_text="•"),
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        TextColumn("{task.fields[state]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not live,
    )
    bars = {
        job.id: progress.add_task(f"job {job.id} {job.model_id} ({job.compiler_version})", total=len(STEPS), state="")
        for job in jobs
    }
    shown: dict[int, str] = {}

    def show(job: JobOut) -> None:
        state = job.state.value
        verdict = verdicts.get(job.id)
        label = f"{state} {verdict}" if verdict else state
        if job.error_class:
            label += f" ({job.error_class.value})"
        if live:
            styled = f"{state} {verdict_text(verdict)}" if verdict else state
            progress.update(bars[job.id], completed=STEPS.get(job.state, len(STEPS)), state=styled)
        elif shown.get(job.id) != label:
            console.print(
                f"  [{time.monotonic() - start:6.1f} s] job {job.id} {job.model_id}: {label}", highlight=False
            )
        shown[job.id] = label

    with progress:
        while True:
            for job_id, job in list(latest.items()):
                if job.state not in FINISHED_STATES:
                    job = latest[job_id] = fetch(job_id)
                if job.state in FINISHED_STATES and job_id not in verdicts:
                    verdicts[job_id] = verdict_of(job)
                show(job)
            if all(job.state in FINISHED_STATES for job in latest.values()):
                return latest, verdicts
            if time.monotonic() - start > timeout_s:
                waiting = ", ".join(
                    f"{j.id} ({j.state.value})" for j in latest.values() if j.state not in FINISHED_STATES
                )
                raise TimeoutError(f"gave up waiting after {timeout_s:g} s; unfinished jobs: {waiting}")
            time.sleep(poll_s)

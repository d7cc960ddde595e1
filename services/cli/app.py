"""The `supportmatrix` command: submit models and wait for their verdicts, read results, jobs, workers and
diffs, cancel jobs, start sweeps (all through the HTTP API); run the runner here; export and manage tokens (these
two open the database: the API has no route for them).

Exit status: 0 success; 1 an error, said in one line on stderr (the API unreachable or refusing, a bad token,
an unknown model, a database error; `--debug` adds the traceback); 2 bad usage; 3 `submit --wait` ended with
a job that did not PASS. `run` exits with the runner's own status (0 PASS, 1 FAIL, 2 bad usage, 3 ERROR or
SKIPPED).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from services.cli import display
from services.cli.client import ApiClient, CliError, one_line
from services.cli.display import console
from shared.contracts.enums import ACTIVE_STATES, Axis, JobState, Scope, SweepState, SweepView, Task, Verdict
from shared.contracts.run import CORE_SIZES

if TYPE_CHECKING:
    from pydantic import ValidationError

    from services.api.schemas import JobOut
    from shared.jobs.sweeps import SweepOut

DEFAULT_API_URL = "http://127.0.0.1:8000"
EXIT_NOT_PASS = 3


class Format(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"
    parquet = "parquet"


class Listing(StrEnum):
    table = "table"
    json = "json"


@dataclass
class Options:
    """The global options, kept where `main` finds `--debug` after the command has failed."""

    api_url: str = DEFAULT_API_URL
    token: str | None = None
    request_timeout_s: float = 60.0
    debug: bool = False

    def client(self) -> ApiClient:
        return ApiClient(self.api_url, self.token, self.request_timeout_s)


OPTIONS = Options()

app = typer.Typer(
    name="supportmatrix",
    help=__doc__,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain click help and usage errors: greppable, one "Error:" line
    pretty_exceptions_enable=False,
)
tokens_app = typer.Typer(
    help="API tokens, the only way to manage them. Opens the database directly (SUPPORTMATRIX_DATABASE_URL): the "
    "API has no token routes, so run this where the service's settings are.",
    no_args_is_help=True,
)
app.add_typer(tokens_app, name="tokens")


@app.callback()
def global_options(
    api_url: Annotated[str, typer.Option(envvar="SUPPORTMATRIX_API_URL", help="The API's base URL.")] = DEFAULT_API_URL,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="SUPPORTMATRIX_API_TOKEN",
            help="Bearer token for writes (submit, cancel, sweep); reads need none.",
            show_default=False,
        ),
    ] = None,
    request_timeout: Annotated[float, typer.Option(help="Seconds to wait for each answer of the API.")] = 60.0,
    debug: Annotated[bool, typer.Option("--debug", help="On an error, print the traceback too.")] = False,
) -> None:
    OPTIONS.api_url, OPTIONS.token, OPTIONS.request_timeout_s, OPTIONS.debug = api_url, token, request_timeout, debug


def _cores_help(default: str) -> str:
    """The --cores help of submit and run: the sizes a job may ask for, as shared.contracts.run allows them."""
    *smaller, largest = CORE_SIZES
    return f"Shard over {', '.join(map(str, smaller))} or {largest} cores; default: {default}."


# --- jobs ----------------------------------------------------------------------------------------------------


@app.command()
def submit(
    models: Annotated[list[str], typer.Argument(metavar="MODEL", help="Hub model ids, org/name.")],
    revision: Annotated[str | None, typer.Option(help="Branch, tag or commit sha; default: the Hub's main.")] = None,
    compiler: Annotated[
        list[str] | None,
        typer.Option(help="A compiler version to test with; repeat for several. Default: every one workers serve."),
    ] = None,
    cores: Annotated[int | None, typer.Option(help=_cores_help("the fewest that hold it"))] = None,
    task: Annotated[Task | None, typer.Option(help="Default: from the model's pipeline tag.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rerun finished identical jobs (an admin token).")] = False,
    wait: Annotated[
        bool, typer.Option("--wait", help="Follow each job to its verdict; exit 0 only if every job PASSes, else 3.")
    ] = False,
    timeout: Annotated[float, typer.Option(help="With --wait: seconds to wait for every verdict.")] = 3600.0,
) -> None:
    """Submit models (POST /jobs): one job per compiler version. Needs a token of scope submit."""
    from pydantic import ValidationError

    from services.api.schemas import JobCreate

    try:
        bodies = [
            JobCreate.model_validate(
                {
                    "model_id": m,
                    "revision": revision,
                    "compilers": compiler or None,
                    "cores": cores,
                    "task": task,
                    "force": force,
                }
            )
            for m in models
        ]
    except ValidationError as exc:
        raise typer.BadParameter(_invalid(exc)) from exc
    client = OPTIONS.client()
    jobs: list[JobOut] = []
    for body in bodies:
        for job in client.submit(body).jobs:
            jobs.append(job)
            how = "submitted" if job.created else "already there"
            console.print(
                f"job {job.id} {job.model_id} @ {job.sha[:12]} ({job.compiler_version}, {job.cores} core"
                f"{'s' if job.cores > 1 else ''}): {job.state.value}, {how}",
                highlight=False,
            )
    if not wait:
        return

    def verdict_of(job: JobOut) -> str | None:
        if job.state == JobState.cancelled:
            return None
        rows = client.results(model_id=job.model_id, compiler=job.compiler_version, limit=100).items
        return next((row.result.value for row in rows if row.job_id == job.id), None)

    try:
        final, verdicts = display.follow_jobs(jobs, client.job, verdict_of, timeout)
    except TimeoutError as exc:
        raise CliError(str(exc)) from exc
    console.print(display.jobs_table(final.values(), verdicts))
    passed = sum(verdicts.get(job_id) == Verdict.PASS for job_id in final)
    if passed == len(final):
        console.print(f"every job PASS ({passed})")
        return
    console.print(f"{passed} of {len(final)} jobs PASS")
    raise typer.Exit(EXIT_NOT_PASS)


@app.command("jobs")
def list_jobs(
    state: Annotated[JobState | None, typer.Option(help="Only jobs in this state.")] = None,
    model: Annotated[str | None, typer.Option(help="Only this model's jobs.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 50,
    cursor: Annotated[int | None, typer.Option(help="The next page: the cursor a previous page printed.")] = None,
    format: Annotated[Listing, typer.Option("--format")] = Listing.table,
) -> None:
    """List jobs (GET /jobs), newest first."""
    page = OPTIONS.client().jobs(state=state, model_id=model, limit=limit, cursor=cursor)
    if format == Listing.json:
        print(page.model_dump_json(indent=2))
        return
    console.print(display.jobs_table(page.items) if page.items else "no job matches")
    _more(page.next_cursor)


@app.command()
def cancel(job_ids: Annotated[list[int], typer.Argument(metavar="JOB", help="Job ids.")]) -> None:
    """Cancel queued jobs, or stop running ones (DELETE /jobs/ID). Needs a token of scope submit."""
    client = OPTIONS.client()
    for job_id in job_ids:
        job = client.cancel(job_id)
        console.print(f"job {job.id} {job.model_id}: {job.state.value}", highlight=False)


# --- results -------------------------------------------------------------------------------------------------


@app.command()
def results(
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    compiler: Annotated[str | None, typer.Option(help="Only this compiler version.")] = None,
    library_version: Annotated[str | None, typer.Option(help="Only this transformers version.")] = None,
    verdict: Annotated[Verdict | None, typer.Option(help="Only this verdict.")] = None,
    view: Annotated[SweepView | None, typer.Option(help="The newest sweep's view, in its rank order.")] = None,
    task: Annotated[Task | None, typer.Option(help="With --view: its task.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many rows, newest first.")] = 100,
    cursor: Annotated[int | None, typer.Option(help="The next page: the cursor a previous page printed.")] = None,
    format: Annotated[
        Format, typer.Option("--format", help="table, or the API's json, csv or parquet.")
    ] = Format.table,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to this file (json, csv, parquet).")
    ] = None,
) -> None:
    """Results (GET /results), newest first: a table, or JSON, CSV or Parquet with the public dataset's columns."""
    params: dict[str, Any] = {"model_id": model, "compiler": compiler, "library_version": library_version,
                              "verdict": verdict, "view": view, "task": task, "limit": limit,
                              "cursor": cursor}  # fmt: skip
    client = OPTIONS.client()
    if format == Format.table:
        if output is not None:
            raise typer.BadParameter("a table is for reading: use --format json, csv or parquet with --output")
        page = client.results(**params)
        console.print(display.results_table(page.items) if page.items else "no result matches")
        _more(page.next_cursor)
        return
    response = client.results_as(format.value, **params)
    content = (json.dumps(response.json(), indent=2) + "\n").encode() if format == Format.json else response.content
    if output is not None:
        output.write_bytes(content)
        more = response.headers.get("X-Next-Cursor")
        print(
            f"wrote {output} ({len(content)} bytes)" + (f"; next page: --cursor {more}" if more else ""),
            file=sys.stderr,
        )
    elif format == Format.parquet and sys.stdout.isatty():
        raise CliError("Parquet is binary: write it with -o FILE, or pipe stdout into a file")
    else:
        sys.stdout.buffer.write(content)
        sys.stdout.flush()


@app.command()
def diff(
    old: Annotated[str, typer.Argument(metavar="OLD", help="The older version.")],
    new: Annotated[str, typer.Argument(metavar="NEW", help="The newer version.")],
    axis: Annotated[
        Axis, typer.Option(help="Compare compiler versions, transformers versions, or whole stacks (by digest).")
    ] = Axis.compiler,
    format: Annotated[Listing, typer.Option("--format")] = Listing.table,
) -> None:
    """What regressed (PASS → FAIL/ERROR), was fixed, or is FLAKY between two versions (GET /results/diff)."""
    changes = OPTIONS.client().diff(old, new, axis.value)
    if format == Listing.json:
        print(changes.model_dump_json(indent=2, by_alias=True))
        return
    tables = display.diff_tables(changes)
    for table in tables:
        console.print(table)
    counts = ", ".join(f"{len(getattr(changes, k))} {k}" for k in ("regressed", "fixed", "flaky", "changed"))
    console.print(f"{old} → {new} ({axis.value}): {counts if tables else 'no change'}", highlight=False)


# --- the service ---------------------------------------------------------------------------------------------


@app.command()
def workers(format: Annotated[Listing, typer.Option("--format")] = Listing.table) -> None:
    """Live workers (GET /workers): host, core group, queue, and the runtime each serves."""
    found = OPTIONS.client().workers()
    if format == Listing.json:
        print(json.dumps([w.model_dump(mode="json") for w in found], indent=2))
        return
    console.print(display.workers_table(found))
    if not found:
        console.print("no live worker: nothing will run what is submitted")


@app.command()
def sweep(
    wait: Annotated[bool, typer.Option("--wait", help="Follow it until it and every job it made finished.")] = False,
    sweep_id: Annotated[int | None, typer.Option("--id", help="Show this sweep instead of starting one.")] = None,
    timeout: Annotated[float, typer.Option(help="With --wait: seconds to wait.")] = 24 * 3600.0,
) -> None:
    """Start a sweep of the Hub now (POST /sweeps; an admin token), or show one (--id); --wait follows it."""
    client = OPTIONS.client()
    current = client.sweep(sweep_id) if sweep_id is not None else client.start_sweep()
    said = display.sweep_summary(current)
    console.print(said, highlight=False)
    start = time.monotonic()
    while wait and not _sweep_finished(current):
        if time.monotonic() - start > timeout:
            raise CliError(f"gave up waiting for sweep {current.id} after {timeout:g} s")
        time.sleep(2)
        current = client.sweep(current.id)
        if display.sweep_summary(current) != said:
            said = display.sweep_summary(current)
            console.print(said, highlight=False)
    if current.state == SweepState.failed:
        raise CliError(f"sweep {current.id} failed: {current.error}")


def _sweep_finished(sweep: SweepOut) -> bool:
    active = sum(n for state, n in sweep.jobs.items() if state in ACTIVE_STATES)
    return sweep.state in (SweepState.done, SweepState.failed) and active == 0


@app.command()
def export() -> None:
    """Export results to Parquet now, here: the collector's export (`python -m services.worker.collector`), run
    against the database (SUPPORTMATRIX_DATABASE_URL) into SUPPORTMATRIX_EXPORT_DIR, then pushed to
    SUPPORTMATRIX_PUBLISH_REPO when that is set. The API has no export route: workers ask the collector to export
    after every result, so this is for a first export, or one by hand."""
    from services.worker.collector import export_once

    export_once()


# --- the runner, here ----------------------------------------------------------------------------------------


def _runner_help(field: str) -> str:
    """A runner flag's help, from its RunRequest field: described once."""
    from shared.contracts.run import RunRequest

    return (RunRequest.model_fields[field].description or "").capitalize() + "."


@app.command()
def run(
    model: Annotated[str, typer.Argument(metavar="MODEL", help=_runner_help("model_id"))],
    revision: Annotated[str | None, typer.Option(help=_runner_help("revision"))] = None,
    local_dir: Annotated[Path | None, typer.Option(help=_runner_help("local_dir"))] = None,
    backend: Annotated[str | None, typer.Option(help="cpu, cuda or neuron; default: SUPPORTMATRIX_BACKEND.")] = None,
    task: Annotated[Task, typer.Option(help=_runner_help("task"))] = Task.text_generation,
    cores: Annotated[int | None, typer.Option(help=_cores_help("sized"))] = None,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help=_runner_help("trust_remote_code"))
    ] = False,
    timeout: Annotated[float | None, typer.Option(help=_runner_help("timeout_s"))] = None,
    report: Annotated[Path | None, typer.Option(help=_runner_help("report"))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the runner's JSON report, not a summary.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the runner's command; run nothing.")] = False,
) -> None:
    """Test one model here, in a runner child (`python -m services.runner`, as a row's reproduce command runs it):
    the CPU reference and the accelerator run, then the verdict. Exits with the runner's status."""
    from pydantic import ValidationError

    from shared.contracts.report import RunReport
    from shared.contracts.run import RUNNER_MODULE, RunRequest

    try:
        fields = {"model_id": model, "revision": revision, "local_dir": local_dir, "backend": backend,
                  "task": task, "cores": cores, "trust_remote_code": trust_remote_code, "timeout_s": timeout,
                  "report": report}  # fmt: skip
        request = RunRequest.model_validate(fields)
    except ValidationError as exc:
        raise typer.BadParameter(_invalid(exc)) from exc
    command = [sys.executable, "-m", RUNNER_MODULE, *request.to_argv()]
    if dry_run:
        print(shlex.join(command))
        return
    # The runner's log goes to stderr as it runs; its report is the last line of its stdout.
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    *before, last = done.stdout.splitlines() or [""]
    try:
        outcome = RunReport.model_validate_json(last)
    except ValueError:
        sys.stdout.write(done.stdout)
        raise typer.Exit(done.returncode) from None
    if as_json:
        print(last)
        raise typer.Exit(done.returncode)
    for line in before:
        print(line)
    cores = outcome.provenance.cores
    runtime = outcome.runtime
    compiler = f" ({runtime.compiler_name} {runtime.compiler_version})" if runtime else ""
    subject = outcome.subject
    on = f"{subject.backend}, {cores} core{'s' if cores > 1 else ''}{compiler}"
    console.print(f"{subject.model_id}: {display.verdict_text(outcome.verdict)} on {on}", highlight=False)
    timings, peak = outcome.timings, outcome.resources.peak_memory_bytes
    if timings.wall_s is not None:
        memory = f", peak {peak / 2**20:.0f} MiB" if peak else ""
        console.print(f"  wall {timings.wall_s:.1f} s, compile {timings.compile_s or 0:.1f} s{memory}", highlight=False)
    failure = outcome.failure
    if failure.error_class:
        console.print(f"  {failure.error_class.value}: {one_line(failure.error_message or '')[:300]}", highlight=False)
    elif outcome.verdict_reason:
        console.print(f"  {outcome.verdict_reason}", highlight=False)
    raise typer.Exit(done.returncode)


# --- tokens (the database, directly) -------------------------------------------------------------------------


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Who or what holds it, e.g. ci or alice.")],
    scope: Annotated[
        Scope, typer.Option(help="submit: submit and cancel; admin: also force reruns and start sweeps.")
    ] = Scope.submit,
) -> None:
    """Add a token and print it, alone on stdout, once: only its SHA-256 is stored."""
    from shared.auth.tokens import TokenExists, create_token
    from shared.db.engine import session_scope

    try:
        with session_scope() as session:
            token = create_token(session, name, scope)
    except TokenExists as exc:
        raise CliError(str(exc)) from exc
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    print(token)
    print(f"token {name!r} ({scope.value}) created; it is not shown again", file=sys.stderr)


@tokens_app.command("list")
def tokens_list() -> None:
    """Names, scopes and dates; never the tokens."""
    from shared.auth.tokens import list_tokens
    from shared.db.engine import session_scope

    with session_scope() as session:
        console.print(display.tokens_table(list_tokens(session)))


@tokens_app.command("revoke")
def tokens_revoke(name: Annotated[str, typer.Argument(metavar="NAME", help="The token's name.")]) -> None:
    """Revoke a token by name: it is refused from the next request on."""
    from shared.auth.tokens import TokenNotFound, revoke_token
    from shared.db.engine import session_scope

    try:
        with session_scope() as session:
            token = revoke_token(session, name)
            revoked = display.when(token.revoked_at)
    except TokenNotFound as exc:
        raise CliError(str(exc)) from exc
    print(f"token {name!r} revoked at {revoked} (UTC)")


# --- the entry point -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Run the command; our errors and any bug end as one line on stderr (`--debug`: with the traceback)."""
    command = typer.main.get_command(app)
    try:
        command.main(args=argv, prog_name="supportmatrix")  # exits: usage errors 2, typer.Exit its code
    except CliError as exc:
        _fail(str(exc), exc.exit_code)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _fail(f"{type(exc).__name__}: {one_line(first)}" + ("" if OPTIONS.debug else " (--debug shows the traceback)"))


def _fail(message: str, exit_code: int = 1) -> None:
    if OPTIONS.debug:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)


def _invalid(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())


def _more(next_cursor: str | None) -> None:
    if next_cursor:
        print(f"more: --cursor {next_cursor}", file=sys.stderr)

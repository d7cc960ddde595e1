"""The `supportmatrix` command, run as a user runs it: the installed entry point in a subprocess, against a real
API server on a port (uvicorn, in a thread of this process), the suite's database, Redis, Hub stand-in and
worker. One job really runs (submit --wait); everything else reads seeded rows or gets an instant answer."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
import sqlalchemy as sa

from shared.auth.tokens import create_token
from shared.contracts.enums import Scope, Verdict
from shared.contracts.run import RunRequest
from shared.db.engine import new_session, session_scope
from shared.db.models import Job
from shared.hub.client import ResolvedModel
from shared.jobs.submission import submit
from shared.processes import free_port
from shared.settings import get_settings
from tests.conftest import ROOT
from tests.history import record, runtime

CLI = Path(sys.executable).parent / "supportmatrix"  # the [project.scripts] entry point
SEED = f"cli{uuid.uuid4().hex[:8]}"  # an org of seeded rows, and a compiler pair of their own
OLD, NEW = f"{SEED}-1.0", f"{SEED}-2.0"


# --- a real API, and the command against it ------------------------------------------------------------------


@pytest.fixture(scope="module")
def api_url(hub: Any) -> Iterator[str]:
    """The app served by uvicorn on a free port, in a thread: a server the CLI reaches over TCP."""
    import uvicorn

    from services.api.main import app

    assert CLI.exists(), f"{CLI} is missing: install the project (pip install --no-deps -e .)"
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="cli-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the API did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def new_token(scope: Scope) -> str:
    with session_scope() as session:
        return create_token(session, f"cli-{scope.value}-{uuid.uuid4().hex[:8]}", scope)


@pytest.fixture(scope="module")
def admin_token() -> str:
    return new_token(Scope.admin)


def env_for(api_url: str, token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SUPPORTMATRIX_API_TOKEN"}
    return env | {"SUPPORTMATRIX_API_URL": api_url} | ({"SUPPORTMATRIX_API_TOKEN": token} if token else {})


def cli(api_url: str, *args: str, token: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *args], cwd=ROOT, env=env_for(api_url, token), capture_output=True, text=True, timeout=timeout
    )


def cli_at_once(api_url: str, *commands: tuple[str, ...], token: str | None = None) -> list[Any]:
    """Independent commands, run concurrently (each is a process of its own): their results, in order."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: cli(api_url, *args, token=token), commands))


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def one_line_error(proc: subprocess.CompletedProcess[str], *says: str) -> str:
    """A failure: exit 1 and exactly one line on stderr, no traceback."""
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(s in lines[0] for s in says), lines[0]
    return lines[0]


# --- seeded rows ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seeded() -> dict[str, int]:
    """Results under two compiler versions of this module's own (one regression, one fix, one steady PASS), and
    a queued job no worker serves. Returns the ids of the queued job and of a finished one."""
    old, new = runtime(OLD, "5.0"), runtime(NEW, "5.0")
    with new_session() as session:  # record() commits each run
        for model, before, after in [("steady", Verdict.PASS, Verdict.PASS), ("broke", Verdict.PASS, Verdict.FAIL),
                                     ("mended", Verdict.ERROR, Verdict.PASS)]:  # fmt: skip
            record(session, f"{SEED}/{model}", old, before)
            record(session, f"{SEED}/{model}", new, after)
        waiting = ResolvedModel(model_id=f"{SEED}/waiting", sha="c" * 40, gated=False, pipeline_tag=None)
        [queued] = submit(session, waiting, None, [new])
        session.commit()
        done = session.scalar(sa.select(Job.id).where(Job.model_id == f"{SEED}/steady", Job.compiler_version == NEW))
        return {"queued": queued.job.id, "done": done}


# --- one real job, started first so that the other tests run while it does --------------------------------------


@pytest.fixture(scope="module")
def cli_org(hub: Any, tiny_models: Path) -> None:
    """The tiny checkpoints as an org of this module's own: a new job, never another module's."""
    hub.add_dir(tiny_models, org="cli")
    hub.add("cli/adapter", tiny_models / "tiny-adapter", pipeline_tag="text-generation", library_name="peft")


@pytest.fixture(scope="module")
def passing_submission(api_url: str, admin_token: str, worker: Any, cli_org: None) -> Iterator[subprocess.Popen[str]]:
    """`supportmatrix submit cli/tiny-gpt2 --compiler <w-main's> --wait`, running in the background."""
    [live] = [w for w in httpx.get(f"{api_url}/workers").json() if w["name"].startswith("w-main@")]
    command = [
        str(CLI),
        "submit",
        "cli/tiny-gpt2",
        "--compiler",
        live["compiler_version"],
        "--wait",
        "--timeout",
        "170",
    ]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env_for(api_url, admin_token), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_workers_lists_the_live_workers_and_their_core_groups(api_url: str, passing_submission: Any) -> None:
    out = ok(cli(api_url, "workers"))
    assert "w-main@" in out and "core count" in out
    [row] = [line for line in out.splitlines() if "w-main@" in line]
    assert "aot_eager-2.13.0+cpu" in row and "supportmatrix.jobs.cpu." in row


def test_errors_are_one_line_with_a_nonzero_exit(api_url: str, admin_token: str) -> None:
    """API down, unknown model, bad token, no token: one line and exit 1; a bad flag or value: usage, exit 2;
    --debug: the traceback too. The commands are independent, so they run at once."""
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    runs = {
        "down": (down, "jobs"),
        "unknown model": (api_url, "submit", "cli/no-such-model"),
        "bad token": (api_url, "--token", "smx_not-a-token", "submit", "cli/tiny-gpt2"),
        "no token": (api_url, "cancel", "1"),
        "bad flag": (api_url, "jobs", "--no-such-flag"),
        "bad value": (api_url, "submit", "not a model id"),
        "debug": (down, "--debug", "jobs"),
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        token = {"unknown model": admin_token, "bad value": admin_token}
        futures = {what: pool.submit(cli, *args, token=token.get(what)) for what, args in runs.items()}
        done = {what: future.result() for what, future in futures.items()}
    one_line_error(done["down"], "cannot reach the API", down, "connection refused")
    one_line_error(done["unknown model"], "cli/no-such-model does not exist on the Hub", "(404 from POST /jobs)")
    one_line_error(done["bad token"], "the API refused the token (401)")
    one_line_error(done["no token"], "needs an API token", "SUPPORTMATRIX_API_TOKEN")
    bad_flag, bad_value, debug = done["bad flag"], done["bad value"], done["debug"]
    assert bad_flag.returncode == 2 and "No such option: --no-such-flag" in bad_flag.stderr, bad_flag.stderr
    assert bad_value.returncode == 2 and "not a Hub model id" in bad_value.stderr, bad_value.stderr
    assert debug.returncode == 1 and "Traceback" in debug.stderr, debug.stderr
    assert debug.stderr.rstrip().splitlines()[-1].startswith("error: cannot reach the API"), debug.stderr


def test_submit_wait_exits_3_when_a_job_does_not_pass(api_url: str, admin_token: str, cli_org: None) -> None:
    """An adapter repo is SKIPPED at submission: --wait finds it finished at once, and the exit says not PASS."""
    proc = cli(api_url, "submit", "cli/adapter", "--wait", token=admin_token)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert re.search(r"job \d+ cli/adapter: done SKIPPED \(adapter\)", proc.stdout), proc.stdout
    assert "0 of 1 jobs PASS" in proc.stdout


def test_results_as_a_table_json_csv_and_parquet(api_url: str, seeded: dict[str, int], tmp_path: Path) -> None:
    out = tmp_path / "old.parquet"
    table, as_json, as_csv, wrote = cli_at_once(
        api_url,
        ("results", "--compiler", NEW),
        ("results", "--model", f"{SEED}/broke", "--format", "json"),
        ("results", "--compiler", OLD, "--format", "csv"),
        ("results", "--compiler", OLD, "--verdict", "PASS", "--format", "parquet", "-o", str(out)),
    )
    assert {f"{SEED}/steady", f"{SEED}/broke", f"{SEED}/mended"} <= set(re.findall(rf"{SEED}/\w+", ok(table)))
    assert re.search(rf"{SEED}/broke .*FAIL", table.stdout)
    page = json.loads(ok(as_json))
    assert sorted((r["neuronx_cc"], r["result"]) for r in page["items"]) == [(OLD, "PASS"), (NEW, "FAIL")]
    csv = pd.read_csv(io.StringIO(ok(as_csv)))
    assert sorted(csv.model_id) == [f"{SEED}/broke", f"{SEED}/mended", f"{SEED}/steady"]
    assert ok(wrote) == "" and f"wrote {out}" in wrote.stderr
    frame = pd.read_parquet(out)
    assert sorted(frame.model_id) == [f"{SEED}/broke", f"{SEED}/steady"] and set(frame.result) == {"PASS"}


def test_diff_lists_what_regressed_and_what_was_fixed(api_url: str, seeded: dict[str, int]) -> None:
    out = ok(cli(api_url, "diff", OLD, NEW))
    assert re.search(rf"regressed \(1\)[\s\S]*{SEED}/broke .*PASS .*FAIL", out), out
    assert re.search(rf"fixed \(1\)[\s\S]*{SEED}/mended .*ERROR .*PASS", out), out
    assert f"{SEED}/steady" not in out and "1 regressed, 1 fixed, 0 flaky, 0 changed" in out


def test_jobs_and_cancel(api_url: str, admin_token: str, seeded: dict[str, int]) -> None:
    job_id = seeded["queued"]
    listed, refused = cli_at_once(
        api_url,
        ("jobs", "--state", "queued", "--model", f"{SEED}/waiting"),
        ("cancel", str(seeded["done"])),
        token=admin_token,
    )
    assert re.search(rf"{job_id} .*{SEED}/waiting .*queued", ok(listed)), listed.stdout
    one_line_error(refused, "already finished (done)", "409")
    assert (
        ok(cli(api_url, "cancel", str(job_id), token=admin_token)).strip() == f"job {job_id} {SEED}/waiting: cancelled"
    )


def test_sweep_starts_one_shows_it_and_waits_for_it(api_url: str, admin_token: str) -> None:
    """POST /sweeps through the command. The broker is a recorder here: a real sweep message on the suite's
    shared control queue would be run later by another module's control worker. The sweep is then finished in
    SQL, as a control worker would, for `--wait` to see it end."""
    from services.api.deps import producer
    from services.api.main import app
    from shared.contracts.enums import SweepState
    from shared.db.models import Sweep, utcnow

    one_line_error(cli(api_url, "sweep", token=new_token(Scope.submit)), "(403)", "admin")
    sent: list[Any] = []

    class Recorder:
        def send_task(self, name: str, args: list[Any], queue: str) -> None:
            sent.append((name, args, queue))

    app.dependency_overrides[producer] = Recorder
    try:
        started = ok(cli(api_url, "sweep", token=admin_token))
    finally:
        app.dependency_overrides.pop(producer, None)
    sweep_id = int(re.fullmatch(r"sweep (\d+): queued; 0 entries; jobs: none; verdicts: none yet\n", started)[1])  # type: ignore[index]
    assert sent == [("supportmatrix.sweep", [sweep_id], "supportmatrix.control")]
    with session_scope() as session:
        swept = session.get(Sweep, sweep_id)
        assert swept is not None
        swept.state, swept.finished_at = SweepState.done, utcnow()
    assert ok(cli(api_url, "sweep", "--id", str(sweep_id), "--wait")).startswith(f"sweep {sweep_id}: done;")


def test_run_builds_the_reproduce_commands_argv_and_runs_the_runner(api_url: str, tiny_models: Path) -> None:
    request = RunRequest(model_id="local", local_dir=tiny_models / "tiny-gpt2", backend="cpu", cores=1)
    args = ["run", "local", "--local-dir", str(tiny_models / "tiny-gpt2"), "--backend", "cpu", "--cores", "1"]
    dry = ok(cli(api_url, *args, "--dry-run"))
    python, *argv = shlex.split(dry)  # the entry point's python: this venv's, maybe named python3
    assert Path(python).resolve() == Path(sys.executable).resolve()
    assert argv == ["-m", "services.runner", *request.to_argv()]
    # A real runner child: a model the Hub does not have ends ERROR(not_found), whose exit status (3) passes through.
    missing = cli(api_url, "run", "cli/no-such-model", "--backend", "cpu", timeout=120)
    assert missing.returncode == 3, missing.stdout + missing.stderr
    assert "cli/no-such-model: ERROR on cpu" in missing.stdout and "not_found:" in missing.stdout


def test_export_writes_the_parquet_files_here(api_url: str, seeded: dict[str, int]) -> None:
    out = ok(cli(api_url, "export"))
    data = get_settings().export_path / "data"
    assert re.fullmatch(rf"{re.escape(str(data))}: \d+ written, \d+ unchanged\n", out), out
    frame = pd.read_parquet(data)
    assert f"{SEED}/broke" in set(frame.model_id)


def test_tokens_create_list_revoke(api_url: str) -> None:
    """The one token command: a token it creates is accepted by the API, listed without itself, refused once
    revoked; a taken name is an error (1), a bad one bad usage (2)."""
    name = f"cli-made-{uuid.uuid4().hex[:8]}"
    created = cli(api_url, "tokens", "create", name, "--scope", "submit")
    token = ok(created).strip()
    assert token.startswith("smx_") and "\n" not in token and "not shown again" in created.stderr
    cancel_missing_job = {"url": f"{api_url}/jobs/987654321", "headers": {"Authorization": f"Bearer {token}"}}
    assert httpx.delete(**cancel_missing_job).status_code == 404  # past authentication: no such job
    listed, unknown, taken, bad = cli_at_once(
        api_url, ("tokens", "list"), ("tokens", "revoke", f"{name}-nobody"), ("tokens", "create", name),
        ("tokens", "create", "bad name"),
    )  # fmt: skip
    [row] = [line for line in ok(listed).splitlines() if name in line]
    assert "submit" in row and token not in listed.stdout + listed.stderr
    one_line_error(unknown, "no token named")
    assert taken.returncode == 1 and bad.returncode == 2, (taken.stderr, bad.stderr)
    assert ok(cli(api_url, "tokens", "revoke", name)).startswith(f"token '{name}' revoked at ")
    assert httpx.delete(**cancel_missing_job).status_code == 401


def test_submit_wait_follows_a_real_job_to_pass(passing_submission: subprocess.Popen[str]) -> None:
    out, err = passing_submission.communicate(timeout=180)
    assert passing_submission.returncode == 0, out + err
    assert re.search(
        r"job \d+ cli/tiny-gpt2 @ [0-9a-f]{12} \(aot_eager-2\.13\.0\+cpu, 1 core\): queued, submitted", out
    )
    assert re.search(r"job \d+ cli/tiny-gpt2: (running|judging)", out), out  # states as they change
    assert re.search(r"job \d+ cli/tiny-gpt2: done PASS", out), out
    assert out.rstrip().endswith("every job PASS (1)"), out


def test_the_command_imports_neither_torch_nor_the_runner() -> None:
    """`run` starts the runner as a child; the command itself stays light, whichever command is parsed."""
    code = (
        "import sys; from services.cli.app import app; import services.cli.client, services.api.schemas, "
        "shared.contracts, shared.jobs.sweeps, shared.results.cells; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
        "or m.startswith('services.runner')); print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

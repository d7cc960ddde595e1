"""RunRequest is the one spelling of the runner's command line: the CLI, the worker's command and the
reproduce command are derived from it and read back into the same request."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from services.worker.supervise import runner_command
from shared.contracts.enums import Stage, Task
from shared.contracts.run import RUNNER_MODULE, RunRequest
from tests.conftest import ROOT

JOB_REQUEST = RunRequest(
    model_id="org/tiny-llama",
    revision="a" * 40,
    backend="cpu",
    task=Task.feature_extraction,
    cores=4,
    core_range="4-7",
    stage=Stage.accelerator,
    artifacts=Path("/data/artifacts/job-7"),
    timeout_s=90.0,
    report=Path("/data/artifacts/job-7/accelerator-report.json"),
)


def test_a_request_round_trips_through_the_workers_command() -> None:
    command = runner_command(JOB_REQUEST)
    assert command[:3] == [sys.executable, "-m", RUNNER_MODULE]
    assert RunRequest.from_argv(command[3:]) == JOB_REQUEST
    assert RunRequest.from_argv(["org/x"]) == RunRequest(model_id="org/x")  # every default left out


def test_the_reproduce_command_reads_back_as_the_same_test() -> None:
    reproduce = JOB_REQUEST.reproduce_command({"SUPPORTMATRIX_CPU_COMPILE_BACKEND": "aot_eager"})
    words = shlex.split(reproduce)
    assert words[:4] == ["SUPPORTMATRIX_CPU_COMPILE_BACKEND=aot_eager", "python", "-m", RUNNER_MODULE]
    again = RunRequest.from_argv(words[4:])
    # the same test: model, commit, backend, task, cores; not where this run's files went
    assert again == RunRequest.model_validate(JOB_REQUEST.model_dump(include=set(RunRequest.REPRODUCIBLE)))
    assert again.stage == Stage.full and again.artifacts is None and again.core_range is None


def test_the_runners_cli_offers_exactly_the_requests_fields() -> None:
    proc = subprocess.run([sys.executable, "-m", RUNNER_MODULE, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    flags = set(proc.stdout.replace(",", " ").split()) & {f"--{n.replace('_', '-')}" for n in RunRequest.model_fields}
    assert flags == {f"--{n.replace('_', '-')}" for n in RunRequest.model_fields if n != "model_id"}
    assert "MODEL_ID" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", RUNNER_MODULE, "org/x", "--cores", "3"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "invalid choice: 3" in bad.stderr

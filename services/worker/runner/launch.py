"""Starting runner children: isolated processes, a hard timeout, the outcome or the reason there is none.

The parent never dies with a child: a crash, a hang or an OOM kill of the child becomes a RunFailure
with the exit signal and the tail of the child's output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from services.worker.runner.failures import RunFailure
from shared.enums import ErrorClass
from shared.processes import describe_exit, die_with_parent
from shared.settings import child_environment

OUTPUT_TAIL_CHARS = 3000


def run_child(spec: dict[str, Any], env: dict[str, str], timeout_s: float, workdir: Path) -> dict[str, Any]:
    """Run one role in a child process and return its data; raise RunFailure when it produced none."""
    role = spec["role"]
    spec = {**spec, "out": str(workdir / f"{role}.out.json")}
    spec_path = workdir / f"{role}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{role}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.worker.runner.child", str(spec_path)],
            env=child_environment(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Same process group as the runner, so killing the runner's group (the worker's hard timeout)
            # takes every child with it; and a child dies with its runner even when only that is killed.
            preexec_fn=die_with_parent,
        )
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise RunFailure(ErrorClass.timeout, f"{role} run exceeded {timeout_s:.0f} s and was killed") from None
        finally:
            if proc.poll() is None:  # interrupted while waiting: take the child down with us
                _kill(proc)
    out = Path(spec["out"])
    if not out.exists():
        tail = log_path.read_text(errors="replace")[-OUTPUT_TAIL_CHARS:]
        raise RunFailure(ErrorClass.crash, f"{role} process {describe_exit(returncode)}; output:\n{tail}")
    outcome = json.loads(out.read_text())
    if not outcome["ok"]:
        raise RunFailure(ErrorClass(outcome["error_class"]), f"{role}: {outcome['message']}", outcome["traceback"])
    return outcome["data"]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()

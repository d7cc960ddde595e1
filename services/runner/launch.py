"""Starting runner children: isolated processes, a hard timeout, the outcome or the reason there is none.

One role runs as one child, or as N ranks of a sharded run (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
a free MASTER_PORT — no torchrun). The parent never dies with a child: a crash, a hang or an OOM kill
becomes a RunFailure naming the rank, its exit and the tail of its output, and the rest of the group is
killed with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.runner.failures import RunFailure
from shared.enums import ErrorClass
from shared.processes import describe_exit, die_with_parent, free_port, output_tail
from shared.settings import child_environment

POLL_S = 0.2


def run_child(spec: dict[str, Any], env: dict[str, str], timeout_s: float, workdir: Path) -> dict[str, Any]:
    """Run one role in one child process and return its data."""
    return run_ranks(spec, 1, env, timeout_s, workdir)[0]


def run_ranks(
    spec: dict[str, Any], world_size: int, env: dict[str, str], timeout_s: float, workdir: Path
) -> list[dict[str, Any]]:
    """Run one role as ``world_size`` ranks and return each rank's data, rank 0 first."""
    role = spec["role"]
    port = str(free_port())
    ranks = []
    for rank in range(world_size):
        name = role if world_size == 1 else f"{role}.rank{rank}"
        rank_spec = {**spec, "rank": rank, "world_size": world_size, "out": str(workdir / f"{name}.out.json")}
        spec_path = workdir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(rank_spec))
        rank_env = dict(env)
        if world_size > 1:
            rank_env |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        log_path = workdir / f"{name}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.runner.child", str(spec_path)],
                env=child_environment(rank_env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Same process group as the runner, so killing the runner's group (the worker's hard timeout)
                # takes every child with it; and a child dies with its runner even when only that is killed.
                preexec_fn=die_with_parent,
            )
        ranks.append((name, proc, Path(rank_spec["out"]), log_path))
    try:
        _wait_all(ranks, timeout_s, role)
    finally:
        for _, proc, _, _ in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [_outcome(name, proc, out, log) for name, proc, out, log in ranks]


def _wait_all(ranks: list[tuple[str, subprocess.Popen[bytes], Path, Path]], timeout_s: float, role: str) -> None:
    """Until all ranks exit; the first one that fails (or the deadline) ends the wait for all."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = False
        for name, proc, out, log in ranks:
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0 or not out.exists() or not json.loads(out.read_text())["ok"]:
                _outcome(name, proc, out, log)  # raises with this rank's reason
        if not running:
            return
        if time.monotonic() > deadline:
            stuck = [name for name, proc, _, _ in ranks if proc.poll() is None]
            raise RunFailure(ErrorClass.timeout, f"{role} exceeded {timeout_s:.0f} s; still running: {stuck}")
        time.sleep(POLL_S)


def _outcome(name: str, proc: subprocess.Popen[bytes], out: Path, log_path: Path) -> dict[str, Any]:
    if not out.exists():
        tail = output_tail(log_path)
        raise RunFailure(ErrorClass.crash, f"{name} process {describe_exit(proc.wait())}; output:\n{tail}")
    outcome = json.loads(out.read_text())
    if not outcome["ok"]:
        raise RunFailure(ErrorClass(outcome["error_class"]), f"{name}: {outcome['message']}", outcome["traceback"])
    return outcome["data"]

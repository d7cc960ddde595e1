"""Starting runner children: isolated processes, a hard timeout, the outcome or the reason there is none.

One role runs as one child, or as N ranks of a sharded run (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
a free MASTER_PORT — no torchrun). The parent never dies with a child: a crash, a hang or an OOM kill
becomes a RunFailure naming the rank, its exit and the tail of its output, and the rest of the group is
killed with it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from services.runner.backends.base import RankPin
from services.runner.failures import RunFailure
from services.runner.specs import ChildOutcome, ChildSpec, SpecFile, phase_file
from shared.contracts.enums import ErrorClass
from shared.contracts.handoffs import Phase
from shared.processes import ChildProcess, describe_exit, free_port, output_tail
from shared.settings import get_runner_settings
from shared.zygote_client import start_python

POLL_S = 0.2
CHILD_MODULE = "services.runner.child"
Result = TypeVar("Result", bound=BaseModel)


@dataclass
class Budget:
    """A runner's time, from its start: ``outside_s`` for everything but compiling (SUPPORTMATRIX_JOB_TIMEOUT_S),
    ``compile_s`` for the compile phase (SUPPORTMATRIX_COMPILE_TIMEOUT_S). The launcher charges each poll to the
    compile while any rank announces it compiles, else to the rest."""

    outside_s: float
    compile_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    compiled_s: float = 0.0  # charged to the compile so far

    def charge(self, seconds: float, compiling: bool) -> None:
        if compiling:
            self.compiled_s += seconds

    def overrun(self, compiling: bool, phase: str, still: list[str], role: str) -> RunFailure | None:
        """The timeout this runner has run into, naming the phase that ran out; None while it has not."""
        if compiling and self.compiled_s > self.compile_s:
            return RunFailure(
                ErrorClass.timeout,
                f"the compile phase ran past its {self.compile_s:g} s budget (SUPPORTMATRIX_COMPILE_TIMEOUT_S); "
                f"still running: {still}",
            )
        if time.monotonic() - self.started - self.compiled_s > self.outside_s:
            return RunFailure(
                ErrorClass.timeout,
                f"{role} exceeded the {self.outside_s:g} s limit outside compilation (SUPPORTMATRIX_JOB_TIMEOUT_S),"
                f" in the {phase} phase; still running: {still}",
            )
        return None


def run_child(
    spec: ChildSpec, result: type[Result], env: dict[str, str], budget: Budget | float, workdir: Path
) -> Result:
    """Run one role in one child process and return its result (``budget`` in seconds: none of it compiles)."""
    return run_ranks(spec, result, env, budget, workdir)[0]


def run_ranks(
    spec: ChildSpec,
    result: type[Result],
    env: dict[str, str],
    budget: Budget | float,
    workdir: Path,
    pins: list[RankPin] | None = None,
) -> list[Result]:
    """Run one role as ``spec.world_size`` ranks and return each rank's result, rank 0 first.

    ``env`` is the whole environment of the children (the runner's own, already allow-listed, plus the
    backend's variables); ranks add their torch.distributed variables to it, and each its ``pins`` entry: the
    core it is given (the backend's ``rank_pin``).
    """
    role, world_size = spec.role, spec.world_size
    port = str(free_port())
    ranks = []
    for rank in range(world_size):
        name = role if world_size == 1 else f"{role}.rank{rank}"
        rank_spec = spec.model_copy(update={"rank": rank, "out": workdir / f"{name}.out.json"})
        spec_path = workdir / f"{name}.spec.json"
        spec_path.write_text(SpecFile(spec=rank_spec).model_dump_json())
        rank_env = dict(env)
        pin = pins[rank] if pins else RankPin({})
        if world_size > 1:
            rank_env |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        rank_env |= pin.env
        log_path = workdir / f"{name}.log"
        # In the runner's process group, so killing the group (the worker's hard timeout) takes every child with
        # it; and a child dies with its runner even when only that is killed. Forked from the host's zygote when
        # the runner was (SUPPORTMATRIX_RUNNER_ZYGOTE), else a fresh interpreter.
        proc, refused = start_python(
            CHILD_MODULE, [str(spec_path)], rank_env, log_path, own_group=False,
            cpus=pin.cpus or os.sched_getaffinity(0),  # the runner's by default: a forked child does not inherit them
            zygote=get_runner_settings().runner_zygote,
        )  # fmt: skip
        if refused:
            print(f"{name}: a fresh interpreter{refused}", flush=True)
        ranks.append((name, proc, rank_spec.out, log_path))
    try:
        _wait_all(ranks, budget if isinstance(budget, Budget) else Budget(outside_s=budget), role)
    finally:
        for _, proc, _, _ in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [result.model_validate(_outcome(name, proc, out, log).data) for name, proc, out, log in ranks]


def _wait_all(ranks: list[tuple[str, ChildProcess, Path, Path]], budget: Budget, role: str) -> None:
    """Until all ranks exit; the first one that fails (or the budget) ends the wait for all."""
    last = time.monotonic()
    while True:
        running = False
        phases = []
        for name, proc, out, log in ranks:
            code = proc.poll()
            if code is None:
                running = True
                announced = Phase.read(phase_file(out))
                phases.append(announced.phase if announced else "start")
            elif code != 0 or not out.exists() or not ChildOutcome.model_validate_json(out.read_text()).ok:
                _outcome(name, proc, out, log)  # raises with this rank's reason
        if not running:
            return
        now = time.monotonic()
        compiling = "compile" in phases
        budget.charge(now - last, compiling)
        last = now
        still = [name for name, proc, _, _ in ranks if proc.poll() is None]
        if (failure := budget.overrun(compiling, phases[0], still, role)) is not None:
            raise failure
        time.sleep(POLL_S)


def _outcome(name: str, proc: ChildProcess, out: Path, log_path: Path) -> ChildOutcome:
    if not out.exists():
        tail = output_tail(log_path)
        raise RunFailure(ErrorClass.crash, f"{name} process {describe_exit(proc.wait())}; output:\n{tail}")
    outcome = ChildOutcome.model_validate_json(out.read_text())
    if not outcome.ok:
        assert outcome.error_class is not None
        message = f"{name}: {outcome.message}"
        raise RunFailure(
            outcome.error_class, message, outcome.traceback, origin=name, graphs_compiled=outcome.graphs_compiled
        )
    return outcome

"""Timings and peak memory of the process that runs the model."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shared.contracts.enums import CompilePath
from shared.contracts.handoffs import Phase
from shared.contracts.report import Timings


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM).

    Not ru_maxrss: Linux carries a parent's high-water mark across fork+exec, so a child of a big worker
    would report the parent's peak.
    """
    match = re.search(r"^VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError("VmHWM missing from /proc/self/status")
    return int(match.group(1)) * 1024


def graphs_compiled() -> int | None:
    """Graphs the compiler built in this process so far: dynamo's count of unique graphs, which every
    torch.compile backend (neuron, inductor, aot_eager) goes through. A model that recompiles at every
    decode step builds many; None when this process never loaded dynamo.
    """
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_record(model: Any, backend: Any) -> dict[str, Any]:
    """Which compile the run went through and how many graphs the backend's received (``Resources``): a model
    that transformers' generate compiled too holds that compile as ``_compiled_call``."""
    wrapped = hasattr(model, "_compiled_call")
    return {
        "compile_path": CompilePath.forward_and_generate if wrapped else CompilePath.forward,
        "backend_graphs": backend.counted.received if backend.counted else None,
    }


# A phase is named after the clock's step, but for the first call, which compiles (and generates once).
PHASE_OF_STEP = {"first": "compile"}


class Stopwatch:
    """Times named steps; with ``announce``, also writes each step's phase there as it starts."""

    def __init__(self, announce: Path | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.announce = announce

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        if self.announce is not None:
            tmp = self.announce.with_name(f".{self.announce.name}.tmp")
            tmp.write_text(Phase(phase=PHASE_OF_STEP.get(name, name), since=time.time()).model_dump_json())
            tmp.replace(self.announce)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - start


def accelerator_timings(clock: Stopwatch) -> Timings:
    """An accelerator run's timings from its "load", "first" (compile + run) and "generate" (run) phases.

    The first call compiles and runs; the second only runs: their difference is the compile time. Wall
    time is what an unmodified user run costs: load, then the first call.
    """
    return Timings(
        load_s=clock.seconds["load"],
        compile_s=max(clock.seconds["first"] - clock.seconds["generate"], 0.0),
        generate_s=clock.seconds["generate"],
        wall_s=clock.seconds["load"] + clock.seconds["first"],
    )

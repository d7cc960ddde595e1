"""Core groups: aligned power-of-two ranges of a host's cores, and how a runner is pinned to one.

A group is written "a-b" (inclusive), as NEURON_RT_VISIBLE_CORES takes it. On cpu a host may be given
more cores than it has CPUs (to test layouts): core i then maps to CPU i mod the CPU count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class CoreGroup:
    start: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.size & (self.size - 1):
            raise ValueError(f"a core group's size is a power of two, not {self.size}")
        if self.start % self.size:
            raise ValueError(f"a group of {self.size} starts at a multiple of {self.size}, not {self.start}")

    @property
    def end(self) -> int:  # inclusive
        return self.start + self.size - 1

    @property
    def cores(self) -> range:
        return range(self.start, self.start + self.size)

    def __str__(self) -> str:
        return str(self.start) if self.size == 1 else f"{self.start}-{self.end}"

    @classmethod
    def parse(cls, text: str) -> CoreGroup:
        first, _, last = text.strip().partition("-")
        start = int(first)
        end = int(last) if last else start
        return cls(start, end - start + 1)


def pin_environment(backend: str, group: CoreGroup) -> dict[str, str]:
    """What a runner's environment says about the cores it may use."""
    if backend == "neuron":
        return {"NEURON_RT_VISIBLE_CORES": str(group)}
    if backend == "cuda":
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(c) for c in group.cores)}
    return {}


def cpu_set(group: CoreGroup, cpu_count: int | None = None) -> set[int]:
    """The CPUs a cpu-backend runner of this group is bound to."""
    count = cpu_count or os.cpu_count() or 1
    return {core % count for core in group.cores}


def format_cpus(cpus: set[int]) -> str:
    """{0, 1, 2, 5} → "0-2,5"."""
    parts, ordered = [], sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpus(text: str) -> set[int]:
    """ "0-2,5" → {0, 1, 2, 5} (``format_cpus`` read back; a core group's "4-7" too)."""
    cores: set[int] = set()
    for part in filter(None, text.replace(" ", "").split(",")):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores

"""A host's layout: which aligned core groups it runs workers on, given its backlog per group size.

Pure functions, so the launcher, tests and the fleet simulator (bench/makespan.py) share them.

How many groups of each size (`group_counts`), in order:
0. a busy worker keeps its group: its job runs to its end whatever the plan says;
1. a size whose oldest queued job has waited longer than the longest job takes (``patience``) gets a group
   first, largest first, as far as the host's cores allow: no size waits more than about one job's
   duration, so a 16-core job is never starved by a stream of 1-core jobs, nor the reverse;
2. then, one group at a time, the size whose jobs take longest gets another, as far as the cores allow and
   never more groups of a size than it has jobs (longest processing time first, per size: the long jobs
   are a sweep's critical path, and the short ones fill the cores that free up later). Without durations
   the largest size counts as the longest. bench/makespan.py compared this with giving the next group to
   the size that would finish its backlog last: 1.01x against 1.05x of the lower bound on one simulated
   trn2 host, 1.16x against 1.21x on four;
3. of the cores left, up to ``spare`` become idle 1-core groups, so a lonely 1-core job starts at once.
   Only a few: idle workers anywhere on the host would take a burst's 1-core jobs before the next plan
   and scatter them over the aligned blocks its larger groups need; the rest of the cores stay free
   (a worker starts in about a second once the host has described its runtime).

Where the groups go (`place`), buddy-allocator style: the groups that already have workers stay where
they are (busy ones first: draining a busy worker holds its cores until its job ends), and each new group
takes the free aligned block in the most occupied enclosing block, so small groups pack together and
large aligned blocks stay free for large groups. When kept idle workers fragment the host, they drain.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shared.contracts.run import CORE_SIZES
from shared.cores import CoreGroup

SPARE_GROUPS = 2  # idle 1-core groups a host keeps beyond its backlog (rule 3)
PATIENCE_FLOOR_S = 30.0  # rule 1's patience while no durations are known


def group_counts(
    total_cores: int,
    backlog: Mapping[int, int],
    seconds_per_job: Mapping[int, float] | None = None,
    waited: Mapping[int, float] | None = None,
    spare: int = SPARE_GROUPS,
    busy: Mapping[int, int] | None = None,
    stage_limit_s: float = math.inf,
) -> dict[int, int]:
    """Groups per size. ``backlog``: jobs per size that need cores (queued or running); ``seconds_per_job``:
    the expected accelerator-stage seconds per size (unknown sizes count 1 s, so the sizes weigh by
    size); ``waited``: seconds the oldest queued job of each size has waited; ``busy``: busy groups per size;
    ``stage_limit_s``: the accelerator stage's hard limit (``Settings.stage_limit_s``), which no job outlasts."""
    sizes = sorted((s for s in CORE_SIZES if backlog.get(s, 0) > 0 and s <= total_cores), reverse=True)
    seconds = {s: min((seconds_per_job or {}).get(s) or 1.0, stage_limit_s) for s in sizes}
    patience = max([PATIENCE_FLOOR_S, *seconds.values()])
    counts = {s: (busy or {}).get(s, 0) for s in sizes}  # rule 0
    free = total_cores - sum(s * n for s, n in counts.items())
    for size in sizes:  # rule 1
        if counts[size] == 0 and (waited or {}).get(size, 0.0) > patience and size <= free:
            counts[size] = 1
            free -= size
    while True:  # rule 2
        candidates = [s for s in sizes if s <= free and counts[s] < backlog[s]]
        if not candidates:
            break
        size = max(candidates, key=lambda s: (seconds[s], s))
        counts[size] += 1
        free -= size
    counts[1] = counts.get(1, 0) + min(free, spare)  # rule 3
    return {size: n for size, n in counts.items() if n}


def place(total_cores: int, counts: Mapping[int, int], keep: Iterable[CoreGroup] = ()) -> list[CoreGroup] | None:
    """Disjoint aligned groups, ``counts[size]`` of each size, keeping the groups of ``keep`` (in its order of
    preference) where the counts allow; None when what is kept leaves no aligned hole for a new group."""
    taken = [False] * total_cores
    layout: list[CoreGroup] = []
    remaining = dict(counts)
    for group in keep:
        if remaining.get(group.size, 0) > 0 and group.end < total_cores and not any(taken[c] for c in group.cores):
            layout.append(group)
            remaining[group.size] -= 1
            for c in group.cores:
                taken[c] = True
    for size in sorted(remaining, reverse=True):
        for _ in range(remaining[size]):
            free = _tightest_free_block(taken, size)
            if free is None:
                return None
            layout.append(free)
            for c in free.cores:
                taken[c] = True
    return sorted(layout)


def _tightest_free_block(taken: list[bool], size: int) -> CoreGroup | None:
    """The free aligned block of ``size`` whose smallest enclosing aligned block already holds a taken core
    is the smallest (best fit); ties go to the lowest start."""
    total = len(taken)
    best: tuple[int, int] | None = None
    for start in range(0, total - size + 1, size):
        if any(taken[start : start + size]):
            continue
        parent = size * 2
        while parent < 2 * total and not any(taken[(start // parent) * parent : (start // parent + 1) * parent]):
            parent *= 2
        if best is None or (parent, start) < best:
            best = (parent, start)
    return None if best is None else CoreGroup(best[1], size)


@dataclass(frozen=True)
class HostState:
    """What the launcher knows when it plans: its share of the backlog and its workers."""

    total_cores: int
    backlog: Mapping[int, int]
    seconds_per_job: Mapping[int, float] = field(default_factory=dict)
    workers: frozenset[CoreGroup] = frozenset()  # live, not draining
    busy: frozenset[CoreGroup] = frozenset()  # workers running a job now
    # workers still starting: never drained (one stopped while it takes its first message could lose it), but
    # idle for the counts — counting them busy would add a spare group beside each, one more every plan
    starting: frozenset[CoreGroup] = frozenset()
    draining: frozenset[CoreGroup] = frozenset()  # finishing their job, then exiting
    waited: Mapping[int, float] = field(default_factory=dict)  # per size: the oldest queued job's wait, seconds
    spare: int = SPARE_GROUPS
    stage_limit_s: float = math.inf  # the accelerator stage's hard limit: no job takes longer


@dataclass(frozen=True)
class HostPlan:
    layout: list[CoreGroup]
    drain: list[CoreGroup]  # workers whose group left the layout
    start: list[CoreGroup]  # new groups whose cores are free now
    waiting: list[CoreGroup]  # new groups whose cores a draining worker still holds


def plan_host(state: HostState) -> HostPlan:
    busy_sizes = Counter(g.size for g in state.busy & state.workers)
    counts = group_counts(
        state.total_cores,
        state.backlog,
        state.seconds_per_job,
        state.waited,
        state.spare,
        busy_sizes,
        state.stage_limit_s,
    )
    # Keep every worker if the layout can; else only the busy and starting ones (idle ones drain at once);
    # else none. Largest groups first (sizes descending) always pack, so the last try never fails.
    busy = sorted(state.busy & state.workers)
    starting_idle = (state.starting & state.workers) - state.busy  # a busy one has taken its message: may drain
    starting = sorted(starting_idle)
    idle = sorted(state.workers - state.busy - starting_idle)
    for keep in (busy + starting + idle, busy + starting, []):
        layout = place(state.total_cores, counts, keep)
        if layout is not None:
            break
    assert layout is not None
    left_out = state.workers - set(layout)
    drain = sorted(left_out - starting_idle)  # a starting idle worker left out drains at a later plan
    held = set(state.draining) | left_out  # cores freed only when those workers exit
    start: list[CoreGroup] = []
    waiting: list[CoreGroup] = []
    for group in layout:
        if group not in state.workers:
            (waiting if overlaps(group, held) else start).append(group)
    return HostPlan(layout=layout, drain=drain, start=start, waiting=waiting)


def plan_layout(
    total_cores: int,
    backlog: Mapping[int, int],
    seconds_per_job: Mapping[int, float] | None = None,
    waited: Mapping[int, float] | None = None,
    spare: int = SPARE_GROUPS,
) -> list[CoreGroup]:
    """A fresh layout, with no workers to keep."""
    return plan_host(HostState(total_cores, backlog, seconds_per_job or {}, waited=waited or {}, spare=spare)).layout


def overlaps(group: CoreGroup, others: Iterable[CoreGroup]) -> bool:
    return any(group.start <= o.end and o.start <= group.end for o in others)

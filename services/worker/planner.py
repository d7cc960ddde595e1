"""The host layout: which aligned core groups a host runs workers on, given the backlog per group size.

A pure function, so the launcher, tests and simulations share it. Rules, in order:
1. every size with queued work gets at least one group, largest sizes first (a 16-core job is never
   starved by a stream of 1-core jobs), as far as the host's cores allow;
2. the remaining cores go, one group at a time, to the size furthest below its share of the queued
   work (jobs * size * expected seconds), never more groups of a size than it has jobs;
3. cores still free become 1-core groups, so nothing idles when work of any size arrives;
4. groups are placed largest first at consecutive offsets, which keeps each aligned to its size.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.cores import CoreGroup
from shared.hub.sizing import CORE_SIZES


def plan_layout(
    total_cores: int, backlog: Mapping[int, int], seconds_per_job: Mapping[int, float] | None = None
) -> list[CoreGroup]:
    """``backlog``: queued (and running) jobs per group size. Returns disjoint, aligned groups."""
    sizes = sorted((s for s in CORE_SIZES if backlog.get(s, 0) > 0 and s <= total_cores), reverse=True)
    work = {s: backlog[s] * s * (seconds_per_job or {}).get(s, 1.0) for s in sizes}
    total_work = sum(work.values()) or 1.0
    counts = dict.fromkeys(sizes, 0)
    free = total_cores
    for size in sizes:  # rule 1
        if size <= free:
            counts[size] += 1
            free -= size
    while True:  # rule 2
        candidates = [s for s in sizes if s <= free and counts[s] < backlog[s]]
        if not candidates:
            break
        size = max(candidates, key=lambda s: (work[s] / total_work * total_cores - counts[s] * s, s))
        counts[size] += 1
        free -= size
    counts[1] = counts.get(1, 0) + free  # rule 3
    groups, start = [], 0
    for size in sorted(counts, reverse=True):  # rule 4
        for _ in range(counts[size]):
            groups.append(CoreGroup(start, size))
            start += size
    return groups


def reconcile(current: set[CoreGroup], target: list[CoreGroup]) -> tuple[set[CoreGroup], list[CoreGroup]]:
    """Workers to drain (their group is not in the plan) and groups to start (not running yet)."""
    wanted = set(target)
    return current - wanted, [g for g in target if g not in current]


def overlaps(group: CoreGroup, others: set[CoreGroup]) -> bool:
    return any(group.start <= o.end and o.start <= group.end for o in others)

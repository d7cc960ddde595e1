"""The host layout planner and the launcher's reconciliation: pure functions on a 64-core trn2 host."""

from __future__ import annotations

import random

import pytest

from services.worker.planner import overlaps, plan_layout, reconcile
from shared.cores import CoreGroup, cpu_set, format_cpus

HOST = 64


def check_layout(groups: list[CoreGroup], total: int = HOST) -> None:
    covered = [c for g in groups for c in g.cores]
    assert len(covered) == len(set(covered)) == total  # disjoint, and every core in some group
    assert all(g.start % g.size == 0 for g in groups)  # aligned (CoreGroup also refuses otherwise)


def sizes(groups: list[CoreGroup]) -> dict[int, int]:
    out: dict[int, int] = {}
    for g in groups:
        out[g.size] = out.get(g.size, 0) + 1
    return out


def test_no_backlog_keeps_every_core_ready_as_one_core_groups() -> None:
    groups = plan_layout(HOST, {})
    check_layout(groups)
    assert sizes(groups) == {1: 64}


def test_large_jobs_are_not_starved_by_many_small_ones() -> None:
    groups = plan_layout(HOST, {1: 1000, 16: 1, 4: 3})
    check_layout(groups)
    assert sizes(groups)[16] == 1 and sizes(groups)[4] >= 1
    assert sizes(groups)[1] >= 40  # the small jobs still get most of the host


def test_cores_follow_the_share_of_queued_work() -> None:
    groups = plan_layout(HOST, {2: 100, 8: 100})  # 200 vs 800 core-units of work
    check_layout(groups)
    counts = sizes(groups)
    assert counts[8] * 8 > counts[2] * 2 and counts[2] >= 1


def test_no_more_groups_of_a_size_than_it_has_jobs() -> None:
    groups = plan_layout(HOST, {16: 1, 2: 2})
    check_layout(groups)
    assert sizes(groups) == {16: 1, 2: 2, 1: 44}


def test_sizes_larger_than_the_host_are_left_out() -> None:
    groups = plan_layout(4, {16: 3, 2: 1})
    check_layout(groups, 4)
    assert sizes(groups) == {2: 1, 1: 2}


@pytest.mark.parametrize("seed", range(20))
def test_random_backlogs_always_give_a_valid_layout(seed: int) -> None:
    rng = random.Random(seed)
    backlog = {s: rng.choice([0, 0, 1, 3, 50]) for s in (1, 2, 4, 8, 16)}
    groups = plan_layout(HOST, backlog)
    check_layout(groups)
    for size, jobs in backlog.items():
        assert (sizes(groups).get(size, 0) >= 1) == (jobs > 0) or size == 1


def test_reconcile_drains_groups_leaving_the_plan_and_starts_new_ones() -> None:
    current = {CoreGroup(0, 2), CoreGroup(2, 1), CoreGroup(3, 1)}
    target = [CoreGroup(0, 2), CoreGroup(2, 2)]
    drain, start = reconcile(current, target)
    assert drain == {CoreGroup(2, 1), CoreGroup(3, 1)} and start == [CoreGroup(2, 2)]
    assert overlaps(CoreGroup(2, 2), drain)  # so the launcher waits for both to exit before starting it


def test_core_groups_parse_print_and_map_to_cpus() -> None:
    assert CoreGroup.parse("4-7") == CoreGroup(4, 4) and str(CoreGroup(4, 4)) == "4-7"
    assert str(CoreGroup.parse("3")) == "3"
    with pytest.raises(ValueError, match="starts at a multiple"):
        CoreGroup.parse("2-5")
    with pytest.raises(ValueError, match="power of two"):
        CoreGroup.parse("0-2")
    assert cpu_set(CoreGroup(2, 2), cpu_count=2) == {0, 1}  # more cores than CPUs: wrap around
    assert format_cpus({0, 1, 2, 5}) == "0-2,5"

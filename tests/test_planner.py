"""The host layout planner and the launcher's reconciliation: pure functions on a 64-core trn2 host."""

from __future__ import annotations

import random

import pytest

from services.worker.planner import HostState, overlaps, plan_host, plan_layout
from shared.cores import CoreGroup, cpu_set, format_cpus

HOST = 64


def check_layout(groups: list[CoreGroup], total: int = HOST) -> None:
    covered = [c for g in groups for c in g.cores]
    assert len(covered) == len(set(covered)) and all(0 <= c < total for c in covered)  # disjoint, on the host
    assert all(g.start % g.size == 0 for g in groups)  # aligned (CoreGroup also refuses otherwise)


def sizes(groups: list[CoreGroup]) -> dict[int, int]:
    out: dict[int, int] = {}
    for g in groups:
        out[g.size] = out.get(g.size, 0) + 1
    return out


def test_no_backlog_keeps_a_few_one_core_groups_ready_packed_low() -> None:
    """Two spare 1-core workers (a lonely job starts at once), side by side: every larger aligned block stays
    free for the larger groups a burst will need."""
    assert plan_layout(HOST, {}) == [CoreGroup(0, 1), CoreGroup(1, 1)]
    assert sizes(plan_layout(HOST, {}, spare=64)) == {1: 64}


def test_large_jobs_are_not_starved_by_many_small_ones() -> None:
    groups = plan_layout(HOST, {1: 1000, 16: 1, 4: 3})
    check_layout(groups)
    assert sizes(groups)[16] == 1 and sizes(groups)[4] >= 1
    assert sizes(groups) == {16: 1, 4: 3, 1: 36}  # the larger (longer) jobs first; the small ones get the rest


def test_the_longer_size_takes_the_host_until_the_other_has_waited() -> None:
    groups = plan_layout(HOST, {2: 100, 8: 100})  # no durations: the larger size counts as the longer
    check_layout(groups)
    assert sizes(groups) == {8: 8}
    # the 2-core jobs waited past the patience: one group first, then the 8-core groups, then the rest
    assert sizes(plan_layout(HOST, {2: 100, 8: 100}, waited={2: 31.0})) == {8: 7, 2: 4}


def test_no_more_groups_of_a_size_than_it_has_jobs() -> None:
    groups = plan_layout(HOST, {16: 1, 2: 2})
    check_layout(groups)
    assert sizes(groups) == {16: 1, 2: 2, 1: 2}  # and two spare 1-core groups; 42 cores stay free


def test_sizes_larger_than_the_host_are_left_out() -> None:
    groups = plan_layout(4, {16: 3, 2: 1})
    check_layout(groups, 4)
    assert sizes(groups) == {2: 1, 1: 2}


@pytest.mark.parametrize("seed", range(20))
def test_random_backlogs_always_give_a_valid_layout(seed: int) -> None:
    rng = random.Random(seed)
    backlog = {s: rng.choice([0, 0, 1, 3, 50]) for s in (1, 2, 4, 8, 16)}
    seconds = {s: rng.choice([10.0, 100.0, 1000.0]) for s in backlog}
    groups = plan_layout(HOST, backlog, seconds)
    check_layout(groups)
    for size, jobs in backlog.items():
        assert sizes(groups).get(size, 0) <= jobs + (2 if size == 1 else 0)  # two spare 1-core groups at most
    if sum(g.size for g in groups) < HOST:  # cores left free: no job is waiting for a group that fits in them
        free = HOST - sum(g.size for g in groups)
        assert all(sizes(groups).get(s, 0) >= n for s, n in backlog.items() if n and s <= free)


def test_long_large_jobs_open_several_groups_at_once() -> None:
    """Three 4-core jobs of 100 s and a 1-core job of 10 s on 16 cores: all three 4-core jobs start now (they
    are the critical path: 100 s in all), not one after the other beside the short one (300 s)."""
    assert sizes(plan_layout(16, {4: 3, 1: 1}, {4: 100.0, 1: 10.0})) == {4: 3, 1: 3}  # one busy, two spare
    # when the 1-core jobs are the long ones, they are the critical path: they take the host first
    assert sizes(plan_layout(8, {4: 2, 1: 6}, {4: 10.0, 1: 100.0})) == {1: 8}  # six busy, two spare
    # without durations the largest size counts as the longest
    assert sizes(plan_layout(8, {4: 2, 1: 6})) == {4: 2}


def test_a_size_that_waited_longer_than_the_longest_job_gets_a_group_first() -> None:
    """No size waits more than about one job's duration: past it (and past 30 s while durations are unknown)
    the 1-core jobs get a group before the longer 4-core jobs take the host."""
    assert sizes(plan_layout(8, {4: 2, 1: 6}, waited={1: 29.0})) == {4: 2}
    assert sizes(plan_layout(8, {4: 2, 1: 6}, waited={1: 31.0})) == {4: 1, 1: 4}
    durations = {4: 100.0, 1: 10.0}
    assert sizes(plan_layout(8, {4: 2, 1: 6}, durations, waited={1: 99.0})) == {4: 2}
    assert sizes(plan_layout(8, {4: 2, 1: 6}, durations, waited={1: 101.0})) == {4: 1, 1: 4}


def test_no_job_is_expected_to_outlast_the_stage_limit() -> None:
    """The planner's patience is the longest job, but never more than the accelerator stage's hard limit (the same
    budgets the runner enforces): a size whose recent jobs ran long still gets a group once its oldest job waited
    that long."""
    durations = {4: 5000.0, 1: 10.0}
    state = HostState(8, {4: 2, 1: 6}, durations, waited={1: 120.0})
    assert sizes(plan_host(state).layout) == {4: 2}
    limited = HostState(8, {4: 2, 1: 6}, durations, waited={1: 120.0}, stage_limit_s=100.0)
    assert sizes(plan_host(limited).layout) == {4: 1, 1: 4}


def test_one_core_groups_pack_into_the_fewest_aligned_blocks() -> None:
    """Kept groups stay; a new 1-core group takes the hole beside another 1-core group (core 5, beside 4), not
    core 6, which would break the free aligned pair 6-7."""
    busy = {CoreGroup(0, 4), CoreGroup(4, 1)}
    plan = plan_host(
        HostState(total_cores=8, backlog={4: 1, 1: 2, 2: 1}, workers=frozenset(busy), busy=frozenset(busy))
    )
    assert plan.layout == [CoreGroup(0, 4), CoreGroup(4, 1), CoreGroup(5, 1), CoreGroup(6, 2)]
    assert plan.drain == [] and plan.start == [CoreGroup(5, 1), CoreGroup(6, 2)]


def test_the_plan_keeps_busy_workers_and_drains_idle_ones_first() -> None:
    """Two 1-core workers, one busy; the backlog now needs one 1-core group and one 2-core group: the busy
    worker stays, the idle one drains, and the 2-core group waits for its cores only if they are held."""
    workers = frozenset({CoreGroup(0, 1), CoreGroup(2, 1)})
    plan = plan_host(HostState(total_cores=4, backlog={1: 1, 2: 1}, workers=workers, busy=frozenset({CoreGroup(2, 1)})))
    assert CoreGroup(2, 1) in plan.layout and plan.drain == [CoreGroup(0, 1)]
    assert sorted(plan.start + plan.waiting) == [g for g in plan.layout if g not in workers]
    [pair] = [g for g in plan.layout if g.size == 2]
    assert (pair in plan.waiting) == overlaps(pair, plan.drain)
    # a worker already draining holds its cores until it exits: a group over them waits
    drained = plan_host(HostState(total_cores=2, backlog={2: 1}, draining=frozenset({CoreGroup(1, 1)})))
    assert drained.waiting == [CoreGroup(0, 2)] and drained.start == []


def test_core_groups_parse_print_and_map_to_cpus() -> None:
    assert CoreGroup.parse("4-7") == CoreGroup(4, 4) and str(CoreGroup(4, 4)) == "4-7"
    assert str(CoreGroup.parse("3")) == "3"
    with pytest.raises(ValueError, match="starts at a multiple"):
        CoreGroup.parse("2-5")
    with pytest.raises(ValueError, match="power of two"):
        CoreGroup.parse("0-2")
    assert cpu_set(CoreGroup(2, 2), cpu_count=2) == {0, 1}  # more cores than CPUs: wrap around
    assert format_cpus({0, 1, 2, 5}) == "0-2,5"


def test_a_starting_worker_is_kept_but_counts_as_idle() -> None:
    """A lonely 1-core job on core 3 beside two spare workers, one of them still starting: the plan is a fixed
    point (it once counted starting workers busy and added a spare beside each, one more every plan, until
    every core had a worker). A starting worker the layout leaves out is not drained yet; its cores wait."""
    workers = frozenset({CoreGroup(0, 1), CoreGroup(2, 1), CoreGroup(3, 1)})
    state = HostState(
        total_cores=8, backlog={1: 1}, workers=workers, busy=frozenset({CoreGroup(3, 1)}),
        starting=frozenset({CoreGroup(0, 1)}),
    )  # fmt: skip
    plan = plan_host(state)
    assert set(plan.layout) == workers and plan.start == plan.drain == plan.waiting == []
    # on a 2-core host a 2-core job arrives: the idle worker drains, the starting one stays, and the pair waits
    workers = frozenset({CoreGroup(0, 1), CoreGroup(1, 1)})
    plan = plan_host(HostState(2, {2: 1}, workers=workers, starting=frozenset({CoreGroup(0, 1)})))
    assert plan.drain == [CoreGroup(1, 1)] and plan.waiting == [CoreGroup(0, 2)] and plan.start == []

"""The fleet simulator (bench/fleet.py) drives the project's real planner: change the planner, and the
simulated makespan of the same sweep changes."""

from __future__ import annotations

import pytest

from bench import fleet
from bench.makespan import sweep_jobs
from services.worker import planner
from shared.settings import Settings

BURST = [fleet.SimJob(f"c{cores}-{i}", cores, accelerator_s=10.0 * cores, verdict_s=2.0)
         for cores, n in ((1, 6), (2, 3), (4, 2)) for i in range(n)]  # fmt: skip


def test_the_simulation_runs_every_job_once_and_respects_the_lower_bound() -> None:
    result = fleet.simulate(BURST, hosts=1, cores_per_host=8)
    assert sorted(result.ends) == sorted(j.name for j in BURST) == sorted(result.starts)
    assert result.makespan_s >= result.lower_bound_s == max(sum(j.cores * j.accelerator_s for j in BURST) / 8, 42.0)


def test_changing_the_planner_changes_the_simulated_makespan(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = fleet.simulate(BURST, hosts=1, cores_per_host=8, seconds_per_job=fleet.median_seconds_per_size(BURST))

    # a planner that gives the whole host to the largest size with work, then to the next
    def largest_only(total: int, backlog: dict[int, int], *_: object) -> dict[int, int]:
        size = max(backlog, default=1)
        return {size: total // size}

    monkeypatch.setattr(planner, "group_counts", largest_only)
    naive = fleet.simulate(BURST, hosts=1, cores_per_host=8, seconds_per_job=fleet.median_seconds_per_size(BURST))
    assert naive.makespan_s != ours.makespan_s and sorted(naive.ends) == sorted(ours.ends)


def test_a_job_longer_than_the_stage_limit_ends_at_it_as_a_timeout() -> None:
    """The simulator runs the budgets the runner enforces (Settings.stage_limit_s): a job its duration model makes
    longer holds its cores until the limit, then ends."""
    long = [*BURST, fleet.SimJob("huge", 4, accelerator_s=10_000.0, verdict_s=2.0)]
    result = fleet.simulate(long, hosts=1, cores_per_host=8, stage_limit_s=500.0)
    assert result.jobs_timed_out == 1 and result.ends["huge"] - result.starts["huge"] == pytest.approx(502.0)
    default = fleet.simulate(long, hosts=1, cores_per_host=8)
    assert default.jobs_timed_out == 0 and Settings().stage_limit_s(compiles=True) == fleet.STAGE_LIMIT_S


def test_fixed_layouts_leave_out_jobs_larger_than_their_groups() -> None:
    ones = fleet.simulate(BURST, hosts=1, cores_per_host=8, layout=[1] * 8)
    assert ones.jobs_unrunnable == 5 and len(ones.ends) == 6


def test_the_hub_sweep_data_sizes_through_the_real_sizing() -> None:
    jobs, too_big = sweep_jobs()
    assert len(jobs) + too_big >= 200 and {j.cores for j in jobs} == {1, 2, 4, 8, 16}


def test_the_autoscaled_fleet_starts_from_zero_runs_every_job_once_and_gives_its_hosts_back() -> None:
    """The trn2-autoscaled overlay's ScaledJob drives the simulated scaler: no host before the first poll, none
    ready before a node's start-up, every job once, and every host stopped (billed) once it has been idle for the
    launchers' --exit-when-idle."""
    scaler = fleet.Autoscaler.from_manifests(node_start_s=60.0)
    assert scaler.max_hosts == 4 and scaler.idle_exit_s == 900  # the ScaledJob's maxReplicaCount, the idle exit
    jobs = [fleet.SimJob(f"{j.name}@{c}", j.cores, j.accelerator_s, j.verdict_s, compiler=c)
            for c in ("a", "b") for j in BURST * 3]  # fmt: skip
    jobs = [fleet.SimJob(f"{j.name}-{i}", j.cores, j.accelerator_s, j.verdict_s, compiler=j.compiler)
            for i, j in enumerate(jobs)]  # fmt: skip
    result = fleet.AutoscaledFleet(jobs, scaler, cores_per_host=8, timings=fleet.Timings(), compilers=("a", "b")).run()
    assert sorted(result.ends) == sorted(result.starts) == sorted(j.name for j in jobs)
    assert min(result.starts.values()) >= 60.0  # the first node's start-up
    assert 2 <= result.peak_hosts <= scaler.max_hosts  # a host per compiler version at least
    assert all(stop >= start for start, stop in result.hosts_up) and len(result.hosts_up) >= 2
    assert result.billed_core_s >= result.used_core_s > 0
    # each host's cores are billed from its start to its stop, its idle time before it leaves included
    assert max(stop for _, stop in result.hosts_up) >= max(result.ends.values()) + scaler.idle_exit_s
    assert result.billed_core_s == sum(8 * (stop - start) for start, stop in result.hosts_up)

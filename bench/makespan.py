"""P1: the makespan of a sweep of real Hub models on a simulated trn2 fleet (bench/fleet.py).

The sweep: one job per model of ``bench/data/hub_models.csv`` (public model cards and configs; see
bench/data/README.md), sized by the project's own sizing (``shared.hub.sizing.size_model`` at 24 GiB per
core, bf16); models that fit no group of up to 16 cores are SKIPPED and take no core time. Job durations
come from this model (assumptions, not measurements — nothing here reaches a trn2):

- load: 10 s + the per-core weights read at 1 GB/s (each rank reads its shard);
- compile (neuronx-cc, cold cache): 60 s + 90 s per billion parameters per core + 3 s per layer — the graph
  each core compiles grows with its shard, and with the layer count (unrolled);
- generate 32 greedy tokens: 2 s + 32 x (10 ms + 4 ms per billion parameters per core);
- the verdict stage, on the host's CPUs: load the whole checkpoint at 2 GB/s plus 32 tokens of a CPU
  forward pass at 2 x parameters FLOPs per token and 200 GFLOP/s.

For 1 and 4 trn2.48xlarge hosts (64 cores each) it reports each strategy's makespan divided by the lower
bound ``max(total core-seconds / cores, longest job)``: one model at a time (as the public Space's script
runs), fixed layouts (all 1-core; 8 x 8), and ours (the real planner re-planning on events) without and with
the expected seconds per size (what the launcher reads from recent jobs; here, the sweep's own medians).

The autoscaled fleet: the same sweep under two compiler versions (two images, each version's hosts its own
fleet), from zero hosts, scaled by the trn2-autoscaled overlay's KEDA ScaledJob (``fleet.Autoscaler``: its
polling, its largest fleet and its launchers' idle exit read from the manifests, each new node ready ``NODE_START_S``
after the decision), against a static fleet of as many hosts, always up: makespan against the lower bound on the most
hosts the scaler may hold, and the core-hours billed (every host's cores from its start to its stop) against
those the jobs used; restated over a day with that one sweep, against the static fleet up all day, since the point
of scaling to zero is the idle hours.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

from bench.fleet import (
    NODE_START_S,
    AutoscaledFleet,
    Autoscaler,
    SimJob,
    SimResult,
    Timings,
    median_seconds_per_size,
    one_at_a_time,
    simulate,
)
from bench.report import Goal, Measure, Section
from shared.hub.sizing import GIB, ModelShape, shape_from_config, size_model
from shared.jobs.sweeps import expected_work

DATA = Path(__file__).resolve().parent / "data" / "hub_models.csv"
CORES_PER_HOST = 64
CORE_MEMORY = 24 * GIB
GOAL = 1.10
AUTOSCALED_COMPILERS = ("2.21.18209.0", "2.22.12471.0")  # two images' neuronx-cc versions, one sweep each


def shape(row: dict[str, str]) -> ModelShape:
    """The row as sizing reads a model: through the config fields ``shape_from_config`` takes."""
    fields = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size", "head_dim": "head_dim",
              "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
              "vocab_size": "vocab_size", "num_experts": "num_experts"}  # fmt: skip
    config = {key: int(row[column]) for key, column in fields.items() if row[column]}
    return shape_from_config(
        int(float(row["params_b"]) * 1e9), config, expert_parameters=int(float(row["expert_params_b"] or 0) * 1e9)
    )


def job(row: dict[str, str]) -> SimJob | None:
    model = shape(row)
    sizing = size_model(model, CORE_MEMORY)
    if sizing.cores is None:
        return None
    per_core_b = model.parameters / sizing.cores / 1e9
    load = 10 + per_core_b * 2  # 2 bytes per bf16 parameter at 1 GB/s
    compile_s = 60 + 90 * per_core_b + 3 * model.layers
    generate = 2 + 32 * (0.010 + 0.004 * per_core_b)
    verdict = model.parameters * 2 / 2e9 + 32 * 2 * model.parameters / 200e9
    return SimJob(row["model_id"], sizing.cores, load + compile_s + generate, verdict, parameters=model.parameters)


def sweep_jobs(path: Path = DATA) -> tuple[list[SimJob], int]:
    """The sweep's jobs in rank order (the file's), and how many models fit no group (SKIPPED)."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    jobs = [j for j in map(job, rows) if j is not None]
    return jobs, len(rows) - len(jobs)


def enqueue_order(jobs: list[SimJob]) -> list[SimJob]:
    """The order a sweep enqueues them: ``shared.jobs.sweeps.longest_first``'s key, stable over rank order."""
    return sorted(jobs, key=lambda j: expected_work(j.parameters, j.cores), reverse=True)


def strategies(ranked: list[SimJob], hosts: int) -> dict[str, SimResult]:
    timings = Timings()
    jobs = enqueue_order(ranked)
    return {
        "one model at a time": one_at_a_time(jobs, hosts, CORES_PER_HOST),
        "fixed: all 1-core": simulate(jobs, hosts, CORES_PER_HOST, timings, layout=[1] * CORES_PER_HOST),
        "fixed: 8 x 8": simulate(jobs, hosts, CORES_PER_HOST, timings, layout=[8] * 8),
        "ours, no durations": simulate(jobs, hosts, CORES_PER_HOST, timings),
        "ours": simulate(jobs, hosts, CORES_PER_HOST, timings, seconds_per_job=median_seconds_per_size(jobs)),
        # what-if: the sweep enqueued in rank order (the file's), as it did before it ordered by expected work
        "ours, rank order": simulate(
            ranked,
            hosts,
            CORES_PER_HOST,
            timings,
            seconds_per_job=median_seconds_per_size(jobs),
        ),
    }


DAY_S = 86_400.0


def autoscaled(ranked: list[SimJob]) -> tuple[SimResult, SimResult, Autoscaler]:
    """The sweep under every ``AUTOSCALED_COMPILERS`` version on the autoscaled fleet, and on a static fleet of
    the scaler's most hosts (the versions' hosts in turn)."""
    jobs = [replace(j, name=f"{j.name}@{c}", compiler=c) for c in AUTOSCALED_COMPILERS for j in enqueue_order(ranked)]
    scaler = Autoscaler.from_manifests()
    durations = median_seconds_per_size(jobs)
    scaled = AutoscaledFleet(jobs, scaler, CORES_PER_HOST, Timings(), durations, AUTOSCALED_COMPILERS).run()
    static = simulate(jobs, scaler.max_hosts, CORES_PER_HOST, Timings(), durations, compilers=AUTOSCALED_COMPILERS)
    return scaled, static, scaler


def autoscaled_lines(ranked: list[SimJob]) -> tuple[list[str], Measure]:
    scaled, static, scaler = autoscaled(ranked)
    lines = [
        f"\nThe autoscaled fleet: the {len(ranked)} models that fit x {len(AUTOSCALED_COMPILERS)} compiler versions "
        f"({scaled.jobs_run} jobs), from zero hosts; at most {scaler.max_hosts} hosts (`maxReplicaCount`), polling "
        f"{scaler.polling_s:g} s, a host per {CORES_PER_HOST} cores wanted by the queued and running jobs, each host "
        f"leaving on its own after {scaler.idle_exit_s:g} s without work (`--exit-when-idle`; KEDA never stops one), "
        f"a node ready {NODE_START_S:g} s after the decision (an assumption: `bench/fleet.py`).\n",
        "| fleet | makespan | / lower bound | peak hosts | core-hours billed | core-hours used | used / billed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in (("autoscaled (KEDA, 0 → max)", scaled), (f"static, {scaler.max_hosts} hosts always up", static)):
        lines.append(
            f"| {name} | {r.makespan_s / 3600:.2f} h | {r.ratio:.2f} | {r.peak_hosts} | {r.billed_core_s / 3600:,.0f} "
            f"| {r.used_core_s / 3600:,.0f} | {100 * r.used_core_s / r.billed_core_s:.0f} % |"
        )
    lines.append(
        "\nThe static fleet is billed until its last job ends (then scaled away by hand); the autoscaled one pays "
        "for each node's start-up and its idle time before it leaves, and gives nodes back as the queues empty."
    )
    # The point of scaling to zero is the idle hours: a day with one sweep, against the static fleet up all day
    # (after the sweep the autoscaled hosts have left: nothing is billed until the next submission)
    static_day_core_h = scaler.max_hosts * CORES_PER_HOST * DAY_S / 3600
    assert scaled.makespan_s < DAY_S
    lines.append(
        f"\nOver a day with that one sweep: the autoscaled fleet is billed {scaled.billed_core_s / 3600:,.0f} core-h "
        f"(its hosts leave once idle), a static fleet of {scaler.max_hosts} hosts up all day "
        f"{static_day_core_h:,.0f} core-h; for the sweep alone the static fleet, scaled away by hand at its last job, "
        f"{static.billed_core_s / 3600:,.0f} core-h."
    )
    measure = Measure(
        measure="P1 autoscaled fleet: core-hours billed over a day with one sweep x 2 compiler versions",
        unit="core-h",
        ours=scaled.billed_core_s / 3600,
        baseline=static_day_core_h,
        baseline_name=f"static {scaler.max_hosts} hosts up 24 h",
        note=f"the sweep alone: {scaled.billed_core_s / static.billed_core_s:.2f}x the static fleet's "
        f"{static.billed_core_s / 3600:,.0f} core-h; makespan {scaled.makespan_s / 3600:.2f} h "
        f"({scaled.ratio:.2f}x its lower bound) against {static.makespan_s / 3600:.2f} h static; used "
        f"{scaled.used_core_s / 3600:,.0f} core-h",
    )
    return lines, measure


def run(work: Path) -> Section:
    jobs, skipped = sweep_jobs()
    sizes = {s: sum(1 for j in jobs if j.cores == s) for s in sorted({j.cores for j in jobs})}
    measures, lines = [], []
    lines.append(
        f"{len(jobs)} jobs from `bench/data/hub_models.csv` ({skipped} models fit no group of ≤ 16 cores: SKIPPED); "
        f"jobs per group size {sizes}; accelerator stage {min(j.accelerator_s for j in jobs):.0f} … "
        f"{max(j.accelerator_s for j in jobs):.0f} s, verdict stage {min(j.verdict_s for j in jobs):.0f} … "
        f"{max(j.verdict_s for j in jobs):.0f} s (duration model: `bench/makespan.py`'s docstring). Simulated "
        f"launcher: poll {Timings().poll_s} s, worker start {Timings().worker_start_s} s, "
        f"{Timings().verdict_workers} verdict workers per host.\n"
    )
    lines.append("| hosts | strategy | makespan | / lower bound | core utilisation | largest size's longest wait | "
                 "jobs that cannot run |")  # fmt: skip
    lines.append("|---:|---|---:|---:|---:|---:|---:|")
    for hosts in (1, 4):
        results = strategies(jobs, hosts)
        bound = results["ours"].lower_bound_s
        for name, r in results.items():
            lines.append(
                f"| {hosts} | {name} | {r.makespan_s / 3600:.2f} h | {r.makespan_s / bound:.2f} | "
                f"{100 * r.core_utilisation:.0f} % | {r.largest_size_wait_s / 60:.0f} min | {r.jobs_unrunnable} |"
            )
        ours = results["ours"]
        long_jobs = [j for j in jobs if j.accelerator_s + j.verdict_s > bound / 2]
        why = ""
        if ours.makespan_s / bound > GOAL:
            long_jobs = [j for j in jobs if j.accelerator_s + j.verdict_s > bound / 2]
            why = (
                f"; misses by {ours.makespan_s / bound - GOAL:.2f}: {len(long_jobs)} jobs last more than half the "
                f"bound ({bound / 2 / 60:.0f} min) and need {sum(j.cores for j in long_jobs)} of the "
                f"{hosts * CORES_PER_HOST} cores, so all must start in its first half, while each size's queue is "
                "FIFO and its groups are planned per host from median durations; enqueued in rank order instead "
                f"of longest first: {results['ours, rank order'].makespan_s / bound:.2f}x"
            )
        measures.append(
            Measure(
                measure=f"P1 simulated sweep makespan, {hosts} trn2 host(s)",
                unit="h",
                ours=ours.makespan_s / 3600,
                baseline=bound / 3600,
                baseline_name="lower bound",
                goal=Goal(on="ratio", at_most=GOAL),
                note=f"one model at a time {results['one model at a time'].makespan_s / bound:.1f}x; "
                f"without durations {results['ours, no durations'].makespan_s / bound:.2f}x{why}",
            )
        )
    lines.append(
        "\nThe lower bound is `max(total core-seconds / cores, longest job)` over every job that fits; fixed "
        "layouts leave out the jobs larger than their groups (the last column), so their makespan covers fewer "
        "cells."
    )
    scaled_lines, scaled_measure = autoscaled_lines(jobs)
    lines += scaled_lines
    measures.append(scaled_measure)
    return Section(name="makespan", title="P1 — sweep makespan on a simulated trn2 fleet", measures=measures,
                   details="\n".join(lines))  # fmt: skip

"""Sharded runs on the cpu backend: real rank processes over gloo, spawned by the runner (no torchrun)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from shared.contracts.report import RunReport
from tests.conftest import ROOT
from tests.test_runner import run_local


def run(tiny_models: Path, model: str, *args: str, **env: str) -> tuple[int, dict[str, Any]]:
    return run_local(tiny_models / model, *args, **env)


@pytest.mark.parametrize(
    ("model", "cores", "parallelism", "env"),
    # One case per parallelism and architecture family, over 2 ranks; 4 ranks run in tests/test_deploy.py (the
    # first-hour check: experts-only EP of Qwen3-MoE) and below (a rank killed, heads that do not divide).
    # Some in bf16, trn2's dtype: the reduction order then drifts at bf16's scale, not fp32's.
    [
        # Qwen3 over 2 ranks runs in the first-hour check (tests/test_deploy.py), Llama over 2 in bf16 in
        # tests/test_judges.py.
        ("tiny-llama", 2, "tp", {}),
        ("tiny-mixtral", 2, "ep", {"SUPPORTMATRIX_CPU_DTYPE": "bfloat16", "SUPPORTMATRIX_LONG_GENERATION": "true"}),
        ("tiny-qwen3-moe", 2, "ep_tp", {"SUPPORTMATRIX_MOE_PARALLELISM": "ep_tp"}),
    ],
)
def test_sharded_runs_pass(tiny_models: Path, model: str, cores: int, parallelism: str, env: dict[str, str]) -> None:
    code, report = run(tiny_models, model, "--cores", str(cores), **env)
    assert code == 0, report.failure.error_message or report.verdict_reason
    assert report.verdict == "PASS" and report.provenance.cores == cores and report.placement.parallelism == parallelism
    bf16 = env.get("SUPPORTMATRIX_CPU_DTYPE") == "bfloat16"
    assert report.runtime.compiler_version.endswith("-bf16") == bf16
    if not bf16:  # bf16 may reorder near ties; the verdict then says so
        assert report.comparison.generated_token_ids == report.comparison.reference_token_ids
    assert report.comparison.prefill_rel_error < (4e-2 if bf16 else 1e-3)
    assert report.judge.judge_kind == "likelihood" and report.judge.judge_prompt_hash  # sharded runs are judged
    assert report.resources.peak_memory_bytes > 100 * 2**20  # the max over ranks
    # one compile, the run's own: generate's auto-compile (which the cpu backend's switch makes eligible, as on a
    # neuron device) stays off, and the backend received every graph dynamo built (prefill and decode)
    resources = report.resources
    assert resources.compile_path == "forward" and resources.backend_graphs == resources.graphs_compiled == 2
    # each rank on its own core, in a group of the backend's collective, and the row says so
    assert report.placement.rank_cores == "0@cpu,1@cpu" and report.placement.visible_cores == "0-1"
    assert report.placement.collective == "gloo"
    if env.get("SUPPORTMATRIX_LONG_GENERATION"):  # a benign bf16 run of two ranks: its long generation is ok
        assert report.long.long_generation == "ok", report.long.long_reason
    if model.endswith("moe") or model.endswith("mixtral"):
        assert report.comparison.routing_margin is not None and report.comparison.routing_margin >= 0
        # every rank recorded the experts the compiled run chose (the routers are replicated under EP), within the
        # two graphs asserted above, and they agreed: rank 0's routing was compared with the reference's (a routing
        # the ranks disagree on, or none recorded, leaves the row without routing_flips)
        evidence = report.comparison.evidence
        assert "routing_flips" in evidence, evidence
        if not bf16:  # fp32 routes as the eager reference does: not one choice flipped
            assert evidence["routing_flips"] == 0 and evidence["routing_roots"] == []
        # the reference ran again with rank 0's experts forced (the counterfactual) only where the routing flipped
        assert "forced_prefill_rel_error" not in evidence or evidence["routing_flips"] > 0, evidence


def test_a_model_without_a_parallel_plan_forced_to_two_cores_is_unsupported(tiny_models: Path) -> None:
    code, report = run(tiny_models, "tiny-gpt2", "--cores", "2")
    assert code == 3 and report.failure.error_class == "unsupported_parallelism"
    assert "GPT2Config has no tensor-parallel plan" in report.failure.error_message
    assert "accelerator.rank" in report.failure.error_message  # which rank said so


def test_heads_that_do_not_divide_are_sized_to_a_size_that_works_or_refused(tiny_models: Path) -> None:
    code, report = run(tiny_models, "tiny-llama-6h")  # 6 heads, 2 KV heads: sized to one core
    assert code == 0 and report.provenance.cores == 1 and report.placement.parallelism == "none"
    code, report = run(tiny_models, "tiny-llama-6h", "--cores", "4")
    assert code == 3 and report.failure.error_class == "unsupported_parallelism"
    assert "6 attention heads / 2 KV heads do not divide over 4 ranks" in report.failure.error_message


def test_a_skipped_all_reduce_fails(tiny_models: Path) -> None:
    """The fault only sharding can make: one row-parallel projection returns its rank's partial sum. The graded
    faults (a shard scaled, a head zeroed, a wrong rotary base, an off-by-one cache position, a dropped layer)
    and benign noise (thread counts, TP 1/2/4) are measured in bench/calibrate_verdict.py; drop_layer fails
    through the service in tests/test_stages.py."""
    code, report = run(tiny_models, "tiny-qwen3", "--cores", "2", SUPPORTMATRIX_CPU_FAULT="skip_allreduce")
    assert code == 1 and report.verdict == "FAIL", report.failure.error_message
    assert "prefill logits differ" in report.verdict_reason


def test_a_rank_that_dies_takes_its_group_down_and_is_named(tiny_models: Path) -> None:
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.runner",
            "local",
            "--local-dir",
            str(tiny_models / "tiny-llama"),
            "--cores",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.monotonic() + 120
    ranks: list[psutil.Process] = []
    while len(ranks) < 2 and time.monotonic() < deadline:
        ranks = [c for c in psutil.Process(runner.pid).children() if "accelerator.rank" in " ".join(c.cmdline())]
        time.sleep(0.1)
    assert len(ranks) == 2, "the two ranks never started"
    time.sleep(2)  # into loading or the collectives
    # each live rank's environment: its rank, a world of 2, device index 0 of its own; each pinned to its own CPU
    environments = {r.pid: r.environ() for r in ranks}
    assert sorted(e["RANK"] for e in environments.values()) == ["0", "1"]
    assert all(e["WORLD_SIZE"] == "2" and e["LOCAL_RANK"] == "0" for e in environments.values())
    assert sorted(r.cpu_affinity() for r in ranks) == [[0], [1]]
    [victim] = [r for r in ranks if r.cmdline()[-1].endswith("accelerator.rank1.spec.json")]
    victim.kill()
    out, _ = runner.communicate(timeout=120)
    report = RunReport.model_validate_json(out.strip().splitlines()[-1])
    assert (
        report.failure.error_class == "crash"
        and "accelerator.rank1 process killed by SIGKILL" in report.failure.error_message
    )
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)  # rank 0 went too


def _agree(rank: int, port: int, digests: list[bytes], answers: Any) -> None:
    import torch.distributed as dist

    from services.runner.parallel import same_on_every_rank

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(digests))
    try:
        same = same_on_every_rank(digests[rank], "cpu")
        differ = same_on_every_rank(digests[rank] if rank == 0 else b"\x01" + digests[rank][1:], "cpu")
        answers.put((rank, same, differ))
    finally:
        dist.destroy_process_group()


def test_the_ranks_routing_is_kept_only_where_every_rank_recorded_the_same() -> None:
    """``same_on_every_rank``, which decides whether an EP run keeps rank 0's routing: two gloo ranks with the same
    digest both hear yes; one rank's other digest (a rank-local fault routed it otherwise) makes both hear no."""
    import multiprocessing
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    digest = bytes(range(32))
    ranks = [context.Process(target=_agree, args=(rank, port, [digest, digest], answers)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert sorted(answers.get(timeout=5) for _ in ranks) == [(0, True, False), (1, True, False)]

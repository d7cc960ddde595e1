"""The runner as users and the worker call it: a real child process loading a real checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from services.runner.failures import RunFailure, classify
from services.runner.launch import Budget, run_child
from services.runner.specs import DescribeSpec
from shared.contracts.enums import ErrorClass
from shared.contracts.report import RunReport
from shared.contracts.run import RuntimeInfo
from shared.settings import inherited_environment
from tests.conftest import ROOT, RUN_DIR


def run_runner(*args: str, cwd: Path = ROOT, **env: str) -> tuple[int, RunReport]:
    proc = subprocess.run(
        [sys.executable, "-m", "services.runner", *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return proc.returncode, RunReport.model_validate_json(lines[-1])


def run_local(directory: Path, *args: str, **env: str) -> tuple[int, RunReport]:
    """The runner on a checkpoint directory: only through its explicit --local-dir option."""
    return run_runner(f"local/{directory.name}", "--local-dir", str(directory), *args, **env)


def test_inductor_compiles_and_a_second_host_hits_the_shared_cache(tiny_models: Path) -> None:
    """The real default compiler on the cpu backend, on a local checkpoint directory; a cold run pushes its
    cache entries to a shared remote, a fresh cache elsewhere pulls them and compiles from the cache."""
    remote = str(RUN_DIR / "shared-compile-cache")
    common = {"SUPPORTMATRIX_CPU_COMPILE_BACKEND": "inductor", "SUPPORTMATRIX_COMPILE_CACHE_REMOTE": remote,
              "SUPPORTMATRIX_COMPILE_CACHE_PUSH": "true"}  # fmt: skip
    code, report = run_local(tiny_models / "tiny-llama", SUPPORTMATRIX_CACHE_DIR=str(RUN_DIR / "cache-a"), **common)
    assert code == 0, report
    assert report.verdict == "PASS" and report.resources.compile_cache == "miss"
    assert report.runtime.compiler_name == "inductor" and report.runtime.compiler_version == "inductor-2.13.0+cpu"
    assert report.comparison.generated_token_ids == report.comparison.reference_token_ids
    assert len(report.comparison.generated_token_ids) == 32
    # inductor generated code for this run in the configured cache, not in /tmp, and pushed it
    assert any((RUN_DIR / "cache-a" / "inductor").rglob("*.py"))
    assert any((Path(remote) / "inductor-inductor-2.13.0+cpu").rglob("*"))
    assert report.timings.compile_s > report.timings.generate_s
    assert report.subject.sha is None  # a local directory has no commit
    assert report.provenance.reproduce == (
        f"python -m services.runner local/tiny-llama --local-dir {tiny_models / 'tiny-llama'} --backend cpu --cores 1"
    )

    # Two jobs at once on one cache: the warm one reads its own lookups while the cold one writes new entries beside
    # it (an outcome read off the cache directory would call the warm one a miss).
    other = {**common, "SUPPORTMATRIX_CACHE_DIR": str(RUN_DIR / "cache-b")}
    with ThreadPoolExecutor(2) as pool:
        cold_job = pool.submit(run_local, tiny_models / "tiny-qwen3", **other)
        (code, warm), (cold_code, cold) = (
            pool.submit(run_local, tiny_models / "tiny-llama", **other).result(),
            cold_job.result(),
        )
    assert code == 0 and warm.resources.compile_cache == "hit", warm
    assert warm.resources.cache_hits and warm.resources.cache_misses == 0
    assert cold_code == 0 and cold.resources.compile_cache == "miss" and cold.resources.cache_misses
    assert warm.comparison.generated_token_ids == report.comparison.generated_token_ids


def test_hub_model_is_downloaded_through_the_endpoint(hub: Any, tmp_path: Path) -> None:
    before = len(hub.requests)
    code, report = run_runner("org/tiny-gpt2", HF_HOME=str(tmp_path / "empty-hf-cache"))
    assert code == 0 and report.verdict == "PASS", report
    assert len(report.subject.sha) == 40
    paths = [p for _, p in hub.requests[before:]]
    assert any(p.endswith("/resolve/" + report.subject.sha + "/model.safetensors") for p in paths)


@pytest.mark.parametrize(
    ("model", "error_class", "message"),
    [
        ("org/tiny-broken", "load", "weight headers are unreadable"),
        ("org/no-such-model", "not_found", "org/no-such-model@main"),
        ("org/gated-llama", "gated", "is gated"),
    ],
)
def test_models_that_cannot_run_end_in_error_with_their_class(
    hub: Any, tiny_models: Path, model: str, error_class: str, message: str
) -> None:
    hub.add("org/gated-llama", tiny_models / "tiny-llama", gated="auto")
    code, report = run_runner(model)
    assert code == 3
    assert report.verdict == "ERROR" and report.failure.error_class == error_class, report.failure.error_message
    assert message in report.failure.error_message


def test_an_unreachable_hub_is_retried_then_an_error_of_its_own_class(tmp_path: Path) -> None:
    code, report = run_runner(
        "org/tiny-llama",
        HF_ENDPOINT="http://127.0.0.1:9",  # nothing listens on the discard port
        HF_HOME=str(tmp_path / "hf"),
        SUPPORTMATRIX_HUB_RETRY_DELAYS_S="[0.1, 0.1]",
    )
    assert code == 3 and report.failure.error_class == "hub_unavailable", report.failure.error_message
    assert "Connect" in report.failure.error_message


def test_describe_reports_what_this_machine_serves() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.runner.describe"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["backend"] == "cpu" and info["compiler_version"] == "aot_eager-2.13.0+cpu"
    assert info["library"] == "transformers" and info["library_version"]


def test_bad_usage_exits_2_with_a_message() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.runner", "--backend", "tpu", "org/x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "invalid choice: 'tpu'" in proc.stderr


def test_a_child_that_dies_without_output_is_a_crash(tmp_path: Path) -> None:
    with pytest.raises(RunFailure) as info:
        # An interpreter without its standard library dies at start-up, before it writes anything.
        run_child(DescribeSpec(backend="cpu"), RuntimeInfo, inherited_environment({"PYTHONHOME": "/nonexistent"}), 60,
                  tmp_path)  # fmt: skip
    assert info.value.error_class == ErrorClass.crash
    assert "exit status 1" in info.value.message and "Fatal Python error" in info.value.message


def test_a_child_over_its_time_limit_is_killed(tmp_path: Path) -> None:
    with pytest.raises(RunFailure) as info:
        run_child(DescribeSpec(backend="cpu"), RuntimeInfo, inherited_environment({}), 0.2, tmp_path)
    assert info.value.error_class == ErrorClass.timeout


def test_exceptions_are_classified_by_phase_and_memory() -> None:
    import torch._dynamo.exc

    assert classify(MemoryError(), ErrorClass.load) == ErrorClass.oom
    assert classify(RuntimeError("CUDA out of memory. Tried to allocate"), ErrorClass.runtime) == ErrorClass.oom
    assert classify(OSError("no such file"), ErrorClass.load) == ErrorClass.load
    assert classify(ValueError("bad shape"), ErrorClass.compile) == ErrorClass.runtime
    assert classify(torch._dynamo.exc.Unsupported("graph break"), ErrorClass.compile) == ErrorClass.compile


def test_evidence_comes_from_what_greedy_picked_from(tiny_models: Path, tmp_path: Path) -> None:
    """A bf16 run of a checkpoint whose generation config sets a repetition penalty, with a benign divergence
    forced at a near tie: the penalty changes greedy's pick at later steps, so evidence from raw logits would
    see real divergences there; the processed scores the reference is scored with see none. PASS."""
    checkpoint = tmp_path / "tiny-llama-penalty"
    shutil.copytree(tiny_models / "tiny-llama", checkpoint)
    config = json.loads((checkpoint / "generation_config.json").read_text())
    (checkpoint / "generation_config.json").write_text(json.dumps(config | {"repetition_penalty": 1.5}))
    code, report = run_local(checkpoint, SUPPORTMATRIX_CPU_DTYPE="bfloat16", SUPPORTMATRIX_CPU_FAULT="swap_near_tie")
    assert code == 0 and report.verdict == "PASS", report
    divergence = report.comparison.first_divergence
    assert divergence is not None and divergence >= 4 and "every divergence a near tie" in report.verdict_reason
    evidence = report.comparison.evidence
    assert all(step["rank"] < 5 and step["gap"] <= 0.3 for step in evidence["divergent_steps"])
    assert any(step > divergence for step in evidence["processor_reordered_steps"])  # the penalty mattered
    # what sizing predicted per core is kept beside what was measured; the model compiled once (prefill, decode)
    assert report.resources.predicted_peak_bytes_per_core > 0 and report.resources.peak_memory_bytes > 0
    assert report.resources.graphs_compiled == 2


def test_the_compile_has_a_budget_of_its_own_and_a_timeout_names_its_phase(tiny_models: Path) -> None:
    """Compile seconds are charged to SUPPORTMATRIX_COMPILE_TIMEOUT_S, everything else to the job timeout: a
    compile past its budget is ERROR(timeout) naming the compile phase, however much of the rest is left."""
    budget = Budget(outside_s=10.0, compile_s=5.0, started=time.monotonic() - 12.0)
    budget.charge(4.0, compiling=True)  # 12 s since the start, 4 of them compiling: 8 s outside
    assert budget.overrun(False, "generate", [], "accelerator") is None
    budget.charge(2.0, compiling=True)
    compiled = budget.overrun(True, "compile", ["accelerator"], "accelerator")
    assert compiled is not None and "the compile phase ran past its 5 s budget" in compiled.message
    budget.charge(3.0, compiling=False)  # a poll outside the compile charges nothing to it
    assert budget.compiled_s == 6.0
    code, report = run_local(tiny_models / "tiny-llama", SUPPORTMATRIX_COMPILE_TIMEOUT_S="0.3",
                             SUPPORTMATRIX_JOB_TIMEOUT_S="600")  # fmt: skip
    assert code == 3 and report.failure.error_class == "timeout", report.failure
    assert (
        "the compile phase ran past its 0.3 s budget (SUPPORTMATRIX_COMPILE_TIMEOUT_S)" in report.failure.error_message
    )


def test_each_divergent_steps_router_margin_is_read_at_the_position_that_chose_its_token(tiny_models: Path) -> None:
    """The routing part of the verdict's rule reads, for each divergent step, the reference's router margin at the
    position whose logits chose that token (the prompt's last, then each token's): one forward over the prompt and
    the tokens gives them all, the same numbers as each prefix's own last position; a dense model has none."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.runner.tasks.text_generation import router_margins, routing_margin, step_routing_margins
    from shared.testconfig import PROMPT

    moe = tiny_models / "tiny-qwen3-moe"
    tokenizer = AutoTokenizer.from_pretrained(moe)
    model = AutoModelForCausalLM.from_pretrained(moe).eval()
    inputs = tokenizer(PROMPT, return_tensors="pt")
    tokens = [5, 17, 42, 99]
    margins = step_routing_margins(model, inputs, tokens)
    assert margins is not None and len(margins) == len(tokens)
    for step in range(len(tokens)):
        prefix = torch.cat([inputs["input_ids"], torch.tensor([tokens[:step]], dtype=torch.long)], dim=1)
        own = router_margins(model, prefix)
        assert own is not None and abs(own[-1] - margins[step]) < 1e-4  # causal: the prefix alone gives the same
    assert routing_margin(model, inputs) == pytest.approx(min(router_margins(model, inputs["input_ids"]) or [0]))
    dense = AutoModelForCausalLM.from_pretrained(tiny_models / "tiny-llama").eval()
    assert step_routing_margins(dense, inputs, tokens) is None

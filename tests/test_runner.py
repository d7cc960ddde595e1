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


def test_a_fault_of_the_decode_alone_fails_at_the_first_step_whose_logits_moved(tiny_models: Path) -> None:
    """An off-by-one cache position leaves the prefill as it is and moves every decode step (rule version 7): the
    run fails at step 1, where its logits first differ from the reference's on the same prefix, whatever its tokens
    do; the row keeps every step's error."""
    code, report = run_local(tiny_models / "tiny-llama", SUPPORTMATRIX_CPU_FAULT="cache_position")
    assert code == 1 and report.verdict == "FAIL", report.verdict_reason
    assert (report.verdict_reason or "").startswith("step 1's logits differ from the reference's on the same prefix")
    errors = report.comparison.evidence["step_rel_errors"]
    assert len(errors) == 32 and errors[0] < 1e-3 < min(errors[1:])  # fp32: the prefill is untouched
    assert (report.comparison.prefill_rel_error or 0.0) < 1e-3


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


def test_the_routing_recorder_keeps_each_forwards_experts_and_the_flips_read_the_experts_that_swapped() -> None:
    """On a 2-layer, 4-expert Mixtral built in memory (top-2; the reference keeps its top 4 router logits): the same
    model recorded twice flips nothing; layer 1's router negated in one run flips only layer 1 (layer 0 reads
    nothing it changed), each flip's margin the reference's logit of the expert dropped minus the one added, the
    largest such gap; a router that did not run is kept as no expert (-1), which no margin excuses; every call's
    choices are its own, copied out of the router's tensors (a backend reusing its buffers changes none of them).
    The counterfactual's forcer makes the unchanged model choose another run's experts."""
    import math

    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from services.runner.routing import RoutingForcer, RoutingRecorder
    from tasks.text_generation.verdict import routing_flips

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    model = MixtralForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 9))

    def recorded(top: bool = False, calls: int = 1) -> Any:
        recorder = RoutingRecorder(model, top=top)
        assert len(recorder.routers) == 2 and recorder.unordered is None
        forward = recorder.wrap(model.forward)
        recorder.recording = True
        with torch.inference_mode():
            for _ in range(calls):
                forward(input_ids=ids)
        recorder.remove()
        return recorder, recorder.routing(prompt_positions=ids.shape[1])

    _, ours = recorded()
    _, reference = recorded(top=True)
    assert len(ours.experts) == 9 and len(ours.experts[0]) == 2 and len(reference.top_logits[0][1]) == 4
    assert routing_flips(ours, reference) == []
    recorder, twice = recorded(calls=2)
    chosen = [router.chosen_experts for router in recorder.routers]
    assert twice.experts == ours.experts * 2
    with torch.inference_mode():  # a reused output buffer, overwritten by the next forward: the record has its copy
        for tensor in chosen:
            tensor.fill_(3)
    assert recorder.routing(prompt_positions=9).experts == twice.experts

    gate = model.model.layers[1].mlp.gate
    logits: dict[str, Any] = {}

    def keep(module: Any, args: Any, output: Any) -> None:
        logits["layer 1"] = output[0].detach().clone()

    hook = gate.register_forward_hook(keep)
    with torch.no_grad():
        gate.weight.neg_()
    _, flipped = recorded()
    with torch.no_grad():
        gate.weight.neg_()
    hook.remove()
    flips = routing_flips(flipped, reference)
    assert flips and {f.layer for f in flips} == {1} and len(flips) <= 9
    negated = -logits["layer 1"]  # the reference's router logits at layer 1 (the hook saw the negated run's)
    for f in flips:
        position = f.step + 8
        dropped = set(reference.experts[position][1]) - set(flipped.experts[position][1])
        added = set(flipped.experts[position][1]) - set(reference.experts[position][1])
        gaps = [float(negated[position, d] - negated[position, a]) for d in dropped for a in added]
        assert math.isclose(f.margin, max(gaps), rel_tol=1e-5, abs_tol=1e-5)

    # the counterfactual: the unchanged model made to choose the negated run's experts chooses them, position by
    # position over two forwards (a prefill, then one more position); made to choose its own, it computes what it did
    forcer = RoutingForcer(model, flipped.model_copy(update={"experts": flipped.experts + flipped.experts[:1]}))
    recorder = RoutingRecorder(model)  # after the forcer's hooks: it records what the forced routers chose
    recorder.recording = True
    forward = recorder.wrap(model.forward)
    with torch.inference_mode():
        forward(input_ids=ids)
        forward(input_ids=ids[:, :1])
    forcer.remove()
    recorder.remove()
    assert forcer.forceable and recorder.routing(prompt_positions=9).experts == forcer.routing.experts
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
        forcer = RoutingForcer(model, ours)
        same = model(input_ids=ids).logits
        forcer.remove()
    assert torch.equal(plain, same)
    # a router whose weights are not its logits' softmax over the chosen experts (scaled here, as per-expert scales or
    # sparsemixer weigh them), or forwards that route other positions than recorded: no counterfactual
    gate = model.model.layers[0].mlp.gate
    router_forward = gate.forward
    gate.forward = lambda hidden: (lambda out: (out[0], out[1] * 0.5, out[2]))(router_forward(hidden))
    try:
        with torch.inference_mode():
            forcer = RoutingForcer(model, ours)
            model(input_ids=ids)
            forcer.remove()
    finally:
        del gate.forward
    assert not forcer.forceable and not forcer.covered
    with torch.inference_mode():
        forcer = RoutingForcer(model, ours)
        model(input_ids=ids[:, :5])  # 5 of the 9 recorded positions
        forcer.remove()
    assert forcer.forceable and not forcer.covered

    mlp = model.model.layers[1].mlp
    mlp.forward = lambda hidden_states: torch.zeros_like(hidden_states)  # layer 1's router does not run
    try:
        _, skipped = recorded()
    finally:
        del mlp.forward
    assert all(layers[1] == [-1, -1] for layers in skipped.experts)
    flips = routing_flips(skipped, reference)
    assert flips and all(f.layer == 1 and f.margin is None for f in flips) and len(flips) == 9


def test_a_router_that_does_not_choose_by_raw_logit_order_gets_no_routing_record() -> None:
    """DeepSeek-V3's router adds a correction bias to sigmoid scores and picks expert groups first: a gap of its raw
    logits says nothing of how close its choice was, so it gets no recorder (and so no excuse), and the reason says
    why. Config-level signs alone (groups, a sigmoid score) are read too."""
    from types import SimpleNamespace

    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from services.runner.routing import RoutingRecorder, unordered_routing

    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=64, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                              num_hidden_layers=2, first_k_dense_replace=0, num_attention_heads=2,
                              num_key_value_heads=2, n_routed_experts=8, n_group=2, topk_group=1,
                              num_experts_per_tok=2, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                              qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=64)  # fmt: skip
    recorder = RoutingRecorder(DeepseekV3ForCausalLM(config).eval())
    assert recorder.routers == [] and recorder.hooks == [] and "correction bias" in (recorder.unordered or "")
    assert recorder.wrap(len) is len  # the forward is left as it is
    assert "groups" in (unordered_routing(SimpleNamespace(config=SimpleNamespace(n_group=8)), [object()]) or "")
    scored = SimpleNamespace(config=SimpleNamespace(scoring_func="sigmoid"))
    assert "sigmoid" in (unordered_routing(scored, [object()]) or "")
    assert unordered_routing(SimpleNamespace(config=SimpleNamespace(n_group=1)), [object()]) is None


def test_the_neuron_backend_gives_torchneuron_a_private_work_directory_when_the_worker_gave_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reproduce command or a local run has no TORCH_NEURONX_DEBUG_DIR from the worker: the neuron backend's
    accelerator environment names a fresh directory of the run's own under its TMPDIR, 0700 and its user's, a
    new one per run — never TorchNeuron's shared /tmp/neuron_backend. One the worker set is kept as it is. (The
    choice only: torch_neuronx is not imported.)"""
    from services.runner.backends.neuron import DEBUG_DIR, NeuronBackend
    from shared.settings import Settings

    backend = NeuronBackend(Settings(data_dir=tmp_path / "data"))
    monkeypatch.delenv(DEBUG_DIR, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    first, second = (Path(backend.accelerator_env()[DEBUG_DIR]) for _ in range(2))
    assert first != second and first.parent == second.parent == tmp_path
    for made in (first, second):
        held = made.lstat()
        assert made.is_dir() and held.st_mode & 0o777 == 0o700 and held.st_uid == os.geteuid()
        assert made.name.startswith("neuron_backend-") and list(made.iterdir()) == []
    assert "torch_neuronx" not in sys.modules
    given = tmp_path / "work-accelerator" / "neuron_backend"
    monkeypatch.setenv(DEBUG_DIR, str(given))
    # the ranks get the runner's own environment with the backend's on top (as the accelerator stage builds it)
    assert inherited_environment(backend.accelerator_env())[DEBUG_DIR] == str(given) and not given.exists()

"""The runner's stages: accelerator (pinned cores), verdict and judge (host CPUs), or all of them in one go.

Stages hand over through the job's artifact directory (``shared.contracts.handoffs.Artifacts``), never through a
database: the worker puts a stored reference there before the verdict stage and stores the new one it
finds there after.
"""

from __future__ import annotations

import struct
import tempfile
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path

from services.runner.backends import Backend, get_backend
from services.runner.download import Checkpoint, download
from services.runner.failures import RunFailure, failure_report, phase, stage_report
from services.runner.judges import make_judge
from services.runner.launch import Budget, run_child, run_ranks
from services.runner.specs import AcceleratorSpec, ReferenceResult, ReferenceSpec
from services.runner.tasks import get_task
from services.runner.tasks.conclusion import Conclusion
from shared.contracts.enums import ErrorClass, Stage, Verdict
from shared.contracts.handoffs import (
    AcceleratorData,
    AcceleratorOutput,
    Artifacts,
    StoredReference,
    VerdictOutput,
    write_model,
)
from shared.contracts.report import Placement, RunReport
from shared.contracts.run import RunRequest
from shared.cores import format_cpus, parse_cpus
from shared.hub.sizing import (
    ModelShape,
    checkpoint_shape,
    default_core_memory_bytes,
    per_core_bytes,
    size_model,
    unfit_class,
)
from shared.settings import RunnerSettings, inherited_environment
from shared.testconfig import reference_key
from tasks import declaration
from tasks.text_generation import Tolerances
from tasks.text_generation.verdict import decide


def run(request: RunRequest, settings: RunnerSettings) -> RunReport:
    backend = get_backend(request.backend or settings.backend, settings)
    with _artifact_dir(request, settings) as root:
        artifacts = Artifacts(root)
        if request.stage == Stage.judge:
            return judge_stage(settings, artifacts)
        if request.stage in (Stage.accelerator, Stage.full):
            report = accelerator_stage(request, backend, artifacts)
            if request.stage == Stage.accelerator or report.verdict is not None:
                return report
        verdict = verdict_stage(request, backend, artifacts)
        if request.stage == Stage.verdict or not verdict.judge_needed:
            return verdict.report
        return judge_stage(settings, artifacts)


def _artifact_dir(request: RunRequest, settings: RunnerSettings) -> AbstractContextManager[Path]:
    """The job's artifact directory; a standalone full run gets a temporary one under the data dir."""
    if request.artifacts is not None:
        request.artifacts.mkdir(parents=True, exist_ok=True)
        return nullcontext(request.artifacts)
    if request.stage != Stage.full:
        raise ValueError(f"--stage {request.stage.value} needs --artifacts, where the stages hand over")
    runs = settings.data_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    return _temporary(runs)


def _temporary(parent: Path) -> AbstractContextManager[Path]:
    class Temporary(tempfile.TemporaryDirectory[str]):
        def __enter__(self) -> Path:  # type: ignore[override]
            return Path(self.name)

    return Temporary(prefix="run-", dir=parent)


def _budget(request: RunRequest, backend: Backend) -> Budget:
    """This runner's budgets, from now: ``--timeout-s`` (else the job timeout) outside compilation, and the
    compile's own."""
    settings = backend.settings
    return Budget(outside_s=request.timeout_s or settings.job_timeout_s, compile_s=settings.compile_timeout_s)


# --- the accelerator stage ----------------------------------------------------------------------------


def accelerator_stage(request: RunRequest, backend: Backend, artifacts: Artifacts) -> RunReport:
    """Download, size, load, compile, generate; leave an AcceleratorOutput. The report's verdict stays None
    unless the run ended here (ERROR, or SKIPPED as too large)."""
    budget = _budget(request, backend)  # from the stage's start: the download counts outside compilation
    # The report is filled in as the stage gets further, so that a failure reports all that was known by then.
    report = stage_report(request, backend.name, backend.settings.host_name)
    try:
        checkpoint = download(
            request.model_id,
            request.revision,
            request.local_dir,
            backend.settings.hub_retry_delays_s,
            with_code=request.trust_remote_code,
        )
        report.subject.sha = checkpoint.sha
        shape = _checkpoint_shape(checkpoint)
        cores = report.provenance.cores = choose_cores(request, shape, backend)
        report.resources.predicted_peak_bytes_per_core = per_core_bytes(shape, cores, backend.dtype)
        reproduced = request.model_copy(
            update={"revision": checkpoint.sha or request.revision, "cores": cores, "backend": backend.name}
        )
        report.provenance.reproduce = reproduced.reproduce_command(backend.reproduce_env())
        spec = AcceleratorSpec(
            backend=backend.name,
            world_size=cores,
            task=request.task,
            model_dir=checkpoint.path,
            artifacts=artifacts.root,
            trust_remote_code=request.trust_remote_code,
        )
        env = inherited_environment(backend.accelerator_env())
        pins = backend.rank_pins(request.core_range, cores)
        ranks = run_ranks(spec, AcceleratorData, env, budget, artifacts.root, pins)
        report.placement = ranks_placement([r.placement for r in ranks], backend.exclusive_cores)
    except RunFailure as failure:
        # too large, or a task that runs whole split by force: no run of this model can say more
        unrunnable = failure.error_class in (ErrorClass.too_large, unfit_class(declaration(request.task).sharded))
        return failed(report, failure, Verdict.SKIPPED if unrunnable else Verdict.ERROR)
    data = ranks[0]  # rank 0's outputs; peak memory is the most any rank used
    data.resources.peak_memory_bytes = max(r.resources.peak_memory_bytes or 0 for r in ranks)
    data.resources.predicted_peak_bytes_per_core = report.resources.predicted_peak_bytes_per_core
    runtime = data.runtime
    assert runtime is not None and runtime.torch_version
    report.runtime, report.timings, report.resources = runtime, data.timings, data.resources
    report.performance = data.performance  # the verdict stage keeps it for a PASS only
    report.output = data.output
    key = reference_key(
        request.model_id,
        checkpoint.content_id,
        request.task.value,
        backend.dtype,
        runtime.library_version,
        runtime.torch_version,
        data.output.pipeline_key,
    )
    output = AcceleratorOutput(
        report=report,
        data=data,
        model_dir=checkpoint.path,
        dtype=backend.dtype,
        content_id=checkpoint.content_id,
        reference_key=key,
    )
    write_model(artifacts.accelerator, output)
    return report


def ranks_placement(ranks: list[Placement], exclusive: bool) -> Placement:
    """The run's placement from each rank's: the cores they saw together, each rank's core and device in rank
    order, rank 0's process group. Two ranks on one core of a backend whose cores are exclusive is a broken
    placement: the run did not shard over the cores its row would claim."""
    seen = [rank.visible_cores or "" for rank in ranks]
    if exclusive:
        for later, cores in enumerate(seen):
            if cores in seen[:later]:
                raise RunFailure(
                    ErrorClass.placement,
                    f"ranks {seen.index(cores)} and {later} both hold core {cores} (each rank's core@device: "
                    f"{', '.join(r.rank_cores or '?' for r in ranks)})",
                )
    try:
        together = format_cpus(set().union(*(parse_cpus(cores) for cores in seen)))
    except ValueError:  # a backend that reports devices, not core numbers
        together = seen[0]
    return ranks[0].model_copy(
        update={"visible_cores": together, "rank_cores": ",".join(r.rank_cores or "?" for r in ranks)}
    )


def _checkpoint_shape(checkpoint: Checkpoint) -> ModelShape:
    try:
        return checkpoint_shape(checkpoint.path)
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise RunFailure(ErrorClass.load, f"the checkpoint's config or weight headers are unreadable: {exc}") from exc


def choose_cores(request: RunRequest, shape: ModelShape, backend: Backend) -> int:
    """--cores when given, else the fewest cores whose memory holds the checkpoint."""
    if request.cores:
        return int(request.cores)
    memory = default_core_memory_bytes(backend.name, backend.settings.core_memory_gib)
    whole = None if declaration(request.task).sharded else request.task.value
    sizing = size_model(shape, memory, run_dtype=backend.dtype, whole=whole)
    if sizing.cores is None:
        raise RunFailure(unfit_class(declaration(request.task).sharded), sizing.reason)
    return sizing.cores


# --- the verdict stage ---------------------------------------------------------------------------------


def verdict_stage(request: RunRequest, backend: Backend, artifacts: Artifacts) -> VerdictOutput:
    """The reference (stored, or computed on the CPU), the evidence and the verdict; leaves a VerdictOutput.

    A sharded text-generation run's verdict is provisional here: the judge stage decides it with the judge.
    """
    acc = AcceleratorOutput.model_validate_json(artifacts.accelerator.read_text())
    task = get_task(request.task)
    found: ReferenceResult | None = None
    new_reference = None
    if artifacts.stored_reference.exists():
        stored = StoredReference.model_validate_json(artifacts.stored_reference.read_text())
        found = task.reuse(acc.data, stored.data, artifacts, acc.dtype)
    try:
        if found is None:
            spec = ReferenceSpec(
                backend=backend.name,
                task=request.task,
                model_dir=acc.model_dir,
                artifacts=artifacts.root,
                accelerator=acc.data,
                trust_remote_code=request.trust_remote_code,
            )
            env = inherited_environment(backend.reference_env())
            found = run_child(spec, ReferenceResult, env, _budget(request, backend), artifacts.root)
            new_reference = acc.new_reference(found.data)
        conclusion = task.conclude(acc.data, found, artifacts, acc.dtype)
    except RunFailure as failure:
        output = VerdictOutput(report=failed(acc.report, failure), dtype=acc.dtype)
    else:
        output = VerdictOutput(
            report=conclusion.into(acc.report),
            dtype=acc.dtype,
            evidence=conclusion.evidence,
            new_reference=new_reference,
            judge_needed=conclusion.evidence is not None and conclusion.evidence.sharded,
        )
    write_model(artifacts.verdict, output)
    return output


# --- the judge stage -----------------------------------------------------------------------------------


def judge_stage(settings: RunnerSettings, artifacts: Artifacts) -> RunReport:
    """Ask the configured judge about a sharded run's text and decide with its answer: the same rule, now with
    the judge's outcome.

    It runs in a process of its own that loads no tested checkpoint: the only one given the judge's token.
    """
    output = VerdictOutput.model_validate_json(artifacts.verdict.read_text())
    report, comparison = output.report, output.report.comparison
    assert output.evidence is not None
    try:
        with phase(ErrorClass.runtime):
            judge = make_judge(settings).judge(
                comparison.generated_text or "",
                comparison.reference_text or "",
                comparison.accelerator_loglik or 0.0,
                comparison.reference_loglik or 0.0,
            )
    except RunFailure as failure:
        return failed(report, failure, prefix="judge: ")
    decision = decide(replace(output.evidence, judge=judge), Tolerances.for_dtype(output.dtype))
    judged = Conclusion.of(decision, comparison, output.evidence, report.long, report.performance).into(report)
    return judged.model_copy(update={"judge": judge.audit})


def failed(report: RunReport, failure: RunFailure, verdict: Verdict = Verdict.ERROR, prefix: str = "") -> RunReport:
    """The report of a stage that ended with ``failure`` (``services.runner.failures.failure_report``)."""
    return failure_report(report, failure, verdict, prefix)

"""Constructing result histories in a database without running models."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, Stage, SweepState, Task, Verdict
from shared.contracts.report import OPTIONAL_PARTS, ROW_PARTS, RunReport, Subject
from shared.contracts.run import RuntimeInfo
from shared.db.models import Sweep, SweepEntry
from shared.hub.client import ResolvedModel
from shared.jobs.lease import acquire_lease
from shared.jobs.outcomes import finish
from shared.jobs.submission import submit
from shared.settings import Settings


def runtime(compiler: str, library: str) -> RuntimeInfo:
    return RuntimeInfo(
        backend="neuron",
        compiler_name="neuronx-cc",
        compiler_version=compiler,
        library_version=library,
        torch_version="2.13.0",
    )


def report_of(**fields: Any) -> RunReport:
    """A report from flat field names, as a row spells them: each goes to the part that declares it (the
    subject's too; ``verdict``, ``verdict_reason`` and ``runtime`` as they are)."""
    top = {name: fields.pop(name) for name in ("verdict", "verdict_reason", "runtime") if name in fields}
    parts = {"subject": Subject} | {part: model for part, model in ROW_PARTS.items() if part not in OPTIONAL_PARTS}
    values: dict[str, dict[str, Any]] = {}
    for name, value in fields.items():
        [owner] = [part for part, model in parts.items() if name in model.model_fields]
        values.setdefault(owner, {})[name] = value
    return RunReport(**top, **{part: parts[part](**given) for part, given in values.items()})


def record(
    session: Session,
    model: str,
    rt: RuntimeInfo,
    verdict: Verdict,
    force: bool = False,
    sha: str = "b" * 40,
    task: str = Task.text_generation.value,
    **fields: Any,
) -> int:
    """One finished run of ``model`` under ``rt`` with ``verdict``, as a worker would have written it; ``fields``
    are more of the row's (an ERROR's class defaults to compile)."""
    resolved = ResolvedModel(model_id=model, sha=sha, gated=False, pipeline_tag=None)
    [sub] = submit(session, resolved, None, [rt], force=force, task=task)
    acquire_lease(session, sub.job.id, "w", Settings(), Stage.accelerator)
    fields.setdefault("error_class", ErrorClass.compile if verdict == Verdict.ERROR else None)
    finish(
        session,
        sub.job.id,
        "w",
        report_of(model_id=model, task=task, backend="neuron", verdict=verdict, cores=2, wall_s=12.5,
                  peak_memory_bytes=3 << 30, **fields),
    )  # fmt: skip
    session.commit()
    return sub.job.id


# What a realistic FAIL, PASS and sharded PASS carry beyond the verdict (rows as the worker writes them).
_COMPARED = {"prefill_rel_error": 0.011, "accelerator_loglik": -41.5, "reference_loglik": -40.9, "similarity": 0.93,
             "generated_text": "The river flows past", "reference_text": "The river flows by",
             "generated_token_ids": [464, 7850, 29, 1], "reference_token_ids": [464, 7850, 29, 2]}  # fmt: skip
SEED_ROWS = {
    "pass": (Verdict.PASS, {"tokens_match": True, "decode_tokens_per_s": 812.5, "ttft_p50_s": 0.02, "ttft_p99_s": 0.03,
                            "tpot_p50_s": 0.0012, "tpot_p99_s": 0.0019, "perf_iterations": 3, "perf_new_tokens": 32,
                            "perf_prompt_tokens": 12, "long_generation": "ok", "long_new_tokens": 256,
                            "long_agreement": [1.0, 0.98], "long_repetition": 0.1, "compile_cache": "hit"}),
    "sharded": (Verdict.PASS, {"parallelism": "tp", "visible_cores": "0-1", "rank_cores": "0@0,1@0",
                               "collective": "gloo", "judge_kind": "openai", "judge_answer": "same",
                               "judge_rationale": "both continue the sentence about the river", "first_divergence": 3,
                               "routing_margin": 0.2, **_COMPARED}),
    "fail": (Verdict.FAIL, {"verdict_reason": "diverged at token 3 and the log-likelihood dropped by 0.6",
                            "first_divergence": 3, "long_generation": "collapsed", "long_first_divergence": 40,
                            "long_reason": "repeats one token from step 120", **_COMPARED}),
    "embedding": (Verdict.PASS, {"similarity": 0.9991}),
}  # fmt: skip
# The classes a submission refuses (SKIPPED); every other class ends a row ERROR.
SKIPPED_CLASSES = {ErrorClass.too_large, ErrorClass.remote_code, ErrorClass.gated, ErrorClass.adapter,
                   ErrorClass.weights_format, ErrorClass.quantized, ErrorClass.unsupported_architecture}  # fmt: skip


def seed_every_outcome(session: Session, org: str = "seed") -> int:
    """Rows of every verdict and every error class, under two compiler versions and two library versions (so that
    diffs, histories and failure groups have something to compare), two tasks among them, and a sweep that ranks
    the newest runs in its views; returns how many rows."""
    ranked: dict[tuple[str, str], int] = {}  # (model, task): its newest job
    for compiler in ("2.21.0+seed-a", "2.22.0+seed-b"):
        for library in ("5.24.0", "5.30.0"):
            rt = runtime(compiler, library)
            for name, (verdict, fields) in SEED_ROWS.items():
                task = Task.feature_extraction.value if name == "embedding" else Task.text_generation.value
                ranked[f"{org}/{name}", task] = record(session, f"{org}/{name}", rt, verdict, task=task, **fields)
            for error in ErrorClass:
                verdict = Verdict.SKIPPED if error in SKIPPED_CLASSES else Verdict.ERROR
                message = f"{error.value}: seeded at {compiler} (RuntimeError: step 3 of 7 failed, NCC_EVRF009)"
                job_id = record(session, f"{org}/{error.value}", rt, verdict, error_class=error, error_message=message)
                ranked[f"{org}/{error.value}", Task.text_generation.value] = job_id
    sweep = Sweep(trigger="api", state=SweepState.done, config={}, submitted_by="seed")
    session.add(sweep)
    session.flush()
    for view in ("trending", "downloads"):
        for rank, ((model_id, task), job_id) in enumerate(sorted(ranked.items()), start=1):
            session.add(
                SweepEntry(sweep_id=sweep.id, model_id=model_id, task=task, view=view, rank=rank, job_id=job_id)
            )
    session.commit()
    return 4 * (len(SEED_ROWS) + len(ErrorClass))

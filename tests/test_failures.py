"""Failure signatures end to end: what the compiler refuses becomes ERROR(compile) with its reason named, every
ERROR and FAIL row gets a signature, and GET /failures reads forty failures of one cause as one line."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from services.runner.failures import RunFailure, phase
from services.runner.stages import failed
from shared.contracts.enums import ErrorClass, Stage, Verdict
from shared.contracts.report import RunReport
from shared.db.models import Job, Result
from shared.hub.client import ResolvedModel
from shared.jobs.lease import acquire_lease
from shared.jobs.outcomes import finish, job_report
from shared.jobs.submission import submit
from shared.settings import Settings
from tests.conftest import fresh_database
from tests.history import report_of, runtime

# --- what the compiler refuses -------------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def test_a_graph_break_under_fullgraph_is_a_compile_error_named_by_its_reason(fresh_dynamo: None) -> None:
    import torch

    def branch(x: Any) -> Any:
        if x.sum() > 0:  # data-dependent control flow: dynamo cannot trace it into one graph
            return x + 1
        return x - 1

    with pytest.raises(RunFailure) as info, phase(ErrorClass.compile):
        torch.compile(branch, backend="eager", fullgraph=True)(torch.ones(2))
    assert info.value.error_class == ErrorClass.compile
    first_line = info.value.message.splitlines()[0]
    assert first_line.startswith("Unsupported: graph break under fullgraph=True: Data-dependent branching (in ")
    assert first_line.endswith("test_failures.py:branch)")


def test_a_recompile_limit_hit_is_a_compile_error_with_the_guard_and_the_graphs_counted(fresh_dynamo: None) -> None:
    """Even in the second, runtime call: a recompile is the compiler's failure."""
    import torch

    def step(x: Any, n: int) -> Any:
        return x + n  # n is specialised: a new value fails the guard and compiles a new graph

    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=False)
    with pytest.raises(RunFailure) as info, phase(ErrorClass.runtime):
        for n in range(20):
            compiled(torch.ones(2), n)
    failure = info.value
    assert failure.error_class == ErrorClass.compile
    first_line = failure.message.splitlines()[0]
    assert first_line.startswith(
        "FailOnRecompileLimitHit: recompile limit hit: dynamo compiled 8 graphs (recompile_limit 8) for a guarded "
        "value that changes at every call, such as every decode step: n == 7 at "  # the guard, and its line
    )
    assert first_line.endswith(f"test_failures.py:{step.__code__.co_firstlineno + 1} in step")
    report = failed(report_of(model_id="org/m", task="text-generation", backend="cpu"), failure)
    signature = report.failure.failure_signature
    assert signature is not None and signature.startswith(
        "ERROR(compile): FailOnRecompileLimitHit: recompile limit hit: dynamo compiled <n> graphs"
    )
    assert signature.endswith(".py:<n> in step @ torch._dynamo.convert_frame:_compile")


def build_tiny_mistral(out: Path) -> Path:
    """A tiny Mistral with its config's default sliding window (4096, far beyond prompt + 32 tokens)."""
    import torch
    from transformers import GenerationConfig, MistralConfig, MistralForCausalLM

    from testing.tiny_models import VOCAB_SIZE, build_tokenizer

    tokenizer = build_tokenizer()
    config = MistralConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                           tie_word_embeddings=False)  # fmt: skip
    assert config.sliding_window == 4096
    torch.manual_seed(0)
    model = MistralForCausalLM(config)
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_mistrals_sliding_window_cache_recompiling_per_token_ends_in_a_compile_error(tmp_path: Path) -> None:
    """transformers' static sliding-window cache guards on a Python int (its cumulative length) that changes at
    every decode step, so dynamo recompiles per token until its limit: ERROR(compile), the reason named."""
    from tests.test_runner import run_local

    code, report = run_local(build_tiny_mistral(tmp_path / "tiny-mistral"))
    assert code == 3 and report.verdict == "ERROR", report
    assert report.failure.error_class == "compile", report.failure.error_message
    assert report.failure.error_message.startswith("accelerator: FailOnRecompileLimitHit: recompile limit hit: ")
    assert "cumulative_length_int == " in report.failure.error_message
    assert "at transformers/cache_utils.py:" in report.failure.error_message
    # a graph per decode step until dynamo's recompile limit (8), named in the message; a model compiling once: 2
    assert report.resources.graphs_compiled == 8 and "(recompile_limit 8)" in report.failure.error_message
    assert report.failure.failure_signature.startswith("ERROR(compile): FailOnRecompileLimitHit: recompile limit hit: ")
    assert report.failure.failure_signature.endswith(
        ": kwargs['cache'].layers[<n>].cumulative_length_int == <n> at transformers/cache_utils.py:<n> in update"
        " @ torch._dynamo.convert_frame:_compile"
    )
    assert len(report.failure.signature_id) == 16


# --- GET /failures -------------------------------------------------------------------------------------

OLD, NEW = "2.9.0", "2.10.0"  # ordered by their numbers: as text, "2.10.0" sorts first
RECOMPILE = (
    "FailOnRecompileLimitHit: recompile limit hit: dynamo compiled {n} graphs (recompile_limit 8) for a guarded "
    "value that changes at every call, such as every decode step: kwargs['cache'].layers[0].cumulative_length_int"
    " == {k} at transformers/cache_utils.py:566 in update\nHard failure due to fullgraph=True"
)
TRACE = """Traceback (most recent call last):
  File "/opt/venv/lib/python3.11/site-packages/torch/_dynamo/convert_frame.py", line 2031, in _compile
    raise FailOnRecompileLimitHit(
torch._dynamo.exc.FailOnRecompileLimitHit: Hard failure due to fullgraph=True
"""


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    """A migrated database of this test's own, so that the grouped view sees only the rows planted here."""
    with fresh_database(request.param, tmp_path) as engine:
        yield engine


def plant(session: Session, model: str, compiler: str, outcome: Any) -> None:
    """One finished job of ``model`` under ``compiler``, written by the job rules as a worker writes it;
    ``outcome`` makes its report from the job (the runner's, or the worker's own)."""
    resolved = ResolvedModel(model_id=model, sha="c" * 40, gated=False, pipeline_tag=None)
    [sub] = submit(session, resolved, None, [runtime(compiler, "5.24.0")], force=True)
    acquire_lease(session, sub.job.id, "w", Settings(), Stage.accelerator)
    assert finish(session, sub.job.id, "w", outcome(sub.job))
    session.commit()


def runner_error(rank: str, graphs: int) -> Any:
    """The runner's report of a recompile-limit hit on ``rank``, through the runner's own failed()."""

    def report(job: Job) -> RunReport:
        failure = RunFailure(ErrorClass.compile, f"{rank}: " + RECOMPILE.format(n=graphs, k=graphs + 9), TRACE,
                             origin=rank, graphs_compiled=graphs)  # fmt: skip
        return failed(report_of(model_id=job.model_id, task=job.task, backend="neuron", cores=1), failure)

    return report


def fail(gap: float) -> Any:
    return lambda job: report_of(model_id=job.model_id, task=job.task, backend="neuron", verdict=Verdict.FAIL,
                                 verdict_reason=f"prefill logits differ from the reference by {gap:.3g} "
                                 "(relative; tolerance 0.05)")  # fmt: skip


def timeout(limit_s: int) -> Any:
    """The worker's own report: it killed the runner, which wrote nothing."""
    message = f"runner exceeded its stage's {limit_s} s limit in the compile phase and was killed"
    return lambda job: job_report(job, Verdict.ERROR, ErrorClass.timeout, message)


def passed(job: Job) -> RunReport:
    return report_of(model_id=job.model_id, task=job.task, backend="neuron", verdict=Verdict.PASS)


RECOMPILE_SIGNATURE = (
    "ERROR(compile): FailOnRecompileLimitHit: recompile limit hit: dynamo compiled <n> graphs (recompile_limit <n>) "
    "for a guarded value that changes at every call, such as every decode step: "
    "kwargs['cache'].layers[<n>].cumulative_length_int == <n> at transformers/cache_utils.py:<n> in update"
    " @ torch._dynamo.convert_frame:_compile"
)
FAIL_SIGNATURE = "FAIL: prefill logits differ from the reference by <n> (relative; tolerance <n>)"
TIMEOUT_SIGNATURE = "ERROR(timeout): runner exceeded its stage's <n> s limit in the compile phase and was killed"


@pytest.fixture
def api(database: sa.Engine) -> Iterator[TestClient]:
    """The API reading ``database``."""
    from services.api.deps import get_session
    from services.api.main import app

    def session() -> Iterator[Session]:
        with Session(database) as s:
            yield s

    app.dependency_overrides[get_session] = session
    yield TestClient(app)
    app.dependency_overrides.pop(get_session, None)


def test_failures_of_three_kinds_are_grouped_by_signature_across_two_compiler_versions(
    database: sa.Engine, api: TestClient
) -> None:
    with Session(database, expire_on_commit=False) as session:
        plant(session, "org/c", NEW, runner_error("accelerator", 8))  # first seen, under the newer version
        plant(session, "org/a", OLD, runner_error("accelerator", 8))
        plant(session, "org/b", OLD, runner_error("accelerator.rank1", 9))  # a sharded run's rank
        plant(session, "org/f", OLD, timeout(600))
        plant(session, "org/d", NEW, fail(0.0712))
        plant(session, "org/e", NEW, fail(3.5))
        plant(session, "org/g", NEW, passed)
        plant(session, "org/d", NEW, fail(0.25))  # a rerun: counted again, one example
        rows = [r for _, r in session.execute(sa.select(Job.id, Result).join(Result.job).order_by(Result.id))]
    assert [r.graphs_compiled for r in rows[:3]] == [8, 8, 9]
    assert rows[6].verdict == Verdict.PASS and (rows[6].failure_signature, rows[6].signature_id) == (None, None)
    c, a, b, f, d, _, _, d_again = (r.created_at.replace(tzinfo=None) for r in rows)

    def view(**params: str) -> list[dict[str, Any]]:
        response = api.get("/failures", params=params)
        assert response.status_code == 200, response.text
        items = response.json()["items"]
        for item in items:
            assert len(item.pop("signature_id")) == 16
            for key in ("first_seen", "last_seen"):
                item[key] = dt.datetime.fromisoformat(item[key]).replace(tzinfo=None)
        return items

    # Most rows first; of two as many, the one seen last first.
    assert view() == [
        {"signature": FAIL_SIGNATURE, "verdict": "FAIL", "error_class": None, "count": 3, "first_seen": d,
         "last_seen": d_again, "compiler_versions": [NEW], "example_models": ["org/d", "org/e"], "new_in": NEW,
         "new": None},
        {"signature": RECOMPILE_SIGNATURE, "verdict": "ERROR", "error_class": "compile", "count": 3,
         "first_seen": c, "last_seen": b, "compiler_versions": [OLD, NEW],
         "example_models": ["org/b", "org/a", "org/c"], "new_in": OLD, "new": None},
        {"signature": TIMEOUT_SIGNATURE, "verdict": "ERROR", "error_class": "timeout", "count": 1, "first_seen": f,
         "last_seen": f, "compiler_versions": [OLD], "example_models": ["org/f"], "new_in": OLD, "new": None},
    ]  # fmt: skip
    # Under the newer version: counted there; the recompile limit was already hit under the older one.
    assert [(g["signature"], g["count"], g["first_seen"], g["last_seen"], g["example_models"], g["new"])
            for g in view(compiler=NEW)] == [
        (FAIL_SIGNATURE, 3, d, d_again, ["org/d", "org/e"], True),
        (RECOMPILE_SIGNATURE, 1, c, c, ["org/c"], False),
    ]  # fmt: skip
    assert [(g["signature"], g["count"], g["first_seen"], g["last_seen"], g["example_models"], g["new"])
            for g in view(compiler=OLD)] == [
        (RECOMPILE_SIGNATURE, 2, a, b, ["org/b", "org/a"], True),
        (TIMEOUT_SIGNATURE, 1, f, f, ["org/f"], True),
    ]  # fmt: skip
    assert view(task="feature-extraction") == [] and len(view(task="text-generation")) == 3
    assert [g["signature"] for g in view(limit="1")] == [FAIL_SIGNATURE]
    assert api.get("/failures", params={"compiler": "no spaces"}).status_code == 422

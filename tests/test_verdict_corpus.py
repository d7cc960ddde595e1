"""The test's identity is everything that can change a verdict: the rule's logic by its version (a golden corpus of
evidence cases), and the settings that decide a verdict by the job's config_hash (each setting classified once)."""

from __future__ import annotations

from enum import Enum
from typing import Any, get_args

import pytest
from sqlalchemy.orm import Session

from shared.contracts.enums import Task
from shared.db.models import Job
from shared.hub.client import ResolvedModel
from shared.jobs.lease import refuse_other_test
from shared.jobs.submission import submit
from shared.settings import VERDICT_SETTINGS, Settings, setting_role
from shared.testconfig import config_hash, planned_config_hash, verdict_settings
from tasks.text_generation import VERDICT_RULE_VERSION
from tests.history import runtime
from tests.verdict_corpus import load, written_now

REGENERATE = "python -m tests.verdict_corpus"


def test_the_rule_decides_every_case_of_its_golden_corpus_as_under_its_version() -> None:
    corpus = load()
    assert corpus.rule == VERDICT_RULE_VERSION, (
        f"VERDICT_RULE_VERSION is {VERDICT_RULE_VERSION}, the corpus was decided under {corpus.rule}: write it anew "
        f"({REGENERATE}) and read the outcomes that moved in its diff"
    )
    moved = [
        f"{case.dtype}: {case.name}: {(case.verdict, case.first_divergence)} -> {now}"
        for case in corpus.decide
        if (now := case.decided(corpus.tolerances_of(case))) != (case.verdict, case.first_divergence)
    ] + [
        f"long: {case.name}: {(case.outcome, case.first_divergence)} -> {now}"
        for case in corpus.long
        if (now := case.decided()) != (case.outcome, case.first_divergence)
    ]
    assert moved == [], (
        f"{len(moved)} cases decide otherwise under the same VERDICT_RULE_VERSION {VERDICT_RULE_VERSION}: the rule's "
        f"logic changed, so rows decided before are another test; raise the version and run {REGENERATE}: {moved[:5]}"
    )
    # The grid is the one the corpus was written from (a case added to the grid is not silently left out of it)
    assert [(case.dtype, case.name) for case in written_now().decide] == [
        (case.dtype, case.name) for case in corpus.decide
    ]
    # and reaches every outcome of both rules
    assert {case.verdict for case in corpus.decide} == {"PASS", "FAIL"}
    assert {case.outcome for case in corpus.long} == {"ok", "diverged", "collapsed", "non-finite"}


def test_every_setting_is_classified_once_by_what_it_can_change() -> None:
    unclassified = [name for name in Settings.model_fields if setting_role(name) is None]
    assert unclassified == [], f"mark these settings with a role of shared.settings.SettingRole: {unclassified}"
    assert set(VERDICT_SETTINGS) == {"judge_kind", "judge_model", "judge_loglik_slack", "moe_parallelism"}


def _changed(name: str) -> Any:
    """Another valid value of setting ``name``."""
    field = Settings.model_fields[name]
    default = field.get_default(call_default_factory=True)
    annotation = field.annotation
    enum = annotation if isinstance(annotation, type) and issubclass(annotation, Enum) else None
    choices = list(enum) if enum else [choice for choice in get_args(annotation) if isinstance(choice, str)]
    if choices:
        return next(choice for choice in choices if choice != default)
    return default + 1 if isinstance(default, float | int) else f"{default}-other"


@pytest.mark.parametrize("name", VERDICT_SETTINGS)
def test_a_setting_that_decides_a_verdict_makes_a_sharded_text_generation_job_another_test(name: str) -> None:
    base, other = Settings(), Settings(**{name: _changed(name)})
    task = Task.text_generation.value
    assert config_hash(task, verdict_settings(other, task, 2)) != config_hash(task, verdict_settings(base, task, 2))
    # A run that reads none of them keeps its test's hash: an unsharded one, another task's, a CPU reference's key
    for task, cores in [(Task.text_generation.value, 1), (Task.feature_extraction.value, 2)]:
        assert config_hash(task, verdict_settings(other, task, cores)) == config_hash(task)
    # A worker runs only the test a job was planned as: not a sharded job planned under another value (and it says
    # which values it holds); an unsharded one, which reads none of them, it runs
    task = Task.text_generation.value
    sharded = Job(id=7, task=task, cores=2, config_hash=planned_config_hash(task, 2, base))
    assert refuse_other_test(sharded, base) is None
    refused = refuse_other_test(sharded, other)
    assert refused is not None and f"{name}={getattr(other, name)}" in refused and sharded.config_hash in refused
    unsharded = Job(id=8, task=task, cores=1, config_hash=planned_config_hash(task, 1, base))
    assert refuse_other_test(unsharded, other) is None


def test_another_judge_is_another_test_for_a_sharded_job_and_the_same_for_an_unsharded_one(
    session: Session, planned_with: Any
) -> None:
    model = ResolvedModel(model_id="org/judged", sha="a" * 40, gated=False, pipeline_tag=None)
    rt = runtime("2.21.0+x", "5.24.0")
    planned_with(SUPPORTMATRIX_JUDGE_KIND="likelihood")
    [sharded], [unsharded] = submit(session, model, None, [rt], cores=2), submit(session, model, None, [rt], cores=1)
    planned_with(SUPPORTMATRIX_JUDGE_KIND="local")
    [sharded_again], [unsharded_again] = (
        submit(session, model, None, [rt], cores=2),
        submit(session, model, None, [rt], cores=1),
    )
    assert sharded_again.created and sharded_again.job.id != sharded.job.id
    assert sharded_again.job.config_hash != sharded.job.config_hash
    assert not unsharded_again.created and unsharded_again.job.id == unsharded.job.id

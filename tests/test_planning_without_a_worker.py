"""With no worker live and no queue seen with its stack (a fresh install), a neuron job's stack cannot be known where
the API runs (the cpu image: no TorchNeuron, no Neuron runtime): it is refused with the reason, never planned for a
guessed stack whose queue no worker consumes (which would end ERROR(no_worker) minutes later)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.contracts.enums import Scope
from shared.db.models import Job
from shared.installed import installed_version
from shared.jobs.queues import job_queue
from shared.jobs.reconcile import mark_queue_live
from shared.jobs.runtimes import NoRuntime, default_runtime, plan_runtimes
from shared.settings import get_settings
from tests.conftest import fresh_database
from tests.test_stack_identity import NEURON

COMPILER = NEURON.compiler_version


@pytest.fixture
def neuron_settings(tmp_path: Path) -> Any:
    assert installed_version("torch-neuronx") is None, "this test is about an API without TorchNeuron"
    return get_settings().model_copy(update={"backend": "neuron", "default_compiler": COMPILER, "data_dir": tmp_path})


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_neuron_stack_the_api_cannot_know_is_refused_not_guessed(
    kind: str, tmp_path: Path, neuron_settings: Any
) -> None:
    with pytest.raises(NoRuntime, match=r"cannot know the stack of neuronx-cc 2\.28\.7631\.0 \(torch-neuronx"):
        default_runtime(neuron_settings)
    with fresh_database(kind, tmp_path) as engine, Session(engine) as session:
        with pytest.raises(NoRuntime, match="start one worker of the fleet's image once"):
            plan_runtimes(session, neuron_settings, None)
        # once a worker of the image was seen with its stack, that stack is planned (what it serves again)
        mark_queue_live(session, job_queue("neuron", NEURON.stack(), 1), runtime=NEURON)
        session.flush()
        assert plan_runtimes(session, neuron_settings, None) == [NEURON]


@pytest.fixture
def fresh_api(tmp_path: Path, neuron_settings: Any, hub: Any) -> Iterator[tuple[Any, Any]]:
    """The API on a fresh database of its own (no worker ever seen), as a neuron deployment's cpu-image API."""
    from fastapi.testclient import TestClient

    from services.api import deps
    from services.api.main import app
    from shared.auth.tokens import create_token

    with fresh_database("sqlite", tmp_path) as engine:
        with Session(engine) as session:
            token = create_token(session, "fresh-admin", Scope.admin)
            session.commit()

        async def fresh_session() -> AsyncIterator[Session]:
            with Session(engine) as session:
                yield session

        async def settings() -> Any:
            return neuron_settings

        app.dependency_overrides[deps.get_session] = fresh_session
        app.dependency_overrides[deps.current_settings] = settings
        try:
            with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
                yield client, engine
        finally:
            app.dependency_overrides.clear()


def test_post_jobs_says_why_no_neuron_stack_can_be_planned(fresh_api: tuple[Any, Any]) -> None:
    client, engine = fresh_api
    response = client.post("/jobs", json={"model_id": "org/tiny-llama"})
    assert response.status_code == 503, response.text
    detail = response.json()["detail"]
    assert "cannot know the stack of neuronx-cc" in detail and "start one worker" in detail
    with Session(engine) as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(Job)) == 0  # nothing planned, nothing queued

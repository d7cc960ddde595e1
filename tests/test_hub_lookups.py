"""A slow Hub cannot take the API's threads: submissions wait on it in a bounded pool of their own, every Hub
call the API makes has a short timeout, and model_info answers are cached per (model, revision)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import anyio.to_thread
import pytest

from services.api.deps import get_hub_pool
from services.api.hub_pool import HubPool, PoolBusy
from shared.hub import client as hub_client
from shared.settings import get_settings


def test_the_pool_runs_at_most_its_size_outside_the_shared_threads_and_refuses_after_waiting() -> None:
    release = threading.Event()
    running: list[int] = []

    def slow_hub() -> int:
        running.append(1)
        release.wait(10)
        return 7

    async def scenario() -> None:
        pool = HubPool(size=2, wait_s=0.3)
        results: list[int] = []

        async def submit() -> None:
            results.append(await pool.run(slow_hub))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(submit)
            tasks.start_soon(submit)
            while len(running) < 2:
                await anyio.sleep(0.01)
            # Both slots hold a thread, and none of the shared pool's, which sync routes still get at once.
            assert anyio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
            assert await anyio.to_thread.run_sync(lambda: "read") == "read"
            started = time.monotonic()
            with pytest.raises(PoolBusy):
                await pool.run(slow_hub)
            assert 0.25 < time.monotonic() - started < 2 and len(running) == 2
            release.set()
        assert results == [7, 7]
        assert await pool.run(lambda: 8) == 8  # the slots came back

    anyio.run(scenario)


@pytest.fixture
def one_slot_pool(api: Any) -> Iterator[HubPool]:
    pool = HubPool(size=1, wait_s=0.3)
    api.app.dependency_overrides[get_hub_pool] = lambda: pool
    yield pool
    api.app.dependency_overrides.pop(get_hub_pool, None)


def test_a_submission_stuck_on_the_hub_leaves_reads_answering_and_the_next_one_gets_503(
    api: Any, one_slot_pool: HubPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()

    def stuck_hub(*args: Any) -> Any:
        entered.set()
        release.wait(10)
        raise hub_client.ModelNotFound("gave up")

    monkeypatch.setattr("services.api.routes.jobs.submit_model", stuck_hub)
    with ThreadPoolExecutor(1) as background:
        first = background.submit(api.post, "/jobs", json={"model_id": "org/slow-one"})
        assert entered.wait(10)
        started = time.monotonic()
        assert api.get("/jobs", params={"limit": 1}).status_code == 200
        assert time.monotonic() - started < 2
        second = api.post("/jobs", json={"model_id": "org/slow-two"})
        assert second.status_code == 503 and int(second.headers["retry-after"]) > 0
        assert "waiting on the Hub" in second.json()["detail"]
        release.set()
        assert first.result(10).status_code == 404


def test_model_info_is_cached_per_model_and_revision(hub: Any) -> None:
    model = hub_client.resolve_model("org/tiny-llama")
    assert hub_client.resolve_model("org/tiny-llama") is model
    assert hub_client.resolve_model("org/tiny-llama", "main") is not model
    assert hub_client.resolve_model("org/tiny-qwen3").model_id == "org/tiny-qwen3"
    with pytest.raises(hub_client.ModelNotFound):  # refusals are not cached: the repo may appear
        hub_client.resolve_model("org/not-yet-there")


@pytest.fixture
def silent_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A Hub that accepts connections and never answers."""
    from huggingface_hub import constants

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", url)
    yield url
    listener.close()


def test_a_hub_that_never_answers_costs_a_lookup_its_timeout(silent_hub: str) -> None:
    started = time.monotonic()
    with pytest.raises(hub_client.HubUnavailable):
        hub_client.resolve_model("org/silent-model", timeout_s=0.5)
    assert time.monotonic() - started < 5


def test_the_apis_hub_client_gives_every_request_a_timeout(api: Any) -> None:
    """Calls that take no timeout argument (get_paths_info) use the shared client, bounded at API start."""
    from huggingface_hub import get_session

    assert get_session().timeout.read == get_settings().hub_timeout_s


def test_a_revision_the_hub_cannot_route_is_not_found_rather_than_the_hub_down(hub: Any) -> None:
    """Found by the fuzzer: a '/' in a revision gets a bare 404, which once read as "Hub unavailable" (503)."""
    with pytest.raises(hub_client.RevisionNotFound):
        hub_client.resolve_model("org/tiny-llama", "no/such/branch")

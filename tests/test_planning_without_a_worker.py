"""Planning with no worker live. A fleet declared in the configuration the API and the launchers share
(SUPPORTMATRIX_FLEET_RUNTIME) is planned for whoever is up, on the queue its launchers consume, and a launcher of
another stack does not start. Undeclared, with no queue seen with its stack (a fresh install), a neuron job's stack
cannot be known where the API runs (the cpu image: no TorchNeuron, no Neuron runtime): it is refused with the reason,
never planned for a guessed stack whose queue no worker consumes (which would end ERROR(no_worker) minutes later)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
import yaml
from sqlalchemy.orm import Session

from services.worker import host
from services.worker.__main__ import describe_runtime
from shared.contracts.enums import Scope
from shared.contracts.run import RuntimeInfo, stack_of
from shared.db.models import Job
from shared.installed import installed_version
from shared.jobs.queues import job_queue
from shared.jobs.reconcile import mark_queue_live
from shared.jobs.runtimes import NoRuntime, default_runtime, plan_runtimes, refuse_other_fleet
from shared.settings import Settings, get_settings
from tests.conftest import RUN_DIR, fresh_database
from tests.test_kubernetes import IMAGE_COMPILER, KUBE, OVERLAYS, WORKLOADS, kubectl, pod_spec
from tests.test_kubernetes import component as component_of
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


@contextlib.contextmanager
def api_on(engine: Any, api_settings: Settings) -> Iterator[Any]:
    """The API (a test client with an admin token) on ``engine``'s database, reading ``api_settings``."""
    from fastapi.testclient import TestClient

    from services.api import deps
    from services.api.main import app
    from shared.auth.tokens import create_token

    with Session(engine) as session:
        token = create_token(session, "fresh-admin", Scope.admin)
        session.commit()

    async def fresh_session() -> AsyncIterator[Session]:
        with Session(engine) as session:
            yield session

    async def settings() -> Settings:
        return api_settings

    app.dependency_overrides[deps.get_session] = fresh_session
    app.dependency_overrides[deps.current_settings] = settings
    try:
        with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
            yield client
    finally:
        app.dependency_overrides.clear()


@pytest.fixture
def fresh_api(tmp_path: Path, neuron_settings: Any, hub: Any) -> Iterator[tuple[Any, Any]]:
    """The API on a fresh database of its own (no worker ever seen), as a neuron deployment's cpu-image API."""
    with fresh_database("sqlite", tmp_path) as engine, api_on(engine, neuron_settings) as client:
        yield client, engine


def test_post_jobs_says_why_no_neuron_stack_can_be_planned(fresh_api: tuple[Any, Any]) -> None:
    client, engine = fresh_api
    response = client.post("/jobs", json={"model_id": "org/tiny-llama"})
    assert response.status_code == 503, response.text
    detail = response.json()["detail"]
    assert "cannot know the stack of neuronx-cc" in detail and "SUPPORTMATRIX_FLEET_RUNTIME" in detail
    with Session(engine) as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(Job)) == 0  # nothing planned, nothing queued


# A fleet of the neuron image's compiler, as `python -m services.worker --describe` prints its runtime.
FLEET = RuntimeInfo(
    backend="neuron", compiler_name="neuronx-cc", compiler_version=IMAGE_COMPILER,
    compiler_build=f"{IMAGE_COMPILER}+a1b2c3d4",
    library_version="5.24.0", torch_version="2.13.0", torch_neuronx_version="2.13.3.0.1",
    neuron_runtime_version="2.35.30.0",
)  # fmt: skip
# Where this machine's runtime is described once (a runner child's answer, kept as a worker keeps it) for the tests.
DESCRIBED = RUN_DIR / "planning-described"


def rendered_with(overlay: str, tmp_path: Path, config: dict[str, str]) -> list[dict[str, Any]]:
    """``overlay`` rendered as an operator's overlay of it renders: ``config`` merged into its ConfigMap, in both
    namespaces (docs/kubernetes.md, step 2)."""
    mine = tmp_path / "overlay"
    mine.mkdir()
    literals = "".join(f"      - {json.dumps(f'{name}={value}')}\n" for name, value in config.items())
    merged = "configMapGenerator:\n" + "".join(
        f"  - name: supportmatrix-config\n    namespace: {namespace}\n    behavior: merge\n    literals:\n{literals}"
        for namespace in ("supportmatrix", "supportmatrix-launchers")
    )
    (mine / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n"
        f"  - {os.path.relpath(KUBE / 'overlays' / overlay, mine)}\n" + (merged if config else "")
    )
    out = subprocess.run([kubectl(), "kustomize", str(mine)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def pod_environment(docs: list[dict[str, Any]], component: str) -> dict[str, str]:
    """The SUPPORTMATRIX_ variables a pod of ``component`` (api, host-launcher) of rendered ``docs`` reads: its
    ConfigMap's, then its container's own values."""
    [workload] = [d for d in docs if d["kind"] in WORKLOADS and component_of(d) == component]
    [box] = pod_spec(workload)["containers"]
    maps = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"
    }
    found: dict[str, str] = {}
    for source in box.get("envFrom", []):  # its namespace's: a pod reads no other
        found |= maps.get((workload["metadata"]["namespace"], source.get("configMapRef", {}).get("name")), {})
    found |= {e["name"]: e["value"] for e in box.get("env", []) if "value" in e}
    return {name: value for name, value in found.items() if name.startswith("SUPPORTMATRIX_")}


def settings_of(environment: dict[str, str], monkeypatch: pytest.MonkeyPatch, **here: Any) -> Settings:
    """The settings a process with ``environment`` reads, on this machine's directories and database (``here``)."""
    with monkeypatch.context() as only_here:
        for name, value in environment.items():
            only_here.setenv(name, value)
        return Settings().model_copy(update=here)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_under_each_overlays_environment_a_job_with_no_worker_live_lands_on_the_queue_its_fleet_consumes(
    overlay: str, tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each overlay as an operator applies it — a trn2 one with the fleet declared as docs/kubernetes.md says
    (SUPPORTMATRIX_FLEET_RUNTIME, as `python -m services.worker --describe` prints it on the fleet's image), cpu-dev
    as shipped (its API and launchers are one image) — an API pod's environment, on the cpu image (no TorchNeuron
    here), with no worker live and none ever seen, plans a submitted job for the fleet's stack: on exactly the queue
    the fleet's launchers consume, whose Redis list holds the job (a trn2 fleet's: no worker here takes it), and
    whose cores the overlay's KEDA trigger counts (its query run on PostgreSQL) where the overlay scales on one."""
    declared = {}
    if overlay != "cpu-dev":
        declared = {"SUPPORTMATRIX_FLEET_RUNTIME": FLEET.model_dump_json()}
    docs = rendered_with(overlay, tmp_path, declared)
    here = {"data_dir": DESCRIBED, "export_dir": tmp_path / "export", "cache_dir": tmp_path / "cache"}
    # what the fleet's launchers serve: the declared runtime, or (cpu-dev) what a launcher of this image describes
    launcher_settings = settings_of(pod_environment(docs, "host-launcher"), monkeypatch, **here)
    fleet = launcher_settings.fleet_runtime or describe_runtime(launcher_settings)
    assert refuse_other_fleet(launcher_settings, fleet) is None
    with fresh_database("postgresql", tmp_path) as engine:
        url = engine.url.render_as_string(False)
        api_settings = settings_of(pod_environment(docs, "api"), monkeypatch, **here, database_url=url)
        assert api_settings.backend == "cpu"  # the API's own packages are the cpu image's
        with api_on(engine, api_settings) as client:
            response = client.post("/jobs", json={"model_id": "org/tiny-llama"})
            assert response.status_code == 202, response.text
        with Session(engine) as session:
            [job] = session.scalars(sa.select(Job)).all()
            assert job.queue == job_queue(fleet.backend, fleet.stack(), 1) and stack_of(job) == fleet.stack()
            triggers = [t for d in docs if d["kind"] == "ScaledJob" for t in d["spec"]["triggers"]]
            counted = {t["name"]: session.scalar(sa.text(t["metadata"]["query"])) for t in triggers}
        if overlay == "trn2-autoscaled":
            assert job.compiler_version == IMAGE_COMPILER
            assert counted == {"cores-wanted": 1}  # the one 1-core job's core
        else:
            assert not triggers
        if overlay == "cpu-dev":
            return  # its queue is the suite's own cpu workers' too: one of them may have taken the job already
        broker = redis.Redis.from_url(os.environ["SUPPORTMATRIX_REDIS_URL"])
        try:
            assert broker.llen(job.queue) == 1
        finally:
            broker.delete(job.queue)


def test_a_host_launcher_serving_another_stack_than_the_declared_fleets_does_not_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """This machine's launcher serves its cpu stack, not a declared neuron fleet's: it does not start, and prints the
    line that would declare its own, which, declared, it serves."""
    monkeypatch.setenv("SUPPORTMATRIX_DATA_DIR", str(DESCRIBED))
    monkeypatch.setenv("SUPPORTMATRIX_FLEET_RUNTIME", FLEET.model_dump_json())
    get_settings.cache_clear()
    try:
        assert host.main([]) == 2
        refused = capsys.readouterr().out
        assert "not started: this host serves compiler " in refused and "SUPPORTMATRIX_FLEET_RUNTIME" in refused
        monkeypatch.setenv("SUPPORTMATRIX_FLEET_RUNTIME", refused.rsplit("prints it: ", 1)[1].strip())
        get_settings.cache_clear()
        assert refuse_other_fleet(get_settings(), describe_runtime(get_settings())) is None
    finally:
        get_settings.cache_clear()

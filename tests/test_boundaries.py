"""The lines the design never crosses: the API and the worker process never import torch, the runner or a task's
torch half (only its declaration); the runner never imports a database or broker client; a runner's environment
holds no secret it is not given."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, runner_paths


@pytest.mark.parametrize("module", ["services.api.main", "services.worker.tasks", "services.worker.__main__"])
def test_services_do_not_import_torch_or_the_runner(module: str) -> None:
    code = (
        f"import importlib, sys; importlib.import_module({module!r}); "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers', "
        "'services.runner')) or (m.startswith('tasks.') and m.count('.') > 1)); print(bad); "
        "sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# The floors of shared/, ground first: a module imports only from its own floor or below. The contracts are pure
# records; settings and the per-machine facts build on them; then the database schema and the Hub; then the rules
# on results and tokens; the job rules on top.
FLOORS = [
    {"shared.contracts"},
    {"shared.settings", "shared.installed", "shared.cores", "shared.processes",
     "shared.zygote_client", "shared.isolation"},
    {"shared.db", "shared.hub"},
    {"tasks"},  # the tasks' declarations (tasks/<name>/__init__.py); their torch halves are the runner's
    {"shared.testconfig", "shared.auth", "shared.results"},
    {"shared.jobs"},
]  # fmt: skip


def _floor(module: str) -> int:
    """The floor of ``shared.x.y``: that of its package ``shared.x``; of a task's declaration, the tasks'."""
    package = "tasks" if module.split(".")[0] == "tasks" else ".".join(module.split(".")[:2])
    [floor] = [i for i, rooms in enumerate(FLOORS) if package in rooms]
    return floor


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_no_module_of_shared_imports_one_from_a_floor_above_and_the_contracts_import_nothing() -> None:
    declarations = [
        ROOT / "tasks" / "__init__.py",
        ROOT / "tasks" / "declaration.py",
        *ROOT.glob("tasks/*/__init__.py"),
    ]
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in [*(ROOT / "shared").rglob("*.py"), *declarations]
    }
    halves = tuple(
        ".".join(p.relative_to(ROOT).with_suffix("").parts) for p in runner_paths() if p.parts[-3] == "tasks"
    )
    upward, contracts = [], []
    for module, path in sorted(modules.items()):
        for imported in sorted(m for m in _imports(path) if m in modules):
            if module.startswith("shared.contracts") and not imported.startswith("shared.contracts"):
                contracts.append(f"{module} imports {imported}")
            elif _floor(imported) > _floor(module):
                upward.append(f"{module} imports {imported}")
        for imported in _imports(path):
            # a declaration (or shared/) imports no torch half: tasks.<name>.runner is the runner's to import
            assert not imported.startswith(halves), (module, imported)
            if module.startswith("shared.contracts"):
                assert imported.split(".")[0] not in ("services", "testing", "sqlalchemy", "pyarrow"), (
                    module,
                    imported,
                )
    assert contracts == [] and upward == []
    assert all(m in modules for m in ("shared.contracts.report", "shared.jobs.outcomes", "shared.db.models", "tasks"))


def test_shared_imports_nothing_from_services() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "shared").rglob("*.py")
        if "from services" in path.read_text() or "import services" in path.read_text()
    ]
    assert offenders == []


def test_the_runner_never_imports_a_database_a_broker_or_the_worker() -> None:
    """The runner is a pure child: every module of it (each task's torch half too), imported, pulls in no SQL, Celery
    or Redis client."""
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for path in runner_paths()
    )
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'celery', 'redis', 'kombu', "
        "'psycopg') or m.startswith('services.worker')); print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "services.runner.stages" in modules and "tasks.text_generation.runner" in modules and len(modules) > 15


SECRETS = {
    "database_url": "postgresql+psycopg://admin:db-secret@db/prod",
    "redis_url": "redis://:redis-secret@redis:6379/0",
    "publish_token": "hf_publish_secret",
    "judge_token": "judge-secret",
    "compile_cache_token": "hf_cache_write_secret",
}


def test_a_child_environment_holds_only_the_secrets_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.settings import Settings, child_environment

    monkeypatch.setenv("HF_TOKEN", "hf_read_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    settings = Settings(**SECRETS, compile_cache_remote="/shared/cache")  # type: ignore[arg-type]
    env = child_environment(settings, {"NEURON_RT_VISIBLE_CORES": "0-3"})
    text = "\n".join(f"{k}={v}" for k, v in env.items())
    for secret in [*SECRETS.values(), "hf_read_secret", "aws-secret"]:
        assert secret not in text
    assert env["NEURON_RT_VISIBLE_CORES"] == "0-3" and env["SUPPORTMATRIX_COMPILE_CACHE_REMOTE"] == "/shared/cache"
    assert env["HF_ENDPOINT"] == os.environ["HF_ENDPOINT"]  # the Hub (stand-in) it downloads from
    judged = child_environment(settings, {}, {"SUPPORTMATRIX_JUDGE_TOKEN": settings.judge_token or ""})
    assert judged["SUPPORTMATRIX_JUDGE_TOKEN"] == "judge-secret" and "SUPPORTMATRIX_DATABASE_URL" not in judged
    assert env["HF_TOKEN_PATH"].endswith("no-hub-token")  # not a token saved under HF_HOME either


def test_an_accelerator_stage_gets_the_hub_token_only_when_gated_and_no_cache_token_for_repo_code() -> None:
    from services.worker.tasks import accelerator_secrets
    from shared.db.models import Job
    from shared.settings import Settings

    settings = Settings(compile_cache_token="hf_cache_write_secret")
    plain, gated, coded = Job(gated=False, trust_remote_code=False), Job(gated=True), Job(trust_remote_code=True)
    assert accelerator_secrets(plain, settings, "hf_read") == {
        "SUPPORTMATRIX_COMPILE_CACHE_TOKEN": "hf_cache_write_secret"
    }
    assert accelerator_secrets(gated, settings, "hf_read")["HF_TOKEN"] == "hf_read"
    assert accelerator_secrets(coded, settings, "hf_read") == {}  # a repo's own code never holds the cache token
    assert accelerator_secrets(gated, Settings(), None) == {}

"""The lines the design never crosses: the API and the worker process never import torch or the runner; the
runner never imports a database or broker client; a runner's environment holds no secret it is not given."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("module", ["services.api.main", "services.worker.tasks", "services.worker.__main__"])
def test_services_do_not_import_torch_or_the_runner(module: str) -> None:
    code = (
        f"import importlib, sys; importlib.import_module({module!r}); "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers', "
        "'services.runner'))); print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shared_imports_nothing_from_services() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "shared").rglob("*.py")
        if "from services" in path.read_text() or "import services" in path.read_text()
    ]
    assert offenders == []


def test_the_runner_never_imports_a_database_a_broker_or_the_worker() -> None:
    """The runner is a pure child: every module of it, imported, pulls in no SQL, Celery or Redis client."""
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in (ROOT / "services" / "runner").rglob("*.py")
    )
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'celery', 'redis', 'kombu', "
        "'psycopg') or m.startswith('services.worker')); print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "services.runner.stages" in modules and len(modules) > 15


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


def test_the_readmes_layout_table_matches_the_tree() -> None:
    """Every path the layout table names exists, and every package of services/ and shared/ is named."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("### Layout") : text.index("### How a job runs")]
    named = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    assert named and [p for p in named if not (ROOT / p).exists()] == []
    packages = [
        f"{path.parent.relative_to(ROOT).as_posix()}/"
        for top in ("services", "shared")
        for path in (ROOT / top).glob("*/__init__.py")
    ]
    assert sorted(p for p in packages if p not in named) == []

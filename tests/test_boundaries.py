"""The lines the design never crosses: the API and the worker process never import torch or the runner."""

from __future__ import annotations

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

"""One runner child process: `python -m services.runner.child SPEC.json`.

Runs one role (the CPU reference, the accelerator run, or describe) and writes its outcome as JSON to the
path the spec names: data on success, or an error class, message and traceback. A crash leaves no file,
which the launcher reports with the exit signal.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from services.runner.backends import Backend, get_backend
from services.runner.compile_cache import local_cache_dir, namespace, remote_for
from services.runner.failures import RunFailure
from services.runner.tasks import get_task
from shared.enums import ErrorClass
from shared.settings import get_settings


class SharedCompileCache:
    """The local compile cache of an accelerator rank, pulled from the configured remote before the run
    (rank 0 only) and pushed to it after, when pushing is configured."""

    def __init__(self, backend: Backend, compiler_name: str, compiler_version: str, rank: int) -> None:
        settings = backend.settings
        self.local = local_cache_dir(settings.cache_path, backend.name)
        self.remote = None
        if settings.compile_cache_remote and rank == 0:
            ns = namespace(compiler_name, compiler_version)
            self.remote = remote_for(settings.compile_cache_remote, ns, settings.compile_cache_token)
            self.remote.pull(self.local)
        self.push_allowed = settings.compile_cache_push
        self.before = self._count()

    def _count(self) -> int:
        return sum(1 for p in self.local.rglob("*") if p.is_file()) if self.local.exists() else 0

    def new_entries(self) -> int:
        return self._count() - self.before

    def push(self) -> None:
        if self.remote is not None and self.push_allowed:
            self.remote.push(self.local)


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    backend = get_backend(spec["backend"], get_settings())
    try:
        if spec["role"] == "describe":
            return {"ok": True, "data": backend.describe().model_dump()}
        task = get_task(spec["task"])
        if spec["role"] == "accelerator":
            backend.prepare_process()
            runtime = backend.describe()  # the versions that really run
            cache = SharedCompileCache(backend, runtime.compiler_name, runtime.compiler_version, spec["rank"])
            data = task.accelerator(spec, backend)
            data["compile_cache"] = backend.cache_outcome(cache.new_entries())
            cache.push()
            data["runtime"] = runtime.model_dump()
        else:
            data = task.reference(spec, backend)
        return {"ok": True, "data": data}
    except RunFailure as failure:
        return {
            "ok": False,
            "error_class": failure.error_class.value,
            "message": failure.message,
            "traceback": failure.trace,
        }
    except Exception as exc:
        return {
            "ok": False,
            "error_class": ErrorClass.internal.value,
            "message": f"{type(exc).__name__}: {exc}"[:4000],
            "traceback": traceback.format_exc(),
        }


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    outcome = execute(spec)
    out = Path(spec["out"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(outcome))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

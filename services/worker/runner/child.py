"""One runner child process: `python -m services.worker.runner.child SPEC.json`.

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

from services.worker.runner.backends import get_backend
from services.worker.runner.failures import RunFailure
from services.worker.runner.tasks import get_task
from shared.enums import ErrorClass
from shared.settings import get_settings


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    backend = get_backend(spec["backend"], get_settings())
    try:
        if spec["role"] == "describe":
            return {"ok": True, "data": backend.describe().model_dump()}
        task = get_task(spec["task"])
        if spec["role"] == "accelerator":
            backend.prepare_process()
            data = task.accelerator(spec, backend)
            data["runtime"] = backend.describe().model_dump()  # the versions that really ran
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

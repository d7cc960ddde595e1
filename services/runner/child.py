"""One runner child process: `python -m services.runner.child SPEC.json`.

Runs one role (the accelerator run or one of its ranks, the CPU reference, or describe) and writes its
``ChildOutcome`` to the path the spec names. A crash leaves no file, which the launcher reports with the
exit signal.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from pydantic import BaseModel

from services.runner.backends import Backend, get_backend
from services.runner.compile_cache import local_cache_dir, namespace, remote_for
from services.runner.failures import RunFailure
from services.runner.measure import graphs_compiled
from services.runner.specs import AcceleratorSpec, AnySpec, ChildOutcome, DescribeSpec, SpecFile
from services.runner.tasks import get_task
from shared.contracts.enums import ErrorClass
from shared.settings import get_runner_settings


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

    def push(self) -> None:
        if self.remote is not None and self.push_allowed:
            self.remote.push(self.local)


def join_process_group(backend: Backend) -> None:
    """This rank's process group, with the backend's collective (RANK, WORLD_SIZE, MASTER_* from the launcher),
    before transformers loads the model: it uses a group it finds, where it would pick one by device type."""
    import torch

    torch.distributed.init_process_group(backend=backend.collective)


def run_role(spec: AnySpec) -> BaseModel:
    backend = get_backend(spec.backend, get_runner_settings())
    if isinstance(spec, DescribeSpec):
        return backend.describe()
    task = get_task(spec.task)
    if isinstance(spec, AcceleratorSpec):
        backend.prepare_process()
        runtime = backend.describe()  # the versions that really run
        cache = SharedCompileCache(backend, runtime.compiler_name, runtime.compiler_build, spec.rank)
        if spec.world_size > 1:
            join_process_group(backend)
        data = task.accelerator(spec, backend)
        backend.cache_lookups().into(data.resources)
        data.resources.graphs_compiled = graphs_compiled()
        cache.push()
        data.runtime = runtime
        return data
    return task.reference(spec, backend)


def execute(spec: AnySpec) -> ChildOutcome:
    try:
        return ChildOutcome(ok=True, data=run_role(spec).model_dump(mode="json"))
    except RunFailure as failure:
        outcome = ChildOutcome(
            ok=False, error_class=failure.error_class, message=failure.message, traceback=failure.trace
        )
    except Exception as exc:
        outcome = ChildOutcome(
            ok=False,
            error_class=ErrorClass.internal,
            message=f"{type(exc).__name__}: {exc}"[:4000],
            traceback=traceback.format_exc(),
        )
    if isinstance(spec, AcceleratorSpec):
        outcome.graphs_compiled = graphs_compiled()  # how far the compiler got: many for a recompiling model
    return outcome


def main(argv: list[str]) -> int:
    spec = SpecFile.model_validate_json(Path(argv[1]).read_text()).spec
    outcome = execute(spec)
    tmp = spec.out.with_suffix(".tmp")
    tmp.write_text(outcome.model_dump_json())
    os.replace(tmp, spec.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Turning what went wrong in a runner process into an error class and a message, and into a stage's report."""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from shared.contracts.enums import ErrorClass, Verdict
from shared.contracts.report import Failure, Performance, Provenance, RunReport, Subject
from shared.contracts.run import RunRequest
from shared.results.signatures import error_signature, module_of

_OOM_MARKERS = ("out of memory", "outofmemory", "cannot allocate memory", "failed to allocate")
_COMPILE_ID = re.compile(r"^\d+/(\d+):\s*")  # a guard failure's "frame/compile:" prefix
_RECOMPILE_LIMIT = "Dynamo recompile limit exceeded"  # the gb_type dynamo gives the limit it hit


class RunFailure(Exception):
    """A failure with its class, raised out of a phase and written into the report.

    ``origin`` names the child (role or rank) it happened in when the launcher re-raises a child's failure;
    its message then starts with ``"{origin}: "``. ``graphs_compiled`` is what the compiler had built in
    that child by then (None when unknown: not an accelerator child, or killed before it could say).
    """

    def __init__(
        self,
        error_class: ErrorClass,
        message: str,
        trace: str = "",
        *,
        origin: str = "",
        graphs_compiled: int | None = None,
    ) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.message = message
        self.trace = trace
        self.origin = origin
        self.graphs_compiled = graphs_compiled

    @property
    def cause(self) -> str:
        """The message without the child's name: one failure reads the same on every rank."""
        return self.message.removeprefix(f"{self.origin}: ") if self.origin else self.message


def classify(exc: BaseException, phase: ErrorClass) -> ErrorClass:
    """The class of ``exc`` raised during ``phase`` (load, compile or runtime).

    The first call both compiles and runs: only the compiler's own errors are compile errors — in either
    call, since a recompile (the second call meeting a failed guard) is the compiler's too. A recompile
    limit hit under fullgraph=True (FailOnRecompileLimitHit, which is not a TorchDynamoException) and a
    graph break (Unsupported) are the compiler's.
    """
    text = f"{type(exc).__name__} {exc}".lower()
    if isinstance(exc, MemoryError) or any(m in text for m in _OOM_MARKERS):
        return ErrorClass.oom
    if phase in (ErrorClass.compile, ErrorClass.runtime) and _is_compiler_error(exc):
        return ErrorClass.compile
    if phase == ErrorClass.compile:
        return ErrorClass.runtime
    return phase


def _is_compiler_error(exc: BaseException) -> bool:
    try:
        from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
    except ImportError:
        return False
    return isinstance(exc, TorchDynamoException | FailOnRecompileLimitHit)


def describe(exc: BaseException) -> str:
    """``Type: message``; for what the compiler refuses, the reason named on the first line (a recompile
    limit, a graph break, a backend compiler's own error) and dynamo's own text after it."""
    reason = compile_reason(exc)
    head = f"{type(exc).__name__}: "
    return (head + (f"{reason}\n{exc}" if reason else str(exc)))[:4000]


def compile_reason(exc: BaseException) -> str | None:
    """The reason a compile failed, in one line; None for anything that is not the compiler's refusal."""
    try:
        from torch._dynamo import exc as dynamo
    except ImportError:
        return None
    cause = exc.__cause__
    if isinstance(exc, dynamo.FailOnRecompileLimitHit) or _gb_type(exc) == _RECOMPILE_LIMIT:
        return _recompile_limit_reason(exc if cause is None else cause)
    if isinstance(exc, dynamo.RecompileError):
        return f"recompiled where recompiling is refused: {_first_line(exc)}"
    if isinstance(exc, dynamo.Unsupported):
        where = _user_frame(exc)
        return f"graph break under fullgraph=True: {_gb_type(exc) or _first_line(exc)}" + (
            f" (in {where})" if where else ""
        )
    if isinstance(exc, dynamo.BackendCompilerFailed):
        inner = exc.inner_exception
        return f"the {exc.backend_name} compiler failed: {type(inner).__name__}: {_first_line(inner)}"
    return None


def _recompile_limit_reason(exc: BaseException) -> str:
    import torch._dynamo.config as config
    from torch._dynamo.utils import guard_failures

    from services.runner.measure import graphs_compiled

    found = re.search(r"Limit type: (\w+)", str(exc))
    limit_type = found.group(1) if found else "recompile_limit"
    # Each recompile lists why every cached graph of the function failed its guards: the newest graph's
    # reason (the highest compile id) is the guard that keeps failing.
    failures = max(guard_failures.values(), key=len, default=[])
    newest = _COMPILE_ID.sub("", str(max(failures, key=_compile_index, default="")).split("\n", 1)[0])
    # "expression    # source line  # path.py:123 in function"
    parts = [p.strip() for p in re.split(r"\s+#\s+", newest)]
    guard = parts[0] + (f" at {parts[-1]}" if len(parts) > 1 else "")
    return (
        f"recompile limit hit: dynamo compiled {graphs_compiled()} graphs ({limit_type} "
        f"{getattr(config, limit_type, '?')}) for a guarded value that changes at every call, such as every "
        f"decode step" + (f": {guard}" if guard else "")
    )


def _compile_index(reason: object) -> int:
    found = _COMPILE_ID.match(str(reason))
    return int(found.group(1)) if found else -1


def _gb_type(exc: BaseException) -> str | None:
    return getattr(exc, "gb_type", None)


def _first_line(exc: BaseException) -> str:
    return next((s.strip() for s in str(exc).splitlines() if s.strip()), "")


def _user_frame(exc: BaseException) -> str | None:
    """Where in the traced code dynamo stopped: the innermost frame of its user stack."""
    stack = getattr(exc, "real_stack", None)
    if not stack:
        return None
    frame = stack[-1]
    return f"{module_of(frame.filename) or frame.filename}:{frame.name}"


@contextmanager
def phase(error_class: ErrorClass) -> Iterator[None]:
    try:
        yield
    except RunFailure:
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise RunFailure(classify(exc, error_class), describe(exc), traceback.format_exc()) from exc


def stage_report(request: RunRequest, backend: str, host: str | None) -> RunReport:
    """The report a stage starts from, filled in as it gets further: what it runs (the request's model, commit and
    task, on ``backend``) and where (``host``, the request's core range)."""
    return RunReport(
        subject=Subject(model_id=request.model_id, revision=request.revision, task=request.task, backend=backend),
        provenance=Provenance(host=host, core_range=request.core_range),
    )


def failure_report(
    report: RunReport, failure: RunFailure, verdict: Verdict = Verdict.ERROR, prefix: str = ""
) -> RunReport:
    """The report of a stage that ended with ``failure``: its class, message and (ERROR) signature, and the
    graphs the accelerator's compiler built when the failure says and the report does not already."""
    ended = Failure(error_class=failure.error_class, error_message=prefix + failure.message)
    if verdict == Verdict.ERROR:
        signature = error_signature(failure.error_class, prefix + failure.cause, failure.trace, report.subject.model_id)
        ended = ended.model_copy(update={"failure_signature": signature.text, "signature_id": signature.id})
    resources = report.resources
    if resources.graphs_compiled is None:
        resources = resources.model_copy(update={"graphs_compiled": failure.graphs_compiled})
    # a run that did not end in a verdict has no speed to report (a PASS's alone is kept)
    update = {"verdict": verdict, "failure": ended, "resources": resources, "performance": Performance()}
    return report.model_copy(update=update)

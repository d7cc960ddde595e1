"""Turning what went wrong in a runner process into an error class and a message."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from shared.enums import ErrorClass

_OOM_MARKERS = ("out of memory", "outofmemory", "cannot allocate memory", "failed to allocate")


class RunFailure(Exception):
    """A failure with its class, raised out of a phase and written into the report."""

    def __init__(self, error_class: ErrorClass, message: str, trace: str = "") -> None:
        super().__init__(message)
        self.error_class = error_class
        self.message = message
        self.trace = trace


def classify(exc: BaseException, phase: ErrorClass) -> ErrorClass:
    """The class of ``exc`` raised during ``phase`` (load, compile or runtime)."""
    text = f"{type(exc).__name__} {exc}".lower()
    if isinstance(exc, MemoryError) or any(m in text for m in _OOM_MARKERS):
        return ErrorClass.oom
    if phase == ErrorClass.compile and not _is_compiler_error(exc):
        # The first call both compiles and runs: only the compiler's own errors are compile errors.
        return ErrorClass.runtime
    return phase


def _is_compiler_error(exc: BaseException) -> bool:
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:
        return False
    return isinstance(exc, TorchDynamoException)


@contextmanager
def phase(error_class: ErrorClass) -> Iterator[None]:
    try:
        yield
    except RunFailure:
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise RunFailure(
            classify(exc, error_class), f"{type(exc).__name__}: {exc}"[:4000], traceback.format_exc()
        ) from exc

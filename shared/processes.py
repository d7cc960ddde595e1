"""Small facts about child processes, shared by the worker (which starts runners) and the runner."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, Protocol

from shared.contracts.handoffs import read_regular

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
OUTPUT_TAIL_CHARS = 3000


def describe_exit(returncode: int) -> str:
    """'killed by SIGSEGV' for a negative return code, 'exit status 3' otherwise."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (the kernel's OOM killer sends this too)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exit status {returncode}"


def die_with_parent() -> None:
    """Run in a child between fork and exec: the kernel sends it SIGKILL when its parent exits.

    A parent that died before the signal was asked for has already re-parented the child: it exits then.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)


def no_new_privileges() -> None:
    """Run in a runner before its module: nothing it or its children execute gains a privilege — no setuid or setgid
    binary, no file capability (prctl PR_SET_NO_NEW_PRIVS: inherited by every child, never undone). A root
    process may still take a user of its own (setuid is not an exec). Raises OSError."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


class ChildProcess(Protocol):
    """What callers use of a process they started: ``subprocess.Popen``, or one forked without a new interpreter
    (``shared.zygote_client.ForkedProcess``, ``services.worker.host.ForkedWorker``)."""

    pid: int
    returncode: int | None  # as Popen's: negative when killed by that signal

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


def run_as_child(main: Callable[[], object]) -> NoReturn:
    """In a process forked without exec: run ``main`` as an interpreter runs a script — a SystemExit's code or an
    uncaught exception's traceback and status 1, then the exit hooks — and end the process there, never
    returning into the code that forked it."""
    code = 1
    try:
        try:
            returned = main()
            code = returned if isinstance(returned, int) else 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
        atexit._run_exitfuncs()
        logging.shutdown()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream must not keep the process from ending
                stream.flush()
        os._exit(code)


def output_tail(log: Path) -> str:
    """The end of a child's captured output, for an error message about it (the row's, which anyone reads): never
    through a link planted at the log's name (``read_regular``)."""
    try:
        return read_regular(log).decode(errors="replace")[-OUTPUT_TAIL_CHARS:]
    except OSError as exc:
        return f"(its log {log} could not be read: {exc.strerror or exc})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

"""Small facts about child processes, shared by the worker (which starts runners) and the runner."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
from pathlib import Path

PR_SET_PDEATHSIG = 1
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


def output_tail(log: Path) -> str:
    """The end of a child's captured output, for an error message about it."""
    return log.read_text(errors="replace")[-OUTPUT_TAIL_CHARS:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

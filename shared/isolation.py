"""Runners under users of their own: what a model's code can reach.

A runner runs a model's code — transformers' always, and for an allow-listed org's ``trust_remote_code`` repo
the repo's own ``*.py``. The worker and the API hold what such code must never touch: the database's and the
Hub's credentials in their environments, the SQLite file, and the compile cache that every later run loads
(inductor's entries are code). So when the worker runs as root, each runner runs as a user of its own,
created by ``scripts/setup.sh`` and the images:

- ``SUPPORTMATRIX_RUNNER_USER`` (``supportmatrix-runner``) runs transformers' code. It owns the shared compile
  cache, its home (``<data dir>/home/<user>``), its Hub cache (``$HF_HOME/<user>`` where HF_HOME is set, else its
  home's) and the artifacts of its job.
- ``SUPPORTMATRIX_SANDBOX_USER`` (``supportmatrix-sandbox``) runs a repo's own code. It owns nothing shared: its
  run's compile cache, Hub cache and home are directories of its job's artifacts (``Sandbox``), never pulled
  into, never pushed from, read by no other run, and removed when the job's row is written.

Neither can read another user's ``/proc/<pid>/environ`` (the worker's, the API's, the zygote's), the
database file (0600, the worker's), or the secrets file the worker hands a forked runner (read while the
child is still root, before it takes its user). A worker that is not root cannot switch users: its runners
run as it does, with its access (``isolation`` is None), and the worker says so when it starts.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from shared.settings import Settings


class RunAs(BaseModel):
    """The user a runner process runs as (it crosses into the zygote with a fork request)."""

    name: str
    uid: int
    gid: int

    @classmethod
    def named(cls, name: str) -> RunAs:
        entry = pwd.getpwnam(name)  # KeyError: no such user
        return cls(name=name, uid=entry.pw_uid, gid=entry.pw_gid)


class IsolationUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Isolation:
    runner: RunAs  # transformers' code
    sandbox: RunAs  # a repo's own code

    def user_for(self, runs_repo_code: bool) -> RunAs:
        return self.sandbox if runs_repo_code else self.runner


def isolation(settings: Settings) -> Isolation | None:
    """The runners' users; None when runners run as the worker: it is not root (it cannot switch users), or
    SUPPORTMATRIX_RUNNER_USER is empty. Raises IsolationUnavailable when a named user does not exist."""
    if os.geteuid() != 0 or not settings.runner_user:
        return None
    try:
        return Isolation(RunAs.named(settings.runner_user), RunAs.named(settings.sandbox_user))
    except KeyError as exc:
        raise IsolationUnavailable(
            f"the runner user {exc} does not exist: create the runner users with scripts/setup.sh (as root), or "
            "set SUPPORTMATRIX_RUNNER_USER= to run runners as the worker's own user, with its access"
        ) from exc


def give(path: Path, user: RunAs) -> None:
    """``path`` (a directory, created when missing) and all under it owned by ``user``: only entries owned by
    someone else are changed, so a second call walks without writing."""
    path.mkdir(parents=True, exist_ok=True)
    for entry in (path, *path.rglob("*")):
        stat = entry.lstat()
        if (stat.st_uid, stat.st_gid) != (user.uid, user.gid):
            os.lchown(entry, user.uid, user.gid)


def prepare(settings: Settings) -> str:
    """At a worker's start: the shared directories runners write, given to the runner user; says who runs them.
    Raises IsolationUnavailable when the users are named but missing."""
    users = isolation(settings)
    if users is None:
        why = "the worker is not root" if os.geteuid() != 0 else "SUPPORTMATRIX_RUNNER_USER is empty"
        return f"runners run as this worker's user, with its access ({why}): repo code is not isolated"
    shared = [settings.cache_path, settings.runner_home]
    if settings.runner_hub_home is not None:  # the runners' Hub cache, where the operator placed HF_HOME
        shared.append(settings.runner_hub_home)
    for path in shared:
        give(path, users.runner)
    artifacts = settings.data_dir / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    for user in (users.runner, users.sandbox):
        _check_reaches(user, artifacts)
    return f"runners run as {users.runner.name}, a repo's own code as {users.sandbox.name}"


# Exits 3 when the directory cannot be entered: the interpreter started and imported the project.
REACH_PROBE = "import os, sys, shared.contracts; sys.exit(0 if os.access(sys.argv[1], os.X_OK) else 3)"


def _check_reaches(user: RunAs, artifacts: Path) -> None:
    """``user`` can start this interpreter, import the project and enter the artifacts directory — else each of
    its runners would fail at its start. Where not, the usual cause is a directory above the interpreter, the
    checkout or the data dir that only its owner may enter (a venv made from a Python under /root, a data dir
    under pytest's or a user's private tmp)."""
    probe = [sys.executable, "-c", REACH_PROBE, str(artifacts)]
    try:
        subprocess.run(probe, user=user.uid, group=user.gid, extra_groups=[], check=True, capture_output=True,
                       cwd="/", timeout=120)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        if isinstance(exc, subprocess.CalledProcessError) and exc.returncode == 3:
            why = f"cannot enter {artifacts}"
        else:
            stderr = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip()[-300:]
            said = f"{type(exc).__name__}: {exc}" + (f"; {stderr}" if stderr else "")
            why = f"cannot run {sys.executable} with this project ({said})"
        raise IsolationUnavailable(
            f"the runner user {user.name} {why}: every directory above the interpreter, the checkout and the data dir "
            "must be searchable by others (o+x; scripts/setup.sh sees to the first two), or set "
            "SUPPORTMATRIX_RUNNER_USER= to run runners as the worker's user, with its access"
        ) from exc


@dataclass(frozen=True)
class Sandbox:
    """The private directories of a run of a repo's own code, under its job's artifacts."""

    root: Path

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def hub_home(self) -> Path:
        return self.root / "hf-home"

    @property
    def home(self) -> Path:
        return self.root / "home"

    def create(self, user: RunAs | None) -> None:
        for path in (self.cache, self.hub_home, self.home):
            path.mkdir(parents=True, exist_ok=True)
        if user is not None:
            give(self.root, user)

    def environment(self) -> dict[str, str]:
        """What the run's runner is given instead of the shared directories; no compile-cache remote."""
        return {
            "SUPPORTMATRIX_CACHE_DIR": str(self.cache),
            "SUPPORTMATRIX_COMPILE_CACHE_REMOTE": "",
            "SUPPORTMATRIX_COMPILE_CACHE_PUSH": "false",
            "HF_HOME": str(self.hub_home),
            "HOME": str(self.home),
        }

"""Runners under users of their own: what a model's code can reach.

A runner runs a model's code — transformers' always, and for an allow-listed org's ``trust_remote_code`` repo
the repo's own ``*.py``. The worker and the API hold what such code must never touch: the database's and the
Hub's credentials in their environments, the SQLite file, and the compile cache that every later run loads
(inductor's entries are code). So when the worker runs as root, each runner runs as a user of its own,
created by ``scripts/setup.sh`` and the images:

- ``SUPPORTMATRIX_RUNNER_USER`` (``supportmatrix-runner``) runs transformers' code. It owns the shared compile
  cache, its home (``<data dir>/home/<user>``), its Hub cache (``$HF_HOME/<user>`` where HF_HOME is set, else its
  home's) and the artifacts of its job.
- a repo's own code runs as a uid of its job's own (``Isolation.sandbox_for``: from ``SUPPORTMATRIX_SANDBOX_UIDS``,
  with no account, its gid the same number), so no two jobs' repo code share a user. It owns nothing shared: its
  run's compile cache, Hub cache and home are directories of its job's artifacts (``Sandbox``), never pulled
  into, never pushed from, read by no other user's run (the runner user's, another sandboxed job's: the job's
  directory is 0700 while its repo code runs), and removed when the job's row is written.

Neither can read another user's ``/proc/<pid>/environ`` (the worker's, the API's, the zygote's), the
database file (0600, the worker's), or the secrets file the worker hands a forked runner (read while the
child is still root, before it takes its user). Each stage's runner has a work directory (``WorkDir``: its TMPDIR
and TorchNeuron's debug directory), 0700 and its user's: the runner user's runs cannot read a sandboxed job's, nor
a sandboxed job's runs the runner user's or another sandboxed job's (another uid), nor any other user either.
Runs of the runner user (transformers' code, which we trust) share its uid.

A run of a repo's own code never holds the Hub token *when runners are isolated* (a root worker, runner users
on): the worker downloads a gated repo's files for it, into a directory of its own that no runner user can reach
(``DownloadStaging``), and hands them over when the download has ended. A worker that is not root cannot switch
users: its runners run as it does, with its access (``isolation`` is None), and the worker says so when it
starts; such code could read the worker's own environment, so a gated repo with code of its own is not run there
(SKIPPED, services/worker/supervise.py).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from shared.settings import Settings

# Opens a directory by descriptor, refusing a symbolic link at its name: how every directory of a job (its user's) is
# entered by the worker.
OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


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
    sandbox_uids: range  # a repo's own code: one uid of these per job

    def sandbox_for(self, job_id: int) -> RunAs:
        """The user a job's repo code runs as: a uid of the range by the job's id, with no account (its gid the same
        number). Two jobs share one only when their ids are the range's length apart, never two jobs at once."""
        uid = self.sandbox_uids[job_id % len(self.sandbox_uids)]
        return RunAs(name=f"sandbox-{uid}", uid=uid, gid=uid)

    def user_for(self, runs_repo_code: bool, job_id: int) -> RunAs:
        return self.sandbox_for(job_id) if runs_repo_code else self.runner


def isolation(settings: Settings) -> Isolation | None:
    """The runners' users; None when runners run as the worker: it is not root (it cannot switch users), or
    SUPPORTMATRIX_RUNNER_USER is empty. Raises IsolationUnavailable when the runner user does not exist."""
    if os.geteuid() != 0 or not settings.runner_user:
        return None
    try:
        return Isolation(RunAs.named(settings.runner_user), settings.sandbox_uid_range)
    except KeyError as exc:
        raise IsolationUnavailable(
            f"the runner user {exc} does not exist: create the runner users with scripts/setup.sh (as root), or "
            "set SUPPORTMATRIX_RUNNER_USER= to run runners as the worker's own user, with its access"
        ) from exc


def give(path: Path, user: RunAs) -> None:
    """``path`` (a directory, created when missing) and all under it owned by ``user``, without following a
    symbolic link anywhere (``os.fwalk`` walks by file descriptors: an entry swapped for a link while it walks is
    not followed; a link itself gets the owner). Only entries owned by someone else are changed, so a second call
    walks without writing."""
    path.mkdir(parents=True, exist_ok=True)
    for _, dirs, files, fd in os.fwalk(path, follow_symlinks=False):
        if not _owned_by(os.fstat(fd), user):
            os.fchown(fd, user.uid, user.gid)
        for name in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):  # gone since it was listed
                if not _owned_by(os.stat(name, dir_fd=fd, follow_symlinks=False), user):
                    os.chown(name, user.uid, user.gid, dir_fd=fd, follow_symlinks=False)


def make_private(directory: Path) -> None:
    """``directory`` 0700, through its own descriptor: a link planted in its place (by a process of the user it
    belongs to) is refused (OSError), never followed."""
    fd = os.open(directory, OPEN_DIRECTORY)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _owned_by(entry: os.stat_result, user: RunAs) -> bool:
    return (entry.st_uid, entry.st_gid) == (user.uid, user.gid)


def prepare(settings: Settings) -> str:
    """At a worker's start: the shared directories runners write, given to the runner user; says who runs them.
    Raises IsolationUnavailable when the users are named but missing."""
    users = isolation(settings)
    if users is None:
        why = "the worker is not root" if os.geteuid() != 0 else "SUPPORTMATRIX_RUNNER_USER is empty"
        return (
            f"runners run as this worker's user, with its access ({why}): repo code is not isolated, and a gated "
            "repo with code of its own is not run (SKIPPED: its code could read this worker's Hub token)"
        )
    shared = [settings.cache_path, settings.runner_home]
    if settings.runner_hub_home is not None:  # the runners' Hub cache, where the operator placed HF_HOME
        shared.append(settings.runner_hub_home)
    for path in shared:
        give(path.resolve(), users.runner)  # the operator's paths: a link placed there (a bigger disk) is meant
    held = sorted(entry.pw_name for entry in pwd.getpwall() if entry.pw_uid in users.sandbox_uids)
    if held:
        raise IsolationUnavailable(
            f"SUPPORTMATRIX_SANDBOX_UIDS={settings.sandbox_uids} holds the uids of accounts {held}: a repo's code run "
            "as one would be that account; choose a range no account holds"
        )
    artifacts = settings.data_dir / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    for user in (users.runner, users.sandbox_for(0)):
        _check_reaches(user, artifacts)
    return f"runners run as {users.runner.name}, a repo's own code as a uid of its job's own ({settings.sandbox_uids})"


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

    @classmethod
    def of_job(cls, artifacts: Path) -> Sandbox:
        return cls(artifacts / "sandbox")

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
        """The sandbox and its directories, made where missing, in its job's directory — the job's sandbox uid's
        since its first stage, so a link or file planted at any of their names is removed, never followed: each is
        made and opened relative to its parent's descriptor (O_NOFOLLOW). Raises OSError."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        job_fd = os.open(self.root.parent, OPEN_DIRECTORY)  # the job's directory, in the worker's artifacts directory
        try:
            root_fd = _directory_at(job_fd, self.root.name)
            try:
                for path in (self.cache, self.hub_home, self.home):
                    os.close(_directory_at(root_fd, path.name))
            finally:
                os.close(root_fd)
        finally:
            os.close(job_fd)
        if user is not None:
            give(self.root, user)
            make_private(self.root)  # its job's repo code's alone

    def environment(self, user: RunAs | None) -> dict[str, str]:
        """What the run's runner is given instead of the shared directories; no compile-cache remote. Its uid has
        no account, so its name is in USER and LOGNAME, where getpass and the tools that name a user look first."""
        named = {"USER": user.name, "LOGNAME": user.name} if user is not None else {}
        return {
            **named,
            "SUPPORTMATRIX_CACHE_DIR": str(self.cache),
            "SUPPORTMATRIX_COMPILE_CACHE_REMOTE": "",
            "SUPPORTMATRIX_COMPILE_CACHE_PUSH": "false",
            "HF_HOME": str(self.hub_home),
            "HOME": str(self.home),
        }


@dataclass(frozen=True)
class WorkDir:
    """The work directory of one stage's runner, under its job's artifacts: its ``TMPDIR`` (Python's tempfile and
    the tools that honour TMPDIR put their scratch files there) and TorchNeuron's debug directory
    (``TORCH_NEURONX_DEBUG_DIR``: the FX graphs, StableHLO and NEFFs of what it compiles). TorchNeuron's default,
    ``/tmp/neuron_backend``, is one directory for every user of the host: the first run to create it owns it, and
    any later run of any user reads the graphs left there. This one is 0700 and its run's user's: private to that
    user (the runner user, or the job's sandbox uid) against every other user, not against another run of the same
    user. The worker keeps it with a FAIL's (or an ERROR's) artifacts, else removes it when the stage ends."""

    path: Path

    @classmethod
    def of_stage(cls, artifacts: Path, stage: str) -> WorkDir:
        return cls(artifacts / f"work-{stage}")

    @property
    def neuron_debug(self) -> Path:
        return self.path / "neuron_backend"

    def create(self, user: RunAs | None) -> None:
        """A fresh, empty directory, 0700, owned by ``user`` (None: this process's own user, a worker that runs its
        runners as itself). Whatever is at its path first — a lost attempt's directory, or a file or symbolic link
        a process of the job's user planted there — is removed, never followed; the mode and owner are set through
        the new directory's own descriptor (O_NOFOLLOW), so a swap after the mkdir changes nothing outside it.
        Raises OSError (a full disk, an entry that cannot be removed)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            planted = self.path.lstat()
        except FileNotFoundError:
            planted = None
        if planted is not None and stat.S_ISDIR(planted.st_mode):
            shutil.rmtree(self.path)  # refuses a symbolic link; a directory's own links are removed, not followed
        elif planted is not None:
            self.path.unlink()
        self.path.mkdir(mode=0o700)
        fd = os.open(self.path, OPEN_DIRECTORY)
        try:
            os.fchmod(fd, 0o700)  # mkdir's mode is masked by the umask; this is not
            if user is not None:
                os.fchown(fd, user.uid, user.gid)
        finally:
            os.close(fd)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def environment(self) -> dict[str, str]:
        """What the stage's runner and its children are given (both are per-child variables: a runner forked from
        the zygote may have them)."""
        return {"TMPDIR": str(self.path), "TORCH_NEURONX_DEBUG_DIR": str(self.neuron_debug)}


class UnsafeStagingParent(OSError):
    """The directory meant to hold downloads' staging is not this process's user's alone."""


@dataclass(frozen=True)
class DownloadStaging:
    """Where the worker (root) downloads a gated repo for a run of its code: a fresh directory, 0700 and this
    process's, in a parent that is too (``<artifacts>/.downloads``, beside the job directories that are given to
    the runner users, on their filesystem), so that no runner user's process can reach it while the download runs:
    none can plant a symbolic link for the download to write through. When the download has ended (its process
    group gone), ``hand_over`` gives the files to the run's user and moves them into the job's directory, through
    directory descriptors opened without following links."""

    root: Path

    @classmethod
    def create(cls, artifacts_dir: Path, prefix: str) -> DownloadStaging:
        """A fresh staging in ``artifacts_dir/.downloads``; raises UnsafeStagingParent when that is a link or
        another user's (OSError otherwise: a full disk)."""
        parent = artifacts_dir / ".downloads"
        parent.mkdir(mode=0o700, exist_ok=True)
        held = parent.lstat()
        if not stat.S_ISDIR(held.st_mode) or held.st_uid != os.geteuid():
            raise UnsafeStagingParent(f"{parent} is not a directory of uid {os.geteuid()}")
        if held.st_mode & 0o077:
            os.chmod(parent, 0o700)  # a directory of ours (lstat: no link), in the artifacts directory (ours)
        return cls(Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=parent)))  # 0700, this process's

    @property
    def hub_home(self) -> Path:
        return self.root / "hf-home"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def log(self) -> Path:
        return self.root / "download.log"

    @property
    def report(self) -> Path:
        return self.root / "download-report.json"

    def environment(self) -> dict[str, str]:
        """The download's own directories, all in the staging: nothing of a runner user's is read or written by it
        (its HOME is not the sandbox's: Python would import the user site-packages found there)."""
        for path in (self.hub_home, self.home, self.cache):
            path.mkdir(exist_ok=True)
        return {"HF_HOME": str(self.hub_home), "HOME": str(self.home), "SUPPORTMATRIX_CACHE_DIR": str(self.cache)}

    def hand_over(self, job_dir: Path, sandbox: Sandbox, user: RunAs) -> None:
        """The downloaded Hub cache becomes ``sandbox``'s (``job_dir/sandbox/hf-home``), and the download's log and
        report (if any) ``job_dir``'s, all owned by ``user``. ``job_dir``'s parent is trusted (this process's); the
        job's directory and its sandbox are opened with O_NOFOLLOW and every move is relative to their descriptors,
        so a link planted in their place, or the job's user renaming them meanwhile, sends nothing elsewhere; an
        entry already at a destination (the empty Hub cache ``Sandbox.create`` made) is removed without following
        it. Raises OSError."""
        if sandbox.root.parent != job_dir or sandbox.hub_home.parent != sandbox.root:
            raise ValueError(f"{sandbox.root} is not {job_dir}'s sandbox")
        give(self.root, user)
        parent_fd = os.open(job_dir.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            job_fd = os.open(job_dir.name, OPEN_DIRECTORY, dir_fd=parent_fd)
            try:
                sandbox_fd = os.open(sandbox.root.name, OPEN_DIRECTORY, dir_fd=job_fd)
                try:
                    _replace(self.hub_home, sandbox_fd, sandbox.hub_home.name)
                finally:
                    os.close(sandbox_fd)
                for kept in (self.log, self.report):
                    if kept.exists():
                        _replace(kept, job_fd, kept.name)
            finally:
                os.close(job_fd)
        finally:
            os.close(parent_fd)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _directory_at(dir_fd: int, name: str) -> int:
    """The directory ``name`` in the one open at ``dir_fd``, made (0700) when missing; anything else there — a link, a
    file — is removed first, never followed. Returns its descriptor (O_NOFOLLOW: one swapped in meanwhile fails)."""
    try:
        held = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        held = None
    if held is not None and not stat.S_ISDIR(held.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        held = None
    if held is None:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    return os.open(name, OPEN_DIRECTORY, dir_fd=dir_fd)


def _replace(source: Path, dir_fd: int, name: str) -> None:
    """Move ``source`` to ``name`` in the directory open at ``dir_fd``, removing what is there first (a directory
    by descriptors, never following a link in it; anything else unlinked, a link itself not followed)."""
    try:
        there = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        there = None
    if there is not None and stat.S_ISDIR(there.st_mode) and source.is_dir():
        shutil.rmtree(name, dir_fd=dir_fd)
    elif there is not None and not stat.S_ISDIR(there.st_mode):
        os.unlink(name, dir_fd=dir_fd)
    os.rename(source, name, dst_dir_fd=dir_fd)

"""The host's zygote forks runners as a fresh interpreter would start them, and never what it must not.

A child here is ``services.runner.child`` reading its spec from a FIFO: it waits, alive and inspectable,
until the test writes the spec (a describe), then runs it and exits.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.runner.specs import ChildOutcome, DescribeSpec, SpecFile
from services.runner.zygote_server import Peer, child_user
from shared.isolation import RunAs
from shared.settings import child_environment, get_settings
from shared.zygote_client import (
    EXIT_UNKNOWN,
    ForkedProcess,
    ForkRequest,
    environment_mismatch,
    kill_group,
    socket_name,
    start_python,
    zygote_address,
)
from tests.conftest import start_zygote

CHILD = "services.runner.child"
ROOT = Path(__file__).resolve().parent.parent


def zygote_in(tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    """A zygote of its own for a test, at an address of its own under ``tmp``."""
    address = zygote_address(tmp, name)
    return start_zygote(address, tmp / f"{name}.log"), address


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    tmp = tmp_path_factory.mktemp("zygote")
    proc, address = zygote_in(tmp, "shared")
    yield proc, address, tmp
    proc.terminate()
    proc.wait(30)


def waiting_child(tmp: Path, name: str) -> tuple[Path, Path]:
    """A spec path that is a FIFO (the child blocks reading it) and the outcome path the spec will name."""
    fifo = tmp / f"{name}.spec.json"
    os.mkfifo(fifo)
    return fifo, tmp / f"{name}.out.json"


def release(fifo: Path, out: Path) -> None:
    fifo.write_text(SpecFile(spec=DescribeSpec(backend="cpu", out=out)).model_dump_json())


def test_a_forked_runner_gets_its_group_cpus_log_and_exit_status(zygote: tuple[object, str, Path]) -> None:
    zygote_proc, address, tmp = zygote
    fifo, out = waiting_child(tmp, "plain")
    log = tmp / "plain.log"
    env = child_environment(get_settings(), {})
    proc, refused = start_python(CHILD, [str(fifo)], env, log, own_group=True, cpus={0}, zygote=address)
    assert refused is None and isinstance(proc, ForkedProcess)
    assert os.getpgid(proc.pid) == proc.pid  # leads its own process group: one kill takes it and its ranks
    status = Path(f"/proc/{proc.pid}/status")
    assert status.read_text().count("Cpus_allowed_list:\t0\n") == 1
    # nothing it executes gains a privilege (a setuid binary, a capability): set by the child before its module, which
    # then waits on its spec
    deadline = time.monotonic() + 30
    while "NoNewPrivs:\t1\n" not in status.read_text():
        assert time.monotonic() < deadline, status.read_text()
        time.sleep(0.05)
    assert int(Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1].split()[1]) == zygote_proc.pid  # type: ignore[attr-defined]
    assert proc.poll() is None
    release(fifo, out)
    assert proc.wait(timeout=120) == 0
    outcome = ChildOutcome.model_validate_json(out.read_text())
    assert outcome.ok and outcome.data is not None and outcome.data["backend"] == "cpu"
    assert f"fork {proc.pid}: {CHILD}" in (tmp / "shared.log").read_text()


def test_a_link_planted_at_a_runners_log_is_replaced_never_followed(zygote: tuple[object, str, Path]) -> None:
    """The log's name is in the job's directory, its runner user's: a link planted there to a file only root writes
    is replaced by a fresh log, by the root zygote asked by the worker and by the worker starting a fresh
    interpreter; the link's target keeps what it held."""
    _, address, tmp = zygote
    victim = tmp / "root-only"
    victim.write_text("root's")
    victim.chmod(0o600)
    env = child_environment(get_settings(), {})
    fifo, out = waiting_child(tmp, "planted")
    forked_log, fresh_log = tmp / "planted-forked.log", tmp / "planted-fresh.log"
    for log in (forked_log, fresh_log):
        log.symlink_to(victim)
    forked, refused = start_python(CHILD, [str(fifo)], env, forked_log, own_group=True, zygote=address)
    assert refused is None and isinstance(forked, ForkedProcess)
    release(fifo, out)
    fresh, _ = start_python("platform", [], env, fresh_log, own_group=True)
    assert isinstance(fresh, subprocess.Popen) and fresh.wait(timeout=60) == 0 and forked.wait(timeout=120) == 0
    for log in (forked_log, fresh_log):
        assert not log.is_symlink() and stat.S_ISREG(log.lstat().st_mode)
    assert "Linux" in fresh_log.read_text()  # the fresh interpreter's output went to its own log
    assert victim.read_text() == "root's"


def test_a_foreign_environment_or_module_is_refused_and_started_afresh(zygote: tuple[object, str, Path]) -> None:
    """huggingface_hub read HF_ENDPOINT when the zygote imported it: a child told another would use the old one."""
    _, address, tmp = zygote
    env = child_environment(get_settings(), {})
    assert environment_mismatch(env, env | {"HF_TOKEN": "t", "RANK": "1", "NEURON_RT_VISIBLE_CORES": "0-1"}) is None
    fifo, out = waiting_child(tmp, "foreign")
    foreign = env | {"HF_ENDPOINT": "http://elsewhere.invalid"}
    proc, refused = start_python(CHILD, [str(fifo)], foreign, tmp / "foreign.log", own_group=True, zygote=address)
    assert isinstance(proc, subprocess.Popen) and refused is not None and "HF_ENDPOINT" in refused
    release(fifo, out)
    assert proc.wait(timeout=300) == 0
    proc, refused = start_python("services.worker", [], env, tmp / "worker.log", own_group=True, zygote=address)
    assert isinstance(proc, subprocess.Popen) and "not a runner module" in (refused or "")
    kill_group(proc)


def memory_holds(pid: int, needle: bytes) -> bool:
    """Whether any readable mapping of process ``pid`` holds ``needle`` (we are root: /proc/PID/mem reads)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if not perms.startswith("r"):
                continue
            for offset in range(start, end, 1 << 26):
                try:
                    mem.seek(offset)
                    chunk = mem.read(min(end - offset, (1 << 26) + len(needle)))
                except (OSError, ValueError, OverflowError):
                    break
                if needle in chunk:
                    return True
    return False


def test_a_secret_reaches_the_child_in_a_file_and_never_the_zygotes_memory(zygote: tuple[object, str, Path]) -> None:
    """Every later child is a copy of the zygote's memory: a token a request left there would reach a run of a
    repo's own code. The requester hands it over in a file of its own, which the child reads and removes."""
    zygote_proc, address, tmp = zygote
    token = f"hf_zygote_secret_{uuid.uuid4().hex}"
    fifo, out = waiting_child(tmp, "secret")
    env = child_environment(get_settings(), {}, {"HF_TOKEN": token})
    proc, _ = start_python(CHILD, [str(fifo)], env, tmp / "secret.log", own_group=True, zygote=address)
    assert isinstance(proc, ForkedProcess)
    deadline = time.monotonic() + 30
    while (tmp / "secret.log.secrets").exists():  # read by the child, then removed
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert memory_holds(proc.pid, f"HF_TOKEN={token}".encode())
    assert not memory_holds(zygote_proc.pid, token.encode())  # type: ignore[attr-defined]
    release(fifo, out)
    assert proc.wait(timeout=120) == 0


def asking_for(fifo: Path, log: Path, address: str) -> subprocess.Popen[bytes]:
    """A process that asks the zygote for a child waiting on ``fifo``, prints the child's pid and sleeps."""
    return subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom pathlib import Path\nfrom shared.settings import child_environment, get_settings\n"
         "from shared.zygote_client import start_python\n"
         f"proc, _ = start_python({CHILD!r}, [{str(fifo)!r}], child_environment(get_settings(), {{}}), "
         f"Path({str(log)!r}), own_group=True, zygote={address!r})\n"
         "print(proc.pid, flush=True)\ntime.sleep(600)"],
        cwd=ROOT, stdout=subprocess.PIPE,
    )  # fmt: skip


def gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_forked_child_dies_with_the_process_that_asked_for_it(zygote: tuple[object, str, Path]) -> None:
    """The worker killed outright takes its runner along (as a parent-death signal does for a fresh one)."""
    _, address, tmp = zygote
    fifo, _ = waiting_child(tmp, "orphan")
    asker = asking_for(fifo, tmp / "orphan.log", address)
    assert asker.stdout is not None
    pid = int(asker.stdout.readline())
    os.kill(pid, 0)  # alive, waiting on its FIFO
    asker.send_signal(signal.SIGKILL)
    asker.wait()
    assert gone(pid), "the orphaned child is still there"  # killed, and reaped by the zygote: no zombie stays
    # a requester gone before its answer: the zygote drops it and serves the next one
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as vanishing:
        vanishing.connect(socket_name(address))
        vanishing.sendall(b'{"module": "services.runner.child", "args": []')  # half a request, then gone
    fifo, out = waiting_child(tmp, "after")
    env = child_environment(get_settings(), {})
    proc, refused = start_python(CHILD, [str(fifo)], env, tmp / "after.log", own_group=True, zygote=address)
    assert refused is None
    release(fifo, out)
    assert proc.wait(timeout=120) == 0


def test_a_forked_child_dies_with_its_requester_even_when_the_zygote_dies_with_it(tmp_path: Path) -> None:
    """A launcher's whole process group SIGKILLed takes the worker and the zygote at once: nobody is left to see
    the requester's connection close, and the child goes by itself (it watches its requester)."""
    zygote_proc, address = zygote_in(tmp_path, "together")
    fifo, _ = waiting_child(tmp_path, "left")
    asker = asking_for(fifo, tmp_path / "left.log", address)
    assert asker.stdout is not None
    pid = int(asker.stdout.readline())
    os.kill(pid, 0)  # alive, waiting on its FIFO
    zygote_proc.kill()
    asker.kill()
    zygote_proc.wait()
    asker.wait()
    assert gone(pid), "the child outlived its requester and the zygote"


def test_a_timeout_kills_the_forked_group_and_a_dead_zygote_loses_only_the_status(tmp_path: Path) -> None:
    zygote_proc, address = zygote_in(tmp_path, "mortal")
    env = child_environment(get_settings(), {})
    fifo, _ = waiting_child(tmp_path, "hung")
    proc, _ = start_python(CHILD, [str(fifo)], env, tmp_path / "hung.log", own_group=True, zygote=address)
    kill_group(proc)  # what supervise does past the job's limit
    assert proc.returncode == -signal.SIGKILL
    fifo2, out2 = waiting_child(tmp_path, "outlives")
    proc, _ = start_python(CHILD, [str(fifo2)], env, tmp_path / "outlives.log", own_group=True, zygote=address)
    zygote_proc.terminate()
    zygote_proc.wait(30)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)  # the zygote is gone; its child is not
    release(fifo2, out2)
    assert proc.wait(timeout=120) == EXIT_UNKNOWN and ChildOutcome.model_validate_json(out2.read_text()).ok


def test_a_requester_of_another_user_gets_children_of_its_own_user_whatever_it_asks() -> None:
    """The user a root zygote's child takes (services.runner.zygote_server.child_user): the one the zygote's own
    user (the worker) names, or none; for any other requester (a runner asking for its ranks), that requester's
    own — a runner that asks for root, or for another runner's user, does not get it."""
    root = RunAs(name="root", uid=0, gid=0)
    sandbox = RunAs(name="sandbox-60101", uid=60101, gid=60101)
    asking = {"module": "services.runner.child", "args": [], "env": {}, "log": "/dev/null", "group": "new"}
    worker = Peer(os.getpid(), os.getuid(), os.getgid())
    assert child_user(ForkRequest(**asking, run_as=sandbox), worker) == sandbox
    assert child_user(ForkRequest(**asking), worker) is None  # the zygote's own user
    runner = Peer(1234, 999, 995)
    for asked in (root, sandbox, None):
        got = child_user(ForkRequest(**asking, run_as=asked), runner)
        assert got is not None and (got.uid, got.gid) == (runner.uid, runner.gid)
